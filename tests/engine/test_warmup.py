"""Engine warmup (run by actors before serving on CUDA): it must drive every path serving takes
(batched decode, speculative verify steps, chunked prefill, prefill over a cached prefix), so the
kernels and graphs those paths need exist before the first request, and it must leave nothing
behind that a request could see."""

from __future__ import annotations

import dataclasses

import pytest

from tandem.cluster.config import load_config
from tandem.engine.config import CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig
from tandem.wire.errors import ConfigError
from tandem.engine.engine import LLMEngine
from tandem.engine.stats import EngineStats


def _config() -> EngineConfig:
    # 512 blocks (8,192 tokens) hold every warmup shape here; the default sizes the cache from
    # memory (2 GiB on CPU), which only took ~1.4 s to zero per engine
    return EngineConfig(model="tiny-random", speculative=SpeculativeConfig(method="ngram", num_tokens=3),
                        scheduler=SchedulerConfig(max_num_batched_tokens=256), cache=CacheConfig(num_blocks=512))


def test_warmup_drives_every_serving_path():
    e = LLMEngine(_config())
    seen = {"max_batch": 0, "drafts": 0, "chunk_after_chunk": 0, "cached_prefix": 0}
    prepare = e.runner.prepare

    def spy(sched, drafts=None, trees=None):
        seen["max_batch"] = max(seen["max_batch"], len(sched.scheduled))
        seen["drafts"] += sum(s.num_draft_tokens for s in sched.scheduled)
        for s in sched.scheduled:
            r = s.request
            if r.num_computed_tokens < r.num_prompt_tokens and r.num_computed_tokens > 0:
                if r.num_cached_prompt_tokens and r.num_computed_tokens == r.num_cached_prompt_tokens:
                    seen["cached_prefix"] += 1
                else:
                    seen["chunk_after_chunk"] += 1
        return prepare(sched, drafts, trees)

    e.runner.prepare = spy
    report = e.warmup(shapes=((100, 1), (100, 4), (600, 1)))
    assert report["shapes"] == [(100, 1), (100, 4), (600, 1)]
    assert seen["max_batch"] >= 4, seen
    assert seen["drafts"] > 0, seen                 # verify steps ran
    assert seen["chunk_after_chunk"] > 0, seen      # the 600-token prompt took several 256-token chunks
    assert seen["cached_prefix"] > 0, seen          # the extended prompt reused a cached prefix


def test_warmup_leaves_no_trace():
    e, fresh = LLMEngine(_config()), LLMEngine(_config())
    e.warmup(shapes=((100, 2), (300, 1)))
    assert not e.has_unfinished()
    assert e.allocator.num_used_blocks == 0 and not e.allocator.cached
    assert e.stats == EngineStats() and e.allocator.prefix_queries == 0
    e.allocator.check_invariants()
    reqs = [{"prompt_token_ids": list(range(5, 140)), "max_tokens": 16, "ignore_eos": True}]
    got, want = e.generate(reqs)[0], fresh.generate(reqs)[0]
    assert got["token_ids"] == want["token_ids"] and got["usage"] == want["usage"]


def test_warmup_skips_shapes_that_do_not_fit_and_refuses_a_busy_engine():
    e = LLMEngine(dataclasses.replace(_config(), cache=dataclasses.replace(_config().cache, num_blocks=64)))
    report = e.warmup(shapes=((100, 1), (100, 16), (5000, 1)))   # 64 blocks x 16 = 1024 tokens
    assert report["shapes"] == [(100, 1)]
    e.add_request("busy", prompt_token_ids=[1, 2, 3])
    with pytest.raises(RuntimeError, match="idle"):
        e.warmup()
    e.abort("busy")


def test_warmup_setting():
    assert LLMEngine(_config()).wants_warmup is False                      # CPU default: off
    assert LLMEngine(dataclasses.replace(_config(), warmup=True)).wants_warmup is True
    assert load_config(overrides={"model.warmup": False}).engine.warmup is False
    with pytest.raises(ConfigError, match="warmup"):
        EngineConfig(warmup="yes")
