"""Tensor parallelism on CPU (gloo): TP=2 against TP=1 in fp32, for a Llama (Llama-3 rope, odd
vocabulary: the vocab-parallel layers pad it), a Qwen2 (q/k/v biases, tied embeddings: one
vocab shard serves both) and a Qwen3 (per-head q/k norms, head_dim != hidden / heads) built by
transformers (tests/engine/families.py). One spawned process is rank 1 for all three models;
this process is rank 0 and runs the engine. Greedy tokens must be equal; logits of every step
within test_model_vs_hf's tolerance (row-parallel sums change only the fp32 rounding). With
--quantization fp8 each rank quantizes its own shard: its logits err against fp32 about as much as
one rank's FP8 model does."""

from __future__ import annotations

import time

import pytest
import torch

from tandem.engine.config import CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig
from tandem.engine.engine import LLMEngine
from tandem.engine.parallel.group import destroy_tensor_parallel, init_tensor_parallel
from tandem.engine.parallel.local import free_init_method, spawn_shards
from tandem.engine.parallel.sharding import check_shardable, padded_vocab, rank_config, shard_tensor
from tandem.engine.weights import PRESETS
from tandem.wire.errors import ConfigError
from tests.engine.families import build_family_dir
from tests.engine.test_model_vs_hf import _close

FAMILIES = ("llama", "qwen2", "qwen3")


def _config(path, tp: int, quantization: str | None = None) -> EngineConfig:
    return EngineConfig(model=str(path), tensor_parallel_size=tp, cache=CacheConfig(num_blocks=64, block_size=16),
                        scheduler=SchedulerConfig(max_num_batched_tokens=24), quantization=quantization)


def _generate(engine: LLMEngine) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Three prompts (one chunked over two steps), 6 greedy tokens each; -> tokens, every step's logits."""
    logits, execute = [], engine.runner.execute
    engine.runner.execute = lambda batch, hook=None: logits.append(execute(batch, hook)) or logits[-1]
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (30, 7, 12)]
    outs = engine.generate([{"prompt_token_ids": p, "max_tokens": 6, "ignore_eos": True} for p in prompts])
    return [o["token_ids"] for o in outs], logits


def test_tp2_matches_tp1(tmp_path):
    dirs = {f: tmp_path / f for f in FAMILIES}
    for f, path in dirs.items():
        build_family_dir(f, path)
    configs = [_config(dirs[f], 2) for f in FAMILIES] + [_config(dirs["llama"], 2, "fp8")]
    init = free_init_method()
    procs = spawn_shards(configs, init, timeout_s=3)
    try:
        init_tensor_parallel(0, 2, init, timeout_s=120)
        for f, config in zip(FAMILIES, configs):
            want_tokens, want_logits = _generate(LLMEngine(_config(dirs[f], 1)))
            engine = LLMEngine(config)
            if f == "llama":
                time.sleep(5)  # rank 1 waits for the next step longer than its collectives' timeout: fine
            assert engine.kv_cache.tensor.shape[-2] == 1  # this rank's KV heads: 1 of 2
            tokens, logits = _generate(engine)
            engine.shards.close()
            assert tokens == want_tokens, f
            assert len(logits) == len(want_logits) and engine.shards.steps == len(logits)
            for got, want in zip(logits, want_logits):
                assert got.shape == want.shape
                if want.numel():  # a step that only prefills a chunk samples nothing
                    _close(got, want)
        # shard, then quantize: FP8 per output channel of each rank's shard
        exact = _generate(LLMEngine(_config(dirs["llama"], 1)))[1]
        one = _generate(LLMEngine(_config(dirs["llama"], 1, "fp8")))[1]
        engine = LLMEngine(configs[-1])
        assert all(m.is_fp8 for m in (engine.model.layers[0].self_attn.o_proj, engine.model.layers[1].mlp.gate_up_proj))
        two = _generate(engine)[1]
        engine.shards.close()
        # the first sampling step (the same inputs everywhere): each rank's per-channel scales err
        # about as much as the whole model's
        e, a, b = next((e, a, b) for e, a, b in zip(exact, one, two) if e.numel())
        err_one, err_two = (a - e).abs().max().item(), (b - e).abs().max().item()
        assert 0.5 * err_one <= err_two <= 2 * err_one, (err_one, err_two)
    finally:
        destroy_tensor_parallel()
        for p in procs:
            p.join(timeout=30)
    assert [p.exitcode for p in procs] == [0]


def test_shard_rules():
    cfg = rank_config(PRESETS["tiny-random"], 1)
    v = cfg.vocab_size
    emb = torch.arange(v * 2, dtype=torch.float32).view(v, 2)
    parts = [shard_tensor("model.embed_tokens.weight", emb, cfg, r, 3) for r in range(3)]
    assert all(p.shape == (padded_vocab(cfg, 3), 2) for p in parts)
    assert torch.equal(torch.cat(parts)[:v], emb) and not torch.cat(parts)[v:].any()
    o = torch.randn(cfg.hidden_size, cfg.num_heads * cfg.head_dim)
    halves = [shard_tensor("model.layers.0.self_attn.o_proj.weight", o, cfg, r, 2) for r in range(2)]
    assert torch.equal(torch.cat(halves, 1), o)
    norm = torch.randn(cfg.hidden_size)
    assert shard_tensor("model.layers.0.input_layernorm.weight", norm, cfg, 1, 2) is norm


def test_unsupported_splits_are_refused_by_name():
    cfg = PRESETS["tiny-random"]
    with pytest.raises(ConfigError, match=f"does not divide the {cfg.num_kv_heads} KV heads of model 'tiny-random'"):
        check_shardable(cfg, cfg.num_kv_heads * 2, "tiny-random")
    with pytest.raises(ConfigError, match="tensor_parallel_size must be an integer >= 1"):
        EngineConfig(tensor_parallel_size=0)
    with pytest.raises(ConfigError, match="'draft' is not implemented with tensor_parallel_size > 1"):
        EngineConfig(tensor_parallel_size=2, speculative=SpeculativeConfig(method="draft", draft_num_layers=1))
    with pytest.raises(ConfigError, match="needs this process to join a group of 2 ranks"):
        LLMEngine(EngineConfig(model="tiny-random", tensor_parallel_size=2))
