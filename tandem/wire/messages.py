"""The messages that cross a process boundary between the router, the pool actors and the
controller, each defined once with named fields: what a router asks a worker (`PrefillReserve`,
`DecodeReserve`), what the worker answers (`PrefillReservation`, `DecodePlan`, `PrefillResult`),
the first output token a prefill actor hands over to a decode actor (`FirstToken`, through the
router), and what a decode actor streams to each router (`StepOutput`, `OutputError`; the router's
output pump adds `WorkerLostNotice` when the actor dies). All are plain dataclasses: Ray pickles
them, and every reader uses the same attribute names."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import Union

from tandem.wire.errors import InvalidRequestError

MAX_TOP_LOGPROBS = 20  # OpenAI's bound on top_logprobs
MAX_SPECULATIVE_TOKENS = 64  # draft tokens one request may ask to verify per step
MAX_PENALTY = 2.0  # OpenAI's bound on presence_penalty and frequency_penalty
MAX_REPETITION_PENALTY = 10.0  # a sanity bound: at 10 a repeated token's logit is a tenth


class FinishReason(enum.Enum):
    STOP = "stop"  # EOS or a stop string
    LENGTH = "length"  # max_tokens or the model's context
    ABORT = "abort"  # cancelled, deadline, or the request failed


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    # speculative decoding: the most draft tokens per step for this request (None: the engine's
    # setting, 0: never speculate); the engine's length policy may use fewer
    num_speculative_tokens: int | None = None
    # log-probabilities: None = off (costs nothing); n >= 0: each output token's logprob and the n
    # most likely tokens of the distribution it was drawn from (`TokenLogprob`)
    logprobs: int | None = None
    # penalties on what was said (`engine.penalties`): OpenAI's presence (subtracted from the logit
    # of each token already in the output) and frequency (times its count there), each in [-2, 2],
    # and vLLM's / transformers' repetition penalty (a logit of a token in the prompt or the output
    # divided by it when positive, multiplied when negative), > 0; 0, 0 and 1 are off
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise InvalidRequestError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if math.isnan(self.temperature) or self.temperature < 0:
            raise InvalidRequestError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if math.isnan(self.top_p) or not 0 < self.top_p <= 1:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise InvalidRequestError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if any(not s for s in self.stop):
            raise InvalidRequestError("stop strings must not be empty")
        k = self.num_speculative_tokens
        if k is not None and (not isinstance(k, int) or not 0 <= k <= MAX_SPECULATIVE_TOKENS):
            raise InvalidRequestError(f"num_speculative_tokens must be an integer in [0, {MAX_SPECULATIVE_TOKENS}] "
                                      f"(0 = off), got {k!r}")
        n = self.logprobs
        if n is not None and (not isinstance(n, int) or not 0 <= n <= MAX_TOP_LOGPROBS):
            raise InvalidRequestError(f"logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}], got {n!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not -MAX_PENALTY <= v <= MAX_PENALTY:  # NaN fails too
                raise InvalidRequestError(f"{name} must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}] (0 = off), got {v}")
        if not 0 < self.repetition_penalty <= MAX_REPETITION_PENALTY:
            raise InvalidRequestError(f"repetition_penalty must be in (0, {MAX_REPETITION_PENALTY:g}] (1 = off), "
                                      f"got {self.repetition_penalty}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        """Whether a penalty is on: the engine then needs the request's tokens on the host each step."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0


@dataclass
class Usage:
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    completion_tokens: int = 0
    draft_tokens: int = 0
    accepted_draft_tokens: int = 0
    draft_steps: int = 0  # decode steps that verified at least one draft


@dataclass(frozen=True)
class TokenLogprob:
    """One output token's log-probability under the distribution it was drawn from (greedy: the
    model's raw logits; sampled: after temperature, top-k and top-p, so an excluded token is -inf),
    and the `top` most likely tokens of that distribution as (token id, logprob), most likely first."""
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class FirstToken:
    """A prefill-only request's first output token, as the decode actor continues from it: its
    text (held back where a stop string could be starting), whether it ends the request, and the
    sampler's state after the draw (None for an unseeded request)."""
    token_id: int
    text: str
    finish_reason: FinishReason | None = None
    rng_state: bytes | None = None
    logprob: TokenLogprob | None = None   # when the request asked for logprobs


# ---- router -> prefill actor ----------------------------------------------------------------------
@dataclass(frozen=True)
class PrefillReserve:
    """Take blocks for a prompt; `sampling` gives its first output token (None: greedy, one token)."""
    transfer_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams | None = None


@dataclass(frozen=True)
class PrefillReservation:
    """The prefill actor's answer: how much of the prompt it had cached, and all the prompt's blocks
    (the router slices the ones to send, and those a prefix pull lands in)."""
    cached_tokens: int
    block_ids: list[int]


@dataclass(frozen=True)
class FirstTokenReady:
    """A prefill worker's `first_token`: the first output token as soon as it is sampled, with where the
    time went on the prefill actor (`timings`: stage -> seconds; empty when unknown)."""
    first: FirstToken
    timings: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class PrefillResult:
    """A prefill worker's `start`, once the KV has arrived: the first output token again, with the
    prompt's split between cached and computed tokens."""
    cached_tokens: int
    computed_tokens: int
    first: FirstToken | None
    timings: dict[str, float] = field(default_factory=dict)


