"""The simulated workers: a prefix cache per worker (LRU, in tokens), one record per request in
flight (`SimSeq`), and the prefill and decode workers' queues and batches. State only; the rules
that move requests between them are in cluster/sim_engine.py.

Each worker reports what a live one does (`entry`: a `WorkerEntry` with its `WorkerStats`, the
fields the controller's `build_snapshot` and role policy (`prompt_counters`, `role_move`) read), from
counters and latency windows (`LatencyWindow`, the live workers' own) kept as the simulation runs, so
the simulated controller is given its inputs by the live functions."""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from typing import Any

from tandem.cluster.sim_model import RequestLike
from tandem.perf_model import PerfModel
from tandem.placement import DRAINING, READY, WorkerView
from tandem.runtime.latency import DEFAULT_WINDOW_S, LatencyWindow
from tandem.wire.cluster import WorkerEntry
from tandem.wire.stats import Percentiles, WorkerStats


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


class SimSeq:
    __slots__ = ("spec", "idx", "arrival_s", "decode", "reserved", "pinned", "cached", "kind",
                 "prefill_left", "context", "generated", "first_token_s", "finish_s", "session_decode",
                 "credit", "chunk", "prefill_start_s", "prefiller", "queued_s", "admission", "retries")

    def __init__(self, spec: RequestLike, idx: int):
        self.spec, self.idx, self.arrival_s = spec, idx, spec.arrival_s
        self.decode: SimDecodeWorker | None = None
        self.session_decode: str | None = None  # the session's decode worker when it arrived
        self.pinned: list[tuple] = []  # decode-cache entries this sequence uses
        self.reserved = self.cached = self.prefill_left = self.context = self.generated = 0
        self.kind = "rejected"
        self.first_token_s: float | None = None
        self.finish_s: float | None = None
        self.credit = 0.0  # tokens owed by decode steps, not yet emitted (speculation's fractions)
        self.chunk = 1 << 30  # prompt tokens per step when it prefills in chunks (adaptive: chosen)
        self.prefill_start_s = 0.0  # when another worker reserved its prefill (remote prefills)
        self.prefiller: SimWorker | None = None  # that worker: its prefill latency, once the KV is ready
        # when it reached its worker's engine as new work (a prompt to prefill, a remote prefill's
        # KV): an overlapped engine schedules it into the step after the one then computing
        self.queued_s = 0.0
        self.admission = None  # its slot in the router's admission limiter, where one is simulated
        self.retries = 0  # times the client sent it again after a refusal (Simulation.retries)

    def emit(self, tokens_per_step: float) -> int:
        """Tokens one decode step emits for this sequence: `tokens_per_step` on average (1 + the
        drafts speculation accepts), whole tokens, deterministically (an accumulator), never past
        its output length."""
        self.credit += tokens_per_step
        n = min(int(self.credit + 1e-9), self.spec.output_tokens - self.generated)
        self.credit -= n
        return n


class SimWorker:
    pool = ""
    role = ""  # what it serves, as WorkerEntry.role ("": its pool's)

    def __init__(self, wid: int, ready_s: float, block_tokens: int, latency_window_s: float = DEFAULT_WINDOW_S):
        self.wid, self.ready_s = wid, ready_s
        self.up = False  # started
        self.accepting = False  # started and not draining
        self.draining = False
        self.gone = False
        self.pending = False  # created past max_workers: waits for a slot before it starts
        self.cache = PrefixCache(block_tokens)
        # what a live worker reports (WorkerStats): prompt tokens it took to prefill for other
        # workers (counted when handed to its engine, as the live prefill part counts them), and the
        # latency from reserving such a prefill to its KV ready on the decode worker
        self.computed_tokens = 0
        self.prefill_latency = LatencyWindow(latency_window_s)

    @property
    def name(self) -> str:
        """Its worker id, named as the controller names a live one."""
        return f"{self.pool}-{self.wid}"

    def state(self) -> str:
        """As the controller lists it (WorkerEntry.state); a gone worker is not listed at all."""
        return "starting" if not self.up else "draining" if self.draining else "ready"

    def entry(self, now: float, perf: PerfModel) -> WorkerEntry:
        """What `cluster_state()` lists for it at `now`. The simulation reads its stats as of now;
        the live controller's are its last health check's, up to a check period older."""
        stats = self.stats(now, perf) if self.up else None     # a starting worker has not answered
        return WorkerEntry(self.name, self.pool, self.state(), stats=stats, role=self.role or self.pool)

    def stats(self, now: float, perf: PerfModel) -> WorkerStats:
        raise NotImplementedError


