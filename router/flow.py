"""The router's record of one request as it moves through the cluster, with explicit states and
pure transitions; router/generation.py does the I/O and asks this record what each message means.

A request's states, in order:
1. PLACING: reserving on a decode actor (and on a prefill actor when the prompt is prefilled
   remotely); again after each migration.
2. PREFILLING: a prefill actor computes the prompt; the request's next token is the one the
   prefill actor samples (ahead of its KV's arrival), not one from the decode actor. A failed
   remote prefill falls back to the decode actor's own prefill: STREAMING.
3. STREAMING: tokens come from the decode actor's output pump.
4. FINISHED: the last token went out with its usage.
A decode actor that dies (or fails the request) sends the request back to PLACING on another one,
from its prompt plus the tokens already streamed, at most `max_migrations` times; then FAILED.
A decode actor that offers it to move (draining, rebalancing) has it moved with its KV, STREAMING
all the while (router/moving.py: reserved elsewhere and pre-copied while it decodes, then handed
over once it pauses): the next decode actor continues from the last streamed token, nothing is
recomputed.
The request's first token is streamed, timed and logged once, whatever happens after.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field
from typing import Any

from tandem.wire.errors import MigrationsExhausted
from tandem.wire.messages import (FirstToken, OutputError, SamplingParams, SequenceMoving, SequencePaused, StepOutput,
                                  Usage, WorkerLostNotice)

Message = StepOutput | OutputError | WorkerLostNotice | SequenceMoving | SequencePaused


class FlowState(enum.Enum):
    PLACING = "placing"
    PREFILLING = "prefilling"
    STREAMING = "streaming"
    FINISHED = "finished"
    FAILED = "failed"


class Event(enum.Enum):
    """What a message from the cluster means for the request."""
    IGNORE = "ignore"    # another decode actor died: not ours
    MIGRATE = "migrate"  # our decode actor died or failed the request
    MOVE = "move"        # about a move with its KV: offered (or withdrawn), or its reservation failed
    MOVED = "moved"      # our decode actor paused it to move; its tail is on the way
    TOKENS = "tokens"    # new tokens to stream


@dataclass
class RequestFlow:
    request_id: str
    prompt: list[int]
    sampling: SamplingParams
    max_migrations: int = 2
    # the id its actors know it by (router/request_ids.py): unique in the cluster, whatever the
    # client sent as `request_id` (which is only echoed back); "": the request id
    cluster_id: str = ""
    deadline: float | None = None   # the client's, in time.monotonic() seconds; None: none
    state: FlowState = FlowState.PLACING
    out_ids: list[int] = field(default_factory=list)  # every token streamed so far
    migrations: int = 0
    lost: set[str] = field(default_factory=set)  # decode actors that died under it: not used again
    lost_actors: dict[str, str | None] = field(default_factory=dict)  # their Ray actor ids, by worker id
    failed_on: set[str] = field(default_factory=set)  # decode actors it failed on: used again only if no other can take it
    first_sent: bool = False      # the request's first token is out (TTFT recorded)
    # the prefill actor's first token, for the decode actor once it is streamed
    handover: FirstToken | None = None
    release_decode: bool = False  # that token ended the request: free the decode reservation
    injected: OutputError | None = None  # a failure the router saw itself (a refused handover)
    move: Any = None              # router/moving.PendingMove while another actor holds a reservation for it

    def __post_init__(self) -> None:
        self.cluster_id = self.cluster_id or self.request_id

    # ---- placing ----------------------------------------------------------------------------
    def placed(self, remote: bool) -> None:
        """A decode actor holds the request; a prefill actor computes it when `remote`."""
        self._expect(FlowState.PLACING)
        self.state = FlowState.PREFILLING if remote else FlowState.STREAMING

    def prefill_fell_back(self) -> None:
        """The remote prefill failed; the decode actor prefills the request itself."""
        self._expect(FlowState.PREFILLING)
        self.state = FlowState.STREAMING

    def continuation(self) -> tuple[list[int], SamplingParams]:
        """The prompt and sampling that continue the request from the tokens already streamed
        (greedy output is unchanged)."""
        left = max(1, self.sampling.max_tokens - len(self.out_ids))
        return self.prompt + self.out_ids, dataclasses.replace(self.sampling, max_tokens=left)

    # ---- messages ---------------------------------------------------------------------------
    def classify(self, msg: Message, decode_id: str) -> Event:
        if isinstance(msg, WorkerLostNotice):
            return Event.MIGRATE if msg.worker_id == decode_id else Event.IGNORE
        if isinstance(msg, SequencePaused):
            return Event.MOVED
        if isinstance(msg, SequenceMoving) or (isinstance(msg, OutputError) and self.move is not None
                                               and msg.request_id == self.move.request_id):
            return Event.MOVE
        if isinstance(msg, OutputError):
            return Event.MIGRATE
        return Event.TOKENS

    def migrate(self, msg: WorkerLostNotice | OutputError, decode_id: str) -> str:
        """Back to PLACING after `msg` about the decode actor `decode_id`; the reason, for metrics:
        "decode_lost" (it died: never placed on again) or "request_failed". Raises
        MigrationsExhausted past `max_migrations`."""
        if self.migrations >= self.max_migrations:
            self.state = FlowState.FAILED
            raise MigrationsExhausted(f"request failed after {self.migrations} migrations: {msg.error}")
        self.migrations += 1
        self.handover, self.injected = None, None
        self.state = FlowState.PLACING
        if isinstance(msg, WorkerLostNotice):
            self.lost.add(decode_id)
            return "decode_lost"
        self.failed_on.add(decode_id)     # a step error may be that actor's own (a sticky device error)
        return "request_failed"

    def moved_continuation(self, num_tokens: int, last: int | None = None) -> tuple[list[int], SamplingParams] | None:
        """The prompt and sampling of the request as it continues on another decode actor over its
        KV: every token so far but the last (the handoff, which counts as that actor's first output
        token). None when the sequence the decode actor moves (its KV covering `num_tokens`
        positions, `last` its last token when known) is not the one streamed (nothing to move)."""
        if self.state is not FlowState.STREAMING or not self.out_ids or last not in (None, self.out_ids[-1]) \
                or num_tokens != len(self.prompt) + len(self.out_ids) - 1:
            return None
        left = self.sampling.max_tokens - len(self.out_ids) + 1
        return self.prompt + self.out_ids[:-1], dataclasses.replace(self.sampling, max_tokens=left)

    def first_from_prefill(self, first: FirstToken, prefill_cached: int) -> StepOutput:
        """The prefill actor sampled the request's next token: stream it now. If it ends the
        request the decode actor is not needed; else the decode actor continues from it (`handover`,
        once it is out)."""
        self._expect(FlowState.PREFILLING)
        self.state = FlowState.STREAMING
        usage = None
        if first.finish_reason is not None:
            usage = Usage(prompt_tokens=len(self.prompt), cached_prompt_tokens=prefill_cached,
                          completion_tokens=1)
            self.release_decode = True
        else:
            self.handover = first
        logprobs = (first.logprob,) if first.logprob is not None else None
        return StepOutput(self.request_id, [first.token_id], first.text, first.finish_reason, usage, logprobs)

    def take(self, msg: StepOutput) -> bool:
        """Tokens out to the client; True when they carry the request's first token (once per
        request, migrations and second remote prefills included)."""
        self.out_ids.extend(msg.token_ids)
        first = not self.first_sent
        self.first_sent = True
        return first

    def finish(self, usage: Usage, prefill_cached: int) -> Usage:
        """FINISHED; the usage the client sees: the whole request's counts, whichever actors ran it."""
        self.state = FlowState.FINISHED
        n = len(self.prompt)
        return dataclasses.replace(usage, prompt_tokens=n, completion_tokens=len(self.out_ids),
                                   cached_prompt_tokens=min(n, max(usage.cached_prompt_tokens, prefill_cached)))

    def handover_refused(self, why: str) -> None:
        """The decode actor did not take the prefill's first token: the request moves on, as after
        its error."""
        self.injected = OutputError(self.request_id, f"the decode actor refused the first token: {why}")

    def take_injected(self) -> OutputError | None:
        msg, self.injected = self.injected, None
        return msg

    def _expect(self, state: FlowState) -> None:
        if self.state is not state:
            raise RuntimeError(f"request {self.request_id}: {state.value} expected, in {self.state.value}")
