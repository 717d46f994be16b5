"""Piecewise CUDA graphs (engine.piecewise_graphs) on the GPU: prefill chunks and mixed steps
replayed as captured stretches around an eager attention.

- fp32: greedy generation with them (chunks over cached prefixes, mixed with decodes, speculative
  verification beside them; decode and verify shapes with no graph yet run on them too) gives
  exactly the tokens of the same engine with them off.
- bf16: a mixed step's logits are the eager forward's (rel. error < 2e-2: the padded rows may get
  other GEMM kernels), and the KV cache it leaves is the eager step's.
- warmup captures every bucket; serving then captures none.
"""

from __future__ import annotations

import pytest
import torch

from tandem.engine.config import CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig
from tandem.engine.engine import LLMEngine
from tandem.engine.weights import load_model
from tandem.wire.messages import SamplingParams
from tests.gpu.test_engine_gpu import rel_err

MODEL = "smollm2-135m-random"


def _engine(model, tok, spec=False, piecewise=True):
    cfg = EngineConfig(model="test", device="cuda", cache=CacheConfig(block_size=16, num_blocks=512),
                       scheduler=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=400),
                       speculative=SpeculativeConfig(method="ngram", num_tokens=4, min_n=2, max_n=4)
                       if spec else SpeculativeConfig())
    e = LLMEngine(cfg, model=model, tokenizer=tok)
    if not piecewise:
        e.runner.piecewise = None
    return e


def _requests(vocab):
    gen = torch.Generator().manual_seed(9)
    prefix = torch.randint(3, vocab, (700,), generator=gen).tolist()
    motif = torch.randint(3, vocab, (6,), generator=gen).tolist()
    ps = [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in (40, 300, 17, 129, 64, 500)]
    ps += [motif * 12, prefix]
    # later turns over the cached prefix: 23, 150 and 380 new tokens
    ps += [prefix + torch.randint(3, vocab, (n,), generator=gen).tolist() for n in (23, 150, 380)]
    return [{"prompt_token_ids": p, "max_tokens": 12 + 3 * i, "ignore_eos": True} for i, p in enumerate(ps)]


@pytest.mark.parametrize("spec", [False, True], ids=["plain", "speculative"])
def test_piecewise_greedy_matches_eager_fp32(spec):
    model, tok, _ = load_model(MODEL, "float32", "cuda", seed=7)
    reqs = _requests(model.config.vocab_size)
    arrivals = [0, 0, 1, 2, 2, 5, 6, 6, 30, 31, 40]
    want = [r["token_ids"] for r in _engine(model, tok, spec, piecewise=False).generate(reqs, arrivals)]
    e = _engine(model, tok, spec)
    got = [r["token_ids"] for r in e.generate(reqs, arrivals)]
    stats = e.runner.graph_stats
    assert stats["piecewise_off"] is None, stats
    assert stats["piecewise_buckets"] > 0 and stats["piecewise_replays"] > 0, stats
    assert stats["split_runs"] > 0 and stats["eager_runs"] == 0, stats   # new decode shapes: split, not eager
    assert e.allocator.prefix_hits > 0
    assert got == want


@torch.inference_mode()
def test_bf16_mixed_step_logits_and_cache_match_eager():
    model, tok, _ = load_model(MODEL, "bfloat16", "cuda", seed=7)
    e = _engine(model, tok)
    gen = torch.Generator().manual_seed(5)
    for i in range(3):
        e.add_request(f"d{i}", prompt_token_ids=torch.randint(3, 4000, (60 + 20 * i,), generator=gen).tolist(),
                      sampling=SamplingParams(max_tokens=40, ignore_eos=True))
    for _ in range(3):
        e.step()
    e.settle()
    e.add_request("p", prompt_token_ids=torch.randint(3, 4000, (181,), generator=gen).tolist(),
                  sampling=SamplingParams(max_tokens=4, ignore_eos=True))
    sched = e.scheduler.schedule()
    batch = e.runner.prepare(sched)
    assert batch.graph_key is None and batch.input_ids.shape[0] == 3 + 181
    kv_before = e.kv_cache.tensor.clone()
    eager = e.runner.execute(batch, layer_done=lambda layer: None)   # a per-layer callback: eager
    kv_eager = e.kv_cache.tensor.clone()
    e.kv_cache.tensor.copy_(kv_before)
    replays = e.runner.graph_stats["piecewise_replays"]
    split = e.runner.execute(batch)
    assert e.runner.graph_stats["piecewise_replays"] == replays + 1
    assert split.shape == eager.shape == (3 + 1, model.config.vocab_size)
    assert rel_err(split, eager) < 2e-2
    assert rel_err(e.kv_cache.tensor, kv_eager) < 1e-2
    # the same slots written, the chunk's and the decodes' only: [layers, K/V, blocks, slots]
    changed = (kv_eager != kv_before).flatten(4).any(-1)
    assert torch.equal((e.kv_cache.tensor != kv_before).flatten(4).any(-1), changed)
    assert changed[0, 0].sum().item() == 3 + 181
    for r in list(e.scheduler.requests):
        e.abort(r)


def test_warmup_captures_every_bucket_and_serving_captures_none():
    model, tok, _ = load_model(MODEL, "bfloat16", "cuda", seed=7)
    e = _engine(model, tok)
    pw = e.runner.piecewise
    assert e.runner.capture_piecewise() == len(pw.buckets)
    reqs = _requests(model.config.vocab_size)
    e.generate(reqs, [0, 0, 1, 2, 2, 5, 6, 6, 30, 31, 40])
    stats = e.runner.graph_stats
    assert stats["piecewise_buckets"] == len(pw.buckets) and pw.captures == len(pw.buckets), stats
    assert stats["piecewise_replays"] > 0
