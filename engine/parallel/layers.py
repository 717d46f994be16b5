"""The vocab-parallel embedding and LM head, and `make_parallel`, which turns a decoder built from
a rank's config (engine.parallel.sharding.rank_config) into its tensor-parallel shard.

The decoder itself stays single-device (as gpt-fast applies TP after building the model): a rank's
attention and MLP already compute only their heads and columns, so all `make_parallel` adds is the
sum over ranks after each row-parallel projection (`reduce_output`), and the two vocab layers.
"""

from __future__ import annotations

import torch
from torch import nn
import torch.nn.functional as F

from tandem.engine.parallel.group import TPGroup
from tandem.engine.parallel.sharding import padded_vocab


class VocabParallelEmbedding(nn.Module):
    """Rows [rank * n, (rank + 1) * n) of the (padded) embedding; a lookup zeroes the ids other
    ranks own, then sums over ranks."""

    def __init__(self, num_rows: int, hidden: int, group: TPGroup):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_rows, hidden))
        self.group = group
        self.start = group.rank * num_rows

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start  # [T]
        mine = (local >= 0) & (local < self.weight.shape[0])
        out = F.embedding(torch.where(mine, local, torch.zeros_like(local)), self.weight)  # [T, hidden]
        out = out * mine.unsqueeze(-1).to(out.dtype)
        return self.group.all_reduce(out)


class VocabParallelHead(nn.Module):
    """The LM head over this rank's vocabulary rows; logits are gathered over ranks and cut to
    the model's vocabulary (dropping the padding rows)."""

    def __init__(self, num_rows: int, hidden: int, vocab_size: int, group: TPGroup):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_rows, hidden))
        self.vocab_size = vocab_size
        self.group = group

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = F.linear(hidden, self.weight)  # [N, rows]
        return self.group.all_gather_last(logits)[..., :self.vocab_size]


def make_parallel(model: nn.Module, group: TPGroup) -> nn.Module:
    """In place, on a decoder built from `rank_config` (weights not yet loaded): row-parallel
    outputs summed over ranks, vocab-parallel embedding and head (tied again when the model ties
    them). -> the model, whose `hf_tensors` now names a rank's shards."""
    cfg, world = model.config, group.world_size
    if world == 1:
        return model
    rows = padded_vocab(cfg, world)
    like = model.embed_tokens.weight
    model.embed_tokens = VocabParallelEmbedding(rows, cfg.hidden_size, group).to(like.device, like.dtype)
    model.lm_head = VocabParallelHead(rows, cfg.hidden_size, cfg.vocab_size, group).to(like.device, like.dtype)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    for layer in model.layers:
        layer.self_attn.reduce_output = group.all_reduce
        layer.mlp.reduce_output = group.all_reduce
    model.tp_group = group
    return model
