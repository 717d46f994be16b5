"""The decode worker: continuous batching over one engine, fed either by its own prefill (short
uncached suffixes) or by KV that a prefill actor streams into blocks it reserved.

A request's stages here, in order (its record, `DecodeRequest`, names them as states):
1. `reserve(DecodeReserve)`: validate; look the prompt up in the prefix cache; if the uncached part
   is at most the local-prefill threshold (or remote prefill is not offered), queue it for local
   prefill (IN_ENGINE); otherwise take blocks for the whole prompt and answer with the block ids
   the KV must land in (RESERVED).
2. `expect`: register the transfer spec with the KV receiver (before the prefill actor sends);
   RECEIVING. (`reserve` does it itself when the router names the prefill actor.)
3. The KV of the whole prompt arrives (polled between steps), and the router hands over the first
   output token the prefill actor sampled (`first_token`, after streaming it to the client). With
   both (KV_READY waits for the token), the request joins the running batch (IN_ENGINE); its next
   step computes that token and samples the second.
4. Each step's new tokens for all sequences go to their routers as one message per router.
A failed or aborted transfer frees the reserved blocks (RELEASING while the receiver may still
write into them) and ends the request with an error.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from typing import Any, Callable

from tandem.decode_workers.moves import SequenceMoves
from tandem.decode_workers.moves_in import MovesIn
from tandem.decode_workers.outboxes import Outboxes
from tandem.decode_workers.records import AbortAction, DecodeRequest, DecodeState, FirstTokenTaken
from tandem.engine.engine import LLMEngine, RequestOutput
from tandem.engine.kernels.compile_watch import watch as compile_watch
from tandem.engine.serving_loop import EngineLoop
from tandem.kv_transfer.base import TransferState
from tandem.kv_transfer.spec import TransferSpec
from tandem.kv_transfer.config import KVTransferConfig
from tandem.kv_transfer.link import Connector
from tandem.kv_transfer.receiver import LayerStreamReceiver
from tandem.kv_transfer.sender import LayerStreamSender
from tandem.kv_transfer.shared import SharedEngine
from tandem.placement import wants_remote_prefill
from tandem.runtime.latency import DEFAULT_WINDOW_S, LatencyWindow
from tandem.runtime.metrics import TransferTimes
from tandem.wire.errors import NoReservation, WorkerUnavailable
from tandem.wire.messages import (DecodePlan, DecodeReserve, FirstToken, Output, OutputError, SamplingParams,
                                  StepOutput)
from tandem.wire.stats import Percentiles, WorkerStats

log = logging.getLogger(__name__)


class DecodeWorker:
    def __init__(self, worker_id: str, engine: LLMEngine, connector: Connector | None = None,
                 local_prefill_threshold: float = 256, transfer_config: KVTransferConfig | None = None,
                 router_timeout_s: float = 30.0, clock: Callable[[], float] = time.monotonic,
                 warmup: dict[str, Any] | None = None, shared: SharedEngine | None = None,
                 latency_window_s: float = DEFAULT_WINDOW_S):
        """`engine`: warmed up already where it wants to be (`warm_up`, whose result is `warmup`).
        `connector`: this actor's transport endpoint (a DistConnector; a FakeConnector in tests;
        None: no remote prefill). `shared`: the loop, sender and receiver of a worker that also
        prefills for others over this engine (tandem.workers); it calls this part's hooks. `router_timeout_s`: a router that has not asked for its outputs
        for this long is gone (live routers ask every 0.5 s); its requests are aborted and their KV
        freed. `clock`: for that timeout and TPOT."""
        self.worker_id = worker_id
        self.engine = engine
        self.router_timeout_s = router_timeout_s
        self.clock = clock
        self._routers_checked = 0.0
        self.warmup = warmup
        self.threshold = local_prefill_threshold
        self.block_size = engine.allocator.block_size
        self.receiver = self.sender = None
        if shared is not None:
            self.receiver, self.sender = shared.receiver, shared.sender
        elif connector is not None:
            tcfg = transfer_config or KVTransferConfig(start_timeout_s=600.0)
            self.receiver = LayerStreamReceiver(engine.kv_cache, connector, tcfg, on_release=self.kv_released,
                                                on_transition=self._wake)
            # prefix pulls: a prefill actor asks for the session's cached prefix it lacks
            self.sender = LayerStreamSender(engine.kv_cache, connector, tcfg, on_release=self.sent_released)
        self.requests: dict[str, DecodeRequest] = {}   # request id -> its record
        # transfer id -> the record whose KV it carries, while it is on the way or the receiver may
        # still write into its blocks (an aborted request leaves `requests` at once, and may be
        # placed here again under the same id, while its old transfer's blocks are not free yet)
        self._by_transfer: dict[str, DecodeRequest] = {}
        self.outboxes = Outboxes(clock)
        self.draining = False
        self.moves = SequenceMoves(self)   # running sequences moved out with their KV
        self.moves_in = MovesIn(self)      # ... and in
        self.counters = {"requests": 0, "remote_prefills": 0, "local_prefills": 0, "transfer_failures": 0,
                         "kv_transfer_bytes": 0, "sequences_migrated_in": 0, "tokens_recomputed": 0}
        self.transfer_times = TransferTimes()  # KV landed, per transfer: the kv_transfer_seconds histogram
        self.tpot = LatencyWindow(latency_window_s)
        self._snapshot: WorkerStats | None = None
        self._owns_loop = shared is None
        if shared is not None:
            self.loop = shared.loop
            return
        self.loop = EngineLoop(engine, on_step=self.publish, before_step=self._before_step,
                               on_step_error=self._fail_engine_requests, name=f"{worker_id}-loop")
        self.loop.start()

    # ---- called from any thread ---------------------------------------------------------------
    def _wake(self) -> None:
        """A transfer ended: admit it now rather than at the idle loop's next poll."""
        loop = getattr(self, "loop", None)
        if loop is not None:
            loop.wake()

    def reserve(self, req: DecodeReserve) -> DecodePlan:
        """`req.transfer_id` set: remote prefill is on offer under that transfer id.
        `req.prefill_id`: the prefill actor the router will ask first; a remote reservation then
        also registers the receive from it (the plan says `expecting`), which saves the router an
        `expect` call (and its wait for this loop's current step) on every remote prefill."""
        # makes and admits a new request (or queues a local prefill): it may run inside a step once
        # its kernels are queued, instead of after it (EngineLoop.call_mid_step)
        return self.loop.run_mid_step(self._reserve, req)

    def expect(self, spec: TransferSpec) -> None:
        self.loop.run(self._expect, spec)

    def abort(self, request_id: str) -> bool:
        return self.loop.run(self._abort, request_id)

    def first_token(self, request_id: str, first: FirstToken) -> bool:
        """The first output token of a remote-prefilled request, which its router has streamed
        already. False if the request is gone (aborted meanwhile)."""
        return self.loop.run(self._first_token, request_id, first)

    def send_prefix(self, spec: TransferSpec) -> None:
        """Send cached prefix blocks of a reserved request to the prefill actor that will extend it."""
        self.loop.run(self.sender.send, spec)  # the blocks stay held by the reserved request meanwhile

    def move_out(self, count: int | None = None) -> int:
        """Offer up to `count` decoding sequences (None: all) to their routers to move them to
        another decode actor with their KV (decode_workers/moves.py); -> how many."""
        return self.loop.run(self.moves.offer_some, count)

    def start_move(self, request_id: str, precopy: TransferSpec | None, tail: TransferSpec, first_block: int) -> None:
        """A sequence offered to move (`move_out`) has blocks reserved on another decode actor:
        send its full blocks from `first_block` on there now (`precopy`), and the rest (`tail`)
        once it pauses (decode_workers/moves.py). It may run inside a step: full blocks are
        written by no step, so a GPU step in flight does not delay the pre-copy."""
        self.loop.run_mid_step(self.moves.start, request_id, precopy, tail, first_block)

    def take_moved(self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams,
                   handoff: FirstToken) -> bool:
        """A sequence moving here paused where it ran: it joins the batch from `handoff` once its
        KV has landed (decode_workers/moves_in.py); False when its reservation is gone."""
        return self.loop.run_mid_step(self.moves_in.take_moved, request_id, prompt_token_ids, sampling, handoff)

    def resume(self, request_id: str) -> bool:
        """A sequence offered to move continues here (its router found nowhere to move it): a
        paused one is queued for the next step, as an admission is."""
        return self.loop.run_mid_step(self.moves.resume, request_id)

    def sent_released(self, tid: str) -> None:
        self.moves.released(tid)

    def stats(self) -> WorkerStats:
        """The latest snapshot, taken by the loop between steps: answers at once even while a long
        step runs (health checks must not wait for the engine)."""
        return self._snapshot or self.loop.run(self.collect_stats)

    def get_outputs(self, router_id: str, timeout_s: float = 1.0) -> list[Output]:
        """Everything produced for `router_id` since the last call (one list entry per step),
        waiting up to `timeout_s` for the first."""
        return self.outboxes.take(router_id, timeout_s)

    def held(self) -> dict[str, str]:
        """Request id (and transfer id, while its KV may still land) -> state, of every request
        this worker holds anything for (tests, debugging)."""
        def snapshot() -> dict[str, str]:
            out = {rid: r.state.value for rid, r in self.requests.items()}
            out.update({tid: r.state.value for tid, r in self._by_transfer.items()})
            return out
        return self.loop.run(snapshot)

    def kv_blocks_used(self) -> int:
        return self.loop.run(lambda: self.engine.allocator.num_used_blocks)

    def shutdown(self) -> None:
        if not self._owns_loop:   # a shared loop and transport: their owner stops them
            return
        self.loop.stop()
        for end in (self.sender, self.receiver):
            if end is not None:
                end.close()

    # ---- on the loop thread: placing a request ------------------------------------------------
    def _reserve(self, r: DecodeReserve) -> DecodePlan:
        if self.draining and r.replaces is None:     # (a request it held continues here)
            raise WorkerUnavailable(f"{self.worker_id} is draining")
        e = self.engine
        req = e.make_request(r.request_id, prompt_token_ids=r.prompt_token_ids, sampling=r.sampling)
        req.max_chunk_tokens = r.prefill_chunk_tokens
        n = req.num_prompt_tokens
        cached = e.allocator.num_cached_tokens(r.prompt_token_ids)
        if r.move_headroom is not None:
            return self.moves_in.reserve(req, r, cached)
        rec = self.requests[r.request_id] = DecodeRequest(req, r.router_id)
        self.outboxes.seen(r.router_id)   # a reserve proves the router alive
        self.counters["requests"] += 1
        self.counters["tokens_recomputed"] += max(0, min(r.recomputed_tokens, n) - cached)
        # a worker named as its own prefill worker (it also prefills for others) prefills locally
        remote = (r.transfer_id is not None and self.receiver is not None and r.prefill_id != self.worker_id
                  and wants_remote_prefill(n, cached, self.threshold))
        if remote and e.allocator.admit(req, n - cached):
            return self._reserve_remote(rec, r, cached)
        e.scheduler.add(req)
        self.counters["local_prefills"] += 1
        return DecodePlan(remote=False, cached_tokens=cached)

    def _reserve_remote(self, rec: DecodeRequest, r: DecodeReserve, cached: int) -> DecodePlan:
        req, e = rec.request, self.engine
        n = req.num_prompt_tokens
        req.num_cached_prompt_tokens = req.num_computed_tokens
        req.admitted_once = True
        first = cached // self.block_size
        last = e.allocator.blocks_needed(n)
        self.counters["remote_prefills"] += 1
        rec.transfer_id, rec.state = r.transfer_id, DecodeState.RESERVED
        self._by_transfer[r.transfer_id] = rec
        plan = DecodePlan(remote=True, cached_tokens=cached, first_block=first, dst_block_ids=req.block_ids[first:last],
                          num_tokens=n, prefix_block_ids=req.block_ids[:first])
        if r.prefill_id is None:
            return plan
        try:
            self._expect_spec(rec, TransferSpec(r.transfer_id, r.prefill_id, self.worker_id,
                                                tuple(range(e.kv_cache.num_layers)), (),
                                                tuple(plan.dst_block_ids), n))
        except BaseException:
            self._abort(req.request_id)      # the reserved blocks go back
            raise
        return dataclasses.replace(plan, expecting=r.prefill_id)

    def _expect(self, spec: TransferSpec) -> None:
        rec = self._by_transfer.get(spec.request_id)
        if rec is None or not rec.awaiting_kv:
            raise NoReservation(f"no reservation for transfer {spec.request_id!r} on {self.worker_id}")
        if rec.state is DecodeState.RECEIVING:    # registered at reserve, from another actor
            self.receiver.redirect(spec)
        else:
            self._expect_spec(rec, spec)

    def _expect_spec(self, rec: DecodeRequest, spec: TransferSpec) -> None:
        rec.registering()                 # before expect: a failed one releases inside it
        try:
            self.receiver.expect(spec)
        except BaseException:
            rec.registration_failed()     # nothing registered: the caller frees the blocks
            raise
        rec.registered(time.perf_counter())

    def _first_token(self, rid: str, first: FirstToken) -> bool:
        rec = self.requests.get(rid)
        taken = rec.take_first(first) if rec is not None else FirstTokenTaken.REFUSED
        if taken is FirstTokenTaken.ADMIT:
            self._admit(rec, first)
        return taken is not FirstTokenTaken.REFUSED

    def _admit(self, rec: DecodeRequest, first: FirstToken) -> None:
        if rec.move_capacity:    # moved in: the headroom it did not use goes back
            self.engine.allocator.truncate(rec.request, rec.request.num_prompt_tokens)
        self.engine.accept_first_token(rec.request, first)
        self.engine.scheduler.add_ready(rec.request)

    # ---- on the loop thread: transfers --------------------------------------------------------
    def _sync_transfer_index(self, rec: DecodeRequest) -> None:
        """A record stays under its transfer id while its KV may still land in its blocks."""
        if not (rec.awaiting_kv or rec.receiving) and self._by_transfer.get(rec.transfer_id) is rec:
            del self._by_transfer[rec.transfer_id]

    def forget(self, rec: DecodeRequest) -> None:
        if self.requests.get(rec.request_id) is rec:
            del self.requests[rec.request_id]

    def kv_ended(self, reaped: list[tuple[str, TransferState]]) -> None:
        """The receiver's ended transfers (`reap()`); those this part does not wait for are
        ignored (a shared receiver also carries the prefill part's prefix pulls)."""
        if not self._by_transfer:
            return
        for tid, state in reaped:
            rec = self._by_transfer.get(tid)
            if rec is None:
                continue
            if rec.precopy_of is not None:     # a moving sequence's pre-copy
                self.moves_in.precopy_ended(rec, state)
            elif not rec.awaiting_kv:     # aborted meanwhile
                if state is TransferState.DONE and rec.landed_after_abort():   # landed, then aborted
                    self.engine.allocator.free(rec.request)
            elif state is TransferState.DONE:
                self._kv_landed(rec)
            else:
                rec.transfer_failed()   # its blocks come back with the receiver's release
                self.moves_in.abort_precopy(rec)
                self.forget(rec)
                self.counters["transfer_failures"] += 1
                self._emit_error(rec, f"KV transfer {state.value}")
            self._sync_transfer_index(rec)

    def _kv_landed(self, rec: DecodeRequest) -> None:
        if rec.precopy is not None and not self.moves_in.tail_landed(rec):
            return                  # a moving sequence's tail came before its pre-copy
        req = rec.request
        if rec.transfer_started_at is not None:
            self.transfer_times.record(time.perf_counter() - rec.transfer_started_at)
        first = rec.kv_arrived()
        req.num_computed_tokens = req.num_prompt_tokens
        self.engine.allocator.register_full_blocks(req)
        if first is not None:
            self._admit(rec, first)
        # else: the router has not handed the first token over yet (KV_READY)

    def kv_released(self, tid: str) -> None:
        # the receiver runs this on our thread for FAILED / ABORTED transfers once no layer is
        # being copied into their blocks (at once, or when the copy in flight ends): free them
        rec = self._by_transfer.get(tid)
        if rec is None:
            return
        if rec.released():
            self.engine.allocator.free(rec.request)
        self._sync_transfer_index(rec)

    def _abort(self, rid: str) -> bool:
        rec = self.requests.pop(rid, None)
        if rec is None:
            return self.engine.abort(rid)
        self.moves_in.abort_precopy(rec)
        action = rec.abort()
        if action is AbortAction.ABORT_IN_ENGINE:
            return self.engine.abort(rid)
        if action is AbortAction.DROP_PAUSED:
            self.moves.drop(rec)
            return True
        if action is AbortAction.ABORT_SEND:
            self.moves.abort_send(rec)
            return True
        if action is AbortAction.ABORT_RECEIVE:
            # the release callback frees the blocks, now or after the layer being copied; a
            # transfer that already arrived hands them back when it is reaped (kv_ended)
            self.receiver.abort(rec.transfer_id)
        else:  # reserved, its receive never registered or already released; or its KV here
            self.engine.allocator.free(rec.request)
        if rec.transfer_id is not None:
            self._sync_transfer_index(rec)
        return True

    # ---- on the loop thread: between and after steps (the hooks a shared loop's owner calls) ---
    def _before_step(self) -> None:
        if self.sender is not None:
            self.moves.sends_ended(self.sender.reap())
        if self.receiver is not None and self._by_transfer:
            self.kv_ended(self.receiver.reap())
        self.between_steps()

    def between_steps(self) -> None:
        """After the transport's ends are handled: expire silent routers, move sequences out
        (sent ones freed, a draining worker's paused), take the stats snapshot."""
        self._expire_routers()
        self.moves.between_steps()
        self._snapshot = self.collect_stats()

    def owns(self, request_id: str) -> bool:
        return request_id in self.requests

    def _expire_routers(self) -> None:
        """A router that stopped polling (crashed, or cut off) would leave its requests decoding
        into an outbox nobody reads, holding their KV until max_tokens, and the outbox growing.
        Abort them and leave one error per request in its outbox, so a router that comes back
        learns what happened (and places them again) instead of waiting for its deadline."""
        now = self.clock()
        if now - self._routers_checked < min(1.0, self.router_timeout_s / 4):
            return
        self._routers_checked = now
        gone = self.outboxes.silent(self.router_timeout_s)
        if not gone:
            return
        for rid, rec in list(self.requests.items()):
            router = rec.router_id
            if router in gone:
                log.warning("router %s silent for over %.0f s: aborting its request %s", router,
                            self.router_timeout_s, rid)
                self._abort(rid)
                self.outboxes.put(router, [OutputError(rid, f"aborted on {self.worker_id}: its router "
                                                            f"did not poll for {self.router_timeout_s:.0f} s")])
                self.counters["router_timeouts"] = self.counters.get("router_timeouts", 0) + 1
        for router in gone:
            self.outboxes.keep_errors_only(router)

    def fail_own_requests(self, exc: BaseException) -> None:
        """A step raised: every request of this part in the engine gets an error (its router moves
        it to a decode actor again, from the tokens already streamed) and its KV is freed. Requests
        still waiting for their KV were not in the step and stay."""
        message = f"engine step failed on {self.worker_id}: {type(exc).__name__}: {exc}"[:300]
        for rid in [r for r in self.engine.scheduler.requests if r in self.requests]:
            self._emit_error(self.requests[rid], message)
            self._abort(rid)
        self.counters["step_failures"] = self.counters.get("step_failures", 0) + 1

    def _fail_engine_requests(self, exc: BaseException) -> None:
        self.fail_own_requests(exc)
        for rid in [r for r in self.engine.scheduler.requests if r not in self.requests]:
            self.engine.abort(rid)     # nobody's: nothing waits for it

    def _emit_error(self, rec: DecodeRequest, message: str) -> None:
        router, rec.router_id = rec.router_id, None
        if router is not None:
            self.outboxes.put(router, [OutputError(rec.request_id, message)])

    def publish(self, outputs: list[RequestOutput]) -> None:
        per_router: dict[str, list[Output]] = {}
        now = self.clock()
        for o in outputs:
            rec = self.requests.get(o.request_id)
            if rec is None:
                continue
            if rec.first_output_at is None:
                rec.first_output_at = now
            if o.finished:
                self.forget(rec)
                if o.usage.completion_tokens > 1:
                    self.tpot.add(now, (now - rec.first_output_at) / (o.usage.completion_tokens - 1))
            if rec.router_id is None:
                continue
            per_router.setdefault(rec.router_id, []).append(StepOutput(
                o.request_id, o.new_token_ids, o.new_text, o.finish_reason if o.finished else None,
                o.usage if o.finished else None, tuple(o.new_logprobs) if o.new_logprobs is not None else None))
        for router, msgs in per_router.items():
            self.outboxes.put(router, msgs)

    def collect_stats(self) -> WorkerStats:
        """On the loop thread: the stats as of now (`stats()` answers the latest of these)."""
        e = self.engine
        a = e.allocator
        waiting_kv = sum(1 for r in self.requests.values() if r.waiting) + self.moves.holding()
        return WorkerStats(
            self.worker_id, "decode", running=len(e.scheduler.running),
            waiting=len(e.scheduler.waiting) + len(e.scheduler.ready) + waiting_kv,
            kv_blocks_used=a.num_used_blocks, kv_blocks_total=a.num_blocks,
            prefix_queries=a.prefix_queries, prefix_hits=a.prefix_hits, tokens_computed=e.stats.tokens_computed,
            **e.stats.prompt_counters(),
            steps=e.stats.steps, busy_s=self.loop.busy_s, draining=self.draining,
            tpot=Percentiles(**self.tpot.percentiles(self.clock())),
            kv_blocks_waiting=sum(a.blocks_needed(r.num_tokens) for r in e.scheduler.waiting),
            draft_tokens=getattr(e.stats, "draft_tokens", 0),
            accepted_draft_tokens=getattr(e.stats, "accepted_draft_tokens", 0),
            loop_error=repr(self.loop.error) if self.loop.error else None,
            last_step_error=self.loop.last_step_error, warmup_s=self.warmup["seconds"] if self.warmup else 0.0,
            slow_steps=self.loop.slow_steps, mid_step_calls=self.loop.mid_step_calls,
            late_compiles=compile_watch.late, cuda_graphs=e.runner.graph_stats,
            **self.counters, **self.moves.counters, **self.transfer_times.stats())


def warm_up(engine: LLMEngine, worker_id: str) -> dict[str, Any] | None:
    """Kernels compiled and decode graphs captured before the first request, not inside it (where
    the engine wants it: on CUDA). The actor runs it before it joins the transport."""
    if not engine.wants_warmup:
        return None
    result = engine.warmup()
    log.info("%s warmed up in %.1f s (CUDA_MODULE_LOADING=%s): %s", worker_id, result["seconds"],
             os.environ.get("CUDA_MODULE_LOADING"), result)
    return result
