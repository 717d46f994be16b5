"""Tandem's one metrics registry, and the /metrics endpoint that serves it.

`MetricsHub` owns a prometheus_client `CollectorRegistry` with every Tandem metric (vLLM-style
`tandem:` names, listed in `METRIC_NAMES`). It lives in the router process. The router records
request-level timings on it directly; workers (Ray actors in other processes) keep cumulative
counters (their KV transfer times in a `TransferTimes`) and report them in their stats; the router
reads each worker's stats from the controller's cluster state as a `WorkerMetricsSnapshot`
(`from_worker_stats`) and hands the list to `MetricsHub.update_from_workers`, which sets the
gauges and advances the cluster-wide counters by each worker's delta. A worker that restarts (new
`incarnation`, or a counter going backwards) starts a new baseline, so no count is lost or doubled;
a hub that restarts under running workers counts from their next report on.

Prometheus reserves colons for recording rules by convention; vLLM uses them in exported names
anyway and so do we, so one dashboard style covers both. prometheus_client appends `_total` to
counter names: `tandem:prefix_cache_queries` is scraped as `tandem:prefix_cache_queries_total`.
"""

from __future__ import annotations

import bisect
import itertools
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

from wsgiref.simple_server import make_server

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, make_wsgi_app, start_http_server
from prometheus_client.exposition import ThreadingWSGIServer, _SilentHandler
from prometheus_client.core import HistogramMetricFamily

from tandem.wire.cluster import WorkerEntry

# TTFT spans a warm-cache GPU prefill (ms) to a cold 100k-token prompt on CPU (minutes).
TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5,
                2.0, 3.0, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)
# Per-token gaps: a GPU decode step with speculation (~1 ms per token) to a busy CPU worker (~1 s).
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1,
               0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 3.0, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0, 45.0, 60.0,
               120.0, 240.0, 480.0, 960.0, 1920.0)
QUEUE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0,
                 80.0, 160.0)
# One request's KV: NVLink/RDMA moves a layer in well under a ms; gloo over TCP can take seconds.
KV_TRANSFER_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
                       5.0, 10.0, 30.0)

POOLS = ("prefill", "decode", "router")  # "router": requests queued in the router's admission

# a decode worker's KV-move counters (WorkerStats fields): each is `tandem:<name>_total` by pool and worker
_MOVE_COUNTERS = {"sequences_migrated": "Running sequences a worker sent to another decode worker with their KV.",
                  "kv_tokens_migrated": "KV positions sent with those sequences.",
                  "tokens_recomputed": "Positions of requests moved by recompute (after a failure) computed again.",
                  "kv_tokens_precopied": "Of the KV positions moved, those sent while the sequence still decoded.",
                  "move_precopy_seconds": "Seconds the moves' pre-copies took (send to end), summed.",
                  "move_tail_seconds": "Seconds the moves' tails took (sent once paused, to the sender letting go), summed.",
                  "sequences_migrated_in": "Running sequences a worker took from another decode worker with their KV.",
                  "pressure_moves": "Sequences a worker moved out because its KV cache was about to preempt one.",
                  "migrations_resumed": "Sequences paused to move that resumed where they were (nowhere could take them)."}

# Exported metric family names (without the _bucket/_sum/_count/_total suffixes).
METRIC_NAMES = (
    "tandem:time_to_first_token_seconds", "tandem:inter_token_latency_seconds",
    "tandem:e2e_request_latency_seconds", "tandem:request_queue_time_seconds",
    "tandem:num_requests_running", "tandem:num_requests_waiting", "tandem:kv_cache_usage_perc",
    "tandem:prefix_cache_queries", "tandem:prefix_cache_hits", "tandem:kv_transfer_seconds",
    "tandem:kv_transfer_bytes", "tandem:spec_decode_draft_tokens",
    "tandem:spec_decode_accepted_tokens", "tandem:pool_size", "tandem:pool_target",
    "tandem:pool_workers_by_role", "tandem:request_migrations", "tandem:requests", "tandem:requests_shed",
    *(f"tandem:{name}" for name in _MOVE_COUNTERS),
)