class SimPrefillWorker(SimWorker):
    pool = "prefill"

    def __init__(self, *a: Any):
        super().__init__(*a)
        self.free_s = 0.0
        self.jobs: deque[tuple[float, float, int]] = deque()  # (start, end, tokens), FIFO
        self.queued: deque[tuple[float, int]] = deque()      # (KV delivered at, prompt tokens)
        self.queued_tokens = 0
        self.busy_booked_s = 0.0   # compute time of every job taken, those still ahead included

    def take(self, now: float, tokens: int, busy_s: float) -> tuple[float, float]:
        """Queue a prefill of `tokens` new tokens that keeps it busy `busy_s`, FIFO: (start, end)."""
        start = max(now, self.free_s)
        self.free_s = end = start + busy_s
        self.jobs.append((start, end, tokens))
        self.busy_booked_s += busy_s
        self.computed_tokens += tokens
        return start, end

    def idle(self, now: float) -> bool:
        return self.free_s <= now

    def stats(self, now: float, perf: PerfModel) -> WorkerStats:
        """Its jobs as a live prefill worker reports them: one running (the oldest unfinished), the
        rest waiting; the prompt tokens still to compute (the running one's in proportion to its
        time left); its compute time so far."""
        self._drop_done(now)
        jobs = self.jobs
        left = sum(n if start >= now else int(n * (end - now) / max(end - start, 1e-12)) for start, end, n in jobs)
        running = sum(start < now for start, _, _ in jobs)
        return WorkerStats(
            self.name, self.pool, running=running, waiting=len(jobs) - running, queued_prompt_tokens=left,
            kv_blocks_total=perf.kv_capacity_tokens // perf.block_tokens, draining=self.draining,
            computed_tokens=self.computed_tokens,
            busy_s=self.busy_booked_s - sum(end - max(start, now) for start, end, _ in jobs),
            prefill_latency=Percentiles(**self.prefill_latency.percentiles(now)))

    def deliver(self, now: float) -> None:
        """Prompts whose KV has been delivered by `now` leave the router's count of queued tokens."""
        while self.queued and self.queued[0][0] <= now:
            self.queued_tokens -= self.queued.popleft()[1]

    def _drop_done(self, now: float) -> None:
        while self.jobs and self.jobs[0][1] <= now:      # FIFO: the oldest ends first
            self.jobs.popleft()

    def view(self, r: RequestLike, now: float) -> WorkerView:
        """What the router knows of it (tandem.placement): its prompts not yet computed as load."""
        self._drop_done(now)
        return WorkerView(self.name, self.pool, READY if self.accepting else DRAINING, running=len(self.jobs),
                          cached_prefix_tokens=self.cache.hit(r))


class SimDecodeWorker(SimWorker):
    pool = "decode"

    def __init__(self, *a: Any):
        super().__init__(*a)
        self.waiting: deque[SimSeq] = deque()  # routed here, not admitted
        self.local: list[SimSeq] = []  # admitted, prefilling here in chunks
        self.running: list[SimSeq] = []
        self.awaiting_kv = 0  # admitted, remote prefill in flight
        self.reserved = 0  # KV tokens reserved by admitted sequences, beyond their cached prefix
        self.held = 0  # KV tokens admitted sequences use, cached prefix included (what "used" means)
        self.stepping = False
        self.step_started_s = 0.0
        self.busy_s = 0.0  # time in finished steps
        self.host_debt_s = 0.0  # admit_host_s of requests routed here since its last step began
        self.tpot = LatencyWindow(self.prefill_latency.window_s)  # each finished sequence's time per output token
        # the engine's prompt counters (engine/stats.py `count_prompts`): positions computed, and
        # prompts whose last position was computed here and their lengths
        self.prompt_tokens_computed = self.prompts_completed = self.prompt_tokens_completed = 0
        # "decode"; in the adaptive layout Simulation.add_worker starts it "mixed" (it decodes, and
        # prefills for others with slack), as live, and the role policy lends some to "prefill",
        # which takes no new decode requests
        self.role = "decode"

    def slots_used(self) -> int:
        return len(self.running) + len(self.local) + self.awaiting_kv

    def load(self) -> int:
        return self.slots_used() + len(self.waiting)

    def local_queued(self) -> int:
        """Prompt tokens it prefills itself and has not finished (the router counts them to the
        first token)."""
        return sum(x.spec.input_tokens - x.cached for x in self.local if x.prefill_left > 0)

    def view(self, r: RequestLike, block_tokens: int, kv_capacity_tokens: int) -> WorkerView:
        """What the router knows of it (tandem.placement)."""
        return WorkerView(self.name, self.pool, READY if self.accepting else DRAINING,
                          running=self.slots_used(), waiting=len(self.waiting),
                          kv_blocks_used=self.held // block_tokens,
                          kv_blocks_total=kv_capacity_tokens // block_tokens,
                          cached_prefix_tokens=self.cache.hit(r))

    def idle(self, now: float) -> bool:
        return not (self.load() or self.stepping)

    def count_prompts(self, chunks: list[tuple[SimSeq, int]]) -> None:
        """A step's prompt chunks (sequence, positions), counted as the engine counts them when it
        schedules the step: the positions, and a prompt completed by the chunk with its last one."""
        for s, n in chunks:
            self.prompt_tokens_computed += n
            if n >= s.prefill_left:
                self.prompts_completed += 1
                self.prompt_tokens_completed += s.spec.input_tokens

    def stats(self, now: float, perf: PerfModel) -> WorkerStats:
        """Its batch and KV as a live decode worker reports them: running, the engine's batch
        (chunked prefills too, its own and others'); waiting, routed here but not admitted or
        admitted and waiting for a remote prefill's KV; KV blocks held by admitted sequences (each
        reserves prompt + output at admission). Waiting blocks: the simulation's waiting requests
        have no engine request yet, so each counts the prompt + output it will reserve (live: the
        engine's waiting queue's prompt blocks). Its busy time counts a step in progress up to now."""
        bt = perf.block_tokens
        return WorkerStats(
            self.name, self.pool, role=self.role, running=len(self.running) + len(self.local),
            waiting=len(self.waiting) + self.awaiting_kv,
            queued_prompt_tokens=sum(s.prefill_left for s in self.local),
            kv_blocks_used=self.held // bt, kv_blocks_total=perf.kv_capacity_tokens // bt,
            kv_blocks_waiting=sum(s.spec.input_tokens + s.spec.output_tokens for s in self.waiting) // bt,
            draining=self.draining, computed_tokens=self.computed_tokens,
            prompt_tokens_computed=self.prompt_tokens_computed, prompts_completed=self.prompts_completed,
            prompt_tokens_completed=self.prompt_tokens_completed,
            busy_s=self.busy_s + (now - self.step_started_s if self.stepping else 0.0),
            prefill_latency=Percentiles(**self.prefill_latency.percentiles(now)),
            tpot=Percentiles(**self.tpot.percentiles(now)))

