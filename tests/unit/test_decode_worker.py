"""The decode worker on CPU against fakes (the tiny-random engine, the fake network, a fake
clock), through its public methods: a local prefill streams typed step outputs to its router; a
silent router loses its requests and their KV; a failed step reports once per request and frees
everything; a first token for a request that is gone is refused."""

from __future__ import annotations

import time

import pytest

from tandem.kv_transfer.spec import TransferSpec
from tandem.wire.errors import NoReservation, WorkerUnavailable
from tandem.wire.messages import DecodeReserve, FinishReason, FirstToken, OutputError, SamplingParams, StepOutput
from tests.unit.kv_factories import until
from tests.unit.worker_factories import FakeClock, create_decode_worker, create_engine

SP = SamplingParams(max_tokens=5, ignore_eos=True)


@pytest.fixture
def decode():
    w = create_decode_worker()
    yield w
    w.shutdown()


def drain(w, router: str, until_finished: set[str], timeout_s: float = 10.0) -> list:
    out: list = []
    end = time.monotonic() + timeout_s
    while until_finished - {m.request_id for m in out if isinstance(m, OutputError) or m.finished}:
        assert time.monotonic() < end, out
        out += w.get_outputs(router, 0.2)
    return out


def test_a_local_prefill_streams_step_outputs_that_end_with_finish_and_usage(decode):
    ids = list(range(10, 20))                          # 10 uncached tokens: under the threshold
    plan = decode.reserve(DecodeReserve("r1", "router-a", ids, SP, transfer_id="t1"))
    assert not plan.remote and plan.mode == "local" and plan.cached_tokens == 0
    out = drain(decode, "router-a", {"r1"})
    assert all(isinstance(m, StepOutput) and m.request_id == "r1" for m in out)
    assert [t for m in out for t in m.token_ids] == create_engine().generate(
        [{"prompt_token_ids": ids, "max_tokens": 5, "ignore_eos": True}])[0]["token_ids"]
    last = out[-1]
    assert last.finish_reason is FinishReason.LENGTH and last.usage.completion_tokens == 5
    assert not any(m.finished for m in out[:-1])
    until(lambda: decode.held() == {} and decode.kv_blocks_used() == 0)


def test_a_long_prompt_offered_remote_prefill_reserves_the_blocks_the_kv_lands_in(decode):
    plan = decode.reserve(DecodeReserve("r2", "router-a", list(range(10, 90)), SP, transfer_id="t2"))
    assert plan.remote and plan.expecting is None and plan.num_tokens == 80 and len(plan.dst_block_ids) == 5
    assert decode.held() == {"r2": "reserved", "t2": "reserved"}
    assert decode.kv_blocks_used() == 5 and decode.stats().remote_prefills == 1
    assert decode.abort("r2")
    assert decode.held() == {} and decode.kv_blocks_used() == 0


def test_expect_without_a_reservation_is_refused(decode):
    with pytest.raises(NoReservation):
        decode.expect(TransferSpec("t-none", "prefill-0", "decode-0", (0, 1), (0,), (0,), 16))


def test_a_first_token_for_a_request_that_is_gone_is_refused(decode):
    assert not decode.first_token("nobody", FirstToken(5, "x"))
    decode.reserve(DecodeReserve("r3", "router-a", list(range(10, 90)), SP, transfer_id="t3"))
    assert decode.first_token("r3", FirstToken(5, "x"))     # kept until its KV lands
    assert decode.abort("r3")
    assert not decode.first_token("r3", FirstToken(5, "x"))


def test_a_draining_worker_takes_no_new_requests_but_continues_one_it_held(decode):
    decode.draining = True
    with pytest.raises(WorkerUnavailable):
        decode.reserve(DecodeReserve("r4", "router-a", list(range(10, 20)), SP))
    # a request whose remote prefill failed continues here as a local prefill: work in flight
    assert not decode.reserve(DecodeReserve("r4/2", "router-a", list(range(10, 20)), SP, replaces="r4/1")).remote
    assert drain(decode, "router-a", {"r4/2"})[-1].finished


def test_a_silent_router_loses_its_requests_and_their_kv_and_finds_errors_when_back():
    clock = FakeClock()
    w = create_decode_worker(clock=clock, router_timeout_s=30.0, engine=create_engine(num_blocks=256))
    try:
        long = SamplingParams(max_tokens=1500, ignore_eos=True)
        w.reserve(DecodeReserve("dead-0", "r-dead", list(range(10, 20)), long))
        w.reserve(DecodeReserve("live-0", "r-live", list(range(30, 40)), long))
        clock.advance(20.0)
        w.get_outputs("r-live", 0.0)                      # the live router polls; the dead one does not
        clock.advance(20.0)                               # r-dead silent 40 s, r-live 20 s
        until(lambda: w.stats().router_timeouts == 1)
        assert w.held() == {"live-0": "in_engine"}
        back = w.get_outputs("r-dead", 0.5)
        assert [(type(m), m.request_id) for m in back] == [(OutputError, "dead-0")] and "did not poll" in back[0].error
        assert w.abort("live-0")
        until(lambda: w.kv_blocks_used() == 0)
    finally:
        w.shutdown()


def test_a_failing_step_fails_each_request_in_it_once_and_frees_its_kv(decode):
    long = SamplingParams(max_tokens=200, ignore_eos=True)
    decode.reserve(DecodeReserve("r5", "router-a", list(range(10, 20)), long))
    decode.reserve(DecodeReserve("r6", "router-b", list(range(30, 40)), long))
    waiting = decode.reserve(DecodeReserve("r7", "router-a", list(range(100, 180)), long, transfer_id="t7"))
    decode.loop.run(decode.loop.inject_step_failure, None)
    out = drain(decode, "router-a", {"r5"}) + drain(decode, "router-b", {"r6"})
    errors = [m for m in out if isinstance(m, OutputError)]
    assert sorted(m.request_id for m in errors) == ["r5", "r6"] and "engine step failed" in errors[0].error
    assert decode.held() == {"r7": "reserved", "t7": "reserved"}       # not in the step: it stays
    assert decode.kv_blocks_used() == len(waiting.dst_block_ids)
    assert decode.abort("r7") and decode.kv_blocks_used() == 0
