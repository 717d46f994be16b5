"""The one-token GEMV of a batch-1 decode step, with the elementwise op before it folded in.

out[N] = W[N, K] @ x[K] (+ bias), W in the model dtype (bf16/fp16/fp32) or FP8 e4m3 with scales
(`scale [N, G]` as engine.kernels.fp8_gemm: G == 1 per output channel, applied once at the end;
else one per `group_k` input columns). No tensor cores: each program streams `block_n` weight rows
in `block_k`-column tiles with 16-byte loads, widens them to fp32 and accumulates `w * x` into a
[block_n, block_k] register tile (`thread_sums`: [block_n, block_k / 16 bytes], each thread's run
summed first), reduced once at the end.

At batch 1 a Llama layer's add + RMSNorm and SiLU-and-mul are launches of their own that move a
few KB each; every program of a GEMV reads the whole input vector anyway, so it can compute them
itself (the vector stays in L1/L2):
- `norm_gemv`: the input is RMSNorm(x + residual) * norm_weight. The sum x + residual is rounded
  to the model dtype as engine.kernels.fused.rms_norm rounds it (program 0 writes it: the new
  residual stream, the same bits); the dot products are taken with (x + residual) * norm_weight and
  scaled by 1 / rms at the end, so the normalised activations are not rounded to the model dtype
  (in fp32 that changes nothing but the order of two products; in bf16 it drops two roundings).
- `silu_gemv`: the input is SiLU(gate) * up of a [2 * K] gate/up vector, rounded to the model
  dtype as engine.kernels.fused.silu_and_mul rounds it.

So a fused call gives the output of the two launches it replaces (the same for SiLU; within the
model dtype's rounding for the norm), one launch and one kernel gap less each: at llama3-8b's
batch 1, 96 of a step's ~400 kernels.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tandem.engine.kernels import pdl
from tandem.engine.kernels.validate import FLOAT_DTYPES, require_runnable, require_same, require_tensor

FP8_DTYPE = torch.float8_e4m3fn
_PLAIN, _NORM, _SILU, _SCALED = 0, 1, 2, 3
_PROLOGUE_NAMES = ("none", "norm", "silu", "none")  # a scaled input reads as a plain one


@triton.jit
def _input_tile(x_ptr, r_ptr, g_ptr, new_r_ptr, ks, k_mask, K, ss, store_residual,
                PROLOGUE: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
    # -> (the GEMV's input at columns ks in fp32, the running sum of squares). The norm's 1/rms is
    # applied to the dot products at the end, so it needs no first pass over the vector.
    dt = new_r_ptr.dtype.element_ty
    if PROLOGUE == 2:
        gate = tl.load(x_ptr + ks, mask=k_mask, other=0.0).to(tl.float32)
        up = tl.load(x_ptr + K + ks, mask=k_mask, other=0.0).to(tl.float32)
        h = (gate * tl.sigmoid(gate) * up).to(dt).to(tl.float32)
    else:
        h = tl.load(x_ptr + ks, mask=k_mask, other=0.0).to(tl.float32)
        if PROLOGUE == 1:
            if HAS_RESIDUAL:
                s = (h + tl.load(r_ptr + ks, mask=k_mask, other=0.0).to(tl.float32)).to(dt)
                tl.store(new_r_ptr + ks, s, mask=k_mask & store_residual)
                h = s.to(tl.float32)
            ss += h * h
            h = h * tl.load(g_ptr + ks, mask=k_mask, other=0.0).to(tl.float32)
    return h, ss


@triton.jit
def _products(w, h, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, VEC: tl.constexpr):
    # w [BLOCK_N, BLOCK_K] * h [BLOCK_K], each run of VEC columns (one thread's 16-byte load) summed
    # in its thread: the accumulator is [BLOCK_N, BLOCK_K // VEC], so larger tiles fit in registers
    return tl.sum(tl.reshape(w * h[None, :], (BLOCK_N, BLOCK_K // VEC, VEC)), axis=2)


@triton.jit
def _scale_bias(out, rn, n_mask, s_ptr, stride_sn, b_ptr, ROW_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr,
                row_scale, LOADED: tl.constexpr):
    # the per-output-channel scale of FP8 weights (LOADED: `row_scale`, read before the loop), then the bias
    if ROW_SCALE:
        if not LOADED:
            row_scale = tl.load(s_ptr + rn * stride_sn, mask=n_mask, other=0.0)
        out *= row_scale
    if HAS_BIAS:
        out += tl.load(b_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)
    return out


@triton.jit
def _residual_norm(out, rn, n_mask, pid_n, out_ptr, ss_ptr, er_ptr, eg_ptr, enew_r_ptr, res, next_g,
                   LOADED: tl.constexpr):
    # the output joins the residual stream (rounded as rms_norm rounds the sum): write this program's
    # rows of the new stream and their sum of squares; -> the stream times the next norm's weight
    # (LOADED: `res`, `next_g`, the stream's rows and that weight's, read before the loop)
    dt = out_ptr.dtype.element_ty
    if not LOADED:
        res = tl.load(er_ptr + rn, mask=n_mask, other=0.0)
        next_g = tl.load(eg_ptr + rn, mask=n_mask, other=0.0)
    s_new = (out.to(dt).to(tl.float32) + res.to(tl.float32)).to(dt)
    tl.store(enew_r_ptr + rn, s_new, mask=n_mask)
    sf = s_new.to(tl.float32)
    tl.store(ss_ptr + pid_n, tl.sum(sf * sf, axis=0))
    return sf * next_g.to(tl.float32)


@triton.jit
def _early_load(ptr, offsets, mask, EARLY: tl.constexpr):
    # EARLY_EPILOGUE: an epilogue read issued before the K loop (-> the values in fp32, exactly),
    # else nothing yet (-> zeros, unused: the epilogue loads after the loop)
    if EARLY:
        return tl.load(ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    return tl.zeros(offsets.shape, tl.float32)


@triton.jit
def _tile_rows(pid_n, N, BLOCK_N: tl.constexpr, SILU_OUT: tl.constexpr):
    # -> (the weight rows of this program's tile, which of them exist). SILU_OUT: gate/up pairs,
    # row j of the tile is gate row i (j even) or up row i (j odd) of the program's channels i
    if SILU_OUT:
        j = tl.arange(0, BLOCK_N)
        pair = pid_n * (BLOCK_N // 2) + j // 2
        return pair + (j % 2) * (N // 2), pair < N // 2
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    return rn, rn < N


@triton.jit
def _gemv_kernel(
    x_ptr, r_ptr, g_ptr, new_r_ptr, w_ptr, s_ptr, b_ptr, out_ptr,
    ss_ptr, er_ptr, eg_ptr, enew_r_ptr,
    N, K, stride_wn, stride_sn, eps, NUM_SS,
    PROLOGUE: tl.constexpr, HAS_RESIDUAL: tl.constexpr, SCALED: tl.constexpr, GROUP_K: tl.constexpr,
    HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
    USE_PDL: tl.constexpr, VEC: tl.constexpr, RESIDUAL_NORM: tl.constexpr, BLOCK_SS: tl.constexpr,
    SILU_OUT: tl.constexpr, EARLY_EPILOGUE: tl.constexpr = False,
):
    pid_n = tl.program_id(0)
    rn, n_mask = _tile_rows(pid_n, N, BLOCK_N, SILU_OUT)
    rk = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + rn.to(tl.int64)[:, None] * stride_wn
    store_residual = (rk * 0 + pid_n) == 0  # [BLOCK_K]: program 0 writes the new residual
    ss = tl.zeros((BLOCK_K,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_N, BLOCK_K // VEC), dtype=tl.float32)
    start = 0
    # weights no kernel writes (FP8 rows' scales, the next norm's): before any PDL wait
    row_scale = _early_load(s_ptr, rn * stride_sn, n_mask, EARLY_EPILOGUE and SCALED and GROUP_K == 0)
    next_g = _early_load(eg_ptr, rn, n_mask, EARLY_EPILOGUE and RESIDUAL_NORM)
    pdl.enter(USE_PDL == 1)  # a programmatic dependent: wait for the kernel before, let the next one be scheduled
    if USE_PDL == 2:  # as 1, the first weight tile (no kernel writes weights) loaded before the wait, raw
        k_mask = rk < K  # (FP8: a quarter of the registers the widened tile would hold)
        w_raw = tl.load(w_rows + rk[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        pdl.enter(True)
        w = w_raw.to(tl.float32)
        if GROUP_K != 0:
            w = w * tl.load(s_ptr + rn * stride_sn, mask=n_mask, other=0.0)[:, None]
        h, ss = _input_tile(x_ptr, r_ptr, g_ptr, new_r_ptr, rk, k_mask, K, ss, store_residual,
                            PROLOGUE, HAS_RESIDUAL)
        acc += _products(w, h, BLOCK_N, BLOCK_K, VEC)
        start = BLOCK_K
    if PROLOGUE == 3:  # the norm's sums of squares are the producer's (read after the wait)
        ss = tl.load(ss_ptr + tl.arange(0, BLOCK_SS), mask=tl.arange(0, BLOCK_SS) < NUM_SS, other=0.0)
    res = _early_load(er_ptr, rn, n_mask, EARLY_EPILOGUE and RESIDUAL_NORM)  # a kernel before wrote it
    for k0 in range(start, K, BLOCK_K):
        ks = k0 + rk
        if EVEN_K:
            k_mask = rk < BLOCK_K
            w = tl.load(w_rows + ks[None, :], mask=n_mask[:, None], other=0.0).to(tl.float32)
        else:
            k_mask = ks < K
            w = tl.load(w_rows + ks[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0).to(tl.float32)
        h, ss = _input_tile(x_ptr, r_ptr, g_ptr, new_r_ptr, ks, k_mask, K, ss, store_residual,
                            PROLOGUE, HAS_RESIDUAL)
        if GROUP_K == 0:
            acc += _products(w, h, BLOCK_N, BLOCK_K, VEC)
        else:  # block_k divides group_k: one scale per row over the tile
            s = tl.load(s_ptr + rn * stride_sn + k0 // GROUP_K, mask=n_mask, other=0.0)
            acc += _products(w, h, BLOCK_N, BLOCK_K, VEC) * s[:, None]
    out = tl.sum(acc, axis=1)  # [BLOCK_N]
    if PROLOGUE == 1 or PROLOGUE == 3:
        out *= tl.rsqrt(tl.sum(ss, axis=0) / K + eps)
    out = _scale_bias(out, rn, n_mask, s_ptr, stride_sn, b_ptr, SCALED and GROUP_K == 0, HAS_BIAS, row_scale,
                      EARLY_EPILOGUE)
    if RESIDUAL_NORM:
        out = _residual_norm(out, rn, n_mask, pid_n, out_ptr, ss_ptr, er_ptr, eg_ptr, enew_r_ptr, res, next_g,
                             EARLY_EPILOGUE)
    _store_out(out, rn, n_mask, pid_n, N, out_ptr, BLOCK_N, SILU_OUT)


@triton.jit
def _store_out(out, rn, n_mask, pid_n, N, out_ptr, BLOCK_N: tl.constexpr, SILU_OUT: tl.constexpr):
    # SILU_OUT: out [BLOCK_N] holds (gate, up) pairs -> SiLU(gate) * up, each rounded as
    # silu_and_mul rounds it, at the program's channels
    dt = out_ptr.dtype.element_ty
    if SILU_OUT:
        gate, up = tl.split(tl.reshape(out.to(dt).to(tl.float32), (BLOCK_N // 2, 2)))
        ro = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        tl.store(out_ptr + ro, (gate * tl.sigmoid(gate) * up).to(dt), mask=ro < N // 2)
    else:
        tl.store(out_ptr + rn, out.to(dt), mask=n_mask)


@dataclass(frozen=True)
class GemvConfig:
    block_n: int = 4
    block_k: int = 512
    num_warps: int = 2
    num_stages: int = 4
    # each thread sums its 16-byte run of columns before the accumulator ([block_n, block_k / run]
    # registers instead of [block_n, block_k]): FP8's larger tiles fit (bench/fp8_gemv_variants.py)
    thread_sums: bool = False


# (weight kind, N, K, prologue) -> config where a sweep on an H200 beat the default.
# bench/gemv_gpu.py --models 8b (2026-12-02, evening, calls 2-3; docs/benchmarks.md): llama3-8b's
# projections. Each thread's 16-byte run summed in registers (thread_sums) let FP8 take 2048-column
# tiles: o 6.6 us against 6.9, gate/up 30.8 against 33.2, down 16.9 against 17.1, the LM head 121
# against 146 (bench/fp8_gemv_variants.py: the same loop reading int32 words instead, no widening,
# took 6.0 / 29.2 / 15.7). Older entries: bench/fp8_sweep.py (qwen2.5-32b, llama3-70b FP8) and
# bench/gemv_gpu.py run 4 of the afternoon (qwen2.5-32b bf16), without thread sums. (*) FP8 q/k/v
# since the norms fold into it: the step 2.507 and 2.521 ms against 2.513 and 2.527 with (8, 1024,
# 4, 1), two calls of `gemv_gpu.py --variants`; o, down, gate/up and head tiles tried beside it lost.
_TUNED = {("16bit", 6144, 4096, "norm"): GemvConfig(8, 1024, 4, 2, True),  # llama3-8b bf16
          ("16bit", 28672, 4096, "norm"): GemvConfig(4, 2048, 8, 2, True),
          ("16bit", 4096, 14336, "silu"): GemvConfig(4, 2048, 8, 2, True),
          ("fp8", 6144, 4096, "none"): GemvConfig(4, 1024, 4, 2, True),  # llama3-8b FP8 (2026-12-03 *)
          ("fp8", 6144, 4096, "norm"): GemvConfig(4, 512, 2, 4),
          ("fp8", 28672, 4096, "none"): GemvConfig(8, 2048, 4, 2, True),
          ("fp8", 28672, 4096, "norm"): GemvConfig(8, 1024, 4, 1, True),
          ("fp8", 4096, 14336, "silu"): GemvConfig(8, 2048, 8, 2, True),
          ("fp8", 128256, 4096, "none"): GemvConfig(8, 2048, 4, 2, True),
          ("fp8", 5120, 27648, "none"): GemvConfig(2, 4096, 4, 1),  # qwen2.5-32b, llama3-70b
          ("fp8", 10240, 8192, "none"): GemvConfig(4, 1024, 4, 3),
          ("16bit", 5120, 5120, "none"): GemvConfig(4, 512, 4, 4),
          ("16bit", 5120, 27648, "silu"): GemvConfig(4, 512, 4, 4),
          ("fp8", 7168, 5120, "norm"): GemvConfig(8, 512, 4, 3),
          ("fp8", 55296, 5120, "norm"): GemvConfig(32, 256, 8, 3),
          ("fp8", 5120, 27648, "silu"): GemvConfig(16, 512, 8, 3)}
_DEFAULT = {"fp8": GemvConfig(4, 2048, 4, 2, True),  # llama3-8b o and down's best, gate/up's second
            "16bit": GemvConfig(4, 1024, 4, 2), "fp32": GemvConfig(4, 256, 4, 4)}


def choose_gemv_config(n: int, k: int, weight_dtype: torch.dtype, group_k: int = 0,
                       prologue: str = "none") -> GemvConfig:
    """Rows per program, K tile, warps and stages for one weight shape and prologue ("none",
    "norm", "silu"): the sweeps' best (bench/fp8_sweep.py, bench/gemv_gpu.py) where one beat the
    default; 16-byte loads are 16 FP8 or 8 bf16 columns."""
    kind = _kind(weight_dtype)
    cfg = _TUNED.get((kind, n, k, prologue), _DEFAULT[kind])
    if cfg.block_k > k:  # a small model: no tile wider than the row
        cfg = dataclasses.replace(cfg, block_k=max(16, triton.next_power_of_2(k)))
    if group_k and group_k % cfg.block_k:
        cfg = dataclasses.replace(cfg, block_k=group_k)
    return cfg


def _kind(dtype: torch.dtype) -> str:
    return "fp8" if dtype == FP8_DTYPE else "fp32" if dtype.itemsize == 4 else "16bit"


def _weight_kind(weight: torch.Tensor) -> str | None:
    """The kind of a projection weight this kernel can read ("fp8", "16bit", "fp32"), else None."""
    return _kind(weight.dtype) if weight.dtype in (*FLOAT_DTYPES, FP8_DTYPE) else None


# One-token projections of the model (TritonOps.linear / norm_linear / silu_linear) that take this
# kernel with their prologue ("none", "norm", "silu") folded in: (weight kind, N, K, prologue) where
# it beat what it replaces on an H200 (bench/gemv_gpu.py, docs/benchmarks.md, issues 23 and 24):
# bf16 against cuBLAS (plus the norm's or SiLU's launch): every llama3-8b projection since the
# 2048-column tiles (down with its SiLU 29.9 us against 33.0; the step 4.17 ms against 4.31 without
# it); qwen2.5-32b's q/k/v, o and gate/up (its down was not remeasured with the new tiles). No FP8
# entry: a prologue costs an FP8 GEMV 5-15% of its time, and FP8 steps with the prologues folded
# in lost to the plain GEMVs with separate launches (3.03 ms against 2.79). An FP8 projection
# without its prologue always runs here (engine.quant.fp8.fp8_linear).
WINS: frozenset[tuple[str, int, int, str]] = frozenset({
    ("16bit", 6144, 4096, "norm"), ("16bit", 4096, 4096, "none"), ("16bit", 28672, 4096, "norm"),  # llama3-8b
    ("16bit", 4096, 14336, "silu"),
    ("16bit", 7168, 5120, "norm"), ("16bit", 5120, 5120, "none"), ("16bit", 55296, 5120, "norm"),  # qwen2.5-32b
    # deepseek-v2-lite: latent attention's q/kv_a with its norm and o, the shared experts' gate/up
    # and down, the dense layer 0's MLP (bench/mla_gpu.py --gemv all against table: the batch-1
    # step 2.59 ms against 2.76, batch 64 unchanged; docs/benchmarks.md, issue 29)
    ("16bit", 3648, 2048, "norm"), ("16bit", 2048, 2048, "none"), ("16bit", 5632, 2048, "none"),
    ("16bit", 2048, 2816, "silu"), ("16bit", 21888, 2048, "norm"), ("16bit", 2048, 10944, "silu")})
# "table": WINS; "all": every projection, every prologue; "off": none (the separate launches and
# cuBLAS; FP8 still takes the plain kernel through fp8_linear). Benchmarks compare.
POLICY = "table"


def takes(weight: torch.Tensor, prologue: str = "none") -> bool:
    """Whether a one-token projection with this weight, `prologue` folded in, runs here."""
    kind = _weight_kind(weight)
    if POLICY == "off" or kind is None:
        return False
    if POLICY == "all":
        return True
    return (kind, *weight.shape, prologue) in WINS


def check_weight(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None, bias: torch.Tensor | None,
                 group_k: int, k: int) -> None:
    """The checks every projection kernel makes of its weight [N, K] (model dtype, or FP8 with its
    scale [N, G]: G == 1, or one per group_k columns), scale and bias against x's device and K."""
    require_tensor("weight", weight, ndim=2, dtypes=(*FLOAT_DTYPES, FP8_DTYPE))
    require_same("weight", weight, "x", x, dtype=False)
    n = weight.shape[0]
    if weight.shape[1] != k:
        raise ValueError(f"weight is {tuple(weight.shape)} but the input has {k} columns")
    if (scale is None) != (weight.dtype != FP8_DTYPE):
        raise ValueError("an FP8 weight needs its scale, and only an FP8 weight takes one")
    if scale is not None:
        require_tensor("scale", scale, ndim=2, dtypes=(torch.float32,), last_dim_contiguous=False)
        require_same("scale", scale, "x", x, dtype=False)
        groups = 1 if group_k == 0 else -(-k // group_k)
        if group_k < 0 or (group_k and group_k % 16):
            raise ValueError(f"group_k must be 0 (per channel) or a multiple of 16, got {group_k}")
        if tuple(scale.shape) != (n, groups) or (groups > 1 and scale.stride(1) != 1):
            raise ValueError(f"scale must be [{n}, {groups}] float32 with contiguous groups, got "
                             f"{tuple(scale.shape)} strides {scale.stride()}")
    elif weight.dtype != x.dtype:
        raise ValueError(f"weight has dtype {weight.dtype} but x has {x.dtype}")
    if bias is not None:
        require_tensor("bias", bias, ndim=1, dtypes=FLOAT_DTYPES)
        require_same("bias", bias, "x", x, dtype=False)
        if bias.shape[0] != n:
            raise ValueError(f"bias has {bias.shape[0]} elements for {n} output channels")


def _launch(prologue: int, x, residual, norm_weight, new_residual, eps, weight, scale, bias, group_k, k,
            config: GemvConfig | None, sums: torch.Tensor | None = None,
            fold: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None, silu_out: bool = False
            ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """-> (out [1, N], or [1, N / 2] with `silu_out`; the sums of squares the residual-norm epilogue
    wrote: one per program, or None). `sums`: the input's sums of squares (prologue _SCALED);
    `fold`: (residual, the next norm's weight, the new residual stream to write) for the epilogue."""
    require_runnable(x, _gemv_kernel)
    n = weight.shape[0]
    cfg = config or choose_gemv_config(n, k, weight.dtype, group_k, _PROLOGUE_NAMES[prologue])
    if group_k and group_k % cfg.block_k:
        raise ValueError(f"block_k {cfg.block_k} must divide group_k {group_k}")
    if silu_out and (n % 2 or cfg.block_n % 2):
        raise ValueError(f"SiLU(gate) * up needs an even number of weight rows and of rows per program, "
                         f"got {n} and block_n {cfg.block_n}")
    n_out = n // 2 if silu_out else n
    grid = triton.cdiv(n_out, cfg.block_n // 2 if silu_out else cfg.block_n)
    out = torch.empty((1, n_out), dtype=x.dtype, device=x.device)
    if fold is not None:
        sums = torch.empty(grid, dtype=torch.float32, device=x.device)
    anchor = scale if scale is not None else weight  # any tensor stands in for an unused pointer
    er, eg, enew = fold if fold is not None else (anchor, anchor, anchor)
    pdl = _pdl(x.device, weight.dtype)
    vec = min(16 // weight.element_size(), cfg.block_k) if cfg.thread_sums else 1
    num_ss = sums.numel() if sums is not None else 1
    _gemv_kernel[(grid,)](
        x, residual if residual is not None else x, norm_weight if norm_weight is not None else anchor,
        new_residual if new_residual is not None else out, weight, anchor, bias if bias is not None else anchor,
        out, sums if sums is not None else anchor, er, eg, enew,
        n, k, weight.stride(0), scale.stride(0) if scale is not None else 0, float(eps), num_ss,
        PROLOGUE=prologue, HAS_RESIDUAL=residual is not None, SCALED=scale is not None, GROUP_K=group_k,
        HAS_BIAS=bias is not None, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, EVEN_K=k % cfg.block_k == 0,
        USE_PDL=pdl, VEC=vec, RESIDUAL_NORM=fold is not None, BLOCK_SS=triton.next_power_of_2(num_ss),
        SILU_OUT=silu_out, EARLY_EPILOGUE=EARLY_EPILOGUE, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages, **({"launch_pdl": True} if pdl else {}))
    return out, sums if fold is not None else None


# The epilogue's reads (FP8 row scales, the residual rows and the next norm's weight of the
# residual-norm epilogue) issued before the K loop instead of after it (_gemv_kernel's
# EARLY_EPILOGUE); tests compare both orders under the interpreter. llama3-8b's FP8 batch-1 step on
# the H200: 2.318 ms against 2.379 after the loop, bf16's unchanged (docs/benchmarks.md, 2026-12-05)
EARLY_EPILOGUE = True

# Programmatic dependent launch (Hopper on): each GEMV is launched so that it may start while the
# kernel before it finishes (_gemv_kernel): "prefetch" (its first weight tile loaded before it
# waits), "wait" (it only waits), "off" (plain launches); `PDL` for model-dtype weights, `PDL_FP8`
# for FP8 (None: "prefetch" where the norm, SiLU and attention kernels are PDL launches too,
# engine.kernels.pdl.on(), else "off"). On the H200 (docs/benchmarks.md, issues 23 and 24): the
# bf16 8B batch-1 step 4.188 ms prefetching against 4.705 with cuBLAS; FP8 2.78 plain, 2.64
# waiting after PDL small kernels, 2.59 prefetching (2.79 while the tile was widened to fp32
# before the wait, four times the registers), 3.06 prefetching after plain ones.
PDL = "prefetch"
PDL_FP8: str | None = None
_PDL_MODES = {"off": 0, "wait": 1, "prefetch": 2}


def _pdl(device: torch.device, weight_dtype: torch.dtype) -> int:
    if weight_dtype == FP8_DTYPE:
        mode = PDL_FP8 if PDL_FP8 is not None else "prefetch" if pdl.on() else "off"
    else:
        mode = PDL
    return _PDL_MODES[mode] if pdl.supported(device) else 0


def _check_norm_weight(norm_weight: torch.Tensor, x: torch.Tensor, hidden: int) -> None:
    require_tensor("norm_weight", norm_weight, ndim=1, dtypes=FLOAT_DTYPES)
    require_same("norm_weight", norm_weight, "x", x, dtype=False)
    if norm_weight.shape[0] != hidden:
        raise ValueError(f"norm_weight has {norm_weight.shape[0]} elements for hidden size {hidden}")


def _check_row(name: str, x: torch.Tensor) -> None:
    require_tensor(name, x, ndim=2, dtypes=FLOAT_DTYPES)
    if x.shape[0] != 1:
        raise ValueError(f"{name} must be one token, [1, K], got shape {tuple(x.shape)}")


def gemv(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None = None,
         bias: torch.Tensor | None = None, *, group_k: int = 0, config: GemvConfig | None = None,
         silu_out: bool = False) -> torch.Tensor:
    """x [1, K] @ weight[N, K]^T (+ bias) -> [1, N] in x's dtype. weight in x's dtype (scale None)
    or float8_e4m3fn with scale [N, G] float32. `silu_out`: weight is a gate/up projection [2I, K]
    (gate rows first) and the output is SiLU(gate) * up [1, I], what `fused.silu_and_mul` makes of
    the plain output (each program computes gate and up rows of the same channels)."""
    _check_row("x", x)
    check_weight(x, weight, scale, bias, group_k, x.shape[1])
    return _launch(_PLAIN, x, None, None, None, 0.0, weight, scale, bias, group_k, x.shape[1], config,
                   silu_out=silu_out)[0]


def norm_gemv(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
              weight: torch.Tensor, scale: torch.Tensor | None = None, bias: torch.Tensor | None = None, *,
              group_k: int = 0, config: GemvConfig | None = None,
              silu_out: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The projection of RMSNorm(x + residual): what `fused.rms_norm(x, norm_weight, eps, residual)`
    followed by `gemv` (`silu_out` as gemv's) on its output gives, in one launch. -> (out [1, N],
    new residual [1, K]; x itself when residual is None)."""
    _check_row("x", x)
    k = x.shape[1]
    if residual is not None:
        require_tensor("residual", residual, ndim=2, dtypes=FLOAT_DTYPES)
        require_same("residual", residual, "x", x, shape=True)
    _check_norm_weight(norm_weight, x, k)
    check_weight(x, weight, scale, bias, group_k, k)
    new_residual = x if residual is None else torch.empty_like(x)
    out, _ = _launch(_NORM, x, residual, norm_weight, new_residual if residual is not None else None, eps,
                     weight, scale, bias, group_k, k, config, silu_out=silu_out)
    return out, new_residual


def silu_gemv(gate_up: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None = None,
              bias: torch.Tensor | None = None, *, group_k: int = 0,
              config: GemvConfig | None = None) -> torch.Tensor:
    """The projection of SiLU(gate) * up, gate_up [1, 2 * K] (gate first): what
    `fused.silu_and_mul` followed by `gemv` gives, in one launch. -> [1, N]."""
    _check_row("gate_up", gate_up)
    if gate_up.shape[1] % 2:
        raise ValueError(f"gate_up must be [1, 2 * intermediate], got odd width {gate_up.shape[1]}")
    k = gate_up.shape[1] // 2
    check_weight(gate_up, weight, scale, bias, group_k, k)
    return _launch(_SILU, gate_up, None, None, None, 0.0, weight, scale, bias, group_k, k, config)[0]


# ---- the next norm folded into the GEMV before it ----------------------------------------------
# A layer's o and down projections feed the residual stream, and the RMSNorm after each sum feeds
# the next projection. The norm needs the whole vector, which no one program of a GEMV holds, so
# it is split between the two GEMVs around it: the producer's programs each add their rows to the
# residual stream, write them times the norm's weight, and write their rows' sum of squares
# (`residual_gemv`); the consumer reads that vector like a plain input and scales its dot products
# by 1 / rms from the sums (`scaled_gemv`). No norm launch, and no extra pass over the vector in
# either GEMV (where `norm_gemv` makes every program read the input, the residual and the norm's
# weight: for FP8 weights that costs more than the launch it saves). Which weight kinds fold:
# `FOLD_KINDS` (measured on the H200, docs/benchmarks.md, issue 24).
FOLD_KINDS: frozenset[str] = frozenset({"fp8"})


@dataclass
class NormedRow:
    """One token's RMSNorm, left for the GEMV that reads it to finish (`residual_gemv` makes it):
    `y` [1, K] = the residual stream times the norm's weight (model dtype), `sums` [P] fp32 = sums
    of squares of the residual stream over P slices. RMSNorm(stream) = y * rsqrt(sum(sums) / K + eps),
    as `scaled_gemv` applies it, or `finish` for any other reader."""
    y: torch.Tensor
    sums: torch.Tensor
    norm_weight: torch.Tensor
    eps: float

    @property
    def shape(self) -> torch.Size:
        return self.y.shape

    def finish(self) -> torch.Tensor:
        """The normalised activations [1, K] in the model dtype."""
        inv = torch.rsqrt(self.sums.sum() / self.y.shape[1] + self.eps)
        return (self.y.float() * inv).to(self.y.dtype)


# A gate/up projection's SiLU-and-mul as its GEMV's epilogue (`silu_out`): no SiLU launch, and the
# down projection reads a plain input. Which weight kinds take it: `ACT_KINDS` (measured on the H200,
# docs/benchmarks.md, issue 24); the others keep the SiLU where `takes(down, "silu")` puts it.
ACT_KINDS: frozenset[str] = frozenset({"fp8"})


def activates(weight: torch.Tensor) -> bool:
    """Whether a one-token gate/up projection with this weight [2I, K] computes SiLU(gate) * up
    in its GEMV (`silu_out`): its weight kind is in ACT_KINDS and POLICY is not "off"."""
    return POLICY != "off" and _weight_kind(weight) in ACT_KINDS and weight.shape[0] % 2 == 0


def folds(weight: torch.Tensor) -> bool:
    """Whether a one-token projection with this weight, feeding the residual stream, takes the next
    norm into its GEMV (`residual_gemv`): its weight kind is in FOLD_KINDS ("fp8", "16bit", "fp32")
    and POLICY is not "off"."""
    return POLICY != "off" and _weight_kind(weight) in FOLD_KINDS


def residual_gemv(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None = None,
                  bias: torch.Tensor | None = None, *, residual: torch.Tensor, norm_weight: torch.Tensor,
                  eps: float, silu: bool = False, group_k: int = 0,
                  config: GemvConfig | None = None) -> tuple[NormedRow, torch.Tensor]:
    """`gemv(x)` (`silu`: of SiLU(gate) * up, x = gate_up [1, 2K]) added to `residual`, and the
    RMSNorm with `norm_weight` of that sum begun: -> (NormedRow, the new residual stream [1, N]).
    The new stream has the bits `fused.rms_norm(gemv(x), norm_weight, eps, residual)` gives it."""
    _check_row("x", x)
    if silu and x.shape[1] % 2:
        raise ValueError(f"gate_up must be [1, 2 * intermediate], got odd width {x.shape[1]}")
    k = x.shape[1] // 2 if silu else x.shape[1]
    check_weight(x, weight, scale, bias, group_k, k)
    n = weight.shape[0]
    require_tensor("residual", residual, ndim=2, dtypes=FLOAT_DTYPES)
    require_same("residual", residual, "x", x)
    if tuple(residual.shape) != (1, n):
        raise ValueError(f"residual has shape {tuple(residual.shape)}, the output is [1, {n}]")
    _check_norm_weight(norm_weight, x, n)
    new_residual = torch.empty_like(residual)
    y, sums = _launch(_SILU if silu else _PLAIN, x, None, None, None, 0.0, weight, scale, bias, group_k, k,
                      config, fold=(residual, norm_weight, new_residual))
    return NormedRow(y, sums, norm_weight, float(eps)), new_residual


def scaled_gemv(row: NormedRow, weight: torch.Tensor, scale: torch.Tensor | None = None,
                bias: torch.Tensor | None = None, *, group_k: int = 0,
                config: GemvConfig | None = None, silu_out: bool = False) -> torch.Tensor:
    """The projection of a NormedRow's normalised activations (what `gemv(row.finish())` gives,
    without rounding them to the model dtype; `silu_out` as gemv's): one launch, the 1/rms applied
    to the dot products."""
    _check_row("row.y", row.y)
    check_weight(row.y, weight, scale, bias, group_k, row.y.shape[1])
    return _launch(_SCALED, row.y, None, None, None, row.eps, weight, scale, bias, group_k, row.y.shape[1],
                   config, sums=row.sums, silu_out=silu_out)[0]
