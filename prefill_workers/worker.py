"""The prefill worker: computes prompts' KV with its own prefix cache (only the uncached part,
in chunks under the step's token budget) and streams each layer's KV to a decode actor as soon as
that layer is done in the step that completes the prompt.

A request's stages here, in order (its record, `PrefillJob`, names them as states):
1. `reserve(PrefillReserve)`: take blocks for the prompt (its cached prefix included) and answer
   with them and how much was cached (the router, asking the decode actor at the same time, picks
   the range to send and any prefix the decode actor holds that this actor should pull,
   `expect_pull`). RESERVED.
2. `start(spec)`: begin the transfer, schedule the prompt (once a prefix pull has landed: PULLING,
   then SENDING), and wait: each layer of the final step is sent as that layer finishes (earlier
   chunks' KV of that layer goes in the same message). The step that completes the prompt also
   samples the request's first output token with its own sampling parameters: `first_token`
   returns it at once (the router streams it while the last layers are still on the wire), and
   `start` returns it again once the KV has arrived.
3. When the transfer ends (done, failed or aborted), the request's blocks are released (PARKED
   first while a prefix pull may still write into them); the prefix stays in this actor's cache for
   the session's next turn.
"""

from __future__ import annotations

import logging
import os
import time
from concurrent.futures import Future
from typing import Any, Callable

from tandem.engine.engine import LLMEngine
from tandem.engine.kernels.compile_watch import watch as compile_watch
from tandem.engine.serving_loop import EngineLoop
from tandem.kv_transfer.base import TransferState
from tandem.kv_transfer.spec import TransferSpec
from tandem.kv_transfer.config import KVTransferConfig
from tandem.kv_transfer.link import Connector
from tandem.kv_transfer.receiver import LayerStreamReceiver
from tandem.kv_transfer.sender import LayerStreamSender
from tandem.kv_transfer.shared import SharedEngine
from tandem.prefill_workers.first_tokens import FirstTokenBoard
from tandem.prefill_workers.records import PrefillJob, PrefillState
from tandem.runtime.latency import DEFAULT_WINDOW_S, LatencyWindow
from tandem.runtime.metrics import TransferTimes
from tandem.wire.errors import NoReservation, TransferFailed, WorkerUnavailable
from tandem.wire.messages import FirstTokenReady, PrefillReservation, PrefillReserve, PrefillResult, SamplingParams
from tandem.wire.stats import Percentiles, WorkerStats

log = logging.getLogger(__name__)


