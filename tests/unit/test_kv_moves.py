"""Moving a running sequence to another decode worker with its KV (decode_workers/moves.py, the
receiving side moves_in.py), two pool workers on the fake network and the test as the router
(router/moving.py's calls, in order): the moved sequence's tokens are exactly a single engine's
(greedy, and seeded sampling continuing from the handed-over sampler state), nothing is
recomputed on the receiving worker, the full blocks go while the sequence still decodes and only
the tail once it is paused, and on every other path (aborted while offered or pre-copying,
resumed because nowhere could take it, a send whose link dies, a pre-copy that fails) no KV block
is left held on either side."""

from __future__ import annotations

import dataclasses
import time

import pytest

from tandem.engine.block_manager import BlockAllocator
from tandem.engine.request import Request
from tandem.kv_transfer.config import KVTransferConfig
from tandem.kv_transfer.fake import FakeNetwork
from tandem.kv_transfer.spec import TransferSpec
from tandem.wire.errors import NoReservation, WorkerUnavailable
from tandem.wire.messages import (MOVE_HEADROOM_BLOCKS, DecodePlan, DecodeReserve, OutputError, SamplingParams,
                                  SequenceMoving, SequencePaused, StepOutput)
from tests.unit.kv_factories import until
from tests.unit.worker_factories import create_engine, create_pool_worker

PROMPT = list(range(3, 14))
GREEDY = SamplingParams(max_tokens=120, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=120, ignore_eos=True, temperature=1.0, seed=11)
SHORT = SamplingParams(max_tokens=48, ignore_eos=True)
LONG = SamplingParams(max_tokens=600, ignore_eos=True)    # still decoding however slow the test
HEADROOM = MOVE_HEADROOM_BLOCKS * 16       # 16-token blocks


@pytest.fixture
def net():
    return FakeNetwork()


# the tail's receive is registered when the target reserves, before the pre-copy: on a loaded
# machine it may start seconds later (production waits up to 600 s)
TRANSFERS = KVTransferConfig(connect_timeout_s=2.0, timeout_s=2.0, start_timeout_s=60.0)


@pytest.fixture
def a(net):
    w = create_pool_worker(net, "a", "decode", transfer_config=TRANSFERS)
    yield w
    w.shutdown()


@pytest.fixture
def b(net):
    w = create_pool_worker(net, "b", "decode", transfer_config=TRANSFERS)
    yield w
    w.shutdown()


def one_engine(sp: SamplingParams) -> list[int]:
    return create_engine().generate([{"prompt_token_ids": PROMPT, **dataclasses.asdict(sp)}])[0]["token_ids"]


def collect(worker, until_msg, timeout_s: float = 20.0, router: str = "router") -> tuple[list[int], list]:
    """Tokens streamed to `router` until a message satisfying `until_msg` arrives (it is returned
    last in the messages; what came after it in the same poll is kept for the next call)."""
    ids, msgs = [], []
    inbox = worker.__dict__.setdefault("test_inbox", {}).setdefault(router, [])

    def poll() -> bool:
        if not inbox:
            inbox.extend(worker.decode.get_outputs(router, timeout_s=0.05))
        while inbox:
            m = inbox.pop(0)
            msgs.append(m)
            if isinstance(m, StepOutput):
                ids.extend(m.token_ids)
            if until_msg(m):
                return True
        return False
    until(poll, timeout_s)
    return ids, msgs


def pending(worker, router: str = "router") -> list:
    """Every message queued for `router` now: what `collect` kept from its last poll, then the
    worker's queue."""
    inbox = worker.__dict__.setdefault("test_inbox", {}).setdefault(router, [])
    msgs = inbox + worker.decode.get_outputs(router, timeout_s=0.05)
    inbox.clear()
    return msgs


