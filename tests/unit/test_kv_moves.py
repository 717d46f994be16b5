"""Moving a running sequence to another decode worker with its KV (decode_workers/moves.py), two
pool workers on the fake network and the test as the router: the moved sequence's tokens are
exactly a single engine's (greedy, and seeded sampling continuing from the handed-over sampler
state), nothing is recomputed on the receiving worker, and on every other path (aborted while
paused, resumed because nowhere could take it, a send whose link dies) no KV block is left held."""

from __future__ import annotations

import dataclasses

import pytest

from tandem.kv_transfer.fake import FakeNetwork
from tandem.kv_transfer.spec import TransferSpec
from tandem.wire.errors import NoReservation, WorkerUnavailable
from tandem.wire.messages import DecodeReserve, OutputError, SamplingParams, SequencePaused, StepOutput
from tests.unit.kv_factories import until
from tests.unit.worker_factories import create_engine, create_pool_worker

PROMPT = list(range(3, 14))
GREEDY = SamplingParams(max_tokens=48, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=48, ignore_eos=True, temperature=1.0, seed=11)


@pytest.fixture
def net():
    return FakeNetwork()


@pytest.fixture
def a(net):
    w = create_pool_worker(net, "a", "decode")
    yield w
    w.shutdown()


@pytest.fixture
def b(net):
    w = create_pool_worker(net, "b", "decode")
    yield w
    w.shutdown()


def one_engine(sp: SamplingParams) -> list[int]:
    return create_engine().generate([{"prompt_token_ids": PROMPT, **dataclasses.asdict(sp)}])[0]["token_ids"]


def collect(worker, until_msg, timeout_s: float = 20.0) -> tuple[list[int], list]:
    """Tokens streamed to "router" until a message satisfying `until_msg` arrives (it is returned
    last in the messages)."""
    ids, msgs = [], []
    done = False

    def poll() -> bool:
        nonlocal done
        for m in worker.decode.get_outputs("router", timeout_s=0.05):
            msgs.append(m)
            if isinstance(m, StepOutput):
                ids.extend(m.token_ids)
            done = done or until_msg(m)
        return done
    until(poll, timeout_s)
    return ids, msgs


def start_and_pause(a, sp: SamplingParams, rid: str = "r/1", after: int = 1) -> tuple[list[int], SequencePaused]:
    """A request decoding on `a`, paused after at least `after` tokens: (tokens streamed, its notice)."""
    a.reserve(DecodeReserve(rid, "router", PROMPT, sp))
    first: list[int] = []
    while len(first) < after:
        first += collect(a, lambda m: isinstance(m, StepOutput))[0]
    assert a.decode.move_out() == 1
    more, msgs = collect(a, lambda m: isinstance(m, SequencePaused))
    out, paused = first + more, msgs[-1]
    assert paused.request_id == rid and paused.handoff.token_id == out[-1]
    assert paused.num_tokens == len(PROMPT) + len(out) - 1
    return out, paused


def move(a, b, out: list[int], paused: SequencePaused, sp: SamplingParams, rid: str = "r/2") -> None:
    """What the router does (router/moving.py): reserve on `b` with the handoff, then `a` sends."""
    ask = DecodeReserve(rid, "router", PROMPT + out[:-1], dataclasses.replace(sp, max_tokens=sp.max_tokens - len(out) + 1),
                        transfer_id=f"{rid}#move", prefill_id="a", handoff=paused.handoff)
    plan = b.reserve(ask)
    assert plan.remote and plan.expecting == "a" and plan.num_tokens == paused.num_tokens
    spec = TransferSpec(f"{rid}#move", "a", "b", (0, 1), (), plan.dst_block_ids, plan.num_tokens)
    a.decode.send_kv(paused.request_id, spec, plan.first_block)


