"""Weight-only FP8 GEMM: out[M, N] = x[M, K] @ dequant(w[N, K])^T (+ bias), for the small-M
(decode) steps where `torch._scaled_mm` loses to bf16 (issue 24's table); and `quantize_rows`,
the per-token activation quantization `_scaled_mm` needs, in one kernel.

The activations stay in their dtype (bf16/fp16/fp32); each [BLOCK_K, BLOCK_N] tile of the e4m3
weight is read once (half the bytes of bf16), widened to the activation dtype in registers (exact:
every e4m3 value is representable in bf16/fp16/fp32) and fed to `tl.dot`, as Marlin-style kernels
do. Scales: `scale[N, G]` fp32. G == 1 is per-output-channel, applied once in the epilogue;
G == ceil(K / group_k) is a block layout (DeepSeek/Qwen FP8: [128, 128] blocks, expanded along N
to one row per output channel at load), applied to each K tile's partial sum, so BLOCK_K must
divide group_k. Accumulation is fp32; the output is rounded once to x's dtype.

One token (a batch-1 decode step) takes engine.kernels.gemv instead: no tensor cores, the weight
rows streamed with 16-byte loads and reduced on the CUDA cores, with a tile config per weight
shape from bench/fp8_sweep.py (`gemv.choose_gemv_config`); ~0.6-0.7x bf16 cuBLAS's time on H200.
A few tokens (2 to 4, by weight shape: `gemv_rows.takes`) take engine.kernels.gemv_rows, the same
loop over several rows of x.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

from tandem.engine.kernels import gemv_rows
from tandem.engine.kernels.gemv import GemvConfig, check_weight, choose_gemv_config, gemv
from tandem.engine.kernels.validate import (FLOAT_DTYPES, next_power_of_2, require_runnable, require_tensor)

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)
FP8_INV_MAX = float(torch.tensor(1 / FP8_MAX, dtype=torch.float32))  # as engine.quant.fp8 (its note)


@triton.jit
def _fp8_gemm_kernel(
    x_ptr, w_ptr, s_ptr, b_ptr, out_ptr,
    M, N, K,
    stride_xm, stride_wn, stride_sn, stride_om,
    GROUP_K: tl.constexpr, HAS_BIAS: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_mask = rm < M
    n_mask = rn < N
    x_rows = x_ptr + rm.to(tl.int64)[:, None] * stride_xm
    w_cols = w_ptr + rn.to(tl.int64)[None, :] * stride_wn  # w is [N, K]: a tile [BLOCK_K, BLOCK_N]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + rk
        k_mask = ks < K
        x = tl.load(x_rows + ks[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_cols + ks[:, None], mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        if UPCAST:  # Triton's interpreter computes bf16 / fp16 dots wrongly: do them in fp32 there
            x = x.to(tl.float32)
        w = w.to(x.dtype)
        if GROUP_K == 0:
            if IEEE:
                acc = tl.dot(x, w, acc, input_precision="ieee")
            else:
                acc = tl.dot(x, w, acc)
        else:
            if IEEE:
                part = tl.dot(x, w, input_precision="ieee")
            else:
                part = tl.dot(x, w)
            s = tl.load(s_ptr + rn * stride_sn + k0 // GROUP_K, mask=n_mask, other=0.0)
            acc += part * s[None, :]
    if GROUP_K == 0:
        acc *= tl.load(s_ptr + rn * stride_sn, mask=n_mask, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + rm.to(tl.int64)[:, None] * stride_om + rn[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


@dataclass(frozen=True)
class GemmConfig:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 4
    gemv: bool = False  # one token: the CUDA-core kernel (block_m unused)


def choose_config(m: int, n: int, k: int, group_k: int, elem_bytes: int = 2) -> GemmConfig:
    """Tile shape by M (and wide N), from bench/fp8_gpu.py's and bench/fp8_sweep.py's sweeps on an
    H200 (docs/benchmarks.md). One token: the CUDA-core kernel (engine.kernels.gemv's config). Up to 64 tokens: narrow N
    tiles keep every SM streaming weights. `elem_bytes` 4 (fp32 activations): tiles whose staged x
    would overflow the 227 KB of shared memory are replaced by one that fits (seen compiling in
    fp32 there)."""
    wide = n >= 16384  # gate_up
    if m == 1:
        g = choose_gemv_config(n, k, FP8_DTYPE)
        cfg = GemmConfig(1, g.block_n, g.block_k, g.num_warps, g.num_stages, gemv=True)
    elif m <= 16:
        cfg = GemmConfig(16, 32, 512, num_warps=4, num_stages=3)
    elif m <= 32:
        cfg = GemmConfig(32, 64 if wide else 32, 128, num_warps=4, num_stages=4)
    elif m <= 64 or elem_bytes > 2:
        cfg = GemmConfig(64, 128, 128, num_warps=8, num_stages=3) if wide or m > 64 else GemmConfig(64, 32, 128)
    else:
        cfg = GemmConfig(128, 256, 64, num_warps=8, num_stages=3) if wide else GemmConfig(128, 64, 128)
    if group_k and group_k % cfg.block_k:
        cfg = dataclasses.replace(cfg, block_k=group_k)
    return cfg


def fp8_gemm(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
             *, group_k: int = 0, config: GemmConfig | None = None) -> torch.Tensor:
    """x: [M, K] (fp32/bf16/fp16, rows contiguous); weight: [N, K] float8_e4m3fn, rows contiguous;
    scale: [N, G] float32 (G == 1: per channel, group_k 0; else G == ceil(K / group_k), one scale
    per output channel and K group of group_k columns); bias: [N] or None. -> [M, N] in x's dtype."""
    require_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES)
    require_tensor("weight", weight, ndim=2, dtypes=(FP8_DTYPE,))
    m, k = x.shape
    n = weight.shape[0]
    check_weight(x, weight, scale, bias, group_k, k)
    require_runnable(x, _fp8_gemm_kernel)
    interpreted = not isinstance(_fp8_gemm_kernel, JITFunction)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    cfg = config or choose_config(m, n, k, group_k, x.element_size())
    if group_k and group_k % cfg.block_k:
        raise ValueError(f"block_k {cfg.block_k} must divide group_k {group_k}")
    if cfg.gemv and m == 1:  # no config given: gemv picks its own tuned one, whole
        gemv_cfg = None if config is None else GemvConfig(cfg.block_n, cfg.block_k, cfg.num_warps, cfg.num_stages)
        return gemv(x, weight, scale, bias, group_k=group_k, config=gemv_cfg)
    if config is None and gemv_rows.takes(weight, m):  # a few rows: each weight read once for all
        return gemv_rows.gemv_rows(x, weight, scale, bias, group_k=group_k)
    grid = (triton.cdiv(n, cfg.block_n), triton.cdiv(m, cfg.block_m))
    _fp8_gemm_kernel[grid](
        x, weight, scale, bias if bias is not None else scale, out, m, n, k,
        x.stride(0), weight.stride(0), scale.stride(0), out.stride(0),
        GROUP_K=group_k, HAS_BIAS=bias is not None, IEEE=x.dtype == torch.float32 or interpreted,
        UPCAST=interpreted,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out


@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, s_ptr, stride_x, stride_q, K, FP8_MAX: tl.constexpr,
                          FP8_INV_MAX: tl.constexpr, MIN_SCALE: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < K
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    # the scale as engine.quant.fp8.quantize_tokens: amax times the fp32 reciprocal of 448. An
    # IEEE-rounded division (div.rn) for the elements: Triton's `/` is div.full.f32 (within 2 ulp),
    # which now and then rounds an element to the other side of an e4m3 boundary from torch's
    scale = tl.maximum(tl.max(tl.abs(x), axis=0) * FP8_INV_MAX, MIN_SCALE)
    q = tl.clamp(tl.div_rn(x, scale), -FP8_MAX, FP8_MAX)
    tl.store(q_ptr + row * stride_q + cols, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + row, scale)


def quantize_rows(x: torch.Tensor, min_scale: float = 1e-12) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] float -> (q [M, K] float8_e4m3fn, scale [M, 1] float32): each row's largest |value|
    maps to 448 (engine.quant.fp8.quantize_fp8's rule, per token), x ~= q * scale."""
    require_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES)
    require_runnable(x, _quantize_rows_kernel)
    m, k = x.shape
    q = torch.empty((m, k), dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    if m == 0:
        return q, scale
    block = next_power_of_2(k)
    _quantize_rows_kernel[(m,)](x, q, scale, x.stride(0), q.stride(0), k,
                                FP8_MAX=FP8_MAX, FP8_INV_MAX=FP8_INV_MAX, MIN_SCALE=min_scale, BLOCK=block,
                                num_warps=min(16, max(1, block // 1024)))
    return q, scale
