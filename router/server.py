"""The gRPC front door: `tandem.v1.Generation` (server streaming), `tandem.v1.Admin`, health and
reflection. Validates, renders chat templates and tokenizes, routes by session (the session's own
worker, then the best prefix hit, then the least loaded), arranges remote prefill when the decode
actor asks for it, streams tokens, and frees the request's KV on every actor when the client
cancels or its deadline passes. Errors are mapped to status codes here, once.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import grpc
import ray

from tandem.runtime.logging_setup import bind_request
from tandem.runtime.metrics import WorkerMetricsSnapshot, get_hub
from tandem.engine.prefix_hash import block_hashes
from tandem.engine.request import InvalidRequestError, WorkerUnavailable
from tandem.protos.tandem.v1 import admin_pb2, admin_pb2_grpc, generation_pb2, generation_pb2_grpc
from tandem.router.admission import AdmissionConfig, AdmissionLimiter, Overloaded, client_identity
from tandem.router.auth import bearer_token
from tandem.router.cluster_view import ClusterView
from tandem.router.prefix_index import PrefixIndex
from tandem.router.routing import any_ready, choose_worker, prefill_placement
from tandem.router.sessions import SessionState, make_session_store
from tandem.router.validation import RequestLimits, validate_request

log = logging.getLogger(__name__)

FINISH = {"stop": generation_pb2.STOP, "length": generation_pb2.LENGTH, "abort": generation_pb2.ABORT}


class RequestFailed(Exception):
    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code


class Router:
    """Everything a Generate call needs, independent of gRPC plumbing."""

    def __init__(self, view: ClusterView, tokenizer, model_config, block_size: int, sessions,
                 limits: RequestLimits = RequestLimits(), local_prefill_threshold: float = 256,
                 admission: AdmissionConfig = AdmissionConfig(), max_prefill_queued_tokens: float = math.inf):
        self.view = view
        self.tokenizer = tokenizer
        self.vocab_size = model_config.vocab_size
        self.max_context = model_config.max_position_embeddings
        self.block_size = block_size
        self.sessions = sessions
        self.limits = limits
        self.threshold = local_prefill_threshold
        # past max_prefill_queued tokens of this router's remote prefills on a prefill actor, it gets
        # no more while a decode actor's own queue of local prefills is shorter (prefill_placement)
        self.max_prefill_queued = max_prefill_queued_tokens
        self.prefill_queued: dict[str, int] = {}   # prompt tokens placed on each prefill actor, not yet delivered
        self.local_queued: dict[str, int] = {}     # ... on each decode actor to prefill itself, no first token yet
        self.num_layers = model_config.num_layers
        self.prefix = {"prefill": PrefixIndex(), "decode": PrefixIndex()}
        self.counters = {"requests": 0, "ok": 0, "errors": 0, "cancelled": 0}
        self._background: set[asyncio.Future] = set()   # fire-and-forget cleanups, kept referenced
        self.max_migrations = 2  # per request, then UNAVAILABLE
        self.slow_ttft_s: float | None = 1.0  # log where the time went for first tokens slower than this
        self.hub = get_hub()
        self.limiter = AdmissionLimiter(admission, on_change=self.hub.set_router_queue)

    # ---- input ------------------------------------------------------------------------------
    def prepare(self, request) -> tuple[Any, list[int], Any]:
        v = validate_request(request, vocab_size=self.vocab_size, max_context=self.max_context, limits=self.limits)
        if v.messages is not None:
            text = self.tokenizer.apply_chat_template(v.messages, add_generation_prompt=True)
            ids = self.tokenizer.encode(text, add_special_tokens=False)
        elif v.prompt is not None:
            ids = self.tokenizer.encode(v.prompt)
        else:
            ids = list(v.prompt_token_ids)
        if not ids:
            raise InvalidRequestError("the prompt has no tokens after tokenization")
        sampling = v.sampling_for_prompt(len(ids), self.max_context)
        return v, ids, sampling

    # ---- routing ----------------------------------------------------------------------------
    def _pick(self, pool: str, session_worker: str | None, hashes: list[bytes], exclude=()) -> str | None:
        views = [w for w in self.view.views(pool) if w.worker_id not in exclude]
        hits = {w: n * self.block_size for w, n in self.prefix[pool].match(hashes).items()}
        wid = choose_worker(views, session_worker, hits)
        if wid is None:
            if any_ready(views):
                raise RequestFailed(grpc.StatusCode.RESOURCE_EXHAUSTED, f"every {pool} worker is overloaded; retry later")
            raise RequestFailed(grpc.StatusCode.UNAVAILABLE, f"no {pool} worker is ready")
        return wid

    # ---- one request ------------------------------------------------------------------------
    async def generate(self, request, context):
        t0 = time.perf_counter()
        self.counters["requests"] += 1
        v, ids, sampling = self.prepare(request)
        rid = v.request_id or uuid.uuid4().hex
        with bind_request(rid):
            async for resp in self._generate(v, ids, sampling, rid, t0):
                yield resp

    async def _place(self, rid, ids, sp, sess, hashes, exclude: set[str]) -> "Attempt":
        """Reserve on a decode actor (the session's, else the best prefix hit, else the least
        loaded), and when it asks for remote prefill, start it on a prefill actor; a worker that is
        draining or gone is skipped, and a prefill that cannot start falls back to local prefill."""
        offer_remote = self.threshold != float("inf") and bool(self.view.views("prefill"))
        prefill_hint, early = None, None
        if offer_remote:
            # The prefill actor is picked first and reserved on while the decode actor reserves
            # (the two answers are independent); it is named in the decode actor's reserve, which
            # then registers the KV receive from it. Both save a sequential call per remote prefill.
            try:
                prefill_hint = self._pick("prefill", sess.prefill_worker if sess else None, hashes)
            except RequestFailed:
                prefill_hint = None
            if prefill_hint is not None and self.max_prefill_queued != math.inf:
                decode_ids = [sess.decode_worker] if sess and sess.decode_worker else \
                    [w.worker_id for w in self.view.views("decode")]
                local = min((self.local_queued.get(w, 0) for w in decode_ids), default=0)
                prefill_hint = prefill_placement(prefill_hint, [w.worker_id for w in self.view.views("prefill")],
                                                 self.prefill_queued, local, len(ids), self.max_prefill_queued)
                if prefill_hint is None:      # every prefill actor is backlogged: prefill locally
                    offer_remote = False
                    self.counters["prefill_backlogged"] = self.counters.get("prefill_backlogged", 0) + 1
        transfer_id = f"{rid}#{uuid.uuid4().hex[:8]}" if offer_remote else None
        hold = None       # counted on the prefill actor at once, so concurrent arrivals see it
        if prefill_hint is not None and offer_remote:
            hold = self._hold(self.prefill_queued, prefill_hint, len(ids))
            early = asyncio.ensure_future(self._reserve_prefill(prefill_hint, transfer_id, ids, sp))
        tried = set(exclude)
        try:
            while True:
                decode_id = self._pick("decode", sess.decode_worker if sess else None, hashes, exclude=tried)
                decode = self.view.handle(decode_id)
                # count it at once, so concurrent arrivals see this load before the worker reports it
                self.view.inflight[decode_id] = self.view.inflight.get(decode_id, 0) + 1
                try:
                    plan = await self._reservation(decode.reserve.remote(rid, self.view.router_id, ids, sp,
                                                                         transfer_id, prefill_hint),
                                                   undo=lambda d=decode: d.abort.remote(rid))
                    break
                except (WorkerUnavailable, ray.exceptions.RayActorError):
                    self.view.inflight[decode_id] -= 1
                    tried.add(decode_id)
        except BaseException:
            self._release(hold)
            self._drop_prefill_reservation(early, prefill_hint, transfer_id)
            raise
        att = Attempt(decode_id, decode, transfer_id=transfer_id, mode=plan["mode"])
        att.marks["decode_reserved"] = time.perf_counter()
        try:
            await self._after_decode_reserve(att, rid, ids, sp, sess, hashes, plan, prefill_hint,
                                             transfer_id, hold, early)
        except BaseException:
            # cancelled (the client went, its deadline passed) or failed before the caller has the
            # attempt: nobody else knows of the decode actor's reservation
            self.view.inflight[decode_id] -= 1
            self._release(att.local_hold)
            self._in_background(decode.abort.remote(rid))
            raise
        return att

    async def _after_decode_reserve(self, att, rid, ids, sp, sess, hashes, plan, prefill_hint, transfer_id,
                                    hold, early) -> None:
        """_place, once the decode actor has answered: start the remote prefill it asked for (or
        prefill locally), or drop the early prefill reservation when it prefills itself."""
        decode_id = att.decode_id
        if plan["mode"] != "remote":                  # prefilled locally: the early one is not needed
            # counted on the decode actor until its first token (prefill_placement weighs it)
            att.local_hold = self._hold(self.local_queued, decode_id, len(ids) - plan.get("cached_tokens", 0))
            self._release(hold)
            self._drop_prefill_reservation(early, prefill_hint, transfer_id)
        else:
            try:
                att.prefill_id, att.prefill_cached, att.prefill_task, att.first_task = \
                    await self._start_remote_prefill(rid, transfer_id, ids, plan, decode_id, sess, hashes, sp, early)
            except BaseException as e:
                self._release(hold)
                if not isinstance(e, (WorkerUnavailable, RequestFailed, ray.exceptions.RayActorError)):
                    raise
                log.info("remote prefill of %s unavailable (%s); prefilling locally", rid, e)
                await self._prefill_locally(att, rid, ids, sp)
            else:
                att.marks["prefill_started"] = time.perf_counter()
                att.prefill_task.add_done_callback(lambda _: att.marks.setdefault("kv_sent", time.perf_counter()))
                if hold is None or hold[1] != att.prefill_id:    # another prefill actor took it
                    self._release(hold)
                    hold = self._hold(self.prefill_queued, att.prefill_id, len(ids))
                att.prefill_task.add_done_callback(lambda _: self._release(hold))

    @staticmethod
    def _hold(queued: dict[str, int], worker_id: str, tokens: int) -> tuple[dict[str, int], str, int]:
        """Count `tokens` of this router's prompts on `worker_id` in `queued` (prefill_queued or
        local_queued) until `_release` of what this returns."""
        queued[worker_id] = queued.get(worker_id, 0) + tokens
        return queued, worker_id, tokens

    @staticmethod
    def _release(hold: tuple[dict[str, int], str, int] | None) -> None:
        if hold is None:
            return
        queued, worker_id, tokens = hold
        left = queued.get(worker_id, 0) - tokens
        if left > 0:
            queued[worker_id] = left
        else:
            queued.pop(worker_id, None)

    async def _reserve_prefill(self, prefill_id: str, transfer_id: str, ids, sp) -> tuple[Any, dict]:
        """-> (the actor's handle, its reservation)."""
        handle = self.view.handle(prefill_id)
        if handle is None:
            raise WorkerUnavailable(f"{prefill_id} left the prefill pool")
        return handle, await self._reservation(handle.reserve.remote(transfer_id, ids, sp),
                                               undo=lambda: handle.abort.remote(transfer_id))

    def _drop_prefill_reservation(self, early, prefill_id, transfer_id) -> None:
        """In the background: once the early prefill reservation has been answered, free it."""
        if early is None:
            return
        self._undo_once_answered(early, lambda answer: answer[0].abort.remote(transfer_id))

    async def _reservation(self, ref, undo):
        """Await an actor's reservation (`ref`, a Ray call). Cancelling the wait does not cancel the
        call: the actor reserves all the same. If this request is cancelled meanwhile, `undo()` (an
        abort call) frees it in the background once the actor has answered."""
        call = asyncio.ensure_future(ref)
        try:
            return await asyncio.shield(call)
        except asyncio.CancelledError:
            self._undo_once_answered(call, lambda _answer: undo())
            raise

    def _undo_once_answered(self, call, undo) -> None:
        """In the background: once `call` (a reservation) has answered, `undo(answer)` (an abort
        call); nothing when it failed, since nothing was reserved."""
        async def run():
            try:
                answer = await call
            except Exception:  # noqa: BLE001 - refused or the actor died: nothing reserved
                return
            await undo(answer)
        self._in_background(run())

    def _in_background(self, aw) -> None:
        """A cleanup that must outlive the request (kept referenced; errors logged, not raised)."""
        async def run():
            try:
                await aw
            except Exception as e:  # noqa: BLE001 - best effort: a dead actor holds no KV
                log.debug("background cleanup failed: %s", e)
        task = asyncio.ensure_future(run())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _prefill_locally(self, att: "Attempt", rid, ids, sp) -> None:
        """Drop a remote-prefill reservation (its half-received KV is freed) and queue the request
        for the decode actor's own prefill instead."""
        await att.decode.abort.remote(rid)
        plan = await self._reservation(att.decode.reserve.remote(rid, self.view.router_id, ids, sp, None),
                                       undo=lambda: att.decode.abort.remote(rid))
        if att.local_hold is None:
            att.local_hold = self._hold(self.local_queued, att.decode_id, len(ids) - plan.get("cached_tokens", 0))
        if att.first_task is not None:
            att.first_task.cancel()
        att.prefill_id = att.prefill_task = att.first_task = None

    async def _generate(self, v, ids, sampling, rid, t0):
        sess = await self.sessions.get(v.session_id) if v.session_id else None
        hashes = block_hashes(ids, self.block_size)
        queue: asyncio.Queue = asyncio.Queue()
        self.view.queues[rid] = queue
        sp = {"max_tokens": sampling.max_tokens, "temperature": sampling.temperature, "top_p": sampling.top_p,
              "top_k": sampling.top_k, "seed": sampling.seed, "stop": tuple(sampling.stop),
              "ignore_eos": sampling.ignore_eos}
        att: Attempt | None = None
        finished = False
        out_ids: list[int] = []
        lost: set[str] = set()
        migrations = 0
        try:
            att = await self._place(rid, ids, sp, sess, hashes, lost)
            first = True
            last_t = None
            handover = None   # the prefill's first token, for the decode actor once it is streamed
            injected = None   # a message the loop made itself (the decode actor refused the handover)
            while True:
                task = att.prefill_task
                if injected is not None:
                    msg, injected = injected, None
                elif task is not None and not att.first_handled:
                    early = att.first_task
                    if early is not None and early.done() and (early.cancelled() or early.exception() is not None):
                        early = att.first_task = None   # no early token: the prefill's result brings it
                    if not task.done() and not (early is not None and early.done()):
                        getter = asyncio.ensure_future(queue.get())
                        await asyncio.wait({getter, task} | ({early} if early is not None else set()),
                                           return_when=asyncio.FIRST_COMPLETED)
                        if not getter.done():
                            getter.cancel()
                            continue                 # the prefill ended or sampled: handled just below
                        msg = getter.result()        # (an error from the decode actor, say)
                    elif task.done() and task.exception() is not None:
                        # the prefill actor failed (or died) before the KV and first token arrived
                        log.warning("remote prefill of %s failed (%s); prefilling locally", rid, task.exception())
                        self.hub.record_migration("prefill_failed")
                        await self._prefill_locally(att, rid, ids + out_ids, _continue(sp, out_ids))
                        continue
                    else:
                        # the prefill actor sampled the first token: stream it now (the decode
                        # actor takes it before or after its KV lands); a transfer that fails later
                        # comes back as the decode actor's error, and the request moves on from there
                        att.first_handled = True
                        if early is not None and early.done():
                            first = early.result()["first"]
                            att.marks["first_timings"] = early.result()["timings"]
                        else:
                            first = task.result()["first"]
                        msg = {"request_id": rid, "token_ids": first["token_ids"], "text": first["text"]}
                        if first["finish_reason"]:   # it ends the request: the decode actor is not needed
                            msg.update(finish_reason=first["finish_reason"], usage={
                                "prompt_tokens": len(ids), "cached_prompt_tokens": att.prefill_cached,
                                "completion_tokens": 1, "draft_tokens": 0, "accepted_draft_tokens": 0})
                            att.release_decode = True    # after the token is out
                        else:
                            handover = first             # after the token is out
                else:
                    msg = await queue.get()
                lost_decode = msg.get("worker_lost") and msg["worker_id"] == att.decode_id
                if msg.get("worker_lost") and not lost_decode:
                    continue
                if lost_decode or "error" in msg:
                    # the decode actor died (or the request failed on it): continue on another one
                    # from the prompt plus the tokens already streamed; greedy output is unchanged
                    if migrations >= self.max_migrations:
                        raise RequestFailed(grpc.StatusCode.UNAVAILABLE,
                                            f"request failed after {migrations} migrations: {msg.get('error')}")
                    migrations += 1
                    if lost_decode:
                        lost.add(att.decode_id)
                    self.hub.record_migration("decode_lost" if lost_decode else "request_failed")
                    log.warning("moving %s off %s after %d tokens: %s", rid, att.decode_id, len(out_ids),
                                msg.get("error"))
                    self.view.inflight[att.decode_id] -= 1
                    self._release(att.local_hold)
                    att.local_hold = None
                    if not lost_decode:
                        await self._abort_everywhere(rid, att)
                    cont = ids + out_ids
                    att = await self._place(rid, cont, _continue(sp, out_ids), None,
                                            block_hashes(cont, self.block_size), lost)
                    continue
                resp = generation_pb2.GenerateResponse(token_ids=msg["token_ids"], text=msg["text"])
                out_ids.extend(msg["token_ids"])
                now = time.perf_counter()
                if first:
                    resp.request_id = rid
                    first = False
                    self._release(att.local_hold)
                    att.local_hold = None
                    self.hub.record_first_token(now - t0)
                    if self.slow_ttft_s is not None and now - t0 > self.slow_ttft_s:
                        self._log_slow_first_token(rid, len(ids), t0, now, att, migrations)
                elif msg["token_ids"]:
                    self.hub.record_tokens(now - last_t, len(msg["token_ids"]))
                last_t = now
                if "finish_reason" in msg:
                    u = dict(msg["usage"])
                    u["cached_prompt_tokens"] = min(len(ids), max(u["cached_prompt_tokens"], att.prefill_cached))
                    u["prompt_tokens"] = len(ids)
                    u["completion_tokens"] = len(out_ids)
                    resp.finish_reason = FINISH[msg["finish_reason"]]
                    resp.usage.CopyFrom(generation_pb2.Usage(**u))
                    finished = True
                    self.hub.record_finished(code="OK", finish_reason=msg["finish_reason"],
                                             e2e_seconds=time.perf_counter() - t0)
                    yield resp
                    break
                yield resp
                if handover is not None:   # streamed: now the decode actor continues from it
                    payload, handover = handover, None
                    try:
                        taken = await att.decode.first_token.remote(rid, payload)
                    except Exception as e:  # noqa: BLE001 - its output pump reports a dead actor too
                        taken, why = False, f"{type(e).__name__}: {e}"
                    else:
                        why = "it no longer held the request"
                    if not taken:
                        injected = {"request_id": rid, "error": f"the decode actor refused the first token: {why}"}
            if att.release_decode:
                await att.decode.abort.remote(rid)   # its reservation: the first token ended the request
            if att.prefill_task is not None:
                try:
                    await att.prefill_task
                except Exception as e:  # noqa: BLE001 - the tokens arrived; only a late report failed
                    if not att.release_decode:     # else its transfer was aborted on purpose
                        log.warning("prefill of %s reported %s after its tokens were streamed", rid, e)
            self.counters["ok"] += 1
            self.prefix["decode"].record(att.decode_id, block_hashes(ids + out_ids, self.block_size))
            if v.session_id:
                await self.sessions.put(v.session_id, SessionState(
                    decode_worker=att.decode_id,
                    prefill_worker=att.prefill_id or (sess.prefill_worker if sess else None),
                    num_tokens=len(ids) + len(out_ids), turn=(sess.turn + 1 if sess else 1)))
        finally:
            self.view.queues.pop(rid, None)
            if att is not None:
                self._release(att.local_hold)
            if att is not None and self.view.inflight.get(att.decode_id):
                self.view.inflight[att.decode_id] -= 1
            if not finished and att is not None:
                self.counters["cancelled"] += 1
                self.hub.record_finished(code="CANCELLED_OR_FAILED", finish_reason="abort", e2e_seconds=None)
                await self._abort_everywhere(rid, att)
            log.debug("request %s done in %.3f s", rid, time.perf_counter() - t0)

    def _log_slow_first_token(self, rid, num_tokens, t0, now, att: "Attempt", migrations: int) -> None:
        """Where a slow first token's time went, as the router saw it: placing it (the decode
        actor's reserve, then the prefill actor's reserve, prefix pull and start), the prefill and
        transfer (with the prefill actor's own split when it reported one; the first token comes
        with its result), and from there to the token's send; or the local prefill and first step.
        Never raises: it only reports."""
        try:
            m = att.marks
            ms = lambda a, b: f"{1e3 * (b - a):.0f} ms"  # noqa: E731
            parts = [f"{att.mode} on {att.decode_id}"]
            if "decode_reserved" in m:
                parts.append(f"decode reserve {ms(t0, m['decode_reserved'])}")
            task = att.prefill_task
            if "prefill_started" in m and task is None:   # the remote prefill failed: local instead
                parts.append(f"remote prefill failed after {ms(m['prefill_started'], m.get('kv_sent', now))}, "
                             f"then local prefill + first step {ms(m.get('kv_sent', now), now)}")
            elif "prefill_started" in m:
                parts.append(f"prefill placed on {att.prefill_id} {ms(m['decode_reserved'], m['prefill_started'])}")
                if "kv_sent" not in m:    # the common case: the token went out ahead of the last layers
                    split = ", ".join(f"{k} {1e3 * v:.0f} ms" for k, v in m.get("first_timings", {}).items())
                    parts.append(f"prefill to first token {ms(m['prefill_started'], now)}"
                                 + (f" ({split})" if split else "") + ", KV still on the wire")
                else:
                    ok = task.done() and not task.cancelled() and task.exception() is None
                    split = ", ".join(f"{k} {1e3 * v:.0f} ms" for k, v in
                                      (task.result().get("timings", {}) if ok else {}).items())
                    parts.append(f"prefill+transfer {ms(m['prefill_started'], m['kv_sent'])}"
                                 + (f" ({split})" if split else ""))
                    parts.append(f"KV sent to first token {ms(m['kv_sent'], now)}")
            elif "decode_reserved" in m:
                parts.append(f"local prefill + first step {ms(m['decode_reserved'], now)}")
            if migrations:
                parts.append(f"after {migrations} migration(s)")
            log.warning("slow first token for %s (%d prompt tokens): %.0f ms; %s", rid, num_tokens,
                        1e3 * (now - t0), "; ".join(parts))
        except Exception:  # noqa: BLE001 - a report must not fail the request it reports on
            log.exception("could not report the slow first token of %s", rid)

    async def _start_remote_prefill(self, rid, transfer_id, ids, plan, decode_id, sess, hashes, sp, early=None):
        """Take the prefill actor's reservation (made alongside the decode actor's, `early`; else
        reserve now), pull the decode actor's cached prefix into it when it lacks some, then start
        the layer-by-layer transfer into the decode actor's reserved blocks."""
        decode = self.view.handle(decode_id)
        tried: set[str] = set()
        res = None
        if early is not None:
            prefill_id = plan.get("expecting")   # the decode actor registered the receive from it
            try:
                prefill, res = await early
            except (WorkerUnavailable, ray.exceptions.RayActorError) as e:
                # draining, out of KV blocks or gone: another prefill actor (the decode actor's
                # receive is pointed at it by `expect`), as when none was reserved early
                log.info("prefill actor %s unavailable for %s (%s); trying another", prefill_id, rid, e)
                tried.add(prefill_id)
        if res is None:
            while True:
                prefill_id = self._pick("prefill", sess.prefill_worker if sess else None, hashes, exclude=tried)
                prefill = self.view.handle(prefill_id)
                try:
                    res = await self._reservation(prefill.reserve.remote(transfer_id, ids, sp),
                                                  undo=lambda p=prefill: p.abort.remote(transfer_id))
                    break
                except WorkerUnavailable:
                    tried.add(prefill_id)
        try:
            return await self._transfer_from(prefill, prefill_id, decode, decode_id, transfer_id, ids, plan, res,
                                             hashes)
        except BaseException:
            await prefill.abort.remote(transfer_id)  # do not leak the prefill actor's reservation
            raise

    async def _transfer_from(self, prefill, prefill_id, decode, decode_id, transfer_id, ids, plan, res, hashes):
        """`plan`: the decode actor's reservation (its cached tokens, the blocks the KV lands in);
        `res`: the prefill actor's (its cached tokens, all the prompt's blocks)."""
        from tandem.kv_transfer.base import TransferSpec

        layers = list(range(self.num_layers))
        first, n, bs = plan["first_block"], len(plan["dst_block_ids"]), self.block_size
        blocks = res["block_ids"]
        spec = TransferSpec(transfer_id, prefill_id, decode_id, layers, blocks[first:first + n],
                            plan["dst_block_ids"], plan["num_tokens"]).to_msg()
        cached, peer_cached = res["cached_tokens"], plan["cached_tokens"]
        if peer_cached > cached:   # the decode actor holds more of the prefix: pull it, do not recompute
            at = cached // bs      # both counts are whole blocks
            pull_dst = blocks[at:peer_cached // bs]
            pull = TransferSpec(f"{transfer_id}/pull", decode_id, prefill_id, layers,
                                plan["prefix_block_ids"][at:at + len(pull_dst)], pull_dst,
                                len(pull_dst) * bs).to_msg()
            await prefill.expect_pull.remote({**pull, "owner": transfer_id}, peer_cached)
            await decode.send_prefix.remote(pull)
            cached = peer_cached
        if plan.get("expecting") != prefill_id:
            await decode.expect.remote(spec)
        task = asyncio.ensure_future(prefill.start.remote(spec))
        # the first token as soon as it is sampled, while the last layers are still on the wire
        early = asyncio.ensure_future(prefill.first_token.remote(transfer_id))
        self.prefix["prefill"].record(prefill_id, hashes[: len(ids) // self.block_size])
        return prefill_id, cached, task, early

    async def _abort_everywhere(self, rid, att: "Attempt") -> None:
        calls = [att.decode.abort.remote(rid)]
        prefill = self.view.handle(att.prefill_id) if att.prefill_id else None
        if prefill is not None:
            calls.append(prefill.abort.remote(att.transfer_id))
        for c in calls:
            try:
                await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(c.future())), 10)
            except Exception:  # noqa: BLE001 - best effort; a dead actor holds no KV
                pass
        if att.prefill_task is not None:
            att.prefill_task.cancel()
        if att.first_task is not None:
            att.first_task.cancel()


@dataclass
class Attempt:
    """Where a request runs now; a migration makes a new one."""
    decode_id: str
    decode: Any
    prefill_id: str | None = None
    prefill_task: Any = None
    first_task: Any = None       # the prefill actor's first token, ahead of the transfer's end
    transfer_id: str | None = None
    mode: str = "local"
    first_handled: bool = False  # the prefill actor's first token was taken from its result
    release_decode: bool = False  # that token ended the request: free the decode reservation
    local_hold: Any = None        # a local prefill counted in Router.local_queued until its first token
    marks: dict[str, float] = field(default_factory=dict)  # perf_counter() at each stage (slow-TTFT log)
    prefill_cached: int = 0


def _continue(sp: dict[str, Any], out_ids: list[int]) -> dict[str, Any]:
    """Sampling for the rest of a request whose first `out_ids` were already streamed."""
    return {**sp, "max_tokens": max(1, sp["max_tokens"] - len(out_ids))}


class GenerationService(generation_pb2_grpc.GenerationServicer):
    def __init__(self, router: Router):
        self.router = router

    async def Generate(self, request, context):
        r = self.router
        client = client_identity(context.peer(), bearer_token(context.invocation_metadata()))
        try:
            adm = await r.limiter.acquire(client)
        except Overloaded as e:
            r.counters["errors"] += 1
            r.hub.record_finished(code="RESOURCE_EXHAUSTED", finish_reason="none", e2e_seconds=None)
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e), trailing_metadata=e.trailing_metadata())
        r.hub.record_queue_time(adm.queued_s)
        try:
            async for resp in r.generate(request, context):
                yield resp
        except InvalidRequestError as e:
            r.counters["errors"] += 1
            r.hub.record_finished(code="INVALID_ARGUMENT", finish_reason="none", e2e_seconds=None)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except RequestFailed as e:
            r.counters["errors"] += 1
            await context.abort(e.code, str(e))
        except grpc.aio.AbortError:
            raise
        except Exception as e:  # noqa: BLE001 - an actor's unexpected error: a status, not UNKNOWN
            r.counters["errors"] += 1
            log.exception("request failed in the cluster")
            unavailable = isinstance(e, (WorkerUnavailable, ray.exceptions.RayActorError))
            await context.abort(grpc.StatusCode.UNAVAILABLE if unavailable else grpc.StatusCode.INTERNAL,
                                f"request failed in the cluster ({type(e).__name__}: {str(e)[:200]}); "
                                "it is safe to retry")
        finally:
            r.limiter.release(adm)


