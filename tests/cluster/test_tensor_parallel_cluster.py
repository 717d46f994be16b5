"""A tensor-parallel pool worker through the cluster: the decode pool's worker runs 2 ranks (its
WorkerActor as rank 0, a ShardActor as rank 1, in one placement group; gloo), colocated (no
prefill pool; KV resharding between workers: test_tp_reshard.py). Tokens streamed
over gRPC equal a single-rank engine's greedy tokens; a rank killed mid-step fails its worker
cleanly and the streams move."""

from __future__ import annotations

import os
import signal

import ray

from tandem.engine.config import CacheConfig, EngineConfig
from tandem.engine.engine import LLMEngine
from tests.chaos.test_faults import _reference, _streams, _wait

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


def test_a_rank_killed_mid_step_fails_its_worker_and_the_streams_move(make_cluster):
    """kill -9 rank 1 of the decode worker that is streaming: rank 0 exits (no step hangs in a
    collective), the controller finds the worker dead, and every stream continues on the other
    TP=2 worker with the tokens a single engine gives (the worker-lost path)."""
    c = make_cluster({"model.name": "tiny-random", "cache.num_blocks": 512, "prefill.replicas": 0,
                      "decode.replicas": 2, "decode.tensor_parallel_size": 2, "decode.num_cpus": 0.5})
    reqs = [{"prompt": f"rank loss {i} " + "ab" * i, "max_tokens": 300, "ignore_eos": True} for i in range(3)]
    ref = _reference("tiny-random", reqs)
    results, errors = [None] * len(reqs), []
    threads = _streams(c, reqs, results, errors)
    busy = []
    _wait(lambda: busy.extend(w for w, s in c.worker_stats().items() if s.running > 0) or busy, 60, "a stream")
    victim = ray.get_actor(f"{c.cluster.namespace}:{busy[0]}", namespace=c.cluster.namespace)
    pids = ray.get(victim.rank_pids.remote(), timeout=30)
    assert len(pids) == 2
    os.kill(pids[1], signal.SIGKILL)
    assert any(r is None for r in results), "meant to kill mid-stream"
    for t in threads:
        t.join(240)
    assert not errors, errors
    assert results == ref, "greedy streams must continue on the other worker with no gap and no duplicate"
    _wait(lambda: not _alive(pids[0]), 60, "rank 0 of the failed worker to exit")
    _wait(lambda: busy[0] not in c.worker_stats(), 60, "the controller to drop the failed worker")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
