"""What every draft proposer promises. No torch import.

`propose([(request, k), ...]) -> {request id: Draft}`: up to k draft tokens that might follow each
request's tokens (fewer, or none, when it has no good guess). `Draft.probs` is the distribution
each draft token was sampled from ([k, vocab] tensor) when the proposer sampled; None when the
drafts are deterministic (n-gram lookup, greedy drafting), which the verifier treats as one-hot.
`release(request_id)` drops whatever per-request state (KV blocks, indexes) the proposer keeps.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from tandem.engine.request import Request


@dataclass
class Draft:
    token_ids: list[int]
    probs: Any = None  # torch.Tensor [len(token_ids), vocab] or None (one-hot at each token)

    def __len__(self) -> int:
        return len(self.token_ids)

    def head(self, k: int) -> "Draft":
        """The first k drafts (the scheduler may grant fewer than were proposed)."""
        if k >= len(self.token_ids):
            return self
        return Draft(self.token_ids[:k], None if self.probs is None else self.probs[:k])


class Proposer(Protocol):
    def propose(self, wanted: list[tuple[Request, int]]) -> dict[str, Draft]: ...

    def release(self, request_id: str) -> None: ...