class AdminService(admin_pb2_grpc.AdminServicer):
    def __init__(self, controller):
        self.controller = controller

    async def GetClusterState(self, request, context):
        return cluster_state_proto(await self.controller.cluster_state.remote())

    async def SetPoolBounds(self, request, context):
        target = request.target if request.HasField("target") else None
        try:
            await self.controller.set_pool_bounds.remote(request.pool, request.min, request.max, target)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        state = cluster_state_proto(await self.controller.cluster_state.remote())
        return next(p for p in state.pools if p.name == request.pool)

    async def DrainWorker(self, request, context):
        try:
            r = await self.controller.drain_worker.remote(request.worker_id)
        except KeyError as e:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(e).strip("'\""))
        return admin_pb2.Worker(id=r["worker_id"], pool=r["pool"], state=_WORKER_STATE[r["state"]])


_WORKER_STATE = {"starting": admin_pb2.WORKER_STATE_STARTING, "ready": admin_pb2.WORKER_STATE_READY,
                 "draining": admin_pb2.WORKER_STATE_DRAINING, "dead": admin_pb2.WORKER_STATE_DEAD}


def cluster_state_proto(state: dict[str, Any]) -> admin_pb2.ClusterState:
    out = admin_pb2.ClusterState()
    totals = out.totals
    for name, p in state["pools"].items():
        pool = out.pools.add(name=name, size=p["size"], target=p["target"], min=p["min"], max=p["max"],
                             draining=p["draining"], target_pinned=p.get("target_pinned", False))
        for w in state["workers"]:
            if w["pool"] != name:
                continue
            s = w.get("stats") or {}
            pool.workers.add(id=w["worker_id"], pool=name, pid=w.get("pid", 0), node=w.get("node", ""),
                             state=_WORKER_STATE[w["state"]], running_requests=s.get("running", 0),
                             waiting_requests=s.get("waiting", 0), kv_blocks_used=s.get("kv_blocks_used", 0),
                             kv_blocks_total=s.get("kv_blocks_total", 0))
            totals.workers += 1
            totals.running_requests += s.get("running", 0)
            totals.waiting_requests += s.get("waiting", 0)
            totals.kv_blocks_used += s.get("kv_blocks_used", 0)
            totals.kv_blocks_total += s.get("kv_blocks_total", 0)
    d = state.get("last_decision") or {}
    if d:
        out.last_decision.CopyFrom(admin_pb2.AutoscalerDecision(
            at_unix_s=d.get("at_unix_s", 0.0), prefill_target=d.get("prefill_target", 0),
            decode_target=d.get("decode_target", 0), reasons=d.get("reasons", [])))
    return out


