"""Moving a running request to another decode actor with its KV (KV-preserving migration), the
router's half. The decode actor that runs it offers it (`SequenceMoving`: it drains, was asked to
rebalance, or is short of blocks) and keeps decoding it; here the router, in the background while
the request's tokens keep streaming,

1. picks another decode actor (as for a new request: prefix hits, load; never the offering one or
   one that died under the request) and reserves there (`DecodeReserve.move_headroom`): blocks
   for every token so far but the last plus some headroom, the receives registered from the
   offering actor;
2. has the offering actor start (`start_move`): it pre-copies the sequence's full blocks there,
   then pauses the sequence at a step boundary and sends the tail itself (decode_workers/moves.py);
3. on its `SequencePaused`, hands the other actor the sequence's prompt and handoff token
   (`take_moved`), which it continues from once the tail has landed.
So the pause holds one notice and one call beside the tail's transfer; the reservation and the
bulk of the KV are off it.

The request's stream sees no gap and no duplicate: the offering actor's outputs all came before
its notice, and the next actor's first output is the token after the handoff. Seeded sampling
continues from the sampler state the handoff carries. A reservation refused everywhere, or a
start refused, has the offering actor `resume` (the sequence stays there); an offer it withdraws
(`cancelled`) or a failed pre-copy (the other actor's transfer error) frees the reservation. A
handoff that fails after the pause moves the request on by recompute, as after any failure.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import ray

from tandem.engine.prefix_hash import block_hashes
from tandem.kv_transfer.spec import TransferSpec
from tandem.router.flow import RequestFlow
from tandem.router.placing import Attempt, Placer
from tandem.wire.errors import InvalidRequestError, NoReservation, WorkerUnavailable
from tandem.wire.messages import (MOVE_HEADROOM_BLOCKS, DecodePlan, DecodeReserve, OutputError, SequenceMoving,
                                  SequencePaused)

log = logging.getLogger(__name__)


@dataclass(eq=False)
class PendingMove:
    """A move under way: `task` reserves and starts it (-> the attempt on the other actor, or None
    when it could not); `att` is that attempt once reserved, for a cleanup to free."""
    request_id: str
    task: asyncio.Future | None = None
    att: Attempt | None = None


def on_notice(placer: Placer, flow: RequestFlow, att: Attempt, msg: SequenceMoving | OutputError, queue) -> None:
    """A move offered (start it in the background), withdrawn, or its reservation failed."""
    if isinstance(msg, SequenceMoving) and not msg.cancelled:
        cont = flow.moved_continuation(msg.num_tokens)
        if flow.move is not None:         # (never offered twice)
            return
        if cont is None:
            log.info("%s stays on %s: its offer (%d positions) is not the sequence streamed (%d tokens)",
                     flow.request_id, att.decode_id, msg.num_tokens, len(flow.prompt) + len(flow.out_ids))
            placer.in_background(att.decode.resume.remote(request_id=att.request_id))
            return
        pm = flow.move = PendingMove(placer.new_attempt(flow.cluster_id, queue))
        pm.task = asyncio.ensure_future(_start(placer, flow, att, pm, *cont))
        return
    if isinstance(msg, OutputError):      # the pre-copy failed on the other actor: stay here
        log.info("%s stays on %s: %s", flow.request_id, att.decode_id, msg.error)
        placer.in_background(att.decode.resume.remote(request_id=att.request_id))
    abandon(placer, flow)


def abandon(placer: Placer, flow: RequestFlow) -> None:
    """Free the reservation of a move under way (the request ended, moved otherwise, or stays)."""
    pm, flow.move = flow.move, None
    if pm is None:
        return
    if pm.task is not None and not pm.task.done():
        pm.task.cancel()                  # it frees what it reserved
    elif pm.att is not None:
        _undo(placer, pm.att)
    else:
        placer.forget(pm.request_id)


async def complete(placer: Placer, flow: RequestFlow, paused: SequencePaused) -> Attempt:
    """The offering actor paused the sequence and sent its tail: hand it over. -> the attempt on
    the other actor; raises (NoReservation, WorkerUnavailable, a Ray error) when that failed: the
    caller moves the request on by recompute."""
    t0 = time.perf_counter()
    pm, flow.move = flow.move, None
    if pm is None or pm.task is None:
        raise NoReservation(f"{flow.request_id} paused to move, but nothing is reserved for it")
    new = await pm.task
    if new is None:
        raise NoReservation(f"{flow.request_id}: its reservation elsewhere failed")
    cont = flow.moved_continuation(paused.num_tokens, paused.handoff.token_id)
    try:
        if cont is None:
            raise WorkerUnavailable(f"{flow.request_id}: the paused sequence is not the one streamed")
        ids, sp = cont
        taken = await new.decode.take_moved.remote(request_id=new.request_id, prompt_token_ids=ids, sampling=sp,
                                                   handoff=paused.handoff)
        if not taken:
            raise NoReservation(f"{new.decode_id} no longer holds {flow.request_id}'s reservation")
    except BaseException:
        _undo(placer, new)
        raise
    t = new.marks["moved"] = time.perf_counter()
    log.info("moved %s to %s with the KV of %d positions: reserved %.1f ms and started %.1f ms after the offer, "
             "paused %.1f ms after it, handed over in %.1f ms", flow.request_id, new.decode_id, paused.num_tokens,
             1e3 * (new.marks["reserved"] - new.marks["offered"]), 1e3 * (new.marks["started"] - new.marks["offered"]),
             1e3 * (t0 - new.marks["offered"]), 1e3 * (t - t0))
    return new


async def _start(placer: Placer, flow: RequestFlow, att: Attempt, pm: PendingMove, ids: list[int], sp) -> Attempt | None:
    t0 = time.perf_counter()
    try:
        new, plan = await _reserve(placer, flow, att, pm.request_id, ids, sp)
    except (Exception, asyncio.CancelledError) as e:  # noqa: BLE001 - nowhere to go (PLACEMENT_ERRORS), or it ended
        placer.forget(pm.request_id)
        return _stays(placer, flow, att, pm, e)
    pm.att = new
    new.marks["offered"] = t0
    bs, layers = placer.block_size, tuple(range(placer.num_layers))
    n_pre, first = plan.precopy_blocks, plan.first_block
    pre = None if not n_pre else TransferSpec(plan.precopy_id, att.decode_id, new.decode_id, layers, (),
                                              plan.dst_block_ids[:n_pre], (first + n_pre) * bs)
    tail = TransferSpec(new.transfer_id, att.decode_id, new.decode_id, layers, (), plan.dst_block_ids[n_pre:],
                        plan.num_tokens)
    try:
        await att.decode.start_move.remote(request_id=att.request_id, precopy=pre, tail=tail, first_block=first)
    except (Exception, asyncio.CancelledError) as e:  # noqa: BLE001 - refused (NoReservation, ValueError), or gone
        pm.att = None
        _undo(placer, new)
        return _stays(placer, flow, att, pm, e)
    new.marks["started"] = time.perf_counter()
    return new


def _stays(placer: Placer, flow: RequestFlow, att: Attempt, pm: PendingMove, why: BaseException) -> None:
    """The move could not start: the sequence continues where it is. Re-raises a cancel."""
    if flow.move is pm:
        flow.move = None
    placer.in_background(att.decode.resume.remote(request_id=att.request_id))
    if isinstance(why, asyncio.CancelledError):
        raise why
    log.info("%s stays on %s: %s", flow.request_id, att.decode_id, why)
    return None


def _undo(placer: Placer, new: Attempt) -> None:
    view = placer.view
    if view.inflight.get(new.decode_id):
        view.inflight[new.decode_id] -= 1
    placer.forget(new.request_id)
    placer.in_background(new.decode.abort.remote(new.request_id))


async def _reserve(placer: Placer, flow: RequestFlow, att: Attempt, rid: str, ids: list[int],
                   sp) -> tuple[Attempt, DecodePlan]:
    view = placer.view
    hashes = block_hashes(ids, placer.block_size)
    tried = {att.decode_id} | flow.lost
    while True:
        decode_id = placer.pick("decode", None, hashes, exclude=tried)
        decode = view.handle(decode_id)
        view.inflight[decode_id] = view.inflight.get(decode_id, 0) + 1
        ask = DecodeReserve(rid, view.router_id, ids, sp, transfer_id=f"{rid}#move", prefill_id=att.decode_id,
                            move_headroom=MOVE_HEADROOM_BLOCKS * placer.block_size)
        try:
            plan = await placer.reservation(decode.reserve.remote(ask), undo=lambda d=decode: d.abort.remote(rid))
        except (WorkerUnavailable, InvalidRequestError, ray.exceptions.RayActorError) as e:   # no room there
            view.inflight[decode_id] -= 1
            log.debug("%s cannot take %s: %s", decode_id, flow.request_id, e)
            tried.add(decode_id)
            continue
        except BaseException:
            view.inflight[decode_id] -= 1
            raise
        new = Attempt(rid, decode_id, decode, transfer_id=f"{rid}#move", mode="moved")
        new.marks["reserved"] = time.perf_counter()
        return new, plan