class PrefillWorker:
    def __init__(self, worker_id: str, engine: LLMEngine, connector: Connector,
                 transfer_config: KVTransferConfig | None = None, reservation_timeout_s: float = 120.0,
                 clock: Callable[[], float] = time.monotonic, warmup: dict[str, Any] | None = None,
                 shared: SharedEngine | None = None, latency_window_s: float = DEFAULT_WINDOW_S):
        """`engine`: warmed up already where it wants to be (`warm_up`, whose result is `warmup`).
        `connector`: this actor's transport endpoint (a DistConnector; a FakeConnector in tests).
        `shared`: the loop, sender and receiver of a worker that also decodes over this engine
        (tandem.workers); it calls this part's hooks. None: this worker makes and runs its own.
        `reservation_timeout_s`: a reservation its router has not started by then is freed (the
        router crashed or lost it between the two calls, which are milliseconds apart); a late
        `start` is refused and its router prefills locally. `clock`: for that timeout and the
        reserve -> KV latency."""
        self.worker_id = worker_id
        self.engine = engine
        self.reservation_timeout_s = reservation_timeout_s
        self.clock = clock
        self._reservations_checked = 0.0
        self.warmup = warmup
        tcfg = transfer_config or KVTransferConfig(start_timeout_s=600.0)
        # a finished transfer wakes the loop, which hands the result over at once instead of at
        # its next idle poll (up to idle_wait_s later, on every remote first token)
        # the release callback only notes the end: it can fire inside a mid-step call (begin()
        # runs pending releases), and ending a transfer touches the scheduler, which the running
        # step owns until its outputs are in; `_before_step` handles the ends
        self._ended: list[str] = []
        # prefix pulls (the receiver): the decode actor's cached prefix of a session, which this actor lacks
        if shared is None:
            self.sender = LayerStreamSender(engine.kv_cache, connector, tcfg, on_release=self.sent_released,
                                            on_transition=self._wake)
            self.receiver = LayerStreamReceiver(engine.kv_cache, connector, tcfg, on_release=self.pull_released)
        else:
            self.sender, self.receiver = shared.sender, shared.receiver
        self.jobs: dict[str, PrefillJob] = {}   # transfer id -> its request's record
        # pull transfer id -> the transfer id whose blocks it lands in, while the pull is pending
        # or may still write into them (a pull may still be copying a layer after it is aborted)
        self._pull_owner: dict[str, str] = {}
        self.first_tokens = FirstTokenBoard()
        self.draining = False
        self.counters = {"prefills": 0, "prompt_tokens": 0, "computed_tokens": 0, "pulled_tokens": 0,
                         "transfer_failures": 0,
                         "kv_transfer_bytes": 0}
        self.transfer_times = TransferTimes()  # KV delivered, per transfer: the kv_transfer_seconds histogram
        self.latency = LatencyWindow(latency_window_s)  # reserve -> KV delivered: the part of TTFT this pool controls
        self._snapshot: WorkerStats | None = None
        self._owns_loop = shared is None
        if shared is not None:
            self.loop = shared.loop
            return
        self.loop = EngineLoop(engine, on_step=self.on_step, before_step=self._before_step,
                               layer_done=self.layer_done, on_step_error=self._fail_engine_requests,
                               name=f"{worker_id}-loop")
        self.loop.start()

    # ---- called from any thread ---------------------------------------------------------------
    def _wake(self) -> None:
        loop = getattr(self, "loop", None)
        if loop is not None:
            loop.wake()

    def reserve(self, req: PrefillReserve) -> PrefillReservation:
        """Take blocks for the prompt (its cached prefix shared). Answers `cached_tokens` and the
        prompt's `block_ids`; the router, which also holds the decode actor's answer (the two
        reserves run at once), slices the blocks to send and the prefix to pull from them.
        `req.sampling`: for its first output token (greedy when None)."""
        # reserve, expect_pull and start only make, admit and queue new requests: they run inside
        # a long prefill step once its kernels are queued, not after it (EngineLoop.call_mid_step)
        return self.loop.run_mid_step(self._reserve, req)

    def expect_pull(self, spec: TransferSpec, owner: str, covers_tokens: int) -> None:
        """Pull `spec` (a prefix of `owner`'s prompt, `covers_tokens` long) from the decode actor."""
        self.loop.run_mid_step(self._expect_pull, spec, owner, covers_tokens)

    def start(self, spec: TransferSpec, timeout_s: float = 600.0) -> PrefillResult:
        """Compute and send; returns when the transfer has ended (raises TransferFailed if it
        failed), with the first output token for the router to stream."""
        try:
            fut = self.loop.run_mid_step(self._start, spec)
        except BaseException as e:      # never started: a `first_token` waiter must not wait on
            self.first_tokens.resolve(spec.request_id, None, e)
            raise
        return fut.result(timeout_s)

    def first_token(self, transfer_id: str, timeout_s: float = 600.0) -> FirstTokenReady:
        """`transfer_id`'s first output token as soon as the step that completes the prompt has
        sampled it, before its last layers have landed on the decode actor. Raises if the transfer
        ends without one (failed, aborted)."""
        return self.first_tokens.wait(transfer_id, timeout_s)

    def abort(self, transfer_id: str) -> bool:
        return self.loop.run(self._abort, transfer_id)

    def stats(self) -> WorkerStats:
        """The latest snapshot, taken by the loop between steps: answers at once even while a long
        step runs (health checks must not wait for the engine)."""
        return self._snapshot or self.loop.run(self.collect_stats)

    def held(self) -> dict[str, str]:
        """Transfer id -> state of every request this worker holds anything for (tests, debugging)."""
        return self.loop.run(lambda: {t: j.state.value for t, j in self.jobs.items()})

    def kv_blocks_used(self) -> int:
        return self.loop.run(lambda: self.engine.allocator.num_used_blocks)

    def shutdown(self) -> None:
        if self._owns_loop:     # (a shared loop and transport: their owner stops them)
            self.loop.stop()
            self.sender.close()
            self.receiver.close()

    # ---- on the loop thread: reserve, pull, start ---------------------------------------------
    def _reserve(self, r: PrefillReserve) -> PrefillReservation:
        if self.draining:
            raise WorkerUnavailable(f"{self.worker_id} is draining")
        e = self.engine
        sp = r.sampling or SamplingParams(max_tokens=1)
        req = e.make_request(r.transfer_id, prompt_token_ids=r.prompt_token_ids, sampling=sp, prefill_only=True)
        n = req.num_prompt_tokens
        cached = e.allocator.num_cached_tokens(r.prompt_token_ids)
        if not e.allocator.admit(req, n - cached):
            raise WorkerUnavailable(f"{self.worker_id}: no free KV blocks for a {n}-token prefill")
        req.num_cached_prompt_tokens = req.num_computed_tokens
        self.jobs[r.transfer_id] = PrefillJob(r.transfer_id, req, reserved_at=self.clock())
        return PrefillReservation(cached, req.block_ids[:e.allocator.blocks_needed(n)])

    def _live_job(self, tid: str) -> PrefillJob:
        job = self.jobs.get(tid)
        if job is None or job.state is not PrefillState.RESERVED:
            raise NoReservation(f"{self.worker_id} holds no reservation for transfer {tid!r}: never "
                                f"made, aborted, or not started within {self.reservation_timeout_s:.0f} s")
        return job

    def _expect_pull(self, spec: TransferSpec, owner: str, covers: int) -> None:
        job = self._live_job(owner)
        job.add_pull(spec.request_id, covers)
        self._pull_owner[spec.request_id] = owner  # before expect: a failed one releases inside it
        try:
            self.receiver.expect(spec)
        except BaseException:
            job.drop_pull(spec.request_id)
            self._pull_owner.pop(spec.request_id, None)
            raise

    def _start(self, spec: TransferSpec) -> Future:
        job = self._live_job(spec.request_id)
        t0 = time.perf_counter()
        try:
            self.sender.begin(spec)
        except BaseException:         # a spec the sender refuses, or a closed sender: nothing was
            self._end(job)            # started, and nothing stays held
            raise
        fut: Future = Future()
        schedule = job.start(t0, fut)
        req = job.request
        self.counters["prefills"] += 1
        self.counters["prompt_tokens"] += req.num_prompt_tokens
        self.counters["kv_transfer_bytes"] += len(spec.src_block_ids) * self.engine.kv_cache.bytes_per_block
        if schedule:
            self._schedule(job)
        return fut

    def _schedule(self, job: PrefillJob) -> None:
        job.scheduled(time.perf_counter())
        req = job.request
        self.counters["computed_tokens"] += req.num_prompt_tokens - req.num_computed_tokens
        self.engine.scheduler.add_ready(req)

    # ---- on the loop thread: ending a request and freeing its blocks ---------------------------
    def _end(self, job: PrefillJob) -> None:
        """Free an ended request's blocks: its pending prefix pulls are aborted first, and while one
        may still write into them they stay PARKED until it lets go (`pull_released`)."""
        for pid in job.end():
            self.receiver.abort(pid)   # releases now, or once the layer being copied lands
            self._forget_pull(pid, job)
        if job.settle():
            self.engine.allocator.free(job.request)
            self._drop(job)

    def _drop(self, job: PrefillJob) -> None:
        if self.jobs.get(job.transfer_id) is job:
            del self.jobs[job.transfer_id]

    def _forget_pull(self, pid: str, job: PrefillJob) -> None:
        if pid not in job.pulls and pid not in job.holds:
            self._pull_owner.pop(pid, None)

    def _pull_job(self, pid: str) -> PrefillJob | None:
        tid = self._pull_owner.get(pid)
        return self.jobs.get(tid) if tid is not None else None

    def pull_released(self, pid: str) -> None:
        """Pull `pid` writes no more into its request's blocks (failed, aborted or landed)."""
        job = self._pull_job(pid)
        if job is None:
            self._pull_owner.pop(pid, None)
            return
        if job.let_go(pid):
            self.engine.allocator.free(job.request)
            self._drop(job)
        self._forget_pull(pid, job)

    def _abort(self, tid: str) -> bool:
        job = self.jobs.get(tid)
        if job is None:
            return False
        if job.state is PrefillState.RESERVED:
            self._end(job)
            return True
        if job.started:
            self.sender.abort(tid)  # the release callback ends it and fails the waiter
            return True
        return False

    # ---- on the loop thread: between steps (the hooks a shared loop's owner calls) -------------
    def _before_step(self) -> None:
        self.sender.reap()
        self.pulls_ended(self.receiver.reap() if self._pull_owner else [])
        self.between_steps()

    def between_steps(self) -> None:
        """After the transport's ends are handled: hand ended transfers over, expire reservations,
        take the stats snapshot."""
        while self._ended:
            self._transfer_ended(self._ended.pop(0))
        self._expire_reservations()
        self._snapshot = self.collect_stats()

    def sent_released(self, tid: str) -> None:
        """The sender's release callback: only notes the end (`between_steps` handles it)."""
        self._ended.append(tid)

    def owns(self, request_id: str) -> bool:
        return request_id in self.jobs

    def sending(self) -> bool:
        """A started prefill may be in the next step: it needs the per-layer hook."""
        return any(j.started for j in self.jobs.values())

    def _expire_reservations(self) -> None:
        now = self.clock()
        if now - self._reservations_checked < min(1.0, self.reservation_timeout_s / 4):
            return
        self._reservations_checked = now
        for job in [j for j in self.jobs.values() if j.expired(now, self.reservation_timeout_s)]:
            log.warning("reservation %s not started after %.0f s: freeing its KV blocks", job.transfer_id,
                        self.reservation_timeout_s)
            self._abort(job.transfer_id)
            self.counters["reservations_expired"] = self.counters.get("reservations_expired", 0) + 1

    def pulls_ended(self, reaped: list[tuple[str, TransferState]]) -> None:
        """The receiver's ended transfers (`reap()`); those that are not this part's pulls are
        ignored (a shared receiver also carries the decode part's KV)."""
        if not self._pull_owner:
            return
        for pid, state in reaped:
            if state is TransferState.DONE:
                self.pull_released(pid)     # (failed ones did, in the release callback)
            job = self._pull_job(pid)
            if job is None:
                continue
            if state is TransferState.DONE:
                landed = job.pull_landed(pid)
                if landed is not None and not job.request.finished:
                    self._use_pulled_prefix(job, *landed)
            elif job.pull_failed(pid) and not job.request.finished:
                self.sender.abort(job.transfer_id)  # fails the main transfer too; its release frees the blocks
            # (a pull that failed before `start`: the request computes its prefix itself)
            self._forget_pull(pid, job)

    def _use_pulled_prefix(self, job: PrefillJob, covers: int, schedule: bool) -> None:
        req = job.request
        req.num_computed_tokens = covers
        req.num_cached_prompt_tokens = covers
        self.engine.allocator.register_full_blocks(req)
        self.counters["pulled_tokens"] += covers
        if schedule:     # started already; a pull that lands before `start`: `_start` schedules it
            self._schedule(job)

    def layer_done(self, layer: int, sched) -> None:
        for s in sched.scheduled:
            r = s.request
            if r.prefill_only and s.completes and self._sending(r.request_id):
                self.sender.send_layer(r.request_id, layer)

    def _sending(self, tid: str) -> PrefillJob | None:
        job = self.jobs.get(tid)
        return job if job is not None and job.started else None

    def on_step(self, outputs) -> None:
        # completions are tracked through the transfer; a step's outputs carry first tokens
        for o in outputs:
            job = self._sending(o.request_id) if o.first is not None else None
            if job is not None:
                job.first = o.first
                self.first_tokens.resolve(job.transfer_id, FirstTokenReady(o.first, _timings(
                    job, "queue+compute")))

    def _transfer_ended(self, tid: str) -> None:
        job = self._sending(tid)
        if job is None:
            return
        if tid in self.engine.scheduler.requests:  # ended before its compute finished
            self.engine.scheduler.abort(tid)        # (its pulls had all landed)
        self._end(job)
        state = self.sender.poll(tid)
        if job.first is None:       # ended before its first token (else `on_step` resolved it)
            self.first_tokens.resolve(tid, None, TransferFailed(f"KV transfer {tid} {state.value} without a "
                                                                f"first token"))
        if state is TransferState.DONE:
            self.latency.add(self.clock(), self.clock() - job.reserved_at)
            if job.started_at is not None:
                self.transfer_times.record(time.perf_counter() - job.started_at)
            req = job.request
            job.done.set_result(PrefillResult(req.num_cached_prompt_tokens,
                                              req.num_prompt_tokens - req.num_cached_prompt_tokens,
                                              job.first, _timings(job, "queue+compute+send")))
        else:
            self.counters["transfer_failures"] += 1
            try:
                self.sender.wait(tid, 0)
                why = ""
            except Exception as e:  # noqa: BLE001 - the typed error says why it ended
                why = f": {e}"
            job.done.set_exception(TransferFailed(f"KV transfer {tid} {state.value}{why}"))

    def fail_own_requests(self, exc: BaseException) -> None:
        """A step raised: the prefills it was computing are aborted (their transfers end, the
        decode side frees its blocks, and each router prefills locally instead)."""
        own = [tid for tid in self.engine.scheduler.requests if tid in self.jobs]
        log.warning("failing %d prefills after a step error: %s", len(own), exc)
        for tid in own:
            if not self._abort(tid):
                self.engine.abort(tid)
        self.counters["step_failures"] = self.counters.get("step_failures", 0) + 1

    def _fail_engine_requests(self, exc: BaseException) -> None:
        self.fail_own_requests(exc)
        for rid in [r for r in self.engine.scheduler.requests if r not in self.jobs]:
            self.engine.abort(rid)     # nobody's: nothing waits for it

    def collect_stats(self) -> WorkerStats:
        """On the loop thread: the stats as of now (`stats()` answers the latest of these)."""
        e = self.engine
        a = e.allocator
        reserved = sum(1 for j in self.jobs.values() if j.state is PrefillState.RESERVED)
        started = sum(1 for j in self.jobs.values() if j.started)
        return WorkerStats(
            self.worker_id, "prefill", running=len(e.scheduler.running),
            waiting=len(e.scheduler.waiting) + len(e.scheduler.ready) + reserved,
            queued_prompt_tokens=sum(r.num_tokens - r.num_computed_tokens
                                     for r in list(e.scheduler.running) + list(e.scheduler.ready)),
            in_flight=started + reserved, kv_blocks_used=a.num_used_blocks, kv_blocks_total=a.num_blocks,
            prefix_queries=a.prefix_queries, prefix_hits=a.prefix_hits, tokens_computed=e.stats.tokens_computed,
            **e.stats.prompt_counters(),
            steps=e.stats.steps, busy_s=self.loop.busy_s, draining=self.draining,
            prefill_latency=Percentiles(**self.latency.percentiles(self.clock())),
            loop_error=repr(self.loop.error) if self.loop.error else None,
            last_step_error=self.loop.last_step_error, warmup_s=self.warmup["seconds"] if self.warmup else 0.0,
            slow_steps=self.loop.slow_steps, mid_step_calls=self.loop.mid_step_calls,
            late_compiles=compile_watch.late, cuda_graphs=e.runner.graph_stats,
            **self.counters, **self.transfer_times.stats())


def warm_up(engine: LLMEngine, worker_id: str) -> dict[str, Any] | None:
    """Kernels compiled before the first request, not inside it (where the engine wants it: on
    CUDA); one output token per warmup request: a prefill actor's steps are never decode-shaped, so
    it needs no decode graphs. The actor runs it before it joins the transport."""
    if not engine.wants_warmup:
        return None
    result = engine.warmup(decode_tokens=1)
    log.info("%s warmed up in %.1f s (CUDA_MODULE_LOADING=%s): %s", worker_id, result["seconds"],
             os.environ.get("CUDA_MODULE_LOADING"), result)
    return result


def _timings(job: PrefillJob, last: str) -> dict[str, float]:
    """Where a prefill's time went: its prefix pull, then `last` (until now)."""
    if job.started_at is None or job.scheduled_at is None:
        return {}
    return {"prefix pull": job.scheduled_at - job.started_at, last: time.perf_counter() - job.scheduled_at}
