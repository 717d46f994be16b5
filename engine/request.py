"""Requests as the engine sees them: token ids, sampling parameters, progress. No torch import.

There is no prefill phase and no decode phase: a request has `num_computed_tokens` (whose KV is in
the cache) and `num_tokens` (prompt + output so far); each step computes some of the difference.
"""

from __future__ import annotations

import enum
import itertools
import math
from dataclasses import dataclass, field


class InvalidRequestError(ValueError):
    """The request cannot be served as asked (bad parameter, too long, unknown role ...).

    Raised before any KV is allocated; the message says what is wrong and what is allowed.
    """


class WorkerUnavailable(RuntimeError):
    """This worker takes no new requests (draining or out of KV); the router tries another."""


class FinishReason(enum.Enum):
    STOP = "stop"  # EOS or a stop string
    LENGTH = "length"  # max_tokens or the model's context
    ABORT = "abort"  # cancelled, deadline, or the request failed


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


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
        if k is not None and (not isinstance(k, int) or k < 0):
            raise InvalidRequestError(f"num_speculative_tokens must be an integer >= 0, got {k!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


_ids = itertools.count()


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
