"""FP8 checkpoints' scale tensors: checked against the model before any weight is read, and copied
with their FP8 weights into the model's fused projections.

Layouts (engine.quant.scheme reads which from config.json):
- `<proj>.weight` e4m3 [N, K] + `<proj>.weight_scale` fp32: one per tensor ([] or [1]: AutoFP8,
  llm-compressor, vLLM's FP8 exports) or one per output channel ([N] or [N, 1]);
- `<proj>.weight` e4m3 + `<proj>.weight_scale_inv` [ceil(N / 128), ceil(K / 128)] with
  `weight_block_size: [128, 128]` (DeepSeek-V3, Qwen FP8), despite the name also a multiplier.
A projection a checkpoint leaves unquantized (`ignored_layers`) ships in a float dtype with no
scale. Static activation scales (`input_scale`) and KV-cache scales (`k_scale`, `v_scale`) are
refused by name.
"""

from __future__ import annotations

import torch

from tandem.engine.config import ModelConfig
from tandem.engine.linear import Linear
from tandem.engine.quant.fp8 import FP8_DTYPE, expand_block_scale

PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
               "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
_REFUSED = {"input_scale": "static activation scales (activation_scheme 'static')",
            "k_scale": "FP8 KV-cache scales", "v_scale": "FP8 KV-cache scales",
            "kv_scale": "FP8 KV-cache scales"}


class ScaleError(ValueError):
    """A scale tensor that does not fit the model or the checkpoint's scheme."""


def _scale_shapes(cfg: ModelConfig, weight_shape: tuple[int, ...]) -> tuple[str, list[tuple[int, ...]]]:
    n, k = weight_shape
    if cfg.weight_block_size is not None:
        bn, bk = cfg.weight_block_size
        return "weight_scale_inv", [(-(-n // bn), -(-k // bk))]
    return "weight_scale", [(), (1,), (n,), (n, 1)]


def split_scales(cfg: ModelConfig, found: dict[str, tuple[tuple[int, ...], str]],
                 expected: dict[str, tuple[int, ...]]) -> dict[str, tuple[tuple[int, ...], str]]:
    """`found` (name -> (shape, file)) without the scale tensors of an FP8 checkpoint, each checked:
    it must belong to a projection weight of `expected` and have the scheme's name and shape."""
    rest = {}
    for name, (shape, file) in found.items():
        stem, _, leaf = name.rpartition(".")
        if leaf in _REFUSED:
            raise ScaleError(f"{file}: tensor {name!r}: {_REFUSED[leaf]} are not implemented")
        if leaf not in ("weight_scale", "weight_scale_inv"):
            rest[name] = (shape, file)
            continue
        weight = expected.get(stem + ".weight")
        if weight is None or not stem.endswith(PROJECTIONS):
            raise ScaleError(f"{file}: tensor {name!r} scales no FP8 projection of {cfg.architecture} "
                             "(the embeddings and the LM head stay in the model dtype)")
        want, shapes = _scale_shapes(cfg, weight)
        if leaf != want:
            raise ScaleError(f"{file}: tensor {name!r}: quantization_config "
                             f"{'sets' if cfg.weight_block_size else 'has no'} weight_block_size, so the "
                             f"scales must be named {want}")
        if tuple(shape) not in shapes:
            raise ScaleError(f"{file}: tensor {name!r} has shape {list(shape)}; for a weight of shape "
                             f"{list(weight)} it must be one of {[list(s) for s in shapes]}")
    return rest


def fused_projections(layer: torch.nn.Module, prefix: str) -> list[tuple[Linear, list[tuple[str, int]]]]:
    """A decoder layer's linears, each with the checkpoint projections it holds, in row order:
    [(linear, [(hf name without '.weight', rows), ...]), ...]."""
    attn, mlp = layer.self_attn, layer.mlp
    return [(attn.qkv_proj, [(prefix + "self_attn.q_proj", attn.q_size), (prefix + "self_attn.k_proj", attn.kv_size),
                             (prefix + "self_attn.v_proj", attn.kv_size)]),
            (attn.o_proj, [(prefix + "self_attn.o_proj", attn.o_proj.out_features)]),
            (mlp.gate_up_proj, [(prefix + "mlp.gate_proj", mlp.intermediate), (prefix + "mlp.up_proj", mlp.intermediate)]),
            (mlp.down_proj, [(prefix + "mlp.down_proj", mlp.down_proj.out_features)])]


@torch.no_grad()
def load_fp8_linear(linear: Linear, parts: list[tuple[str, int]], get, block_size: tuple[int, int] | None) -> bool:
    """Copy an FP8 checkpoint's `parts` (weights + scales, read with `get(name)`) into `linear`,
    turned FP8 first. False (nothing copied) when the checkpoint ships these weights unquantized."""
    weights = [get(name + ".weight") for name, _ in parts]
    is_fp8 = [w.dtype == FP8_DTYPE for w in weights]
    if not any(is_fp8):
        return False
    if not all(is_fp8):
        mixed = [name for (name, _), f in zip(parts, is_fp8) if not f]
        raise ScaleError(f"{mixed} ship unquantized beside FP8 {parts[0][0]}: a fused projection must be all FP8")
    groups = 1 if block_size is None else -(-linear.in_features // block_size[1])
    linear.make_fp8(groups, 0 if block_size is None else block_size[1])
    row = 0
    for (name, rows), w in zip(parts, weights):
        scale = get(name + (".weight_scale_inv" if block_size else ".weight_scale"))
        if scale is None:
            raise ScaleError(f"FP8 tensor {name + '.weight'!r} has no scale")
        if block_size is not None:
            scale = expand_block_scale(scale, rows, block_size[0])
        linear.weight[row:row + rows].copy_(w)
        linear.weight_scale[row:row + rows].copy_(scale.float().reshape(-1, 1) if scale.dim() < 2 or
                                                  scale.shape[1] == 1 else scale)
        row += rows
    return True
