"""Tree-draft verification on the GPU: the Triton kernels' tree mask at Llama-3-8B head sizes in
bf16 (decode kernel, split-K, prefill kernel for trees past 16 rows) against a float64 per-row
reference, and the engine with CUDA graphs verifying trees whose accepted paths leave the first
branch: greedy tokens equal the CPU path's plain decoding, and tree-verify graphs are captured."""

from __future__ import annotations

import copy

import pytest
import torch

from tandem.engine.config import CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig
from tandem.engine.engine import LLMEngine
from tandem.engine.weights import load_model
from tests.engine.test_tree_attention import reference, rel_err, tree_batch
from tests.engine.test_tree_spec import OffBranchOracle

if torch.cuda.is_available():  # elsewhere conftest.py skips these, and triton stays unimported
    from tandem.engine.kernels.paged_attention import paged_attention, paged_decode_attention


def heap(n: int) -> list[int]:
    """n nodes, node i's parent (i - 1) // 2: a binary tree under one child of the root."""
    return [-1] + [(i - 1) // 2 for i in range(1, n)]


@pytest.mark.parametrize("trees,ctx,chain_lens,partition", [
    ([heap(7)] * 4 + [None] * 4, [100, 700, 1500, 2000, 50, 900, 1300, 30], [None] * 4 + [1, 1, 5, 1], "auto"),
    ([heap(15), heap(15)], [2000, 1100], None, 256),   # split-K over long contexts
    ([heap(63), heap(31), None], [1024, 517, 800], [None, None, 40], "auto"),  # prefill kernel
])
def test_tree_kernels_bf16_match_reference(trees, ctx, chain_lens, partition):
    q, k, v, meta = tree_batch(torch.Generator().manual_seed(5), trees, ctx, heads=32, kv_heads=8,
                               head_dim=128, block_size=16, dtype=torch.bfloat16, device="cuda",
                               chain_lens=chain_lens)
    scale = 128 ** -0.5
    ref = reference(q.float(), k.float(), v.float(), meta, scale)
    if meta.max_query_len <= 16:
        out = paged_decode_attention(q, k, v, meta, scale, partition_size=partition)
    else:
        out = paged_attention(q, k, v, meta, scale)
    assert rel_err(out, ref) < 1e-2


def test_tree_verify_with_graphs_matches_cpu_plain_decoding():
    model, tok, _ = load_model("smollm2-135m-random", "float32", "cpu", seed=7)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, model.config.vocab_size, (n,), generator=gen).tolist() for n in (5, 40, 300, 17)]
    reqs = [{"prompt_token_ids": p, "max_tokens": 24, "ignore_eos": True, "request_id": f"r{i}"}
            for i, p in enumerate(prompts)]

    def engine(m, device, proposer=None):
        cfg = EngineConfig(model="test", device=device, cache=CacheConfig(block_size=16, num_blocks=256),
                           scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=512),
                           speculative=SpeculativeConfig(method="suffix" if proposer else "off", num_tokens=4,
                                                         max_verify_tokens=4096))
        return LLMEngine(cfg, model=m, tokenizer=tok, proposer=proposer)

    plain = engine(model, "cpu").generate([dict(r) for r in reqs])
    oracle = OffBranchOracle({r["request_id"]: r["token_ids"] for r in plain}, model.config.vocab_size)
    e = engine(copy.deepcopy(model).to("cuda"), "cuda", oracle)
    out = e.generate([dict(r) for r in reqs])
    assert [r["token_ids"] for r in out] == [r["token_ids"] for r in plain]
    assert any(key.tree for key in e.runner.graphs.graphs), "no tree-verify step was captured"
    assert e.runner.graph_stats["failed"] is None
    assert e.stats.accepted_draft_tokens > e.stats.draft_tokens / 3
