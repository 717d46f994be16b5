"""The controller's bookkeeping for the prefill and decode pools, with no Ray in it: which workers
are members and in what state, their health, each pool's target and bounds, and the autoscaler in
the loop. Workers are reached only through `Member`s (cluster.members) and time comes in as
arguments, so tests drive it with a fake member and a fake clock.

A worker is `starting` until its readiness check passes, `ready` while its health checks pass,
`draining` once asked to drain (no new admissions), and `dead` after `dead_after_failures` missed
checks in a row, or at once when its actor is gone or failed to start; a dead worker is killed
and forgotten and, if its pool is below target, replaced. A draining worker that reports nothing
running, waiting or in flight, in stats asked for after it was told to drain (an earlier answer
may predate the requests it still holds), is stopped (asked to shut down, killed once it did or its stop
timed out: DRAINED_STOP_TIMEOUT_S) and leaves the membership at once.

A worker's role (what it serves: "prefill", "decode" or "mixed") starts as its pool's; `set_role`
changes it in place (tandem.workers: no new actor, its KV cache kept) and logs the change with its
reason. Pools, targets and bounds stay by the pool a worker started in; the autoscaler's load
signals go by the part a worker serves now (`build_snapshot`).
"""

from __future__ import annotations

import itertools
from collections import deque
import logging
import threading
from dataclasses import dataclass, replace
from typing import Callable

from tandem.cluster.roles import PromptCounters, RoleDecision, RoleState, role_period
from tandem.perf_model import PerfModel
from tandem.cluster.autoscaler import DecodeMetrics, MetricsSnapshot, PolicyState, PrefillMetrics, decide
from tandem.cluster.config import ClusterConfig
from tandem.cluster.members import Member, Probe
from tandem.wire.cluster import AutoscalerDecision, ClusterState, PoolState, RoleChange, WorkerEntry
from tandem.wire.errors import InvalidPoolBounds, InvalidRole, UnknownPool, UnknownWorker, WorkerUnavailable
from tandem.wire.stats import Percentiles, WorkerInfo, WorkerStats

log = logging.getLogger(__name__)

POOLS = ("prefill", "decode")
ROLES = ("prefill", "decode", "mixed")
ROLE_CHANGES_SHOWN = 50   # the latest role changes in cluster_state (role_log() keeps 500)
DRAINED_STOP_TIMEOUT_S = 10.0  # a drained worker's shutdown() may take this long before it is killed


@dataclass
class WorkerRecord:
    member: Member
    started_at: float
    state: str = "starting"
    info: WorkerInfo | None = None     # its answer to ready()
    error: str | None = None           # why it failed to start
    stats: WorkerStats | None = None
    stats_sent_at: float = float("-inf")  # when the call that brought `stats` went out
    drained_at: float | None = None  # when it was told to drain
    failures: int = 0
    role: str = ""                   # what it serves now ("": its pool's, until set_role)

    @property
    def worker_id(self) -> str:
        return self.member.worker_id

    @property
    def pool(self) -> str:
        return self.member.pool

    def drained(self) -> bool:
        """Draining, and idle in stats asked for since it was told to drain."""
        return (self.state == "draining" and self.drained_at is not None and self.stats_sent_at > self.drained_at
                and self.stats is not None and self.stats.idle())


@dataclass(frozen=True)
class WorkCounters:
    """One worker's cumulative prefill counters at one snapshot, and the part it served then."""
    part: str                   # "prefill" | "decode" (`serving`)
    computed_tokens: int
    busy_s: float


@dataclass(frozen=True)
class PrefillCounters:
    """The ready workers' counters at one snapshot, by worker id, for the rates of the next; and the
    last prefill capacity measured (tokens per busy second of one prefill-only worker), which holds
    through periods too idle to measure one."""
    at: float
    workers: dict[str, WorkCounters]
    capacity: float | None = None


def serving(w: WorkerEntry) -> str:
    """The part whose autoscaler metrics a worker's load counts in: "prefill" while it only prefills
    (for others), "decode" while it decodes (role decode, or mixed: it prefills for others only
    with slack, so that work shows in its TPOT), whichever pool it started in."""
    return "prefill" if (w.role or w.pool) == "prefill" else "decode"


def _worst_percentiles(workers: list[WorkerEntry], key: str) -> Percentiles:
    vals: list[Percentiles] = [getattr(w.stats, key) for w in workers]

    def worst(q: str) -> float | None:   # the worst worker sets the pool's latency
        xs = [getattr(v, q) for v in vals if getattr(v, q) is not None]
        return max(xs) if xs else None
    return Percentiles(worst("p50"), worst("p90"), worst("p99"))


