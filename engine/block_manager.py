"""KV block allocation with reference counts and prefix caching. Pure Python, no torch.

Blocks hold `block_size` token positions. A full block is identified by a chained hash of its
tokens and its parent's hash, so two requests whose prompts share a prefix share its blocks.
Invariants:
- a block is in exactly one of: held (ref_count > 0), or the free queue (ref_count == 0);
- free-queue blocks that still carry a hash are the prefix cache; they are evicted in LRU order
  (least recently released first) when a fresh block is needed;
- `num_free_blocks` is exact at every moment: held blocks + free-queue blocks == num_blocks.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from tandem.engine.prefix_hash import block_hashes, hash_block  # noqa: F401
from tandem.engine.request import Request


class BlockAllocator:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.cached: dict[bytes, int] = {}  # hash -> block id
        # ref_count == 0 blocks, least recently released first (insertion order)
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.prefix_queries = 0  # tokens looked up
        self.prefix_hits = 0  # tokens found
        self.evictions = 0  # cached blocks reused for other content

    # ---- accounting -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_queue)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- prefix cache -----------------------------------------------------------------------
    def match_prefix(self, token_ids: Sequence[int]) -> tuple[list[int], list[bytes]]:
        """Cached blocks covering the longest prefix of `token_ids`, leaving at least one token
        uncomputed (the last prompt token must run to produce logits). Does not take references."""
        if not self.enable_prefix_caching:
            return [], []
        max_blocks = (len(token_ids) - 1) // self.block_size
        ids: list[int] = []
        hashes: list[bytes] = []
        parent = None
        for b in range(max_blocks):
            parent = hash_block(parent, token_ids[b * self.block_size:(b + 1) * self.block_size])
            block = self.cached.get(parent)
            if block is None:
                break
            ids.append(block)
            hashes.append(parent)
        return ids, hashes

    def num_cached_tokens(self, token_ids: Sequence[int]) -> int:
        return len(self.match_prefix(token_ids)[0]) * self.block_size

    # ---- allocation -------------------------------------------------------------------------
    def _take(self, block: int) -> None:
        if self.ref_counts[block] == 0:
            del self.free_queue[block]
        self.ref_counts[block] += 1

    def _fresh_block(self) -> int:
        block, _ = self.free_queue.popitem(last=False)  # LRU
        h = self.block_hash[block]
        if h is not None:  # evict from the prefix cache
            self.evictions += 1
            if self.cached.get(h) == block:
                del self.cached[h]
            self.block_hash[block] = None
        self.ref_counts[block] = 1
        return block

    def admit(self, req: Request, num_new_tokens: int) -> bool:
        """First allocation for a waiting request: take its cached prefix, then fresh blocks for
        `num_new_tokens` past it (the caller sizes that from `req.num_computed_tokens` after this
        call sets it). Returns False, changing nothing, if the blocks are not there."""
        assert not req.block_ids
        hit_ids, hit_hashes = self.match_prefix(req.all_token_ids)
        cached_tokens = len(hit_ids) * self.block_size
        need = self.blocks_needed(cached_tokens + num_new_tokens) - len(hit_ids)
        reusable = sum(1 for b in hit_ids if self.ref_counts[b] == 0)
        if need > self.num_free_blocks - reusable:
            return False
        for b in hit_ids:
            self._take(b)
        req.block_ids = hit_ids + [self._fresh_block() for _ in range(need)]
        req.block_hashes = list(hit_hashes)
        req.num_registered_blocks = len(hit_ids)
        req.num_computed_tokens = cached_tokens
        self.prefix_queries += req.num_tokens
        self.prefix_hits += cached_tokens
        return True

    def num_admit_tokens(self, req: Request) -> int:
        """Tokens a waiting request's prefix cache covers (what `admit` would set as computed)."""
        return self.num_cached_tokens(req.all_token_ids)

    def grow(self, req: Request, num_new_tokens: int) -> bool:
        """Make room for `num_new_tokens` more positions after `req.num_computed_tokens`."""
        need = self.blocks_needed(req.num_computed_tokens + num_new_tokens) - len(req.block_ids)
        if need <= 0:
            return True
        if need > self.num_free_blocks:
            return False
        req.block_ids.extend(self._fresh_block() for _ in range(need))
        return True

    def share(self, req: Request, block_ids: Sequence[int]) -> None:
        """A second holder of blocks another request holds (a KV receive into part of them that
        lets go on its own): `req` takes a reference on each; its `free` drops them."""
        assert not req.block_ids
        for b in block_ids:
            assert self.ref_counts[b] > 0, f"block {b} is not held"
            self._take(b)
        req.block_ids = list(block_ids)

    def register_full_blocks(self, req: Request) -> None:
        """Publish the request's newly completed full blocks (KV computed) in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        num_full = min(req.num_computed_tokens // self.block_size, len(req.block_ids))
        if num_full <= req.num_registered_blocks:
            return
        tokens = req.all_token_ids
        parent = req.block_hashes[-1] if req.block_hashes else None
        for b in range(len(req.block_hashes), num_full):
            parent = hash_block(parent, tokens[b * self.block_size:(b + 1) * self.block_size])
            req.block_hashes.append(parent)
        for b in range(req.num_registered_blocks, num_full):
            h, block = req.block_hashes[b], req.block_ids[b]
            if h not in self.cached:  # another request may have published the same content
                self.cached[h] = block
                self.block_hash[block] = h
        req.num_registered_blocks = num_full

    def free(self, req: Request) -> None:
        """Drop the request's references. Blocks released last-first, so a sequence's tail is
        evicted before its (more shareable) head."""
        for block in reversed(req.block_ids):
            self.ref_counts[block] -= 1
            assert self.ref_counts[block] >= 0, f"block {block} freed twice"
            if self.ref_counts[block] == 0:
                self.free_queue[block] = None
        req.block_ids = []
        req.block_hashes = []
        req.num_registered_blocks = 0

    def truncate(self, req: Request, num_tokens: int) -> None:
        """Keep only the blocks covering the first `num_tokens` positions (speculative rollback)."""
        keep = self.blocks_needed(num_tokens)
        for block in reversed(req.block_ids[keep:]):
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self.free_queue[block] = None
        if keep < len(req.block_ids):  # a new list: engine.block_tables rewrites the row it keeps
            req.block_ids = req.block_ids[:keep]

    def reset_prefix_cache(self) -> None:
        for h, block in self.cached.items():
            self.block_hash[block] = None
        self.cached.clear()

    def check_invariants(self) -> None:
        held = sum(1 for r in self.ref_counts if r > 0)
        assert held + len(self.free_queue) == self.num_blocks, "block accounting drifted"
        for b in self.free_queue:
            assert self.ref_counts[b] == 0
