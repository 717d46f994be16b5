"""Requests as the engine sees them: token ids, sampling parameters, progress. No torch import.

There is no prefill phase and no decode phase: a request has `num_computed_tokens` (whose KV is in
the cache) and `num_tokens` (prompt + output so far); each step computes some of the difference.
"""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field

from tandem.wire.messages import FinishReason, SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


_ids = itertools.count()
PENDING = -1  # an output token a step still on the device has sampled (Request.num_pending)


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    eos_token_ids: tuple[int, ...] = ()
    arrival: int = field(default_factory=lambda: next(_ids))  # FIFO order

    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    num_computed_tokens: int = 0
    num_cached_prompt_tokens: int = 0  # prefix-cache hit at first admission (usage reporting)
    num_preemptions: int = 0
    # KV blocks this request holds, in position order, and the chained hashes of its full blocks
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)
    num_registered_blocks: int = 0
    admitted_once: bool = False
    # prefill actors compute a prompt's KV and hand it on: no sampling, and on completion the
    # blocks stay held (status FINISHED) until the owner frees them after the transfer
    prefill_only: bool = False
    # speculative decoding accounting
    num_draft_tokens: int = 0
    num_accepted_draft_tokens: int = 0
    num_draft_steps: int = 0  # steps that verified at least one of its drafts
    # output tokens sampled by a step still on the device (the overlapped step): the last
    # `num_pending` entries of output_token_ids are placeholders until the engine resolves them
    num_pending: int = 0
    # the most prompt tokens it computes per step (None: the step's budget); the router's cost
    # model picks it when a decode worker prefills beside its batch (tandem.placement)
    max_chunk_tokens: int | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_at(self, i: int) -> int:
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[i] if i < n else self.output_token_ids[i - n]

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED
