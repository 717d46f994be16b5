"""KV resharded by head between workers of different tensor-parallel sizes, through a real local
cluster (one for the module: gloo, real gRPC): a prefill worker of 2 ranks and a decode worker of
1. Every prompt is prefilled remotely; greedy fp32 tokens equal a single-rank engine's, first with
prefill TP=2 -> decode TP=1, then, the two workers' roles swapped, prefill TP=1 -> decode TP=2.
Between them, a session's second turn pulls its prefix from the TP=1 worker into the TP=2 one.
Then both decode, and running streams move with their KV from one to the other and back
(KV-preserving moves, issue 27: TP=2 -> TP=1 and TP=1 -> TP=2), token-exact, nothing recomputed.
Last, the TP=2 worker's placement group is found by its actor name (what an adopting controller
needs to release it). tiny-random has 2 KV heads, so each rank of the TP=2 worker holds one."""

from __future__ import annotations

import threading
import time

import pytest
import ray

from tandem.cluster.local import RunningCluster
from tandem.engine.config import CacheConfig, EngineConfig
from tandem.engine.engine import LLMEngine
from tandem.protos.tandem.v1 import generation_pb2 as pb
from tandem.workers.tp_ranks import find_placement

CLUSTER = {"model.name": "tiny-random", "cache.num_blocks": 256, "decode.local_prefill_threshold": 0,
           "prefill.replicas": 1, "prefill.tensor_parallel_size": 2, "prefill.num_cpus": 0.5,
           "decode.replicas": 1, "decode.tensor_parallel_size": 1, "decode.num_cpus": 0.5}
# two prompts per direction, none sharing a block with another (each transfer carries a whole prompt)
PROMPTS = {"2->1": [[5, 17, 99, 3, 250, 41, 7, 8, 300, 12, 77, 1, 2, 90, 45, 33, 18], list(range(40, 75))],
           "1->2": [[9, 180, 27, 64, 3, 3, 121, 44, 200, 16, 8, 91, 130, 7, 56, 240, 2, 19], list(range(100, 131))]}
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def cluster(ray_session):
    c = RunningCluster(CLUSTER)
    yield c
    c.close()


@pytest.fixture(scope="module")
def reference():
    ref = LLMEngine(EngineConfig(model="tiny-random", cache=CacheConfig(num_blocks=256)))
    return {k: [r["token_ids"] for r in ref.generate([{"prompt_token_ids": p, "max_tokens": MAX_TOKENS,
                                                       "ignore_eos": True} for p in prompts])]
            for k, prompts in PROMPTS.items()}


def _generate_all(c, prompts) -> list[list[int]]:
    return [c.generate(prompt_token_ids=p, max_tokens=MAX_TOKENS, ignore_eos=True)[0] for p in prompts]


def _received_not_recomputed(before, after, decoder: str, prefiller: str, prompts) -> None:
    """The decoding worker took every prompt's KV from the prefilling one: no transfer failed, and
    it computed no prompt position itself (a failed transfer falls back to a local prefill, which
    would be token-exact too)."""
    d0, d1, p0, p1 = before[decoder], after[decoder], before[prefiller], after[prefiller]
    assert d1.remote_prefills == d0.remote_prefills + len(prompts), "meant to prefill remotely"
    assert (d1.local_prefills, d1.prompt_tokens_computed) == (d0.local_prefills, d0.prompt_tokens_computed)
    assert (d1.transfer_failures, p1.transfer_failures) == (d0.transfer_failures, p0.transfer_failures)
    assert p1.prefills == p0.prefills + len(prompts)
    assert p1.prompt_tokens_computed - p0.prompt_tokens_computed == sum(map(len, prompts))


def test_prefill_tp2_to_decode_tp1_is_token_exact(cluster, reference):
    before = cluster.worker_stats()
    assert _generate_all(cluster, PROMPTS["2->1"]) == reference["2->1"]
    _received_not_recomputed(before, cluster.worker_stats(), "decode-0", "prefill-0", PROMPTS["2->1"])
    used = cluster.wait_idle()
    assert used and all(v == 0 for v in used.values()), used


def test_a_second_turn_pulls_the_prefix_from_tp1_into_tp2(cluster):
    """A session's second turn: the TP=1 decode worker holds the first turn's prompt and output,
    the TP=2 prefill worker only the prompt, so the decode worker sends it the rest (a prefix
    pull, 1 -> 2 by head) and the prefill worker computes only the new tokens; token-exact."""
    first = [(7 * k + 3) % 500 for k in range(40)]
    ids1 = cluster.generate(prompt_token_ids=first, max_tokens=24, ignore_eos=True, session_id="tp-pull")[0]
    second = first + ids1 + [11, 12, 13, 14, 15, 16, 17, 18, 19, 20]
    ref = LLMEngine(EngineConfig(model="tiny-random", cache=CacheConfig(num_blocks=256))).generate(
        [{"prompt_token_ids": second, "max_tokens": MAX_TOKENS, "ignore_eos": True}])[0]["token_ids"]
    before = cluster.worker_stats()
    ids2, _, last = cluster.generate(prompt_token_ids=second, max_tokens=MAX_TOKENS, ignore_eos=True,
                                     session_id="tp-pull")
    after = cluster.worker_stats()
    assert ids2 == ref
    assert after["prefill-0"].pulled_tokens > before["prefill-0"].pulled_tokens, "meant to pull the prefix"
    assert after["decode-0"].remote_prefills == before["decode-0"].remote_prefills + 1
    assert after["prefill-0"].computed_tokens - before["prefill-0"].computed_tokens == \
        last.usage.prompt_tokens - last.usage.cached_prompt_tokens
    assert [after[w].transfer_failures for w in after] == [before[w].transfer_failures for w in after]


