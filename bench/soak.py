"""Soak: mixed traffic for a long time against a local cluster while workers are killed, drained
and rebalanced and Redis restarts, then the books: requests by scenario and status code, the chaos
done, KV blocks still held once idle (must be 0), and greedy outputs checked against the offline
engine (every move, failover and restart must keep them token-exact). Not in CI.

Real parts on 127.0.0.1: Ray, the controller and its pools, two gRPC routers sharing sessions
through a real redis-server, the tiny random model on CPU (or --model).

Scenarios (each client thread picks one per request): a multi-turn session (2-4 turns, on either
router), a greedy one-shot (kept for the check), a seeded sampled one-shot, a long prompt, a
client deadline too short to finish (DEADLINE_EXCEEDED expected), a stream the client abandons
midway (cancel), stop strings. Chaos, every --chaos-every seconds, one of: kill a worker actor
(the controller replaces it; its streams fail over), drain a decode worker (its streams move with
their KV; the pool's target is then restored), move a decode worker's sequences elsewhere, restart
Redis (same port).

    python bench/soak.py --duration 1800                  # 30 minutes, the issue's soak
    python bench/soak.py --duration 120 --clients 4       # a quick look
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import sys
import threading
import time
from pathlib import Path

import grpc
import ray

sys.path.append(str(Path(__file__).resolve().parents[1]))  # tests.conftest; a PYTHONPATH layout wins

from tandem.cluster.local import RunningCluster  # noqa: E402
from tandem.engine.config import CacheConfig, EngineConfig  # noqa: E402
from tandem.engine.engine import LLMEngine  # noqa: E402
from tandem.protos.tandem.v1 import admin_pb2  # noqa: E402
from tandem.protos.tandem.v1 import generation_pb2 as pb  # noqa: E402
from tandem.protos.tandem.v1 import generation_pb2_grpc  # noqa: E402
from tandem.runtime.metrics import get_hub  # noqa: E402
from tests.conftest import start_redis_server  # noqa: E402

SCENARIOS = ("session", "greedy", "seeded", "long", "deadline", "abandon", "stop")


class Books:
    """What happened, from every thread."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.codes: dict[str, collections.Counter] = {s: collections.Counter() for s in SCENARIOS}
        self.chaos: collections.Counter = collections.Counter()
        self.chaos_errors: list[str] = []
        self.greedy: list[tuple[str, int, list[int]]] = []   # (prompt, max_tokens, tokens)
        self.errors: list[str] = []

    def record(self, scenario: str, code: str, detail: str = "") -> None:
        with self.lock:
            self.codes[scenario][code] += 1
            if code not in ("OK", "CANCELLED") and not (scenario == "deadline" and code == "DEADLINE_EXCEEDED") \
                    and len(self.errors) < 50:
                self.errors.append(f"{scenario}: {code}: {detail[:200]}")


def _stream(stub, req, timeout_s: float, stop_after: int | None = None) -> list[int]:
    ids: list[int] = []
    call = stub.Generate(req, timeout=timeout_s)
    for r in call:
        ids.extend(r.token_ids)
        if stop_after is not None and len(ids) >= stop_after:
            call.cancel()
            break
    return ids


def _words(rng: random.Random, n: int) -> str:
    return " ".join(f"w{rng.randrange(500)}" for _ in range(n))