@dataclass(frozen=True)
class WorkerMetricsSnapshot:
    """One worker's numbers at one moment. Counters (cumulative since the worker started) are
    marked; the rest are gauges. Plain data: it crosses Ray as a pickled dataclass or `asdict`."""

    worker_id: str
    pool: str  # "prefill" or "decode"
    incarnation: str = ""  # changes when the worker restarts (e.g. "pid@start_time")
    started_at: float = 0.0  # unix time the worker's counters started from; 0: unknown
    running: int = 0
    waiting: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    prefix_queries: int = 0  # counter, tokens looked up in the prefix cache
    prefix_hits: int = 0  # counter, tokens found there
    kv_transfer_bytes: int = 0  # counter
    kv_transfer_count: int = 0  # counter, transfers finished
    kv_transfer_seconds_sum: float = 0.0  # counter
    # counter, per upper bound in KV_TRANSFER_BUCKETS: transfers that took <= that bound
    # (cumulative, like Prometheus buckets); empty when the worker does not time transfers.
    kv_transfer_seconds_buckets: tuple[int, ...] = ()
    draft_tokens: int = 0  # counter
    accepted_tokens: int = 0  # counter
    sequences_migrated: int = 0  # counter: sent to another decode worker with their KV
    kv_tokens_migrated: int = 0  # counter
    tokens_recomputed: int = 0  # counter: positions of moved requests computed again
    kv_tokens_precopied: int = 0  # counter: of kv_tokens_migrated, sent before the pause
    move_precopy_seconds: float = 0.0  # counter: the moves' pre-copies, summed
    move_tail_seconds: float = 0.0  # counter: their tails (sent once paused), summed
    sequences_migrated_in: int = 0  # counter: taken from another decode worker with their KV
    pressure_moves: int = 0  # counter: moved out because the KV cache was about to preempt one
    migrations_resumed: int = 0  # counter: paused to move, then resumed (nowhere could take them)

    @classmethod
    def from_dict(cls, d: dict) -> "WorkerMetricsSnapshot":
        d = dict(d)
        d["kv_transfer_seconds_buckets"] = tuple(d.get("kv_transfer_seconds_buckets", ()))
        return cls(**d)

    @classmethod
    def from_worker_stats(cls, w: WorkerEntry) -> "WorkerMetricsSnapshot":
        """A worker as the controller's cluster state carries it (its pid and latest stats) in the
        hub's terms."""
        s = w.load()
        return cls(
            worker_id=w.worker_id, pool=w.pool, incarnation=str(w.pid or ""),
            running=s.running, waiting=s.waiting, kv_blocks_used=s.kv_blocks_used, kv_blocks_total=s.kv_blocks_total,
            prefix_queries=s.prefix_queries, prefix_hits=s.prefix_hits, kv_transfer_bytes=s.kv_transfer_bytes,
            kv_transfer_count=s.kv_transfer_count, kv_transfer_seconds_sum=s.kv_transfer_seconds,
            kv_transfer_seconds_buckets=tuple(s.kv_transfer_seconds_buckets),
            draft_tokens=s.draft_tokens, accepted_tokens=s.accepted_draft_tokens,
            **{name: getattr(s, name) for name in _MOVE_COUNTERS})

    @property
    def kv_cache_usage(self) -> float:
        return self.kv_blocks_used / self.kv_blocks_total if self.kv_blocks_total else 0.0


_COUNTER_FIELDS = ("prefix_queries", "prefix_hits", "kv_transfer_bytes", "kv_transfer_count",
                   "kv_transfer_seconds_sum", "draft_tokens", "accepted_tokens", *_MOVE_COUNTERS)