def test_prefill_tp1_to_decode_tp2_is_token_exact(cluster, reference):
    """The same two workers, roles swapped: the TP=2 worker decodes, the TP=1 one prefills."""
    for wid, role in (("prefill-0", "decode"), ("decode-0", "prefill")):
        assert ray.get(cluster.cluster.controller.set_role.remote(wid, role, "test: swap"), timeout=30).role == role
    time.sleep(0.6)                           # the routers' views refresh every 0.25 s
    before = cluster.worker_stats()
    assert _generate_all(cluster, PROMPTS["1->2"]) == reference["1->2"]
    _received_not_recomputed(before, cluster.worker_stats(), "prefill-0", "decode-0", PROMPTS["1->2"])
    used = cluster.wait_idle()
    assert used and all(v == 0 for v in used.values()), used


class _Stream(threading.Thread):
    def __init__(self, c, prompt: list[int], max_tokens: int):
        super().__init__(daemon=True)
        self.c, self.prompt, self.max_tokens = c, prompt, max_tokens
        self.ids: list[int] = []
        self.error: str | None = None

    def run(self) -> None:
        try:
            req = pb.GenerateRequest(prompt_token_ids=self.prompt, sampling=pb.SamplingParams(
                max_tokens=self.max_tokens, ignore_eos=True))
            for r in self.c.stub.Generate(req, timeout=240):
                self.ids.extend(r.token_ids)
        except Exception as e:  # noqa: BLE001 - asserted below
            self.error = repr(e)


def _wait(cond, timeout_s: float, what) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what() if callable(what) else what}"
        time.sleep(0.05)


def test_running_streams_move_with_their_kv_between_tp_sizes_and_back(cluster):
    """Both workers decode (the TP=1 one also prefills): every running stream is moved off the
    worker that holds it, then off the other one, so each crosses 2 -> 1 or 1 -> 2 and back."""
    for wid, role in (("prefill-0", "decode"), ("decode-0", "mixed")):
        ray.get(cluster.cluster.controller.set_role.remote(wid, role, "test: both decode"), timeout=30)
    time.sleep(0.6)
    # 1,500 tokens (2 x 96 blocks, both fit one worker): the second stream can be 250 tokens ahead of
    # the first when hop 0 starts (its prefill waits for the TP=2 worker), and must outlive hop 1
    prompts, n = [list(range(3, 24)), [7, 7, 200, 31, 64, 90, 12, 5, 250, 41, 18]], 1500
    ref = LLMEngine(EngineConfig(model="tiny-random", cache=CacheConfig(num_blocks=256))).generate(
        [{"prompt_token_ids": p, "max_tokens": n, "ignore_eos": True} for p in prompts])
    streams = [_Stream(cluster, p, n) for p in prompts]
    for s in streams:
        s.start()
    _wait(lambda: all(len(s.ids) >= 20 for s in streams), 120, "every stream to be decoding")
    handles = {w: ray.get_actor(f"{cluster.cluster.namespace}:{w}", namespace=cluster.cluster.namespace)
               for w in ("prefill-0", "decode-0")}
    before = cluster.worker_stats()
    moved = {w: 0 for w in handles}
    for hop in range(2):
        # the controller's stats lag the workers by a health period: read them once they count both
        # streams (after a hop, the target's may not show what it took yet)
        _wait(lambda: sum(cluster.worker_stats()[w].running for w in handles) == len(streams), 60,
              f"the stats before hop {hop} to show every stream")
        stats = cluster.worker_stats()
        source = max(handles, key=lambda w: stats[w].running)
        count = stats[source].running
        assert count > 0 and ray.get(handles[source].move_out.remote(count=None), timeout=30) == count
        moved[source] += count
        _wait(lambda: cluster.worker_stats()[source].sequences_migrated
              == before[source].sequences_migrated + moved[source], 120,
              lambda: f"hop {hop} off {source}: {[(len(s.ids), s.error) for s in streams]}, {cluster.worker_stats()}")
    for s in streams:
        s.join(240)
    assert [s.error for s in streams] == [None, None]
    assert [s.ids for s in streams] == [r["token_ids"] for r in ref], "no gap, no duplicate, the same tokens"
    after = cluster.worker_stats()
    assert all(moved.values()), f"meant to move off both workers: {moved}"
    for w in handles:
        assert after[w].sequences_migrated_in - before[w].sequences_migrated_in == sum(moved.values()) - moved[w]
        assert after[w].tokens_recomputed == before[w].tokens_recomputed
        assert after[w].transfer_failures == before[w].transfer_failures
    used = cluster.wait_idle()
    assert used and all(v == 0 for v in used.values()), used


def test_a_tp_workers_placement_group_is_found_by_its_actor_name(cluster):
    """What a controller that adopts a detached TP worker needs to release its ranks' bundles with
    it (ActorStarter.adopt): its placement group, looked up by the worker's actor name."""
    ns = cluster.cluster.namespace
    pg = find_placement(f"{ns}:prefill-0")
    assert pg is not None and len(pg.bundle_specs) == 2
    assert find_placement(f"{ns}:decode-0") is None         # one rank: no placement group
