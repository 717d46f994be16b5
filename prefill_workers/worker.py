"""The prefill worker: computes prompts' KV with its own prefix cache (only the uncached part,
in chunks under the step's token budget) and streams each layer's KV to a decode actor as soon as
that layer is done in the step that completes the prompt.

A request's stages here, in order:
1. `reserve(tokens)`: take blocks for the prompt (its cached prefix included) and answer with
   them and how much was cached (the router, asking the decode actor at the same time, picks the
   range to send and any prefix the decode actor holds that this actor should pull, `expect_pull`).
2. `start(spec)`: begin the transfer, schedule the prompt, and wait: each layer of the final step
   is sent as that layer finishes (earlier chunks' KV of that layer goes in the same message).
   The step that completes the prompt also samples the request's first output token with its own
   sampling parameters: `first_token` returns it at once (the router streams it while the last
   layers are still on the wire), and `start` returns it again once the KV has arrived.
3. When the transfer ends (done, failed or aborted), the request's blocks are released; the
   prefix stays in this actor's cache for the session's next turn.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
from concurrent.futures import Future
from typing import Any

from tandem.runtime.latency import LatencyWindow
from tandem.runtime.metrics import TransferTimes
from tandem.engine.config import EngineConfig
from tandem.engine.engine import LLMEngine
from tandem.engine.request import Request, SamplingParams, WorkerUnavailable
from tandem.engine.kernels.compile_watch import watch as compile_watch
from tandem.engine.serving_loop import EngineLoop

log = logging.getLogger(__name__)


class PrefillWorker:
    def __init__(self, worker_id: str, engine_config: EngineConfig, rendezvous: str,
                 transfer_config=None, engine: LLMEngine | None = None, reservation_timeout_s: float = 120.0):
        """`reservation_timeout_s`: a reservation its router has not started by then is freed (the
        router crashed or lost it between the two calls, which are milliseconds apart); a late
        `start` is refused and its router prefills locally."""
        self.reservation_timeout_s = reservation_timeout_s
        self._reservations_checked = 0.0
        from tandem.kv_transfer.base import KVTransferConfig
        from tandem.kv_transfer.torch_dist import DistConnector, make_dist_receiver, make_dist_sender

        self.worker_id = worker_id
        self.engine = engine or LLMEngine(engine_config)
        # kernels compiled before the first request, not inside it; one output token per warmup
        # request: a prefill actor's steps are never decode-shaped, so it needs no decode graphs
        self.warmup = self.engine.warmup(decode_tokens=1) if self.engine.wants_warmup else None
        if self.warmup is not None:
            log.info("%s warmed up in %.1f s (CUDA_MODULE_LOADING=%s): %s", worker_id, self.warmup["seconds"],
                     os.environ.get("CUDA_MODULE_LOADING"), self.warmup)
        tcfg = transfer_config or KVTransferConfig(start_timeout_s=600.0)
        conn = DistConnector(worker_id, rendezvous, self.engine.kv_cache.device, tcfg)
        # a finished transfer wakes the loop, which hands the result over at once instead of at
        # its next idle poll (up to idle_wait_s later, on every remote first token)
        # the release callback only notes the end: it can fire inside a mid-step call (begin()
        # runs pending releases), and ending a transfer touches the scheduler, which the running
        # step owns until its outputs are in; `_before_step` handles the ends
        self._ended: list[str] = []
        self.sender = make_dist_sender(worker_id, self.engine.kv_cache, conn, tcfg, on_release=self._ended.append,
                                       on_transition=self._wake)
        # prefix pulls: the decode actor's cached prefix of a session, which this actor lacks
        self.receiver = make_dist_receiver(worker_id, self.engine.kv_cache, conn, tcfg,
                                           on_release=self._let_go_of_pull)
        self.pulling: dict[str, tuple[str, int]] = {}  # pull transfer id -> (transfer id, tokens it covers)
        # A pull may still be copying a layer into its request's blocks after it is aborted: its
        # blocks are freed only once the receiver lets go of them (release callback for a failed
        # or aborted pull, reap for one that landed meanwhile).
        self._pull_holds: dict[str, str] = {}  # pull transfer id -> transfer id whose blocks it may write
        self._parked: dict[str, Request] = {}  # transfer id -> ended request, freed when no pull holds it
        self.reserved: dict[str, Request] = {}  # transfer id -> request (blocks held)
        self.active: dict[str, Request] = {}  # transfer id -> request scheduled / sending
        self.done: dict[str, Future] = {}
        self.draining = False
        self.counters = {"prefills": 0, "prompt_tokens": 0, "computed_tokens": 0, "pulled_tokens": 0,
                         "transfer_failures": 0,
                         "kv_transfer_bytes": 0}
        self.transfer_times = TransferTimes()  # KV delivered, per transfer: the kv_transfer_seconds histogram
        self._started: dict[str, float] = {}
        self._scheduled_at: dict[str, float] = {}  # prefix pulled (if any): queued for compute
        self._first: dict[str, dict[str, Any]] = {}  # transfer id -> first output token (engine.RequestOutput.first)
        # transfer id -> the first token's future, made by whichever of `first_token` (the router's
        # call) and the loop comes first; resolved ones nobody asked for are dropped oldest first
        self._first_ready: collections.OrderedDict[str, Future] = collections.OrderedDict()
        self._first_lock = threading.Lock()
        self.latency = LatencyWindow()  # reserve -> KV delivered: the part of TTFT this pool controls
        self._reserved_at: dict[str, float] = {}
        self._snapshot: dict[str, Any] | None = None
        self.loop = EngineLoop(self.engine, on_step=self._on_step, before_step=self._before_step,
                               layer_done=self._layer_done, on_step_error=self._fail_engine_requests,
                               name=f"{worker_id}-loop")
        self.loop.start()

    # ---- called from any thread ---------------------------------------------------------------
    def _wake(self) -> None:
        loop = getattr(self, "loop", None)
        if loop is not None:
            loop.wake()

    def reserve(self, transfer_id: str, prompt_token_ids: list[int],
                sampling: dict[str, Any] | None = None) -> dict[str, Any]:
        """Take blocks for the prompt (its cached prefix shared). Answers `cached_tokens` and the
        prompt's `block_ids`; the router, which also holds the decode actor's answer (the two
        reserves run at once), slices the blocks to send and the prefix to pull from them.
        `sampling`: the request's sampling parameters, for its first output token (greedy when
        None)."""
        # reserve, expect_pull and start only make, admit and queue new requests: they run inside
        # a long prefill step once its kernels are queued, not after it (EngineLoop.call_mid_step)
        return self.loop.run_mid_step(self._reserve, transfer_id, prompt_token_ids, sampling)

    def expect_pull(self, spec_msg: dict[str, Any], covers_tokens: int) -> None:
        self.loop.run_mid_step(self._expect_pull, spec_msg, covers_tokens)

    def start(self, spec_msg: dict[str, Any], timeout_s: float = 600.0) -> dict[str, Any]:
        """Compute and send; returns when the transfer has ended (raises if it failed), with the
        first output token (`first`, see engine.RequestOutput) for the router to stream."""
        try:
            fut = self.loop.run_mid_step(self._start, spec_msg)
        except BaseException as e:      # never started: a `first_token` waiter must not wait on
            self._resolve_first(spec_msg["request_id"], None, e)
            raise
        return fut.result(timeout_s)

    def first_token(self, transfer_id: str, timeout_s: float = 600.0) -> dict[str, Any]:
        """`{"first": engine.RequestOutput.first, "timings": {...}}` for `transfer_id`'s prompt as
        soon as the step that completes the prompt has sampled its first output token, before its
        last layers have landed on the decode actor. Raises if the transfer ends without one
        (failed, aborted)."""
        fut = self._first_future(transfer_id)
        try:
            return fut.result(timeout_s)
        finally:
            with self._first_lock:
                self._first_ready.pop(transfer_id, None)

    def abort(self, transfer_id: str) -> bool:
        return self.loop.run(self._abort, transfer_id)

    def stats(self) -> dict[str, Any]:
        """The latest snapshot, taken by the loop between steps: answers at once even while a long
        step runs (health checks must not wait for the engine)."""
        return self._snapshot or self.loop.run(self._stats)

    def shutdown(self) -> None:
        self.loop.stop()
        self.sender.close()
        self.receiver.close()

    # ---- on the loop thread -------------------------------------------------------------------
    def _reserve(self, tid: str, ids: list[int], sampling: dict[str, Any] | None = None) -> dict[str, Any]:
        if self.draining:
            raise WorkerUnavailable(f"{self.worker_id} is draining")
        e = self.engine
        sp = SamplingParams(**sampling) if sampling else SamplingParams(max_tokens=1)
        req = e.make_request(tid, prompt_token_ids=ids, sampling=sp, prefill_only=True)
        n = req.num_prompt_tokens
        cached = e.allocator.num_cached_tokens(ids)
        if not e.allocator.admit(req, n - cached):
            raise WorkerUnavailable(f"{self.worker_id}: no free KV blocks for a {n}-token prefill")
        req.num_cached_prompt_tokens = req.num_computed_tokens
        self.reserved[tid] = req
        self._reserved_at[tid] = time.monotonic()
        return {"cached_tokens": cached, "block_ids": req.block_ids[:e.allocator.blocks_needed(n)]}

    def _expect_pull(self, spec_msg: dict[str, Any], covers: int) -> None:
        from tandem.kv_transfer.base import TransferSpec

        spec = TransferSpec.from_msg(spec_msg)
        owner = spec_msg["owner"]
        self.pulling[spec.request_id] = (owner, covers)
        self._pull_holds[spec.request_id] = owner    # before expect: a failed one releases inside it
        try:
            self.receiver.expect(spec)
        except BaseException:
            self.pulling.pop(spec.request_id, None)
            self._pull_holds.pop(spec.request_id, None)
            raise

    def _free(self, tid: str, req: Request) -> None:
        """Free an ended request's blocks: its prefix pulls are aborted first, and while one may
        still write into them they are parked until it lets go (`_let_go_of_pull`)."""
        for pid, (owner, _) in list(self.pulling.items()):
            if owner == tid:
                del self.pulling[pid]
                self.receiver.abort(pid)   # releases now, or once the layer being copied lands
        if tid in self._pull_holds.values():
            self._parked[tid] = req
        else:
            self.engine.allocator.free(req)

    def _let_go_of_pull(self, pid: str) -> None:
        """Pull `pid` writes no more into its request's blocks (failed, aborted or landed)."""
        tid = self._pull_holds.pop(pid, None)
        if tid in self._parked and tid not in self._pull_holds.values():
            self.engine.allocator.free(self._parked.pop(tid))

    def _before_step(self) -> None:
        self._poll_transfers()
        while self._ended:
            self._transfer_ended(self._ended.pop(0))
        self._expire_reservations()
        self._snapshot = self._stats()

    def _expire_reservations(self) -> None:
        now = time.monotonic()
        if now - self._reservations_checked < min(1.0, self.reservation_timeout_s / 4):
            return
        self._reservations_checked = now
        for tid in [t for t in self.reserved if now - self._reserved_at.get(t, now) > self.reservation_timeout_s]:
            log.warning("reservation %s not started after %.0f s: freeing its KV blocks", tid,
                        self.reservation_timeout_s)
            self._abort(tid)
            self.counters["reservations_expired"] = self.counters.get("reservations_expired", 0) + 1

    def _poll_transfers(self) -> None:
        self.sender.reap()
        if not (self.pulling or self._pull_holds):
            return
        from tandem.kv_transfer.base import TransferState

        for pid, state in self.receiver.reap():
            if state is TransferState.DONE:
                self._let_go_of_pull(pid)     # (failed ones did, in the release callback)
            owner, covers = self.pulling.pop(pid, (None, 0))
            started = owner in self.active
            # a pull can land before the router's `start` (a fast link): `_start` schedules it then
            req = self.active.get(owner) if started else self.reserved.get(owner)
            if req is None or req.finished:
                continue
            if state is TransferState.DONE:
                req.num_computed_tokens = covers
                req.num_cached_prompt_tokens = covers
                self.engine.allocator.register_full_blocks(req)
                self.counters["pulled_tokens"] += covers
                if started:
                    self._schedule(req)
            elif started:
                self.sender.abort(owner)  # fails the main transfer too; its release frees the blocks
            # (a pull that failed before `start`: the request computes its prefix itself)

    def _start(self, spec_msg: dict[str, Any]) -> Future:
        from tandem.kv_transfer.base import TransferSpec

        spec = TransferSpec.from_msg(spec_msg)
        req = self.reserved.pop(spec.request_id, None)
        if req is None:
            raise KeyError(f"{self.worker_id} holds no reservation for transfer {spec.request_id!r}: never "
                           f"made, aborted, or not started within {self.reservation_timeout_s:.0f} s")
        t0 = time.perf_counter()
        try:
            self.sender.begin(spec)
        except BaseException:         # a spec the sender refuses, or a closed sender: nothing was
            self._reserved_at.pop(spec.request_id, None)      # started, and nothing stays held
            self._free(spec.request_id, req)
            raise
        fut: Future = Future()
        self.done[spec.request_id] = fut
        self.active[spec.request_id] = req
        self._started[spec.request_id] = t0
        self.counters["prefills"] += 1
        self.counters["prompt_tokens"] += req.num_prompt_tokens
        self.counters["kv_transfer_bytes"] += len(spec.src_block_ids) * self.engine.kv_cache.bytes_per_block
        if not any(owner == spec.request_id for owner, _ in self.pulling.values()):
            self._schedule(req)
        return fut

    def _schedule(self, req: Request) -> None:
        self._scheduled_at[req.request_id] = time.perf_counter()
        self.counters["computed_tokens"] += req.num_prompt_tokens - req.num_computed_tokens
        self.engine.scheduler.add_ready(req)

    def _layer_done(self, layer: int, sched) -> None:
        for s in sched.scheduled:
            r = s.request
            if r.prefill_only and s.completes and r.request_id in self.active:
                self.sender.send_layer(r.request_id, layer)

    def _on_step(self, outputs) -> None:
        # completions are tracked through the transfer; a step's outputs carry first tokens
        for o in outputs:
            if o.first is not None and o.request_id in self.active:
                tid, now = o.request_id, time.perf_counter()
                self._first[tid] = o.first
                t0, t_sched = self._started.get(tid), self._scheduled_at.get(tid)
                timings = ({"prefix pull": t_sched - t0, "queue+compute": now - t_sched}
                           if t0 is not None and t_sched is not None else {})
                self._resolve_first(tid, {"first": o.first, "timings": timings})

    def _first_future(self, tid: str) -> Future:
        with self._first_lock:
            fut = self._first_ready.get(tid)
            if fut is None:
                fut = self._first_ready[tid] = Future()
                if len(self._first_ready) > 4096:        # resolved long ago and never asked for
                    for old in [t for t, f in self._first_ready.items() if f.done()][:1024]:
                        del self._first_ready[old]
            return fut

    def _resolve_first(self, tid: str, first: dict[str, Any] | None, error: BaseException | None = None) -> None:
        fut = self._first_future(tid)
        if not fut.done():
            if first is not None:
                fut.set_result(first)
            else:
                fut.set_exception(error or RuntimeError(f"transfer {tid} ended without a first token"))

    def _transfer_ended(self, tid: str) -> None:
        req = self.active.pop(tid, None)
        if req is None:
            return
        if req.request_id in self.engine.scheduler.requests:  # ended before its compute finished
            self.engine.scheduler.abort(tid)                    # (its pulls had all landed)
        else:
            self._free(tid, req)
        state = self.sender.poll(tid)
        t0 = self._started.pop(tid, None)
        t_sched = self._scheduled_at.pop(tid, None)
        first = self._first.pop(tid, None)
        if first is None:       # ended before its first token (else `_on_step` resolved it)
            self._resolve_first(tid, None, RuntimeError(f"KV transfer {tid} {state.value} without a first token"))
        fut = self.done.pop(tid, None)
        from tandem.kv_transfer.base import TransferState

        r0 = self._reserved_at.pop(tid, None)
        if state is TransferState.DONE:
            if r0 is not None:
                self.latency.add(time.monotonic(), time.monotonic() - r0)
            if t0 is not None:
                self.transfer_times.record(time.perf_counter() - t0)
            if fut is not None:
                now = time.perf_counter()
                timings = {}
                if t0 is not None and t_sched is not None:
                    timings = {"prefix pull": t_sched - t0, "queue+compute+send": now - t_sched}
                fut.set_result({"cached_tokens": req.num_cached_prompt_tokens,
                                "computed_tokens": req.num_prompt_tokens - req.num_cached_prompt_tokens,
                                "timings": timings, "first": first})
        else:
            self.counters["transfer_failures"] += 1
            if fut is not None:
                try:
                    self.sender.wait(tid, 0)
                    why = ""
                except Exception as e:  # noqa: BLE001 - the typed error says why it ended
                    why = f": {e}"
                fut.set_exception(RuntimeError(f"KV transfer {tid} {state.value}{why}"))

    def _fail_engine_requests(self, exc: BaseException) -> None:
        """A step raised: the prefills it was computing are aborted (their transfers end, the
        decode side frees its blocks, and each router prefills locally instead)."""
        log.warning("failing %d prefills after a step error: %s", len(self.engine.scheduler.requests), exc)
        for tid in list(self.engine.scheduler.requests):
            if not self._abort(tid):
                self.engine.abort(tid)
        self.counters["step_failures"] = self.counters.get("step_failures", 0) + 1

    def _abort(self, tid: str) -> bool:
        req = self.reserved.pop(tid, None)
        if req is not None:
            self._reserved_at.pop(tid, None)
            self._free(tid, req)
            return True
        if tid in self.active:
            self.sender.abort(tid)  # the release callback frees and fails the waiter
            return True
        return False

    def _stats(self) -> dict[str, Any]:
        e = self.engine
        a = e.allocator
        return {"worker_id": self.worker_id, "pool": "prefill", "running": len(e.scheduler.running),
                "waiting": len(e.scheduler.waiting) + len(e.scheduler.ready) + len(self.reserved),
                "queued_prompt_tokens": sum(r.num_tokens - r.num_computed_tokens
                                            for r in list(e.scheduler.running) + list(e.scheduler.ready)),
                "in_flight": len(self.active) + len(self.reserved),
                "kv_blocks_used": a.num_used_blocks, "kv_blocks_total": a.num_blocks,
                "prefix_queries": a.prefix_queries, "prefix_hits": a.prefix_hits,
                "tokens_computed": e.stats.tokens_computed, "steps": e.stats.steps,
                "busy_s": self.loop.busy_s, "draining": self.draining,
                "prefill_latency": self.latency.percentiles(time.monotonic()),
                "loop_error": repr(self.loop.error) if self.loop.error else None,
                "last_step_error": self.loop.last_step_error,
                "warmup_s": self.warmup["seconds"] if self.warmup else 0.0, "slow_steps": self.loop.slow_steps,
                "mid_step_calls": self.loop.mid_step_calls,
                "late_compiles": compile_watch.late,
                "cuda_graphs": e.runner.graph_stats, **self.counters, **self.transfer_times.stats()}
