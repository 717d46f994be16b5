"""Moving a running request to another decode actor with its KV (KV-preserving migration), the
router's half. The decode actor that runs it paused it (`SequencePaused`: it drains, or was asked
to rebalance) and holds its blocks; here the router

1. picks another decode actor (as for a new request: prefix hits, load; never the paused one or
   one that died under the request) and reserves there with `DecodeReserve.handoff`: blocks for
   every token but the last, the receive registered from the paused actor, and the handoff token
   it continues from once the KV has landed (it was streamed already);
2. has the paused actor send the KV layer by layer into those blocks (`send_kv`), over the path
   prefills use.

The request's stream sees no gap and no duplicate: the paused actor's outputs all came before its
notice, and the next actor's first output is the token after the handoff. Seeded sampling
continues from the sampler state the handoff carries. A send that fails comes back as the new
actor's transfer error, and the request moves on by recompute like after any failure. When no
other actor can take it now, the paused actor resumes it (`resume`) and it finishes there.
"""

from __future__ import annotations

import logging
import time

import ray

from tandem.engine.prefix_hash import block_hashes
from tandem.kv_transfer.spec import TransferSpec
from tandem.router.flow import RequestFlow
from tandem.router.placing import Attempt, Placer
from tandem.wire.errors import InvalidRequestError, WorkerUnavailable
from tandem.wire.messages import DecodePlan, DecodeReserve, SequencePaused

log = logging.getLogger(__name__)


async def move_with_kv(placer: Placer, flow: RequestFlow, att: Attempt, paused: SequencePaused, queue) -> Attempt:
    """The request's attempt on the actor it moved to; the paused attempt is left to the caller
    (its actor frees it once the KV is sent). Raises PLACEMENT_ERRORS (or NoReservation from the
    paused actor) when it could not move: the caller resumes it where it is."""
    cont = flow.moved_continuation(paused)
    if cont is None:
        raise WorkerUnavailable(f"{att.request_id}: the paused sequence is not the one streamed")
    ids, sp = cont
    view = placer.view
    t0 = time.perf_counter()
    rid = placer.new_attempt(flow.cluster_id, queue)
    try:
        new, plan = await _reserve(placer, flow, att, rid, ids, sp, paused)
    except BaseException:
        placer.forget(rid)
        raise
    spec = TransferSpec(f"{rid}#move", att.decode_id, new.decode_id, tuple(range(placer.num_layers)), (),
                        plan.dst_block_ids, plan.num_tokens)
    try:
        await att.decode.send_kv.remote(request_id=att.request_id, spec=spec, first_block=plan.first_block)
    except BaseException:
        view.inflight[new.decode_id] -= 1
        placer.forget(rid)
        placer.in_background(new.decode.abort.remote(rid))
        raise
    t2 = new.marks["moved"] = time.perf_counter()
    log.info("moved %s from %s to %s with the KV of %d positions (%d cached there): reserved in %.1f ms, "
             "sending after %.1f ms", flow.request_id, att.decode_id, new.decode_id, plan.num_tokens,
             plan.cached_tokens, 1e3 * (new.marks["reserved"] - t0), 1e3 * (t2 - t0))
    return new


async def _reserve(placer: Placer, flow: RequestFlow, att: Attempt, rid: str, ids: list[int], sp,
                   paused: SequencePaused) -> tuple[Attempt, DecodePlan]:
    view = placer.view
    hashes = block_hashes(ids, placer.block_size)
    tried = {att.decode_id} | flow.lost
    while True:
        decode_id = placer.pick("decode", None, hashes, exclude=tried)
        decode = view.handle(decode_id)
        view.inflight[decode_id] = view.inflight.get(decode_id, 0) + 1
        ask = DecodeReserve(rid, view.router_id, ids, sp, transfer_id=f"{rid}#move", prefill_id=att.decode_id,
                            handoff=paused.handoff)
        try:
            plan = await placer.reservation(decode.reserve.remote(ask), undo=lambda d=decode: d.abort.remote(rid))
        except (WorkerUnavailable, InvalidRequestError, ray.exceptions.RayActorError) as e:   # no room there
            view.inflight[decode_id] -= 1
            log.debug("%s cannot take %s: %s", decode_id, flow.request_id, e)
            tried.add(decode_id)
            continue
        new = Attempt(rid, decode_id, decode, transfer_id=f"{rid}#move", mode="moved")
        new.marks["reserved"] = time.perf_counter()
        return new, plan

