"""The prefill worker on CPU against fakes: the tiny-random engine, the in-process fake network
(faults injectable), a fake clock. A remote prefill's first token reaches the router before its KV
lands, and the decode worker continues it as one engine would; a reservation never started is
freed on time; a refused or failed transfer leaves nothing held."""

from __future__ import annotations

import threading
import time

import pytest
from tests.unit.kv_factories import until
from tests.unit.worker_factories import FakeClock, create_decode_worker, create_engine, create_prefill_worker

from tandem.kv_transfer.spec import TransferSpec
from tandem.kv_transfer.fake import FakeNetwork
from tandem.wire.errors import NoReservation, TransferFailed
from tandem.wire.messages import (DecodePlan, DecodeReserve, OutputError, PrefillReservation, PrefillReserve,
                                  SamplingParams, StepOutput)

SP = SamplingParams(max_tokens=6, ignore_eos=True)


@pytest.fixture
def net():
    return FakeNetwork()


@pytest.fixture
def prefill(net):
    w = create_prefill_worker(net)
    yield w
    w.shutdown()


@pytest.fixture
def decode(net):
    w = create_decode_worker(net)
    yield w
    w.shutdown()


def transfer_spec(tid: str, res: PrefillReservation, plan: DecodePlan, layers: int) -> TransferSpec:
    """What the router sends both actors: the prefill's blocks from the decode's first uncached one."""
    n = len(plan.dst_block_ids)
    return TransferSpec(tid, "prefill-0", "decode-0", tuple(range(layers)),
                        res.block_ids[plan.first_block:plan.first_block + n], plan.dst_block_ids, plan.num_tokens)