class TransferTimes:
    """One worker's KV transfer durations as histogram counters (cumulative since it started):
    how many, their sum, and how many fell in each KV_TRANSFER_BUCKETS bucket. Workers record
    each finished transfer and ship `stats()` in their stats; the hub turns the deltas into
    `tandem:kv_transfer_seconds`."""

    def __init__(self) -> None:
        self.count = 0
        self.seconds = 0.0
        self._buckets = [0] * len(KV_TRANSFER_BUCKETS)  # non-cumulative; a slower one is only in count

    def record(self, seconds: float) -> None:
        self.count += 1
        self.seconds += seconds
        i = bisect.bisect_left(KV_TRANSFER_BUCKETS, seconds)
        if i < len(self._buckets):
            self._buckets[i] += 1

    def cumulative_buckets(self) -> tuple[int, ...]:
        """Transfers that took <= each bound, like Prometheus buckets."""
        return tuple(itertools.accumulate(self._buckets))

    def stats(self) -> dict:
        """The worker-stats keys `WorkerMetricsSnapshot.from_worker_stats` reads."""
        return {"kv_transfer_count": self.count, "kv_transfer_seconds": self.seconds,
                "kv_transfer_seconds_buckets": list(self.cumulative_buckets())}


class WorkerCounters:
    """What a worker keeps to fill its snapshots: cumulative counters, updated in place."""

    def __init__(self, worker_id: str, pool: str, incarnation: str = "",
                 started_at: float | None = None) -> None:
        self.worker_id, self.pool, self.incarnation = worker_id, pool, incarnation
        self.started_at = time.time() if started_at is None else started_at
        self.prefix_queries = self.prefix_hits = 0
        self.kv_transfer_bytes = 0
        self.transfers = TransferTimes()
        self.draft_tokens = self.accepted_tokens = 0

    def record_prefix_lookup(self, queried_tokens: int, hit_tokens: int) -> None:
        self.prefix_queries += queried_tokens
        self.prefix_hits += hit_tokens

    def record_transfer(self, seconds: float, num_bytes: int) -> None:
        self.kv_transfer_bytes += num_bytes
        self.transfers.record(seconds)

    def record_speculation(self, draft_tokens: int, accepted_tokens: int) -> None:
        self.draft_tokens += draft_tokens
        self.accepted_tokens += accepted_tokens

    def snapshot(self, *, running: int, waiting: int, kv_blocks_used: int,
                 kv_blocks_total: int) -> WorkerMetricsSnapshot:
        return WorkerMetricsSnapshot(
            worker_id=self.worker_id, pool=self.pool, incarnation=self.incarnation,
            started_at=self.started_at,
            running=running, waiting=waiting, kv_blocks_used=kv_blocks_used,
            kv_blocks_total=kv_blocks_total, prefix_queries=self.prefix_queries,
            prefix_hits=self.prefix_hits, kv_transfer_bytes=self.kv_transfer_bytes,
            kv_transfer_count=self.transfers.count, kv_transfer_seconds_sum=self.transfers.seconds,
            kv_transfer_seconds_buckets=self.transfers.cumulative_buckets(),
            draft_tokens=self.draft_tokens, accepted_tokens=self.accepted_tokens)


class _TransferHistogram:
    """`tandem:kv_transfer_seconds` as a collector: a histogram summed from workers' deltas."""

    name = "tandem:kv_transfer_seconds"

    def __init__(self) -> None:
        self.buckets = [0.0] * len(KV_TRANSFER_BUCKETS)  # cumulative, like the exposition
        self.count = 0.0
        self.sum = 0.0
        self._lock = threading.Lock()

    def add(self, buckets: Sequence[float], count: float, seconds: float) -> None:
        with self._lock:
            if len(buckets) == len(self.buckets):
                self.buckets = [a + b for a, b in zip(self.buckets, buckets)]
            self.count += count
            self.sum += seconds

    def collect(self):
        with self._lock:
            family = HistogramMetricFamily(
                self.name, "Time to move one request's KV from a prefill to a decode worker.")
            pairs = [(_le(b), n) for b, n in zip(KV_TRANSFER_BUCKETS, self.buckets)]
            family.add_metric([], pairs + [("+Inf", self.count)], self.sum)
        yield family

    def describe(self):
        return self.collect()


