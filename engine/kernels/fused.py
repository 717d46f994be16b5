"""Fused elementwise kernels of a Llama layer: add + RMSNorm, rotary embedding (NeoX / rotate-half,
as Hugging Face Llama), and SiLU(gate) * up. Each reads its inputs once and writes its outputs once;
all accept fp32, bf16 and fp16 and compute in fp32. Where Hugging Face rounds an intermediate to the
model dtype (the residual sum, the normalised activations before the weight), these kernels round it
too, so bf16 results match the reference model bit for bit in most elements."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem.engine.kernels import pdl
from tandem.engine.kernels.validate import (FLOAT_DTYPES, INDEX_DTYPES, next_power_of_2, require_runnable,
                                     require_same, require_tensor)


@triton.jit
def _rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr, new_residual_ptr,
    eps,
    stride_x, stride_r, stride_o, stride_nr,
    HIDDEN: tl.constexpr, BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr, USE_PDL: tl.constexpr = False,
):
    row = tl.program_id(0).to(tl.int64)
    pdl.enter(USE_PDL)
    cols = tl.arange(0, BLOCK)
    mask = cols < HIDDEN
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
        # round the sum to the model dtype first: that is the residual the next layer sees
        x = (x + r).to(new_residual_ptr.dtype.element_ty)
        tl.store(new_residual_ptr + row * stride_nr + cols, x, mask=mask)
        x = x.to(tl.float32)
    variance = tl.sum(x * x, axis=0) / HIDDEN
    normed = (x * tl.rsqrt(variance + eps)).to(out_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (normed * w).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual: [T, hidden]; weight: [hidden]. Llama's pre-norm step:
    new_residual = x + residual (or x itself when residual is None); out = RMSNorm(new_residual).
    Returns (out, new_residual), both new [T, hidden] tensors of x's dtype (new_residual is x when
    residual is None)."""
    require_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES)
    require_tensor("weight", weight, ndim=1, dtypes=FLOAT_DTYPES)
    require_same("weight", weight, "x", x, dtype=False)
    if weight.shape[0] != x.shape[1]:
        raise ValueError(f"weight has {weight.shape[0]} elements for hidden size {x.shape[1]}")
    if residual is not None:
        require_tensor("residual", residual, ndim=2, dtypes=FLOAT_DTYPES)
        require_same("residual", residual, "x", x, shape=True)
    require_runnable(x, _rms_norm_kernel)
    num_rows, hidden = x.shape
    out = torch.empty((num_rows, hidden), dtype=x.dtype, device=x.device)
    new_residual = x if residual is None else torch.empty_like(out)
    if num_rows == 0:
        return out, new_residual
    block = next_power_of_2(hidden)
    r = x if residual is None else residual  # unread when HAS_RESIDUAL is False
    _rms_norm_kernel[(num_rows,)](
        x, r, weight, out, new_residual, float(eps),
        x.stride(0), r.stride(0), out.stride(0), new_residual.stride(0),
        HIDDEN=hidden, BLOCK=block, HAS_RESIDUAL=residual is not None,
        num_warps=min(16, max(1, block // 512)), **pdl.launch_options(x.device),
    )
    return out, new_residual


@triton.jit
def _rotate_heads(x_ptr, stride_h, cos, sin,
                  NUM_HEADS: tl.constexpr, HALF: tl.constexpr,
                  BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    # x_ptr points at one token's [NUM_HEADS, 2 * HALF]; cos, sin: [1, BLOCK_HALF] fp32
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (heads < NUM_HEADS) & (dims < HALF)
    first = x_ptr + heads * stride_h + dims
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first + HALF, mask=mask, other=0.0).to(tl.float32)
    tl.store(first, (x1 * cos - x2 * sin).to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(first + HALF, (x2 * cos + x1 * sin).to(x_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    q_ptr, k_ptr, positions_ptr, cos_sin_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_cs,
    NUM_Q_HEADS: tl.constexpr, NUM_K_HEADS: tl.constexpr, HALF: tl.constexpr,
    BLOCK_QH: tl.constexpr, BLOCK_KH: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + token).to(tl.int64)
    dims = tl.arange(0, BLOCK_HALF)[None, :]
    row = cos_sin_ptr + pos * stride_cs
    cos = tl.load(row + dims, mask=dims < HALF, other=0.0).to(tl.float32)
    sin = tl.load(row + HALF + dims, mask=dims < HALF, other=0.0).to(tl.float32)
    _rotate_heads(q_ptr + token * stride_qt, stride_qh, cos, sin, NUM_Q_HEADS, HALF, BLOCK_QH, BLOCK_HALF)
    _rotate_heads(k_ptr + token * stride_kt, stride_kh, cos, sin, NUM_K_HEADS, HALF, BLOCK_KH, BLOCK_HALF)


def rotary_embedding(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
                     cos_sin_cache: torch.Tensor) -> None:
    """Rotate q [T, Hq, D] and k [T, Hkv, D] in place (views allowed, e.g. slices of a fused qkv
    output) by the angles of their positions [T]. cos_sin_cache: [max_position, D], row p holding
    cos(p * inv_freq) in its first half and sin in its second (rotate-half pairing: dim i with
    dim i + D/2). Positions are not range-checked (that would sync)."""
    require_tensor("q", q, ndim=3, dtypes=FLOAT_DTYPES)
    require_tensor("k", k, ndim=3, dtypes=FLOAT_DTYPES)
    require_tensor("positions", positions, ndim=1, dtypes=INDEX_DTYPES, last_dim_contiguous=False)
    require_tensor("cos_sin_cache", cos_sin_cache, ndim=2, dtypes=FLOAT_DTYPES)
    require_same("k", k, "q", q)
    require_same("positions", positions, "q", q, dtype=False)
    require_same("cos_sin_cache", cos_sin_cache, "q", q, dtype=False)
    num_tokens, num_q_heads, head_dim = q.shape
    if k.shape[0] != num_tokens or k.shape[2] != head_dim:
        raise ValueError(f"k has shape {tuple(k.shape)}, expected [{num_tokens}, kv_heads, {head_dim}]")
    if positions.shape[0] != num_tokens:
        raise ValueError(f"positions has {positions.shape[0]} entries for {num_tokens} tokens")
    if head_dim % 2 or cos_sin_cache.shape[1] != head_dim:
        raise ValueError(f"cos_sin_cache must be [max_position, head_dim={head_dim}] with an even "
                         f"head_dim, got {tuple(cos_sin_cache.shape)}")
    require_runnable(q, _rotary_kernel)
    if num_tokens == 0:
        return
    half = head_dim // 2
    _rotary_kernel[(num_tokens,)](
        q, k, positions, cos_sin_cache,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos_sin_cache.stride(0),
        NUM_Q_HEADS=num_q_heads, NUM_K_HEADS=k.shape[1], HALF=half,
        BLOCK_QH=next_power_of_2(num_q_heads), BLOCK_KH=next_power_of_2(k.shape[1]),
        BLOCK_HALF=next_power_of_2(half),
        num_warps=4 if num_q_heads * head_dim >= 2048 else 1,
    )


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o,
                         INTER: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr = False):
    pdl.enter(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < INTER
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + INTER + cols, mask=mask, other=0.0).to(tl.float32)
    out = gate * tl.sigmoid(gate) * up
    tl.store(out_ptr + row * stride_o + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up: [T, 2 * I] (gate in the first half, up in the second) -> SiLU(gate) * up, [T, I]."""
    require_tensor("gate_up", gate_up, ndim=2, dtypes=FLOAT_DTYPES)
    num_rows, width = gate_up.shape
    if width % 2:
        raise ValueError(f"gate_up must be [T, 2 * intermediate], got odd width {width}")
    require_runnable(gate_up, _silu_and_mul_kernel)
    inter = width // 2
    out = torch.empty((num_rows, inter), dtype=gate_up.dtype, device=gate_up.device)
    if num_rows == 0:
        return out
    block = min(1024, next_power_of_2(inter))
    _silu_and_mul_kernel[(num_rows, triton.cdiv(inter, block))](
        gate_up, out, gate_up.stride(0), out.stride(0),
        INTER=inter, BLOCK=block, num_warps=4 if block >= 512 else 1, **pdl.launch_options(gate_up.device),
    )
    return out