def client(stubs, books: Books, stop: threading.Event, seed: int) -> None:
    rng = random.Random(seed)
    while not stop.is_set():
        scenario = rng.choice(SCENARIOS)
        stub = rng.choice(stubs)
        try:
            if scenario == "session":
                sid = f"soak-{seed}-{rng.randrange(10**9)}"
                for turn in range(rng.randint(2, 4)):
                    _stream(rng.choice(stubs), pb.GenerateRequest(
                        prompt=f"turn {turn}: {_words(rng, rng.randint(5, 40))}", session_id=sid,
                        sampling=pb.SamplingParams(max_tokens=rng.randint(8, 64))), 120)
            elif scenario in ("greedy", "long"):
                prompt = _words(rng, rng.randint(200, 300) if scenario == "long" else rng.randint(5, 60))
                n = rng.randint(16, 200)
                ids = _stream(stub, pb.GenerateRequest(prompt=prompt, sampling=pb.SamplingParams(
                    max_tokens=n, ignore_eos=True)), 180)
                with books.lock:
                    books.greedy.append((prompt, n, ids))
            elif scenario == "seeded":
                _stream(stub, pb.GenerateRequest(prompt=_words(rng, 20), sampling=pb.SamplingParams(
                    max_tokens=rng.randint(16, 120), temperature=0.8, top_p=0.9, seed=rng.randrange(10**6))), 120)
            elif scenario == "deadline":
                _stream(stub, pb.GenerateRequest(prompt=_words(rng, 30), sampling=pb.SamplingParams(
                    max_tokens=1500, ignore_eos=True)), 0.3)
            elif scenario == "abandon":
                _stream(stub, pb.GenerateRequest(prompt=_words(rng, 30), sampling=pb.SamplingParams(
                    max_tokens=500, ignore_eos=True)), 120, stop_after=rng.randint(1, 40))
                books.record(scenario, "CANCELLED")
                continue
            else:
                _stream(stub, pb.GenerateRequest(prompt=_words(rng, 20), sampling=pb.SamplingParams(
                    max_tokens=80, stop=["w1", "w2"])), 120)
            books.record(scenario, "OK")
        except grpc.RpcError as e:
            books.record(scenario, e.code().name, e.details() or "")
        except Exception as e:  # noqa: BLE001 - counted
            books.record(scenario, type(e).__name__, str(e))


def chaos(c: RunningCluster, redis, books: Books, stop: threading.Event, every_s: float, seed: int) -> None:
    rng = random.Random(seed)
    while not stop.wait(every_s):
        state = c.admin.GetClusterState(admin_pb2.GetClusterStateRequest(), timeout=10)
        ready = {p.name: [w.id for w in p.workers if w.state == admin_pb2.WORKER_STATE_READY] for p in state.pools}
        action = rng.choice(("kill", "drain", "move", "redis"))
        try:
            if action == "kill" and ready["decode"] + ready["prefill"]:
                wid = rng.choice(ready["decode"] + ready["prefill"])
                ray.kill(ray.get_actor(f"{c.cluster.namespace}:{wid}", namespace=c.cluster.namespace))
            elif action == "drain" and len(ready["decode"]) > 1:
                pool = next(p for p in state.pools if p.name == "decode")
                c.admin.DrainWorker(admin_pb2.DrainWorkerRequest(worker_id=rng.choice(ready["decode"])), timeout=10)
                time.sleep(min(every_s / 2, 10))       # the streams move; then the pool is refilled
                c.admin.SetPoolBounds(admin_pb2.SetPoolBoundsRequest(pool="decode", min=pool.min, max=pool.max,
                                                                     target=pool.target), timeout=10)
            elif action == "move" and len(ready["decode"]) > 1:
                c.admin.MoveSequences(admin_pb2.MoveSequencesRequest(worker_id=rng.choice(ready["decode"])),
                                      timeout=40)
            elif action == "redis":
                redis["server"].stop()
                time.sleep(1.0)
                redis["server"] = start_redis_server(redis["server"].port)
            else:
                continue
            books.chaos[action] += 1
        except Exception as e:  # noqa: BLE001 - reported
            books.chaos_errors.append(f"{action}: {type(e).__name__}: {str(e)[:200]}")


def verify(model: str, num_blocks: int, greedy: list[tuple[str, int, list[int]]], sample: int, seed: int) -> int:
    """Greedy outputs that differ from the offline engine's (a sample of them)."""
    picked = random.Random(seed).sample(greedy, min(sample, len(greedy)))
    if not picked:
        return 0
    ref = LLMEngine(EngineConfig(model=model, cache=CacheConfig(num_blocks=num_blocks))).generate(
        [{"prompt": p, "max_tokens": n, "ignore_eos": True} for p, n, _ in picked])
    return sum(r["token_ids"] != ids for (_, _, ids), r in zip(picked, ref))