@pytest.mark.parametrize("sp", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_a_moved_sequence_continues_token_exact_with_nothing_recomputed(a, b, sp):
    out, paused = start_and_pause(a, sp)
    assert 0 < len(out) < sp.max_tokens
    move(a, b, out, paused, sp)
    rest, _ = collect(b, lambda m: isinstance(m, StepOutput) and m.finished)
    assert out + rest == one_engine(sp)
    until(lambda: a.kv_blocks_used() == 0)
    until(lambda: b.kv_blocks_used() == 0)
    sa, sb = a.stats(), b.stats()
    assert (sa.sequences_migrated, sb.sequences_migrated_in) == (1, 1)
    assert sa.kv_tokens_migrated == paused.num_tokens
    assert sb.tokens_recomputed == 0 and sb.computed_tokens == 0
    assert a.held() == {} and b.held() == {}


def test_a_draining_worker_pauses_every_decoding_sequence_and_a_resumed_one_stays(a, b):
    a.reserve(DecodeReserve("r/1", "router", PROMPT, GREEDY))
    first, _ = collect(a, lambda m: isinstance(m, StepOutput))
    a.drain(True, move=True)
    more, msgs = collect(a, lambda m: isinstance(m, SequencePaused))
    out = first + more
    assert a.decode.resume("r/1")           # nowhere to go: it finishes here, never paused again
    rest, msgs = collect(a, lambda m: isinstance(m, StepOutput) and m.finished)
    assert not any(isinstance(m, SequencePaused) for m in msgs)
    assert out + rest == one_engine(GREEDY)
    assert a.stats().migrations_resumed == 1
    until(lambda: a.kv_blocks_used() == 0)


def test_a_paused_sequence_aborted_by_its_router_frees_its_blocks(a):
    out, paused = start_and_pause(a, GREEDY)
    assert a.kv_blocks_used() > 0
    assert a.abort("r/1")
    until(lambda: a.kv_blocks_used() == 0)
    with pytest.raises(NoReservation):     # nothing to send any more
        a.decode.send_kv("r/1", TransferSpec("x#move", "a", "b", (0, 1), (), (1,), 1), 0)
    assert a.held() == {}


def test_a_move_to_a_worker_without_room_is_refused_and_the_sequence_resumed(net, a):
    small = create_pool_worker(net, "b", "decode", engine=create_engine(num_blocks=8))
    try:
        # 7 of its 8 blocks reserved for a remote prefill of 112 tokens (another router's)
        plan = small.reserve(DecodeReserve("hog/1", "other", list(range(3, 115)), SamplingParams(max_tokens=8),
                                           transfer_id="hog#t"))
        assert plan.remote and small.kv_blocks_used() == 7
        out, paused = start_and_pause(a, GREEDY, after=30)    # over 32 positions: 3 blocks
        with pytest.raises(WorkerUnavailable, match="no free KV blocks"):
            move(a, small, out, paused, GREEDY)
        assert set(small.held()) == {"hog/1", "hog#t"}     # nothing of r/2
        assert a.decode.resume("r/1")
        rest, _ = collect(a, lambda m: isinstance(m, StepOutput) and m.finished)
        assert out + rest == one_engine(GREEDY)
    finally:
        small.shutdown()


def test_a_send_whose_link_dies_fails_the_receiver_and_frees_both_sides(net, a, b):
    net.set_faults("a", "b", die_after_layers=1)
    out, paused = start_and_pause(a, GREEDY)
    move(a, b, out, paused, GREEDY)
    _, msgs = collect(b, lambda m: isinstance(m, OutputError))
    assert "KV transfer" in msgs[-1].error      # the router moves it on by recompute
    until(lambda: a.kv_blocks_used() == 0 and b.kv_blocks_used() == 0)
    until(lambda: a.held() == {} and b.held() == {})


def test_before_the_engine_would_preempt_the_youngest_sequence_moves_out_instead(net, b):
    tight = create_pool_worker(net, "a", "decode", engine=create_engine(num_blocks=8))
    try:
        sp = SamplingParams(max_tokens=60, ignore_eos=True)       # 11 + 60 tokens: 5 blocks each at the end
        tight.reserve(DecodeReserve("old/1", "router", PROMPT, sp))
        tight.reserve(DecodeReserve("young/1", "router", PROMPT, sp))
        out: dict[str, list[int]] = {"old/1": [], "young/1": []}
        paused = None

        def poll() -> bool:
            nonlocal paused
            for m in tight.decode.get_outputs("router", timeout_s=0.05):
                if isinstance(m, StepOutput):
                    out[m.request_id] += m.token_ids
                elif isinstance(m, SequencePaused):
                    paused = m
            return paused is not None
        until(poll, 20)
        assert paused.request_id == "young/1"          # the scheduler's victim would have been the youngest
        move(tight, b, out["young/1"], paused, sp, rid="young/2")
        rest, _ = collect(b, lambda m: isinstance(m, StepOutput) and m.finished)
        until(lambda: poll() or len(out["old/1"]) == 60)
        ref = create_engine().generate([{"prompt_token_ids": PROMPT, **dataclasses.asdict(sp)}])[0]["token_ids"]
        assert out["old/1"] == ref and out["young/1"] + rest == ref
        assert tight.engine.stats.preemptions == 0 and tight.stats().pressure_moves == 1
        until(lambda: tight.kv_blocks_used() == 0 and b.kv_blocks_used() == 0)
    finally:
        tight.shutdown()
