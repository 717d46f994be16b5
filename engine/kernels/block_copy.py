"""Copy whole KV blocks of a run of layers between the paged cache and a contiguous buffer: the
KV transport's gather (cache -> message) and scatter (message -> cache). The Triton twin of
`KVCache.gather_layers` / `scatter_layers`' torch path (index_select / index_copy_ on dim 1).

A block of one layer's K (or V) plane is one contiguous row of block_size * Hkv * head_dim
elements (32 KiB for Llama-3-8B in bf16), so each program copies a slice of one row with wide
loads; torch's indexing kernels copy element by element and reach about a third of HBM bandwidth.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from tandem.engine.kernels.validate import INDEX_DTYPES, next_power_of_2, require_runnable, require_tensor


# The per-transfer integers (blocks in the message, first plane) are not specialized: Triton would
# compile a variant per divisibility class, each a second-long stall in the middle of serving.
@triton.jit(do_not_specialize=["n_blocks", "first_plane"])
def _block_copy_kernel(cache_ptr, buf_ptr, idx_ptr, n_blocks, cache_blocks, first_plane, row_elems,
                       TO_BUF: tl.constexpr, BLOCK: tl.constexpr):
    # buffer row r = plane p (K/V of each layer of the run, in order), block j of the index
    r = tl.program_id(0).to(tl.int64)
    p = r // n_blocks
    j = r % n_blocks
    block = tl.load(idx_ptr + j).to(tl.int64)
    cache_row = (first_plane + p) * cache_blocks + block
    offs = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < row_elems
    if TO_BUF:
        x = tl.load(cache_ptr + cache_row * row_elems + offs, mask=mask)
        tl.store(buf_ptr + r * row_elems + offs, x, mask=mask)
    else:
        x = tl.load(buf_ptr + r * row_elems + offs, mask=mask)
        tl.store(cache_ptr + cache_row * row_elems + offs, x, mask=mask)


def compile_variants(cache: torch.Tensor) -> int:
    """Compile both directions now (engine warmup), by copying block 0 of layer 0 out and back in
    (the cache is unchanged). Returns the number of launches."""
    ids = torch.zeros(1, dtype=torch.long, device=cache.device)
    buf = torch.empty((1, cache.shape[1], 1, *cache.shape[3:]), dtype=cache.dtype, device=cache.device)
    copy_blocks(cache, range(0, 1), ids, buf, to_buf=True)
    copy_blocks(cache, range(0, 1), ids, buf, to_buf=False)
    return 2


def copy_blocks(cache: torch.Tensor, layers: range, block_ids: torch.Tensor, buf: torch.Tensor,
                to_buf: bool) -> None:
    """cache: [num_layers, P, num_blocks, *row] contiguous (P planes per layer: K and V); buf:
    [len(layers), P, n, *row] contiguous, same dtype and device; block_ids: [n] int32/int64 on the
    device. to_buf: buf[l, p, j] = cache[layers[l], p, block_ids[j]], else the reverse. Block ids
    are not range-checked (that would sync); the caller's allocator owns them."""
    if not isinstance(cache, torch.Tensor) or not isinstance(buf, torch.Tensor):
        raise ValueError("cache and buf must be torch.Tensors")
    require_tensor("block_ids", block_ids, ndim=1, dtypes=INDEX_DTYPES)
    if cache.dim() < 4 or not cache.is_contiguous() or not buf.is_contiguous():
        raise ValueError(f"cache {tuple(cache.shape)} and buf {tuple(buf.shape)} must be contiguous, "
                         "cache [layers, planes, blocks, ...]")
    if layers.step != 1 or not 0 <= layers.start < layers.stop <= cache.shape[0]:
        raise ValueError(f"layers {layers} is not a run of the cache's {cache.shape[0]} layers")
    n = block_ids.shape[0]
    want = (len(layers), cache.shape[1], n, *cache.shape[3:])
    if tuple(buf.shape) != want or buf.dtype != cache.dtype or buf.device != cache.device:
        raise ValueError(f"buf is {tuple(buf.shape)} {buf.dtype} on {buf.device}; want {want} "
                         f"{cache.dtype} on {cache.device}")
    if block_ids.device != cache.device:
        raise ValueError(f"block_ids are on {block_ids.device}, the cache on {cache.device}")
    require_runnable(cache, _block_copy_kernel)
    if n == 0:
        return
    row = cache[0, 0, 0].numel()
    block = min(8192, next_power_of_2(row))
    grid = (len(layers) * cache.shape[1] * n, triton.cdiv(row, block))
    _block_copy_kernel[grid](cache, buf, block_ids, n, cache.shape[2], layers.start * cache.shape[1], row,
                             TO_BUF=to_buf, BLOCK=block, num_warps=8 if block >= 4096 else 4)


