"""Which slice of each Hugging Face tensor a rank holds, and loading a rank's shard of a model.

Megatron's split, in Hugging Face names (so quantization, which acts on the loaded tensors, sees
a rank's shard as an ordinary smaller checkpoint): q/k/v and gate/up are column-parallel (rows of
the weight, by head and by intermediate column), o_proj and down_proj row-parallel (columns of the
weight; their outputs are summed over ranks), the embedding and the LM head vocab-parallel (rows,
the vocabulary padded to a multiple of the ranks with zero rows). Norms are replicated, Qwen3's
q/k norms too (one weight shared by every head). Each rank's KV cache holds its own KV heads.
"""

from __future__ import annotations

import dataclasses

import torch

from tandem.engine.config import ModelConfig
from tandem.wire.errors import ConfigError

# Hugging Face name suffix -> (dimension split, what one rank's part counts: heads, kv heads, ...)
_RULES: dict[str, tuple[int, str]] = {
    "self_attn.q_proj.weight": (0, "q"), "self_attn.q_proj.bias": (0, "q"),
    "self_attn.k_proj.weight": (0, "kv"), "self_attn.k_proj.bias": (0, "kv"),
    "self_attn.v_proj.weight": (0, "kv"), "self_attn.v_proj.bias": (0, "kv"),
    "self_attn.o_proj.weight": (1, "q"),
    "mlp.gate_proj.weight": (0, "mlp"), "mlp.up_proj.weight": (0, "mlp"),
    "mlp.down_proj.weight": (1, "mlp"),
    "model.embed_tokens.weight": (0, "vocab"), "lm_head.weight": (0, "vocab"),
}


def check_shardable(cfg: ModelConfig, world: int, model: str) -> None:
    """Refuse, by name, a split this engine does not implement: every rank must hold whole KV
    heads (no KV-head replication when there are more ranks than KV heads) and an equal part of
    the MLP."""
    if world < 1:
        raise ConfigError(f"engine: tensor_parallel_size must be >= 1, got {world}")
    if world > 1 and cfg.moe is not None:
        raise ConfigError(f"engine: tensor_parallel_size {world} with the mixture-of-experts model {model!r} is "
                          "not implemented (neither expert nor tensor parallelism of the experts)")
    if world > 1 and cfg.mla is not None:
        raise ConfigError(f"engine: tensor_parallel_size {world} with the latent-attention model {model!r} is "
                          "not implemented (the latent cache is not split over heads)")
    if cfg.num_kv_heads % world:
        raise ConfigError(f"engine: tensor_parallel_size {world} does not divide the {cfg.num_kv_heads} "
                          f"KV heads of model {model!r} (each rank holds whole KV heads; replicating "
                          f"them over ranks is not implemented)")
    if cfg.intermediate_size % world:
        raise ConfigError(f"engine: tensor_parallel_size {world} does not divide intermediate_size "
                          f"{cfg.intermediate_size} of model {model!r}")


def padded_vocab(cfg: ModelConfig, world: int) -> int:
    """Vocabulary rows per rank: the vocabulary padded up to a multiple of `world`, over `world`."""
    return -(-cfg.vocab_size // world)


def rank_config(cfg: ModelConfig, world: int) -> ModelConfig:
    """The per-rank shapes the decoder is built with: 1/world of the heads, KV heads and MLP
    columns. vocab_size stays the model's (the vocab-parallel layers split it themselves)."""
    return dataclasses.replace(cfg, num_heads=cfg.num_heads // world, num_kv_heads=cfg.num_kv_heads // world,
                               intermediate_size=cfg.intermediate_size // world)


def _rule(name: str) -> tuple[int, str] | None:
    for suffix, rule in _RULES.items():
        if name.endswith(suffix):
            return rule
    return None


def shard_tensor(name: str, t: torch.Tensor, cfg: ModelConfig, rank: int, world: int) -> torch.Tensor:
    """Rank `rank`'s part of the full tensor `name` (a copy, so the full tensor can be freed)."""
    rule = _rule(name)
    if rule is None or world == 1:
        return t
    dim, unit = rule
    per = {"q": cfg.num_heads // world * cfg.head_dim, "kv": cfg.num_kv_heads // world * cfg.head_dim,
           "mlp": cfg.intermediate_size // world, "vocab": padded_vocab(cfg, world)}[unit]
    part = t.narrow(dim, min(rank * per, t.shape[dim]), max(0, min(per, t.shape[dim] - rank * per)))
    if part.shape[dim] < per:  # the vocabulary's padding rows
        pad = list(part.shape)
        pad[dim] = per - part.shape[dim]
        part = torch.cat([part, part.new_zeros(pad)], dim)
    return part.clone()


def shard_tensors(tensors: dict[str, torch.Tensor], cfg: ModelConfig, rank: int, world: int) -> dict[str, torch.Tensor]:
    """Every tensor of a full Hugging Face state dict, cut to rank `rank`'s part."""
    return {name: shard_tensor(name, t, cfg, rank, world) for name, t in tensors.items()}
