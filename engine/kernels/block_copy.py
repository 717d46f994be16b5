"""Copy whole KV blocks of a run of layers between the paged cache and a contiguous buffer: the
KV transport's gather (cache -> message) and scatter (message -> cache). The Triton twin of
`KVCache.gather_layers` / `scatter_layers`' torch path (index_select / index_copy_ on dim 1).

A block of one layer's K (or V) plane is one contiguous row of block_size * Hkv * head_dim
elements (32 KiB for Llama-3-8B in bf16), so each program copies a slice of one row with wide
loads; torch's indexing kernels copy element by element and reach about a third of HBM bandwidth.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.validate import INDEX_DTYPES, next_power_of_2, require_runnable, require_tensor


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
