"""The GEMV of a few tokens: out[M, N] = x[M, K] @ W[N, K]^T (+ bias) for 2 <= M <= MAX_ROWS, each
weight read once for all M rows of x.

A decode step of two sequences, or a speculative verify step of one sequence with a draft token,
is too small for a tensor-core GEMM to stream its weights well: on the H200 llama3-8b's FP8
projections took as long for 2 tokens through engine.kernels.fp8_gemm as bf16's through cuBLAS,
1.8x their one-token GEMVs. Here, as in engine.kernels.gemv, no tensor cores: each program (one warp
by default) streams `block_n` weight rows in `block_k`-column tiles with 16-byte loads (FP8 e4m3
with its scales, or the model dtype), widens each tile to fp32 once, and multiplies it with each
row of x into that row's own accumulator, each thread's run of columns summed in its registers, so
the only cross-thread reduction is once per row at the end. Fp32 accumulation, the output rounded
once to x's dtype, as `gemv.gemv` does for one row. The step of two sequences: FP8 4.52 -> 3.03 ms,
bf16 4.80 -> 4.64 (docs/benchmarks.md, issue 24). The FMAs grow with M while the bytes do not, so
from 4 rows (8 on every shape) the GEMMs win again.

Launches are programmatic dependents on Hopper where `gemv` makes them so (the first weight tile
loads before the wait). Which projections take it: `takes` (`ROWS` per weight shape, `ROWS_DEFAULT`
per kind), through TritonOps.linear and engine.kernels.fp8_gemm.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tandem.engine.kernels.gemv import FP8_DTYPE, _pdl, _weight_kind, check_weight
from tandem.engine.kernels.validate import FLOAT_DTYPES, require_runnable, require_tensor

MAX_ROWS = 8


@triton.jit
def _row(acc, w, x_row_ptr, ks, k_mask, row_ok, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, VEC: tl.constexpr):
    # acc [BLOCK_N, BLOCK_K // VEC] += w [BLOCK_N, BLOCK_K] * x[ks], each thread's run of VEC columns
    # (its 16-byte load of w) summed in its registers: no shuffle until the end of the row
    x = tl.load(x_row_ptr + ks, mask=k_mask & row_ok, other=0.0).to(tl.float32)
    return acc + tl.sum(tl.reshape(w * x[None, :], (BLOCK_N, BLOCK_K // VEC, VEC)), axis=2)


@triton.jit
def _rows_tile(a0, a1, a2, a3, a4, a5, a6, a7, w_raw, k0, ks, k_mask, x_ptr, stride_xm, M, s_ptr, rn, n_mask,
               stride_sn, GROUP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_K: tl.constexpr, VEC: tl.constexpr):
    # one weight tile, widened to fp32 once, against each row of x: an accumulator per row (BLOCK_M
    # of the eight in use)
    w = w_raw.to(tl.float32)
    if GROUP_K != 0:  # block_k divides group_k: one scale per row over the tile
        w = w * tl.load(s_ptr + rn * stride_sn + k0 // GROUP_K, mask=n_mask, other=0.0)[:, None]
    at = ks * 0
    a0 = _row(a0, w, x_ptr, ks, k_mask, at < M, BLOCK_N, BLOCK_K, VEC)
    a1 = _row(a1, w, x_ptr + stride_xm, ks, k_mask, at + 1 < M, BLOCK_N, BLOCK_K, VEC)
    if BLOCK_M > 2:
        a2 = _row(a2, w, x_ptr + 2 * stride_xm, ks, k_mask, at + 2 < M, BLOCK_N, BLOCK_K, VEC)
        a3 = _row(a3, w, x_ptr + 3 * stride_xm, ks, k_mask, at + 3 < M, BLOCK_N, BLOCK_K, VEC)
    if BLOCK_M > 4:
        a4 = _row(a4, w, x_ptr + 4 * stride_xm, ks, k_mask, at + 4 < M, BLOCK_N, BLOCK_K, VEC)
        a5 = _row(a5, w, x_ptr + 5 * stride_xm, ks, k_mask, at + 5 < M, BLOCK_N, BLOCK_K, VEC)
        a6 = _row(a6, w, x_ptr + 6 * stride_xm, ks, k_mask, at + 6 < M, BLOCK_N, BLOCK_K, VEC)
        a7 = _row(a7, w, x_ptr + 7 * stride_xm, ks, k_mask, at + 7 < M, BLOCK_N, BLOCK_K, VEC)
    return a0, a1, a2, a3, a4, a5, a6, a7


@triton.jit
def _store_row(acc, m, M, out_ptr, stride_om, rn, n_mask, s_ptr, stride_sn, b_ptr,
               SCALED: tl.constexpr, GROUP_K: tl.constexpr, HAS_BIAS: tl.constexpr):
    out = tl.sum(acc, axis=1)  # [BLOCK_N]
    if SCALED and GROUP_K == 0:  # per output channel, once
        out *= tl.load(s_ptr + rn * stride_sn, mask=n_mask, other=0.0)
    if HAS_BIAS:
        out += tl.load(b_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + m * stride_om + rn, out.to(out_ptr.dtype.element_ty), mask=n_mask & (rn * 0 + m < M))


@triton.jit
def _gemv_rows_kernel(
    x_ptr, w_ptr, s_ptr, b_ptr, out_ptr,
    M, N, K, stride_xm, stride_wn, stride_sn, stride_om,
    SCALED: tl.constexpr, GROUP_K: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, VEC: tl.constexpr, USE_PDL: tl.constexpr,
):
    pid_n = tl.program_id(0)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = rn < N
    rk = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + rn.to(tl.int64)[:, None] * stride_wn
    a0 = tl.zeros((BLOCK_N, BLOCK_K // VEC), dtype=tl.float32)
    a1, a2, a3, a4, a5, a6, a7 = a0, a0, a0, a0, a0, a0, a0
    start = 0
    if USE_PDL == 1:  # launched as a programmatic dependent: wait for the kernel before (it writes x)
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    if USE_PDL == 2:  # as 1, the first weight tile (no kernel writes weights) loaded before the wait
        k_mask = rk < K
        w_raw = tl.load(w_rows + rk[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
        a0, a1, a2, a3, a4, a5, a6, a7 = _rows_tile(a0, a1, a2, a3, a4, a5, a6, a7, w_raw, 0, rk, k_mask, x_ptr,
                                                    stride_xm, M, s_ptr, rn, n_mask, stride_sn, GROUP_K, BLOCK_M,
                                                    BLOCK_N, BLOCK_K, VEC)
        start = BLOCK_K
    for k0 in range(start, K, BLOCK_K):
        ks = k0 + rk
        k_mask = (rk < BLOCK_K) if EVEN_K else (ks < K)
        w_raw = tl.load(w_rows + ks[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        a0, a1, a2, a3, a4, a5, a6, a7 = _rows_tile(a0, a1, a2, a3, a4, a5, a6, a7, w_raw, k0, ks, k_mask, x_ptr,
                                                    stride_xm, M, s_ptr, rn, n_mask, stride_sn, GROUP_K, BLOCK_M,
                                                    BLOCK_N, BLOCK_K, VEC)
    _store_row(a0, 0, M, out_ptr, stride_om, rn, n_mask, s_ptr, stride_sn, b_ptr, SCALED, GROUP_K, HAS_BIAS)
    _store_row(a1, 1, M, out_ptr, stride_om, rn, n_mask, s_ptr, stride_sn, b_ptr, SCALED, GROUP_K, HAS_BIAS)
    if BLOCK_M > 2:
        _store_row(a2, 2, M, out_ptr, stride_om, rn, n_mask, s_ptr, stride_sn, b_ptr, SCALED, GROUP_K, HAS_BIAS)
        _store_row(a3, 3, M, out_ptr, stride_om, rn, n_mask, s_ptr, stride_sn, b_ptr, SCALED, GROUP_K, HAS_BIAS)
    if BLOCK_M > 4:
        _store_row(a4, 4, M, out_ptr, stride_om, rn, n_mask, s_ptr, stride_sn, b_ptr, SCALED, GROUP_K, HAS_BIAS)
        _store_row(a5, 5, M, out_ptr, stride_om, rn, n_mask, s_ptr, stride_sn, b_ptr, SCALED, GROUP_K, HAS_BIAS)
        _store_row(a6, 6, M, out_ptr, stride_om, rn, n_mask, s_ptr, stride_sn, b_ptr, SCALED, GROUP_K, HAS_BIAS)
        _store_row(a7, 7, M, out_ptr, stride_om, rn, n_mask, s_ptr, stride_sn, b_ptr, SCALED, GROUP_K, HAS_BIAS)


@dataclass(frozen=True)
class RowsConfig:
    block_n: int = 4
    block_k: int = 512
    num_warps: int = 1
    num_stages: int = 2


# (weight kind, N, K, rows of x padded to a power of two) -> config where the H200 sweep beat the
# kind's default (bench/gemv_gpu.py --rows, docs/benchmarks.md issue 24)
_TUNED = {("fp8", 28672, 4096, 2): RowsConfig(8, 256, 1, 2), ("fp8", 6144, 4096, 4): RowsConfig(4, 512, 1, 2),
          ("16bit", 28672, 4096, 2): RowsConfig(4, 512, 1, 2)}
_DEFAULT = {"fp8": RowsConfig(4, 1024, 1, 2), "16bit": RowsConfig(2, 512, 1, 2), "fp32": RowsConfig(4, 128, 1, 2)}


def _block_m(m: int) -> int:
    return max(2, triton.next_power_of_2(m))


def choose_rows_config(m: int, n: int, k: int, weight_dtype: torch.dtype, group_k: int = 0) -> RowsConfig:
    """Rows per program, K tile, warps and stages for m rows of x and one weight shape."""
    kind = "fp8" if weight_dtype == FP8_DTYPE else "fp32" if weight_dtype.itemsize == 4 else "16bit"
    cfg = _TUNED.get((kind, n, k, _block_m(m)), _DEFAULT[kind])
    if cfg.block_k > k:  # a small model: no tile wider than the row
        cfg = RowsConfig(cfg.block_n, max(16, triton.next_power_of_2(k)), cfg.num_warps, cfg.num_stages)
    if group_k and group_k % cfg.block_k:
        cfg = RowsConfig(cfg.block_n, group_k, cfg.num_warps, cfg.num_stages)
    return cfg


def gemv_rows(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None = None,
              bias: torch.Tensor | None = None, *, group_k: int = 0,
              config: RowsConfig | None = None) -> torch.Tensor:
    """x [M, K] (2 <= M <= MAX_ROWS, rows contiguous) @ weight[N, K]^T (+ bias) -> [M, N] in x's
    dtype; weight in x's dtype (scale None) or float8_e4m3fn with scale [N, G] float32, as
    `gemv.gemv` takes them."""
    require_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES)
    m, k = x.shape
    if not 2 <= m <= MAX_ROWS:
        raise ValueError(f"gemv_rows takes 2 to {MAX_ROWS} rows of x (one row: gemv.gemv), got {m}")
    check_weight(x, weight, scale, bias, group_k, k)
    require_runnable(x, _gemv_rows_kernel)
    n = weight.shape[0]
    cfg = config or choose_rows_config(m, n, k, weight.dtype, group_k)
    if group_k and group_k % cfg.block_k:
        raise ValueError(f"block_k {cfg.block_k} must divide group_k {group_k}")
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    anchor = scale if scale is not None else weight  # any tensor stands in for an unused pointer
    pdl = _pdl(x.device, weight.dtype)
    _gemv_rows_kernel[(triton.cdiv(n, cfg.block_n),)](
        x, weight, anchor, bias if bias is not None else anchor, out,
        m, n, k, x.stride(0), weight.stride(0), scale.stride(0) if scale is not None else 0, out.stride(0),
        SCALED=scale is not None, GROUP_K=group_k, HAS_BIAS=bias is not None,
        BLOCK_M=_block_m(m), BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        EVEN_K=k % cfg.block_k == 0, VEC=min(16 // weight.element_size(), cfg.block_k), USE_PDL=pdl,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **({"launch_pdl": True} if pdl else {}))
    return out


# (weight kind, N, K) -> the most rows of x a projection takes here, where the H200 measured this
# kernel beating what the step ran before (cuBLAS for 16-bit weights, engine.kernels.fp8_gemm's
# tensor-core GEMM for FP8; bench/gemv_gpu.py --rows, docs/benchmarks.md issue 24). llama3-8b, us
# for 2 rows, before -> here: FP8 q/k/v 16.9 -> 10.3, o 13.0 -> 8.6, gate/up 48.1 -> 33.8, down
# 36.8 -> 22.6 (4 rows: 16.7 -> 15.3, 13.0 -> 11.5, 47.9 -> 52.4, 36.6 -> 31.8; 8 rows lose on every
# shape); bf16 o 12.4 -> 10.9, gate/up 56.1 -> 54.5 (q/k/v and down lose, as do 4 rows). Any other
# FP8 weight takes it for ROWS_DEFAULT rows: the GEMM's small-M tiles stream its weights no better.
ROWS: dict[tuple[str, int, int], int] = {
    ("fp8", 6144, 4096): 4, ("fp8", 4096, 4096): 4, ("fp8", 4096, 14336): 4, ("fp8", 28672, 4096): 2,
    ("16bit", 4096, 4096): 2, ("16bit", 28672, 4096): 2}
ROWS_DEFAULT: dict[str, int] = {"fp8": 2}


def takes(weight: torch.Tensor, m: int) -> bool:
    """Whether a projection of m (>= 2) rows of x with this weight [N, K] runs here."""
    kind = _weight_kind(weight)
    if kind is None or weight.dim() != 2:
        return False
    most = ROWS.get((kind, *weight.shape), ROWS_DEFAULT.get(kind, 0))
    return 2 <= m <= min(most, MAX_ROWS)
