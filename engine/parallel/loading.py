"""Loading one rank's shard of a model: the full Hugging Face tensors (a directory's, or a
`*-random` preset's seeded weights, drawn as the single-device engine draws them), cut to the
rank's part (engine.parallel.sharding), into a decoder built from the rank's config."""

from __future__ import annotations

import torch

from tandem.engine.checkpoint import check_model_dir, load_tensors
from tandem.engine.config import EngineConfig, ModelConfig
from tandem.engine.model import LlamaForCausalLM, Rotary
from tandem.engine.parallel.group import TPGroup, current_group
from tandem.engine.parallel.layers import make_parallel
from tandem.engine.parallel.sharding import check_shardable, rank_config, shard_tensors
from tandem.engine.tokenizer import HFTokenizer
from tandem.engine.weights import DTYPES, hf_state_dict, load_model, resolve_model_dir


def _full_tensors(config: EngineConfig):
    """-> (Hugging Face tensors of the whole model in config.dtype, tokenizer, ModelConfig)."""
    path = resolve_model_dir(config.model)
    if path is None:  # a preset: the same seeded weights a single-device engine draws, then cut
        full, tokenizer, cfg = load_model(config.model, config.dtype, config.device, config.seed)
        return hf_state_dict(full, on_host=False), tokenizer, cfg
    cfg = check_model_dir(path)
    return load_tensors(path, config.device, DTYPES[config.dtype]), HFTokenizer.from_dir(path, cfg.eos_token_ids), cfg


def build_rank_model(cfg: ModelConfig, group: TPGroup, dtype: torch.dtype, device: str) -> LlamaForCausalLM:
    """An empty (unloaded) tensor-parallel shard of a model of config `cfg` for `group.rank`."""
    rcfg = rank_config(cfg, group.world_size)
    with torch.device("meta"):
        model = LlamaForCausalLM(rcfg)
    model = model.to_empty(device=device).to(dtype)
    model.rotary = Rotary(rcfg, cfg.max_position_embeddings).to(device)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    return make_parallel(model, group)


def load_rank_model(config: EngineConfig, group: TPGroup):
    """-> (this rank's shard in eval mode, tokenizer, the model's full ModelConfig). Refuses a
    model whose KV heads or MLP the group's size does not divide (ConfigError, by name)."""
    tensors, tokenizer, cfg = _full_tensors(config)
    check_shardable(cfg, group.world_size, config.model)
    model = build_rank_model(cfg, group, DTYPES[config.dtype], config.device)
    shards = shard_tensors(tensors, cfg, group.rank, group.world_size)
    del tensors
    model.load_hf_state_dict(shards)
    return model.eval(), tokenizer, cfg


def load_engine_model(config: EngineConfig):
    """-> (model, tokenizer, ModelConfig) an engine serves: the whole model on one rank, else this
    process's rank's shard (it must have joined the worker's group: init_tensor_parallel)."""
    if config.tensor_parallel_size == 1:
        return load_model(config.model, config.dtype, config.device, config.seed)
    return load_rank_model(config, current_group(config.tensor_parallel_size))
