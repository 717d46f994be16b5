"""What-if simulator: replay a workload against N prefill and M decode workers, without GPUs.

A discrete-event simulation of Tandem's request path, with service times from a fitted `PerfModel`:

1. A request arrives; the router picks a decode worker: the session's own (unless it is draining
   or the request would queue there), else the one with the most of the prompt cached, then the
   least loaded.
2. It waits there (FIFO) for a batch slot and KV for prompt + output; the prompt's cached prefix
   (an LRU per worker, by session or by block hash) is reused, not reserved again.
3. Uncached part <= `local_prefill_threshold` (or no prefill workers, or every prefill worker holds
   `prefill_queue_limit` prompt tokens not yet delivered and the decode worker's own queue of
   prefills is the shorter, the router's rule): the decode worker prefills it itself, in chunks
   inside its steps. Otherwise the prefill worker with the earliest estimated
   finish (its queue plus the work its own cache leaves) computes it FIFO, and streams the KV layer
   by layer, so the KV is ready at max(compute end, compute start + transfer time). That is the
   first token. (`pull_prefix`: what if the prefill worker received the decode worker's cached
   prefix instead of recomputing what its own cache lacks.)
4. Decode workers run continuous-batching steps, one token per running sequence per step.

Outputs per-request TTFT/TPOT/e2e and a summary; `sweep` tries every prefill:decode split of a
worker budget plus the colocated mode. With an `AutoscalerConfig` the policy in cluster.autoscaler
runs every period on a snapshot built from the simulation; new workers start after a delay.
Everything is deterministic for a given workload and seed (the seed only breaks routing ties).
"""

from __future__ import annotations

import dataclasses
import heapq
import math
import random
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Protocol, Sequence

import numpy as np

from tandem.cluster.autoscaler import (AutoscalerConfig, DecodeMetrics, MetricsSnapshot, PolicyState,
                                PrefillMetrics, decide)
from tandem.runtime.latency import LatencyWindow
from tandem.wire.errors import ConfigError


class RequestLike(Protocol):  # cluster.workloads.RequestSpec has these fields
    session_id: str
    turn: int
    arrival_s: float
    input_tokens: int
    output_tokens: int
    shared_prefix_tokens: int
    hash_ids: tuple[int, ...]
    hash_block_tokens: int


