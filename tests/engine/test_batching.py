"""Continuous batching, chunked prefill, preemption and prefix caching must never change a
request's tokens: each request gets exactly what it gets when run alone."""

from __future__ import annotations

import pytest

PROMPTS = [
    "def add(a, b):",
    "Once upon a time, in a land far away, there lived a dragon who loved",
    "SELECT name, email FROM users WHERE",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):",
    "The mitochondria is",
    "import os\nimport sys\n\ndef main():\n    args = sys.argv[1:]\n    for a in args:\n        print(",
    "Q: What is 17 * 3?\nA:",
    "# A function that reverses a linked list in C\nstruct Node {",
    "Dear team, following up on yesterday's meeting about the migration plan, I wanted to",
]


@pytest.fixture(scope="module")
def solo_outputs(smollm2):
    """Each prompt alone, greedy."""
    from tandem.engine.config import CacheConfig, EngineConfig
    from tandem.engine.engine import LLMEngine

    model, tok = smollm2
    outs = []
    for i, p in enumerate(PROMPTS):
        e = LLMEngine(EngineConfig(cache=CacheConfig(num_blocks=256)), model=model, tokenizer=tok)
        outs.append(e.generate([{"prompt": p, "max_tokens": 12 + 3 * i}])[0]["token_ids"])
    return outs


def _requests():
    return [{"prompt": p, "max_tokens": 12 + 3 * i} for i, p in enumerate(PROMPTS)]


def test_staggered_arrivals_match_solo(smollm2, make_engine, solo_outputs):
    model, tok = smollm2
    # a small token budget forces chunked prefill of the longer prompts alongside running decodes
    e = make_engine(model, tok, max_num_batched_tokens=24)
    arrivals = [0, 0, 1, 3, 4, 7, 9, 12, 15]
    results = e.generate(_requests(), arrivals=arrivals)
    assert [r["token_ids"] for r in results] == solo_outputs
    assert e.stats.steps > 0


def test_preemption_under_small_kv_budget_matches_solo(smollm2, make_engine, solo_outputs):
    model, tok = smollm2
    # 12 blocks of 8 tokens: 96 positions for 9 requests that together need several hundred
    e = make_engine(model, tok, num_blocks=12, block_size=8, max_num_batched_tokens=64)
    results = e.generate(_requests(), arrivals=[0, 0, 0, 1, 1, 2, 2, 3, 3])
    assert e.stats.preemptions > 0, "the KV budget was meant to force preemption"
    assert [r["token_ids"] for r in results] == solo_outputs


def test_shared_prefix_computes_only_new_tokens(smollm2, make_engine):
    model, tok = smollm2
    e = make_engine(model, tok)
    prefix = ("You are a careful senior engineer reviewing code. " * 12).strip()
    first = e.generate([{"prompt": prefix + " Review: x = 1", "max_tokens": 8, "request_id": "a"}])[0]
    second = e.generate([{"prompt": prefix + " Review: y = 2", "max_tokens": 8, "request_id": "b"}])[0]
    n_prompt = len(second["prompt_token_ids"])
    shared = next(i for i, (x, y) in enumerate(zip(first["prompt_token_ids"], second["prompt_token_ids"])) if x != y)
    cached = second["usage"]["cached_prompt_tokens"]
    bs = e.allocator.block_size
    assert cached == (shared // bs) * bs and cached >= 64
    # prompt positions computed for b = prompt - cached, plus one per decode step after the first token
    assert e.stats.per_request_computed["b"] == n_prompt - cached + len(second["token_ids"]) - 1
    # the prompt counters the controller reads the demand from: positions computed (not cached),
    # prompts completed and their lengths
    n_first = len(first["prompt_token_ids"])
    assert e.stats.prompt_tokens_computed == n_first + n_prompt - cached
    assert e.stats.prompts_completed == 2 and e.stats.prompt_tokens_completed == n_first + n_prompt
    fresh = make_engine(model, tok, prefix_caching=False)
    alone = fresh.generate([{"prompt": prefix + " Review: y = 2", "max_tokens": 8}])[0]
    assert alone["token_ids"] == second["token_ids"]
    assert fresh.stats.per_request_computed["gen-0"] == n_prompt + len(alone["token_ids"]) - 1


def test_eviction_under_pressure_keeps_outputs_correct(smollm2, make_engine, solo_outputs):
    model, tok = smollm2
    # 10 blocks of 8 tokens: each request evicts the cached blocks of the ones before it, while a
    # repeat straight after a request still finds its blocks
    e = make_engine(model, tok, num_blocks=10, block_size=8)
    for i in (1, 3, 5, 7):
        for rep in range(2):
            res = e.generate([{"prompt": PROMPTS[i], "max_tokens": 12 + 3 * i, "request_id": f"r{i}-{rep}"}])[0]
            assert res["token_ids"] == solo_outputs[i]
        assert res["usage"]["cached_prompt_tokens"] > 0, "the repeat should hit its own cached prefix"
    assert e.allocator.evictions > 0, "the cache was meant to be too small to keep everything"
