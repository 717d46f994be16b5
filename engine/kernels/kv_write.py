"""Scatter the new tokens' K and V into their paged-cache slots (the Triton twin of
`engine.attention.write_kv_torch`). A slot of -1 means "skip this token" (padding rows)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem.engine.kernels.validate import (FLOAT_DTYPES, INDEX_DTYPES, next_power_of_2, require_runnable,
                                     require_same, require_tensor)


@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    block_size,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcb, stride_kcs, stride_kch,
    stride_vcb, stride_vcs, stride_vch,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # one program per token: all its KV heads, [BLOCK_H, BLOCK_D]
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:
        return
    block = slot // block_size
    offset = slot % block_size
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    mask = (heads[:, None] < NUM_HEADS) & (dims[None, :] < HEAD_DIM)

    k = tl.load(k_ptr + token * stride_kt + heads[:, None] * stride_kh + dims[None, :], mask=mask)
    k_dst = k_cache_ptr + block * stride_kcb + offset * stride_kcs
    tl.store(k_dst + heads[:, None] * stride_kch + dims[None, :], k, mask=mask)

    v = tl.load(v_ptr + token * stride_vt + heads[:, None] * stride_vh + dims[None, :], mask=mask)
    v_dst = v_cache_ptr + block * stride_vcb + offset * stride_vcs
    tl.store(v_dst + heads[:, None] * stride_vch + dims[None, :], v, mask=mask)


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """k, v: [T, num_kv_heads, head_dim] -> their slots of k_cache, v_cache ([num_blocks, block_size,
    num_kv_heads, head_dim], views allowed), in place. slot_mapping: [T] int32/int64, slot =
    block_id * block_size + offset, -1 = skip. Slots are not range-checked (that would sync)."""
    require_tensor("k", k, ndim=3, dtypes=FLOAT_DTYPES)
    require_tensor("v", v, ndim=3, dtypes=FLOAT_DTYPES)
    require_tensor("k_cache", k_cache, ndim=4, dtypes=FLOAT_DTYPES)
    require_tensor("v_cache", v_cache, ndim=4, dtypes=FLOAT_DTYPES)
    require_tensor("slot_mapping", slot_mapping, ndim=1, dtypes=INDEX_DTYPES,
                   last_dim_contiguous=False)
    require_same("v", v, "k", k, shape=True)
    require_same("k_cache", k_cache, "k", k)
    require_same("v_cache", v_cache, "k_cache", k_cache, shape=True)
    require_same("slot_mapping", slot_mapping, "k", k, dtype=False)
    if k_cache.shape[2:] != k.shape[1:]:
        raise ValueError(f"k is [T, heads, head_dim] = {tuple(k.shape)} but k_cache is "
                         f"[blocks, block_size, heads, head_dim] = {tuple(k_cache.shape)}")
    if slot_mapping.shape[0] != k.shape[0]:
        raise ValueError(f"slot_mapping has {slot_mapping.shape[0]} slots for {k.shape[0]} tokens")
    require_runnable(k, _write_kv_kernel)
    num_tokens, num_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    _write_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping,
        k_cache.shape[1],
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        NUM_HEADS=num_heads, HEAD_DIM=head_dim,
        BLOCK_H=next_power_of_2(num_heads), BLOCK_D=next_power_of_2(head_dim),
        num_warps=4 if num_heads * head_dim >= 1024 else 1,
    )
