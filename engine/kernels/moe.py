"""The routed experts of a mixture-of-experts layer in Triton, the CUDA path of engine.moe (whose
`experts_torch` is the reference); `fused_experts` picks one of two paths by token count.

Grouped (vLLM's fused_moe scheme; prefill and large batches): each token's k (token, slot) pairs
are sorted by expert and every expert's run is padded to a multiple of BLOCK_M (one launch,
engine.kernels.moe_route.align_fused, up to FUSED_ALIGN_MAX_PAIRS pairs; above, align_parallel's five
launches under PARALLEL_ALIGN, else `align_by_expert`'s torch ops, also the reference). One launch computes silu(x @ gate.T) * (x @ up.T) for every pair (a program: BLOCK_M
pairs of one expert x BLOCK_N columns of both its gate and its up rows), a second multiplies by
down.T and by the pair's routing weight in fp32, a third sums each token's k slots (plus the shared
experts' output) into the model dtype. Each expert's weights are read once per BLOCK_M of its pairs.

GEMV (decode, a few tokens: each chosen expert sees about one token, so a 16-row tile would be
mostly padding): no sort; a program per (pair, column block) for gate/up, and a program per
(token, column block) for down that loops over the token's k experts and writes their weighted sum
(plus the shared output) directly: two launches. Under SPLIT_DOWN_GEMV the down launch is a program
per (pair, column block) too, and the sum kernel adds the k slots: three.

Neither path reads a device value on the host, so a step with them can be captured in a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tandem.engine.kernels.moe_route import align_fused, align_parallel
from tandem.engine.kernels.validate import (FLOAT_DTYPES, INDEX_DTYPES, next_power_of_2, require_runnable, require_same,
                                            require_tensor)


@dataclass(frozen=True)
class MoEKernelConfig:
    block_m: int = 16
    block_n: int = 64
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 3


def default_config(num_pairs: int, num_experts: int, dtype: torch.dtype) -> MoEKernelConfig:
    """Tiles by the mean pairs per expert: 16-row tiles while experts see few tokens (decode),
    64-row tiles once each sees many (prefill); fp32 takes half the K tile (shared memory)."""
    per_expert = num_pairs / num_experts
    if PREFILL_TILE_128 and per_expert >= 512 and dtype != torch.float32:
        return MoEKernelConfig(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=3)
    block_m = 16 if per_expert <= 16 else 32 if per_expert <= 64 else 64
    block_k = 32 if dtype == torch.float32 else 64
    return MoEKernelConfig(block_m=block_m, block_n=64 if block_m < 64 else 128, block_k=block_k)


# prefill-sized runs (>= 512 pairs per expert, 16-bit) on 128 x 128 tiles with 8 warps: 424 TFLOP/s
# against 309 for the 64-row tile at an 8k prefill on V2-Lite's experts (H200, bench/moe_gpu.py
# --prefill-sweep, docs/benchmarks.md); checked on the H200 (tests/gpu/test_moe_gpu.py::
# test_prefill_tile_bf16) and timed there: V2-Lite's 8k prefill 108.6 ms against 117.2-118.1 (0.56 of
# the matmul rate against 0.50-0.52; bench/mla_gpu.py --prefill-tile, 2026-12-04)
PREFILL_TILE_128 = True


# the decode path's tiles: one pair's BLOCK_N weight rows, BLOCK_K at a time (fp32 in registers)
GEMV_MAX_TOKENS, GEMV_BLOCK_N, GEMV_BLOCK_K = 8, 16, 256
# the split down launch's: (32, 128) measured best of seven at one token on an H200 (bench/moe_gpu.py
# --gemv-sweep, docs/benchmarks.md): Qwen3-30B's experts 31.3 us against 36.6 with (16, 256), V2-Lite's 38.2 / 39.0
DOWN_GEMV_BLOCK_N, DOWN_GEMV_BLOCK_K = 32, 128
# the one-program align walks every padded row: measured on an H200 (docs/benchmarks.md, Mixture of
# experts) it made the grouped path 83 us slower at 512 pairs and 265 us at 2048 than the torch align
# (many programs); it pays only at a few dozen pairs
FUSED_ALIGN_MAX_PAIRS = 64
# above that, the five-launch many-program align (moe_route.align_parallel) instead of ~25 torch ops
# (align_by_expert, kept as the reference and for PARALLEL_ALIGN = False); compiled and measured on an
# H200 (docs/benchmarks.md, Latent attention, run 3)
PARALLEL_ALIGN = True
# the GEMV path's down projection as a program per (pair, column block) and the top-k sum after (3
# launches), not a program per (token, column block) looping over the token's k experts (2): measured
# on an H200 (docs/benchmarks.md, Latent attention, run 3) the loop ran at 3.7x its floor at one token,
# the split at 1.9x
SPLIT_DOWN_GEMV = True
SUM_BLOCK_N = 1024


def align_by_expert(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ids [T, k] -> (pairs [P] int32: pair indices t * k + slot grouped by expert, each expert's
    run padded with the value T * k to a multiple of block_m; block_expert [P / block_m] int32: the
    expert of each block of rows; num_padded [1] int32: the rows in use). P is the most rows any
    routing can need, T * k + min(T * k, E) * (block_m - 1), rounded up to block_m."""
    flat = ids.reshape(-1).long()
    pairs = flat.numel()
    counts = torch.zeros(num_experts, dtype=torch.int64, device=ids.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = padded.cumsum(0)
    order = flat.argsort(stable=True)  # pair indices grouped by expert, in pair order within one
    experts_sorted = flat[order]
    rank = torch.arange(pairs, device=ids.device) - (counts.cumsum(0) - counts)[experts_sorted]
    rows = -(-(pairs + min(pairs, num_experts) * (block_m - 1)) // block_m) * block_m
    sorted_pairs = torch.full((rows,), pairs, dtype=torch.int32, device=ids.device)
    sorted_pairs[(ends - padded)[experts_sorted] + rank] = order.to(torch.int32)
    starts = torch.arange(0, rows, block_m, device=ids.device)
    block_expert = torch.searchsorted(ends, starts, right=True).clamp_(max=num_experts - 1).to(torch.int32)
    return sorted_pairs, block_expert, ends[-1:].to(torch.int32)


@triton.jit
def _gate_up_kernel(x_ptr, w_ptr, out_ptr, pairs_ptr, block_expert_ptr, num_padded_ptr,
                    num_pairs, K, N, stride_x, stride_we, stride_wn, stride_o,
                    TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    PRECISION: tl.constexpr):
    # out[pair, n] = silu(x[pair // TOP_K] . w[e, n]) * (x[pair // TOP_K] . w[e, N + n]), e the pair's expert
    pid = tl.program_id(0)
    num_n = tl.cdiv(N, BLOCK_N)
    pid_m, pid_n = pid // num_n, pid % num_n
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    pairs = tl.load(pairs_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = pairs < num_pairs
    rows = (pairs // TOP_K).to(tl.int64)
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + rows[:, None] * stride_x + offs_k[None, :]
    g_ptrs = w_ptr + expert * stride_we + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]  # [BK, BN]
    u_ptrs = g_ptrs + N * stride_wn
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = offs_k < K - k0
        a = tl.load(x_ptrs, mask=valid[:, None] & k_mask[None, :], other=0.0)
        w_mask = k_mask[:, None] & n_mask[None, :]
        acc_g = tl.dot(a, tl.load(g_ptrs, mask=w_mask, other=0.0), acc_g, input_precision=PRECISION)
        acc_u = tl.dot(a, tl.load(u_ptrs, mask=w_mask, other=0.0), acc_u, input_precision=PRECISION)
        x_ptrs += BLOCK_K
        g_ptrs += BLOCK_K
        u_ptrs += BLOCK_K
    # the projections round to the model dtype before the activation, as the torch path's do
    gate = acc_g.to(out_ptr.dtype.element_ty).to(tl.float32)
    up = acc_u.to(out_ptr.dtype.element_ty).to(tl.float32)
    h = gate / (1.0 + tl.exp(-gate)) * up
    out_ptrs = out_ptr + pairs[:, None].to(tl.int64) * stride_o + offs_n[None, :]
    tl.store(out_ptrs, h.to(out_ptr.dtype.element_ty), mask=valid[:, None] & n_mask[None, :])


@triton.jit
def _down_kernel(h_ptr, w_ptr, out_ptr, weights_ptr, pairs_ptr, block_expert_ptr, num_padded_ptr,
                 num_pairs, K, N, stride_h, stride_we, stride_wn, stride_o,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    # out[pair, n] = weights[pair] * (h[pair] . w[e, n]) in fp32
    pid = tl.program_id(0)
    num_n = tl.cdiv(N, BLOCK_N)
    pid_m, pid_n = pid // num_n, pid % num_n
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    pairs = tl.load(pairs_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = pairs < num_pairs
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    h_ptrs = h_ptr + pairs[:, None].to(tl.int64) * stride_h + offs_k[None, :]
    w_ptrs = w_ptr + expert * stride_we + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = offs_k < K - k0
        a = tl.load(h_ptrs, mask=valid[:, None] & k_mask[None, :], other=0.0)
        acc = tl.dot(a, tl.load(w_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0), acc,
                     input_precision=PRECISION)
        h_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    acc = acc.to(h_ptr.dtype.element_ty).to(tl.float32)  # down_proj's output in the model dtype
    acc *= tl.load(weights_ptr + pairs, mask=valid, other=0.0)[:, None]
    out_ptrs = out_ptr + pairs[:, None].to(tl.int64) * stride_o + offs_n[None, :]
    tl.store(out_ptrs, acc, mask=valid[:, None] & n_mask[None, :])


def _check(x, w13, w2, weights, ids) -> None:
    require_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES)
    require_tensor("w13", w13, ndim=3, dtypes=FLOAT_DTYPES)
    require_tensor("w2", w2, ndim=3, dtypes=FLOAT_DTYPES)
    require_tensor("weights", weights, ndim=2, dtypes=(torch.float32,))
    require_tensor("ids", ids, ndim=2, dtypes=INDEX_DTYPES)
    require_same("w13", w13, "x", x)
    require_same("w2", w2, "x", x)
    require_same("weights", weights, "x", x, dtype=False)
    require_same("ids", ids, "x", x, dtype=False)
    experts, two_i, hidden = w13.shape
    if hidden != x.shape[1] or two_i % 2 or w2.shape != (experts, hidden, two_i // 2):
        raise ValueError(f"w13 {tuple(w13.shape)} and w2 {tuple(w2.shape)} do not fit x {tuple(x.shape)}: "
                         f"need w13 [E, 2I, H] and w2 [E, H, I] with H = {x.shape[1]}")
    if ids.shape != weights.shape or ids.shape[0] != x.shape[0]:
        raise ValueError(f"ids {tuple(ids.shape)} and weights {tuple(weights.shape)} must both be [T, k] "
                         f"with T = {x.shape[0]}")
    if not (x.is_contiguous() and w13.is_contiguous() and w2.is_contiguous()):
        raise ValueError("x, w13 and w2 must be contiguous")


@triton.jit
def _gate_up_gemv_kernel(x_ptr, w_ptr, out_ptr, ids_ptr, K, N, stride_x, stride_we, stride_wn, stride_o,
                         TOP_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # the decode shape: a program is one (token, slot) pair x BLOCK_N columns, no tile padding
    pair = tl.program_id(0).to(tl.int64)
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + (pair // TOP_K) * stride_x + offs_k
    g_ptrs = w_ptr + expert * stride_we + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]  # [BN, BK]
    acc_g = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = offs_k < K - k0
        a = tl.load(x_ptrs, mask=k_mask, other=0.0).to(tl.float32)[None, :]
        w_mask = n_mask[:, None] & k_mask[None, :]
        acc_g += tl.load(g_ptrs, mask=w_mask, other=0.0).to(tl.float32) * a
        acc_u += tl.load(g_ptrs + N * stride_wn, mask=w_mask, other=0.0).to(tl.float32) * a
        x_ptrs += BLOCK_K
        g_ptrs += BLOCK_K
    gate = tl.sum(acc_g, 1).to(out_ptr.dtype.element_ty).to(tl.float32)
    up = tl.sum(acc_u, 1).to(out_ptr.dtype.element_ty).to(tl.float32)
    h = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + pair * stride_o + offs_n, h.to(out_ptr.dtype.element_ty), mask=n_mask)


@triton.jit
def _down_gemv_kernel(h_ptr, w_ptr, out_ptr, add_ptr, weights_ptr, ids_ptr, K, N, stride_h, stride_we, stride_wn,
                      stride_o, stride_a, TOP_K: tl.constexpr, HAS_ADD: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # out[t, n] = sum over t's slots s of weights[t, s] * (h[t, s] . w[ids[t, s], n]) (+ add[t, n])
    t = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    total = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for s in range(TOP_K):
        pair = t * TOP_K + s
        expert = tl.load(ids_ptr + pair).to(tl.int64)
        h_ptrs = h_ptr + pair * stride_h + offs_k
        w_ptrs = w_ptr + expert * stride_we + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_mask = offs_k < K - k0
            a = tl.load(h_ptrs, mask=k_mask, other=0.0).to(tl.float32)[None, :]
            acc += tl.load(w_ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0.0).to(tl.float32) * a
            h_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        y = tl.sum(acc, 1).to(h_ptr.dtype.element_ty).to(tl.float32)  # down_proj's output in the model dtype
        total += y * tl.load(weights_ptr + pair)
    if HAS_ADD:
        total += tl.load(add_ptr + t * stride_a + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * stride_o + offs_n, total.to(out_ptr.dtype.element_ty), mask=n_mask)


@triton.jit
def _down_pair_gemv_kernel(h_ptr, w_ptr, out_ptr, weights_ptr, ids_ptr, K, N, stride_h, stride_we, stride_wn, stride_o,
                           BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # out[pair, n] = weights[pair] * (h[pair] . w[ids[pair], n]) in fp32: a program per (pair, column
    # block), so one token's k experts are read side by side, not one after another
    pair = tl.program_id(0).to(tl.int64)
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    h_ptrs = h_ptr + pair * stride_h + offs_k
    w_ptrs = w_ptr + expert * stride_we + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = offs_k < K - k0
        a = tl.load(h_ptrs, mask=k_mask, other=0.0).to(tl.float32)[None, :]
        acc += tl.load(w_ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0.0).to(tl.float32) * a
        h_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    y = tl.sum(acc, 1).to(h_ptr.dtype.element_ty).to(tl.float32)  # down_proj's output in the model dtype
    tl.store(out_ptr + pair * stride_o + offs_n, y * tl.load(weights_ptr + pair), mask=n_mask)


@triton.jit
def _sum_slots_kernel(y_ptr, out_ptr, add_ptr, N, stride_y, stride_o, stride_a,
                      TOP_K: tl.constexpr, HAS_ADD: tl.constexpr, BLOCK_N: tl.constexpr):
    # out[t] = sum over slots of y[t * TOP_K + s] (fp32) (+ add[t]), in out's dtype
    t = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    total = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for s in range(TOP_K):
        total += tl.load(y_ptr + (t * TOP_K + s) * stride_y + offs_n, mask=n_mask, other=0.0)
    if HAS_ADD:
        total += tl.load(add_ptr + t * stride_a + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * stride_o + offs_n, total.to(out_ptr.dtype.element_ty), mask=n_mask)


def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                  ids: torch.Tensor, config: MoEKernelConfig | None = None, *, add: torch.Tensor | None = None,
                  path: str | None = None) -> torch.Tensor:
    """x [T, H]; w13 [E, 2I, H] (gate rows, then up rows); w2 [E, H, I]; weights [T, k] fp32;
    ids [T, k] expert ids (each in [0, E)). -> [T, H] in x's dtype: for each token the sum over its
    k experts of weight * down(silu(gate(x)) * up(x)), as engine.moe.experts_torch, plus `add`
    [T, H] if given (the shared experts' output, added in fp32 before the one rounding).
    `path`: "gemv" (a program per (token, slot) pair, the top-k sum inside the down launch: 2
    launches), "grouped" (pairs sorted by expert into tiles: 4 launches with the one-launch align) or
    None: gemv up to GEMV_MAX_TOKENS tokens, where each chosen expert sees about one token."""
    _check(x, w13, w2, weights, ids)
    require_runnable(x, _gate_up_kernel)
    if add is not None:
        require_tensor("add", add, ndim=2, dtypes=FLOAT_DTYPES)
        require_same("add", add, "x", x, shape=True, dtype=False)
    if path not in (None, "gemv", "grouped"):
        raise ValueError(f"path must be 'gemv', 'grouped' or None, got {path!r}")
    if x.shape[0] == 0:
        return torch.zeros_like(x)
    if path == "gemv" or (path is None and x.shape[0] <= GEMV_MAX_TOKENS):
        return _experts_gemv(x, w13, w2, weights.contiguous(), ids.contiguous(), add)
    return _experts_grouped(x, w13, w2, weights, ids, config, add)


def _launch(x, cfg: MoEKernelConfig | None = None) -> dict:
    if x.device.type != "cuda":
        return {}
    return {"num_warps": 4} if cfg is None else {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}


def _experts_gemv(x, w13, w2, weights, ids, add) -> torch.Tensor:
    (tokens, hidden), (_, two_i, _), top_k = x.shape, w13.shape, ids.shape[1]
    inter = two_i // 2
    # the interpreter (CPU) pays per program, not per byte: there, one column block per row if it fits
    wide = x.device.type != "cuda"
    h = torch.empty((tokens * top_k, inter), dtype=x.dtype, device=x.device)
    block_n = min(128, next_power_of_2(inter)) if wide else GEMV_BLOCK_N
    _gate_up_gemv_kernel[(tokens * top_k, triton.cdiv(inter, block_n))](
        x, w13, h, ids, hidden, inter, x.stride(0), w13.stride(0), w13.stride(1), h.stride(0),
        TOP_K=top_k, BLOCK_N=block_n, BLOCK_K=GEMV_BLOCK_K, **_launch(x))
    out = torch.empty_like(x)
    if SPLIT_DOWN_GEMV:
        y = torch.empty((tokens * top_k, hidden), dtype=torch.float32, device=x.device)
        block_n = min(128, next_power_of_2(hidden)) if wide else DOWN_GEMV_BLOCK_N
        _down_pair_gemv_kernel[(tokens * top_k, triton.cdiv(hidden, block_n))](
            h, w2, y, weights, ids, inter, hidden, h.stride(0), w2.stride(0), w2.stride(1), y.stride(0),
            BLOCK_N=block_n, BLOCK_K=DOWN_GEMV_BLOCK_K, **_launch(x))
        _sum_slots_kernel[(tokens, triton.cdiv(hidden, SUM_BLOCK_N))](
            y, out, add if add is not None else out, hidden, y.stride(0), out.stride(0),
            add.stride(0) if add is not None else 0, TOP_K=top_k, HAS_ADD=add is not None, BLOCK_N=SUM_BLOCK_N,
            **_launch(x))
        return out
    # few tokens: narrower column blocks so that the down launch still fills the GPU
    block_n = GEMV_BLOCK_N if tokens * triton.cdiv(hidden, GEMV_BLOCK_N) >= 256 else GEMV_BLOCK_N // 2
    block_n = min(128, next_power_of_2(hidden)) if wide else block_n
    _down_gemv_kernel[(tokens, triton.cdiv(hidden, block_n))](
        h, w2, out, add if add is not None else out, weights, ids, inter, hidden, h.stride(0),
        w2.stride(0), w2.stride(1), out.stride(0), add.stride(0) if add is not None else 0,
        TOP_K=top_k, HAS_ADD=add is not None, BLOCK_N=block_n, BLOCK_K=GEMV_BLOCK_K, **_launch(x))
    return out


def _experts_grouped(x, w13, w2, weights, ids, config, add) -> torch.Tensor:
    (tokens, hidden), (experts, two_i, _), top_k = x.shape, w13.shape, ids.shape[1]
    inter, pairs = two_i // 2, tokens * top_k
    cfg = config or default_config(pairs, experts, x.dtype)
    align = align_fused if pairs <= FUSED_ALIGN_MAX_PAIRS else align_parallel if PARALLEL_ALIGN else align_by_expert
    sorted_pairs, block_expert, num_padded = align(ids.contiguous(), experts, cfg.block_m)
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    m_blocks = block_expert.numel()
    h = torch.empty((pairs, inter), dtype=x.dtype, device=x.device)
    _gate_up_kernel[(m_blocks * triton.cdiv(inter, cfg.block_n),)](
        x, w13, h, sorted_pairs, block_expert, num_padded, pairs, hidden, inter,
        x.stride(0), w13.stride(0), w13.stride(1), h.stride(0),
        TOP_K=top_k, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, PRECISION=precision,
        **_launch(x, cfg))
    y = torch.empty((pairs, hidden), dtype=torch.float32, device=x.device)
    _down_kernel[(m_blocks * triton.cdiv(hidden, cfg.block_n),)](
        h, w2, y, weights.reshape(-1).contiguous(), sorted_pairs, block_expert, num_padded, pairs, inter, hidden,
        h.stride(0), w2.stride(0), w2.stride(1), y.stride(0),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, PRECISION=precision, **_launch(x, cfg))
    out = torch.empty_like(x)
    _sum_slots_kernel[(tokens, triton.cdiv(hidden, SUM_BLOCK_N))](
        y, out, add if add is not None else out, hidden, y.stride(0), out.stride(0),
        add.stride(0) if add is not None else 0, TOP_K=top_k, HAS_ADD=add is not None, BLOCK_N=SUM_BLOCK_N,
        **_launch(x))
    return out
