"""A tensor-parallel pool worker through the cluster: the decode pool's worker runs 2 ranks (its
WorkerActor as rank 0, a ShardActor as rank 1, in one placement group; gloo), colocated (no
prefill pool: KV transfer to or from tensor-parallel workers is not built yet). Tokens streamed
over gRPC equal a single-rank engine's greedy tokens."""

from __future__ import annotations

import ray

from tandem.engine.config import CacheConfig, EngineConfig
from tandem.engine.engine import LLMEngine

PROMPTS = [[5, 17, 99, 3, 250, 41, 7, 8, 300, 12], list(range(40, 70))]


def test_tp2_decode_worker_over_grpc(make_cluster):
    c = make_cluster({"model.name": "tiny-random", "cache.num_blocks": 256, "prefill.replicas": 0,
                      "decode.replicas": 1, "decode.tensor_parallel_size": 2, "decode.num_cpus": 0.5})
    ref = LLMEngine(EngineConfig(model="tiny-random", cache=CacheConfig(num_blocks=256)))
    want = ref.generate([{"prompt_token_ids": p, "max_tokens": 12, "ignore_eos": True} for p in PROMPTS])
    for p, w in zip(PROMPTS, want):
        got, _, last = c.generate(prompt_token_ids=p, max_tokens=12, ignore_eos=True)
        assert got == w["token_ids"]
    stats = c.worker_stats()
    assert list(stats) == ["decode-0"]
    assert stats["decode-0"].kv_blocks_total == 256
    pgs = [pg for pg in ray.util.placement_group_table().values() if pg["state"] == "CREATED"]
    assert any(len(pg["bundles"]) == 2 for pg in pgs), "the worker's two ranks share one placement group"