@dataclass(frozen=True)
class PerfModel:
    """Fitted service times. Defaults: an ASSUMED Llama-3-8B on one H200 (bf16), see docs/operations.md.

    prefill s     = prefill_base_s + prefill_per_token_s * n + prefill_attn_s * n * context
                    (n: tokens computed, context: prompt length once they are in)
    decode step s = decode_base_s + decode_per_seq_s * batch + decode_per_ctx_token_s * sum(context)
    transfer s    = transfer_base_s + transfer_per_token_s * tokens
    control path  = request_overhead_s on every request's client-visible times (router, actor
                    RPCs, streaming), + remote_overhead_s before a remote prefill's KV is usable
                    (RPCs to the prefill actor, the decode step after the KV lands); both fitted
                    on a running cluster by `tandem profile --target` (fit_control_path)
    """
    prefill_base_s: float = 0.005
    prefill_per_token_s: float = 1 / 12000
    prefill_attn_s: float = 1.3e-9
    decode_base_s: float = 0.012
    decode_per_seq_s: float = 1e-4
    decode_per_ctx_token_s: float = 3e-8
    transfer_base_s: float = 0.0005
    transfer_per_token_s: float = 2.6e-6
    request_overhead_s: float = 0.0
    remote_overhead_s: float = 0.0
    local_prefill_threshold: float = 256  # uncached tokens a decode worker prefills itself
    # prefill.max_queued_tokens: prompt tokens queued on a prefill worker past which requests are
    # prefilled by their decode worker instead (the router's rule); inf: always remote
    prefill_queue_limit: float = math.inf
    max_batch: int = 256  # sequences per decode worker
    max_step_tokens: int = 2048  # tokens per decode step (decodes + local prefill chunks)
    kv_capacity_tokens: int = 700_000  # KV per worker (decode: running + prefix cache)
    block_tokens: int = 16  # prefix-cache granularity

    def __post_init__(self) -> None:
        coeffs = ("prefill_base_s", "prefill_per_token_s", "prefill_attn_s", "decode_base_s",
                  "decode_per_seq_s", "decode_per_ctx_token_s", "transfer_base_s", "transfer_per_token_s",
                  "request_overhead_s", "remote_overhead_s")
        if any(getattr(self, c) < 0 for c in coeffs) or self.local_prefill_threshold < 0:
            raise ConfigError("perf model: coefficients and local_prefill_threshold must be >= 0")
        if not self.prefill_queue_limit > 0:
            raise ConfigError("perf model: prefill_queue_limit must be > 0 (inf: no limit)")
        if min(self.max_batch, self.max_step_tokens, self.kv_capacity_tokens, self.block_tokens) < 1:
            raise ConfigError("perf model: max_batch, max_step_tokens, kv_capacity_tokens and "
                              "block_tokens must be >= 1")

    def prefill_s(self, n: int, context: int) -> float:
        if not n:
            return 0.0
        return self.prefill_base_s + n * (self.prefill_per_token_s + self.prefill_attn_s * context)

    def decode_step_s(self, batch: int, context_tokens: int) -> float:
        return (self.decode_base_s + self.decode_per_seq_s * batch
                + self.decode_per_ctx_token_s * context_tokens)

    def transfer_s(self, tokens: int) -> float:
        return self.transfer_base_s + self.transfer_per_token_s * tokens if tokens else 0.0

    @classmethod
    def fit(cls, samples: Iterable[tuple[str, Sequence[float] | dict[str, float], float]],
            base: "PerfModel | None" = None, **fixed: Any) -> "PerfModel":
        """Least squares from profiling samples `(kind, features, seconds)`:
        ("prefill", (new_tokens, context), s), ("decode", (batch_size, total_context_tokens), s),
        ("transfer", (tokens,), s); features may also be dicts with those names. Kinds without
        samples keep `base`'s coefficients; negative fits are clipped to 0; `fixed` sets the rest."""
        names = {"prefill": ("new_tokens", "context"), "decode": ("batch_size", "total_context_tokens"),
                 "transfer": ("tokens",)}
        rows: dict[str, list[tuple[list[float], float]]] = {k: [] for k in names}
        for kind, feats, seconds in samples:
            if kind not in names:
                raise ValueError(f"unknown sample kind {kind!r}; expected one of {sorted(names)}")
            f = [feats[n] for n in names[kind]] if isinstance(feats, dict) else list(feats)
            x = {"prefill": lambda: [1.0, f[0], f[0] * f[1]],
                 "decode": lambda: [1.0, f[0], f[1]],
                 "transfer": lambda: [1.0, f[0]]}[kind]()
            rows[kind].append((x, float(seconds)))
        fields = {"prefill": ("prefill_base_s", "prefill_per_token_s", "prefill_attn_s"),
                  "decode": ("decode_base_s", "decode_per_seq_s", "decode_per_ctx_token_s"),
                  "transfer": ("transfer_base_s", "transfer_per_token_s")}
        values: dict[str, Any] = {}
        for kind, data in rows.items():
            if not data:
                continue
            a = np.array([x for x, _ in data], dtype=np.float64)
            y = np.array([s for _, s in data], dtype=np.float64)
            scale = np.maximum(np.abs(a).max(axis=0), 1e-30)  # columns span 1 .. 1e9: normalize
            coef = np.linalg.lstsq(a / scale, y, rcond=None)[0] / scale
            values.update({name: max(0.0, float(c)) for name, c in zip(fields[kind], coef)})
        return dataclasses.replace(base or cls(), **values, **fixed)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        for key in _MAYBE_INF:
            if math.isinf(d[key]):
                d[key] = "inf"  # JSON has no infinity
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "PerfModel":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise ConfigError(f"perf model: unknown key(s) {sorted(unknown)}")
        d = dict(d)
        for key in _MAYBE_INF:
            if isinstance(d.get(key), str):
                d[key] = float(d[key])
        return cls(**d)


_MAYBE_INF = ("local_prefill_threshold", "prefill_queue_limit")


@dataclass(frozen=True)
class SLO:
    ttft_s: float = 2.0
    tpot_s: float = 0.05


@dataclass(frozen=True)
class RequestResult:
    session_id: str
    turn: int
    arrival_s: float
    input_tokens: int
    output_tokens: int
    cached_tokens: int  # prompt tokens not computed (prefix-cache hits)
    prefill: str  # "remote" | "local" | "rejected" (prompt + output exceed a worker's KV)
    ttft_s: float | None
    tpot_s: float | None  # None when output_tokens == 1 or rejected
    e2e_s: float | None


@dataclass(frozen=True)
class PoolSample:
    time_s: float
    prefill_live: int
    decode_live: int
    prefill_target: int
    decode_target: int
    prefill_draining: int = 0
    decode_draining: int = 0


@dataclass(frozen=True)
class SimSummary:
    label: str
    prefill: int  # initial pool sizes (colocated: prefill 0)
    decode: int
    requests: int
    rejected: int
    ttft_p50: float
    ttft_p90: float
    ttft_p99: float
    tpot_p50: float
    tpot_p90: float
    tpot_p99: float
    e2e_p50: float
    e2e_p90: float
    goodput_rps: float  # requests meeting both SLOs per second of the run
    slo_attainment: float  # fraction of requests meeting both SLOs
    cached_token_ratio: float
    output_tok_s: float
    duration_s: float
    mean_workers: float  # time-averaged live workers of both pools


@dataclass
class SimResult:
    summary: SimSummary
    requests: list[RequestResult]
    pool_sizes: list[PoolSample] = field(default_factory=list)


