"""Moving running sequences to another decode actor with their KV (KV-preserving migration): the
receiving side. The sending side (decode_workers/moves.py) says what moves when; here:

1. `reserve` (the router's `DecodeReserve` with `move_headroom`, while the sequence still decodes
   on the other actor): blocks for its tokens so far (but the last) plus the headroom, and two
   receives registered from that actor: the pre-copy, its full blocks (they no longer change), and
   the tail, every block after them up to the headroom. The pre-copy's receive is a record of its
   own, holding its own references on its blocks (`BlockAllocator.share`), so each receive lets go
   of its blocks on its own, whatever order they end in.
2. `take_moved`: once the sequence paused there (its tail is on the way), the router hands over
   its prompt (every token but the last, now), sampling and handoff token; the request joins the
   batch when the tail has landed too, its extra blocks (the headroom it did not use) freed.
A pre-copy that fails fails the request, as a failed transfer does (its router moves it on).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tandem.decode_workers.records import DecodeRequest, DecodeState
from tandem.engine.request import Request
from tandem.kv_transfer.base import TransferState
from tandem.kv_transfer.spec import TransferSpec
from tandem.wire.errors import WorkerUnavailable
from tandem.wire.messages import DecodePlan, DecodeReserve, FirstToken, SamplingParams

if TYPE_CHECKING:   # the worker owns this; a runtime import would be circular
    from tandem.decode_workers.worker import DecodeWorker


class MovesIn:
    def __init__(self, worker: DecodeWorker):
        self.w = worker

    def reserve(self, req: Request, r: DecodeReserve, cached: int) -> DecodePlan:
        w, e = self.w, self.w.engine
        n, bs = req.num_prompt_tokens, w.block_size
        if w.receiver is None or r.prefill_id is None or r.transfer_id is None:
            raise WorkerUnavailable(f"{w.worker_id} cannot receive KV")
        capacity = n + max(1, min(r.move_headroom, r.sampling.max_tokens))
        if not e.allocator.admit(req, capacity - cached):
            raise WorkerUnavailable(f"{w.worker_id} has no free KV blocks for {capacity - cached} moved positions")
        rec = w.requests[r.request_id] = DecodeRequest(req, r.router_id, move_capacity=capacity)
        w.outboxes.seen(r.router_id)
        w.counters["requests"] += 1
        w.moves.moved_in(r.request_id)
        req.num_cached_prompt_tokens, req.admitted_once = req.num_computed_tokens, True
        first, full = cached // bs, max(cached // bs, n // bs)
        rec.transfer_id, rec.state = r.transfer_id, DecodeState.RESERVED
        w._by_transfer[r.transfer_id] = rec
        layers = tuple(range(e.kv_cache.num_layers))
        pre_id = f"{r.transfer_id}/pre" if full > first else None
        try:
            w._expect_spec(rec, TransferSpec(r.transfer_id, r.prefill_id, w.worker_id, layers, (),
                                             tuple(req.block_ids[full:]), capacity))
            if pre_id is not None:
                self._expect_precopy(rec, pre_id, TransferSpec(pre_id, r.prefill_id, w.worker_id, layers, (),
                                                               tuple(req.block_ids[first:full]), full * bs))
        except BaseException:
            w._abort(req.request_id)      # the reserved blocks go back
            raise
        return DecodePlan(remote=True, cached_tokens=cached, first_block=first, dst_block_ids=req.block_ids[first:],
                          num_tokens=capacity, prefix_block_ids=req.block_ids[:first], expecting=r.prefill_id,
                          precopy_blocks=full - first, precopy_id=pre_id)

    def _expect_precopy(self, rec: DecodeRequest, pre_id: str, spec: TransferSpec) -> None:
        w = self.w
        holder = Request(pre_id, rec.request.prompt_token_ids[:spec.num_tokens])
        w.engine.allocator.share(holder, spec.dst_block_ids)
        pre = DecodeRequest(holder, None, transfer_id=pre_id, state=DecodeState.RESERVED, precopy_of=rec)
        rec.precopy = w._by_transfer[pre_id] = pre
        try:
            w._expect_spec(pre, spec)
        except BaseException:
            del w._by_transfer[pre_id]
            rec.precopy = None
            w.engine.allocator.free(holder)
            raise

    # ---- the receives' ends (on the loop thread) -----------------------------------------------
    def tail_landed(self, rec: DecodeRequest) -> bool:
        """The tail's KV landed: False while the pre-copy has not (it is admitted when that does)."""
        if rec.precopy is None:
            return True
        rec.tail_landed, rec.receiving = True, False
        return False

    def precopy_ended(self, pre: DecodeRequest, state: TransferState) -> None:
        w, rec = self.w, pre.precopy_of
        mine = rec.precopy is pre
        if mine:
            rec.precopy = None
        if state is TransferState.DONE:
            pre.receiving, pre.state = False, DecodeState.GONE
            w.engine.allocator.free(pre.request)
            w._sync_transfer_index(pre)
            if mine and rec.tail_landed and rec.awaiting_kv:
                rec.tail_landed = False
                w._kv_landed(rec)
            return
        pre.transfer_failed()              # its references go with the receiver's release
        w._sync_transfer_index(pre)
        if mine and rec.awaiting_kv:       # else it ended already (aborted, or failed)
            self.fail(rec, f"KV transfer (pre-copy) {state.value}")

    def fail(self, rec: DecodeRequest, why: str) -> None:
        """The request ends with an error to its router (which moves it on); its tail's receive is
        aborted (its release frees the blocks) or, landed already, its blocks freed now."""
        w = self.w
        rec.tail_landed = False
        rec.transfer_failed()
        w.forget(rec)
        w.counters["transfer_failures"] += 1
        w._emit_error(rec, why)
        if rec.receiving:
            w.receiver.abort(rec.transfer_id)
        else:                              # its tail landed (or never was registered): nothing writes
            w.engine.allocator.free(rec.request)
            rec.state = DecodeState.GONE
        w._sync_transfer_index(rec)

    def abort_precopy(self, rec: DecodeRequest) -> None:
        """Its request was aborted: the pre-copy's receive too (its release drops its references)."""
        if rec.precopy is not None:
            self.w.receiver.abort(rec.precopy.transfer_id)

    # ---- the handoff (on the loop thread) --------------------------------------------------------
    def take_moved(self, rid: str, prompt_token_ids: list[int], sampling: SamplingParams,
                   handoff: FirstToken) -> bool:
        """The sequence paused on the actor it comes from: its prompt now (every token but the
        handoff, which is its last output, streamed already), sampling (max_tokens left) and the
        handoff. False (and the reservation freed) when it is not a move reserved here any more
        (aborted, its transfer failed) or it outgrew the blocks reserved."""
        w = self.w
        rec = w.requests.get(rid)
        if rec is None or not rec.move_capacity or rec.first is not None or not rec.waiting:
            return False
        old = rec.request
        if len(prompt_token_ids) > rec.move_capacity or prompt_token_ids[:old.num_prompt_tokens] != old.prompt_token_ids:
            w._abort(rid)
            return False
        req = w.engine.make_request(rid, prompt_token_ids=list(prompt_token_ids), sampling=sampling)
        for f in ("block_ids", "block_hashes", "num_registered_blocks", "num_computed_tokens",
                  "num_cached_prompt_tokens", "admitted_once"):
            setattr(req, f, getattr(old, f))
        rec.request = req
        if rec.state is DecodeState.KV_READY:    # landed first: every position is there now
            req.num_computed_tokens = req.num_prompt_tokens
            w.engine.allocator.register_full_blocks(req)
        w.counters["sequences_migrated_in"] += 1
        return w._first_token(rid, handoff)
