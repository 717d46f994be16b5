"""The decode worker: continuous batching over one engine, fed either by its own prefill (short
uncached suffixes) or by KV that a prefill actor streams into blocks it reserved.

A request's stages here, in order:
1. `reserve`: validate; look the prompt up in the prefix cache; if the uncached part is at most
   the local-prefill threshold (or remote prefill is not offered), queue it for local prefill;
   otherwise take blocks for the whole prompt and answer with the block ids the KV must land in.
2. `expect`: register the transfer spec with the KV receiver (before the prefill actor sends).
3. The KV of the whole prompt arrives (polled between steps), and the router hands over the first
   output token the prefill actor sampled (`first_token`, after streaming it to the client). With
   both, the request joins the running batch; its next step computes that token and samples the
   second.
4. Each step's new tokens for all sequences go to their routers as one message per router.
A failed or aborted transfer frees the reserved blocks and ends the request with an error.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from dataclasses import asdict
from typing import Any

from tandem.engine.config import EngineConfig
from tandem.engine.engine import LLMEngine, RequestOutput
from tandem.engine.request import FinishReason, InvalidRequestError, Request, SamplingParams
from tandem.runtime.latency import LatencyWindow
from tandem.runtime.metrics import TransferTimes
from tandem.engine.request import WorkerUnavailable
from tandem.engine.kernels.compile_watch import watch as compile_watch
from tandem.engine.serving_loop import EngineLoop
from tandem.placement import wants_remote_prefill

log = logging.getLogger(__name__)


class DecodeWorker:
    def __init__(self, worker_id: str, engine_config: EngineConfig, local_prefill_threshold: float = 256,
                 rendezvous: str | None = None, transfer_config=None, engine: LLMEngine | None = None,
                 router_timeout_s: float = 30.0):
        """`router_timeout_s`: a router that has not asked for its outputs for this long is gone
        (live routers ask every 0.5 s); its requests are aborted and their KV freed."""
        self.worker_id = worker_id
        self.router_timeout_s = router_timeout_s
        self._router_seen: dict[str, float] = {}  # router id -> monotonic time of its last poll
        self._routers_checked = 0.0
        self._routers_expired: set[str] = set()  # handled already; a poll or reserve revives one
        self.engine = engine or LLMEngine(engine_config)
        # kernels compiled and decode graphs captured before the first request, not inside it
        self.warmup = self.engine.warmup() if self.engine.wants_warmup else None
        if self.warmup is not None:
            log.info("%s warmed up in %.1f s (CUDA_MODULE_LOADING=%s): %s", worker_id, self.warmup["seconds"],
                     os.environ.get("CUDA_MODULE_LOADING"), self.warmup)
        self.threshold = local_prefill_threshold
        self.block_size = self.engine.allocator.block_size
        self.receiver = self.sender = None
        if rendezvous is not None:
            from tandem.kv_transfer.base import KVTransferConfig
            from tandem.kv_transfer.torch_dist import DistConnector, make_dist_receiver, make_dist_sender

            tcfg = transfer_config or KVTransferConfig(start_timeout_s=600.0)
            conn = DistConnector(worker_id, rendezvous, self.engine.kv_cache.device, tcfg)
            self.receiver = make_dist_receiver(worker_id, self.engine.kv_cache, conn, tcfg,
                                               on_release=self._transfer_failed,
                                               on_transition=self._wake)
            # prefix pulls: a prefill actor asks for the session's cached prefix it lacks
            self.sender = make_dist_sender(worker_id, self.engine.kv_cache, conn, tcfg)
        self.owner: dict[str, str] = {}  # request id -> router id
        self.remote: dict[str, Request] = {}  # transfer id -> request waiting for its KV
        # transfer id -> request whose blocks the receiver may still write into: registered with
        # the receiver, and not yet handed back (DONE: at reap; FAILED / ABORTED: its release
        # callback, which waits for a layer being copied). An abort takes the request out of
        # `remote` at once, but only these two free its blocks.
        self._receiving: dict[str, Request] = {}
        self._kv_ready: dict[str, Request] = {}  # request id -> KV arrived, first token not yet
        self._first: dict[str, dict[str, Any]] = {}  # request id -> first token come before its KV
        self.transfer_of: dict[str, str] = {}  # request id -> transfer id
        self._outboxes: dict[str, queue.SimpleQueue] = {}
        self._outbox_lock = threading.Lock()
        self.draining = False
        self.counters = {"requests": 0, "remote_prefills": 0, "local_prefills": 0, "transfer_failures": 0,
                         "kv_transfer_bytes": 0}
        self.transfer_times = TransferTimes()  # KV landed, per transfer: the kv_transfer_seconds histogram
        self._transfer_started: dict[str, float] = {}
        self._first_token_at: dict[str, float] = {}
        self.tpot = LatencyWindow()
        self._snapshot: dict[str, Any] | None = None
        self.loop = EngineLoop(self.engine, on_step=self._publish, before_step=self._before_step,
                               on_step_error=self._fail_engine_requests, name=f"{worker_id}-loop")
        self.loop.start()

    # ---- called from any thread ---------------------------------------------------------------
    def _wake(self) -> None:
        """A transfer ended: admit it now rather than at the idle loop's next poll."""
        loop = getattr(self, "loop", None)
        if loop is not None:
            loop.wake()

    def reserve(self, request_id: str, router_id: str, prompt_token_ids: list[int], sampling: dict[str, Any],
                transfer_id: str | None = None, prefill_id: str | None = None) -> dict[str, Any]:
        """`transfer_id` set: remote prefill is on offer under that transfer id. `prefill_id`: the
        prefill actor the router will ask first; a remote reservation then also registers the
        receive from it (the answer says `expecting`), which saves the router an `expect` call
        (and its wait for this loop's current step) on every remote prefill."""
        # makes and admits a new request (or queues a local prefill): it may run inside a step once
        # its kernels are queued, instead of after it (EngineLoop.call_mid_step)
        return self.loop.run_mid_step(self._reserve, request_id, router_id, prompt_token_ids, sampling,
                                      transfer_id, prefill_id)

    def expect(self, spec_msg: dict[str, Any]) -> None:
        self.loop.run(self._expect, spec_msg)

    def abort(self, request_id: str) -> bool:
        return self.loop.run(self._abort, request_id)

    def first_token(self, request_id: str, first: dict[str, Any]) -> bool:
        """The first output token of a remote-prefilled request (engine.RequestOutput.first), which
        its router has streamed already. False if the request is gone (aborted meanwhile)."""
        return self.loop.run(self._first_token, request_id, first)

    def send_prefix(self, spec_msg: dict[str, Any]) -> None:
        """Send cached prefix blocks of a reserved request to the prefill actor that will extend it."""
        self.loop.run(self._send_prefix, spec_msg)

    def stats(self) -> dict[str, Any]:
        """The latest snapshot, taken by the loop between steps: answers at once even while a long
        step runs (health checks must not wait for the engine)."""
        return self._snapshot or self.loop.run(self._stats)

    def get_outputs(self, router_id: str, timeout_s: float = 1.0) -> list[dict[str, Any]]:
        """Everything produced for `router_id` since the last call (one list entry per step),
        waiting up to `timeout_s` for the first."""
        self._router_seen[router_id] = time.monotonic()
        self._routers_expired.discard(router_id)
        box = self._outbox(router_id)
        out: list[dict[str, Any]] = []
        try:
            out.extend(box.get(timeout=timeout_s))
        except queue.Empty:
            return out
        while True:
            try:
                out.extend(box.get_nowait())
            except queue.Empty:
                return out

    def shutdown(self) -> None:
        self.loop.stop()
        for end in (self.sender, self.receiver):
            if end is not None:
                end.close()

    # ---- on the loop thread -------------------------------------------------------------------
    def _outbox(self, router_id: str) -> queue.SimpleQueue:
        with self._outbox_lock:
            box = self._outboxes.get(router_id)
            if box is None:
                box = self._outboxes[router_id] = queue.SimpleQueue()
            return box

    def _reserve(self, rid, router_id, ids, sampling, transfer_id, prefill_id=None) -> dict[str, Any]:
        if self.draining:
            raise WorkerUnavailable(f"{self.worker_id} is draining")
        e = self.engine
        req = e.make_request(rid, prompt_token_ids=ids, sampling=SamplingParams(**sampling))
        self.owner[rid] = router_id
        self._router_seen[router_id] = time.monotonic()   # a reserve proves the router alive
        self._routers_expired.discard(router_id)
        self.counters["requests"] += 1
        n = req.num_prompt_tokens
        cached = e.allocator.num_cached_tokens(ids)
        remote = transfer_id is not None and self.receiver is not None and wants_remote_prefill(n, cached, self.threshold)
        if remote and e.allocator.admit(req, n - cached):
            req.num_cached_prompt_tokens = req.num_computed_tokens
            req.admitted_once = True
            first = cached // self.block_size
            last = e.allocator.blocks_needed(n)
            self.counters["remote_prefills"] += 1
            self.remote[transfer_id] = req
            self.transfer_of[rid] = transfer_id
            plan = {"mode": "remote", "cached_tokens": cached, "first_block": first,
                    "dst_block_ids": req.block_ids[first:last], "num_tokens": n,
                    "prefix_block_ids": req.block_ids[:first]}
            if prefill_id is not None:
                from tandem.kv_transfer.base import TransferSpec

                try:
                    self._expect_spec(TransferSpec(transfer_id, prefill_id, self.worker_id,
                                                   tuple(range(e.kv_cache.num_layers)), (),
                                                   tuple(plan["dst_block_ids"]), n))
                except BaseException:
                    self._abort(rid)      # the reserved blocks go back
                    raise
                plan["expecting"] = prefill_id
            return plan
        e.scheduler.add(req)
        self.counters["local_prefills"] += 1
        return {"mode": "local", "cached_tokens": cached}

    def _expect(self, spec_msg: dict[str, Any]) -> None:
        from tandem.kv_transfer.base import TransferSpec

        spec = TransferSpec.from_msg(spec_msg)
        if spec.request_id not in self.remote:
            raise KeyError(f"no reservation for transfer {spec.request_id!r} on {self.worker_id}")
        if spec.request_id in self._transfer_started:   # registered at reserve, from another actor
            self.receiver.redirect(spec)
        else:
            self._expect_spec(spec)

    def _expect_spec(self, spec) -> None:
        tid = spec.request_id
        self._receiving[tid] = self.remote[tid]   # before expect: a failed one releases inside it
        try:
            self.receiver.expect(spec)
        except BaseException:
            self._receiving.pop(tid, None)        # nothing registered: the caller frees the blocks
            raise
        self._transfer_started[tid] = time.perf_counter()

    def _send_prefix(self, spec_msg: dict[str, Any]) -> None:
        from tandem.kv_transfer.base import TransferSpec

        spec = TransferSpec.from_msg(spec_msg)
        self.sender.send(spec)  # the blocks stay held by the reserved request meanwhile

    def _before_step(self) -> None:
        self._poll_transfers()
        self._expire_routers()
        self._snapshot = self._stats()

    def _expire_routers(self) -> None:
        """A router that stopped polling (crashed, or cut off) would leave its requests decoding
        into an outbox nobody reads, holding their KV until max_tokens, and the outbox growing.
        Abort them and leave one error per request in its outbox, so a router that comes back
        learns what happened (and places them again) instead of waiting for its deadline."""
        now = time.monotonic()
        if now - self._routers_checked < min(1.0, self.router_timeout_s / 4):
            return
        self._routers_checked = now
        gone = {r for r, t in list(self._router_seen.items())
                if now - t > self.router_timeout_s and r not in self._routers_expired}
        if not gone:
            return
        for rid, router in list(self.owner.items()):
            if router in gone:
                log.warning("router %s silent for over %.0f s: aborting its request %s", router,
                            self.router_timeout_s, rid)
                self._abort(rid)
                self._outbox(router).put([{"request_id": rid, "error": f"aborted on {self.worker_id}: its router "
                                           f"did not poll for {self.router_timeout_s:.0f} s"}])
                self.counters["router_timeouts"] = self.counters.get("router_timeouts", 0) + 1
        with self._outbox_lock:
            for router in gone:
                box = self._outboxes.get(router)
                if box is None:
                    continue
                kept = []                   # keep only the error messages, drop the token stream
                while True:
                    try:
                        kept.extend(m for m in box.get_nowait() if "error" in m)
                    except queue.Empty:
                        break
                if kept:
                    box.put(kept)
                else:
                    del self._outboxes[router]
        self._routers_expired |= gone

    def _poll_transfers(self) -> None:
        if self.sender is not None:
            self.sender.reap()
        if self.receiver is None or not (self.remote or self._receiving):
            return
        from tandem.kv_transfer.base import TransferState

        for tid, state in self.receiver.reap():
            req = self.remote.pop(tid, None)
            if state is TransferState.DONE:
                arrived = self._receiving.pop(tid, None)
                if req is None and arrived is not None:   # it landed, then the request was aborted
                    self.engine.allocator.free(arrived)
            if req is None:
                continue
            self.transfer_of.pop(req.request_id, None)
            t0 = self._transfer_started.pop(tid, None)
            if state is TransferState.DONE:
                if t0 is not None:
                    self.transfer_times.record(time.perf_counter() - t0)
                req.num_computed_tokens = req.num_prompt_tokens
                self.engine.allocator.register_full_blocks(req)
                first = self._first.pop(req.request_id, None)
                if first is not None:
                    self._admit(req, first)
                else:                      # the router has not handed the first token over yet
                    self._kv_ready[req.request_id] = req
            else:
                self.counters["transfer_failures"] += 1
                self._emit_error(req.request_id, f"KV transfer {state.value}")

    def _first_token(self, rid: str, first: dict[str, Any]) -> bool:
        req = self._kv_ready.pop(rid, None)
        if req is not None:
            self._admit(req, first)
            return True
        if rid in self.transfer_of:        # its KV is still on the way
            self._first[rid] = first
            return True
        return False

    def _admit(self, req: Request, first: dict[str, Any]) -> None:
        self.engine.accept_first_token(req, first)
        self.engine.scheduler.add_ready(req)

    def _transfer_failed(self, tid: str) -> None:
        # the receiver runs this on our thread for FAILED / ABORTED transfers once no layer is
        # being copied into their blocks (at once, or when the copy in flight ends): free them
        req = self._receiving.pop(tid, None)
        if req is not None:
            self.engine.allocator.free(req)

    def _abort(self, rid: str) -> bool:
        self.owner.pop(rid, None)
        self._first.pop(rid, None)
        self._first_token_at.pop(rid, None)   # (a finished request's goes in _publish)
        waiting = self._kv_ready.pop(rid, None)
        if waiting is not None:          # KV here, first token not: not in the engine yet
            self.engine.allocator.free(waiting)
            return True
        tid = self.transfer_of.pop(rid, None)
        if tid is not None:
            req = self.remote.pop(tid)
            self._transfer_started.pop(tid, None)
            if tid in self._receiving:
                # the release callback frees the blocks, now or after the layer being copied; a
                # transfer that already arrived hands them back when it is reaped (_poll_transfers)
                self.receiver.abort(tid)
            else:  # reserved, transfer never expected
                self.engine.allocator.free(req)
            return True
        return self.engine.abort(rid)

    def _fail_engine_requests(self, exc: BaseException) -> None:
        """A step raised: every request in the engine gets an error (its router moves it to a
        decode actor again, from the tokens already streamed) and its KV is freed. Requests still
        waiting for their KV were not in the step and stay."""
        message = f"engine step failed on {self.worker_id}: {type(exc).__name__}: {exc}"[:300]
        for rid in list(self.engine.scheduler.requests):
            self._emit_error(rid, message)
            self._abort(rid)
        self.counters["step_failures"] = self.counters.get("step_failures", 0) + 1

    def _emit_error(self, rid: str, message: str) -> None:
        router = self.owner.pop(rid, None)
        if router is not None:
            self._outbox(router).put([{"request_id": rid, "error": message}])

    def _publish(self, outputs: list[RequestOutput]) -> None:
        per_router: dict[str, list[dict[str, Any]]] = {}
        now = time.monotonic()
        for o in outputs:
            t1 = self._first_token_at.setdefault(o.request_id, now)
            if o.finished:
                del self._first_token_at[o.request_id]
                if o.usage.completion_tokens > 1:
                    self.tpot.add(now, (now - t1) / (o.usage.completion_tokens - 1))
            router = self.owner.get(o.request_id)
            if router is None:
                continue
            msg: dict[str, Any] = {"request_id": o.request_id, "token_ids": o.new_token_ids, "text": o.new_text}
            if o.finished:
                msg["finish_reason"] = o.finish_reason.value
                msg["usage"] = asdict(o.usage)
                del self.owner[o.request_id]
            per_router.setdefault(router, []).append(msg)
        for router, msgs in per_router.items():
            self._outbox(router).put(msgs)

    def _stats(self) -> dict[str, Any]:
        e = self.engine
        a = e.allocator
        return {"worker_id": self.worker_id, "pool": "decode", "running": len(e.scheduler.running),
                "waiting": len(e.scheduler.waiting) + len(e.scheduler.ready) + len(self.remote) + len(self._kv_ready),
                "kv_blocks_used": a.num_used_blocks, "kv_blocks_total": a.num_blocks,
                "prefix_queries": a.prefix_queries, "prefix_hits": a.prefix_hits,
                "tokens_computed": e.stats.tokens_computed, "steps": e.stats.steps,
                "busy_s": self.loop.busy_s, "draining": self.draining,
                "tpot": self.tpot.percentiles(time.monotonic()),
                "kv_blocks_waiting": sum(e.allocator.blocks_needed(r.num_tokens) for r in e.scheduler.waiting),
                "draft_tokens": getattr(e.stats, "draft_tokens", 0),
                "accepted_draft_tokens": getattr(e.stats, "accepted_draft_tokens", 0),
                "loop_error": repr(self.loop.error) if self.loop.error else None,
                "last_step_error": self.loop.last_step_error,
                "warmup_s": self.warmup["seconds"] if self.warmup else 0.0, "slow_steps": self.loop.slow_steps,
                "mid_step_calls": self.loop.mid_step_calls,
                "late_compiles": compile_watch.late,
                "cuda_graphs": e.runner.graph_stats, **self.counters, **self.transfer_times.stats()}


def finish_reason_of(msg: dict[str, Any]) -> FinishReason | None:
    r = msg.get("finish_reason")
    return FinishReason(r) if r else None


__all__ = ["DecodeWorker", "InvalidRequestError", "finish_reason_of"]