def _prefill_rates(pre: list[WorkerEntry], now_counters: dict[str, WorkCounters], prev: PrefillCounters | None,
                   now: float, period_s: float) -> tuple[float | None, float | None]:
    """(prompt tokens per second the prefill-only workers computed since `prev`, tokens per busy
    second of one of them). Per worker, so a worker changing role or leaving moves no counts with it:
    a worker's tokens since the last snapshot count for the part it serves now (a new one's from
    zero); its busy time only when it only prefilled at both ends (a mixed one's includes decoding)."""
    if prev is None or now <= prev.at:
        return None, None

    def since(wid: str, key: str) -> float:
        before = prev.workers.get(wid)
        return max(0, getattr(now_counters[wid], key) - (getattr(before, key) if before else 0))
    rate = sum(since(w.worker_id, "computed_tokens") for w in pre) / (now - prev.at)
    steady = [w.worker_id for w in pre if w.worker_id in prev.workers and prev.workers[w.worker_id].part == "prefill"]
    busy = sum(since(wid, "busy_s") for wid in steady)
    tokens = sum(since(wid, "computed_tokens") for wid in steady)
    # tokens count when a step is scheduled and busy time once it ran, so a period just after a
    # burst can hold busy time without tokens: that measures nothing
    cap = tokens / busy if busy > 0.2 * period_s and tokens > 0 else None
    return rate, cap


def build_snapshot(workers: tuple[WorkerEntry, ...], prev: PrefillCounters | None, now: float,
                   period_s: float, max_seqs_per_worker: int | None = None) -> tuple[MetricsSnapshot, PrefillCounters]:
    """The autoscaler's inputs from the workers' latest stats (`cluster_state().workers`). Sizes,
    draining counts and KV capacity are by pool (the autoscaler resizes pools); load, rates and
    latency by the part each ready worker serves now (`serving`), so a worker lent to the other role
    counts, once, in the metrics of the part it serves. `prev` carries the counters of the last
    call, for rates; returns the new one to carry. `max_seqs_per_worker`: the decode workers'
    batch slots (scheduler.max_num_seqs), for their sequence load; None: the autoscaler's default."""
    ready = [w for w in workers if w.state == "ready" and w.stats is not None]
    pre = [w for w in ready if serving(w) == "prefill"]
    dec = [w for w in ready if serving(w) == "decode"]

    def in_pool(pool):
        return [w for w in ready if w.pool == pool]

    def draining(pool):
        return sum(1 for w in workers if w.pool == pool and w.state == "draining")

    def total(ws, key):
        return sum(getattr(w.stats, key) for w in ws)

    counters = {w.worker_id: WorkCounters(serving(w), w.stats.computed_tokens, w.stats.busy_s) for w in ready}
    rate, cap = _prefill_rates(pre, counters, prev, now, period_s)
    if cap is None and prev is not None:
        cap = prev.capacity   # an idle period keeps what was measured, not the config's default
    lat, tpot = _worst_percentiles(pre, "prefill_latency"), _worst_percentiles(dec, "tpot")
    snap = MetricsSnapshot(
        prefill=PrefillMetrics(
            size=len(in_pool("prefill")), draining=draining("prefill"),
            queued_prompt_tokens=total(pre, "queued_prompt_tokens"), prompt_tokens_per_s=rate or 0.0,
            prefill_tokens_per_s_per_worker=cap, ttft_p50=lat.p50, ttft_p90=lat.p90, ttft_p99=lat.p99),
        decode=DecodeMetrics(
            size=len(in_pool("decode")), draining=draining("decode"), running_seqs=total(dec, "running"),
            waiting_seqs=total(dec, "waiting"), kv_blocks_used=total(dec, "kv_blocks_used"),
            # over the pool's workers, as `size` counts them: the KV one decode worker adds
            kv_blocks_total=total(in_pool("decode"), "kv_blocks_total"),
            kv_blocks_waiting=total(dec, "kv_blocks_waiting"), tpot_p50=tpot.p50, tpot_p90=tpot.p90,
            tpot_p99=tpot.p99, max_seqs_per_worker=max_seqs_per_worker))
    return snap, PrefillCounters(now, counters, cap)