class PrefixCache:
    """LRU prefix cache of one worker, in tokens. A session entry holds how many leading tokens of
    the session's context are cached; a hash entry is one `hash_block_tokens` block. Entries that a
    running sequence uses are pinned: never evicted until it finishes."""

    def __init__(self, block_tokens: int):
        self.block_tokens = block_tokens
        self.entries: OrderedDict[tuple, int] = OrderedDict()
        self.pins: dict[tuple, int] = {}
        self.tokens = 0

    def hit(self, r: RequestLike) -> int:
        if r.hash_ids:
            n = 0
            while n < len(r.hash_ids) and ("h", r.hash_ids[n]) in self.entries:
                n += 1
            # the last prompt token is always computed: its logits give the first output token
            return min(n * r.hash_block_tokens, r.input_tokens - 1)
        cached = min(self.entries.get(("s", r.session_id), 0), r.shared_prefix_tokens, r.input_tokens - 1)
        return cached // self.block_tokens * self.block_tokens

    def keys(self, r: RequestLike) -> list[tuple]:
        return [("h", h) for h in r.hash_ids] if r.hash_ids else [("s", r.session_id)]

    def hit_keys(self, r: RequestLike, hit: int) -> list[tuple]:
        """The entries that hold the first `hit` tokens of `r` (what a hit uses)."""
        if not hit:
            return []
        return [("h", h) for h in r.hash_ids[:math.ceil(hit / r.hash_block_tokens)]] if r.hash_ids \
            else [("s", r.session_id)]

    def pin(self, keys: list[tuple]) -> None:
        for k in keys:
            self.pins[k] = self.pins.get(k, 0) + 1
            self.entries.move_to_end(k)

    def unpin(self, keys: list[tuple]) -> None:
        for k in keys:
            self.pins[k] -= 1
            if not self.pins[k]:
                del self.pins[k]

    def store(self, r: RequestLike, context_tokens: int) -> None:
        """Cache `context_tokens` of this request's sequence (most recently used)."""
        if r.hash_ids:
            for k in self.keys(r):
                if k not in self.entries:
                    self.entries[k] = r.hash_block_tokens
                    self.tokens += r.hash_block_tokens
                self.entries.move_to_end(k)
            return
        k = ("s", r.session_id)
        self.tokens += context_tokens - self.entries.get(k, 0)
        self.entries[k] = context_tokens
        self.entries.move_to_end(k)

    def evict_to(self, limit: int) -> None:
        """Evict least recently used, unpinned entries until at most `limit` tokens are cached."""
        if self.tokens <= limit:
            return
        for k in [k for k in self.entries if k not in self.pins]:
            self.tokens -= self.entries.pop(k)
            if self.tokens <= limit:
                return


class _Seq:
    __slots__ = ("spec", "idx", "arrival_s", "decode", "reserved", "pinned", "cached", "kind",
                 "prefill_left", "context", "generated", "first_token_s", "finish_s")

    def __init__(self, spec: RequestLike, idx: int):
        self.spec, self.idx, self.arrival_s = spec, idx, spec.arrival_s
        self.decode: _DecodeWorker | None = None
        self.pinned: list[tuple] = []  # decode-cache entries this sequence uses
        self.reserved = self.cached = self.prefill_left = self.context = self.generated = 0
        self.kind = "rejected"
        self.first_token_s: float | None = None
        self.finish_s: float | None = None


class _Worker:
    def __init__(self, wid: int, ready_s: float, block_tokens: int):
        self.wid, self.ready_s = wid, ready_s
        self.up = False  # started
        self.accepting = False  # started and not draining
        self.draining = False
        self.gone = False
        self.pending = False  # created past max_workers: waits for a slot before it starts
        self.cache = PrefixCache(block_tokens)


class _PrefillWorker(_Worker):
    def __init__(self, *a: Any):
        super().__init__(*a)
        self.free_s = 0.0
        self.jobs: deque[tuple[float, float, int]] = deque()  # (start, end, tokens), FIFO
        self.queued: deque[tuple[float, int]] = deque()      # (KV delivered at, prompt tokens)
        self.queued_tokens = 0

    def idle(self, now: float) -> bool:
        return self.free_s <= now


class _DecodeWorker(_Worker):
    def __init__(self, *a: Any):
        super().__init__(*a)
        self.waiting: deque[_Seq] = deque()  # routed here, not admitted
        self.local: list[_Seq] = []  # admitted, prefilling here in chunks
        self.running: list[_Seq] = []
        self.awaiting_kv = 0  # admitted, remote prefill in flight
        self.reserved = 0  # KV tokens reserved by admitted sequences, beyond their cached prefix
        self.held = 0  # KV tokens admitted sequences use, cached prefix included (what "used" means)
        self.stepping = False

    def slots_used(self) -> int:
        return len(self.running) + len(self.local) + self.awaiting_kv

    def load(self) -> int:
        return self.slots_used() + len(self.waiting)

    def saturated(self, max_batch: int) -> bool:
        return bool(self.waiting) or self.slots_used() >= max_batch

    def idle(self, now: float) -> bool:
        return not (self.load() or self.stepping)


