"""Moving running sequences to another decode actor with their KV (KV-preserving migration): the
sending side. A drain (scale-in, a rolling upgrade, a pod's preStop) or a rebalance moves
sequences without recomputing them; the receiving side is an ordinary remote-prefill reservation
(`DecodeReserve.handoff`), fed by this actor instead of a prefill actor.

1. `pause` (between steps, on the loop thread): a decoding sequence leaves the batch keeping its
   blocks, sampler and detokenizer state (`LLMEngine.pause`), and its router gets a
   `SequencePaused` after every output of the sequence so far, carrying the handoff token: the
   last output token, which the next decode actor continues from.
2. The router reserves on another decode actor (which registers the receive from this one) and
   calls `send`: the blocks go layer by layer over this actor's sender, the path prefills use.
   Once the sender lets go of them (sent, failed, or aborted) they are freed here. A failed send
   comes back to the router as the receiving actor's transfer error, and the request moves on by
   recompute, as after any failure.
3. Or no other decode actor can take it now: the router calls `resume` and the sequence continues
   here (and is not paused again).
While `draining` is set every sequence is paused as soon as it decodes. Before the engine would
have to preempt a sequence for lack of KV blocks (and recompute it later), the youngest running
one is paused to move instead (`relieve`), once per sequence: a sequence that moved in, or that
its router resumed, is never paused for pressure again.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING

from tandem.decode_workers.records import DecodeRequest, DecodeState
from tandem.kv_transfer.spec import TransferSpec
from tandem.wire.errors import NoReservation
from tandem.wire.messages import SequencePaused

if TYPE_CHECKING:   # the worker owns this; a runtime import would be circular
    from tandem.decode_workers.worker import DecodeWorker

log = logging.getLogger(__name__)


class SequenceMoves:
    def __init__(self, worker: DecodeWorker):
        self.w = worker
        self.draining = False    # pause every sequence as soon as it decodes
        self._sending: dict[str, DecodeRequest] = {}   # transfer id -> the record whose KV it carries
        self._released: list[str] = []                 # sends the sender let go of, not handled yet
        self._stay: set[str] = set()                   # resumed here: never paused again
        self.relieve = True      # move the youngest sequence out before a preemption would recompute it
        self._moved_in: set[str] = set()               # arrived with their KV: not paused for pressure
        self._pressured: set[str] = set()              # paused for pressure once: not again
        self.counters = {"sequences_migrated": 0, "kv_tokens_migrated": 0, "migrations_resumed": 0,
                         "pressure_moves": 0}

    # ---- on the loop thread ------------------------------------------------------------------
    def pause(self, request_id: str) -> bool:
        """Take a decoding sequence out of the batch for its router to move; False when it is not
        one (prefilling, waiting for its KV, finished, resumed here before, or no sender)."""
        w = self.w
        rec = w.requests.get(request_id)
        if (rec is None or rec.state is not DecodeState.IN_ENGINE or rec.router_id is None or w.sender is None
                or request_id in self._stay):
            return False
        w.engine.settle()          # a step still on the device (overlap): its tokens go out first
        w.publish(w.engine.take_outputs())
        req = w.engine.pause(request_id)
        if req is None:
            return False
        rec.state = DecodeState.PAUSED
        w.outboxes.put(rec.router_id, [SequencePaused(request_id, w.engine.handoff(req), req.num_tokens - 1)])
        return True

    def pause_some(self, count: int | None = None) -> int:
        """Pause up to `count` decoding sequences (None: all); -> how many."""
        n = 0
        for rid in list(self.w.requests):
            if count is not None and n >= count:
                break
            n += self.pause(rid)
        return n

    def send(self, request_id: str, spec: TransferSpec, first_block: int) -> None:
        """Send a paused sequence's KV from its block `first_block` on into `spec`'s destination
        blocks (the receiving actor holds the ones before: its cached prefix)."""
        w = self.w
        rec = w.requests.get(request_id)
        if rec is None or rec.state is not DecodeState.PAUSED:
            state = rec.state.value if rec is not None else "unknown"
            raise NoReservation(f"{request_id} is not paused on {w.worker_id} ({state})")
        src = rec.request.block_ids[first_block:first_block + len(spec.dst_block_ids)]
        if len(src) != len(spec.dst_block_ids):
            raise ValueError(f"move of {request_id}: {len(spec.dst_block_ids)} destination blocks from block "
                             f"{first_block}, but it holds {len(rec.request.block_ids)}")
        rec.state, rec.transfer_id = DecodeState.SENDING, spec.request_id
        self._sending[spec.request_id] = rec
        try:
            w.sender.send(dataclasses.replace(spec, src_block_ids=tuple(src)))
        except BaseException:
            del self._sending[spec.request_id]
            rec.state, rec.transfer_id = DecodeState.PAUSED, None
            raise
        self.counters["sequences_migrated"] += 1
        self.counters["kv_tokens_migrated"] += spec.num_tokens - first_block * w.block_size

    def resume(self, request_id: str) -> bool:
        """A paused sequence nobody can take continues here; False when it is not paused."""
        rec = self.w.requests.get(request_id)
        if rec is None or rec.state is not DecodeState.PAUSED:
            return False
        rec.state = DecodeState.IN_ENGINE
        self._stay.add(request_id)
        self.w.engine.resume(rec.request)
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

    def between_steps(self) -> None:
        while self._released:
            rec = self._sending.pop(self._released.pop(), None)
            if rec is None:
                continue
            rec.state = DecodeState.GONE
            self.w.engine.drop_paused(rec.request)
            self.w.forget(rec)
        if self._stay or self._moved_in or self._pressured:
            live = self.w.requests.keys()
            self._stay &= live
            self._moved_in &= live
            self._pressured &= live
        if self.draining:
            self.pause_some()
        elif self.relieve:
            self._relieve()

    def moved_in(self, request_id: str) -> None:
        self._moved_in.add(request_id)

    def _relieve(self) -> None:
        """Fewer free KV blocks than running sequences: the next steps may need one each, and the
        engine would preempt the youngest (recomputing it later); pause it to move instead."""
        e = self.w.engine
        running = e.scheduler.running
        if len(running) < 2 or e.allocator.num_free_blocks >= len(running):
            return
        rid = running[-1].request_id
        if rid not in self._moved_in and rid not in self._pressured and self.pause(rid):
            self._pressured.add(rid)
            self.counters["pressure_moves"] += 1

    def holding(self) -> int:
        """Sequences paused or sending: out of the batch, their blocks still held here."""
        return sum(1 for r in self.w.requests.values() if r.state in (DecodeState.PAUSED, DecodeState.SENDING))
