"""The per-request records' transitions, alone (pure: no engine, no transport): each says what the
worker must do next, and a record that ended holds nothing the worker could free twice."""

from __future__ import annotations

from concurrent.futures import Future

import pytest

from tandem.decode_workers.records import AbortAction, DecodeRequest, DecodeState, FirstTokenTaken
from tandem.engine.request import Request
from tandem.prefill_workers.records import PrefillJob, PrefillState
from tandem.wire.messages import FirstToken

FIRST = FirstToken(7, "x")


def job(**kw) -> PrefillJob:
    return PrefillJob("t1", Request("t1", [1, 2, 3]), reserved_at=100.0, **kw)


def decode(state=DecodeState.RESERVED) -> DecodeRequest:
    return DecodeRequest(Request("r1", [1, 2, 3]), "router-a", transfer_id="t1", state=state)


# ---- prefill ------------------------------------------------------------------------------------
def test_a_start_without_a_pull_schedules_at_once():
    j = job()
    assert j.start(1.0, Future()) and j.state is PrefillState.SENDING and j.started


def test_a_pull_pending_at_start_delays_scheduling_until_it_lands():
    j = job()
    j.add_pull("p", 16)
    assert not j.start(1.0, Future()) and j.state is PrefillState.PULLING
    assert j.pull_landed("p") == (16, True) and j.state is PrefillState.SENDING


def test_a_pull_that_lands_before_start_is_used_and_start_schedules():
    j = job()
    j.add_pull("p", 16)
    assert j.pull_landed("p") == (16, False)       # counted now, scheduled by start
    assert j.start(1.0, Future()) and j.state is PrefillState.SENDING


def test_a_failed_pull_aborts_the_transfer_only_once_started():
    before, after = job(), job()
    before.add_pull("p", 16)
    assert not before.pull_failed("p")             # before start: it computes its prefix itself
    after.add_pull("p", 16)
    after.start(1.0, Future())
    assert after.pull_failed("p")


def test_an_ended_job_stays_parked_while_a_pull_may_write_its_blocks():
    j = job()
    j.add_pull("p", 16)
    assert j.end() == ["p"]                        # the worker aborts it
    assert not j.settle() and j.state is PrefillState.PARKED and not j.live
    assert j.let_go("p") and j.state is PrefillState.ENDED


def test_a_pull_that_lets_go_inside_its_abort_does_not_free_before_settle():
    j = job()
    j.add_pull("p", 16)
    j.end()
    assert not j.let_go("p")                       # the receiver released inside abort()
    assert j.settle() and j.state is PrefillState.ENDED


def test_a_pull_landing_after_the_job_ended_is_ignored():
    j = job()
    j.add_pull("p", 16)
    j.end()
    j.settle()
    assert j.pull_landed("p") is None and not j.pull_failed("p")


def test_only_an_unstarted_reservation_expires_and_only_it_takes_pulls():
    j = job()
    assert j.expired(221.0, 120.0) and not j.expired(219.0, 120.0)
    j.start(1.0, Future())
    assert not j.expired(1e9, 120.0)
    with pytest.raises(ValueError):
        j.add_pull("p", 16)
    with pytest.raises(ValueError):
        j.start(2.0, Future())


# ---- decode -------------------------------------------------------------------------------------
def test_kv_then_first_token_admits_on_the_token():
    r = decode()
    r.registering()
    r.registered(1.0)
    assert r.kv_arrived() is None and r.state is DecodeState.KV_READY and not r.receiving
    assert r.take_first(FIRST) is FirstTokenTaken.ADMIT and r.state is DecodeState.IN_ENGINE


def test_first_token_then_kv_admits_on_the_kv():
    r = decode()
    r.registering()
    r.registered(1.0)
    assert r.take_first(FIRST) is FirstTokenTaken.KEPT
    assert r.kv_arrived() == FIRST and r.state is DecodeState.IN_ENGINE and r.first is None


def test_a_first_token_for_a_request_in_the_engine_is_refused():
    assert decode(DecodeState.IN_ENGINE).take_first(FIRST) is FirstTokenTaken.REFUSED


def test_aborting_frees_what_it_holds_in_the_one_right_way():
    assert decode(DecodeState.RESERVED).abort() is AbortAction.FREE_BLOCKS
    kv_here = decode(DecodeState.KV_READY)
    assert kv_here.abort() is AbortAction.FREE_BLOCKS and kv_here.state is DecodeState.GONE
    assert decode(DecodeState.IN_ENGINE).abort() is AbortAction.ABORT_IN_ENGINE
    receiving = decode()
    receiving.registering()
    receiving.registered(1.0)
    assert receiving.abort() is AbortAction.ABORT_RECEIVE and receiving.state is DecodeState.RELEASING
    assert receiving.released() and receiving.state is DecodeState.GONE
    assert not receiving.released()                # a second release frees nothing


def test_a_transfer_that_landed_after_its_abort_is_freed_at_the_reap():
    r = decode()
    r.registering()
    r.registered(1.0)
    r.abort()
    assert r.landed_after_abort() and r.state is DecodeState.GONE and not r.receiving


def test_a_failed_transfer_releases_its_blocks_once():
    r = decode()
    r.registering()
    r.registered(1.0)
    r.transfer_failed()
    assert r.state is DecodeState.RELEASING and r.released() and r.state is DecodeState.GONE
    early = decode()                                # the release came before the reap
    early.registering()
    early.registered(1.0)
    assert early.released() and early.state is DecodeState.RECEIVING
    early.transfer_failed()
    assert early.state is DecodeState.GONE


def test_kv_cannot_arrive_for_a_request_not_waiting_for_it():
    with pytest.raises(ValueError):
        decode(DecodeState.IN_ENGINE).kv_arrived()
