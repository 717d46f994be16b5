"""router/moving.py through the router's public `generate`, against fake actors (no Ray): a decode
actor offers a running sequence (`SequenceMoving`) and the router reserves on another one and
starts the pre-copy while the tokens keep streaming, then hands the sequence over on its
`SequencePaused`; when the offer is withdrawn, nowhere can take it, or the request ends first,
what was reserved on the other actor is freed and the offering actor keeps the sequence."""

from __future__ import annotations

import asyncio

from tandem.wire.errors import WorkerUnavailable
from tandem.wire.messages import (DecodePlan, FinishReason, FirstToken, SequenceMoving, SequencePaused, StepOutput,
                                  Usage)
from tests.unit.test_router_generation import BLOCK, FakeDecode, FakeView, make_router, request, run

PROMPT = 16     # request()'s prompt tokens


class Source(FakeDecode):
    """Decodes locally: one token, then offers the sequence to move; what follows depends on the
    router's calls (`then`: "pause" once started, "cancel" the offer, or "finish" on its own)."""

    def __init__(self, worker_id, view, then="pause"):
        super().__init__(worker_id, view)
        self.then = then

    def reserve(self, ask):
        self.rid = ask.request_id
        self._soon(StepOutput(ask.request_id, [11], "a"), SequenceMoving(ask.request_id, PROMPT))
        return DecodePlan(remote=False, cached_tokens=0)

    def start_move(self, request_id, precopy, tail, first_block):
        self.started = (precopy, tail, first_block)
        if self.then == "pause":     # decodes on while the pre-copy goes, then pauses
            self._soon(StepOutput(request_id, [12], "b"), SequencePaused(request_id, FirstToken(12, "b"), PROMPT + 1))
        elif self.then == "cancel":    # say, its pre-copy failed: it keeps the sequence
            self._soon(StepOutput(request_id, [12], "b"), SequenceMoving(request_id, PROMPT + 1, cancelled=True))
            self._finish(request_id)
        else:
            self._finish(request_id)

    def resume(self, request_id):
        self._finish(request_id)
        return True

    def _finish(self, request_id):
        self._soon(*([] if self.then == "cancel" else [StepOutput(request_id, [12], "b")]),
                   StepOutput(request_id, [13], "c", FinishReason.LENGTH, Usage(completion_tokens=3)))


class Target(FakeDecode):
    def __init__(self, worker_id, view, room=True):
        super().__init__(worker_id, view)
        self.room, self.aborted = room, []

    def reserve(self, ask):
        if not self.room:
            raise WorkerUnavailable(f"{self.worker_id} has no free KV blocks")
        self.ask = ask
        n = len(ask.prompt_token_ids)
        cap = n + ask.move_headroom
        return DecodePlan(remote=True, cached_tokens=0, first_block=0, dst_block_ids=list(range(-(-cap // BLOCK))),
                          num_tokens=cap, expecting=ask.prefill_id, precopy_blocks=n // BLOCK,
                          precopy_id=f"{ask.transfer_id}/pre")

    def take_moved(self, request_id, prompt_token_ids, sampling, handoff):
        self.taken = (prompt_token_ids, sampling, handoff)
        self._soon(StepOutput(request_id, [13], "c", FinishReason.LENGTH, Usage(completion_tokens=2)))
        return True

    def abort(self, request_id):
        self.aborted.append(request_id)
        return True


def cluster(then="pause", room=True):
    view = FakeView()
    src, dst = Source("d0", view, then), Target("d1", view, room)
    view.add(src, "decode")
    view.add(dst, "decode", running=5)     # d0 first, by load
    return view, src, dst


async def run_and_settle(router, req):
    out = await run(router, req)
    await asyncio.sleep(0.05)              # background cleanups (aborts, resumes)
    return out


def test_a_move_reserves_and_pre_copies_while_streaming_then_hands_over_on_the_pause():
    view, src, dst = cluster()
    router = make_router(view, local_prefill_threshold=10_000)
    out = asyncio.run(run_and_settle(router, request(max_tokens=3)))
    assert [list(r.token_ids) for r in out] == [[11], [12], [13]]
    assert router.hub.migrations == ["kv_moved"]
    # reserved for every token so far but the last, plus the headroom, from d0
    assert dst.ask.prompt_token_ids == list(range(1, 17)) and dst.ask.prefill_id == "d0"
    assert dst.ask.move_headroom == 2 * BLOCK and dst.ask.sampling.max_tokens == 3
    pre, tail, first = src.started
    assert first == 0 and pre.dst_block_ids == (0, 1, 2, 3) and pre.num_tokens == 16
    assert tail.dst_block_ids == (4, 5) and tail.num_tokens == 24 and tail.request_id == dst.ask.transfer_id
    ids, sp, handoff = dst.taken                   # the prompt as of the pause, the handoff token
    assert ids == list(range(1, 17)) + [11] and handoff.token_id == 12 and sp.max_tokens == 2
    assert dst.aborted == [] and not src.called("resume")


def test_an_offer_withdrawn_by_its_worker_frees_the_reservation_and_the_stream_stays():
    view, src, dst = cluster(then="cancel")
    router = make_router(view, local_prefill_threshold=10_000)
    out = asyncio.run(run_and_settle(router, request(max_tokens=3)))
    assert [list(r.token_ids) for r in out] == [[11], [12], [13]]
    assert router.hub.migrations == []
    assert dst.aborted == [dst.ask.request_id]           # what the router reserved there goes
    assert dst.ask.request_id not in view.queues and view.inflight.get("d1", 0) == 0


def test_nowhere_to_move_resumes_the_sequence_where_it_is():
    view, src, dst = cluster(then="finish", room=False)
    router = make_router(view, local_prefill_threshold=10_000)
    out = asyncio.run(run_and_settle(router, request(max_tokens=3)))
    assert [list(r.token_ids) for r in out] == [[11], [12], [13]]
    assert src.called("resume") and not src.called("start_move")
    assert view.inflight.get("d1", 0) == 0


def test_a_request_that_finishes_before_its_pause_frees_the_reservation():
    view, src, dst = cluster(then="finish")
    router = make_router(view, local_prefill_threshold=10_000)
    out = asyncio.run(run_and_settle(router, request(max_tokens=3)))
    assert [list(r.token_ids) for r in out] == [[11], [12], [13]]
    assert router.hub.migrations == []
    assert dst.aborted == [dst.ask.request_id] and view.inflight.get("d1", 0) == 0