@triton.jit(do_not_specialize=["n_blocks", "first_plane"])
def _cache_to_cache_kernel(src_ptr, dst_ptr, src_idx_ptr, dst_idx_ptr, n_blocks, src_blocks, dst_blocks,
                           first_plane, row_elems, BLOCK: tl.constexpr):
    # row r = plane p of the run (K/V of each layer, in order), block j of the two indexes
    r = tl.program_id(0).to(tl.int64)
    p = r // n_blocks
    j = r % n_blocks
    # the source ids may live in the peer's memory, unseen by this host: clamped, a bad one reads
    # a wrong block of the peer's cache, never outside it
    src_block = tl.minimum(tl.maximum(tl.load(src_idx_ptr + j).to(tl.int64), 0), src_blocks - 1)
    dst_block = tl.load(dst_idx_ptr + j).to(tl.int64)
    offs = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < row_elems
    x = tl.load(src_ptr + ((first_plane + p) * src_blocks + src_block) * row_elems + offs, mask=mask)
    tl.store(dst_ptr + ((first_plane + p) * dst_blocks + dst_block) * row_elems + offs, x, mask=mask)


def copy_cache_blocks(src: torch.Tensor, dst: torch.Tensor, layers: range, src_ids: torch.Tensor,
                      dst_ids: torch.Tensor, block: int = 8192, num_warps: int = 8,
                      check: bool = True) -> None:
    """dst[l, p, dst_ids[j]] = src[l, p, src_ids[j]] for the layers of the run: block to block,
    no buffer in between. One of the two caches may be another GPU's, mapped into this process
    (CUDA IPC over NVLink): the KV transport's one-sided copy. Same checks as `copy_blocks`;
    `check=False` skips them for a pair of caches checked once (the launch is on a transfer's
    critical path)."""
    if check:
        _check_cache_copy(src, dst, layers, src_ids, dst_ids)
    n = src_ids.shape[0]
    if n == 0:
        return
    row = math.prod(src.shape[3:])
    block = min(block, next_power_of_2(row))
    grid = (len(layers) * src.shape[1] * n, triton.cdiv(row, block))
    _cache_to_cache_kernel[grid](src, dst, src_ids, dst_ids, n, src.shape[2], dst.shape[2],
                                 layers.start * src.shape[1], row, BLOCK=block, num_warps=num_warps)


def _check_cache_copy(src: torch.Tensor, dst: torch.Tensor, layers: range, src_ids: torch.Tensor,
                      dst_ids: torch.Tensor) -> None:
    require_tensor("src_ids", src_ids, ndim=1, dtypes=INDEX_DTYPES)
    require_tensor("dst_ids", dst_ids, ndim=1, dtypes=INDEX_DTYPES)
    for name, cache in (("src", src), ("dst", dst)):
        if not isinstance(cache, torch.Tensor) or cache.dim() < 4 or not cache.is_contiguous():
            raise ValueError(f"{name} must be a contiguous cache [layers, planes, blocks, ...]")
    if src.shape[:2] != dst.shape[:2] or src.shape[3:] != dst.shape[3:] or src.dtype != dst.dtype:
        raise ValueError(f"caches differ: src {tuple(src.shape)} {src.dtype}, dst {tuple(dst.shape)} {dst.dtype}")
    if src_ids.shape != dst_ids.shape:
        raise ValueError(f"{src_ids.shape[0]} source blocks for {dst_ids.shape[0]} destination blocks")
    if layers.step != 1 or not 0 <= layers.start < layers.stop <= src.shape[0]:
        raise ValueError(f"layers {layers} is not a run of the cache's {src.shape[0]} layers")
    require_runnable(src, _cache_to_cache_kernel)
