"""Rotary embedding and the paged-cache write of a step's new K/V in one launch: what
`fused.rotary_embedding` then `kv_write.write_kv` do, one program per token. At a decode step of
a few sequences each of those is a ~2 us launch per layer doing almost nothing (llama3-8b at batch
1: 66 + 45 us a step for the two, plus a graph gap each); one launch saves one of them.

Same contract as the two it replaces: q [T, Hq, D] is rotated in place, k [T, Hkv, D] too (the
attention reads K from the cache, but the rotated k stays what the two-launch path leaves), and
k, v go to their slots of k_cache, v_cache [blocks, block_size, Hkv, D] (views allowed); a slot of
-1 skips the write (padding rows). Rotate-half pairing (dim i with i + D/2) from a cos/sin cache
[max_position, D] (cos in the first half of row p, sin in the second), computed in fp32.

`ENABLED` (on) picks it; `TritonOps.rotary_write_kv` reads it on each call. On the H200 it gave
the two launches' bytes at 8B sizes (tests/gpu/test_rope_kv_gpu.py) and took llama3-8b's batch-1
step from 431 to 399 kernels (with the split-K defaults of the same run, 4.80 -> 4.67 ms).

`rotary_kv_attention` goes one step further for a step the decode kernel takes whole (every
sequence at most MAX_DECODE_QUERY_LEN new tokens): the decode attention kernel rotates q in
registers and writes the new K/V itself before it reads the cache (`paged_decode_attention(rope=)`),
so rotary and the KV write cost no launch at all. `IN_ATTENTION` is the most tokens a step may
carry for that (0: never); other steps take the launch above, then `paged_attention`. On the H200
(llama3-8b-random, context 1k, docs/benchmarks.md, issue 24; tests/gpu/test_rope_kv_gpu.py checks
it there): the step at batch 1 bf16 4.106 ms against 4.182, FP8 2.499 against 2.535; at 64
7.086 / 6.830 against 7.144 / 6.868; at 256 1% slower (16.220 / 14.391 against 16.065 / 14.250),
so it stops at 64 tokens.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem.engine.kernels import pdl
from tandem.engine.kernels.fused import _rotate_heads, rotary_embedding
from tandem.engine.kernels.kv_write import write_kv
from tandem.engine.kernels.paged_attention import (MAX_DECODE_QUERY_LEN, NewKV, paged_attention,
                                                   paged_decode_attention)
from tandem.engine.kernels.validate import next_power_of_2, require_runnable

ENABLED = True
IN_ATTENTION = 64


@triton.jit
def _rotary_write_kv_kernel(
    q_ptr, k_ptr, v_ptr, positions_ptr, cos_sin_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, block_size,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_cs,
    stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
    NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HALF: tl.constexpr,
    BLOCK_QH: tl.constexpr, BLOCK_KH: tl.constexpr, BLOCK_HALF: tl.constexpr, USE_PDL: tl.constexpr = False,
):
    pdl.enter(USE_PDL)
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + token).to(tl.int64)
    half = tl.arange(0, BLOCK_HALF)[None, :]
    row = cos_sin_ptr + pos * stride_cs
    cos = tl.load(row + half, mask=half < HALF, other=0.0).to(tl.float32)
    sin = tl.load(row + HALF + half, mask=half < HALF, other=0.0).to(tl.float32)
    _rotate_heads(q_ptr + token * stride_qt, stride_qh, cos, sin, NUM_Q_HEADS, HALF, BLOCK_QH, BLOCK_HALF)

    # k: rotated in registers, stored back to k and to its cache slot; v: copied to its slot
    heads = tl.arange(0, BLOCK_KH)[:, None]
    mask = (heads < NUM_KV_HEADS) & (half < HALF)
    k_first = k_ptr + token * stride_kt + heads * stride_kh + half
    k1 = tl.load(k_first, mask=mask, other=0.0).to(tl.float32)
    k2 = tl.load(k_first + HALF, mask=mask, other=0.0).to(tl.float32)
    r1 = (k1 * cos - k2 * sin).to(k_ptr.dtype.element_ty)
    r2 = (k2 * cos + k1 * sin).to(k_ptr.dtype.element_ty)
    tl.store(k_first, r1, mask=mask)
    tl.store(k_first + HALF, r2, mask=mask)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot >= 0:
        block = slot // block_size
        offset = slot % block_size
        k_dst = k_cache_ptr + block * stride_kcb + offset * stride_kcs + heads * stride_kch + half
        tl.store(k_dst, r1, mask=mask)
        tl.store(k_dst + HALF, r2, mask=mask)
        v_src = v_ptr + token * stride_vt + heads * stride_vh + half
        v_dst = v_cache_ptr + block * stride_vcb + offset * stride_vcs + heads * stride_vch + half
        tl.store(v_dst, tl.load(v_src, mask=mask), mask=mask)
        tl.store(v_dst + HALF, tl.load(v_src + HALF, mask=mask), mask=mask)


def rotary_write_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                    cos_sin_cache: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    slot_mapping: torch.Tensor, fused: bool | None = None) -> None:
    """`rotary_embedding(q, k, positions, cos_sin_cache)` then `write_kv(k, v, k_cache, v_cache,
    slot_mapping)`, in one launch when `fused` (None: ENABLED). Inputs are checked by the two
    unfused wrappers' rules (the fused path runs their checks with no launch: T = 0 views)."""
    fused = ENABLED if fused is None else fused
    if not fused:
        rotary_embedding(q, k, positions, cos_sin_cache)
        write_kv(k, v, k_cache, v_cache, slot_mapping)
        return
    _check(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping)
    require_runnable(q, _rotary_write_kv_kernel)
    num_tokens = q.shape[0]
    if num_tokens == 0:
        return
    num_q_heads, head_dim = q.shape[1:]
    num_kv_heads, half = k.shape[1], head_dim // 2
    _rotary_write_kv_kernel[(num_tokens,)](
        q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping, k_cache.shape[1],
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos_sin_cache.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1),
        v_cache.stride(2),
        NUM_Q_HEADS=num_q_heads, NUM_KV_HEADS=num_kv_heads, HALF=half,
        BLOCK_QH=next_power_of_2(num_q_heads), BLOCK_KH=next_power_of_2(num_kv_heads),
        BLOCK_HALF=next_power_of_2(half), num_warps=4 if num_q_heads * head_dim >= 2048 else 1,
        **pdl.launch_options(q.device),
    )