def publish_cluster_metrics(hub, state: dict[str, Any]) -> None:
    hub.update_from_workers([WorkerMetricsSnapshot.from_worker_stats(w) for w in state["workers"] if w.get("stats")])
    for name, p in state["pools"].items():
        hub.set_pool(name, p["size"], p["target"])


async def serve(controller, config, namespace: str, tokenizer, model_config,
                interceptors=(), credentials=None) -> tuple[grpc.aio.Server, Router, int]:
    """Start the router's gRPC server; returns (server, router, bound port)."""
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection

    rc = config.router
    limits = RequestLimits()
    view = ClusterView(controller, f"router-{uuid.uuid4().hex[:8]}", namespace)
    await view.start()
    sessions = make_session_store(rc.redis_url, rc.session_ttl_s)
    router = Router(view, tokenizer, model_config, config.engine.cache.block_size, sessions, limits,
                    config.decode.local_prefill_threshold,
                    AdmissionConfig(max_in_flight=rc.max_in_flight, max_queue=rc.max_queue,
                                    max_streams_per_client=rc.max_streams_per_client),
                    config.prefill.max_queued_tokens)
    router.slow_ttft_s = rc.slow_ttft_log_s
    view.on_refresh = lambda state: publish_cluster_metrics(router.hub, state)
    server = grpc.aio.server(interceptors=list(interceptors), options=[
        ("grpc.max_receive_message_length", limits.grpc_max_receive_bytes),
        ("grpc.max_send_message_length", 64 << 20)])
    generation_pb2_grpc.add_GenerationServicer_to_server(GenerationService(router), server)
    admin_pb2_grpc.add_AdminServicer_to_server(AdminService(controller), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = (generation_pb2.DESCRIPTOR.services_by_name["Generation"].full_name,
             admin_pb2.DESCRIPTOR.services_by_name["Admin"].full_name, health.SERVICE_NAME,
             reflection.SERVICE_NAME)
    reflection.enable_server_reflection(names, server)
    addr = f"{rc.host}:{rc.port}"
    port = server.add_secure_port(addr, credentials) if credentials else server.add_insecure_port(addr)
    await server.start()
    for svc in ("", names[0], names[1]):
        await health_servicer.set(svc, health_pb2.HealthCheckResponse.SERVING)
    router.health = health_servicer
    return server, router, port