_LATENCY_WINDOW_S = LatencyWindow().window_s     # the workers' TTFT / TPOT window


def _pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else math.nan


class _Simulation:
    def __init__(self, requests: Sequence[RequestLike], prefill: int, decode: int, perf: PerfModel,
                 slo: SLO, autoscaler: AutoscalerConfig | None, seed: int, colocated: bool,
                 worker_startup_s: float, closed_loop: bool, pull_prefix: bool,
                 send_until_s: float | Mapping[str, float] | None = None,
                 max_workers: int | None = None):
        self.perf, self.slo, self.cfg = perf, slo, autoscaler
        self.send_until_s = send_until_s
        self.max_workers = max_workers
        self.slot_queue: deque[_Worker] = deque()  # created past max_workers, oldest first
        self.unsent: set[int] = set()  # seq indices a closed-loop session never sent (due too late)
        self.pull_prefix = pull_prefix
        self.colocated = colocated
        self.threshold = math.inf if colocated else perf.local_prefill_threshold
        self.startup_s = worker_startup_s
        self.rng = random.Random(seed)
        self.events: list[tuple[float, int, str, Any]] = []
        self.counter = 0
        self.seqs = [_Seq(r, i) for i, r in enumerate(sorted(requests, key=lambda r: r.arrival_s))]
        # closed loop: a session's next turn is sent `think_s` after its previous turn finished
        self.next_turns: dict[str, deque[_Seq]] | None = None
        if closed_loop:
            self.next_turns = {}
            for s in sorted(self.seqs, key=lambda s: (s.spec.turn, s.arrival_s)):
                self.next_turns.setdefault(s.spec.session_id, deque()).append(s)
        self.prefills: list[_PrefillWorker] = []
        self.decodes: list[_DecodeWorker] = []
        self.session_decode: dict[str, _DecodeWorker] = {}
        self.done = 0
        self.samples: list[PoolSample] = []
        self.policy = PolicyState()
        # for the autoscaler's snapshot: (time, value) within the window
        self.recent_ttft: deque[tuple[float, float]] = deque()  # prefill pool's part of TTFT
        self.recent_tpot: deque[tuple[float, float]] = deque()
        self.recent_prefill: deque[tuple[float, int, int]] = deque()  # (time, tokens, context)
        for _ in range(0 if colocated else prefill):
            self._add_worker(self.prefills, _PrefillWorker, 0.0, started=True)
        for _ in range(decode):
            self._add_worker(self.decodes, _DecodeWorker, 0.0, started=True)

    # -- events ----------------------------------------------------------------------------------
    def push(self, t: float, kind: str, payload: Any = None) -> None:
        self.counter += 1
        heapq.heappush(self.events, (t, self.counter, kind, payload))

    def run(self) -> None:
        first = self.seqs if self.next_turns is None else [q.popleft() for q in self.next_turns.values()]
        for s in first:
            self.push(s.arrival_s, "arrive", s)
        if self.cfg is not None and self.seqs:
            self.push(self.seqs[0].spec.arrival_s, "control")
        while self.events:
            now, _, kind, payload = heapq.heappop(self.events)
            getattr(self, "_on_" + kind)(now, payload)

    def _add_worker(self, pool: list, cls: type, now: float, started: bool = False) -> None:
        w = cls(len(pool), now + (0.0 if started else self.startup_s), self.perf.block_tokens)
        if started:
            w.up = w.accepting = True
        elif self.max_workers is not None and self._slots_held() >= self.max_workers:
            w.pending = True  # like a Ray actor asking for a GPU that no node has free
            self.slot_queue.append(w)
        else:
            self.push(w.ready_s, "ready", w)
        pool.append(w)

    def _slots_held(self) -> int:
        return sum(not w.gone and not w.pending for w in self.prefills + self.decodes)

    def _start_pending(self, now: float) -> None:
        """Workers waiting for a slot start, oldest first, as drained workers free theirs."""
        while self.slot_queue and self._slots_held() < self.max_workers:
            w = self.slot_queue.popleft()
            if not w.gone:
                w.pending, w.ready_s = False, now + self.startup_s
                self.push(w.ready_s, "ready", w)

    def _on_ready(self, now: float, w: _Worker) -> None:
        if w.gone:
            return
        w.up, w.accepting = True, not w.draining
        if isinstance(w, _DecodeWorker):
            self._admit(w, now)

    def _on_arrive(self, now: float, s: _Seq) -> None:
        r = s.spec
        decodes = [w for w in self.decodes if w.accepting] or [w for w in self.decodes if not w.gone]
        if r.input_tokens + r.output_tokens > self.perf.kv_capacity_tokens or not decodes:
            s.kind = "rejected"
            self._retire(now, s)
            return
        # the session's own worker unless it is draining or would make the request queue; else the
        # most of the prompt cached among those with room, then the least loaded
        own = self.session_decode.get(r.session_id)
        if own is None or not own.accepting or own.saturated(self.perf.max_batch):
            free = [w for w in decodes if not w.saturated(self.perf.max_batch)] or decodes
            own = max(free, key=lambda w: (w.cache.hit(r), -w.load(), self.rng.random()))
        self.session_decode[r.session_id] = own
        s.decode = own
        own.waiting.append(s)
        self._admit(own, now)

    def _admit(self, w: _DecodeWorker, now: float) -> None:
        perf = self.perf
        while w.up and w.waiting and w.slots_used() < perf.max_batch:
            s = w.waiting[0]
            r = s.spec
            hit = w.cache.hit(r)
            need = r.input_tokens + r.output_tokens - hit
            pinned = w.cache.hit_keys(r, hit)
            w.cache.pin(pinned)
            w.cache.evict_to(perf.kv_capacity_tokens - w.reserved - need)
            if w.reserved + need + w.cache.tokens > perf.kv_capacity_tokens and w.slots_used():
                w.cache.unpin(pinned)
                return  # KV full: the head of the queue waits for running sequences to finish
            w.waiting.popleft()
            s.pinned = pinned
            w.reserved += need
            w.held += r.input_tokens + r.output_tokens
            s.reserved = need
            uncached = r.input_tokens - hit
            accepting = [p for p in self.prefills if p.accepting]
            prefills = [p for p in accepting if not self._backlogged(p, r.input_tokens, now)]
            if accepting and not prefills and uncached > self.threshold:
                # every prefill worker past the limit: local only while the decode worker's own
                # queue of prefills (prompt tokens, until their first token) is the shorter one
                local_q = sum(x.spec.input_tokens - x.cached for x in w.local if x.prefill_left > 0)
                shortest = min(accepting, key=lambda p: p.queued_tokens)
                if local_q >= shortest.queued_tokens:
                    prefills = [shortest]
            if uncached <= self.threshold or not prefills:
                s.kind, s.cached, s.prefill_left, s.context = "local", hit, uncached, hit
                w.local.append(s)
                self._step_if_idle(w, now)
            else:
                self._send_to_prefill(s, prefills, hit, now)

    def _backlogged(self, p: _PrefillWorker, tokens: int, now: float) -> bool:
        """The router's rule: a prefill worker holding queued or computing prompt tokens gets no
        more once they would pass the limit (an idle one takes any prompt)."""
        limit = self.perf.prefill_queue_limit
        if math.isinf(limit):
            return False
        while p.queued and p.queued[0][0] <= now:     # delivered: off the router's count
            p.queued_tokens -= p.queued.popleft()[1]
        return p.queued_tokens > 0 and p.queued_tokens + tokens > limit

    def _send_to_prefill(self, s: _Seq, prefills: list[_PrefillWorker], decode_hit: int,
                         now: float) -> None:
        r, perf = s.spec, self.perf
        n_in = r.input_tokens

        def work(p: _PrefillWorker) -> tuple[int, float]:
            """(tokens to compute, seconds busy) on `p`: its own cache, or, with pull_prefix, the
            decode worker's cached prefix received over the KV link instead of recomputed."""
            hit = p.cache.hit(r)
            if self.pull_prefix and decode_hit > hit:
                n = n_in - decode_hit
                return n, perf.transfer_s(decode_hit - hit) + perf.prefill_s(n, n_in)
            return n_in - hit, perf.prefill_s(n_in - hit, n_in)
        p = min(prefills, key=lambda p: (max(now, p.free_s) + work(p)[1], self.rng.random()))
        n, busy_s = work(p)
        start = max(now, p.free_s)
        end = start + busy_s
        p.free_s = end
        p.jobs.append((start, end, n))
        p.cache.store(r, n_in)
        p.cache.pin(p.cache.keys(r))  # the newest prompt stays even if it alone is over capacity
        p.cache.evict_to(perf.kv_capacity_tokens)
        p.cache.unpin(p.cache.keys(r))
        self.recent_prefill.append((now, n, n_in))
        s.kind, s.cached = "remote", n_in - n
        s.decode.awaiting_kv += 1
        # layer-by-layer streaming hides the transfer under compute unless it is the slower one
        ready = max(end, start + perf.transfer_s(n_in - decode_hit)) + perf.remote_overhead_s
        p.queued.append((ready, n_in))
        p.queued_tokens += n_in
        self.recent_ttft.append((ready, ready - now))
        self.push(ready, "kv_ready", s)

    def _on_kv_ready(self, now: float, s: _Seq) -> None:
        w = s.decode
        w.awaiting_kv -= 1
        s.context = s.spec.input_tokens
        self._first_token(s, now)
        self._admit(w, now)
        self._step_if_idle(w, now)

    def _first_token(self, s: _Seq, now: float) -> None:
        # the client sees it a control path later; the engine goes on at once
        s.first_token_s, s.generated = now + self.perf.request_overhead_s, 1
        s.context += 1
        if s.spec.output_tokens <= 1:
            self._finish(s, now)
        else:
            s.decode.running.append(s)

    def _step_if_idle(self, w: _DecodeWorker, now: float) -> None:
        if w.stepping or not (w.running or w.local):
            return
        perf = self.perf
        batch = list(w.running)
        dt = perf.decode_step_s(len(batch), sum(s.context for s in batch)) if batch else 0.0
        budget = max(perf.max_step_tokens - len(batch), perf.block_tokens)
        chunks = []
        for s in w.local:  # chunked prefill, FIFO, within the step's token budget
            if budget <= 0:
                break
            n = min(s.prefill_left, budget)
            budget -= n
            chunks.append((s, n))
            dt += n * (perf.prefill_per_token_s + perf.prefill_attn_s * (s.context + n))
        if chunks:
            dt += perf.prefill_base_s
        w.stepping = True
        self.push(now + dt, "step", (w, batch, chunks))

    def _on_step(self, now: float, payload: tuple) -> None:
        w, batch, chunks = payload
        w.stepping = False
        for s in batch:
            s.generated += 1
            s.context += 1
            if s.generated >= s.spec.output_tokens:
                self._finish(s, now)
        if any(s.finish_s is not None for s in batch):
            w.running = [s for s in w.running if s.finish_s is None]
        for s, n in chunks:
            s.prefill_left -= n
            s.context += n
            if s.prefill_left <= 0:
                w.local.remove(s)
                self._first_token(s, now)
        self._admit(w, now)
        self._step_if_idle(w, now)

    def _finish(self, s: _Seq, now: float) -> None:
        w, r = s.decode, s.spec
        s.finish_s = now + self.perf.request_overhead_s       # client-visible, like the first token
        w.reserved -= s.reserved
        w.held -= r.input_tokens + r.output_tokens
        w.cache.unpin(s.pinned)
        w.cache.store(r, r.input_tokens + r.output_tokens)
        w.cache.evict_to(self.perf.kv_capacity_tokens - w.reserved)
        if r.output_tokens > 1:
            self.recent_tpot.append((now, (s.finish_s - s.first_token_s) / (r.output_tokens - 1)))
        self._retire(now, s)

    def _retire(self, now: float, s: _Seq) -> None:
        self.done += 1
        if self.next_turns is not None and self.next_turns.get(s.spec.session_id):
            nxt = self.next_turns[s.spec.session_id].popleft()
            nxt.arrival_s = (s.finish_s or now) + getattr(nxt.spec, "think_s", 0.0)
            until = self.send_until_s
            if isinstance(until, Mapping):
                until = until.get(s.spec.session_id)
            if until is not None and nxt.arrival_s >= until:
                # due past the run's end: neither it nor the session's later turns are sent
                self.unsent.add(id(nxt))
                self.unsent.update(id(x) for x in self.next_turns.pop(s.spec.session_id))
                return
            self.push(nxt.arrival_s, "arrive", nxt)

    # -- autoscaler in the loop -----------------------------------------------------------------
    def _on_control(self, now: float, _: Any) -> None:
        cfg = self.cfg
        for w in self.prefills + self.decodes:
            if w.draining and not w.gone and w.idle(now):
                w.gone = True
        snap = self._snapshot(now)
        d = decide(snap, cfg, self.policy, now)
        self.policy = d.state
        p_target = 0 if self.colocated else d.prefill_target
        self._resize(self.prefills, _PrefillWorker, p_target, now)
        self._resize(self.decodes, _DecodeWorker, d.decode_target, now)
        self._start_pending(now)
        self.samples.append(PoolSample(now, snap.prefill.size, snap.decode.size, p_target, d.decode_target,
                                       snap.prefill.draining, snap.decode.draining))
        if self.done + len(self.unsent) < len(self.seqs):  # unsent turns never finish
            self.push(now + cfg.period_s, "control")

    def _resize(self, pool: list, cls: type, target: int, now: float) -> None:
        live = [w for w in pool if not w.draining and not w.gone]
        for _ in range(target - len(live)):
            self._add_worker(pool, cls, now)
        # shrink: cancel workers still starting (newest first), then drain the least loaded
        victims = sorted(live, key=lambda w: (w.accepting, w.load() if isinstance(w, _DecodeWorker)
                                              else w.free_s, -w.wid))
        for w in victims[:max(0, len(live) - target)]:
            w.accepting, w.draining = False, True
            if not w.up or w.idle(now):
                w.gone = True

    def _snapshot(self, now: float) -> MetricsSnapshot:
        cfg, perf = self.cfg, self.perf
        # What the live controller is given (controller.build_snapshot): latency percentiles over
        # the workers' window (LatencyWindow) of samples already taken, by then (a remote
        # prefill's TTFT is stamped when its KV will be ready, which may be after now), and the
        # prompt-token rate over the last period.
        window = _LATENCY_WINDOW_S
        for name in ("recent_ttft", "recent_tpot", "recent_prefill"):
            q = getattr(self, name)
            if q and min(x[0] for x in q) < now - window:
                setattr(self, name, deque(x for x in q if x[0] >= now - window))
        queued = running = 0
        for p in self.prefills:
            while p.jobs and p.jobs[0][1] <= now:
                p.jobs.popleft()
            for start, end, n in p.jobs:
                if start > now:
                    queued += n
                else:
                    running += int(n * (end - now) / max(end - start, 1e-12))
        cap = None
        if self.recent_prefill:
            n_mean = sum(j[1] for j in self.recent_prefill) / len(self.recent_prefill)
            ctx_mean = sum(j[2] for j in self.recent_prefill) / len(self.recent_prefill)
            if n_mean > 0:
                cap = n_mean / perf.prefill_s(max(1, round(n_mean)), round(ctx_mean))
        ttft = [v for t, v in self.recent_ttft if t <= now]
        tpot = [v for t, v in self.recent_tpot if t <= now]
        live_d = [w for w in self.decodes if w.accepting]
        blocks = perf.kv_capacity_tokens // perf.block_tokens
        prefill = PrefillMetrics(
            size=sum(p.accepting for p in self.prefills),
            draining=sum(p.draining and not p.gone for p in self.prefills),
            queued_prompt_tokens=queued, running_prompt_tokens=running,
            prompt_tokens_per_s=sum(j[1] for j in self.recent_prefill if j[0] > now - cfg.period_s) / cfg.period_s,
            prefill_tokens_per_s_per_worker=cap,
            ttft_p50=_pct(ttft, 50) if ttft else None, ttft_p90=_pct(ttft, 90) if ttft else None,
            ttft_p99=_pct(ttft, 99) if ttft else None)
        decode = DecodeMetrics(
            size=len(live_d), draining=sum(w.draining and not w.gone for w in self.decodes),
            running_seqs=sum(w.slots_used() for w in live_d),
            waiting_seqs=sum(len(w.waiting) for w in live_d),
            kv_blocks_used=sum(w.held for w in live_d) // perf.block_tokens,
            kv_blocks_total=blocks * len(live_d),
            kv_blocks_waiting=sum(s.spec.input_tokens + s.spec.output_tokens
                                  for w in live_d for s in w.waiting) // perf.block_tokens,
            kv_blocks_cached=sum(w.cache.tokens for w in live_d) // perf.block_tokens,
            tpot_p50=_pct(tpot, 50) if tpot else None, tpot_p90=_pct(tpot, 90) if tpot else None,
            tpot_p99=_pct(tpot, 99) if tpot else None, max_seqs_per_worker=perf.max_batch)
        return MetricsSnapshot(prefill, decode)

    # -- results --------------------------------------------------------------------------------
    def result(self, label: str, prefill: int, decode: int) -> SimResult:
        reqs = []
        for s in self.seqs:
            if id(s) in self.unsent:
                continue
            r = s.spec
            ok = s.finish_s is not None
            tpot = ((s.finish_s - s.first_token_s) / (r.output_tokens - 1)
                    if ok and r.output_tokens > 1 else None)
            reqs.append(RequestResult(
                r.session_id, r.turn, s.arrival_s, r.input_tokens, r.output_tokens,
                s.cached if ok else 0, s.kind if ok else "rejected",
                s.first_token_s - s.arrival_s if ok else None, tpot,
                s.finish_s - s.arrival_s if ok else None))
        return SimResult(summarize(reqs, self.slo, label, prefill, decode, self.samples), reqs,
                         list(self.samples))


