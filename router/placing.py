"""Placing one request on the cluster's actors: pick workers through the placement policy
(tandem.placement), reserve on the decode actor and, when it asks for remote prefill, on a prefill
actor, start the KV transfer between them, and undo every reservation a cancelled or failed request
leaves behind. The request's own flow (router/flow.py, router/generation.py) calls `place` and
`abort_everywhere`; nothing here streams tokens.

Promises: a reservation is freed on every path that does not hand it to the caller (cancelled
while awaiting it, failed after it, or not needed); the prompt tokens counted on an actor
(`prefill_queued`, `local_queued`) are released exactly once.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import ray

from tandem.kv_transfer.spec import TransferSpec
from tandem.perf_model import PerfModel
from tandem.placement import (LOCAL, READY, BatchGuard, EngineLoad, OverloadFn, OverloadLimits, PrefillOption, WorkerView, any_ready, choose_prefill, has_slack,
                              choose_worker, prefill_options, local_prefill_queue, prefill_placement,
                              remote_prefill_offered)
from tandem.router.cluster_view import ClusterView
from tandem.router.prefix_index import PrefixIndex
from tandem.router.sessions import SessionState
from tandem.wire.errors import NoReservation, NoWorkerReady, WorkersOverloaded, WorkerUnavailable
from tandem.wire.messages import DecodePlan, DecodeReserve, PrefillReservation, PrefillReserve, SamplingParams

log = logging.getLogger(__name__)

Hold = tuple[dict[str, int], str, int]   # (queued counts, worker id, tokens): see Placer.hold
# what sends a request to another actor or to its decode actor's own prefill (NoReservation: the
# prefill actor's reservation expired or was aborted between reserve and a prefix pull)
PLACEMENT_ERRORS = (WorkerUnavailable, NoWorkerReady, WorkersOverloaded, NoReservation, ray.exceptions.RayActorError)


@dataclass
class Attempt:
    """Where a request runs now; a migration makes a new one. `request_id` is the id the actors
    know this attempt by (the client's id plus an attempt number, new for every reservation on a
    decode actor), so nothing an earlier attempt left in an outbox reaches this one."""
    request_id: str
    decode_id: str
    decode: Any
    prefill_id: str | None = None
    prefill_task: Any = None     # the prefill actor's start(): its PrefillResult once the KV is sent
    first_task: Any = None       # the prefill actor's FirstTokenReady, ahead of the transfer's end
    transfer_id: str | None = None
    mode: str = "local"
    local_hold: Hold | None = None  # a local prefill counted in Placer.local_queued until its first token
    marks: dict[str, float] = field(default_factory=dict)  # perf_counter() at each stage (slow-TTFT log)
    prefill_cached: int = 0

    @property
    def remote(self) -> bool:
        return self.prefill_task is not None


@dataclass
class _Placement:
    """One `Placer.place` call's arguments and what it learned on the way."""
    rid: str
    ids: list[int]
    sp: SamplingParams
    sess: SessionState | None
    hashes: list[bytes]
    transfer_id: str | None = None
    prefill_hint: str | None = None
    chunk: int | None = None   # a local prefill's tokens per step (the cost model's pick)
    hold: Hold | None = None   # the prompt counted on the prefill actor picked first
    early: Any = None          # that actor's reservation, made alongside the decode actor's
    recomputed: int = 0        # prompt tokens computed before, elsewhere (a request moved by recompute)


@dataclass(frozen=True)
class CostPlacement:
    """The router's cost model: service times and the SLOs placement keeps inside."""

    perf: PerfModel
    slo_ttft_s: float
    slo_tpot_s: float
    batch_guard: bool = True    # refuse a request that would slow its decode worker's batch past the TPOT SLO

    def full_for(self, prompt_tokens: int, block_tokens: int) -> OverloadFn | None:
        """`choose_worker`'s `full` for a new request of `prompt_tokens` (tandem.placement.BatchGuard)."""
        if not self.batch_guard:
            return None
        return BatchGuard(self.perf, self.slo_tpot_s).full_for(prompt_tokens, block_tokens)


