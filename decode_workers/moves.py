"""Moving running sequences to another decode actor with their KV (KV-preserving migration): the
sending side. A drain (scale-in, a rolling upgrade, a pod's preStop) or a rebalance moves
sequences without recomputing them; the receiving side (decode_workers/moves_in.py) reserves for
them, fed by this actor instead of a prefill actor. As live VM migration does, the bulk of the KV
moves while the sequence keeps decoding (pre-copy); the pause carries only what changed since.

1. `offer` (between steps, on the loop thread): the sequence's router gets a `SequenceMoving`
   after every output of the sequence so far; the sequence keeps decoding while it fits what its
   router reserves (the positions offered plus `MOVE_HEADROOM_BLOCKS`), then waits out of the
   batch, so a reservation slower than the headroom's steps delays the move but never voids it.
2. The router reserves on another decode actor (blocks for the sequence's positions plus some
   headroom, both receives registered) and calls `start`: the sequence's full blocks (which no
   step writes any more) go there now over this actor's sender, the path prefills use.
3. Once the pre-copy has gone (or the sequence would outgrow the blocks reserved), the sequence
   leaves the batch at a step boundary (`LLMEngine.pause`) and the blocks after the pre-copied
   ones (the tail: its last partial block and the tokens since) go at once; its router gets a
   `SequencePaused` with the handoff token and hands the other actor the sequence's prompt and
   that token (`take_moved`). The pause is that notice and that call, beside the tail's transfer.
   Once the sender lets go of the tail (sent, failed, or aborted) the blocks are freed here. A
   failed send comes back to the router as the receiving actor's transfer error, and the request
   moves on by recompute, as after any failure.
4. Or no other decode actor can take it now: the router calls `resume` and the sequence continues
   here (and is not offered again). A pre-copy that fails, a sequence preempted meanwhile (its
   blocks were reused), or one that outgrew what was reserved, withdraws the offer the same way
   (`SequenceMoving(cancelled=True)`: the router frees the reservation).
While `draining` is set every sequence is offered as soon as it decodes. Before the engine would
have to preempt a sequence for lack of KV blocks (and recompute it later), the youngest running
one is paused at once to move instead (`relieve`: it must not grow meanwhile; its whole KV then
goes as soon as the router has reserved), once per sequence: a sequence that moved in, or that
its router resumed, is never offered for pressure again.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import TYPE_CHECKING

from tandem.decode_workers.records import DecodeRequest, DecodeState
from tandem.engine.request import RequestStatus
from tandem.kv_transfer.base import TransferState
from tandem.kv_transfer.spec import TransferSpec
from tandem.wire.errors import NoReservation
from tandem.wire.messages import MOVE_HEADROOM_BLOCKS, SequenceMoving, SequencePaused

if TYPE_CHECKING:   # the worker owns this; a runtime import would be circular
    from tandem.decode_workers.worker import DecodeWorker

log = logging.getLogger(__name__)


@dataclasses.dataclass(eq=False)
class _Offer:
    """A sequence offered to move: what its router reserved for it, once it has (`start`)."""
    rec: DecodeRequest
    preemptions: int                   # the engine's count for it when offered: a preemption reuses its blocks
    limit: int                         # the positions its router reserves (those offered plus the headroom)
    tail: TransferSpec | None = None   # the tail's registered receive (its source blocks filled at the pause)
    first_block: int = 0               # the receiving actor holds the blocks before (its cached prefix)
    precopy_src: tuple[int, ...] = ()  # the blocks pre-copied, from first_block on
    precopy_id: str | None = None      # the pre-copy's transfer id, while it is on its way
    started_at: float = 0.0


class SequenceMoves:
    def __init__(self, worker: DecodeWorker):
        self.w = worker
        self.draining = False    # offer every sequence as soon as it decodes
        self._offers: dict[str, _Offer] = {}            # request id -> its offer, until its tail is sent
        self._precopies: dict[str, str] = {}            # pre-copy transfer id -> request id
        self._sending: dict[str, tuple[DecodeRequest, float]] = {}   # tail transfer id -> its record, sent at
        self._released: list[str] = []                  # sends the sender let go of, not handled yet
        # (router, outbox ticket) of SequencePaused notices its router has not taken yet: a draining
        # worker must not look idle (and be stopped) before its routers know where their requests went
        self._notices: list[tuple[str, int]] = []
        self._stay: set[str] = set()                    # resumed here: never offered again
        self.relieve = True      # move the youngest sequence out before a preemption would recompute it
        self._moved_in: set[str] = set()                # arrived with their KV: not paused for pressure
        self._pressured: set[str] = set()               # paused for pressure once: not again
        self.counters = {"sequences_migrated": 0, "kv_tokens_migrated": 0, "migrations_resumed": 0,
                         "pressure_moves": 0, "kv_tokens_precopied": 0, "move_precopy_seconds": 0.0,
                         "move_tail_seconds": 0.0}

    # ---- on the loop thread ------------------------------------------------------------------
    def offer(self, request_id: str, pause_now: bool = False) -> bool:
        """Offer a decoding sequence to its router to move; False when it is not one (prefilling,
        waiting for its KV, finished, resumed here before, offered already, or no sender).
        `pause_now`: it leaves the batch at once (it must not take more blocks here)."""
        w = self.w
        rec = w.requests.get(request_id)
        if (rec is None or rec.state is not DecodeState.IN_ENGINE or rec.router_id is None or w.sender is None
                or request_id in self._stay or request_id in self._offers):
            return False
        w.engine.settle()          # a step still on the device (overlap): its tokens go out first
        w.publish(w.engine.take_outputs())
        req = rec.request
        if w.requests.get(request_id) is not rec or not _decoding(req):
            return False
        if pause_now:
            if w.engine.pause(request_id) is None:
                return False
            rec.state = DecodeState.PAUSED
        limit = req.num_tokens - 1 + MOVE_HEADROOM_BLOCKS * w.block_size
        self._offers[request_id] = _Offer(rec, req.num_preemptions, limit)
        w.outboxes.put(rec.router_id, [SequenceMoving(request_id, req.num_tokens - 1)])
        return True

    def offer_some(self, count: int | None = None) -> int:
        """Offer up to `count` decoding sequences (None: all); -> how many."""
        n = 0
        for rid in list(self.w.requests):
            if count is not None and n >= count:
                break
            n += self.offer(rid)
        return n

    def start(self, request_id: str, precopy: TransferSpec | None, tail: TransferSpec, first_block: int) -> None:
        """Its router reserved: pre-copy the full blocks from `first_block` on into `precopy`'s
        destination; the rest goes into `tail`'s once it pauses. May run inside a step."""
        w = self.w
        offer = self._offers.get(request_id)
        if offer is None or w.requests.get(request_id) is not offer.rec or offer.tail is not None:
            raise NoReservation(f"{request_id} is not offered to move on {w.worker_id}")
        req = offer.rec.request
        n_pre = len(precopy.dst_block_ids) if precopy is not None else 0
        if (first_block + n_pre) * w.block_size > req.num_computed_tokens:
            raise ValueError(f"move of {request_id}: {n_pre} full blocks to pre-copy from block {first_block}, "
                             f"but its KV covers {req.num_computed_tokens} positions")
        offer.tail, offer.first_block, offer.started_at = tail, first_block, time.perf_counter()
        if precopy is not None:
            src = tuple(req.block_ids[first_block:first_block + n_pre])
            w.sender.send(dataclasses.replace(precopy, src_block_ids=src))
            offer.precopy_src, offer.precopy_id = src, precopy.request_id
            self._precopies[precopy.request_id] = request_id
        if offer.rec.state is DecodeState.PAUSED:    # paused when offered: the tail follows at once
            self._send_tail(offer)

    def resume(self, request_id: str) -> bool:
        """A sequence offered to move that nobody can take continues here; False when it is not
        one (or its tail is on its way already)."""
        offer = self._offers.pop(request_id, None)
        if offer is not None:
            self._stop_precopy(offer)
        rec = self.w.requests.get(request_id)
        if rec is None or offer is None or offer.rec is not rec:
            return False
        self._stay_here(rec)
        self.counters["migrations_resumed"] += 1
        return True

    def drop(self, rec: DecodeRequest) -> None:
        """A paused sequence aborted by its router: its blocks and state go now."""
        self.w.engine.drop_paused(rec.request)

    def abort_send(self, rec: DecodeRequest) -> None:
        """Aborted while its KV is being sent: the sender's release frees the blocks."""
        self.w.sender.abort(rec.transfer_id)

    def released(self, transfer_id: str) -> None:
        """The sender's release callback: only notes it (`between_steps` frees the blocks)."""
        if transfer_id in self._sending:
            self._released.append(transfer_id)

    def sends_ended(self, reaped: list[tuple[str, TransferState]]) -> None:
        """The sender's ended transfers (`reap()`): a pre-copy that went lets its sequence pause;
        one that failed withdraws its offer."""
        for tid, state in reaped:
            offer = self._offers.get(self._precopies.pop(tid, ""))
            if offer is None or offer.precopy_id != tid:
                continue
            offer.precopy_id = None
            if state is TransferState.DONE:
                self.counters["move_precopy_seconds"] += time.perf_counter() - offer.started_at
            else:
                self._cancel(offer, f"its pre-copy {state.value}")

    def between_steps(self) -> None:
        while self._released:
            rec, sent_at = self._sending.pop(self._released.pop(), (None, 0.0))
            if rec is None:
                continue
            self.counters["move_tail_seconds"] += time.perf_counter() - sent_at
            rec.state = DecodeState.GONE
            self.w.engine.drop_paused(rec.request)
            self.w.forget(rec)
        if self._stay or self._moved_in or self._pressured:
            live = self.w.requests.keys()
            self._stay &= live
            self._moved_in &= live
            self._pressured &= live
        for offer in list(self._offers.values()):
            self._advance(offer)
        if self.draining:
            self.offer_some()
        elif self.relieve:
            self._relieve()

    def moved_in(self, request_id: str) -> None:
        self._moved_in.add(request_id)

    def holding(self) -> int:
        """Sequences paused or sending (out of the batch, their blocks still held here), or sent
        and their router not told yet."""
        if self._notices:
            self._notices = [(r, t) for r, t in self._notices if not self.w.outboxes.delivered(r, t)]
        return len(self._notices) + sum(1 for r in self.w.requests.values()
                                        if r.state in (DecodeState.PAUSED, DecodeState.SENDING))

    # ---- the offer's course (between steps) --------------------------------------------------
    def _advance(self, offer: _Offer) -> None:
        rec = offer.rec
        rid = rec.request_id
        if self.w.requests.get(rid) is not rec or rec.state not in (DecodeState.IN_ENGINE, DecodeState.PAUSED):
            del self._offers[rid]              # finished or aborted meanwhile: its router frees the rest
            self._stop_precopy(offer)
            return
        if offer.tail is None:                 # not reserved yet: it decodes while it has room
            if rec.state is DecodeState.IN_ENGINE and self._near_capacity(offer, offer.limit):
                self._pause(offer)
            return
        if offer.precopy_id is not None and not self._near_capacity(offer, offer.tail.num_tokens):
            return                             # still pre-copying with room to decode
        if rec.state is DecodeState.IN_ENGINE and not self._pause(offer):
            return
        self._send_tail(offer)

    def _pause(self, offer: _Offer) -> bool:
        """Take the offered sequence out of the batch at this step boundary; False when it is not
        paused (that step finished it, or it is no longer decoding: the offer is withdrawn)."""
        w, rec = self.w, offer.rec
        w.engine.settle()
        w.publish(w.engine.take_outputs())
        if w.requests.get(rec.request_id) is not rec:  # that step finished it
            self._advance(offer)
            return False
        if w.engine.pause(rec.request_id) is None:
            self._cancel(offer, "it is not decoding")
            return False
        rec.state = DecodeState.PAUSED
        return True

    @staticmethod
    def _near_capacity(offer: _Offer, positions: int) -> bool:
        """Two more steps (one may be in flight) could take it past `positions`."""
        req = offer.rec.request
        per_step = 1 + (req.sampling.num_speculative_tokens or 0)
        return req.num_tokens - 1 + 2 * per_step > positions

    def _send_tail(self, offer: _Offer) -> None:
        """The sequence is paused: the blocks after the pre-copied ones go now, and its router
        learns it paused. Refused (the offer withdrawn) when it outgrew the blocks reserved or its
        pre-copied blocks are no longer its own."""
        w, rec, tail = self.w, offer.rec, offer.tail
        req, rid = rec.request, rec.request_id
        n = req.num_tokens - 1
        k = offer.first_block + len(offer.precopy_src)
        src = list(req.block_ids[k:w.engine.allocator.blocks_needed(n)])
        if (n > tail.num_tokens or len(src) > len(tail.dst_block_ids) or req.num_preemptions != offer.preemptions
                or tuple(req.block_ids[offer.first_block:k]) != offer.precopy_src):
            return self._cancel(offer, f"it no longer fits what was reserved ({n} positions, {tail.num_tokens} reserved)")
        # the tail's receive covers every reserved block: the ones past the sequence get a copy of
        # its last (never read there: they are past its length, and freed when it is admitted)
        src += [src[-1] if src else req.block_ids[k - 1]] * (len(tail.dst_block_ids) - len(src))
        del self._offers[rid]
        rec.state, rec.transfer_id = DecodeState.SENDING, tail.request_id
        self._sending[tail.request_id] = (rec, time.perf_counter())
        try:
            w.sender.send(dataclasses.replace(tail, src_block_ids=tuple(src)))
        except Exception as e:  # noqa: BLE001 - the sender is closed or the spec refused: it stays here
            del self._sending[tail.request_id]
            rec.state, rec.transfer_id = DecodeState.PAUSED, None
            self._offers[rid] = offer
            return self._cancel(offer, f"its tail could not be sent: {e}")
        self.counters["sequences_migrated"] += 1
        self.counters["kv_tokens_migrated"] += n - offer.first_block * w.block_size
        self.counters["kv_tokens_precopied"] += len(offer.precopy_src) * w.block_size
        if rec.router_id is not None:
            ticket = w.outboxes.put(rec.router_id, [SequencePaused(rid, w.engine.handoff(req), n)])
            self._notices.append((rec.router_id, ticket))

    def _cancel(self, offer: _Offer, why: str) -> None:
        """Withdraw the offer: the sequence continues here and its router frees what it reserved."""
        rec = offer.rec
        rid = rec.request_id
        self._offers.pop(rid, None)
        self._stop_precopy(offer)
        log.info("%s stays on %s: %s", rid, self.w.worker_id, why)
        if self.w.requests.get(rid) is not rec:
            return
        self._stay_here(rec)
        if rec.router_id is not None:
            self.w.outboxes.put(rec.router_id, [SequenceMoving(rid, rec.request.num_tokens - 1, cancelled=True)])

    def _stay_here(self, rec: DecodeRequest) -> None:
        self._stay.add(rec.request_id)
        if rec.state is DecodeState.PAUSED:
            rec.state = DecodeState.IN_ENGINE
            self.w.engine.resume(rec.request)

    def _stop_precopy(self, offer: _Offer) -> None:
        if offer.precopy_id is not None:
            self._precopies.pop(offer.precopy_id, None)
            self.w.sender.abort(offer.precopy_id)
            offer.precopy_id = None

    def _relieve(self) -> None:
        """Fewer free KV blocks than running sequences: the next steps may need one each, and the
        engine would preempt the youngest (recomputing it later); pause it to move instead."""
        e = self.w.engine
        running = e.scheduler.running
        if len(running) < 2 or e.allocator.num_free_blocks >= len(running):
            return
        rid = running[-1].request_id
        if rid not in self._moved_in and rid not in self._pressured and self.offer(rid, pause_now=True):
            self._pressured.add(rid)
            self.counters["pressure_moves"] += 1


def _decoding(req) -> bool:
    """Running, past its prompt: its KV covers every token but the last (between steps)."""
    return (req.status is RequestStatus.RUNNING and bool(req.output_token_ids)
            and req.num_computed_tokens == req.num_tokens - 1)
