"""Piecewise graphs (engine.piecewise_graphs) on the CPU: the split forward, run eagerly through
the Triton kernels under the interpreter (`capture=False`) on the padded static inputs, gives the
unsplit forward's logits and KV cache for prefill chunks over a cached prefix and for steps mixing
them with decodes; the engine's greedy tokens are unchanged; models whose stretches cannot be
captured (a mixture of experts, latent attention, tensor-parallel layers) are left eager, by name.
The capture and replay themselves run on the GPU (tests/gpu/test_piecewise_gpu.py)."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from tandem.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from tandem.engine.engine import LLMEngine
from tandem.engine.piecewise_graphs import TOKEN_BUCKETS, PiecewiseGraphs, unsupported
from tandem.wire.messages import SamplingParams

pytest.importorskip("triton")


def _engine(model, tok, piecewise: bool, max_graph_tokens: int = 64, budget: int = 48):
    from tandem.engine.model import TritonOps
    from tandem.engine.model_runner import ModelRunner

    model = copy.deepcopy(model)
    model.ops = TritonOps()
    cfg = EngineConfig(model="test", cache=CacheConfig(block_size=8, num_blocks=96),
                       scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget))
    e = LLMEngine(cfg, model=model, tokenizer=tok)
    e.runner = ModelRunner(model, e.kv_cache, "cpu", cuda_graphs=True, capture=False,
                           graph_batch_sizes=(1, 2, 4, 8), max_graph_tokens=max_graph_tokens, piecewise=piecewise)
    return e


def _requests(vocab: int):
    gen = torch.Generator().manual_seed(5)
    prefix = torch.randint(3, vocab, (40,), generator=gen).tolist()
    ps = [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in (23, 61, 9, 30)]
    # a later turn: the first prompt's prefix cached, 27 new tokens computed over it
    ps += [prefix, prefix + torch.randint(3, vocab, (27,), generator=gen).tolist()]
    return [{"prompt_token_ids": p, "max_tokens": 5 + i, "ignore_eos": True} for i, p in enumerate(ps)]


def test_split_forward_matches_the_plain_forward_in_tokens(tiny):
    model, tok, _ = tiny
    reqs = _requests(model.config.vocab_size)
    arrivals = [0, 0, 1, 2, 3, 9]
    ref = [r["token_ids"] for r in _engine(model, tok, piecewise=False).generate(copy.deepcopy(reqs), arrivals)]
    e = _engine(model, tok, piecewise=True)
    got = [r["token_ids"] for r in e.generate(copy.deepcopy(reqs), arrivals)]
    assert got == ref
    stats = e.runner.graph_stats
    assert stats["piecewise_replays"] > 0, "no prefill step went through the split forward"
    assert stats["piecewise_off"] is None
    assert e.allocator.prefix_hits > 0, "the last request was meant to prefill over a cached prefix"


def _batch_logits_and_cache(model, tok, piecewise: bool):
    """One mixed step (two sequences decoding, a 27-token chunk over a cached 40-token prefix):
    its logits and the KV cache after it."""
    e = _engine(model, tok, piecewise=piecewise)
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(11)
    prefix = torch.randint(3, vocab, (40,), generator=gen).tolist()
    e.generate([{"prompt_token_ids": prefix, "max_tokens": 2}])   # cache the prefix (2: one decode step)
    for n in (12, 20):
        e.add_request(prompt_token_ids=torch.randint(3, vocab, (n,), generator=gen).tolist(),
                      sampling=SamplingParams(max_tokens=50, ignore_eos=True))
    e.step()                                                         # both prefill (32 tokens)
    e.add_request(prompt_token_ids=prefix + torch.randint(3, vocab, (27,), generator=gen).tolist(),
                  sampling=SamplingParams(max_tokens=2, ignore_eos=True))
    seen = {}
    execute = e.runner.execute

    def spy(batch, layer_done=None):
        out = execute(batch, layer_done)
        if batch.graph_key is None and batch.input_ids.shape[0] > 16:
            seen["logits"] = out.clone()
            seen["tokens"] = batch.input_ids.shape[0]
        return out

    e.runner.execute = spy
    e.step()
    return seen, e.kv_cache.tensor.clone(), e


def test_a_mixed_step_gives_the_plain_forward_logits_and_writes_only_its_own_kv(tiny):
    model, tok, _ = tiny
    plain, plain_kv, _ = _batch_logits_and_cache(model, tok, piecewise=False)
    split, split_kv, e = _batch_logits_and_cache(model, tok, piecewise=True)
    assert split["tokens"] == plain["tokens"] == 2 + 27, "the step was meant to carry 2 decodes and the chunk"
    assert e.runner.graph_stats["piecewise_replays"] > 0
    torch.testing.assert_close(split["logits"], plain["logits"], rtol=1e-4, atol=1e-4)
    # the padded rows (29 -> bucket 32) wrote no slot: the caches are equal everywhere
    torch.testing.assert_close(split_kv, plain_kv, rtol=1e-5, atol=1e-5)


def test_buckets_pad_by_at_most_half(tiny):
    model, _, _ = tiny
    pw = PiecewiseGraphs(model, torch.zeros(1), torch.device("cpu"), capture=False, max_tokens=512)
    assert pw.why_not is None
    assert pw.buckets == TOKEN_BUCKETS
    for n in range(1, 513):
        b = pw.bucket(n)
        assert b >= n and b <= max(32, 1.5 * n) and (n <= 128 or b <= 1.25 * n), (n, b)
    assert pw.bucket(513) is None
    small = PiecewiseGraphs(model, torch.zeros(1), torch.device("cpu"), capture=False, max_tokens=100)
    assert small.buckets[-1] == 96 and small.bucket(97) is None


def test_models_whose_stretches_depend_on_the_step_stay_eager(tiny):
    from tandem.engine.moe import no_reduce

    model, _, _ = tiny
    assert unsupported(model) is None
    tp = copy.deepcopy(model)
    tp.layers[-1].self_attn.reduce_output = lambda x: x     # what a tensor-parallel shard installs
    assert "tensor-parallel" in unsupported(tp)
    moe = copy.deepcopy(model)
    moe.layers[0].mlp = torch.nn.Identity()
    assert "mixture of experts" in unsupported(moe)
    assert tp.layers[-1].mlp.reduce_output is no_reduce
    pw = PiecewiseGraphs(tp, torch.zeros(1), torch.device("cpu"), capture=False)
    assert pw.bucket(40) is None and "tensor-parallel" in pw.stats["piecewise_off"]


def test_a_step_with_no_bucket_is_refused(tiny):
    model, _, _ = tiny
    pw = PiecewiseGraphs(model, torch.zeros(1), torch.device("cpu"), capture=False, max_tokens=64)
    with pytest.raises(ValueError, match="no piecewise bucket"):
        pw.run(torch.zeros(65, dtype=torch.int32), torch.zeros(65, dtype=torch.int32), None)
    assert np.isfinite(pw.max_tokens)


def test_the_environment_switch_turns_it_off_for_new_runners(tiny, monkeypatch):
    model, tok, _ = tiny
    monkeypatch.setenv("TANDEM_PIECEWISE_GRAPHS", "0")
    e = _engine(model, tok, piecewise=None)
    assert e.runner.piecewise is None
    e.generate(_requests(model.config.vocab_size)[:2])
    assert "piecewise_replays" not in e.runner.graph_stats
    monkeypatch.setenv("TANDEM_PIECEWISE_GRAPHS", "1")
    assert _engine(model, tok, piecewise=None).runner.piecewise is not None


def test_fp8_models_stay_eager_until_checked_on_the_gpu():
    from tandem.engine.weights import load_model

    fp8, _, _ = load_model("tiny-random", seed=1234, quantization="fp8")
    assert "FP8" in unsupported(fp8)