def run_remote(prefill, decode, rid: str, ids: list[int], sp: SamplingParams = SP) -> list[int]:
    """The router's remote-prefill flow, in order: both reserves, the prefix pull when the decode
    worker holds more of the prompt, start, the early first token handed over, the outputs."""
    tid = f"{rid}#t"
    plan = decode.reserve(DecodeReserve(rid, "router", ids, sp, transfer_id=tid, prefill_id="prefill-0"))
    res = prefill.reserve(PrefillReserve(tid, ids, sp))
    assert plan.remote
    layers = prefill.engine.kv_cache.num_layers
    if plan.cached_tokens > res.cached_tokens:
        at, bs = res.cached_tokens // 16, 16
        dst = res.block_ids[at:plan.cached_tokens // bs]
        pull = TransferSpec(f"{tid}/pull", "decode-0", "prefill-0", tuple(range(layers)),
                            plan.prefix_block_ids[at:at + len(dst)], dst, len(dst) * bs)
        prefill.expect_pull(pull, tid, plan.cached_tokens)
        decode.send_prefix(pull)
    done = {}
    threading.Thread(target=lambda: done.setdefault("result", prefill.start(transfer_spec(tid, res, plan, layers))),
                     daemon=True).start()
    first = prefill.first_token(tid, timeout_s=10)
    assert decode.first_token(rid, first.first)
    out = [first.first.token_id]
    while True:
        msgs = decode.get_outputs("router", 1.0)
        assert not any(isinstance(m, OutputError) for m in msgs), msgs
        out += [t for m in msgs for t in m.token_ids]
        if any(isinstance(m, StepOutput) and m.finished for m in msgs):
            until(lambda: "result" in done)
            return out


def one_engine(ids: list[int], sp: SamplingParams = SP) -> list[int]:
    return create_engine().generate([{"prompt_token_ids": ids, "max_tokens": sp.max_tokens,
                                      "ignore_eos": sp.ignore_eos, "seed": sp.seed,
                                      "temperature": sp.temperature}])[0]["token_ids"]


def test_a_remote_prefill_continues_on_the_decode_worker_as_one_engine_would(prefill, decode):
    ids = list(range(10, 90))
    assert run_remote(prefill, decode, "r1", ids) == one_engine(ids)
    until(lambda: prefill.held() == {} and decode.held() == {})
    assert prefill.kv_blocks_used() == 0 and decode.kv_blocks_used() == 0


def test_a_seeded_sample_continues_from_the_prefill_workers_sampler_state(prefill, decode):
    ids, sp = list(range(30, 100)), SamplingParams(max_tokens=6, ignore_eos=True, temperature=1.0, seed=7)
    assert run_remote(prefill, decode, "r-seed", ids, sp) == one_engine(ids, sp)


def test_the_decode_workers_cached_prefix_is_pulled_not_recomputed(prefill, decode):
    prefix = list(range(200, 248))                       # three whole blocks
    decode.reserve(DecodeReserve("warm", "router", prefix, SamplingParams(max_tokens=3)))
    until(lambda: decode.held() == {})                   # prefilled locally: now in its cache
    decode.get_outputs("router", 0.1)
    ids = prefix + list(range(300, 340))
    before = prefill.stats()
    assert run_remote(prefill, decode, "r2", ids) == one_engine(ids)
    after = prefill.stats()
    assert after.pulled_tokens - before.pulled_tokens == 48
    assert after.computed_tokens - before.computed_tokens == len(ids) - 48
    until(lambda: prefill.held() == {} and prefill.kv_blocks_used() == 0)


def test_a_reservation_never_started_is_freed_after_its_timeout_and_a_late_start_refused(net):
    clock = FakeClock()
    w = create_prefill_worker(net, reservation_timeout_s=120.0, clock=clock)
    try:
        res = w.reserve(PrefillReserve("t-late", list(range(10, 90))))
        time.sleep(0.2)                                  # many idle polls, no time passes
        assert w.held() == {"t-late": "reserved"} and w.kv_blocks_used() > 0
        clock.advance(121.0)
        until(lambda: w.kv_blocks_used() == 0)
        assert w.held() == {} and w.stats().reservations_expired == 1
        spec = TransferSpec("t-late", "prefill-0", "decode-0", (0, 1), res.block_ids, res.block_ids, 80)
        with pytest.raises(NoReservation, match="not started within"):
            w.start(spec)
        with pytest.raises(NoReservation):
            w.first_token("t-late", timeout_s=5)         # answered at once, not after 5 s
    finally:
        w.shutdown()


def test_a_start_the_sender_refuses_keeps_nothing(prefill):
    res = prefill.reserve(PrefillReserve("t-bad", list(range(10, 90))))
    n = prefill.engine.kv_cache.num_blocks
    bad = TransferSpec("t-bad", "prefill-0", "decode-0", (0, 1), (n + 5,) * len(res.block_ids),
                       tuple(range(len(res.block_ids))), 80)
    with pytest.raises(ValueError, match="outside"):
        prefill.start(bad)
    with pytest.raises(ValueError):
        prefill.first_token("t-bad", timeout_s=5)
    assert prefill.held() == {} and prefill.kv_blocks_used() == 0
    assert not prefill.abort("t-bad")


def test_a_transfer_whose_peer_dies_fails_start_and_frees_everything(net, prefill, decode):
    net.set_faults("prefill-0", "decode-0", die_after_layers=1)
    ids = list(range(10, 90))
    plan = decode.reserve(DecodeReserve("r3", "router", ids, SP, transfer_id="t3", prefill_id="prefill-0"))
    res = prefill.reserve(PrefillReserve("t3", ids, SP))
    with pytest.raises(TransferFailed):
        prefill.start(transfer_spec("t3", res, plan, prefill.engine.kv_cache.num_layers), timeout_s=30)
    until(lambda: prefill.held() == {} and prefill.kv_blocks_used() == 0)
    assert prefill.stats().transfer_failures == 1
    errors: list = []
    until(lambda: errors.extend(m for m in decode.get_outputs("router", 0.05) if isinstance(m, OutputError))
          or errors)
    assert errors[0].request_id == "r3"
    until(lambda: decode.held() == {} and decode.kv_blocks_used() == 0)


def test_an_abort_mid_transfer_ends_both_sides(prefill, decode):
    ids = list(range(10, 90))
    plan = decode.reserve(DecodeReserve("r4", "router", ids, SP, transfer_id="t4", prefill_id="prefill-0"))
    res = prefill.reserve(PrefillReserve("t4", ids, SP))
    assert prefill.abort("t4") and decode.abort("r4")
    assert prefill.held() == {} and prefill.kv_blocks_used() == 0
    until(lambda: decode.held() == {} and decode.kv_blocks_used() == 0)
    with pytest.raises(NoReservation):
        prefill.start(transfer_spec("t4", res, plan, prefill.engine.kv_cache.num_layers))