def summarize(reqs: list[RequestResult], slo: SLO, label: str, prefill: int, decode: int,
              samples: list[PoolSample] = ()) -> SimSummary:
    ok = [r for r in reqs if r.ttft_s is not None]
    ttft = [r.ttft_s for r in ok]
    tpot = [r.tpot_s for r in ok if r.tpot_s is not None]
    e2e = [r.e2e_s for r in ok]
    good = sum(r.ttft_s <= slo.ttft_s and (r.tpot_s is None or r.tpot_s <= slo.tpot_s) for r in ok)
    start = min((r.arrival_s for r in reqs), default=0.0)
    end = max((r.arrival_s + r.e2e_s for r in ok), default=start)
    duration = max(end - start, 1e-9)
    prompt = sum(r.input_tokens for r in ok)
    mean_workers = float(prefill + decode)
    if len(samples) > 1:  # time-weighted live workers while the autoscaler ran
        t = [x.time_s for x in samples]
        live = [x.prefill_live + x.decode_live for x in samples]
        mean_workers = sum(l * (b - a) for l, a, b in zip(live, t, t[1:])) / max(t[-1] - t[0], 1e-9)
    return SimSummary(
        label=label, prefill=prefill, decode=decode, requests=len(reqs), rejected=len(reqs) - len(ok),
        ttft_p50=_pct(ttft, 50), ttft_p90=_pct(ttft, 90), ttft_p99=_pct(ttft, 99),
        tpot_p50=_pct(tpot, 50), tpot_p90=_pct(tpot, 90), tpot_p99=_pct(tpot, 99),
        e2e_p50=_pct(e2e, 50), e2e_p90=_pct(e2e, 90),
        goodput_rps=good / duration, slo_attainment=good / len(reqs) if reqs else 0.0,
        cached_token_ratio=sum(r.cached_tokens for r in ok) / prompt if prompt else 0.0,
        output_tok_s=sum(r.output_tokens for r in ok) / duration, duration_s=duration,
        mean_workers=mean_workers)


