"""Building a model on its device part by part, so that no more than one part is ever held in a
form larger than the finished model's.

The model is made on the meta device (no memory). Then, in parameter order (the embeddings, each
decoder layer, the final norm, the LM head) each part is allocated on the device in the model
dtype, filled (`random_fill`: the seeded values of a `*-random` preset; `checkpoint_fill`: a
directory's tensors, read one at a time), and with `fp8` its projections (and an untied LM head)
are quantized before the next part is allocated. Peak memory is the finished parts plus one part
in the model dtype: a 70B model quantized at load fits one H200. A filler sees whatever the part
holds, so a tensor-parallel loader can fill a shard, which is then quantized ("shard, then
quantize").
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from tandem.engine.architectures import UnsupportedModelError
from tandem.engine.checkpoint import tensor_index
from tandem.engine.config import ModelConfig
from tandem.engine.linear import Linear, fp8_head
from tandem.engine.model import DecoderLayer, LlamaForCausalLM
from tandem.engine.quant.checkpoint import ScaleError, fused_projections, load_fp8_linear
from tandem.engine.quant.fp8 import FP8_DTYPE
from tandem.wire.errors import ConfigError

# fill(model, prefix, part): write every tensor of `part` (prefix: its Hugging Face name prefix)
Fill = Callable[[LlamaForCausalLM, str, nn.Module], None]


def model_parts(model: LlamaForCausalLM) -> list[tuple[str, nn.Module]]:
    """(Hugging Face name prefix, module) in the order of model.named_parameters()."""
    parts: list[tuple[str, nn.Module]] = [("model.embed_tokens.", model.embed_tokens)]
    parts += [(f"model.layers.{i}.", layer) for i, layer in enumerate(model.layers)]
    parts.append(("model.norm.", model.norm))
    if not model.config.tie_word_embeddings:
        parts.append(("lm_head.", model.lm_head))
    return parts


def quantize_layer(part: nn.Module) -> None:
    """Every projection of `part` to FP8 per output channel (the embeddings stay in the model
    dtype; fill_parts turns an untied LM head into FP8 too)."""
    for module in part.modules():
        if isinstance(module, Linear):
            module.to_fp8()


def build_model(cfg: ModelConfig, device: str | torch.device, dtype: torch.dtype, fill: Fill, *,
                fp8: bool = False, max_positions: int | None = None) -> LlamaForCausalLM:
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg, max_positions).to(dtype)
    return fill_parts(model, cfg, device, fill, fp8=fp8, max_positions=max_positions)


def fill_parts(model: LlamaForCausalLM, cfg: ModelConfig, device: str | torch.device, fill: Fill, *,
               fp8: bool = False, max_positions: int | None = None) -> LlamaForCausalLM:
    """A model built on the meta device, made real part by part on `device`: each part filled
    (and quantized) before the next is allocated; tied embeddings and the fp32 rotary table last.
    `cfg`: the whole model's config (the rotary table's length)."""
    if fp8 and cfg.moe is not None:
        raise ConfigError("engine: quantization fp8 with mixture-of-experts layers is not implemented "
                          "(the experts would stay in the model dtype); serve it unquantized")
    if fp8 and cfg.mla is not None:
        raise ConfigError("engine: quantization fp8 with latent attention is not implemented "
                          "(kv_b_proj is folded into the query in the model dtype); serve it unquantized")
    for prefix, part in model_parts(model):
        part.to_empty(device=device)
        fill(model, prefix, part)
        if fp8:
            quantize_layer(part)
    if fp8 and not cfg.tie_word_embeddings:
        model.lm_head = fp8_head(model.lm_head)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    rotary = type(model.rotary)  # Rotary, or engine.mla's LatentRotary
    model.rotary = rotary(model.config, max_positions or cfg.max_position_embeddings).to(device)  # fp32 table
    return model.eval()


def random_fill(seed: int, device: str | torch.device) -> Fill:
    """Seeded random weights with trained-like scales (so activations and logits stay finite): one
    generator on the device drawn in parameter order, fp32 draws cast to the model dtype (the same
    values whether the model is built whole or part by part)."""
    gen = torch.Generator(device=device).manual_seed(seed)

    @torch.no_grad()
    def fill(model: LlamaForCausalLM, prefix: str, part: nn.Module) -> None:
        for name, p in part.named_parameters():
            name = prefix + name
            # in place: one fp32 temporary of p's size (an embedding table's is 4 GB in 70B)
            draw = torch.randn(p.shape, generator=gen, device=p.device, dtype=torch.float32)
            if name.endswith("norm.weight"):
                p.copy_(draw.mul_(0.1).add_(1.0))
            else:
                p.copy_(draw.mul_(0.02 if "embed" in name or "lm_head" in name else p.shape[-1] ** -0.5))
    return fill


class CheckpointReader:
    """A directory's safetensors tensors, each read on its own, on the CPU, in its stored dtype."""

    def __init__(self, path: Path):
        self.index = tensor_index(path)  # name -> (shape, file)
        self._handles: dict[str, object] = {}

    def get(self, name: str) -> torch.Tensor | None:
        entry = self.index.get(name)
        if entry is None:
            return None
        file = entry[1]
        handle = self._handles.get(file)
        if handle is None:
            handle = self._handles[file] = safe_open(file, framework="pt")
        return handle.get_tensor(name)


def checkpoint_fill(reader: CheckpointReader) -> Fill:
    """Copy a checked directory's tensors into each part (engine.checkpoint.check_model_dir has
    checked names and shapes); an FP8 checkpoint's projections land as FP8 with their scales."""

    @torch.no_grad()
    def fill(model: LlamaForCausalLM, prefix: str, part: nn.Module) -> None:
        cfg, done = model.config, set()
        if cfg.quant_method == "fp8" and isinstance(part, DecoderLayer):
            for linear, parts in fused_projections(part, prefix):
                try:
                    if load_fp8_linear(linear, parts, reader.get, cfg.weight_block_size):
                        done.update(name + ".weight" for name, _ in parts)
                except ScaleError as e:
                    raise UnsupportedModelError(f"{reader.index[parts[0][0] + '.weight'][1]}: {e}") from None
        for name, dst in model.hf_tensors().items():
            if not name.startswith(prefix) or name in done:
                continue
            src = reader.get(name)
            if src.dtype == FP8_DTYPE:
                raise UnsupportedModelError(f"{reader.index[name][1]}: tensor {name!r} is float8 but config.json "
                                            "has no fp8 quantization_config (or the tensor is not a projection)")
            dst.copy_(src)
    return fill
