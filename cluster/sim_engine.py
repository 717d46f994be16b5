"""The discrete-event simulation of Tandem's request path (cluster/simulator.py describes it). Every
placement decision is the router's and the decode worker's own, through tandem.placement: the same
rules, the same tie-breaking, on what the simulation knows of its workers.

Events, in a request's order: `arrive` (the router picks a decode worker), admission on that worker
(KV for prompt + output; local or remote prefill), `kv_ready` (a remote prefill's KV is usable: the
first token), `step` (one continuous-batching step: a token per running sequence, chunks of local
prefills), then finish. `ready` (a worker started) and `control` (the autoscaler's period) come
from the pools.
"""

from __future__ import annotations

import heapq
from collections import deque
from typing import Any, Mapping, Sequence

from tandem.client.errors import backoff_s
from tandem.cluster import sim_adaptive, sim_control
from tandem.cluster.autoscaler import AutoscalerConfig, MetricsSnapshot, PolicyState
from tandem.cluster.pools import PrefillCounters
from tandem.cluster.roles import RoleConfig
from tandem.cluster.sim_model import SLO, PoolSample, RequestLike, RequestResult, SimResult, summarize
from tandem.perf_model import PerfModel
from tandem.cluster.sim_workers import SimDecodeWorker, SimPrefillWorker, SimSeq, SimWorker
from tandem.router.admission import AdmissionConfig, AdmissionLimiter, Overloaded
from tandem.runtime.latency import DEFAULT_WINDOW_S
from tandem.wire.errors import WORKERS_RETRY_AFTER_S
from tandem.placement import (BatchGuard, OverloadLimits, choose_worker, local_prefill_queue, prefill_placement,
                              remote_prefill_offered, wants_remote_prefill)


SIM_CLIENT = "bench"   # the admission limiter's client identity of every simulated request


