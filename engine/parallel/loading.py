"""Loading one rank's shard of a model, part by part (engine.build): the rank's decoder is made on
the meta device from its config (engine.parallel.sharding.rank_config) with the vocab-parallel
layers in place, then each part is allocated, filled with the rank's slices of the full tensors
and, with `--quantization fp8`, quantized ("shard, then quantize"). The full tensors come one part
at a time from a full-size twin of that part: a directory's tensors, or a `*-random` preset's
seeded draws made exactly as the single-device engine makes them (so TP=N serves TP=1's weights).
"""

from __future__ import annotations

import torch

from tandem.engine.build import CheckpointReader, Fill, checkpoint_fill, fill_parts, model_parts, random_fill
from tandem.engine.checkpoint import check_model_dir
from tandem.engine.config import PRESETS, EngineConfig, ModelConfig
from tandem.engine.model import LlamaForCausalLM
from tandem.engine.parallel.group import TPGroup, current_group
from tandem.engine.parallel.layers import make_parallel
from tandem.engine.parallel.sharding import check_shardable, rank_config, shard_tensor
from tandem.engine.tokenizer import ByteTokenizer, HFTokenizer
from tandem.engine.weights import DTYPES, load_model, resolve_model_dir
from tandem.wire.errors import ConfigError


def shard_fill(cfg: ModelConfig, full_fill: Fill, group: TPGroup, device, dtype: torch.dtype) -> Fill:
    """A filler of a rank's parts: each part of a full-size twin is made, filled by `full_fill`,
    cut to the rank's slices, and freed before the next (peak: one full part)."""
    with torch.device("meta"):
        full = LlamaForCausalLM(cfg).to(dtype)
    twins = dict(model_parts(full))

    @torch.no_grad()
    def fill(model: LlamaForCausalLM, prefix: str, part) -> None:
        twin = twins[prefix]
        twin.to_empty(device=device)
        full_fill(full, prefix, twin)
        whole = full.hf_tensors()
        for name, dst in model.hf_tensors().items():
            if name.startswith(prefix):
                dst.copy_(shard_tensor(name, whole[name], cfg, group.rank, group.world_size))
        twin.to_empty(device="meta")
    return fill


def build_rank_model(cfg: ModelConfig, group: TPGroup, dtype: torch.dtype, device, fill: Fill,
                     fp8: bool = False) -> LlamaForCausalLM:
    """This rank's shard of a model of config `cfg`, built and filled part by part."""
    with torch.device("meta"):
        model = make_parallel(LlamaForCausalLM(rank_config(cfg, group.world_size)).to(dtype), group)
    return fill_parts(model, cfg, device, fill, fp8=fp8)


def load_rank_model(config: EngineConfig, group: TPGroup):
    """-> (this rank's shard in eval mode, tokenizer, the model's full ModelConfig). Refuses by
    name a model whose KV heads or MLP the group cannot split, and FP8 checkpoints (their scales
    are not sharded yet; `--quantization fp8` of a bf16 checkpoint is)."""
    dtype, path = DTYPES[config.dtype], resolve_model_dir(config.model)
    if path is None:
        cfg = PRESETS[config.model]
        tokenizer, full_fill = ByteTokenizer(cfg.vocab_size, cfg.eos_token_ids), random_fill(config.seed, config.device)
    else:
        cfg = check_model_dir(path)
        tokenizer = HFTokenizer.from_dir(path, cfg.eos_token_ids)
        full_fill = checkpoint_fill(CheckpointReader(path))
    check_shardable(cfg, group.world_size, config.model)
    if cfg.quant_method is not None:
        raise ConfigError(f"engine: tensor_parallel_size {group.world_size} with the {cfg.quant_method} checkpoint "
                          f"{config.model!r} is not implemented (its scales are not sharded); serve its bf16 "
                          "version with --quantization fp8")
    fill = shard_fill(cfg, full_fill, group, config.device, dtype)
    model = build_rank_model(cfg, group, dtype, config.device, fill, fp8=config.quantization == "fp8")
    return model, tokenizer, cfg


def load_engine_model(config: EngineConfig):
    """-> (model, tokenizer, ModelConfig) an engine serves: the whole model on one rank, else this
    process's rank's shard (it must have joined the worker's group: init_tensor_parallel)."""
    if config.tensor_parallel_size == 1:
        return load_model(config.model, config.dtype, config.device, config.seed, config.quantization)
    return load_rank_model(config, current_group(config.tensor_parallel_size))
