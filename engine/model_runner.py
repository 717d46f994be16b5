"""Runs one scheduled batch through the model: builds the flattened inputs and attention metadata
from the scheduler's decision, runs the forward pass, and returns logits for the positions that
need them (the last position of every sequence that samples; 1 + k positions when verifying k
drafts). Owns the model and its KV cache on one device."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.attention import AttentionMetadata
from engine.kv_cache import KVCache
from engine.scheduler import SchedulerOutput


@dataclass
class BatchInputs:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    meta: AttentionMetadata
    logits_index: torch.Tensor  # [N] rows of the hidden states that need logits
    logits_owner: list[tuple[str, int]]  # (request id, number of rows) in order


class ModelRunner:
    def __init__(self, model, kv_cache: KVCache, device: torch.device | str):
        self.model = model
        self.kv_cache = kv_cache
        self.device = torch.device(device)
        self.block_size = kv_cache.block_size

    def prepare(self, out: SchedulerOutput, drafts: dict[str, list[int]] | None = None) -> BatchInputs:
        drafts = drafts or {}
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        qlens: list[int] = []
        slens: list[int] = []
        tables: list[list[int]] = []
        logits_index: list[int] = []
        owners: list[tuple[str, int]] = []
        bs = self.block_size
        for s in out.scheduled:
            r = s.request
            start, n = r.num_computed_tokens, s.num_new_tokens
            known = r.num_tokens
            d = drafts.get(r.request_id, [])[: s.num_draft_tokens]
            tokens = r.all_token_ids
            for p in range(start, start + n):
                ids.append(tokens[p] if p < known else d[p - known])
                pos.append(p)
                slots.append(r.block_ids[p // bs] * bs + p % bs)
            qlens.append(n)
            slens.append(start + n)
            tables.append(r.block_ids)
            if s.samples:
                rows = 1 + s.num_draft_tokens
                base = len(ids) - rows
                logits_index.extend(range(base, base + rows))
                owners.append((r.request_id, rows))
        width = max(len(t) for t in tables)
        table = torch.zeros(len(tables), width, dtype=torch.int32)
        for i, t in enumerate(tables):
            table[i, : len(t)] = torch.tensor(t, dtype=torch.int32)
        qsl = torch.zeros(len(qlens) + 1, dtype=torch.int32)
        qsl[1:] = torch.tensor(qlens, dtype=torch.int32).cumsum(0)
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64).to(dev, non_blocking=True),
            query_start_loc=qsl.to(dev, non_blocking=True),
            seq_lens=torch.tensor(slens, dtype=torch.int32).to(dev, non_blocking=True),
            block_tables=table.to(dev, non_blocking=True),
            query_lens_cpu=qlens, seq_lens_cpu=slens,
            max_query_len=max(qlens), max_seq_len=max(slens))
        return BatchInputs(
            input_ids=torch.tensor(ids, dtype=torch.int64).to(dev, non_blocking=True),
            positions=torch.tensor(pos, dtype=torch.int64).to(dev, non_blocking=True),
            meta=meta,
            logits_index=torch.tensor(logits_index, dtype=torch.int64).to(dev, non_blocking=True),
            logits_owner=owners)

    @torch.inference_mode()
    def execute(self, batch: BatchInputs, layer_done=None) -> torch.Tensor:
        """-> logits [N, vocab] (float32) for `batch.logits_index` rows (N may be 0)."""
        hidden = self.model(batch.input_ids, batch.positions, self.kv_cache.tensor, batch.meta, layer_done)
        if not batch.logits_owner:
            return hidden.new_empty((0, self.model.config.vocab_size), dtype=torch.float32)
        return self.model.compute_logits(hidden.index_select(0, batch.logits_index))