def simulate(workload_requests: Sequence[RequestLike], prefill: int, decode: int, perf: PerfModel,
             slo: SLO = SLO(), autoscaler: AutoscalerConfig | None = None, seed: int = 0, *,
             colocated: bool = False, closed_loop: bool = False, pull_prefix: bool = False,
             worker_startup_s: float = 60.0, label: str | None = None,
             send_until_s: float | Mapping[str, float] | None = None,
             max_workers: int | None = None) -> SimResult:
    """Replay `workload_requests` against `prefill` + `decode` workers. `colocated`: no prefill
    pool, every decode worker prefills everything itself (chunked). `closed_loop`: a session's turn
    k+1 is sent `think_s` after turn k finishes (an agent waits for its answer) instead of at its
    `arrival_s`. With `autoscaler`, pools start at the given sizes and follow the policy; new workers
    take `worker_startup_s` to come up. `pull_prefix`: a prefill worker missing part of the prefix
    the decode worker holds receives that KV from it (transfer time) rather than recomputing it.
    `send_until_s` (closed loop): a turn due at or after it is not sent, nor are the session's later
    turns, as `tandem bench` stops sending at its duration; unsent turns are left out of the result.
    A mapping gives each session id its own cut-off (a ramp of runs). `max_workers` (GPUs in all):
    a new worker past it waits for a drained worker's slot, then starts."""
    if decode < 1 or prefill < 0:
        raise ValueError(f"need decode >= 1 and prefill >= 0, got prefill={prefill}, decode={decode}")
    if max_workers is not None and (0 if colocated else prefill) + decode > max_workers:
        raise ValueError(f"{prefill} prefill + {decode} decode workers exceed max_workers={max_workers}")
    sim = _Simulation(workload_requests, prefill, decode, perf, slo, autoscaler, seed, colocated,
                      worker_startup_s, closed_loop, pull_prefix, send_until_s, max_workers)
    sim.run()
    label = label or ((f"colocated x{decode}" if colocated else f"{prefill}P:{decode}D")
                      + (" autoscaled" if autoscaler else ""))
    return sim.result(label, 0 if colocated else prefill, decode)


