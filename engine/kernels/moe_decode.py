"""A mixture-of-experts layer of a decode step (1 to MAX_TOKENS tokens) in three launches, where
engine.moe.SparseMoE.forward_fused runs seven (router GEMM, routing, the shared experts' two
GEMVs, the routed experts' gate/up, down and slot sum) and pays each launch's ramp and tail:

1. `_router_shared_kernel`: the router's logits [T, E] in fp32 (programs [0, R) by pid; model-dtype
   operands, whose products are exact in fp32, summed in fp32 as Router.logits sums them), and the
   shared experts' SiLU(gate) * up [T, Is] (programs from R on; none without shared experts).
   With `norm` (SparseMoE.norm_forward_fused) it also does the post-attention RMSNorm that would be
   a launch before it: each program normalises its input tiles itself, and the first program of
   each token writes the new residual stream and the normalised row that launches 2 and 3 read.
2. `_routed_gate_up_kernel`: a program per ((token, slot), channel block) routes its token itself
   from the fp32 logits (engine.kernels.moe_route._route_token, the code route_fused runs: the same
   choice, ties to the lower expert) and computes its slot's expert's SiLU(gate) * up [T * k, I];
   the first program of each token writes the token's ids and weights for launch 3 (so launch 3's
   programs read 2k numbers instead of routing again before their first weight load).
3. `_down_sum_kernel`: a program per (token, block of output rows) loops over the token's k experts
   and the shared experts (one more expert of weight 1 and width Is): each expert's down rows . h in
   fp32, rounded to the model dtype, times its weight, summed in fp32 and rounded once.

Every GEMV streams its weight rows as engine.kernels.gemv's does: a program holds a few rows, loads
16-byte runs along K, accumulates w * x into a [rows, BLOCK_K / run] fp32 register tile (each
thread's run summed in its registers) and reduces across threads once per expert, at the end.
Tiles: `TILES` (unmeasured defaults, to sweep on the GPU). Rounding points are those of the path it
replaces (engine.kernels.moe's GEMV path with the shared output as `add`, the shared MLP through
TritonOps): gate and up each rounded to the model dtype, then SiLU(gate) * up; each down output
rounded, the routed ones weighted in fp32 in slot order, the shared one added last, one final
rounding. Only the order of each dot product's fp32 sum differs, so an intermediate may round the
other way: at DeepSeek-V2-Lite's shape in bf16 on the H200, 0 to 8% of the outputs at 1-4 tokens
were one ulp from the seven launches' (tests/gpu/test_moe_gpu.py); fp32 stays within 1e-5 of fp64. No
host reads a device value and every buffer's size follows from shapes alone, so a step with it can
be captured in a CUDA graph (checked on the H200: replays give the eager outputs).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tandem.engine.config import MoEConfig
from tandem.engine.kernels import pdl
from tandem.engine.kernels.moe_route import _route_token, check_routing, route_constants
from tandem.engine.kernels.validate import (FLOAT_DTYPES, next_power_of_2, require_runnable, require_same,
                                            require_tensor)

# Whether SparseMoE.forward_fused takes this path for 1..MAX_TOKENS tokens. On the H200
# (docs/benchmarks.md, issue 29, 2026-12-04): DeepSeek-V2-Lite's layer from a CUDA graph at 1/2/3/4
# tokens 55.1/76.2/99.2/132.3 us against the seven launches' 57.2/88.1/113.4/138.1 (bench/moe_gpu.py
# --decode-sweep), and the whole batch-1 step 2.52 ms against 2.58 (bench/mla_gpu.py --fused-decode).
FUSED_DECODE = True
# Up to 4 tokens: batch-2..4 decode steps and a speculative verify step of 1 + 3 tokens. Each
# token's programs read its experts' weights and the shared experts' (the latter through L2 for the
# second token on: a block's programs for every token are adjacent), so the bytes grow with T
# where the grouped path's do not; at 4 tokens it still won by 4% (above), 5+ were not timed.
MAX_TOKENS = 4
# PDL launches (engine.kernels.pdl: where the forward asks for them) for the three kernels; launch 1
# loads its first weight tile before it waits (no kernel writes weights). False: plain launches
# (bench/mla_gpu.py's `nopdl` variant compares)
PDL = True
# SparseMoE.norm_forward_fused folds the post-attention RMSNorm into launch 1 (moe_decode's `norm`):
# one launch fewer per MoE layer. False: rms_norm's own launch first (bench/mla_gpu.py's `nonorm`)
NORM_FOLD = True


@dataclass(frozen=True)
class DecodeTiles:
    # weight rows per program in launches 1 and 2: (gate, up) channel pairs, or router rows; 16 the
    # sweep's best at 2-4 tokens and second at 1 (55.1 us against 53.6 for down (2, 1024) there)
    gate_up_rows: int = 16
    gate_up_block_k: int = 512  # columns per tile in 16-bit (fp32 halves it: the same 16-byte runs)
    down_rows: int = 4  # output rows per program in launch 3
    down_block_k: int = 512
    num_warps: int = 4
    num_stages: int = 2


TILES = DecodeTiles()


@dataclass(frozen=True)
class DecodedMoE:
    """The layer's output [T, H] (model dtype) and what routed it: logits [T, E] fp32, weights
    [T, k] fp32 and ids [T, k] int32, as route_fused returns them; with the norm folded in
    (moe_decode's `norm`), the new residual stream and the normalised input [T, H] (else None)."""
    out: torch.Tensor
    logits: torch.Tensor
    weights: torch.Tensor
    ids: torch.Tensor
    residual: torch.Tensor | None = None
    normed: torch.Tensor | None = None


@triton.jit
def _stream_tile(x_ptr, r_ptr, ks, k_mask):
    # the new residual stream at ks, round(x + r) in the model dtype, as rms_norm rounds the sum
    return (tl.load(x_ptr + ks, mask=k_mask, other=0.0).to(tl.float32)
            + tl.load(r_ptr + ks, mask=k_mask, other=0.0).to(tl.float32)).to(x_ptr.dtype.element_ty)


@triton.jit
def _input_tile(x_ptr, r_ptr, g_ptr, ks, k_mask, rstd, NORM: tl.constexpr):
    # x[ks] in fp32; NORM: RMSNorm(x + r)[ks] * g with rms_norm's roundings (engine.kernels.fused)
    if NORM:
        dt = x_ptr.dtype.element_ty
        s = _stream_tile(x_ptr, r_ptr, ks, k_mask).to(tl.float32)
        g = tl.load(g_ptr + ks, mask=k_mask, other=0.0).to(tl.float32)
        return ((s * rstd).to(dt).to(tl.float32) * g).to(dt).to(tl.float32)
    return tl.load(x_ptr + ks, mask=k_mask, other=0.0).to(tl.float32)


@triton.jit
def _norm_rstd(x_ptr, r_ptr, K, eps, BLOCK_H: tl.constexpr):
    # 1 / rms of round(x + r) over the whole row, as rms_norm computes it
    cols = tl.arange(0, BLOCK_H)
    s = _stream_tile(x_ptr, r_ptr, cols, cols < K).to(tl.float32)
    return tl.rsqrt(tl.sum(s * s, axis=0) / K + eps)


@triton.jit
def _dot_rows(w_rows, x_ptr, n_mask, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, VEC: tl.constexpr,
              EVEN_K: tl.constexpr, WAIT_AFTER_FIRST: tl.constexpr = False, r_ptr=None, g_ptr=None, eps=0.0,
              NORM: tl.constexpr = False, BLOCK_H: tl.constexpr = 16):
    # w_rows [BLOCK_N] pointers to weight rows -> ([BLOCK_N] fp32: each row . x[0:K], the norm's 1/rms).
    # Each thread's VEC columns (one 16-byte load) summed in its registers; the one cross-thread sum
    # at the end. WAIT_AFTER_FIRST: the kernel's PDL wait comes after the first weight tile's load
    # (the input after it). NORM: the input is RMSNorm(x + r) * g (_input_tile), 1/rms worked out first
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_N, BLOCK_K // VEC), dtype=tl.float32)
    start = 0
    if WAIT_AFTER_FIRST:
        k_mask = rk < K
        w_first = tl.load(w_rows[:, None] + rk[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        pdl.enter(True)
    rstd = 1.0
    if NORM:
        rstd = _norm_rstd(x_ptr, r_ptr, K, eps, BLOCK_H)
    if WAIT_AFTER_FIRST:
        x = _input_tile(x_ptr, r_ptr, g_ptr, rk, k_mask, rstd, NORM)
        acc += tl.sum(tl.reshape(w_first.to(tl.float32) * x[None, :], (BLOCK_N, BLOCK_K // VEC, VEC)), axis=2)
        start = BLOCK_K
    for k0 in range(start, K, BLOCK_K):
        ks = k0 + rk
        if EVEN_K:
            w = tl.load(w_rows[:, None] + ks[None, :], mask=n_mask[:, None], other=0.0).to(tl.float32)
            x = _input_tile(x_ptr, r_ptr, g_ptr, ks, rk < BLOCK_K, rstd, NORM)
        else:
            k_mask = ks < K
            w = tl.load(w_rows[:, None] + ks[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
            w = w.to(tl.float32)
            x = _input_tile(x_ptr, r_ptr, g_ptr, ks, k_mask, rstd, NORM)
        acc += tl.sum(tl.reshape(w * x[None, :], (BLOCK_N, BLOCK_K // VEC, VEC)), axis=2)
    return tl.sum(acc, axis=1), rstd


@triton.jit
def _pair_rows(block, inter, BLOCK_N: tl.constexpr):
    # a gate/up weight [2 * inter, K]: row j of the tile is gate row c (j even) or up row c (j odd)
    # of the block's channels c -> (rows, which exist, the block's channels [BLOCK_N / 2])
    j = tl.arange(0, BLOCK_N)
    channel = block * (BLOCK_N // 2) + j // 2
    return ((channel + (j % 2) * inter).to(tl.int64), channel < inter,
            block * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2))


@triton.jit
def _router_shared_kernel(x_ptr, wr_ptr, logits_ptr, ws_ptr, hs_ptr, r_ptr, g_ptr, xn_ptr, new_r_ptr, eps,
                          T, H, E, I_S, ROUTER_PROGRAMS,
                          stride_x, stride_wr, stride_l, stride_ws, stride_hs,
                          BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, VEC: tl.constexpr, EVEN_K: tl.constexpr,
                          NORM: tl.constexpr = False, BLOCK_H: tl.constexpr = 16, USE_PDL: tl.constexpr = False):
    # with PDL each branch's _dot_rows waits, after its first weight tile's load. NORM: x is the
    # attention's output and r the residual stream (rows of stride_x too); every program works out
    # the norm of its token itself, and the first router program of each token writes the new
    # stream round(x + r) to new_r and the normalised row to xn (what rms_norm would write)
    pid = tl.program_id(0)
    t = pid % T  # tokens fastest: a block's programs for every token run side by side (its rows from L2)
    block = pid // T
    row = t.to(tl.int64) * stride_x
    x_row, r_row = x_ptr + row, r_ptr + row
    if block < ROUTER_PROGRAMS:  # logits [T, E] fp32, never rounded
        rn = block * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = rn < E
        logits, rstd = _dot_rows(wr_ptr + rn.to(tl.int64) * stride_wr, x_row, n_mask, H, BLOCK_N, BLOCK_K, VEC,
                                 EVEN_K, USE_PDL, r_row, g_ptr, eps, NORM, BLOCK_H)
        tl.store(logits_ptr + t.to(tl.int64) * stride_l + rn, logits, mask=n_mask)
        if NORM:
            if block == 0:
                cols = tl.arange(0, BLOCK_H)
                cm = cols < H
                tl.store(new_r_ptr + row + cols, _stream_tile(x_row, r_row, cols, cm), mask=cm)
                tl.store(xn_ptr + row + cols, _input_tile(x_row, r_row, g_ptr, cols, cm, rstd, NORM)
                         .to(xn_ptr.dtype.element_ty), mask=cm)
    else:  # the shared experts' gate and up, each rounded as their GEMV's output is, then SiLU * up
        rows, n_mask, channels = _pair_rows(block - ROUTER_PROGRAMS, I_S, BLOCK_N)
        out, rstd = _dot_rows(ws_ptr + rows * stride_ws, x_row, n_mask, H, BLOCK_N, BLOCK_K, VEC, EVEN_K, USE_PDL,
                              r_row, g_ptr, eps, NORM, BLOCK_H)
        dt = hs_ptr.dtype.element_ty
        gate, up = tl.split(tl.reshape(out.to(dt).to(tl.float32), (BLOCK_N // 2, 2)))
        tl.store(hs_ptr + t.to(tl.int64) * stride_hs + channels, (gate * tl.sigmoid(gate) * up).to(dt),
                 mask=channels < I_S)


@triton.jit
def _routed_gate_up_kernel(x_ptr, logits_ptr, bias_ptr, w_ptr, h_ptr, ids_ptr, weights_ptr, scale, H, INTER,
                           stride_x, stride_l, stride_we, stride_wn, stride_h,
                           N_GROUP: tl.constexpr, GROUP_SIZE: tl.constexpr, TOPK_GROUP: tl.constexpr,
                           TOP_K: tl.constexpr, G_PAD: tl.constexpr, S_PAD: tl.constexpr, K_PAD: tl.constexpr,
                           SOFTMAX: tl.constexpr, HAS_BIAS: tl.constexpr, RANKING: tl.constexpr,
                           RENORM: tl.constexpr, BIG: tl.constexpr,
                           BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, VEC: tl.constexpr, EVEN_K: tl.constexpr,
                           USE_PDL: tl.constexpr = False):
    pdl.enter(USE_PDL)  # the logits are launch 1's
    pair = tl.program_id(0)  # t * TOP_K + slot
    block = tl.program_id(1)
    t, s = pair // TOP_K, pair % TOP_K
    ids, weights = _route_token(logits_ptr + t.to(tl.int64) * stride_l, bias_ptr, scale, N_GROUP, GROUP_SIZE,
                                TOPK_GROUP, TOP_K, G_PAD, S_PAD, K_PAD, SOFTMAX, HAS_BIAS, RANKING, RENORM, BIG)
    slots = tl.arange(0, K_PAD)
    writes = (slots < TOP_K) & (slots * 0 + s + block == 0)  # one program per token (slot 0, block 0) writes
    tl.store(ids_ptr + t * TOP_K + slots, ids, mask=writes)
    tl.store(weights_ptr + t * TOP_K + slots, weights, mask=writes)
    expert = tl.sum(tl.where(slots == s, ids, 0), 0).to(tl.int64)
    rows, n_mask, channels = _pair_rows(block, INTER, BLOCK_N)
    out, _ = _dot_rows(w_ptr + expert * stride_we + rows * stride_wn, x_ptr + t.to(tl.int64) * stride_x, n_mask, H,
                       BLOCK_N, BLOCK_K, VEC, EVEN_K)
    # gate and up rounded to the model dtype before the activation, as engine.kernels.moe's are
    dt = h_ptr.dtype.element_ty
    gate, up = tl.split(tl.reshape(out.to(dt).to(tl.float32), (BLOCK_N // 2, 2)))
    tl.store(h_ptr + pair.to(tl.int64) * stride_h + channels, (gate / (1.0 + tl.exp(-gate)) * up).to(dt),
             mask=channels < INTER)


@triton.jit
def _down_sum_kernel(h_ptr, w2_ptr, ids_ptr, weights_ptr, hs_ptr, ws_ptr, out_ptr, T, H, INTER, I_S,
                     stride_h, stride_we, stride_wn, stride_hs, stride_ws, stride_o,
                     TOP_K: tl.constexpr, HAS_SHARED: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     VEC: tl.constexpr, EVEN_I: tl.constexpr, EVEN_I_S: tl.constexpr, USE_PDL: tl.constexpr = False):
    pdl.enter(USE_PDL)  # the ids, weights and h are launch 2's
    # out[t, n] = sum over slots s of weights[t, s] * rnd(w2[ids[t, s], n] . h[t, s]) (+ rnd(ws[n] . hs[t])),
    # rnd the model dtype's rounding, the sum in fp32 in that order (_down_pair_gemv_kernel + _sum_slots_kernel)
    pid = tl.program_id(0)
    t = (pid % T).to(tl.int64)  # tokens fastest, as launch 1: the shared rows read once from HBM
    rn = (pid // T) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = rn < H
    dt = out_ptr.dtype.element_ty
    total = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for s in range(TOP_K):
        pair = t * TOP_K + s
        expert = tl.load(ids_ptr + pair).to(tl.int64)
        y, _ = _dot_rows(w2_ptr + expert * stride_we + rn.to(tl.int64) * stride_wn, h_ptr + pair * stride_h, n_mask,
                         INTER, BLOCK_N, BLOCK_K, VEC, EVEN_I)
        total += y.to(dt).to(tl.float32) * tl.load(weights_ptr + pair)
    if HAS_SHARED:
        y, _ = _dot_rows(ws_ptr + rn.to(tl.int64) * stride_ws, hs_ptr + t * stride_hs, n_mask, I_S,
                         BLOCK_N, BLOCK_K, VEC, EVEN_I_S)
        total += y.to(dt).to(tl.float32)
    tl.store(out_ptr + t * stride_o + rn, total.to(dt), mask=n_mask)


def _check(x, router_weight, moe, score_bias, w13, w2, shared_gate_up, shared_down) -> None:
    require_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES)
    require_tensor("router_weight", router_weight, ndim=2, dtypes=FLOAT_DTYPES)
    require_tensor("w13", w13, ndim=3, dtypes=FLOAT_DTYPES)
    require_tensor("w2", w2, ndim=3, dtypes=FLOAT_DTYPES)
    for name, t in (("router_weight", router_weight), ("w13", w13), ("w2", w2)):
        require_same(name, t, "x", x)
    tokens, hidden = x.shape
    if tokens > MAX_TOKENS:
        raise ValueError(f"x has {tokens} tokens; the decode path takes at most MAX_TOKENS = {MAX_TOKENS}")
    experts, two_i, _ = w13.shape
    if router_weight.shape != (experts, hidden):
        raise ValueError(f"router_weight is {tuple(router_weight.shape)}, need [E, H] = [{experts}, {hidden}]")
    if w13.shape[2] != hidden or two_i % 2 or w2.shape != (experts, hidden, two_i // 2):
        raise ValueError(f"w13 {tuple(w13.shape)} and w2 {tuple(w2.shape)} do not fit x {tuple(x.shape)}: "
                         f"need w13 [E, 2I, H] and w2 [E, H, I] with H = {hidden}")
    if not (x.is_contiguous() and w13.is_contiguous() and w2.is_contiguous()):
        raise ValueError("x, w13 and w2 must be contiguous")
    check_routing(experts, x.device, moe, score_bias)
    if (shared_gate_up is None) != (shared_down is None):
        raise ValueError("shared_gate_up and shared_down come together (both, or neither without shared experts)")
    if shared_gate_up is not None:
        require_tensor("shared_gate_up", shared_gate_up, ndim=2, dtypes=FLOAT_DTYPES)
        require_tensor("shared_down", shared_down, ndim=2, dtypes=FLOAT_DTYPES)
        require_same("shared_gate_up", shared_gate_up, "x", x)
        require_same("shared_down", shared_down, "x", x)
        inter_s = shared_down.shape[1]
        if shared_gate_up.shape != (2 * inter_s, hidden) or shared_down.shape[0] != hidden:
            raise ValueError(f"shared_gate_up {tuple(shared_gate_up.shape)} and shared_down "
                             f"{tuple(shared_down.shape)} do not fit: need [2Is, {hidden}] and [{hidden}, Is]")


def _check_norm(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor) -> None:
    require_tensor("residual", residual, ndim=2, dtypes=FLOAT_DTYPES)
    require_tensor("norm weight", norm_weight, ndim=1, dtypes=FLOAT_DTYPES)
    require_same("residual", residual, "x", x, shape=True)
    require_same("norm weight", norm_weight, "x", x, dtype=False)
    if not residual.is_contiguous() or norm_weight.shape[0] != x.shape[1]:
        raise ValueError(f"residual must be contiguous and norm weight [{x.shape[1]}], got strides "
                         f"{residual.stride()} and {tuple(norm_weight.shape)}")


def _tiles(x: torch.Tensor, tiles: DecodeTiles, experts: int, inter: int, inter_s: int) -> dict:
    """Each launch's (rows per program, K tile). The interpreter (CPU) pays per program, not per
    byte: there, the widest tiles that fit each matrix."""
    hidden = x.shape[1]
    if x.device.type != "cuda":
        rows1 = min(256, max(next_power_of_2(experts), 2 * next_power_of_2(max(inter_s, 1))))
        return {"rows1": rows1, "rows2": min(256, 2 * next_power_of_2(inter)), "rows3": min(128, next_power_of_2(hidden)),
                "k1": min(256, next_power_of_2(hidden)), "k3": min(256, next_power_of_2(max(inter, inter_s)))}
    scale = 2 if x.dtype == torch.float32 else 1
    return {"rows1": tiles.gate_up_rows, "rows2": tiles.gate_up_rows, "rows3": tiles.down_rows,
            "k1": max(16, min(tiles.gate_up_block_k // scale, next_power_of_2(hidden))),
            "k3": max(16, min(tiles.down_block_k // scale, next_power_of_2(max(inter, inter_s))))}


def moe_decode(x: torch.Tensor, router_weight: torch.Tensor, moe: MoEConfig, score_bias: torch.Tensor | None,
               w13: torch.Tensor, w2: torch.Tensor, shared_gate_up: torch.Tensor | None = None,
               shared_down: torch.Tensor | None = None, *, tiles: DecodeTiles | None = None,
               norm: tuple[torch.Tensor, torch.Tensor, float] | None = None) -> DecodedMoE:
    """SparseMoE.forward of x [T, H] (T <= MAX_TOKENS) in three launches: router_weight [E, H];
    `moe` and score_bias [E] fp32 (noaux_tc only) as engine.moe.route takes them; w13 [E, 2I, H]
    (gate rows, then up rows), w2 [E, H, I]; the shared experts' gate/up [2Is, H] and down [H, Is]
    (both None without shared experts); all weights in x's dtype.
    `norm` = (residual [T, H], norm weight [H], eps): the layer's input is rms_norm(x, weight, eps,
    residual)'s, worked out inside the first launch (engine.kernels.fused.rms_norm's launch gone);
    the result carries the new residual stream, round(x + residual), and the normalised input."""
    _check(x, router_weight, moe, score_bias, w13, w2, shared_gate_up, shared_down)
    if norm is not None:
        _check_norm(x, *norm[:2])
    require_runnable(x, _routed_gate_up_kernel)
    tiles = tiles or TILES
    if tiles.gate_up_rows % 2 or tiles.gate_up_rows < 2:
        raise ValueError(f"tiles.gate_up_rows must be even ((gate, up) pairs), got {tiles.gate_up_rows}")
    (tokens, hidden), (experts, two_i, _), k = x.shape, w13.shape, moe.top_k
    inter, dev = two_i // 2, x.device
    logits = torch.empty((tokens, experts), dtype=torch.float32, device=dev)
    weights = torch.empty((tokens, k), dtype=torch.float32, device=dev)
    ids = torch.empty((tokens, k), dtype=torch.int32, device=dev)
    out = torch.empty_like(x)
    normed, new_residual = (torch.empty_like(x), torch.empty_like(x)) if norm is not None else (None, None)
    if tokens == 0:
        return DecodedMoE(out, logits, weights, ids, new_residual, normed)
    shared = shared_gate_up is not None
    inter_s = shared_down.shape[1] if shared else 0
    ws, wd = (shared_gate_up, shared_down) if shared else (x, x)  # x stands in for unused pointers
    hs = torch.empty((tokens, inter_s), dtype=x.dtype, device=dev) if shared else x
    h = torch.empty((tokens * k, inter), dtype=x.dtype, device=dev)
    cfg = _tiles(x, tiles, experts, inter, inter_s)
    vec = 16 // x.element_size()
    launch = ({"num_warps": tiles.num_warps, "num_stages": tiles.num_stages,
               **pdl.launch_options(dev, PDL)} if dev.type == "cuda" else {})
    k1, k3 = cfg["k1"], cfg["k3"]
    router_programs = triton.cdiv(experts, cfg["rows1"])
    shared_programs = triton.cdiv(inter_s, cfg["rows1"] // 2)
    folded = (norm[0], norm[1], normed, new_residual, float(norm[2])) if norm is not None else (x, x, x, x, 0.0)
    _router_shared_kernel[(tokens * (router_programs + shared_programs),)](
        x, router_weight, logits, ws, hs, *folded, tokens, hidden, experts, inter_s, router_programs,
        x.stride(0), router_weight.stride(0), logits.stride(0), ws.stride(0), hs.stride(0),
        BLOCK_N=cfg["rows1"], BLOCK_K=k1, VEC=min(vec, k1), EVEN_K=hidden % k1 == 0, NORM=norm is not None,
        BLOCK_H=next_power_of_2(hidden), **launch)
    if norm is not None:
        x = normed  # launch 2's input
    _routed_gate_up_kernel[(tokens * k, triton.cdiv(inter, cfg["rows2"] // 2))](
        x, logits, score_bias if score_bias is not None else logits, w13, h, ids, weights,
        float(moe.routed_scaling_factor), hidden, inter, x.stride(0), logits.stride(0), w13.stride(0),
        w13.stride(1), h.stride(0), **route_constants(moe),
        BLOCK_N=cfg["rows2"], BLOCK_K=k1, VEC=min(vec, k1), EVEN_K=hidden % k1 == 0, **launch)
    _down_sum_kernel[(tokens * triton.cdiv(hidden, cfg["rows3"]),)](
        h, w2, ids, weights, hs, wd, out, tokens, hidden, inter, inter_s,
        h.stride(0), w2.stride(0), w2.stride(1), hs.stride(0), wd.stride(0), out.stride(0),
        TOP_K=k, HAS_SHARED=shared, BLOCK_N=cfg["rows3"], BLOCK_K=k3, VEC=min(vec, k3),
        EVEN_I=inter % k3 == 0, EVEN_I_S=not shared or inter_s % k3 == 0, **launch)
    return DecodedMoE(out, logits, weights, ids, new_residual, normed)


def takes(tokens: int) -> bool:
    """Whether SparseMoE.forward_fused runs a step of `tokens` tokens here (FUSED_DECODE, 1..MAX_TOKENS)."""
    return FUSED_DECODE and 1 <= tokens <= MAX_TOKENS
