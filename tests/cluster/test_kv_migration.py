"""KV-preserving migration on a real cluster (real Ray, controller, gRPC router, KV over gloo; the
tiny random model on CPU): of a decode worker running three streams, `tandem move-sequences` moves
one to the other decode worker with its KV, and draining it moves the others. The streams never see an error, a gap or a duplicate; greedy
output is token-exact and seeded sampling continues with the same draws (both against the offline
engine); the receiving worker recomputes nothing; the counters say what moved; no KV block is left
held."""

from __future__ import annotations

import json
import statistics
import threading
import time

import ray

from tandem.cluster.cli import main
from tandem.engine.config import CacheConfig, EngineConfig
from tandem.engine.engine import LLMEngine
from tandem.protos.tandem.v1 import admin_pb2
from tandem.protos.tandem.v1 import generation_pb2 as pb

CLUSTER = {"model.name": "tiny-random", "cache.num_blocks": 512, "decode.local_prefill_threshold": 10_000,
           "prefill.replicas": 1, "decode.replicas": 2}
MAX_TOKENS = 600
REQUESTS = [  # (prompt, sampling)
    ("the first moved stream " + " ".join(f"a{k}" for k in range(20)), {}),
    ("the second moved stream " + " ".join(f"b{k}" for k in range(33)), {}),
    ("the third, sampled with a seed " + " ".join(f"c{k}" for k in range(9)), {"temperature": 0.9, "seed": 7}),
]


class Stream(threading.Thread):
    """One streamed request: its tokens and the time each response arrived."""

    def __init__(self, c, prompt: str, sampling: dict, session: str):
        super().__init__(daemon=True)
        self.c, self.prompt, self.sampling, self.session = c, prompt, sampling, session
        self.ids: list[int] = []
        self.times: list[float] = []
        self.error: str | None = None

    def run(self) -> None:
        req = pb.GenerateRequest(prompt=self.prompt, session_id=self.session, sampling=pb.SamplingParams(
            max_tokens=MAX_TOKENS, ignore_eos=True, **self.sampling))
        try:
            for r in self.c.stub.Generate(req, timeout=120):
                self.ids.extend(r.token_ids)
                self.times.append(time.perf_counter())
        except Exception as e:  # noqa: BLE001 - asserted below
            self.error = repr(e)


def _wait(cond, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def _listed(c, capsys, worker: str) -> dict:
    """`tandem status --json`'s entry for `worker`: as of the controller's last health check (each
    second; seconds late on a loaded machine)."""
    assert main(["status", "--target", c.target, "--json"]) == 0
    return {w["id"]: w for p in json.loads(capsys.readouterr().out)["pools"] for w in p["workers"]}[worker]


def test_a_move_and_a_drain_move_three_running_streams_with_their_kv(make_cluster, capsys):
    c = make_cluster(CLUSTER)
    ref = LLMEngine(EngineConfig(model="tiny-random", cache=CacheConfig(num_blocks=512))).generate(
        [{"prompt": p, "max_tokens": MAX_TOKENS, "ignore_eos": True, **sp} for p, sp in REQUESTS])
    # the three streams on decode-0: a session pins its decode worker
    sessions = {}
    for i in range(3):
        sid = f"move-{i}"
        c.generate(prompt="warm", max_tokens=1, session_id=sid)
        sessions[i] = sid
    streams = [Stream(c, p, sp, sessions[i]) for i, (p, sp) in enumerate(REQUESTS)]
    for s in streams:
        s.start()
    _wait(lambda: all(len(s.ids) >= 40 for s in streams), 60, "every stream to be decoding")
    stats = c.worker_stats()
    source = max(("decode-0", "decode-1"), key=lambda w: stats[w].running)
    target = "decode-1" if source == "decode-0" else "decode-0"
    on_source = stats[source].running
    before = [len(s.ids) for s in streams]
    handle = ray.get_actor(f"{c.cluster.namespace}:{source}", namespace=c.cluster.namespace)
    # first one sequence moves off the hot worker (the operator's `tandem move-sequences`) ...
    assert main(["move-sequences", "--target", c.target, source, "--count", "1"]) == 0
    assert f"{source}: 1 running sequence(s) paused to move" in capsys.readouterr().out
    _wait(lambda: c.worker_stats()[target].sequences_migrated_in == 1, 30, "the first move")
    # ... then the drain moves the others
    c.admin.DrainWorker(admin_pb2.DrainWorkerRequest(worker_id=source), timeout=10)
    # the drained worker is stopped once it holds nothing: read its counters while it is there
    moved = None
    while moved is None or moved.kv_blocks_used or moved.sequences_migrated < on_source:
        moved = ray.get(handle.stats.remote(), timeout=10)
        assert moved.sequences_migrated <= on_source and moved.migrations_resumed == 0
        time.sleep(0.02)      # the router shares this process: a tight loop here slows its moves
    during = [len(s.ids) for s in streams]   # the drain did not wait for the streams to end
    for s in streams:
        s.join(120)

    assert [s.error for s in streams] == [None] * 3
    assert [s.ids for s in streams] == [r["token_ids"] for r in ref]     # no gap, no duplicate, same draws
    assert max(before) < MAX_TOKENS - 100, f"the streams ended before the drain: {before}"
    assert on_source >= 1 and moved.kv_tokens_migrated >= on_source * 40 and moved.tokens_recomputed == 0
    # the moves pre-copied their full blocks (40 positions or more each) and timed their tails
    assert 0 < moved.kv_tokens_precopied <= moved.kv_tokens_migrated and moved.move_tail_seconds > 0
    # the operator's view: `tandem status --json` (Admin) carries the counters per worker
    _wait(lambda: int(_listed(c, capsys, target)["sequences_migrated_in"]) == on_source, 30, "the status to show them")
    assert int(_listed(c, capsys, target)["tokens_recomputed"]) == 0
    used = c.wait_idle()
    assert used and all(v == 0 for v in used.values()), used

    # the pause a moved stream saw, against its usual gap between responses
    pauses = []
    for s in streams:
        gaps = [b - a for a, b in zip(s.times, s.times[1:])]
        pauses.append((max(gaps), statistics.median(gaps)))
    with capsys.disabled():
        print("\nmove pause per stream (longest gap ms / median gap ms): "
              + ", ".join(f"{1e3 * m:.1f}/{1e3 * g:.2f}" for m, g in pauses))
    assert min(during) < MAX_TOKENS, during
    _wait(lambda: source not in {w.id for p in c.admin.GetClusterState(admin_pb2.GetClusterStateRequest(),
                                                                         timeout=10).pools for w in p.workers},
          30, f"{source} to leave once drained")
