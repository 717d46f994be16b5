"""Block identity: a full block of `block_size` token ids is hashed together with its parent
block's hash (blake2b, 8 bytes, over parent hash + token ids as little-endian uint32), so equal
hashes mean equal prefixes in every process. The engine's prefix cache and the router's prefix
index both use these functions. Pure: no torch."""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Sequence

_U32 = "I"
assert array(_U32).itemsize == 4, "token ids are hashed as 4-byte integers"


def hash_block(parent: bytes | None, token_ids: Sequence[int]) -> bytes:
    """Stable (cross-process, cross-platform) hash of one full block chained on its parent."""
    return _hash(parent, _le_u32(token_ids))


def block_hashes(token_ids: Sequence[int], block_size: int, parent: bytes | None = None,
                 start_block: int = 0) -> list[bytes]:
    """Chained hashes of the full blocks of `token_ids`, from block `start_block` on.

    `parent` is the hash of block `start_block - 1` (None when starting at block 0). A trailing
    partial block has no hash: it is not shareable until it fills.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    raw = memoryview(_le_u32(token_ids)).cast("B")
    step = 4 * block_size
    out: list[bytes] = []
    for b in range(start_block, len(token_ids) // block_size):
        parent = _hash(parent, raw[b * step:(b + 1) * step])
        out.append(parent)
    return out


def _le_u32(token_ids: Sequence[int]) -> array:
    data = token_ids if isinstance(token_ids, array) and token_ids.typecode == _U32 \
        else array(_U32, token_ids)
    if sys.byteorder == "big":
        data = array(_U32, data)
        data.byteswap()
    return data


def _hash(parent: bytes | None, payload) -> bytes:
    h = hashlib.blake2b(digest_size=8)
    if parent is not None:
        h.update(parent)
    h.update(payload)
    return h.digest()
