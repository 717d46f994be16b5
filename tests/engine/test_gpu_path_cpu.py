"""The GPU path's host-side logic on the CPU: which steps a CUDA graph serves and how they are
padded (pure functions), and the padded static-buffer step itself, run eagerly through the Triton
kernels under the interpreter (`capture=False`): greedy tokens must equal the plain CPU path's
for staggered arrivals, chunked prefill and speculative verification (1 + k query tokens)."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from tandem.engine.config import CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig
from tandem.engine.cuda_graphs import (GraphKey, StaticInputs, capture_query_lens, graph_key, round_up,
                                token_buckets)
from tandem.engine.engine import LLMEngine

SIZES = (1, 2, 4, 8, 16, 24, 32)
TOKENS = token_buckets(SIZES, 128)


def key(query_lens, max_seq_len, splits=lambda b, c: False, max_context=4096):
    return graph_key(query_lens, max_seq_len, batch_sizes=SIZES, token_sizes=TOKENS,
                     max_context=max_context, splits=splits)


def test_token_buckets_extend_the_batch_sizes():
    assert TOKENS == (1, 2, 4, 8, 16, 24, 32, 64, 96, 128)
    assert round_up(17, SIZES) == 24 and round_up(33, SIZES) is None


def test_decode_pads_batch_and_tokens_together():
    assert key([1] * 3, 100) == GraphKey(4, 4, 1, 0)
    assert key([1] * 17, 3000) == GraphKey(24, 24, 1, 0)
    assert key([1] * 33, 10) is None  # larger than the largest batch size: eager


def test_verify_steps_pad_tokens_to_a_bucket_and_query_len_to_a_power_of_two():
    # 3 sequences verifying 1 + k = 5, 2, 1 tokens: 8 tokens, longest query 5 -> tile of 8
    assert key([5, 2, 1], 700) == GraphKey(4, 8, 8, 0)
    # token bucket capped at batch * query_len
    assert key([2, 2], 50) == GraphKey(2, 4, 2, 0)
    assert key([17], 100) is None  # past the decode kernel's query length: prefill kernel, eager
    assert key([16] * 16, 100) is None  # 256 tokens > the largest token bucket


def test_context_is_part_of_the_key_only_when_the_kernel_splits():
    splits = lambda b, c: b * 8 < 264 and c > 256  # noqa: E731 - 8 KV heads, 132 SMs
    assert key([1], 1025, splits) == GraphKey(1, 1, 1, 2048)
    assert key([1], 100, splits) == GraphKey(1, 1, 1, 0)
    assert key([1] * 32, 8000, splits, max_context=8192) == GraphKey(32, 32, 1, 8192)
    assert key([1], 5000, splits, max_context=4096) is None
    big = graph_key([1] * 40, 8000, batch_sizes=SIZES + (48,), token_sizes=TOKENS, max_context=8192,
                    splits=splits)
    assert big == GraphKey(48, 48, 1, 0)


def test_capture_query_lens_match_the_key():
    for k in (GraphKey(4, 8, 8, 0), GraphKey(8, 8, 1, 0), GraphKey(24, 64, 4, 0), GraphKey(2, 3, 2, 0)):
        lens = capture_query_lens(k)
        assert len(lens) == k.batch and sum(lens) == k.tokens and max(lens) == k.query_len


def test_static_pack_pads_with_no_op_rows():
    s = StaticInputs(max_batch=8, max_tokens=16, max_blocks=4, device=torch.device("cpu"))
    table = np.array([[3, 4], [5, 0]], dtype=np.int32)
    host = s.pack(ids=[7, 8, 9], positions=[20, 21, 5], slots=[52, 53, 80], logits_rows=[1, 2],
                  query_start_loc=[0, 2, 3], seq_lens=[22, 6], table=table)
    s.upload(host, 2, 2)
    assert s.input_ids[:4].tolist() == [7, 8, 9, 0]
    assert s.slots[:5].tolist() == [52, 53, 80, -1, -1]  # padded tokens write nothing
    assert s.query_start_loc[:5].tolist() == [0, 2, 3, 3, 3]  # padded sequences own no tokens
    assert s.seq_lens[:4].tolist() == [22, 6, 0, 0]  # ... and read nothing
    assert s.logits_rows[:3].tolist() == [1, 2, 0]
    assert s.block_tables[:2, :2].tolist() == table.tolist()


# ---- the padded static-buffer step through the Triton kernels (interpreter) ---------------------
PROMPTS = [list(range(5, 40)), [9, 8, 7, 6, 5, 4, 3] * 3, list(range(100, 117)), [11, 12, 13, 11, 12, 13, 11, 12]]


def _engine(model, tok, spec=False, graphs=False):
    from tandem.engine.model import TritonOps
    from tandem.engine.model_runner import ModelRunner

    cfg = EngineConfig(model="test", cache=CacheConfig(block_size=8, num_blocks=64),
                       scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=24),
                       speculative=SpeculativeConfig(method="ngram", num_tokens=3, min_n=2, max_n=3)
                       if spec else SpeculativeConfig())
    if graphs:
        model = copy.deepcopy(model)
        model.ops = TritonOps()
    e = LLMEngine(cfg, model=model, tokenizer=tok)
    if graphs:
        e.runner = ModelRunner(model, e.kv_cache, "cpu", cuda_graphs=True, capture=False,
                               graph_batch_sizes=(1, 2, 4, 8), max_graph_tokens=32)
    return e


def _generate(e):
    reqs = [{"prompt_token_ids": p, "max_tokens": 6 + i, "ignore_eos": True} for i, p in enumerate(PROMPTS)]
    return [r["token_ids"] for r in e.generate(reqs, arrivals=[0, 0, 2, 3])]


@pytest.mark.parametrize("spec,overlap", [(False, False), (True, False), (False, True)],
                         ids=["decode", "speculative", "overlapped"])
def test_static_buffer_steps_match_the_cpu_path(tiny, spec, overlap):
    """overlapped: each step's input ids come from the previous step's tokens on the device
    (engine.inflight.feed_pending), written into the graphs' static buffers."""
    pytest.importorskip("triton")
    model, tok, _ = tiny
    ref = _generate(_engine(model, tok))
    e = _engine(model, tok, spec=spec, graphs=True)
    e.overlap = overlap
    assert _generate(e) == ref
    stats = e.runner.graph_stats
    assert stats["replays"] > 0, "no step went through the static buffers"
    if spec:
        assert e.stats.draft_tokens > 0, "the prompts were meant to give n-gram drafts"
