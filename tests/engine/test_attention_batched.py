"""The torch attention path's batched call for short queries (decode and speculative verify
steps) gives what its loop over the sequences gives: mixed query lengths, cached prefixes, GQA,
a sliding window, shuffled blocks."""

from __future__ import annotations

import pytest
import torch

from tandem.engine import attention
from tandem.engine.attention import AttentionMetadata, paged_attention_torch


def _meta(query_lens, seq_lens, block_size, num_blocks, gen):
    tables = []
    free = torch.randperm(num_blocks, generator=gen).tolist()
    for L in seq_lens:
        n = -(-L // block_size)
        tables.append([free.pop() for _ in range(n)])
    width = max(map(len, tables))
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    qsl = torch.tensor([0] + list(torch.cumsum(torch.tensor(query_lens), 0)), dtype=torch.int32)
    return AttentionMetadata(slot_mapping=torch.zeros(sum(query_lens), dtype=torch.int64), query_start_loc=qsl,
                             seq_lens=torch.tensor(seq_lens, dtype=torch.int32), block_tables=table,
                             query_lens_cpu=list(query_lens), seq_lens_cpu=list(seq_lens),
                             max_query_len=max(query_lens), max_seq_len=max(seq_lens))


@pytest.mark.parametrize("query_lens, seq_lens, window", [
    ([1, 1, 1], [5, 40, 17], None),          # decode
    ([3, 1, 6, 2], [9, 33, 6, 50], None),    # verify steps of different k, one plain decode
    ([4, 2, 1], [30, 3, 64], 8),             # a sliding window
    ([17, 5], [17, 70], None),               # a whole short prompt beside a verify step
])
def test_batched_short_queries_match_the_loop(monkeypatch, query_lens, seq_lens, window):
    gen = torch.Generator().manual_seed(0)
    H, Hkv, D, bs, nb = 6, 2, 8, 4, 64
    k_cache = torch.randn(nb, bs, Hkv, D, generator=gen, dtype=torch.float64)
    v_cache = torch.randn(nb, bs, Hkv, D, generator=gen, dtype=torch.float64)
    q = torch.randn(sum(query_lens), H, D, generator=gen, dtype=torch.float64)
    meta = _meta(query_lens, seq_lens, bs, nb, gen)
    batched = paged_attention_torch(q, k_cache, v_cache, meta, 0.3, sliding_window=window)
    monkeypatch.setattr(attention, "BATCHED_MAX_QUERY_LEN", 0)  # every sequence on its own
    looped = paged_attention_torch(q, k_cache, v_cache, meta, 0.3, sliding_window=window)
    torch.testing.assert_close(batched, looped)
