"""Block hashes of token ids, and the router's approximate index of which worker caches them.

`block_hashes` is THE definition of a block's identity: a full block of `block_size` token ids is
hashed together with its parent block's hash (blake2b, 8 bytes, over parent hash + token ids as
little-endian uint32), so equal hashes mean equal prefixes, in every process. The engine's prefix
cache must use the same function, or the router's guesses never match what workers hold.

`PrefixIndex` remembers, per block hash, the workers that were last sent it. It is approximate (a
worker may have evicted a block since) and bounded (least recently used hashes are dropped first);
a wrong guess only costs a prefix-cache miss, never a wrong answer. Pure: no I/O, no clock.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

from tandem.engine.prefix_hash import block_hashes, hash_block  # noqa: F401  (re-exported)


class PrefixIndex:
    """block hash -> workers believed to hold that block; LRU-bounded by number of hashes."""

    def __init__(self, max_hashes: int = 1_000_000):
        if max_hashes < 1:
            raise ValueError(f"max_hashes must be >= 1, got {max_hashes}")
        self.max_hashes = max_hashes
        self._holders: OrderedDict[bytes, set[str]] = OrderedDict()  # oldest first
        self._by_worker: dict[str, set[bytes]] = {}

    def __len__(self) -> int:
        return len(self._holders)

    def record(self, worker: str, hashes: Sequence[bytes]) -> None:
        """`worker` now holds the blocks of this chain (e.g. it was just sent this prompt)."""
        mine = self._by_worker.setdefault(worker, set())
        # Touch the chain leaf-first so the root ends most recent: eviction then trims chains
        # from their tails, and what stays is still a matchable prefix.
        for h in reversed(hashes):
            holders = self._holders.get(h)
            if holders is None:
                holders = self._holders[h] = set()
            else:
                self._holders.move_to_end(h)
            holders.add(worker)
            mine.add(h)
        while len(self._holders) > self.max_hashes:
            old, holders = self._holders.popitem(last=False)
            for w in holders:
                self._by_worker[w].discard(old)

    def match(self, hashes: Sequence[bytes]) -> dict[str, int]:
        """Per worker, how many leading blocks of this chain it holds (workers with 0 left out)."""
        hits: dict[str, int] = {}
        alive: set[str] | None = None
        matched: list[bytes] = []
        for i, h in enumerate(hashes):
            holders = self._holders.get(h, frozenset())
            alive = set(holders) if alive is None else alive & holders
            if not alive:
                break
            matched.append(h)
            for w in alive:
                hits[w] = i + 1
        for h in reversed(matched):  # a hit keeps the prefix warm, root most recent
            self._holders.move_to_end(h)
        return hits

    def forget_worker(self, worker: str) -> None:
        """Drop everything recorded for `worker` (it died, drained, or restarted cold)."""
        for h in self._by_worker.pop(worker, ()):
            holders = self._holders.get(h)
            if holders is not None:
                holders.discard(worker)
                if not holders:
                    del self._holders[h]

    def workers(self) -> Iterable[str]:
        return (w for w, hashes in self._by_worker.items() if hashes)