class Pools:
    """Membership, health and targets of both pools. `start_member(pool, worker_id)` starts a
    worker and returns its Member; `clock` is monotonic seconds, `wall_clock` unix seconds (for
    the decision log). Thread-safe: the controller's loop and its API calls share it."""

    def __init__(self, config: ClusterConfig, start_member: Callable[[str, str], Member],
                 clock: Callable[[], float], wall_clock: Callable[[], float],
                 dead_after_failures: int = 3):
        self.config = config
        self.start_member = start_member
        self.clock, self.wall_clock = clock, wall_clock
        self.dead_after_failures = dead_after_failures
        self.workers: dict[str, WorkerRecord] = {}
        self.stopping: list[Member] = []  # left the membership; asked to shut down, not yet killed
        self.targets = {"prefill": config.prefill.replicas, "decode": config.decode.replicas}
        a = config.autoscaler
        self.autoscale = config.autoscale
        self.bounds = ({"prefill": (a.prefill_min, a.prefill_max), "decode": (a.decode_min, a.decode_max)}
                       if config.autoscale else {p: (self.targets[p], self.targets[p]) for p in POOLS})
        if config.autoscale:
            self.targets = {p: min(max(self.targets[p], self.bounds[p][0]), self.bounds[p][1]) for p in POOLS}
        self.pinned: set[str] = set()  # pools whose target an operator pinned (SetPoolBounds.target)
        self.policy_state = PolicyState()
        self._rates: PrefillCounters | None = None
        self._next_decision = 0.0
        self.decisions: list[AutoscalerDecision] = []  # recent decisions, for status and tests
        self.role_changes: list[RoleChange] = []       # recent role changes, oldest first
        self.last_decision: AutoscalerDecision | None = None
        self._ids = {p: itertools.count() for p in POOLS}
        self._lock = threading.RLock()
        # the adaptive layout's role policy (cluster.roles), on the router's cost model and SLOs
        self.perf = PerfModel.load(config.router.perf_model) if config.roles.enabled else None
        self.role_state = RoleState()
        self.role_decision: RoleDecision | None = None   # the latest, changed or not
        self._prompts: deque[PromptCounters] = deque()   # samples over the last roles.window_s
        self._next_roles = 0.0

    # ---- membership -------------------------------------------------------------------------
    def adopt(self, member: Member, info: WorkerInfo, stats: WorkerStats) -> None:
        """A worker a previous controller started, ready and serving (a restarted controller's):
        it joins as ready with its role, worker ids continue after it, and its pool's target
        counts it (within the pool's bounds), so adopted workers are not drained for a default."""
        with self._lock:
            pool, wid = member.pool, member.worker_id
            self.workers[wid] = WorkerRecord(member, self.clock(), state="draining" if stats.draining else "ready",
                                             info=info, stats=stats, role=stats.role if stats.role != pool else "",
                                             drained_at=self.clock() if stats.draining else None)
            taken = max(int(w.rsplit("-", 1)[1]) for w in self.workers if w.startswith(pool + "-"))
            self._ids[pool] = itertools.count(max(taken + 1, next(self._ids[pool])))
            live = sum(1 for w in self.workers.values() if w.pool == pool and w.state == "ready")
            lo, hi = self.bounds[pool] if self.autoscale else (0, 10**9)
            self.targets[pool] = max(self.targets[pool], min(max(live, lo), hi))

    def reconcile(self) -> None:
        """Start workers until each pool's live count (not draining) reaches its target; drain the
        extra ones, youngest first (their caches are coldest)."""
        with self._lock:
            for pool in POOLS:
                live = [w for w in self.workers.values() if w.pool == pool and w.state in ("starting", "ready")]
                for _ in range(self.targets[pool] - len(live)):
                    wid = f"{pool}-{next(self._ids[pool])}"
                    self.workers[wid] = WorkerRecord(self.start_member(pool, wid), self.clock(),
                                                     role=getattr(self.config, pool).role)
                    log.info("starting %s", wid)
                extra = len(live) - self.targets[pool]
                if extra > 0:
                    for w in sorted(live, key=lambda w: w.started_at, reverse=True)[:extra]:
                        self._drain(w)

    def _drain(self, w: WorkerRecord, move: bool = True) -> None:
        w.state, w.drained_at = "draining", self.clock()
        w.member.drain(move)

    def check(self) -> None:
        """One round: readiness of starting workers, health of the others, then the dead and the
        drained leave, the stopped are killed, and the pools are refilled to their targets."""
        with self._lock:
            now = self.clock()
            for w in list(self.workers.values()):
                if w.state == "starting":
                    self._check_ready(w)
            for w in list(self.workers.values()):   # the newly ready too: their first stats call goes out
                if w.state in ("ready", "draining"):
                    self._check_health(w, now)
            for w in list(self.workers.values()):
                if w.state == "dead":
                    w.member.kill()
                    del self.workers[w.worker_id]
                elif w.drained():
                    log.info("%s drained; stopping it", w.worker_id)
                    w.member.begin_stop(now, DRAINED_STOP_TIMEOUT_S)
                    self.stopping.append(w.member)
                    del self.workers[w.worker_id]
            self._reap_stopped(now)
        self.reconcile()

    def _check_ready(self, w: WorkerRecord) -> None:
        r = w.member.check_ready()
        if r.status is Probe.OK:
            w.info, w.state = r.value, "ready"
        elif r.status is Probe.FAILED:
            log.error("%s failed to start: %s", w.worker_id, r.error)
            w.state = "dead"
            w.error = str(r.error)

    def _check_health(self, w: WorkerRecord, now: float) -> None:
        r = w.member.check_health(now)
        if r.status is Probe.PENDING:
            return
        if r.value is not None:          # an answer: it resets the count of misses
            w.stats, w.failures = r.value, 0
            w.stats_sent_at = r.sent_at if r.sent_at is not None else now
        if r.status is Probe.FAILED:     # a timeout, an error, or an answer carrying a loop error
            w.failures += 1
            if w.failures >= self.dead_after_failures or r.dead:
                log.warning("%s is dead: %s", w.worker_id, r.error)
                w.state = "dead"

    def _reap_stopped(self, now: float) -> None:
        for m in [m for m in self.stopping if m.check_stopped(now)]:
            m.kill()
            self.stopping.remove(m)

    def stop_all(self, timeout_s: float) -> None:
        """Every worker leaves and is asked to shut down (killed after `timeout_s` at the latest);
        `all_stopped()` says when all are gone."""
        with self._lock:
            now = self.clock()
            for w in self.workers.values():
                w.member.begin_stop(now, timeout_s)
                self.stopping.append(w.member)
            self.workers.clear()

    def all_stopped(self) -> bool:
        with self._lock:
            self._reap_stopped(self.clock())
            return not self.stopping

    # ---- autoscaling ------------------------------------------------------------------------
    def maybe_autoscale(self) -> None:
        """Once per autoscaler period: decide new targets from the workers' stats, then reconcile."""
        now = self.clock()
        if now < self._next_decision:
            return
        a = self.config.autoscaler
        self._next_decision = now + a.period_s
        with self._lock:
            workers = self.state().workers
            (pmin, pmax), (dmin, dmax) = self.bounds["prefill"], self.bounds["decode"]
        snap, self._rates = build_snapshot(workers, self._rates, now, a.period_s,
                                           self.config.engine_for("decode").scheduler.max_num_seqs)
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
            self.last_decision = AutoscalerDecision(
                self.wall_clock(), d.prefill_target, d.decode_target, tuple(d.reasons),
                prefill_size=snap.prefill.size, decode_size=snap.decode.size)
            self.decisions.append(self.last_decision)
            del self.decisions[:-500]
        if changed:
            self.reconcile()

    # ---- roles ------------------------------------------------------------------------------
    def maybe_roles(self) -> None:
        """Once per `roles.period_s` (adaptive layout): the role policy on the measured demand;
        when it moves, one worker changes role in place, with the policy's reason in the log."""
        cfg = self.config.roles
        now = self.clock()
        if not cfg.enabled or now < self._next_roles:
            return
        self._next_roles = now + cfg.period_s
        live = [w for w in self.state().workers if w.state == "ready" and w.stats is not None]
        rc = self.config.router
        d, self.role_state, move = role_period(self._prompts, live, now, self.config.engine.cache.block_size,
                                               self.perf, self.role_state, rc.slo_ttft_ms / 1e3,
                                               rc.slo_tpot_ms / 1e3, cfg)
        if d is not None:
            self.role_decision = d
        if move is not None:
            self.set_role(*move, d.reason)

    # ---- what the API answers ---------------------------------------------------------------
    def state(self) -> ClusterState:
        """Workers (id, pool, state, readiness description, latest stats) and pools (size, target,
        bounds, draining, pinned)."""
        with self._lock:
            workers = tuple(_entry(w) for w in self.workers.values())
            changes = tuple(self.role_changes[-ROLE_CHANGES_SHOWN:])
        pools = {p: PoolState(size=sum(1 for w in workers if w.pool == p and w.state == "ready"),
                              target=self.targets[p], min=self.bounds[p][0], max=self.bounds[p][1],
                              draining=sum(1 for w in workers if w.pool == p and w.state == "draining"),
                              target_pinned=p in self.pinned)
                 for p in POOLS}
        return ClusterState(workers, pools, self.last_decision, role_changes=changes)

    def all_ready(self) -> bool:
        """Every pool has its target of ready workers; raises if a worker failed to start."""
        workers = self.state().workers
        dead = [w for w in workers if w.state == "dead"]
        ready = {p: sum(1 for w in workers if w.pool == p and w.state == "ready") for p in POOLS}
        if all(ready[p] >= self.targets[p] for p in POOLS):
            return True
        if dead:
            raise RuntimeError(f"workers failed to start: {dead}")
        return False

    def drain_worker(self, worker_id: str, move: bool = True) -> WorkerEntry:
        """Drain one worker and lower its pool's target by one (it is not replaced). `move`: its
        running sequences move to other decode workers with their KV where those have room."""
        with self._lock:
            w = self.workers.get(worker_id)
            if w is None:
                raise UnknownWorker(f"unknown worker {worker_id!r}")
            if w.state in ("starting", "ready"):
                self.targets[w.pool] = max(0, self.targets[w.pool] - 1)
                self._drain(w, move)
            return _entry(w)

    def _ready(self, worker_id: str, why: str) -> WorkerRecord:
        """The record of a ready worker; UnknownWorker, or WorkerUnavailable ("<id> is <state>: why")."""
        with self._lock:
            w = self.workers.get(worker_id)
            if w is None:
                raise UnknownWorker(f"unknown worker {worker_id!r}")
            if w.state != "ready":
                raise WorkerUnavailable(f"{worker_id} is {w.state}: {why}")
            return w

    def move_sequences(self, worker_id: str, count: int | None) -> int:
        """Have a ready worker pause up to `count` running sequences (None: all) for their routers
        to move with their KV; -> how many. UnknownWorker, or WorkerUnavailable when not ready."""
        return self._ready(worker_id, "not ready").member.move_out(count)

    def set_role(self, worker_id: str, role: str, reason: str = "") -> WorkerEntry:
        """Change a ready worker's role in place and log it with `reason`. Blocks until the worker
        says it applied the change (milliseconds: it runs on the actor's health threads); raises
        UnknownWorker, InvalidRole, or WorkerUnavailable for a worker that is not ready."""
        if role not in ROLES:
            raise InvalidRole(f"unknown role {role!r}; roles are {list(ROLES)}")
        w = self._ready(worker_id, "only a ready worker changes role")
        t0 = self.clock()
        w.member.set_role(role)          # outside the lock: the health loop goes on meanwhile
        took = self.clock() - t0
        with self._lock:
            before, w.role = w.role or w.pool, role
            self.role_changes.append(RoleChange(self.wall_clock(), worker_id, w.pool, before, role, reason, took))
            del self.role_changes[:-500]
            log.info("%s: role %s -> %s in %.1f ms (%s)", worker_id, before, role, 1e3 * took, reason or "no reason")
            return _entry(w)

    def set_bounds(self, pool: str, min_size: int, max_size: int, target: int | None = None) -> PoolState:
        """New bounds for a pool; a `target` pins it (the autoscaler leaves it), None unpins."""
        if pool not in POOLS:
            raise UnknownPool(f"unknown pool {pool!r}; pools are {list(POOLS)}")
        if min_size < 0 or max_size < min_size:
            raise InvalidPoolBounds(f"bounds must satisfy 0 <= min <= max, got min={min_size} max={max_size}")
        with self._lock:
            self.bounds[pool] = (min_size, max_size)
            if target is None:
                self.pinned.discard(pool)
                t = self.targets[pool]
            else:
                self.pinned.add(pool)
                t = target
            self.targets[pool] = min(max(t, min_size), max_size)
        self.reconcile()
        return self.state().pools[pool]


def _entry(w: WorkerRecord) -> WorkerEntry:
    i = w.info
    return WorkerEntry(w.worker_id, w.pool, w.state, pid=i.pid if i else 0, node=i.node if i else "",
                       host=i.host if i else "", error=w.error, stats=w.stats, role=w.role or w.pool)