def _check(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping) -> None:
    """The same argument checks as the two launches rotary_write_kv replaces, on empty views
    (nothing runs)."""
    num_tokens = q.shape[0]
    if positions.ndim != 1 or positions.shape[0] != num_tokens or slot_mapping.shape[0] != num_tokens:
        raise ValueError(f"positions {tuple(positions.shape)} and slot_mapping {tuple(slot_mapping.shape)} "
                         f"need one entry per token ({num_tokens})")
    rotary_embedding(q[:0], k[:0], positions[:0], cos_sin_cache)
    write_kv(k[:0], v[:0], k_cache, v_cache, slot_mapping[:0])
    if k.shape[0] != num_tokens or k.shape[2] != q.shape[2]:
        raise ValueError(f"k has shape {tuple(k.shape)}, expected [{num_tokens}, kv_heads, {q.shape[2]}]")
    if q.shape[2] % 2 or cos_sin_cache.shape[1] != q.shape[2]:
        raise ValueError(f"cos_sin_cache must be [max_position, head_dim={q.shape[2]}] with an even "
                         f"head_dim, got {tuple(cos_sin_cache.shape)}")


def rotary_kv_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                        cos_sin_cache: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta,
                        scale: float, sliding_window: int | None = None,
                        in_attention: bool | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """`rotary_write_kv(q, k, v, positions, cos_sin_cache, k_cache, v_cache, meta.slot_mapping)`
    then `paged_attention(q, k_cache, v_cache, meta, scale, sliding_window=...)` -> out [T, Hq, D].
    A step the decode kernel takes whole, with `in_attention` (None: at most IN_ATTENTION tokens):
    one launch, the decode kernel rotating q in registers (q is left unrotated, k too) and writing
    the new K/V (the cache ends as the two launches leave it). `out` [T, Hq, D]: written in place
    of a new tensor (a piecewise graph reads the heads' output from a fixed buffer)."""
    in_attention = 0 < q.shape[0] <= IN_ATTENTION if in_attention is None else in_attention
    if in_attention and q.shape[0] and meta.max_query_len <= MAX_DECODE_QUERY_LEN:
        _check(q, k, v, positions, cos_sin_cache, k_cache, v_cache, meta.slot_mapping)
        return paged_decode_attention(q, k_cache, v_cache, meta, scale, out, sliding_window=sliding_window,
                                      rope=NewKV(k, v, positions, cos_sin_cache, meta.slot_mapping))
    rotary_write_kv(q, k, v, positions, cos_sin_cache, k_cache, v_cache, meta.slot_mapping)
    return paged_attention(q, k_cache, v_cache, meta, scale, out, sliding_window=sliding_window)
