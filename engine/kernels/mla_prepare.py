"""Latent attention's per-token preparation in one launch (the Triton twin of engine.mla's torch
steps between the projections and the attention): the latent's RMSNorm (kv_a_layernorm), DeepSeek's
rope on the shared key k_pe and on every head's q_pe, and the cache write of [norm(c), rope(k_pe)].
The torch form of these is about 20 small kernels per layer (casts, the norm's reductions, the
rope's slices, products and concatenations, the index-put), which at decode sizes cost more than
the work they do.

One program per token. The rope reads cos_sin [P, R] (cos times the attention factor in the first
half, sin in the second: engine.mla.LatentRotary) and rotates pairs (x0, x1), (x2, x3), ... under
`interleave`, else (x_i, x_{i + R/2}); the output is de-interleaved, as `engine.mla.apply_latent_rope`
writes it. A slot of -1 (a graph's padding row) writes no cache row. Nothing is read on the host.

`mla_prepare_uk` (the absorbed form's small steps: engine.mla.LatentAttention.fused_absorb) also
takes W_UK, so q_nope @ W_UK per head (torch.bmm's launch otherwise) is in the same launch. A
per-head GEMV wants more than one program per token: programs (token, head, UK_BLOCK columns of
the rank) each compute their slice of q_lat, and program (token, 0, 0) also does the token's work
above, so the norm, rope and cache write still happen once per token.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem.engine.kernels import pdl
from tandem.engine.kernels.validate import (FLOAT_DTYPES, INDEX_DTYPES, next_power_of_2, require_runnable,
                                            require_same, require_tensor)

# rank columns of q_lat per program of mla_prepare_uk: at V2-Lite's sizes (rank 512, nope 128, 16
# heads) 8 programs per head, 128 per token, each reading a [128, 64] slice of W_UK (16 KB in bf16).
# Not measured against other widths (bench/mla_gpu.py --absorb-launch sets it)
UK_BLOCK = 64
# PDL launches (engine.kernels.pdl: where the forward asks for them) for both kernels; the W_UK slice
# is loaded before the wait (no kernel writes weights). False: plain launches (bench/mla_gpu.py's
# `nopdl` variant compares)
PDL = True


@triton.jit
def _prepare_token(q_ptr, kv_ptr, pos_ptr, cos_sin_ptr, norm_ptr, cache_ptr, slot_ptr, q_pe_ptr, t,
                   eps, num_heads, stride_qt, stride_qh, stride_kt, stride_cs, stride_pt, stride_ph, block_size,
                   stride_cb, stride_cr, RANK: tl.constexpr, NOPE: tl.constexpr, HALF: tl.constexpr,
                   INTERLEAVE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr, HALF_PAD: tl.constexpr):
    """Token t's whole preparation: every head's q_pe rotated, [norm(c), rope(k_pe)] to its slot."""
    pos = tl.load(pos_ptr + t).to(tl.int64)
    j = tl.arange(0, HALF_PAD)
    jm = j < HALF
    cos = tl.load(cos_sin_ptr + pos * stride_cs + j, mask=jm, other=0.0)
    sin = tl.load(cos_sin_ptr + pos * stride_cs + HALF + j, mask=jm, other=0.0)
    # every head's q_pe: rows h, pair j
    h = tl.arange(0, BLOCK_H)[:, None]
    hm = (h < num_heads) & jm[None, :]
    q_row = q_ptr + t * stride_qt + h * stride_qh + NOPE
    if INTERLEAVE:
        x1 = tl.load(q_row + 2 * j[None, :], mask=hm, other=0.0).to(tl.float32)
        x2 = tl.load(q_row + 2 * j[None, :] + 1, mask=hm, other=0.0).to(tl.float32)
    else:
        x1 = tl.load(q_row + j[None, :], mask=hm, other=0.0).to(tl.float32)
        x2 = tl.load(q_row + HALF + j[None, :], mask=hm, other=0.0).to(tl.float32)
    out_row = q_pe_ptr + t * stride_pt + h * stride_ph
    dtype = q_pe_ptr.dtype.element_ty
    tl.store(out_row + j[None, :], (x1 * cos[None, :] - x2 * sin[None, :]).to(dtype), mask=hm)
    tl.store(out_row + HALF + j[None, :], (x2 * cos[None, :] + x1 * sin[None, :]).to(dtype), mask=hm)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:
        # the latent: RMSNorm in fp32, rounded to the model dtype before the weight (as engine.model.RMSNorm)
        r = tl.arange(0, BLOCK_R)
        rm = r < RANK
        c = tl.load(kv_ptr + t * stride_kt + r, mask=rm, other=0.0).to(tl.float32)
        c = c * tl.rsqrt(tl.sum(c * c, 0) / RANK + eps)
        w = tl.load(norm_ptr + r, mask=rm, other=0.0)
        c = (w.to(tl.float32) * c.to(dtype).to(tl.float32)).to(dtype)
        row = cache_ptr + (slot // block_size) * stride_cb + (slot % block_size) * stride_cr
        tl.store(row + r, c, mask=rm)
        k_pe = kv_ptr + t * stride_kt + RANK
        if INTERLEAVE:
            k1 = tl.load(k_pe + 2 * j, mask=jm, other=0.0).to(tl.float32)
            k2 = tl.load(k_pe + 2 * j + 1, mask=jm, other=0.0).to(tl.float32)
        else:
            k1 = tl.load(k_pe + j, mask=jm, other=0.0).to(tl.float32)
            k2 = tl.load(k_pe + HALF + j, mask=jm, other=0.0).to(tl.float32)
        tl.store(row + RANK + j, (k1 * cos - k2 * sin).to(dtype), mask=jm)
        tl.store(row + RANK + HALF + j, (k2 * cos + k1 * sin).to(dtype), mask=jm)


@triton.jit
def _prepare_kernel(q_ptr, kv_ptr, pos_ptr, cos_sin_ptr, norm_ptr, cache_ptr, slot_ptr, q_pe_ptr,
                    eps, num_heads, stride_qt, stride_qh, stride_kt, stride_cs, stride_pt, stride_ph, block_size,
                    stride_cb, stride_cr, RANK: tl.constexpr, NOPE: tl.constexpr, HALF: tl.constexpr,
                    INTERLEAVE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr, HALF_PAD: tl.constexpr,
                    USE_PDL: tl.constexpr = False):
    pdl.enter(USE_PDL)
    _prepare_token(q_ptr, kv_ptr, pos_ptr, cos_sin_ptr, norm_ptr, cache_ptr, slot_ptr, q_pe_ptr,
                   tl.program_id(0).to(tl.int64), eps, num_heads, stride_qt, stride_qh, stride_kt, stride_cs,
                   stride_pt, stride_ph, block_size, stride_cb, stride_cr, RANK, NOPE, HALF, INTERLEAVE, BLOCK_R,
                   BLOCK_H, HALF_PAD)


@triton.jit
def _prepare_uk_kernel(q_ptr, kv_ptr, pos_ptr, cos_sin_ptr, norm_ptr, cache_ptr, slot_ptr, q_pe_ptr, w_ptr, q_lat_ptr,
                       eps, num_heads, stride_qt, stride_qh, stride_kt, stride_cs, stride_pt, stride_ph, block_size,
                       stride_cb, stride_cr, stride_wh, stride_wn, stride_lt, stride_lh,
                       RANK: tl.constexpr, NOPE: tl.constexpr, HALF: tl.constexpr, INTERLEAVE: tl.constexpr,
                       BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr, HALF_PAD: tl.constexpr,
                       NOPE_PAD: tl.constexpr, BLOCK_UK: tl.constexpr, USE_PDL: tl.constexpr = False):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    rb = tl.program_id(2)
    # q_lat[t, h, block] = q_nope[t, h] @ W_UK[h][:, block]: fp32 sums, rounded once (as torch.bmm's output);
    # the weight slice first (before the PDL wait: no kernel writes it)
    n = tl.arange(0, NOPE_PAD)
    nm = n < NOPE
    r = rb * BLOCK_UK + tl.arange(0, BLOCK_UK)
    rm = r < RANK
    w = tl.load(w_ptr + h * stride_wh + n[:, None] * stride_wn + r[None, :], mask=nm[:, None] & rm[None, :],
                other=0.0)
    pdl.enter(USE_PDL)
    if (h == 0) & (rb == 0):  # once per token
        _prepare_token(q_ptr, kv_ptr, pos_ptr, cos_sin_ptr, norm_ptr, cache_ptr, slot_ptr, q_pe_ptr, t, eps,
                       num_heads, stride_qt, stride_qh, stride_kt, stride_cs, stride_pt, stride_ph, block_size,
                       stride_cb, stride_cr, RANK, NOPE, HALF, INTERLEAVE, BLOCK_R, BLOCK_H, HALF_PAD)
    x = tl.load(q_ptr + t * stride_qt + h * stride_qh + n, mask=nm, other=0.0).to(tl.float32)
    q_lat = tl.sum(x[:, None] * w.to(tl.float32), 0)
    tl.store(q_lat_ptr + t * stride_lt + h * stride_lh + r, q_lat.to(q_lat_ptr.dtype.element_ty), mask=rm)


def _check(q, kv, positions, cos_sin, norm_weight, cache, slot_mapping, nope) -> tuple[int, int]:
    """-> (rank, rope), or ValueError naming the argument."""
    require_tensor("q", q, ndim=3, dtypes=FLOAT_DTYPES, last_dim_contiguous=True)
    require_tensor("kv", kv, ndim=2, dtypes=FLOAT_DTYPES, last_dim_contiguous=True)
    require_tensor("cache", cache, ndim=4, dtypes=FLOAT_DTYPES)
    require_tensor("cos_sin", cos_sin, ndim=2, dtypes=(torch.float32,))
    require_tensor("norm_weight", norm_weight, ndim=1, dtypes=FLOAT_DTYPES)
    require_tensor("positions", positions, ndim=1, dtypes=INDEX_DTYPES)
    require_tensor("slot_mapping", slot_mapping, ndim=1, dtypes=INDEX_DTYPES)
    for name, t in (("kv", kv), ("cache", cache)):
        require_same(name, t, "q", q)
    for name, t in (("cos_sin", cos_sin), ("norm_weight", norm_weight), ("positions", positions),
                    ("slot_mapping", slot_mapping)):
        require_same(name, t, "q", q, dtype=False)
    require_runnable(q, _prepare_kernel)
    T, H, D = q.shape
    rope = cos_sin.shape[1]
    rank = kv.shape[1] - rope
    if D != nope + rope or rope % 2 or rank <= 0:
        raise ValueError(f"q {tuple(q.shape)} must be [T, H, nope ({nope}) + rope ({rope})] and kv "
                         f"{tuple(kv.shape)} [T, rank + rope], rope even")
    if kv.shape[0] != T or positions.shape[0] != T or slot_mapping.shape[0] != T:
        raise ValueError(f"kv, positions and slot_mapping must have q's {T} tokens")
    if norm_weight.shape[0] != rank or cache.shape[2] != 1 or cache.shape[3] != rank + rope:
        raise ValueError(f"norm_weight {tuple(norm_weight.shape)} must be [{rank}] and cache {tuple(cache.shape)} "
                         f"[num_blocks, block_size, 1, {rank + rope}]")
    if cache.stride(3) != 1:
        raise ValueError(f"cache rows must be contiguous, got strides {cache.stride()}")
    return rank, rope


def mla_prepare(q: torch.Tensor, kv: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
                norm_weight: torch.Tensor, eps: float, cache: torch.Tensor, slot_mapping: torch.Tensor,
                nope: int, interleave: bool) -> torch.Tensor:
    """q [T, H, nope + rope] (views allowed, last dim contiguous); kv [T, rank + rope] (rows
    contiguous): the latent c then k_pe; positions, slot_mapping [T]; cos_sin [P, rope] fp32;
    norm_weight [rank]; cache: one layer's [num_blocks, block_size, 1, rank + rope].
    Writes [norm(c), rope(k_pe)] to each token's slot (none for slot -1) and returns q_pe rotated,
    [T, H, rope] in q's dtype (de-interleaved)."""
    rank, rope = _check(q, kv, positions, cos_sin, norm_weight, cache, slot_mapping, nope)
    T, H, _ = q.shape
    q_pe = torch.empty((T, H, rope), dtype=q.dtype, device=q.device)
    if T == 0:
        return q_pe
    _prepare_kernel[(T,)](
        q, kv, positions, cos_sin, norm_weight, cache, slot_mapping, q_pe, float(eps), H,
        q.stride(0), q.stride(1), kv.stride(0), cos_sin.stride(0), q_pe.stride(0), q_pe.stride(1), cache.shape[1],
        cache.stride(0), cache.stride(1), RANK=rank, NOPE=nope, HALF=rope // 2, INTERLEAVE=interleave,
        BLOCK_R=next_power_of_2(rank), BLOCK_H=next_power_of_2(H), HALF_PAD=next_power_of_2(rope // 2),
        **_launch(q.device))
    return q_pe


def mla_prepare_uk(q: torch.Tensor, kv: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
                   norm_weight: torch.Tensor, eps: float, cache: torch.Tensor, slot_mapping: torch.Tensor,
                   nope: int, interleave: bool, w_uk: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """mla_prepare with the absorbed form's W_UK product in the same launch: also w_uk [H, nope,
    rank] (kv_b_proj's K rows per head, a view: rows contiguous) -> (q_lat [T, H, rank], q_pe
    [T, H, rope]), both in q's dtype; q_lat[t, h] = q_nope[t, h] @ w_uk[h]."""
    rank, rope = _check(q, kv, positions, cos_sin, norm_weight, cache, slot_mapping, nope)
    T, H, _ = q.shape
    require_tensor("w_uk", w_uk, ndim=3, dtypes=FLOAT_DTYPES, last_dim_contiguous=True)
    require_same("w_uk", w_uk, "q", q)
    if w_uk.shape != (H, nope, rank):
        raise ValueError(f"w_uk {tuple(w_uk.shape)} must be [heads ({H}), nope ({nope}), rank ({rank})]")
    q_pe = torch.empty((T, H, rope), dtype=q.dtype, device=q.device)
    q_lat = torch.empty((T, H, rank), dtype=q.dtype, device=q.device)
    if T == 0:
        return q_lat, q_pe
    block_uk = min(UK_BLOCK, next_power_of_2(rank))
    _prepare_uk_kernel[(T, H, triton.cdiv(rank, block_uk))](
        q, kv, positions, cos_sin, norm_weight, cache, slot_mapping, q_pe, w_uk, q_lat, float(eps), H,
        q.stride(0), q.stride(1), kv.stride(0), cos_sin.stride(0), q_pe.stride(0), q_pe.stride(1), cache.shape[1],
        cache.stride(0), cache.stride(1), w_uk.stride(0), w_uk.stride(1), q_lat.stride(0), q_lat.stride(1),
        RANK=rank, NOPE=nope, HALF=rope // 2, INTERLEAVE=interleave, BLOCK_R=next_power_of_2(rank),
        BLOCK_H=next_power_of_2(H), HALF_PAD=next_power_of_2(rope // 2), NOPE_PAD=next_power_of_2(nope),
        BLOCK_UK=block_uk, **_launch(q.device))
    return q_lat, q_pe


def _launch(device: torch.device) -> dict:
    """The launch keywords of both kernels: 4 warps and the PDL options on a GPU (the interpreter: none)."""
    if device.type != "cuda":
        return {}
    return {"num_warps": 4, **pdl.launch_options(device, PDL)}