def _report(args, books: Books, used: dict[str, int], stats: dict, mismatches: int, elapsed_s: float) -> dict:
    """Print the books as a table; -> the JSON report."""
    totals = collections.Counter()
    for v in books.codes.values():
        totals.update(v)
    migrations = {s.labels["reason"]: int(s.value) for m in get_hub().migrations.collect() for s in m.samples
                  if s.name.endswith("_total")}   # both routers (this process), by reason
    moved = {k: sum(getattr(s, k) for s in stats.values()) for k in (
        "sequences_migrated", "sequences_migrated_in", "pressure_moves", "migrations_resumed", "tokens_recomputed")}
    print(f"\nsoak: {args.duration:.0f} s of traffic, {args.clients} clients, {args.model}, chaos every "
          f"{args.chaos_every:g} s")
    print("| scenario | " + " | ".join(sorted(totals)) + " |")
    print("|---|" + "---:|" * len(totals))
    for s in SCENARIOS:
        print(f"| {s} | " + " | ".join(str(books.codes[s].get(k, 0)) for k in sorted(totals)) + " |")
    checked = min(args.verify, len(books.greedy))
    print(f"chaos: {dict(books.chaos)}; chaos errors: {len(books.chaos_errors)}")
    print(f"KV blocks held once idle: {used}; greedy outputs checked: {checked}, mismatches: {mismatches}")
    print(f"requests moved, by reason (routers): {migrations}; on the workers alive at the end: {moved}")
    return {"args": vars(args), "elapsed_s": elapsed_s, "codes": {k: dict(v) for k, v in books.codes.items()},
            "totals": dict(totals), "chaos": dict(books.chaos), "chaos_errors": books.chaos_errors,
            "leaked_blocks": used, "greedy_checked": checked, "greedy_mismatches": mismatches,
            "request_migrations": migrations, "moves_on_live_workers": moved, "errors": books.errors}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration", type=float, default=1800.0, help="seconds of traffic")
    ap.add_argument("--clients", type=int, default=6)
    ap.add_argument("--chaos-every", type=float, default=20.0, metavar="S")
    ap.add_argument("--model", default="tiny-random")
    ap.add_argument("--num-blocks", type=int, default=384)
    ap.add_argument("--verify", type=int, default=60, help="greedy outputs to check against the offline engine")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", help="JSON results here")
    args = ap.parse_args(argv)
    redis = {"server": start_redis_server()}
    ray.init(num_cpus=8, resources={"tandem_prefill": 64, "tandem_decode": 64}, include_dashboard=False,
             log_to_driver=False, logging_level="ERROR")
    c = RunningCluster({"model.name": args.model, "cache.num_blocks": args.num_blocks, "prefill.replicas": 1,
                        "decode.replicas": 2, "decode.local_prefill_threshold": 64}, redis["server"].url)
    books, stop = Books(), threading.Event()
    t0 = time.monotonic()
    try:
        second = c.add_router(redis["server"].url)
        stubs = [c.stub, generation_pb2_grpc.GenerationStub(grpc.insecure_channel(second))]
        threads = [threading.Thread(target=client, args=(stubs, books, stop, args.seed * 1000 + i), daemon=True)
                   for i in range(args.clients)]
        threads.append(threading.Thread(target=chaos, args=(c, redis, books, stop, args.chaos_every, args.seed),
                                        daemon=True))
        for t in threads:
            t.start()
        while time.monotonic() - t0 < args.duration:
            time.sleep(5)
            done = sum(sum(v.values()) for v in books.codes.values())
            print(f"soak: {time.monotonic() - t0:.0f} s, {done} requests, chaos {dict(books.chaos)}", flush=True)
        stop.set()
        for t in threads:
            t.join(240)
        used = c.wait_idle(120)
        stats = c.worker_stats()
    finally:
        c.close()
        ray.shutdown()
        redis["server"].stop()
    mismatches = verify(args.model, args.num_blocks, books.greedy, args.verify, args.seed)
    report = _report(args, books, used, stats, mismatches, time.monotonic() - t0)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    leaked = not used or any(v != 0 for v in used.values())
    return 1 if leaked or mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
