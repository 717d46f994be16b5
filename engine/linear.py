"""The linear layer of every projection of engine.model (q/k/v and gate/up fused, o, down).

In the model dtype it is `nn.Linear` (the same parameters, names and `F.linear` call, so bf16,
fp16 and fp32 run and capture in CUDA graphs as before). `to_fp8` (quantize what it holds, per
output channel) or `make_fp8` (an empty FP8 weight that a checkpoint's FP8 tensors are copied
into) turn it into an FP8 e4m3 layer: `weight` [N, K] float8_e4m3fn and `weight_scale` [N, G]
float32 (engine.quant.fp8 says what G means), run by `engine.quant.fp8.fp8_linear`. The bias, if
any, stays in the model dtype. Quantization acts on whatever weight the layer holds, so a
tensor-parallel shard is quantized after it is cut. `fp8_head` does the same to an untied LM head
(a decode step reads its vocab x hidden weight whole: 1 GB of bf16 at Llama 3's 128k vocabulary).
"""

from __future__ import annotations

import torch
from torch import nn
import torch.nn.functional as F

from tandem.engine.quant.fp8 import FP8_DTYPE, fp8_linear, quantize_fp8


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(out_features, device=device, dtype=dtype)) if bias else None
        self.register_buffer("weight_scale", None)  # [N, G] float32 once FP8
        self.group_k = 0  # FP8 block scales: input columns per scale group (0: per channel)

    @property
    def is_fp8(self) -> bool:
        return self.weight.dtype == FP8_DTYPE

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight_scale is None:
            return F.linear(x, self.weight, self.bias)
        return fp8_linear(x, self.weight, self.weight_scale, self.bias, self.group_k)

    @torch.no_grad()
    def to_fp8(self) -> None:
        """Quantize the weight this layer holds per output channel (a no-op when already FP8)."""
        if self.is_fp8:
            return
        q, scale = quantize_fp8(self.weight)
        self._set_fp8(q, scale, 0)

    def make_fp8(self, groups: int = 1, group_k: int = 0) -> None:
        """An uninitialised FP8 weight and scale [N, groups] on the weight's device, for a loader."""
        dev = self.weight.device
        self._set_fp8(torch.empty(self.out_features, self.in_features, dtype=FP8_DTYPE, device=dev),
                      torch.empty(self.out_features, groups, dtype=torch.float32, device=dev), group_k)

    def _set_fp8(self, q: torch.Tensor, scale: torch.Tensor, group_k: int) -> None:
        self.weight = nn.Parameter(q, requires_grad=False)
        self.weight_scale = scale.float().contiguous()
        self.group_k = group_k

    def extra_repr(self) -> str:
        fp8 = f", fp8 group_k={self.group_k}" if self.is_fp8 else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}{fp8}"


@torch.no_grad()
def fp8_head(head: nn.Module) -> nn.Module:
    """An untied `nn.Linear` LM head as an FP8 `Linear` (per output channel, quantized from the
    weight it holds, which is then released). Any other head (a vocab-parallel shard) comes back
    unchanged; a caller leaves a head tied to the embeddings alone (the lookup table stays)."""
    if type(head) is not nn.Linear:
        return head
    out = Linear(head.in_features, head.out_features, bias=head.bias is not None, device="meta")
    out.weight, out.bias = head.weight, head.bias
    out.to_fp8()
    return out
