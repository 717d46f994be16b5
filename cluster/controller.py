"""The controller actor: pool membership, health checks, the metrics it gathers from workers, the
rendezvous store for KV-transfer groups, and (with --autoscale) the autoscaling loop.

Workers are Ray actors named `<namespace>:<worker id>`; routers look them up by name and read
the membership and load from `cluster_state()`. A worker is `starting` until its `ready()` answers,
`ready` while its health checks pass, `draining` once asked to drain (no new admissions), and
`dead` after `dead_after_failures` missed checks (it is then forgotten and, if its pool is below
target, replaced).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import ray

from tandem.cluster.autoscaler import DecodeMetrics, MetricsSnapshot, PolicyState, PrefillMetrics, decide
from tandem.cluster.config import ClusterConfig, PoolConfig

log = logging.getLogger(__name__)

POOLS = ("prefill", "decode")


@dataclass
class WorkerRecord:
    worker_id: str
    pool: str
    handle: Any
    state: str = "starting"
    info: dict[str, Any] = field(default_factory=dict)
    stats: dict[str, Any] = field(default_factory=dict)
    failures: int = 0
    ready_ref: Any = None
    started_at: float = field(default_factory=time.monotonic)


def actor_options(pool: PoolConfig, name: str, namespace: str) -> dict[str, Any]:
    opts: dict[str, Any] = {"name": name, "namespace": namespace, "num_cpus": pool.num_cpus,
                            "num_gpus": pool.num_gpus}
    if pool.resource_name:
        opts["resources"] = {pool.resource_name: 1}
    return opts


def build_snapshot(workers: list[dict[str, Any]], prev: dict[str, float] | None, now: float,
                   period_s: float) -> tuple[MetricsSnapshot, dict[str, float]]:
    """The autoscaler's inputs from the workers' latest stats (`cluster_state()["workers"]`).
    `prev` carries the counters of the last call, for rates; returns the new one to carry."""
    def live(pool):
        return [w for w in workers if w["pool"] == pool and w["state"] == "ready" and w.get("stats")]

    def pct(ws, key):
        vals = [w["stats"].get(key, {}) or {} for w in ws]
        out = {}
        for q in ("p50", "p90", "p99"):
            xs = [v[q] for v in vals if v.get(q) is not None]
            out[q] = max(xs) if xs else None  # the worst worker sets the pool's latency
        return out

    pre, dec = live("prefill"), live("decode")
    computed = sum(w["stats"].get("computed_tokens", 0) for w in pre)
    busy = sum(w["stats"].get("busy_s", 0.0) for w in pre)
    rate = cap = None
    if prev is not None and now > prev["at"]:
        rate = max(0.0, (computed - prev["computed"]) / (now - prev["at"]))
        dbusy = busy - prev["busy"]
        if dbusy > 0.2 * period_s:
            cap = (computed - prev["computed"]) / dbusy
    lat = pct(pre, "prefill_latency")
    tpot = pct(dec, "tpot")
    snap = MetricsSnapshot(
        prefill=PrefillMetrics(
            size=len(pre), draining=sum(1 for w in workers if w["pool"] == "prefill" and w["state"] == "draining"),
            queued_prompt_tokens=sum(w["stats"].get("queued_prompt_tokens", 0) for w in pre),
            prompt_tokens_per_s=rate or 0.0, prefill_tokens_per_s_per_worker=cap,
            ttft_p50=lat["p50"], ttft_p90=lat["p90"], ttft_p99=lat["p99"]),
        decode=DecodeMetrics(
            size=len(dec), draining=sum(1 for w in workers if w["pool"] == "decode" and w["state"] == "draining"),
            running_seqs=sum(w["stats"].get("running", 0) for w in dec),
            waiting_seqs=sum(w["stats"].get("waiting", 0) for w in dec),
            kv_blocks_used=sum(w["stats"].get("kv_blocks_used", 0) for w in dec),
            kv_blocks_total=sum(w["stats"].get("kv_blocks_total", 0) for w in dec),
            kv_blocks_waiting=sum(w["stats"].get("kv_blocks_waiting", 0) for w in dec),
            tpot_p50=tpot["p50"], tpot_p90=tpot["p90"], tpot_p99=tpot["p99"]))
    return snap, {"at": now, "computed": computed, "busy": busy}


@ray.remote(num_cpus=0, max_concurrency=32)
class Controller:
    def __init__(self, config: ClusterConfig, namespace: str, health_period_s: float = 1.0,
                 dead_after_failures: int = 3):
        from tandem.kv_transfer.torch_dist import start_rendezvous_store

        self.config = config
        self.namespace = namespace
        self.health_period_s = health_period_s
        self.dead_after_failures = dead_after_failures
        host = ray.util.get_node_ip_address()
        self._store, port = start_rendezvous_store(host=host)
        self.rendezvous = f"{host}:{port}"
        self.workers: dict[str, WorkerRecord] = {}
        self.targets = {"prefill": config.prefill.replicas, "decode": config.decode.replicas}
        a = config.autoscaler
        self.autoscale = config.autoscale
        self.bounds = ({"prefill": (a.prefill_min, a.prefill_max), "decode": (a.decode_min, a.decode_max)}
                       if config.autoscale else {p: (self.targets[p], self.targets[p]) for p in POOLS})
        if config.autoscale:
            self.targets = {p: min(max(self.targets[p], self.bounds[p][0]), self.bounds[p][1]) for p in POOLS}
        self.pinned: set[str] = set()  # pools whose target an operator pinned (SetPoolBounds.target)
        self.policy_state = PolicyState()
        self._rates: dict[str, float] | None = None
        self._next_decision = 0.0
        self.decisions: list[dict[str, Any]] = []  # recent decisions, for status and tests
        self.last_decision: dict[str, Any] = {}
        self._ids = {p: itertools.count() for p in POOLS}
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._reconcile()
        self._thread = threading.Thread(target=self._run, name="controller", daemon=True)
        self._thread.start()

    # ---- membership -------------------------------------------------------------------------
    def _start_worker(self, pool: str) -> WorkerRecord:
        from tandem.decode_workers.actor import DecodeActor
        from tandem.prefill_workers.actor import PrefillActor

        wid = f"{pool}-{next(self._ids[pool])}"
        pcfg = getattr(self.config, pool)
        opts = actor_options(pcfg, f"{self.namespace}:{wid}", self.namespace)
        engine_cfg = self.config.engine
        if pcfg.num_gpus > 0 and engine_cfg.device == "cpu":
            from dataclasses import replace

            engine_cfg = replace(engine_cfg, device="cuda")
        if pool == "decode":
            handle = DecodeActor.options(**opts).remote(wid, engine_cfg, pcfg.local_prefill_threshold,
                                                        self.rendezvous, pcfg.num_cpus, self.config.kv_transfer)
        else:
            handle = PrefillActor.options(**opts).remote(wid, engine_cfg, self.rendezvous, pcfg.num_cpus,
                                                         self.config.kv_transfer)
        rec = WorkerRecord(wid, pool, handle)
        rec.ready_ref = handle.ready.remote()
        self.workers[wid] = rec
        log.info("starting %s", wid)
        return rec

    def _reconcile(self) -> None:
        """Start workers until each pool's live count (not draining) reaches its target."""
        with self._lock:
            for pool in POOLS:
                live = [w for w in self.workers.values() if w.pool == pool and w.state in ("starting", "ready")]
                for _ in range(self.targets[pool] - len(live)):
                    self._start_worker(pool)
                extra = len(live) - self.targets[pool]
                if extra > 0:  # drain the youngest first (their caches are coldest)
                    for w in sorted(live, key=lambda w: w.started_at, reverse=True)[:extra]:
                        self._drain(w)

    def _drain(self, w: WorkerRecord) -> None:
        w.state = "draining"
        try:
            w.handle.set_draining.remote(True)
        except Exception:  # noqa: BLE001
            pass

    def _check(self) -> None:
        with self._lock:
            recs = list(self.workers.values())
        for w in recs:
            if w.state == "starting":
                done, _ = ray.wait([w.ready_ref], timeout=0)
                if not done:
                    continue
                try:
                    w.info = ray.get(w.ready_ref)
                    w.state = "ready"
                except Exception as e:  # noqa: BLE001 - the actor failed to start
                    log.error("%s failed to start: %s", w.worker_id, e)
                    w.state = "dead"
                    w.info["error"] = str(e)
                continue
        refs = {w.worker_id: w.handle.stats.remote() for w in recs if w.state in ("ready", "draining")}
        for wid, ref in refs.items():
            w = self.workers.get(wid)
            try:
                w.stats = ray.get(ref, timeout=max(2.0, 2 * self.health_period_s))
                w.failures = 0
                if w.stats.get("loop_error"):
                    raise RuntimeError(w.stats["loop_error"])
            except Exception as e:  # noqa: BLE001 - a missed health check
                w.failures += 1
                if w.failures >= self.dead_after_failures or isinstance(e, ray.exceptions.RayActorError):
                    log.warning("%s is dead: %s", wid, e)
                    w.state = "dead"
        with self._lock:
            for w in list(self.workers.values()):
                if w.state == "dead":
                    try:
                        ray.kill(w.handle)
                    except Exception:  # noqa: BLE001
                        pass
                    del self.workers[w.worker_id]
                elif w.state == "draining" and w.stats and w.stats.get("running", 1) == 0 \
                        and w.stats.get("waiting", 1) == 0 and w.stats.get("in_flight", 0) == 0:
                    log.info("%s drained; stopping it", w.worker_id)
                    try:
                        ray.get(w.handle.shutdown.remote(), timeout=10)
                    except Exception:  # noqa: BLE001
                        pass
                    ray.kill(w.handle)
                    del self.workers[w.worker_id]
        self._reconcile()

    def _autoscale(self) -> None:
        from dataclasses import replace

        now = time.monotonic()
        if now < self._next_decision:
            return
        a = self.config.autoscaler
        self._next_decision = now + a.period_s
        with self._lock:
            workers = self.cluster_state()["workers"]
            (pmin, pmax), (dmin, dmax) = self.bounds["prefill"], self.bounds["decode"]
        snap, self._rates = build_snapshot(workers, self._rates, now, a.period_s)
        cfg = replace(a, prefill_min=pmin, prefill_max=pmax, decode_min=dmin, decode_max=dmax)
        d = decide(snap, cfg, self.policy_state, now)
        self.policy_state = d.state
        with self._lock:
            changed = False
            for pool, target in (("prefill", d.prefill_target), ("decode", d.decode_target)):
                if pool not in self.pinned and target != self.targets[pool]:
                    log.info("autoscaler: %s %d -> %d", pool, self.targets[pool], target)
                    self.targets[pool] = target
                    changed = True
            self.last_decision = {"at_unix_s": time.time(), "prefill_target": d.prefill_target,
                                  "decode_target": d.decode_target, "reasons": list(d.reasons)}
            self.decisions.append({**self.last_decision, "sizes": {"prefill": snap.prefill.size,
                                                                   "decode": snap.decode.size}})
            del self.decisions[:-500]
        if changed:
            self._reconcile()

    def _run(self) -> None:
        while not self._stop.wait(self.health_period_s):
            try:
                self._check()
                if self.autoscale:
                    self._autoscale()
            except Exception:  # noqa: BLE001 - keep checking
                log.exception("health check round failed")

    # ---- API (routers, Admin) -----------------------------------------------------------------
    def wait_ready(self, timeout_s: float = 300.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self._check()
            state = self.cluster_state()
            ready = {p: sum(1 for w in state["workers"] if w["pool"] == p and w["state"] == "ready") for p in POOLS}
            if all(ready[p] >= self.targets[p] for p in POOLS):
                return state
            dead = [w for w in state["workers"] if w["state"] == "dead"]
            if dead:
                raise RuntimeError(f"workers failed to start: {dead}")
            time.sleep(0.2)
        raise TimeoutError(f"pools not ready after {timeout_s:.0f} s: {self.cluster_state()}")

    def cluster_state(self) -> dict[str, Any]:
        with self._lock:
            workers = [{"worker_id": w.worker_id, "pool": w.pool, "state": w.state,
                        "actor_name": f"{self.namespace}:{w.worker_id}", **w.info, "stats": dict(w.stats)}
                       for w in self.workers.values()]
        pools = {p: {"size": sum(1 for w in workers if w["pool"] == p and w["state"] == "ready"),
                     "target": self.targets[p], "min": self.bounds[p][0], "max": self.bounds[p][1],
                     "draining": sum(1 for w in workers if w["pool"] == p and w["state"] == "draining"),
                     "target_pinned": p in self.pinned}
                 for p in POOLS}
        return {"workers": workers, "pools": pools, "rendezvous": self.rendezvous,
                "last_decision": self.last_decision, "namespace": self.namespace,
                "local_prefill_threshold": self.config.decode.local_prefill_threshold}

    def drain_worker(self, worker_id: str) -> dict[str, Any]:
        with self._lock:
            w = self.workers.get(worker_id)
            if w is None:
                raise KeyError(f"unknown worker {worker_id!r}")
            if w.state in ("starting", "ready"):
                self.targets[w.pool] = max(0, self.targets[w.pool] - 1)
                self._drain(w)
            return {"worker_id": w.worker_id, "pool": w.pool, "state": w.state}

    def set_pool_bounds(self, pool: str, min_size: int, max_size: int, target: int | None = None) -> dict[str, Any]:
        if pool not in POOLS:
            raise ValueError(f"unknown pool {pool!r}; pools are {list(POOLS)}")
        if min_size < 0 or max_size < min_size:
            raise ValueError(f"bounds must satisfy 0 <= min <= max, got min={min_size} max={max_size}")
        with self._lock:
            self.bounds[pool] = (min_size, max_size)
            if target is None:
                self.pinned.discard(pool)
                t = self.targets[pool]
            else:
                self.pinned.add(pool)
                t = target
            self.targets[pool] = min(max(t, min_size), max_size)
        self._reconcile()
        return self.cluster_state()["pools"][pool]

    def decision_log(self) -> list[dict[str, Any]]:
        return list(self.decisions)

    def shutdown(self) -> None:
        self._stop.set()
        with self._lock:
            recs = list(self.workers.values())
            self.workers.clear()
        for w in recs:
            try:
                ray.get(w.handle.shutdown.remote(), timeout=5)
            except Exception:  # noqa: BLE001
                pass
            ray.kill(w.handle)