def _le(bound: float) -> str:
    return repr(float(bound))


@dataclass
class _WorkerBaseline:
    incarnation: str
    counters: dict[str, float]
    buckets: tuple[int, ...]


class MetricsHub:
    """Every Tandem metric, on one registry. Thread-safe (prometheus_client objects are)."""

    def __init__(self, registry: CollectorRegistry | None = None,
                 wall_clock: Callable[[], float] = time.time) -> None:
        # Workers that started before this hub (it restarted under them) are not counted from
        # zero at first sight: their history would land in one scrape as a spike.
        self._started_at = wall_clock()
        r = self.registry = registry if registry is not None else CollectorRegistry()
        self.ttft = Histogram("tandem:time_to_first_token_seconds",
                              "From the request reaching the router to its first token.",
                              buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram("tandem:inter_token_latency_seconds",
                             "Gap between consecutive output tokens, per token.",
                             buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram("tandem:e2e_request_latency_seconds",
                             "From the request reaching the router to its last message.",
                             buckets=E2E_BUCKETS, registry=r)
        self.queue_time = Histogram("tandem:request_queue_time_seconds",
                                    "Time a request waited for admission in the router.",
                                    buckets=QUEUE_BUCKETS, registry=r)
        self.running = Gauge("tandem:num_requests_running", "Requests running, by pool.",
                             ["pool"], registry=r)
        self.waiting = Gauge("tandem:num_requests_waiting", "Requests queued, by pool.",
                             ["pool"], registry=r)
        self.kv_usage = Gauge("tandem:kv_cache_usage_perc",
                              "Fraction of a worker's KV blocks in use (0-1).",
                              ["pool", "worker"], registry=r)
        self.prefix_queries = Counter("tandem:prefix_cache_queries",
                                      "Prompt tokens looked up in prefix caches.", ["pool"], registry=r)
        self.prefix_hits = Counter("tandem:prefix_cache_hits",
                                   "Prompt tokens found in prefix caches.", ["pool"], registry=r)
        self.kv_transfer = _TransferHistogram()
        r.register(self.kv_transfer)
        self.kv_transfer_bytes = Counter("tandem:kv_transfer_bytes",
                                         "Bytes of KV moved from prefill to decode workers.",
                                         registry=r)
        self.draft_tokens = Counter("tandem:spec_decode_draft_tokens",
                                    "Speculative tokens proposed.", registry=r)
        self.accepted_tokens = Counter("tandem:spec_decode_accepted_tokens",
                                       "Speculative tokens the verifier kept.", registry=r)
        self.pool_size = Gauge("tandem:pool_size", "Live workers, draining included, by pool.",
                               ["pool"], registry=r)
        self.pool_target = Gauge("tandem:pool_target", "The autoscaler's target, by pool.",
                                 ["pool"], registry=r)
        self.workers_by_role = Gauge("tandem:pool_workers_by_role",
                                     "Live workers of a pool by what they serve now (prefill, decode, mixed).",
                                     ["pool", "role"], registry=r)
        self.moves = {k: Counter(f"tandem:{k}", doc, ["pool", "worker"], registry=r) for k, doc in _MOVE_COUNTERS.items()}
        self.migrations = Counter("tandem:request_migrations",
                                  "Requests moved to another worker mid-flight, by reason.",
                                  ["reason"], registry=r)
        self.requests = Counter("tandem:requests",
                                "Finished requests, by finish reason and gRPC status code.",
                                ["finish_reason", "code"], registry=r)
        self.shed = Counter("tandem:requests_shed",
                            "Requests refused with RESOURCE_EXHAUSTED before they ran, by reason: admission "
                            "(the router's limiter), worker_overload (router.worker_max_*), batch_guard (no "
                            "decode batch with room within the TPOT SLO).", ["reason"], registry=r)
        self._baselines: dict[str, _WorkerBaseline] = {}
        self._lock = threading.Lock()

    # --- the router's own observations --------------------------------------------------------

    def record_queue_time(self, seconds: float) -> None:
        self.queue_time.observe(seconds)

    def record_first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def record_tokens(self, gap_seconds: float, num_tokens: int) -> None:
        """A message brought `num_tokens` new tokens `gap_seconds` after the previous one."""
        if num_tokens > 0:
            per_token = gap_seconds / num_tokens
            for _ in range(num_tokens):
                self.itl.observe(per_token)

    def record_finished(self, *, code: str, finish_reason: str, e2e_seconds: float | None) -> None:
        """`code`: the gRPC status name ("OK", "CANCELLED", ...); finish_reason: "stop",
        "length", "abort", or "none" for requests that ended before a finish reason."""
        self.requests.labels(finish_reason=finish_reason.lower(), code=code.upper()).inc()
        if e2e_seconds is not None:
            self.e2e.observe(e2e_seconds)

    def record_shed(self, reason: str) -> None:
        self.shed.labels(reason=reason).inc()

    def record_migration(self, reason: str) -> None:
        self.migrations.labels(reason=reason).inc()

    def set_router_queue(self, running: int, waiting: int) -> None:
        self.running.labels(pool="router").set(running)
        self.waiting.labels(pool="router").set(waiting)

    def set_pool(self, pool: str, size: int, target: int, roles: dict[str, int] | None = None) -> None:
        """`roles`: the pool's workers by role (a worker lent to the other role counts in its pool)."""
        self.pool_size.labels(pool=pool).set(size)
        self.pool_target.labels(pool=pool).set(target)
        for role in ("prefill", "decode", "mixed"):
            self.workers_by_role.labels(pool=pool, role=role).set((roles or {}).get(role, 0))

    # --- workers' reports ---------------------------------------------------------------------

    def update_from_workers(self, snapshots: Iterable[WorkerMetricsSnapshot | dict]) -> None:
        """Take the current reports of all live workers: gauges are set (workers missing from
        the list drop out of them), counters advance by what each worker added since its last
        report."""
        snaps = [s if isinstance(s, WorkerMetricsSnapshot) else WorkerMetricsSnapshot.from_dict(s)
                 for s in snapshots]
        with self._lock:
            running = {p: 0 for p in ("prefill", "decode")}
            waiting = dict(running)
            for s in snaps:
                running[s.pool] = running.get(s.pool, 0) + s.running
                waiting[s.pool] = waiting.get(s.pool, 0) + s.waiting
                self._advance(s)
            for pool in running:
                self.running.labels(pool=pool).set(running[pool])
                self.waiting.labels(pool=pool).set(waiting[pool])
            live = {(s.pool, s.worker_id) for s in snaps}
            for labels in list(self._kv_usage_labels()):
                if labels not in live:
                    self.kv_usage.remove(*labels)
            for s in snaps:
                self.kv_usage.labels(pool=s.pool, worker=s.worker_id).set(s.kv_cache_usage)

    def _kv_usage_labels(self):
        for metric in self.kv_usage.collect():
            for sample in metric.samples:
                yield sample.labels["pool"], sample.labels["worker"]

    def _advance(self, s: WorkerMetricsSnapshot) -> None:
        now = {name: getattr(s, name) for name in _COUNTER_FIELDS}
        base = self._baselines.get(s.worker_id)
        if base is None and 0 < s.started_at < self._started_at:
            base = _WorkerBaseline(s.incarnation, now, tuple(s.kv_transfer_seconds_buckets))
        restarted = base is None or base.incarnation != s.incarnation or any(
            now[k] < base.counters[k] for k in _COUNTER_FIELDS) or any(
            a < b for a, b in zip(s.kv_transfer_seconds_buckets, base.buckets))
        old = dict.fromkeys(_COUNTER_FIELDS, 0) if restarted else base.counters
        old_buckets = (0,) * len(s.kv_transfer_seconds_buckets) if restarted else base.buckets
        d = {k: now[k] - old[k] for k in _COUNTER_FIELDS}
        if d["prefix_queries"] or d["prefix_hits"]:
            self.prefix_queries.labels(pool=s.pool).inc(d["prefix_queries"])
            self.prefix_hits.labels(pool=s.pool).inc(d["prefix_hits"])
        self.kv_transfer_bytes.inc(d["kv_transfer_bytes"])
        self.draft_tokens.inc(d["draft_tokens"])
        self.accepted_tokens.inc(d["accepted_tokens"])
        for k, counter in self.moves.items():
            if d[k]:
                counter.labels(pool=s.pool, worker=s.worker_id).inc(d[k])
        if d["kv_transfer_count"] or d["kv_transfer_seconds_sum"]:
            buckets = s.kv_transfer_seconds_buckets
            delta_buckets = [a - b for a, b in zip(buckets, old_buckets)] if len(
                old_buckets) == len(buckets) else list(buckets)
            self.kv_transfer.add(delta_buckets, d["kv_transfer_count"], d["kv_transfer_seconds_sum"])
        self._baselines[s.worker_id] = _WorkerBaseline(
            s.incarnation, now, tuple(s.kv_transfer_seconds_buckets))

    def forget_worker(self, worker_id: str) -> None:
        """Drop a dead worker's baseline (its counts so far stay in the totals)."""
        with self._lock:
            self._baselines.pop(worker_id, None)


_hub: MetricsHub | None = None
_hub_lock = threading.Lock()


def get_hub() -> MetricsHub:
    """The process's hub (made on first use): what the router and controller record on."""
    global _hub
    with _hub_lock:
        if _hub is None:
            _hub = MetricsHub()
        return _hub


def start_metrics_server(port: int = 0, host: str = "127.0.0.1",
                         registry: CollectorRegistry | None = None,
                         verify: Callable[[str], bool] | None = None) -> int:
    """Serve `registry` (default: `get_hub()`'s) as Prometheus text on http://host:port/metrics
    from a daemon thread. Port 0 picks a free port; returns the port actually bound. In a pod,
    pass host="0.0.0.0" so Prometheus can reach it. `verify`: /metrics only for a request whose
    `Authorization: Bearer <token>` it accepts (401 otherwise; Prometheus: `authorization:
    {credentials_file: ...}` in the scrape config)."""
    if not 0 <= port < 65536:
        raise ValueError(f"metrics port must be in [0, 65535], got {port}")
    registry = registry if registry is not None else get_hub().registry
    if verify is None:
        server, _thread = start_http_server(port, addr=host, registry=registry)
        return server.server_address[1]
    httpd = make_server(host, port, _behind_token(make_wsgi_app(registry), verify), ThreadingWSGIServer,
                        handler_class=_SilentHandler)
    threading.Thread(target=httpd.serve_forever, daemon=True, name="metrics").start()
    return httpd.server_address[1]


def _behind_token(app, verify: Callable[[str], bool]):
    def guarded(environ, start_response):
        scheme, _, token = environ.get("HTTP_AUTHORIZATION", "").strip().partition(" ")
        if scheme.lower() != "bearer" or not token.strip() or not verify(token.strip()):
            start_response("401 Unauthorized", [("Content-Type", "text/plain"), ("WWW-Authenticate", "Bearer")])
            return [b"/metrics needs 'Authorization: Bearer <admin token>'\n"]
        return app(environ, start_response)
    return guarded