def start_and_offer(a, sp: SamplingParams, rid: str = "r/1", after: int = 1) -> tuple[list[int], SequenceMoving]:
    """A request decoding on `a`, offered to move after at least `after` tokens: (tokens streamed,
    its notice)."""
    a.reserve(DecodeReserve(rid, "router", PROMPT, sp))
    first: list[int] = []
    while len(first) < after:
        first += collect(a, lambda m: isinstance(m, StepOutput))[0]
    assert a.decode.move_out() == 1
    more, msgs = collect(a, lambda m: isinstance(m, SequenceMoving))
    out, offered = first + more, msgs[-1]
    assert offered.request_id == rid and not offered.cancelled
    assert offered.num_tokens == len(PROMPT) + len(out) - 1
    return out, offered


def reserve_and_start(a, b, out: list[int], sp: SamplingParams, rid: str = "r/1", to: str = "r/2",
                      headroom: int = HEADROOM, start=None) -> DecodePlan:
    """What the router does on the offer: reserve on `b` (the positions so far plus `headroom`,
    both receives registered), then `a` starts the pre-copy (`start`: a's `start_move`, or, called
    on a's loop thread, its moves' `start`)."""
    left = dataclasses.replace(sp, max_tokens=sp.max_tokens - len(out) + 1)
    plan = b.reserve(DecodeReserve(to, "router", PROMPT + out[:-1], left, transfer_id=f"{to}#move", prefill_id="a",
                                   move_headroom=headroom))
    assert plan.remote and plan.expecting == "a"
    n_pre, first = plan.precopy_blocks, plan.first_block
    pre = TransferSpec(plan.precopy_id, "a", "b", (0, 1), (), plan.dst_block_ids[:n_pre], (first + n_pre) * 16) \
        if n_pre else None
    tail = TransferSpec(f"{to}#move", "a", "b", (0, 1), (), plan.dst_block_ids[n_pre:], plan.num_tokens)
    (start or a.decode.start_move)(rid, pre, tail, first)
    return plan


def hand_over(a, b, out: list[int], sp: SamplingParams, to: str = "r/2") -> tuple[list[int], SequencePaused]:
    """What the router does once `a` paused it (its tail on the way): hand `b` the prompt and the
    handoff token. -> (every token streamed by `a`, the notice)."""
    more, msgs = collect(a, lambda m: isinstance(m, SequencePaused))
    out, paused = out + more, msgs[-1]
    assert paused.handoff.token_id == out[-1] and paused.num_tokens == len(PROMPT) + len(out) - 1
    left = dataclasses.replace(sp, max_tokens=sp.max_tokens - len(out) + 1)
    assert b.decode.take_moved(to, PROMPT + out[:-1], left, paused.handoff)
    return out, paused


def spy_sends(worker) -> list[tuple[str, int, bool]]:
    """(transfer id, blocks, whether r/1 was still in the engine's batch) of each send `worker` makes."""
    sent, send = [], worker.decode.sender.send

    def spy(spec):
        sent.append((spec.request_id, len(spec.src_block_ids), "r/1" in worker.engine.scheduler.requests))
        send(spec)
    worker.decode.sender.send = spy
    return sent


def assert_nothing_held(*workers) -> None:
    until(lambda: all(w.kv_blocks_used() == 0 for w in workers))
    until(lambda: all(w.held() == {} for w in workers))