# ---- router -> decode actor -----------------------------------------------------------------------
@dataclass(frozen=True)
class DecodeReserve:
    """Place a request on a decode actor. `transfer_id` set: remote prefill is on offer under that
    id; `prefill_id`: the prefill actor the router asks first (the decode actor then registers the
    receive from it at once). `replaces`: the attempt this one continues on the same actor (its
    remote prefill failed, so it prefills locally): work in flight, taken even by an actor that
    takes no new requests (draining, or its decode role dropped)."""
    request_id: str
    router_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    transfer_id: str | None = None
    prefill_id: str | None = None
    replaces: str | None = None
    # prompt tokens per step when it prefills locally (the cost model's pick; None: the step budget)
    prefill_chunk_tokens: int | None = None
    # a running sequence moving here with its KV (KV-preserving migration) from `prefill_id`, the
    # decode actor that runs it and keeps decoding it meanwhile: blocks for the prompt (its tokens
    # so far but the last) plus this many positions more, with two receives registered: its full
    # blocks (pre-copied while it decodes) and the rest (sent once it is paused); the prompt,
    # sampling and handoff token follow (`take_moved`). Remote or refused (WorkerUnavailable),
    # never a local prefill
    move_headroom: int | None = None
    # tokens of the prompt that were computed before, elsewhere (a request moved by recompute):
    # counted as `tokens_recomputed` where it is prefilled again
    recomputed_tokens: int = 0


@dataclass(frozen=True)
class DecodePlan:
    """The decode actor's answer. Local: it prefills the prompt itself. Remote: the KV of the prompt
    from `first_block` on lands in `dst_block_ids` (covering `num_tokens` positions); it already
    holds `prefix_block_ids` (its cached prefix), and has registered the receive from `expecting`
    when the router named a prefill actor."""
    remote: bool
    cached_tokens: int
    first_block: int = 0
    dst_block_ids: list[int] = field(default_factory=list)
    num_tokens: int = 0
    prefix_block_ids: list[int] = field(default_factory=list)
    expecting: str | None = None
    # a move (`DecodeReserve.move_headroom`): the first `precopy_blocks` of `dst_block_ids` take the
    # sequence's full blocks under transfer id `precopy_id` while it decodes; the rest (the tail,
    # `num_tokens` positions in all) take what it writes until it pauses, under `transfer_id`
    precopy_blocks: int = 0
    precopy_id: str | None = None

    @property
    def mode(self) -> str:
        return "remote" if self.remote else "local"


# ---- decode actor -> router (get_outputs), and the router's own output pump -------------------------
@dataclass(frozen=True)
class StepOutput:
    """One request's share of one step: its new tokens and text; `finish_reason` and `usage` once
    it finished."""
    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    logprobs: tuple[TokenLogprob, ...] | None = None   # one per token id, when the request asked

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class OutputError:
    """The request failed on the decode actor (its KV transfer failed, a step raised, its router
    stopped polling) and holds nothing there any more; the router moves it to another one."""
    request_id: str
    error: str


# Positions reserved for a moving sequence past those its offer names, in blocks: what it may decode
# while its router reserves and while its full blocks are pre-copied. The offering actor pauses it
# before it would outgrow them, so a slow reservation costs the sequence a longer pause, never the move.
MOVE_HEADROOM_BLOCKS = 2


@dataclass(frozen=True)
class SequenceMoving:
    """A decode actor offers a running sequence to move with its KV (it drains, is asked to
    rebalance, or is short of blocks): the router reserves on another decode actor and has this
    one pre-copy its full blocks there (`start_move`) while it keeps decoding it, or has it stay
    (`resume`). `num_tokens`: the positions its KV covers now (its tokens so far but the last).
    Comes after every output of the sequence so far. `cancelled`: the offer is withdrawn (the
    pre-copy failed, or the sequence could not pause within what was reserved): it continues
    here, and the router frees what it reserved for it."""
    request_id: str
    num_tokens: int
    cancelled: bool = False


@dataclass(frozen=True)
class SequencePaused:
    """A sequence being moved (`SequenceMoving`) left this decode actor's batch: the rest of its KV
    (the tail the pre-copy did not carry) is on its way into the blocks reserved for it, and the
    router hands the other actor the prompt and `handoff` (`take_moved`). `handoff`: the last
    output token (streamed already), as the next decode actor continues from it; the KV covers
    `num_tokens` positions (the sequence's tokens but that last one). Comes after every output of
    the sequence so far."""
    request_id: str
    handoff: FirstToken
    num_tokens: int


@dataclass(frozen=True)
class WorkerLostNotice:
    """Put in every request's queue by the router's output pump when a decode actor stops
    answering: the requests on `worker_id` move elsewhere."""
    worker_id: str
    error: str


Output = Union[StepOutput, OutputError, SequenceMoving, SequencePaused]
