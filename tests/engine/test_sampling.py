"""Sampling: seeded reproducibility, and top-k / top-p never emit excluded tokens."""

from __future__ import annotations

import torch

from tandem.engine.sampler import Sampler, filter_logits
from tandem.wire.messages import SamplingParams


def test_seeded_sampling_is_reproducible_and_independent_of_batch(smollm2, make_engine):
    model, tok = smollm2
    req = {"prompt": "My favourite animal is", "max_tokens": 16, "temperature": 1.0, "seed": 7}
    a = make_engine(model, tok).generate([req])[0]["token_ids"]
    others = [{"prompt": f"Noise prompt {i}", "max_tokens": 10, "temperature": 0.9, "seed": i} for i in range(3)]
    b = make_engine(model, tok).generate(others + [req])[-1]["token_ids"]
    c = make_engine(model, tok).generate([{**req, "seed": 8}])[0]["token_ids"]
    assert a == b
    assert a != c


def test_top_k_never_emits_excluded_tokens():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 1000, generator=g)
    sampler = Sampler()
    allowed = torch.topk(logits, 5, dim=-1).indices
    for trial in range(20):
        params = [(f"r{i}-{trial}", SamplingParams(temperature=1.5, top_k=5, seed=i + 100 * trial)) for i in range(64)]
        toks = sampler.sample(logits, params)
        for i, t in enumerate(toks):
            assert t in allowed[i].tolist()


def test_top_p_never_emits_excluded_tokens():
    # probabilities 0.5, 0.3, 0.15, 0.05: top_p=0.8 keeps exactly the first two
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).repeat(500, 1)
    kept = filter_logits(logits[0], 1.0, 0, 0.8)
    assert torch.isfinite(kept).tolist() == [True, True, False, False]
    sampler = Sampler()
    toks = sampler.sample(logits, [(f"r{i}", SamplingParams(temperature=1.0, top_p=0.8, seed=i)) for i in range(500)])
    assert set(toks) == {0, 1}


def test_top_p_and_top_k_through_engine(smollm2, make_engine):
    model, tok = smollm2
    e = make_engine(model, tok)
    res = e.generate([{"prompt": "Numbers: 1, 2, 3,", "max_tokens": 6, "temperature": 1.0, "top_k": 1, "seed": s}
                      for s in range(3)])
    greedy = make_engine(model, tok).generate([{"prompt": "Numbers: 1, 2, 3,", "max_tokens": 6}])[0]
    # top_k=1 is greedy whatever the seed
    assert all(r["token_ids"] == greedy["token_ids"] for r in res)


def test_stop_strings_truncate_text(smollm2, make_engine):
    model, tok = smollm2
    e = make_engine(model, tok)
    full = e.generate([{"prompt": "def add(a, b):", "max_tokens": 20}])[0]
    stop = full["text"][5:8]
    res = e.generate([{"prompt": "def add(a, b):", "max_tokens": 20, "stop": [stop]}])[0]
    assert res["finish_reason"] == "stop"
    assert res["text"] == full["text"][: full["text"].index(stop)]
