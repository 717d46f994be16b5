"""engine/kernels/l2_prefetch.py on the GPU: every mode compiles and runs (a hint: the bytes it
covers are unchanged), and a sequence decoding through CUDA graphs with the prefetch forked and
joined in every layer gives the CPU path's greedy tokens (fp32), with the prefetch really issued."""

from __future__ import annotations

import copy

import pytest
import torch

from tandem.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from tandem.engine.engine import LLMEngine
from tandem.engine.weights import load_model


@pytest.mark.parametrize("mode", ["line", "last", "bulk"])
def test_every_mode_runs_and_changes_nothing(mode):
    from tandem.engine.kernels import l2_prefetch

    w = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    before = w.clone()
    l2_prefetch.prefetch(w, w.numel() * w.element_size(), mode)
    l2_prefetch.prefetch(w[:7].contiguous(), 10**9, mode)  # fewer bytes than a chunk, and an over-ask
    torch.cuda.synchronize()
    assert torch.equal(w, before)


@pytest.mark.parametrize("mode", ["last", "bulk"])
def test_decoding_through_graphs_with_the_prefetch_matches_cpu(monkeypatch, mode):
    from tandem.engine.kernels import l2_prefetch

    model, tok, _ = load_model("smollm2-135m-random", "float32", "cpu", seed=7)
    prompt = torch.randint(3, model.config.vocab_size, (37,), generator=torch.Generator().manual_seed(1)).tolist()
    req = [{"prompt_token_ids": prompt, "max_tokens": 24, "ignore_eos": True}]

    def generate(device):
        cfg = EngineConfig(model="test", device=device, cache=CacheConfig(block_size=16, num_blocks=64),
                           scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64))
        e = LLMEngine(cfg, model=copy.deepcopy(model).to(device), tokenizer=tok)
        return e.generate(req)[0]["token_ids"], e

    ref, _ = generate("cpu")
    calls = []
    real = l2_prefetch.prefetch
    monkeypatch.setattr(l2_prefetch, "prefetch", lambda *a, **kw: calls.append(a[1]) or real(*a, **kw))
    monkeypatch.setattr(l2_prefetch, "MODE", mode)
    tokens, e = generate("cuda")
    assert calls and all(n > 0 for n in calls), "no one-token step forked a prefetch"
    assert e.runner.graph_stats["replays"] > 0
    assert tokens == ref