class Placer:
    def __init__(self, view: ClusterView, block_size: int, num_layers: int, counters: dict[str, int], *,
                 local_prefill_threshold: float = 256, max_prefill_queued_tokens: float = math.inf,
                 overload: OverloadLimits = OverloadLimits(), cost: CostPlacement | None = None):
        self.view = view
        self.block_size = block_size
        self.num_layers = num_layers
        self.counters = counters
        self.threshold = local_prefill_threshold
        # past max_prefill_queued tokens of this router's remote prefills on a prefill actor, it gets
        # no more while a decode actor's own queue of local prefills is shorter (prefill_placement)
        self.max_prefill_queued = max_prefill_queued_tokens
        self.overload = overload
        # placement by the cost model (router.placement "cost"): where each prompt is prefilled is
        # tandem.placement.choose_prefill's answer, not the threshold and queue-cap rules
        self.cost = cost
        self.prefill_queued: dict[str, int] = {}   # prompt tokens placed on each prefill actor, not yet delivered
        self.local_queued: dict[str, int] = {}     # ... on each decode actor to prefill itself, no first token yet
        # which worker caches which prompt blocks, whatever part it serves: a worker keeps its KV cache
        # through a role change, so a prompt it decoded is a prefix hit when it is lent to prefill
        self.prefix = PrefixIndex()
        view.on_gone = self.prefix.forget_worker    # a worker that left took its cache with it
        self._background: set[asyncio.Future] = set()   # fire-and-forget cleanups, kept referenced
        self._attempts = itertools.count(1)

    # ---- attempts: the ids actors know a request by ---------------------------------------------
    def _attempt_id(self, rid: str) -> str:
        """A new id for `rid` on the actors: each reservation on a decode actor gets its own, and
        only the current one's outputs reach the request's queue."""
        return f"{rid}/{next(self._attempts)}"

    def _listen(self, attempt_id: str, queue: asyncio.Queue) -> None:
        self.view.queues[attempt_id] = queue

    def new_attempt(self, rid: str, queue: asyncio.Queue) -> str:
        """A new attempt id for request `rid`, whose outputs go to `queue` from now on."""
        aid = self._attempt_id(rid)
        self._listen(aid, queue)
        return aid

    def forget(self, attempt_id: str) -> None:
        """What actors still send under this attempt's id is dropped from now on."""
        self.view.queues.pop(attempt_id, None)

    # ---- the policy ---------------------------------------------------------------------------
    def pick(self, pool: str, session_worker: str | None, hashes: list[bytes], exclude=(),
             new_tokens: int | None = None) -> str:
        """The `pool` worker for a request (tandem.placement.choose_worker). `new_tokens`: the prompt
        of a new request to the decode pool, which the cost model's batch guard may refuse (None: a
        request already running, moved, is never refused by it)."""
        views = [w for w in self.view.views(pool) if w.worker_id not in exclude]
        hits = {w: n * self.block_size for w, n in self.prefix.match(hashes).items()}
        full = self.full_for(pool, new_tokens)
        wid = choose_worker(views, session_worker, hits, overload_fn=self.overload, full=full)
        if wid is None:
            if full is not None and any(w.state == READY and not self.overload(w) for w in views):
                self.counters["batch_guard_refused"] = self.counters.get("batch_guard_refused", 0) + 1
                raise WorkersOverloaded(f"no {pool} worker has room in its batch for this request within the "
                                        f"TPOT SLO ({self.cost.slo_tpot_s * 1e3:g} ms, router.slo_tpot_ms); "
                                        "retry later", reason="batch_guard")
            if any_ready(views):
                raise WorkersOverloaded(f"every {pool} worker is overloaded; retry later")
            raise NoWorkerReady(f"no {pool} worker is ready")
        return wid

    def full_for(self, pool: str, new_tokens: int | None) -> OverloadFn | None:
        if self.cost is None or pool != "decode" or new_tokens is None:
            return None
        return self.cost.full_for(new_tokens, self.block_size)

    def prefill_plan(self, sess: SessionState | None, num_tokens: int, hashes: list[bytes],
                     moved: bool = False) -> tuple[str | None, int | None]:
        """(the prefill actor to reserve on alongside the decode actor, None: prefill locally; the
        local prefill's tokens per step, None: the step budget). By the cost model when the router
        has one (router.placement "cost"), else by the rules (`prefill_target`)."""
        if self.cost is None:
            return self.prefill_target(sess, num_tokens, hashes), None
        if not remote_prefill_offered(self.threshold, 1):
            return None, None
        best = self.cost_choice(sess, num_tokens, hashes, moved)
        if best is None or best.where == LOCAL:
            return None, best.chunk_tokens if best is not None else None
        return best.worker_id, None

    def prefill_target(self, sess: SessionState | None, num_tokens: int, hashes: list[bytes]) -> str | None:
        """The rules' prefill actor to reserve on alongside the decode actor; None: prefill locally."""
        # the workers that take new prefills now (not draining, not lent to decode)
        prefill_ids = [w.worker_id for w in self.view.views("prefill") if w.state == "ready"]
        if not remote_prefill_offered(self.threshold, len(prefill_ids)):
            return None
        try:
            hint = self.pick("prefill", sess.prefill_worker if sess else None, hashes)
        except (NoWorkerReady, WorkersOverloaded):
            return None
        local = local_prefill_queue(sess.decode_worker if sess else None, self.local_queued,
                                    [w.worker_id for w in self.view.views("decode")])
        placed = prefill_placement(hint, prefill_ids, self.prefill_queued, local, num_tokens, self.max_prefill_queued)
        if placed is None:      # every prefill actor is backlogged: prefill locally
            self.counters["prefill_backlogged"] = self.counters.get("prefill_backlogged", 0) + 1
        return placed

    def engine_load(self, w: WorkerView) -> EngineLoad:
        """A worker's engine for the cost model: its batch and KV from its stats, and the prompt
        tokens this router has queued on it (remote prefills to their KV, local ones to their first
        token)."""
        return EngineLoad(w.running, w.kv_blocks_used * self.block_size,
                          self.prefill_queued.get(w.worker_id, 0) + self.local_queued.get(w.worker_id, 0))

    def cost_choice(self, sess: SessionState | None, num_tokens: int, hashes: list[bytes],
                    moved: bool = False) -> PrefillOption | None:
        """The cost model's choice (tandem.placement.choose_prefill) among the decode worker's own
        prefill (at each chunk size) and every ready worker that serves prefill and has slack; None
        when no decode worker can take the request."""
        decode_views = self.view.views("decode")
        hits = {w: n * self.block_size for w, n in self.prefix.match(hashes).items()}
        decode_id = choose_worker(decode_views, sess.decode_worker if sess else None, hits,
                                  overload_fn=self.overload,
                                  full=self.full_for("decode", None if moved else num_tokens))
        if decode_id is None:
            return None
        dview = next(w for w in decode_views if w.worker_id == decode_id)
        dload = self.engine_load(dview)
        decoding = {w.worker_id for w in decode_views if w.state == READY}
        others = {w.worker_id: (self.engine_load(w), hits.get(w.worker_id, 0))
                  for w in self.view.views("prefill")
                  if w.state == READY and not self.overload(w) and w.worker_id != decode_id
                  and has_slack(self.engine_load(w), w.worker_id not in decoding, dload)}
        c = self.cost
        best = choose_prefill(prefill_options(c.perf, num_tokens, decode_id, dload,
                                              hits.get(decode_id, 0), others),
                              c.slo_ttft_s, c.slo_tpot_s)
        self.counters[f"cost_{best.where}"] = self.counters.get(f"cost_{best.where}", 0) + 1
        return best

    # ---- placing ------------------------------------------------------------------------------
    async def place(self, rid: str, ids: list[int], sp: SamplingParams, sess: SessionState | None,
                    hashes: list[bytes], exclude: set[str], queue: asyncio.Queue, recomputed: int = 0,
                    avoid: set[str] = frozenset()) -> Attempt:
        """Reserve on a decode actor (the session's, else the best prefix hit, else the least
        loaded), and when it asks for remote prefill, start it on a prefill actor; a worker that is
        draining or gone is skipped, and a prefill that cannot start falls back to local prefill.
        The prefill actor is picked first and reserved on while the decode actor reserves (the two
        answers are independent); it is named in the decode actor's reserve, which then registers
        the KV receive from it. Both save a sequential call per remote prefill. The decode actor's
        outputs for the new attempt go to `queue`. `recomputed`: how many of the prompt's tokens were
        computed before, elsewhere (a request moved by recompute: the workers count them). `avoid`:
        decode actors tried only once no other one can take it (those the request failed on)."""
        aid = self._attempt_id(rid)
        self._listen(aid, queue)
        try:
            return await self._place(_Placement(aid, ids, sp, sess, hashes, recomputed=recomputed), exclude, avoid)
        except BaseException:
            self.forget(aid)
            raise

    async def _place(self, p: _Placement, exclude: set[str], avoid: set[str]) -> Attempt:
        rid, ids, sp, sess, hashes = p.rid, p.ids, p.sp, p.sess, p.hashes
        p.prefill_hint, p.chunk = self.prefill_plan(sess, len(ids), hashes, moved=bool(p.recomputed))
        if p.prefill_hint is not None:
            p.transfer_id = f"{rid}#{uuid.uuid4().hex[:8]}"
            # counted on the prefill actor at once, so concurrent arrivals see it
            p.hold = self.hold(self.prefill_queued, p.prefill_hint, len(ids))
            p.early = asyncio.ensure_future(self._reserve_prefill(p.prefill_hint, p.transfer_id, ids, sp))
        try:
            att, plan = await self._reserve_decode(p, exclude, avoid)
        except BaseException:
            self.release(p.hold)
            self._drop_prefill_reservation(p.early, p.transfer_id)
            raise
        try:
            await self._after_decode_reserve(att, p, plan)
        except BaseException:
            # cancelled (the client went, its deadline passed) or failed before the caller has the
            # attempt: nobody else knows of the decode actor's reservation
            self.view.inflight[att.decode_id] -= 1
            self.release(att.local_hold)
            self.forget(att.request_id)     # a local fallback may have made it a new attempt
            self.in_background(att.decode.abort.remote(att.request_id))
            raise
        return att

    async def _reserve_decode(self, p: _Placement, exclude: set[str], avoid: set[str]) -> tuple[Attempt, DecodePlan]:
        avoid = set(avoid) - set(exclude)
        tried = set(exclude) | avoid
        while True:
            try:
                decode_id = self.pick("decode", p.sess.decode_worker if p.sess else None, p.hashes, exclude=tried,
                                      new_tokens=None if p.recomputed else len(p.ids))
            except (NoWorkerReady, WorkersOverloaded):
                if not avoid:
                    raise
                tried -= avoid           # no other one can take it: those it failed on may
                avoid = set()
                continue
            decode = self.view.handle(decode_id)
            # count it at once, so concurrent arrivals see this load before the worker reports it
            self.view.inflight[decode_id] = self.view.inflight.get(decode_id, 0) + 1
            ask = DecodeReserve(p.rid, self.view.router_id, p.ids, p.sp, p.transfer_id, p.prefill_hint,
                                prefill_chunk_tokens=p.chunk, recomputed_tokens=p.recomputed)
            try:
                plan = await self.reservation(decode.reserve.remote(ask), undo=lambda d=decode: d.abort.remote(p.rid))
            except (WorkerUnavailable, ray.exceptions.RayActorError):
                self.view.inflight[decode_id] -= 1
                tried.add(decode_id)
                continue
            att = Attempt(p.rid, decode_id, decode, transfer_id=p.transfer_id, mode=plan.mode)
            att.marks["decode_reserved"] = time.perf_counter()
            return att, plan

    async def _after_decode_reserve(self, att: Attempt, p: _Placement, plan: DecodePlan) -> None:
        """`place`, once the decode actor has answered: start the remote prefill it asked for (or
        prefill locally), or drop the early prefill reservation when it prefills itself."""
        if not plan.remote:                 # prefilled locally: the early one is not needed
            # counted on the decode actor until its first token (prefill_placement weighs it)
            att.local_hold = self.hold(self.local_queued, att.decode_id, len(p.ids) - plan.cached_tokens)
            self.release(p.hold)
            self._drop_prefill_reservation(p.early, p.transfer_id)
            return
        try:
            await self._start_remote_prefill(att, p, plan)
        except BaseException as e:
            self.release(p.hold)
            if not isinstance(e, PLACEMENT_ERRORS):
                raise
            log.info("remote prefill of %s unavailable (%s); prefilling locally", p.rid, e)
            await self.prefill_locally(att, p.ids, p.sp)
            return
        att.marks["prefill_started"] = time.perf_counter()
        att.prefill_task.add_done_callback(lambda _: att.marks.setdefault("kv_sent", time.perf_counter()))
        hold = p.hold
        if hold is None or hold[1] != att.prefill_id:    # another prefill actor took it
            self.release(hold)
            hold = self.hold(self.prefill_queued, att.prefill_id, len(p.ids))
        att.prefill_task.add_done_callback(lambda _: self.release(hold))

    async def prefill_locally(self, att: Attempt, ids: list[int], sp: SamplingParams) -> None:
        """Drop a remote-prefill reservation (its half-received KV is freed) and queue the request
        for the decode actor's own prefill instead, as a new attempt: an error the decode actor
        sent for the remote one (its transfer aborted) must not end the local one."""
        old, queue = att.request_id, self.view.queues.get(att.request_id)
        await att.decode.abort.remote(old)
        self.forget(old)
        rid = att.request_id = self._attempt_id(old.rsplit("/", 1)[0])
        if queue is not None:
            self._listen(rid, queue)
        ask = DecodeReserve(rid, self.view.router_id, ids, sp, replaces=old)   # taken even while draining
        plan = await self.reservation(att.decode.reserve.remote(ask), undo=lambda: att.decode.abort.remote(rid))
        if att.local_hold is None:
            att.local_hold = self.hold(self.local_queued, att.decode_id, len(ids) - plan.cached_tokens)
        if att.first_task is not None:
            att.first_task.cancel()
        att.prefill_id = att.prefill_task = att.first_task = None

    # ---- the remote prefill -------------------------------------------------------------------
    async def _start_remote_prefill(self, att: Attempt, p: _Placement, plan: DecodePlan) -> None:
        """Take the prefill actor's reservation (made alongside the decode actor's, `p.early`; else
        reserve now), pull the decode actor's cached prefix into it when it lacks some, then start
        the layer-by-layer transfer into the decode actor's reserved blocks."""
        tried: set[str] = set()
        prefill, prefill_id, res = None, plan.expecting, None
        if p.early is not None:
            try:
                prefill, res = await p.early
            except (WorkerUnavailable, ray.exceptions.RayActorError) as e:
                # draining, out of KV blocks or gone: another prefill actor (the decode actor's
                # receive is pointed at it by `expect`), as when none was reserved early
                log.info("prefill actor %s unavailable for %s (%s); trying another", prefill_id, p.rid, e)
                tried.add(prefill_id)
        tried.add(att.decode_id)     # a worker that also prefills: its own prefill is the local one
        while res is None:
            prefill_id = self.pick("prefill", p.sess.prefill_worker if p.sess else None, p.hashes, exclude=tried)
            try:
                prefill, res = await self._reserve_prefill(prefill_id, p.transfer_id, p.ids, p.sp)
            except WorkerUnavailable:
                tried.add(prefill_id)
        try:
            await self._transfer_from(att, p, plan, prefill, prefill_id, res)
        except BaseException:
            await prefill.abort.remote(p.transfer_id)  # do not leak the prefill actor's reservation
            raise

    async def _transfer_from(self, att: Attempt, p: _Placement, plan: DecodePlan, prefill, prefill_id: str,
                             res: PrefillReservation) -> None:
        """`plan`: the decode actor's reservation (its cached tokens, the blocks the KV lands in);
        `res`: the prefill actor's (its cached tokens, all the prompt's blocks)."""
        layers, bs, tid = list(range(self.num_layers)), self.block_size, p.transfer_id
        first, n, blocks = plan.first_block, len(plan.dst_block_ids), res.block_ids
        spec = TransferSpec(tid, prefill_id, att.decode_id, layers, blocks[first:first + n], plan.dst_block_ids,
                            plan.num_tokens)
        cached, peer_cached = res.cached_tokens, plan.cached_tokens
        if peer_cached > cached:   # the decode actor holds more of the prefix: pull it, do not recompute
            at = cached // bs      # both counts are whole blocks
            pull_dst = blocks[at:peer_cached // bs]
            pull = TransferSpec(f"{tid}/pull", att.decode_id, prefill_id, layers,
                                plan.prefix_block_ids[at:at + len(pull_dst)], pull_dst, len(pull_dst) * bs)
            await prefill.expect_pull.remote(spec=pull, owner=tid, covers_tokens=peer_cached)
            await att.decode.send_prefix.remote(spec=pull)
            cached = peer_cached
        if plan.expecting != prefill_id:
            await att.decode.expect.remote(spec=spec)
        att.prefill_id, att.prefill_cached = prefill_id, cached
        att.prefill_task = asyncio.ensure_future(prefill.start.remote(spec=spec))
        # the first token as soon as it is sampled, while the last layers are still on the wire
        att.first_task = asyncio.ensure_future(prefill.first_token.remote(transfer_id=tid))
        self.prefix.record(prefill_id, p.hashes[: len(p.ids) // bs])

    async def _reserve_prefill(self, prefill_id: str, transfer_id: str, ids, sp) -> tuple[Any, PrefillReservation]:
        """-> (the actor's handle, its reservation)."""
        handle = self.view.handle(prefill_id)
        if handle is None:
            raise WorkerUnavailable(f"{prefill_id} left the prefill pool")
        return handle, await self.reservation(handle.reserve.remote(PrefillReserve(transfer_id, ids, sp)),
                                              undo=lambda: handle.abort.remote(transfer_id))

    # ---- undoing ------------------------------------------------------------------------------
    def _drop_prefill_reservation(self, early, transfer_id) -> None:
        """In the background: once the early prefill reservation has been answered, free it."""
        if early is not None:
            self._undo_once_answered(early, lambda answer: answer[0].abort.remote(transfer_id))

    async def reservation(self, ref, undo):
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
        self.in_background(run())

    def in_background(self, aw) -> None:
        """A cleanup that must outlive the request (kept referenced; errors logged, not raised)."""
        async def run():
            try:
                await aw
            except Exception as e:  # noqa: BLE001 - best effort: a dead actor holds no KV
                log.debug("background cleanup failed: %s", e)
        task = asyncio.ensure_future(run())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def abort_everywhere(self, att: Attempt) -> None:
        """Free what the attempt holds on its actors; what they still send for it is dropped."""
        self.forget(att.request_id)
        calls = [att.decode.abort.remote(att.request_id)]
        prefill = self.view.handle(att.prefill_id) if att.prefill_id else None
        if prefill is not None:
            calls.append(prefill.abort.remote(att.transfer_id))
        for c in calls:
            try:
                await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(c.future())), 10)
            except Exception:  # noqa: BLE001 - best effort; a dead actor holds no KV
                pass
        for task in (att.prefill_task, att.first_task):
            if task is not None:
                task.cancel()

    # ---- prompt tokens counted on actors ------------------------------------------------------
    @staticmethod
    def hold(queued: dict[str, int], worker_id: str, tokens: int) -> Hold:
        """Count `tokens` of this router's prompts on `worker_id` in `queued` (prefill_queued or
        local_queued) until `release` of what this returns."""
        queued[worker_id] = queued.get(worker_id, 0) + tokens
        return queued, worker_id, tokens

    @staticmethod
    def release(hold: Hold | None) -> None:
        if hold is None:
            return
        queued, worker_id, tokens = hold
        left = queued.get(worker_id, 0) - tokens
        if left > 0:
            queued[worker_id] = left
        else:
            queued.pop(worker_id, None)
