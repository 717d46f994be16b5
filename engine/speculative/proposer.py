"""What every draft proposer promises. No torch import.

`propose([(request, k), ...]) -> {request id: Draft}`: up to k draft tokens that might follow each
request's tokens (fewer, or none, when it has no good guess). `Draft.probs` is the distribution
each draft token was sampled from ([k, vocab] tensor) when the proposer sampled; None when the
drafts are deterministic (n-gram lookup, greedy drafting), which the verifier treats as one-hot.
A proposer may return a tree (`Draft.parents`, engine.speculative.tree; deterministic drafts only):
k then bounds its nodes, and `Draft.worth` its estimate of each node's chance to be accepted.
`release(request_id)` drops whatever per-request state (KV blocks, indexes) the proposer keeps.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from tandem.engine.request import Request
from tandem.engine.speculative.tree import is_chain


@dataclass
class Draft:
    token_ids: list[int]
    probs: Any = None  # torch.Tensor [len(token_ids), vocab] or None (one-hot at each token)
    parents: list[int] | None = None  # a tree: each node's parent (-1: the root); None: a chain
    worth: list[float] | None = None  # a tree: the proposer's chance that each node is accepted

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def is_tree(self) -> bool:
        return not is_chain(self.parents)

    def head(self, k: int) -> "Draft":
        """The first k drafts (the scheduler may grant fewer than were proposed); of a tree, its
        first k nodes (a tree too: parents come first)."""
        if k >= len(self.token_ids):
            return self
        return Draft(self.token_ids[:k], None if self.probs is None else self.probs[:k],
                     None if self.parents is None else self.parents[:k],
                     None if self.worth is None else self.worth[:k])

    def select(self, nodes: list[int]) -> "Draft":
        """The tree of these nodes (each one's parent among them), renumbered in node order."""
        if self.parents is None:
            return self.head(len(nodes))
        keep = sorted(nodes)
        new = {old: i for i, old in enumerate(keep)}
        return Draft([self.token_ids[i] for i in keep], None,
                     [-1 if self.parents[i] < 0 else new[self.parents[i]] for i in keep],
                     None if self.worth is None else [self.worth[i] for i in keep])


class Proposer(Protocol):
    def propose(self, wanted: list[tuple[Request, int]]) -> dict[str, Draft]: ...

    def release(self, request_id: str) -> None: ...