def sweep(workload_requests: Sequence[RequestLike], total_workers: int, perf: PerfModel,
          slo: SLO = SLO(), seed: int = 0, *, colocated: bool = True, **options: Any) -> list[SimResult]:
    """Every split of `total_workers` into prefill >= 1 and decode >= 1 workers, then (if
    `colocated`) all of them colocated. `options` go to `simulate` (closed_loop, pull_prefix)."""
    out = [simulate(workload_requests, p, total_workers - p, perf, slo, seed=seed, **options)
           for p in range(1, total_workers)]
    if colocated:
        out.append(simulate(workload_requests, 0, total_workers, perf, slo, seed=seed, colocated=True,
                            **options))
    return out


def format_table(results: Sequence[SimResult | SimSummary]) -> str:
    """A plain-text table, one row per result, best goodput marked with '*'."""
    rows = [r.summary if isinstance(r, SimResult) else r for r in results]
    best = max((r.goodput_rps for r in rows), default=None)

    def f(v: float, scale: float = 1.0, digits: int = 2) -> str:
        return "-" if v is None or math.isnan(v) else f"{v * scale:.{digits}f}"
    head = ["split", "TTFT p50 s", "p90", "p99", "TPOT p50 ms", "p90", "p99", "goodput r/s",
            "SLO met", "cached", "out tok/s"]
    body = [[r.label + (" *" if r.goodput_rps == best else ""), f(r.ttft_p50), f(r.ttft_p90),
             f(r.ttft_p99), f(r.tpot_p50, 1e3, 1), f(r.tpot_p90, 1e3, 1), f(r.tpot_p99, 1e3, 1),
             f(r.goodput_rps, digits=3), f(r.slo_attainment, 100, 1) + "%",
             f(r.cached_token_ratio, 100, 1) + "%", f(r.output_tok_s, digits=0)] for r in rows]
    widths = [max(len(x) for x in col) for col in zip(head, *body)]
    lines = ["  ".join(x.rjust(w) if i else x.ljust(w) for i, (x, w) in enumerate(zip(row, widths)))
             for row in [head, *body]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