class Simulation:
    def __init__(self, requests: Sequence[RequestLike], prefill: int, decode: int, perf: PerfModel,
                 slo: SLO, autoscaler: AutoscalerConfig | None, seed: int, colocated: bool,
                 worker_startup_s: float, closed_loop: bool, pull_prefix: bool,
                 send_until_s: float | Mapping[str, float] | None = None,
                 max_workers: int | None = None, overload: OverloadLimits = OverloadLimits(),
                 adaptive: RoleConfig | None = None, admission: AdmissionConfig | None = None,
                 batch_guard: bool = False, retries: int = 0, retry_until_s: float | None = None):
        self.perf, self.slo, self.cfg = perf, slo, autoscaler
        # the router's admission limiter on the simulation's clock: a request whose predicted wait
        # for its first token is past the limit is refused at arrival, as live (None: none refused)
        self.now_s = 0.0
        self.limiter = None if admission is None else AdmissionLimiter(admission, clock=lambda: self.now_s)
        # adaptive: every worker decodes and prefills; the role policy lends some to prefill only
        self.role_config = adaptive
        self.role_state, self.role_samples, self.role_log = sim_adaptive.new_state()
        self.seed = seed   # placement is deterministic: kept so callers' seeds still name a run
        self.send_until_s = send_until_s
        self.retries = retries   # a refused request is sent again, as `tandem bench --retries` sends it
        self.retry_until_s = retry_until_s   # ... while before this (send_until_s where that is set)
        self.max_workers = max_workers
        self.overload = overload
        # the cost-placing router's guard on decode batches (the adaptive layout's router places by cost)
        self.guard = BatchGuard(perf, slo.tpot_s) if batch_guard and adaptive is not None else None
        self.slot_queue: deque[SimWorker] = deque()  # created past max_workers, oldest first
        self.unsent: set[int] = set()  # seq indices a closed-loop session never sent (due too late)
        self.pull_prefix = pull_prefix
        self.colocated = colocated
        self.threshold = float("inf") if colocated else perf.local_prefill_threshold
        self.startup_s = worker_startup_s
        self.events: list[tuple[float, int, str, Any]] = []
        self.counter = 0
        self.seqs = [SimSeq(r, i) for i, r in enumerate(sorted(requests, key=lambda r: r.arrival_s))]
        # closed loop: a session's next turn is sent `think_s` after its previous turn finished
        self.next_turns: dict[str, deque[SimSeq]] | None = None
        if closed_loop:
            self.next_turns = {}
            for s in sorted(self.seqs, key=lambda s: (s.spec.turn, s.arrival_s)):
                self.next_turns.setdefault(s.spec.session_id, deque()).append(s)
        self.prefills: list[SimPrefillWorker] = []
        self.decodes: list[SimDecodeWorker] = []
        # the router's session state, written when a turn finishes: its decode and prefill workers
        self.session_decode: dict[str, SimDecodeWorker] = {}
        self.session_prefill: dict[str, str] = {}
        self.prefill_of: dict[int, str] = {}   # seq idx -> the prefill worker that computed it
        self.done = 0
        self.samples: list[PoolSample] = []
        self.policy = PolicyState()
        self.rates: PrefillCounters | None = None  # the last snapshot's counters (build_snapshot)
        for _ in range(0 if colocated else prefill):
            self.add_worker(self.prefills, SimPrefillWorker, 0.0, started=True)
        for _ in range(decode):
            self.add_worker(self.decodes, SimDecodeWorker, 0.0, started=True)

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
        if self.role_config is not None and self.seqs:
            self.push(self.seqs[0].spec.arrival_s, "roles")
        while self.events:
            now, _, kind, payload = heapq.heappop(self.events)
            self.now_s = now
            getattr(self, "_on_" + kind)(now, payload)

    # -- pools -----------------------------------------------------------------------------------
    def add_worker(self, pool: list, cls: type, now: float, started: bool = False) -> None:
        # the span of its TTFT and TPOT reports is the autoscaler's, as a live worker's
        window = self.cfg.latency_window_s if self.cfg is not None else DEFAULT_WINDOW_S
        w = cls(len(pool), now + (0.0 if started else self.startup_s), self.perf.block_tokens, window)
        if self.role_config is not None and isinstance(w, SimDecodeWorker):
            w.role = sim_adaptive.MIXED   # the adaptive layout's workers start mixed, as live
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

    def start_pending(self, now: float) -> None:
        """Workers waiting for a slot start, oldest first, as drained workers free theirs."""
        while self.slot_queue and self._slots_held() < self.max_workers:
            w = self.slot_queue.popleft()
            if not w.gone:
                w.pending, w.ready_s = False, now + self.startup_s
                self.push(w.ready_s, "ready", w)

    def _on_ready(self, now: float, w: SimWorker) -> None:
        if w.gone:
            return
        w.up, w.accepting = True, not w.draining
        if isinstance(w, SimDecodeWorker):
            self._admit(w, now)

    def _on_control(self, now: float, _: Any) -> None:
        sim_control.control(self, now)

    def _on_roles(self, now: float, _: Any) -> None:
        sim_adaptive.roles(self, now)

    def _snapshot(self, now: float) -> MetricsSnapshot:
        return sim_control.snapshot(self, now)

    # -- placement: the router's rules (tandem.placement) -----------------------------------------
    def pick_decode(self, r: RequestLike) -> SimDecodeWorker | None:
        """The router's decode choice: the session's worker unless it is not ready or overloaded,
        else the most cached, the least loaded, the lowest KV use, the smallest id; with the batch
        guard, none whose batch is full for the request (the session's own full: none). None: no
        worker can take it (the router answers UNAVAILABLE or RESOURCE_EXHAUSTED)."""
        perf = self.perf
        live = {w.name: w for w in self._decoding()}
        own = self.session_decode.get(r.session_id)
        views = [w.view(r, perf.block_tokens, perf.kv_capacity_tokens) for w in live.values()]
        full = self.guard.full_for(r.input_tokens, perf.block_tokens) if self.guard else None
        wid = choose_worker(views, own.name if own else None, overload_fn=self.overload, full=full)
        return live.get(wid)

    def _decoding(self) -> list[SimDecodeWorker]:
        """The decode workers up and not lent to prefill only: those a request may be placed on."""
        return [w for w in self.decodes if w.up and not w.gone and w.role != sim_adaptive.PREFILL]

    def pick_prefill(self, s: SimSeq, now: float) -> SimPrefillWorker | None:
        """The router's prefill choice for a request the decode worker may prefill remotely: the
        prefill worker picked like a decode worker, unless it is backlogged past
        `prefill_queue_limit` (`prefill_placement`); None: prefill locally."""
        r = s.spec
        ready = {p.name: p for p in self.prefills if p.accepting}
        if not remote_prefill_offered(self.threshold, len(ready)):
            return None
        hint = choose_worker([p.view(r, now) for p in ready.values()], self.session_prefill.get(r.session_id),
                             overload_fn=self.overload)
        if hint is None:
            return None
        for p in ready.values():
            p.deliver(now)
        local = local_prefill_queue(s.session_decode, {w.name: w.local_queued() for w in self.decodes},
                                    [w.name for w in self.decodes if w.up and not w.gone])
        target = prefill_placement(hint, list(ready), {n: p.queued_tokens for n, p in ready.items()}, local,
                                   r.input_tokens, self.perf.prefill_queue_limit)
        return ready.get(target)

    # -- a request's path ------------------------------------------------------------------------
    def _on_arrive(self, now: float, s: SimSeq) -> None:
        r = s.spec
        if self.limiter is not None:
            try:    # one client, as `tandem bench` is
                s.admission = self.limiter.admit_now(SIM_CLIENT)
            except Overloaded as e:   # RESOURCE_EXHAUSTED with the limiter's hint
                self._refused(now, s, "RESOURCE_EXHAUSTED", e.retry_after_s)
                return
        fits = r.input_tokens + r.output_tokens <= self.perf.kv_capacity_tokens
        w = self.pick_decode(r) if fits else None
        if w is None:
            self._release(s)
            if not fits:        # INVALID_ARGUMENT: never retried
                s.kind = "rejected"
                self._retire(now, s)
            elif self._decoding():
                hint = WORKERS_RETRY_AFTER_S   # WorkersOverloaded's, spaced as the router spaces it
                self._refused(now, s, "RESOURCE_EXHAUSTED",
                              hint if self.limiter is None else self.limiter.spaced(hint, workers=True))
            else:
                self._refused(now, s, "UNAVAILABLE", None)   # NoWorkerReady
            return
        own = self.session_decode.get(r.session_id)
        s.session_decode = own.name if own else None
        s.decode = w
        w.host_debt_s += self.perf.admit_host_s    # its serving loop takes the request in
        w.waiting.append(s)
        self._admit(w, now)

    def _refused(self, now: float, s: SimSeq, status: str, hint_s: float | None) -> None:
        """The router refused `s`: the client sends it again after tandem.client.errors.backoff_s
        (at most `retries` times, only while that is before the run's end), else it failed and the
        session goes on to its next turn."""
        wait = backoff_s(status, hint_s, s.retries) if s.retries < self.retries else None
        until = self.retry_until_s if self.send_until_s is None else self._send_until(s.spec.session_id)
        if wait is not None and (until is None or now + wait < until):
            s.retries += 1
            self.push(now + wait, "arrive", s)
            return
        s.kind = "rejected"
        self._retire(now, s)

    def _send_until(self, session_id: str) -> float | None:
        until = self.send_until_s
        return until.get(session_id) if isinstance(until, Mapping) else until

    def _admit(self, w: SimDecodeWorker, now: float) -> None:
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
            # the decode worker's rule, then the router's prefill choice (side-effect free, so the
            # order the router asks them in does not matter)
            if self.role_config is not None:
                sim_adaptive.place(self, w, s, hit, now)
                continue
            p = self.pick_prefill(s, now) if wants_remote_prefill(r.input_tokens, hit, self.threshold) else None
            if p is not None:
                self._send_to_prefill(s, p, hit, now)
            else:
                s.kind, s.cached, s.prefill_left, s.context = "local", hit, r.input_tokens - hit, hit
                s.queued_s = now
                w.local.append(s)
                self._step_if_idle(w, now)

    def _send_to_prefill(self, s: SimSeq, p: SimPrefillWorker, decode_hit: int, now: float) -> None:
        """`p` computes what its own cache lacks (or, with pull_prefix, what the decode worker's
        cached prefix lacks, after receiving that prefix over the KV link), FIFO."""
        r, perf = s.spec, self.perf
        n_in, hit = r.input_tokens, p.cache.hit(r)
        if self.pull_prefix and decode_hit > hit:
            n = n_in - decode_hit
            busy_s = perf.transfer_s(decode_hit - hit) + perf.prefill_s(n, n_in)
        else:
            n, busy_s = n_in - hit, perf.prefill_s(n_in - hit, n_in)
        start, end = p.take(now, n, busy_s)
        p.cache.store(r, n_in)
        p.cache.pin(p.cache.keys(r))  # the newest prompt stays even if it alone is over capacity
        p.cache.evict_to(perf.kv_capacity_tokens)
        p.cache.unpin(p.cache.keys(r))
        self.prefill_of[s.idx] = p.name
        s.prefiller, s.prefill_start_s = p, now
        s.kind, s.cached = "remote", n_in - n
        s.decode.awaiting_kv += 1
        # layer-by-layer streaming hides the transfer under compute unless it is the slower one
        ready = max(end, start + perf.transfer_s(n_in - decode_hit)) + perf.remote_overhead_s
        p.queued.append((ready, n_in))
        p.queued_tokens += n_in
        self.push(ready, "kv_ready", s)

    def _on_kv_ready(self, now: float, s: SimSeq) -> None:
        w = s.decode
        w.awaiting_kv -= 1
        s.prefiller.prefill_latency.add(now, now - s.prefill_start_s)   # reserve -> KV ready, as live
        s.context = s.spec.input_tokens
        s.queued_s = now
        self._first_token(s, now)
        self._admit(w, now)
        self._step_if_idle(w, now)

    def _first_token(self, s: SimSeq, now: float) -> None:
        # the client sees it a control path later; the engine goes on at once
        s.first_token_s, s.generated = now + self.perf.request_overhead_s, 1
        if s.admission is not None:
            self.limiter.started(s.admission)
        s.context += 1
        if s.spec.output_tokens <= 1:
            self._finish(s, now)
        else:
            s.decode.running.append(s)

    def _step_if_idle(self, w: SimDecodeWorker, now: float) -> None:
        if w.stepping or not (w.running or w.local):
            return
        perf = self.perf
        batch, local = list(w.running), w.local
        if perf.overlap and w.step_started_s < now:
            # this step was scheduled while the one before it computed (perf_model: overlap): work
            # that reached the engine after that one started waits a step, unless there is no other
            seen = [s for s in batch if s.queued_s <= w.step_started_s]
            old = [s for s in w.local if s.queued_s <= w.step_started_s]
            if seen or old:
                batch, local = seen, old
        # each decoding sequence takes 1 + its drafts of the step's token budget
        budget = max(perf.max_step_tokens - int(len(batch) * (1 + perf.spec_verify_tokens)), perf.block_tokens)
        chunks = []
        for s in local:  # chunked prefill, FIFO, within the step's token budget
            if budget <= 0:
                break
            n = min(s.prefill_left, budget, s.chunk)
            budget -= n
            chunks.append((s, n))
        dt = perf.step_s(len(batch), sum(s.context for s in batch), [(n, s.context + n) for s, n in chunks])
        dt, w.host_debt_s = dt + w.host_debt_s, 0.0    # requests taken in since the last step began
        w.count_prompts(chunks)
        w.stepping, w.step_started_s = True, now
        self.push(now + dt, "step", (w, batch, chunks))

    def _on_step(self, now: float, payload: tuple) -> None:
        w, batch, chunks = payload
        w.stepping = False
        w.busy_s += now - w.step_started_s
        for s in batch:
            n = s.emit(getattr(s.spec, "tokens_per_step", None) or self.perf.spec_tokens_per_step)
            s.generated += n
            s.context += n
            if s.generated >= s.spec.output_tokens:
                self._finish(s, now)
        if any(s.finish_s is not None for s in batch):
            w.running = [s for s in w.running if s.finish_s is None]
        for s, n in chunks:
            s.prefill_left -= n
            s.context += n
            if s.prefill_left <= 0:
                w.local.remove(s)
                if s.decode is w:
                    self._first_token(s, now)
                else:               # prefilled for another worker (adaptive)
                    sim_adaptive.prefilled_for(self, w, s, now)
        self._admit(w, now)
        self._step_if_idle(w, now)

    def _finish(self, s: SimSeq, now: float) -> None:
        w, r = s.decode, s.spec
        s.finish_s = now + self.perf.request_overhead_s       # client-visible, like the first token
        w.reserved -= s.reserved
        w.held -= r.input_tokens + r.output_tokens
        w.cache.unpin(s.pinned)
        w.cache.store(r, r.input_tokens + r.output_tokens)
        w.cache.evict_to(self.perf.kv_capacity_tokens - w.reserved)
        if r.output_tokens > 1:
            w.tpot.add(now, (s.finish_s - s.first_token_s) / (r.output_tokens - 1))
        # the router writes the session's workers once its turn is done
        self.session_decode[r.session_id] = w
        if s.idx in self.prefill_of:
            self.session_prefill[r.session_id] = self.prefill_of.pop(s.idx)
        self._release(s)
        self._retire(now, s)

    def _release(self, s: SimSeq) -> None:
        if s.admission is not None:
            self.limiter.release(s.admission)

    def _retire(self, now: float, s: SimSeq) -> None:
        self.done += 1
        if self.next_turns is not None and self.next_turns.get(s.spec.session_id):
            nxt = self.next_turns[s.spec.session_id].popleft()
            nxt.arrival_s = (s.finish_s or now) + getattr(nxt.spec, "think_s", 0.0)
            until = self._send_until(s.spec.session_id)
            if until is not None and nxt.arrival_s >= until:
                # due past the run's end: neither it nor the session's later turns are sent
                self.unsent.add(id(nxt))
                self.unsent.update(id(x) for x in self.next_turns.pop(s.spec.session_id))
                return
            self.push(nxt.arrival_s, "arrive", nxt)

    # -- results ---------------------------------------------------------------------------------
    def result(self, label: str, prefill: int, decode: int, cancel_at_s: float | None = None) -> SimResult:
        """The requests sent; one still running at `cancel_at_s` (the client's deadline) failed."""
        reqs = []
        for s in self.seqs:
            if id(s) in self.unsent:
                continue
            r = s.spec
            ok = s.finish_s is not None and (cancel_at_s is None or s.finish_s <= cancel_at_s)
            tpot = ((s.finish_s - s.first_token_s) / (r.output_tokens - 1)
                    if ok and r.output_tokens > 1 else None)
            reqs.append(RequestResult(
                r.session_id, r.turn, s.arrival_s, r.input_tokens, r.output_tokens,
                s.cached if ok else 0, s.kind if ok else "rejected",
                s.first_token_s - s.arrival_s if ok else None, tpot,
                s.finish_s - s.arrival_s if ok else None))
        return SimResult(summarize(reqs, self.slo, label, prefill, decode, self.samples), reqs,
                         list(self.samples))
