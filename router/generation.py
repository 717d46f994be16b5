"""One Generate call, independent of gRPC plumbing: validate and tokenize, place the request
(router/placing.py), stream its tokens, move it to another decode actor when its own fails, and
free what it holds on every actor when it ends early. The request's states and what each message
means are in its record (router/flow.py); this module does the waiting and the calls.

Errors leave as the exception types of tandem.wire.errors (and InvalidRequestError); the gRPC
edge (router/server.py) maps them to status codes.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import time
import uuid
from typing import Any

from tandem.engine.prefix_hash import block_hashes
from tandem.placement import OverloadLimits
from tandem.protos.tandem.v1 import generation_pb2
from tandem.router.admission import AdmissionConfig, AdmissionLimiter, Overloaded
from tandem.router.cluster_view import ClusterView
from tandem.router.flow import Event, FlowState, RequestFlow
from tandem.router.moving import abandon, complete, on_notice
from tandem.router.placing import Attempt, CostPlacement, Placer
from tandem.router.request_ids import ActiveRequests, DuplicateRequest
from tandem.router.sessions import SessionState
from tandem.router.slow_log import slow_first_token_parts
from tandem.router.status_codes import OWN_MESSAGES, status_code
from tandem.router.validation import RequestLimits, validate_request
from tandem.runtime.logging_setup import bind_request
from tandem.runtime.metrics import get_hub
from tandem.wire.errors import InvalidRequestError, NoWorkerReady, WorkersOverloaded
from tandem.wire.messages import FinishReason, OutputError, SamplingParams, SequencePaused, StepOutput

log = logging.getLogger(__name__)

FINISH = {FinishReason.STOP: generation_pb2.STOP, FinishReason.LENGTH: generation_pb2.LENGTH,
          FinishReason.ABORT: generation_pb2.ABORT}


def _logprobs_pb(token_ids: list[int], logprobs) -> list[generation_pb2.TokenLogprob]:
    return [generation_pb2.TokenLogprob(token_id=t, logprob=lp.logprob, top=[
        generation_pb2.TopLogprob(token_id=i, logprob=v) for i, v in lp.top]) for t, lp in zip(token_ids, logprobs)]


def _actor_key(handle) -> str | None:
    """The Ray actor behind a handle (None for test fakes)."""
    actor_id = getattr(handle, "_actor_id", None)
    return actor_id.hex() if actor_id is not None else None


class Router:
    """Everything a Generate call needs, independent of gRPC plumbing."""

    def __init__(self, view: ClusterView, tokenizer, model_config, block_size: int, sessions,
                 limits: RequestLimits = RequestLimits(), local_prefill_threshold: float = 256,
                 admission: AdmissionConfig = AdmissionConfig(), max_prefill_queued_tokens: float = math.inf,
                 overload: OverloadLimits = OverloadLimits(), cost: CostPlacement | None = None):
        self.view = view
        self.tokenizer = tokenizer
        self.vocab_size = model_config.vocab_size
        self.max_context = model_config.max_position_embeddings
        self.block_size = block_size
        self.sessions = sessions
        self.limits = limits
        self.counters = {"requests": 0, "ok": 0, "errors": 0, "cancelled": 0}
        self.placer = Placer(view, block_size, model_config.num_layers, self.counters,
                             local_prefill_threshold=local_prefill_threshold,
                             max_prefill_queued_tokens=max_prefill_queued_tokens, overload=overload,
                             cost=cost)
        self.max_migrations = 2  # per request, then UNAVAILABLE
        # a request whose decode worker died waits this long at most (and never past its deadline)
        # for a ready one, e.g. the controller's replacement, before it fails UNAVAILABLE
        self.replacement_wait_s = 120.0
        self.slow_ttft_s: float | None = 1.0  # log where the time went for first tokens slower than this
        self.hub = get_hub()
        self.limiter = AdmissionLimiter(admission, on_change=self.hub.set_router_queue)
        self.active = ActiveRequests(view.router_id)

    # ---- input ------------------------------------------------------------------------------
    def prepare(self, request) -> tuple[Any, list[int], Any]:
        v = validate_request(request, vocab_size=self.vocab_size, max_context=self.max_context, limits=self.limits)
        if v.messages is not None:
            if v.tools and not getattr(self.tokenizer, "supports_tools", False):
                raise InvalidRequestError("this model's chat template does not support tools (it never reads "
                                          "`tools`); send the request without tools, or serve a model whose "
                                          "template renders them")
            extra = {"tools": v.tools} if v.tools else {}
            text = self.tokenizer.apply_chat_template(v.messages, add_generation_prompt=True, **extra)
            ids = self.tokenizer.encode(text, add_special_tokens=False)
        elif v.prompt is not None:
            ids = self.tokenizer.encode(v.prompt)
        else:
            ids = list(v.prompt_token_ids)
        if not ids:
            raise InvalidRequestError("the prompt has no tokens after tokenization")
        sampling = v.sampling_for_prompt(len(ids), self.max_context)
        return v, ids, sampling

    # ---- one request ------------------------------------------------------------------------
    async def admit_and_generate(self, request, client: str, deadline: float | None = None):
        """`generate` behind admission control: the one entry point of the gRPC and HTTP edges.
        Raises Overloaded when the request is shed; closing the generator cancels the request.
        `deadline`: the client's, in time.monotonic() seconds (None: none), to tell a deadline that
        passed from a cancel in the metrics."""
        adm = await self.limiter.acquire(client)
        self.hub.record_queue_time(adm.queued_s)
        try:
            async for resp in self.generate(request, client, deadline):
                self.limiter.started(adm)      # its first token: no longer ahead of newcomers
                yield resp
        except WorkersOverloaded as e:         # refused by every worker: as router-wide as the limiter's
            e.retry_after_s = self.limiter.spaced(e.retry_after_s, workers=True)
            raise
        finally:
            self.limiter.release(adm)

    def record_error(self, e: Exception, code: str) -> None:
        """Count a request that ended in error `e` (its status `code`, for the metrics)."""
        self.counters["errors"] += 1
        if isinstance(e, (InvalidRequestError, Overloaded, DuplicateRequest)):   # refused before the cluster
            self.hub.record_finished(code=code, finish_reason="none", e2e_seconds=None)
        if isinstance(e, (Overloaded, WorkersOverloaded)):
            self.hub.record_shed("admission" if isinstance(e, Overloaded) else e.reason)

    async def generate(self, request, client: str = "", deadline: float | None = None):
        """One request from `client` (for its request ids: router/request_ids.py). A request that
        ends without finishing counts in requests_total as CANCELLED, DEADLINE_EXCEEDED or its
        failure's status code."""
        t0 = time.perf_counter()
        self.counters["requests"] += 1
        v, ids, sampling = self.prepare(request)
        rid = v.request_id or uuid.uuid4().hex
        cluster_id = self.active.claim(client, rid)
        try:
            with bind_request(rid):
                try:
                    async for resp in self._generate(v, ids, sampling, rid, cluster_id, t0, deadline):
                        yield resp
                except Exception as e:
                    if not isinstance(e, OWN_MESSAGES):   # the client gets one line; the detail is here
                        log.exception("request %s failed in the cluster", rid)
                    e.tandem_request_id = rid     # quoted to the client (router/status_codes.py)
                    self.hub.record_finished(code=status_code(e).name, finish_reason="abort", e2e_seconds=None)
                    raise
                except (asyncio.CancelledError, GeneratorExit):
                    late = deadline is not None and time.monotonic() >= deadline - 0.05
                    self.hub.record_finished(code="DEADLINE_EXCEEDED" if late else "CANCELLED",
                                             finish_reason="abort", e2e_seconds=None)
                    raise
        finally:
            self.active.release(client, rid)

    async def _generate(self, v, ids, sp: SamplingParams, rid, cluster_id, t0, deadline=None):
        sess = await self.sessions.get(v.session_id) if v.session_id else None
        flow = RequestFlow(rid, ids, sp, max_migrations=self.max_migrations, cluster_id=cluster_id,
                           deadline=deadline)
        queue: asyncio.Queue = asyncio.Queue()
        att: Attempt | None = None
        try:
            att = await self.placer.place(cluster_id, ids, sp, sess, block_hashes(ids, self.block_size), flow.lost, queue)
            flow.placed(att.remote)
            last_t = None
            while flow.state is not FlowState.FINISHED:
                msg = await self._next_message(flow, att, queue)
                event = None if msg is None else flow.classify(msg, att.decode_id)
                if event is Event.MIGRATE:
                    att = await self._migrate(flow, att, msg, queue)
                elif event is Event.MOVE:      # offered to move: reserved and pre-copied in the background
                    on_notice(self.placer, flow, att, msg, queue)
                elif event is Event.MOVED:
                    att = await self._move(flow, att, msg, queue)
                if event is not Event.TOKENS:
                    continue
                resp, last_t = self._respond(flow, att, msg, t0, last_t)
                yield resp
                if flow.handover is not None:   # streamed: now the decode actor continues from it
                    await self._hand_over(flow, att)
            await self._finished(v, sess, flow, att)
        finally:
            await self._cleanup(flow, att, t0)

    async def _next_message(self, flow: RequestFlow, att: Attempt, queue: asyncio.Queue):
        """The request's next message: a failure the router saw itself, the prefill actor's first
        token while PREFILLING, else what the decode actor's output pump delivers. None: nothing yet
        (the prefill ended or sampled, or fell back to a local prefill): ask again."""
        injected = flow.take_injected()
        if injected is not None:
            return injected
        if flow.state is not FlowState.PREFILLING:
            return await queue.get()
        task, early = att.prefill_task, att.first_task
        if early is not None and early.done() and (early.cancelled() or early.exception() is not None):
            early = att.first_task = None   # no early token: the prefill's result brings it
        if not task.done() and not (early is not None and early.done()):
            getter = asyncio.ensure_future(queue.get())
            await asyncio.wait({getter, task} | ({early} if early is not None else set()),
                               return_when=asyncio.FIRST_COMPLETED)
            if not getter.done():
                getter.cancel()
                return None              # the prefill ended or sampled: handled on the next call
            return getter.result()       # (an error from the decode actor, say)
        if task.done() and task.exception() is not None:
            # the prefill actor failed (or died) before the KV and first token arrived
            log.warning("remote prefill of %s failed (%s); prefilling locally", flow.request_id, task.exception())
            self.hub.record_migration("prefill_failed")
            await self.placer.prefill_locally(att, *flow.continuation())
            flow.prefill_fell_back()
            return None
        # the prefill actor sampled the first token: stream it now (the decode actor takes it before
        # or after its KV lands); a transfer that fails later comes back as the decode actor's error
        if early is not None and early.done():
            ready = early.result()
            first = ready.first
            att.marks["first_timings"] = ready.timings
        else:
            first = task.result().first
        return flow.first_from_prefill(first, att.prefill_cached)

    async def _migrate(self, flow: RequestFlow, att: Attempt, msg, queue: asyncio.Queue) -> Attempt:
        """The decode actor died (or the request failed on it): continue on another one from the
        prompt plus the tokens already streamed; greedy output is unchanged."""
        abandon(self.placer, flow)                   # a move under way: what it reserved goes
        reason = flow.migrate(msg, att.decode_id)    # raises MigrationsExhausted past the limit
        if reason == "decode_lost":      # that actor, not the worker id: a restarted controller reuses ids
            flow.lost_actors[att.decode_id] = _actor_key(att.decode)
        self.hub.record_migration(reason)
        log.warning("moving %s off %s after %d tokens: %s", flow.request_id, att.decode_id, len(flow.out_ids),
                    msg.error)
        self.view.inflight[att.decode_id] -= 1
        self.placer.release(att.local_hold)
        att.local_hold = None
        if reason != "decode_lost":
            await self.placer.abort_everywhere(att)
        self.placer.forget(att.request_id)
        cont, sp = flow.continuation()
        att = await self._place_when_ready(flow, cont, sp, queue)
        flow.placed(att.remote)
        return att

    async def _move(self, flow: RequestFlow, att: Attempt, msg: SequencePaused, queue: asyncio.Queue) -> Attempt:
        """Its decode actor paused it to move, its tail on the way to the actor reserved for it:
        hand it over there (router/moving.py); when that fails, move it on by recompute."""
        try:
            new = await complete(self.placer, flow, msg)
        except Exception as e:  # noqa: BLE001 - a refusal or a dead actor: recompute, as after any failure
            return await self._migrate(flow, att, OutputError(att.request_id, f"moving it with its KV failed: "
                                                                             f"{type(e).__name__}: {e}"), queue)
        self.hub.record_migration("kv_moved")
        self.view.inflight[att.decode_id] -= 1
        self.placer.forget(att.request_id)     # its actor frees the blocks once they are sent
        return new

    async def _place_when_ready(self, flow: RequestFlow, ids: list[int], sp: SamplingParams,
                                queue: asyncio.Queue) -> Attempt:
        """Place a moved request; while no decode worker is ready (the one that died was the last,
        its replacement is starting), wait for one, up to `replacement_wait_s` and the deadline."""
        give_up = time.monotonic() + self.replacement_wait_s
        if flow.deadline is not None:
            give_up = min(give_up, flow.deadline)
        waited = False
        while True:
            try:
                return await self.placer.place(flow.cluster_id, ids, sp, None, block_hashes(ids, self.block_size),
                                               flow.lost, queue, recomputed=len(ids), avoid=flow.failed_on)
            except NoWorkerReady:
                if time.monotonic() + self.view.refresh_s > give_up:
                    raise
                for wid in list(flow.lost):     # a new actor under a lost one's id may serve it
                    handle = self.view.handle(wid)
                    if handle is not None and _actor_key(handle) != flow.lost_actors.get(wid):
                        flow.lost.discard(wid)
                if not waited:
                    log.warning("%s waits for a ready decode worker", flow.request_id)
                    waited = True
                await asyncio.sleep(self.view.refresh_s)

    def _respond(self, flow: RequestFlow, att: Attempt, msg: StepOutput, t0: float, last_t: float | None):
        """The response for `msg`, with the latency metrics it completes; -> (response, its time)."""
        resp = generation_pb2.GenerateResponse(token_ids=msg.token_ids, text=msg.text)
        if msg.logprobs is not None:
            resp.logprobs.extend(_logprobs_pb(msg.token_ids, msg.logprobs))
        now = time.perf_counter()
        if flow.take(msg):
            resp.request_id = flow.request_id
            self.placer.release(att.local_hold)
            att.local_hold = None
            self.hub.record_first_token(now - t0)
            if self.slow_ttft_s is not None and now - t0 > self.slow_ttft_s:
                self._log_slow_first_token(flow.request_id, len(flow.prompt), t0, now, att, flow.migrations)
        elif msg.token_ids:
            self.hub.record_tokens(now - last_t, len(msg.token_ids))
        if msg.finished:
            usage = flow.finish(msg.usage, att.prefill_cached)
            resp.finish_reason = FINISH[msg.finish_reason]
            resp.usage.CopyFrom(generation_pb2.Usage(**dataclasses.asdict(usage)))
            self.hub.record_finished(code="OK", finish_reason=msg.finish_reason.value,
                                     e2e_seconds=time.perf_counter() - t0)
        return resp, now

    async def _hand_over(self, flow: RequestFlow, att: Attempt) -> None:
        """The prefill actor's first token (streamed already) to the decode actor, which continues
        from it; a refusal moves the request on."""
        first, flow.handover = flow.handover, None
        try:
            taken = await att.decode.first_token.remote(request_id=att.request_id, first=first)
        except Exception as e:  # noqa: BLE001 - its output pump reports a dead actor too
            taken, why = False, f"{type(e).__name__}: {e}"
        else:
            why = "it no longer held the request"
        if not taken:
            flow.handover_refused(why)

    async def _finished(self, v, sess, flow: RequestFlow, att: Attempt) -> None:
        rid = flow.request_id
        if flow.release_decode:
            await att.decode.abort.remote(att.request_id)   # its reservation: the first token ended the request
        if att.prefill_task is not None:
            try:
                await att.prefill_task
            except Exception as e:  # noqa: BLE001 - the tokens arrived; only a late report failed
                if not flow.release_decode:     # else its transfer was aborted on purpose
                    log.warning("prefill of %s reported %s after its tokens were streamed", rid, e)
        self.counters["ok"] += 1
        self.placer.prefix.record(att.decode_id, block_hashes(flow.prompt + flow.out_ids, self.block_size))
        if v.session_id:
            await self.sessions.put(v.session_id, SessionState(
                decode_worker=att.decode_id,
                prefill_worker=att.prefill_id or (sess.prefill_worker if sess else None),
                num_tokens=len(flow.prompt) + len(flow.out_ids), turn=(sess.turn + 1 if sess else 1)))

    async def _cleanup(self, flow: RequestFlow, att: Attempt | None, t0: float) -> None:
        """However the request ended: its counts on actors go, and if it did not finish, whatever it
        holds on its actors is freed."""
        abandon(self.placer, flow)
        if att is not None:
            self.placer.forget(att.request_id)
            self.placer.release(att.local_hold)
            if self.view.inflight.get(att.decode_id):
                self.view.inflight[att.decode_id] -= 1
            if flow.state is not FlowState.FINISHED:     # counted in requests_total by `generate`
                self.counters["cancelled"] += 1
                await self.placer.abort_everywhere(att)
        log.debug("request %s done in %.3f s", flow.request_id, time.perf_counter() - t0)

    def _log_slow_first_token(self, rid, num_tokens, t0, now, att: Attempt, migrations: int) -> None:
        """Where a slow first token's time went, as the router saw it (router/slow_log.py). Never
        raises: it only reports."""
        try:
            log.warning("slow first token for %s (%d prompt tokens): %.0f ms; %s", rid, num_tokens,
                        1e3 * (now - t0), "; ".join(slow_first_token_parts(att, t0, now, migrations)))
        except Exception:  # noqa: BLE001 - a report must not fail the request it reports on
            log.exception("could not report the slow first token of %s", rid)