@pytest.mark.parametrize("sp", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_a_moved_sequence_continues_token_exact_with_nothing_recomputed(a, b, sp):
    out, _ = start_and_offer(a, sp, after=40)
    plan = reserve_and_start(a, b, out, sp)
    out, paused = hand_over(a, b, out, sp)
    assert 0 < len(out) < sp.max_tokens
    rest, _ = collect(b, lambda m: isinstance(m, StepOutput) and m.finished)
    assert out + rest == one_engine(sp)
    assert_nothing_held(a, b)
    sa, sb = a.stats(), b.stats()
    assert (sa.sequences_migrated, sb.sequences_migrated_in) == (1, 1)
    assert sa.kv_tokens_migrated == paused.num_tokens and sa.kv_tokens_precopied == plan.precopy_blocks * 16 > 0
    assert sb.tokens_recomputed == 0 and sb.computed_tokens == 0
    assert sa.move_precopy_seconds > 0 and sa.move_tail_seconds > 0


def test_the_full_blocks_go_while_it_decodes_and_the_pause_carries_only_the_tail(a, b):
    sent = spy_sends(a)
    out, offered = start_and_offer(a, GREEDY, after=60)     # 70 positions: 4 full blocks
    plan = reserve_and_start(a, b, out, GREEDY)
    moved, paused = hand_over(a, b, out, GREEDY)
    rest, _ = collect(b, lambda m: isinstance(m, StepOutput) and m.finished)
    assert moved + rest == one_engine(GREEDY)
    assert plan.precopy_blocks == offered.num_tokens // 16 == 4
    tail_blocks = len(plan.dst_block_ids) - plan.precopy_blocks     # the rest of the reservation
    assert tail_blocks <= (offered.num_tokens % 16 + HEADROOM + 15) // 16
    # the pre-copy left while r/1 was in the batch; once it paused, only the tail did
    assert sent == [("r/2#move/pre", 4, True), ("r/2#move", tail_blocks, False)]
    sa = a.stats()
    assert sa.kv_tokens_precopied == 64 and sa.kv_tokens_migrated - sa.kv_tokens_precopied < HEADROOM + 16
    assert_nothing_held(a, b)


def test_a_sequence_that_would_outgrow_the_headroom_pauses_before_the_pre_copy_ends(net, a, b):
    """The router reserves 5 tokens past where the sequence is, and the pre-copy, over a slow
    link, takes 2 s or more: the sequence fills the reservation within a few steps, pauses, and
    its tail goes before the pre-copy ends. The reservation and the start run on a's loop thread,
    between two of its steps, so the sequence cannot decode past the reservation before the
    pre-copy starts (it decodes on while offered: done from the test thread, as this test once
    was, a loaded CI machine let it run past 5 tokens first, and the offer was rightly withdrawn)."""
    net.set_faults("a", "b", delay_s=1.0)          # a slow link: each frame leaves 1 s late
    out, offered = start_and_offer(a, GREEDY, after=40)

    def reserve_here() -> DecodePlan:             # a's loop thread: no step runs meanwhile
        ahead = a.decode.requests["r/1"].request.num_tokens - 1 - offered.num_tokens   # paused or not
        return reserve_and_start(a, b, out, GREEDY, headroom=ahead + 5, start=a.decode.moves.start)
    plan = a.decode.loop.run(reserve_here)
    moved, paused = hand_over(a, b, out, GREEDY)
    assert a.decode.moves.counters["move_precopy_seconds"] == 0.0   # its pre-copy had not ended
    net.set_faults("a", "b")                              # the rest goes at once
    assert paused.num_tokens <= plan.num_tokens           # it stopped within what was reserved
    rest, _ = collect(b, lambda m: isinstance(m, StepOutput) and m.finished)
    assert moved + rest == one_engine(GREEDY)
    assert b.stats().tokens_recomputed == 0
    assert_nothing_held(a, b)


def test_a_sequence_whose_router_is_slow_to_reserve_waits_within_the_headroom_then_moves(a, b):
    """The router reserves for the positions offered plus MOVE_HEADROOM_BLOCKS: a sequence that
    would outgrow that before the reservation arrives leaves the batch and waits, and the move
    still happens (it used to decode on, and the late reservation was refused as too small)."""
    out, offered = start_and_offer(a, LONG, after=20)
    until(lambda: "r/1" not in a.engine.scheduler.requests)      # paused, still offered
    time.sleep(0.2)                                               # the router is slow
    assert "r/1" not in a.engine.scheduler.requests
    waited = pending(a)          # with what came after the offer in collect's last poll
    more = [t for m in waited if isinstance(m, StepOutput) for t in m.token_ids]
    assert not any(isinstance(m, (SequenceMoving, SequencePaused)) for m in waited)
    assert 0 < len(more) <= HEADROOM
    plan = reserve_and_start(a, b, out, LONG)
    moved, paused = hand_over(a, b, out + more, LONG)
    assert paused.num_tokens == offered.num_tokens + len(more) <= plan.num_tokens
    rest, _ = collect(b, lambda m: isinstance(m, StepOutput) and m.finished, timeout_s=60)
    assert moved + rest == one_engine(LONG)
    assert (a.stats().sequences_migrated, a.stats().migrations_resumed, b.stats().tokens_recomputed) == (1, 0, 0)
    assert_nothing_held(a, b)


def test_an_offer_withdrawn_when_its_pre_copy_fails_finishes_where_it_is_and_frees_both_sides(net, a, b):
    net.set_faults("a", "b", die_after_layers=1)
    out, _ = start_and_offer(a, LONG, after=40)
    reserve_and_start(a, b, out, LONG, headroom=200)
    more, msgs = collect(a, lambda m: isinstance(m, SequenceMoving))
    assert msgs[-1].cancelled and msgs[-1].request_id == "r/1"   # the router frees what it reserved
    _, errs = collect(b, lambda m: isinstance(m, OutputError))
    assert errs[-1].request_id == "r/2" and "KV transfer" in errs[-1].error
    rest, msgs = collect(a, lambda m: isinstance(m, StepOutput) and m.finished)
    assert not any(isinstance(m, (SequencePaused, SequenceMoving)) for m in msgs)
    assert out + more + rest == one_engine(LONG)
    assert a.stats().sequences_migrated == 0
    assert_nothing_held(a, b)


def test_abort_while_pre_copying_frees_both_sides(net, a, b):
    net.set_faults("a", "b", delay_s=0.3)
    out, _ = start_and_offer(a, LONG, after=40)
    plan = reserve_and_start(a, b, out, LONG, headroom=200)
    assert plan.precopy_blocks > 0 and b.kv_blocks_used() > 0
    assert a.abort("r/1") and b.abort("r/2")        # the client went away: the router aborts both
    assert_nothing_held(a, b)
    with pytest.raises(NoReservation):
        a.decode.start_move("r/1", None, TransferSpec("x#move", "a", "b", (0, 1), (), (1,), 1), 0)


def test_a_draining_worker_offers_every_decoding_sequence_and_a_resumed_one_stays(a, b):
    a.reserve(DecodeReserve("r/1", "router", PROMPT, GREEDY))
    first, _ = collect(a, lambda m: isinstance(m, StepOutput))
    a.drain(True, move=True)
    more, msgs = collect(a, lambda m: isinstance(m, SequenceMoving))
    out = first + more
    assert a.decode.resume("r/1")           # nowhere to go: it finishes here, never offered again
    rest, msgs = collect(a, lambda m: isinstance(m, StepOutput) and m.finished)
    assert not any(isinstance(m, (SequencePaused, SequenceMoving)) for m in msgs)
    assert out + rest == one_engine(GREEDY)
    assert a.stats().migrations_resumed == 1
    until(lambda: a.kv_blocks_used() == 0)


def test_an_offered_sequence_aborted_by_its_router_frees_its_blocks(a):
    start_and_offer(a, GREEDY)
    assert a.kv_blocks_used() > 0
    assert a.abort("r/1")
    until(lambda: a.kv_blocks_used() == 0)
    with pytest.raises(NoReservation):     # nothing to move any more
        a.decode.start_move("r/1", None, TransferSpec("x#move", "a", "b", (0, 1), (), (1,), 1), 0)
    assert a.held() == {}


def test_a_move_to_a_worker_without_room_is_refused_and_the_sequence_resumed(net, a):
    small = create_pool_worker(net, "b", "decode", engine=create_engine(num_blocks=8))
    try:
        # 7 of its 8 blocks reserved for a remote prefill of 112 tokens (another router's)
        plan = small.reserve(DecodeReserve("hog/1", "other", list(range(3, 115)), SamplingParams(max_tokens=8),
                                           transfer_id="hog#t"))
        assert plan.remote and small.kv_blocks_used() == 7
        out, _ = start_and_offer(a, SHORT, after=30)    # over 32 positions: 3 blocks
        with pytest.raises(WorkerUnavailable, match="no free KV blocks"):
            reserve_and_start(a, small, out, SHORT)
        assert set(small.held()) == {"hog/1", "hog#t"}     # nothing of r/2
        assert a.decode.resume("r/1")
        rest, _ = collect(a, lambda m: isinstance(m, StepOutput) and m.finished)
        assert out + rest == one_engine(SHORT)
    finally:
        small.shutdown()


def test_a_tail_whose_link_dies_fails_the_receiver_and_frees_both_sides(net, a, b):
    out, _ = start_and_offer(a, GREEDY)              # 11 positions: no full block, all of it is the tail
    net.set_faults("a", "b", die_after_layers=1)
    plan = reserve_and_start(a, b, out, GREEDY)
    assert plan.precopy_blocks == 0
    more, msgs = collect(a, lambda m: isinstance(m, SequencePaused))
    left = dataclasses.replace(GREEDY, max_tokens=GREEDY.max_tokens - len(out + more) + 1)
    b.decode.take_moved("r/2", PROMPT + (out + more)[:-1], left, msgs[-1].handoff)
    _, msgs = collect(b, lambda m: isinstance(m, OutputError))
    assert "KV transfer" in msgs[-1].error      # the router moves it on by recompute
    assert_nothing_held(a, b)


def test_before_the_engine_would_preempt_the_youngest_sequence_moves_out_instead(net, b):
    tight = create_pool_worker(net, "a", "decode", engine=create_engine(num_blocks=8))
    try:
        sp = SamplingParams(max_tokens=60, ignore_eos=True)       # 11 + 60 tokens: 5 blocks each at the end
        tight.reserve(DecodeReserve("old/1", "router", PROMPT, sp))
        tight.reserve(DecodeReserve("young/1", "router", PROMPT, sp))
        out: dict[str, list[int]] = {"old/1": [], "young/1": []}
        notice = {}

        def poll() -> bool:
            for m in tight.decode.get_outputs("router", timeout_s=0.05):
                if isinstance(m, StepOutput):
                    out[m.request_id] += m.token_ids
                elif isinstance(m, (SequenceMoving, SequencePaused)):
                    notice[type(m)] = m
            return bool(notice)
        until(poll, 20)
        offered = notice[SequenceMoving]
        assert offered.request_id == "young/1"       # the scheduler's victim would have been the youngest
        n = len(out["young/1"])
        reserve_and_start(tight, b, out["young/1"], sp, rid="young/1", to="young/2")
        until(lambda: poll() and SequencePaused in notice)    # paused when offered: its KV goes at once
        assert len(out["young/1"]) == n and notice[SequencePaused].num_tokens == offered.num_tokens
        left = dataclasses.replace(sp, max_tokens=sp.max_tokens - n + 1)
        assert b.decode.take_moved("young/2", PROMPT + out["young/1"][:-1], left, notice[SequencePaused].handoff)
        rest, _ = collect(b, lambda m: isinstance(m, StepOutput) and m.finished)
        until(lambda: poll() is not None and len(out["old/1"]) == 60)     # old/1 finishes where it is
        ref = create_engine().generate([{"prompt_token_ids": PROMPT, **dataclasses.asdict(sp)}])[0]["token_ids"]
        assert out["old/1"] == ref and out["young/1"] + rest == ref
        assert tight.engine.stats.preemptions == 0 and tight.stats().pressure_moves == 1
        until(lambda: tight.kv_blocks_used() == 0 and b.kv_blocks_used() == 0)
    finally:
        tight.shutdown()


def test_two_sequences_move_one_after_the_other_over_the_same_link(a, b):
    q_prompt = PROMPT[::-1]
    out, _ = start_and_offer(a, GREEDY, after=40)
    a.reserve(DecodeReserve("q/1", "rq", q_prompt, LONG))    # decodes beside r/1 (another router), moves second
    q, _ = collect(a, lambda m: isinstance(m, StepOutput), router="rq")
    reserve_and_start(a, b, out, GREEDY)
    out, _ = hand_over(a, b, out, GREEDY)
    rest, _ = collect(b, lambda m: isinstance(m, StepOutput) and m.finished)
    assert out + rest == one_engine(GREEDY)
    assert a.decode.move_out() == 1
    more, msgs = collect(a, lambda m: isinstance(m, SequenceMoving), router="rq")
    q += more
    assert msgs[-1].request_id == "q/1" and msgs[-1].num_tokens == len(q_prompt) + len(q) - 1
    left = dataclasses.replace(LONG, max_tokens=LONG.max_tokens - len(q) + 1)
    plan = b.reserve(DecodeReserve("q/2", "rq", q_prompt + q[:-1], left, transfer_id="q/2#move", prefill_id="a",
                                   move_headroom=HEADROOM))
    n_pre = plan.precopy_blocks
    assert n_pre > 0
    a.decode.start_move("q/1", TransferSpec(plan.precopy_id, "a", "b", (0, 1), (), plan.dst_block_ids[:n_pre],
                                            (plan.first_block + n_pre) * 16),
                        TransferSpec("q/2#move", "a", "b", (0, 1), (), plan.dst_block_ids[n_pre:], plan.num_tokens),
                        plan.first_block)
    more, msgs = collect(a, lambda m: isinstance(m, SequencePaused), router="rq")
    q += more
    left = dataclasses.replace(LONG, max_tokens=LONG.max_tokens - len(q) + 1)
    assert b.decode.take_moved("q/2", q_prompt + q[:-1], left, msgs[-1].handoff)
    rest, _ = collect(b, lambda m: isinstance(m, StepOutput) and m.finished, router="rq")
    ref = create_engine().generate([{"prompt_token_ids": q_prompt, **dataclasses.asdict(LONG)}])[0]["token_ids"]
    assert q + rest == ref
    assert b.stats().sequences_migrated_in == 2 and b.stats().tokens_recomputed == 0
    assert_nothing_held(a, b)


def test_a_worker_that_moved_a_sequence_out_is_not_idle_until_its_router_took_the_notice(a, b):
    """A drained worker is stopped once idle: before its router has read where the sequence went,
    that would lose the notice (and the router would recompute the request)."""
    out, _ = start_and_offer(a, GREEDY, after=40)
    reserve_and_start(a, b, out, GREEDY)
    until(lambda: a.kv_blocks_used() == 0)          # paused, tail sent and released: nothing held
    assert not a.stats().idle() and a.stats().waiting == 1
    hand_over(a, b, out, GREEDY)                   # the router's poll takes the notice
    until(lambda: a.stats().idle())
    rest, _ = collect(b, lambda m: isinstance(m, StepOutput) and m.finished)
    assert_nothing_held(a, b)



def test_a_pre_copys_blocks_go_back_only_once_both_it_and_the_sequence_let_go():
    """moves_in.py: the pre-copy's receive and the moving sequence each hold the pre-copied blocks
    (`BlockAllocator.share`), so either may end first without the other's blocks being reused."""
    alloc = BlockAllocator(num_blocks=4, block_size=16)
    seq, pre = Request("r/2", list(range(40))), Request("r/2#move/pre", [])
    assert alloc.admit(seq, 40) and alloc.num_used_blocks == 3
    alloc.share(pre, seq.block_ids[:2])
    alloc.free(seq)                      # aborted while its pre-copy still lands
    assert alloc.num_used_blocks == 2
    alloc.free(pre)
    assert alloc.num_used_blocks == 0
    alloc.check_invariants()
