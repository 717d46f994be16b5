"""Prompt-lookup drafting: no model, just the sequence's own tokens. Pure Python.

If the sequence's last n tokens (n from `max_n` down to `min_n`) occurred earlier in its prompt or
output, propose the tokens that followed that earlier occurrence (the most recent one among those
with the longest match). Edits, renames and quoting copy long runs of the input, so on coding-agent
traffic these drafts are often right.

Each request keeps an index from every `min_n`-gram to the positions where it ends, extended
incrementally as tokens are appended (a request's tokens never change, only grow), so a lookup
costs O(occurrences of the last `min_n` tokens), not O(sequence length).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tandem.engine.request import Request
from tandem.engine.speculative.proposer import Draft

MAX_CANDIDATES = 64  # most recent occurrences examined per lookup (bounds the cost on repetitive text)


@dataclass
class _NgramIndex:
    ends: dict[tuple[int, ...], list[int]] = field(default_factory=dict)  # min_n-gram -> end positions
    indexed: int = 0  # grams ending before this position are in `ends`
    # the request's tokens, extended with its new outputs each step: `Request.all_token_ids` would
    # copy the whole sequence (thousands of tokens on agents' contexts) for every sequence, every step
    tokens: list[int] = field(default_factory=list)


def find_continuation(tokens: list[int], k: int, min_n: int, max_n: int,
                      ends: dict[tuple[int, ...], list[int]] | None = None) -> list[int]:
    """Up to k tokens following the best earlier match of the suffix of `tokens` (see module doc).
    `ends` is the index of all min_n-grams ending before len(tokens) - 1 (built here when None)."""
    L = len(tokens)
    if k <= 0 or L <= min_n:
        return []
    if ends is None:
        ends = {}
        for e in range(min_n, L):
            ends.setdefault(tuple(tokens[e - min_n:e]), []).append(e)
    cands = ends.get(tuple(tokens[L - min_n:]))
    if not cands:
        return []
    best_len, best_end = 0, -1
    for e in reversed(cands[-MAX_CANDIDATES:]):
        if e >= L:  # the suffix itself: nothing follows it yet
            continue
        m = min_n
        while m < max_n and m < e and tokens[e - m - 1] == tokens[L - m - 1]:
            m += 1
        if m > best_len:  # strictly longer: among equals, the most recent (first seen) wins
            best_len, best_end = m, e
            if m == max_n:
                break
    if best_end < 0:
        return []
    return tokens[best_end:best_end + k]


class NgramProposer:
    def __init__(self, min_n: int = 2, max_n: int = 5):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.min_n, self.max_n = min_n, max_n
        self.index: dict[str, _NgramIndex] = {}

    def _update(self, req: Request) -> _NgramIndex:
        rid = req.request_id
        idx = self.index.get(rid)
        if idx is None:
            idx = self.index[rid] = _NgramIndex(indexed=self.min_n, tokens=list(req.prompt_token_ids))
        tokens, prompt = idx.tokens, len(req.prompt_token_ids)
        tokens.extend(req.output_token_ids[len(tokens) - prompt:])   # a request's tokens only grow
        n = self.min_n
        # index grams ending at positions < len - 1 (the last gram is the lookup key itself)
        for e in range(idx.indexed, len(tokens)):
            idx.ends.setdefault(tuple(tokens[e - n:e]), []).append(e)
        idx.indexed = max(idx.indexed, len(tokens))
        return idx

    def propose(self, wanted: list[tuple[Request, int]]) -> dict[str, Draft]:
        out: dict[str, Draft] = {}
        for req, k in wanted:
            if k <= 0:
                continue
            idx = self._update(req)
            draft = find_continuation(idx.tokens, k, self.min_n, self.max_n, idx.ends)
            if draft:
                out[req.request_id] = Draft(draft)
        return out

    def release(self, request_id: str) -> None:
        self.index.pop(request_id, None)
