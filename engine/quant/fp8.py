"""FP8 (e4m3) weights: quantizing a weight per output channel, dequantizing (the reference), and the
matmul every FP8 `engine.linear.Linear` runs, picked per call by where and how many tokens.

A weight is `q [N, K]` float8_e4m3fn with `scale [N, G]` float32, w ~= q * scale: G == 1 per output
channel (quantized at load, or a checkpoint's per-tensor / per-channel `weight_scale`), or G groups
of `group_k` input columns (a checkpoint's `weight_block_size` [128, 128] with `weight_scale_inv`,
each block's scale repeated over its rows so that q/k/v and gate/up fuse by concatenating rows).

`fp8_linear` on CUDA: the Triton weight-only kernel (engine.kernels.fp8_gemm: bf16 activations,
weights widened in the kernel) below `SCALED_MM_MIN_TOKENS` tokens or with block scales;
`torch._scaled_mm` (activations quantized per token, FP8 tensor cores) from there on, where reading
the weight once no longer dominates. Elsewhere (the CPU): dequantize, then a plain matmul.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tandem.engine.kernels import triton_available

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
# 1 / 448 rounded to fp32. A token's scale is amax * FP8_INV_MAX, a multiplication, because that is
# what torch does on CUDA for `amax / 448` (a CPU-scalar divisor becomes a reciprocal multiply, one
# ulp off the division now and then) and the CPU path and engine.kernels.fp8_gemm.quantize_rows
# must give the same bits on both devices
FP8_INV_MAX = float(torch.tensor(1 / FP8_MAX, dtype=torch.float32))
# tokens from which a per-channel FP8 GEMM goes to torch._scaled_mm on CUDA: bench/fp8_gpu.py on
# an H200, the 8B projections summed: the Triton kernel 104 us at 16 tokens against 125, 158 us at
# 32 against 120 (docs/benchmarks.md)
SCALED_MM_MIN_TOKENS = 32
_MIN_SCALE = 1e-12  # an all-zero row or token gets this scale instead of 0 (no 0 / 0)
_CHUNK_BYTES = 256 << 20


def quantize_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] (any float dtype) -> (q [N, K] float8_e4m3fn, scale [N, 1] float32), per output
    channel: each row's largest |value| maps to 448."""
    if w.dim() != 2:
        raise ValueError(f"quantize_fp8 takes a 2-D weight, got shape {tuple(w.shape)}")
    q = torch.empty(w.shape, dtype=FP8_DTYPE, device=w.device)
    scale = torch.empty(w.shape[0], 1, dtype=torch.float32, device=w.device)
    # by row chunks: the temporaries (|w| and the fp32 w / scale) stay under ~_CHUNK_BYTES, so a
    # 70B layer or LM head (4.2 GB in fp32) quantizes beside the finished model
    rows = max(1, _CHUNK_BYTES // max(1, 4 * w.shape[1]))
    for i in range(0, w.shape[0], rows):
        part = w[i:i + rows]
        s = scale[i:i + rows]
        torch.div(part.abs().amax(dim=1, keepdim=True).float(), FP8_MAX, out=s).clamp_min_(_MIN_SCALE)
        q[i:i + rows] = (part / s).clamp_(-FP8_MAX, FP8_MAX)
    return q, scale


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, group_k: int = 0,
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The weight `q * scale` [N, K] in `dtype` (scale [N, 1], or [N, G] with groups of group_k)."""
    w = q.float()
    if group_k:
        s = scale.repeat_interleave(group_k, dim=1)[:, :w.shape[1]]
    else:
        s = scale
    return (w * s).to(dtype)


def expand_block_scale(scale_inv: torch.Tensor, n: int, block_n: int) -> torch.Tensor:
    """A checkpoint's block scales [ceil(N / block_n), G] -> one row per output channel [N, G]."""
    return scale_inv.float().repeat_interleave(block_n, dim=0)[:n].contiguous()


def quantize_tokens(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (fp8 [M, K], scale [M, 1] fp32): per token (the reference of
    engine.kernels.fp8_gemm.quantize_rows)."""
    scale = (x.abs().amax(dim=1, keepdim=True).float() * FP8_INV_MAX).clamp_min(_MIN_SCALE)
    return (x.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def scaled_mm_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                     bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] bf16/fp16 through torch._scaled_mm: rowwise scales (tokens x channels), the
    activations quantized per token by one Triton kernel (on CUDA) or plain torch."""
    if x.device.type == "cuda" and triton_available():
        from tandem.engine.kernels.fp8_gemm import quantize_rows  # noqa: PLC0415 (triton loads only where kernels run)

        xq, xs = quantize_rows(x, _MIN_SCALE)
    else:
        xq, xs = quantize_tokens(x)
    out = torch._scaled_mm(xq, q.t(), scale_a=xs, scale_b=scale.view(1, -1), out_dtype=x.dtype)
    return out if bias is None else out + bias


def torch_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                 group_k: int = 0) -> torch.Tensor:
    """The reference path: dequantize to x's dtype, then F.linear (correct, not fast)."""
    return F.linear(x, dequantize_fp8(q, scale, group_k, x.dtype), bias)


def fp8_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
               group_k: int = 0) -> torch.Tensor:
    """y = x @ (q * scale)^T + bias for x [..., K]; see the module docstring for the path taken."""
    if x.device.type != "cuda" or not triton_available():
        return torch_linear(x, q, scale, bias, group_k)
    from tandem.engine.kernels.fp8_gemm import fp8_gemm  # noqa: PLC0415 (triton loads only where kernels run)

    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if (group_k == 0 and x2.shape[0] >= SCALED_MM_MIN_TOKENS and x.dtype in (torch.bfloat16, torch.float16)
            and q.shape[0] % 16 == 0 and q.shape[1] % 16 == 0):
        out = scaled_mm_linear(x2, q, scale, bias)
    else:
        out = fp8_gemm(x2 if x2.stride(-1) == 1 else x2.contiguous(), q, scale, bias, group_k=group_k)
    return out.view(*shape[:-1], q.shape[0])
