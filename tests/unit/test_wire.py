"""The contracts between processes: every message survives pickling (Ray's transport) unchanged,
reads by the same attribute names on both sides, and each failure kind is its own error type that
keeps its message across the boundary."""

from __future__ import annotations

import pickle

import pytest

from tandem.wire import errors
from tandem.wire.cluster import AutoscalerDecision, ClusterState, PoolState, WorkerEntry
from tandem.wire.messages import (DecodePlan, DecodeReserve, FinishReason, FirstToken, FirstTokenReady, OutputError,
                                  PrefillReservation, PrefillReserve, PrefillResult, SamplingParams, StepOutput,
                                  Usage, WorkerLostNotice)
from tandem.wire.stats import WorkerInfo, WorkerStats

FIRST = FirstToken(42, " hi", FinishReason.STOP, rng_state=b"\x01\x02")
MESSAGES = [
    SamplingParams(max_tokens=3, temperature=0.5, seed=1, stop=("\n",)),
    FIRST,
    PrefillReserve("t1", [1, 2, 3], SamplingParams(max_tokens=2)),
    PrefillReservation(cached_tokens=16, block_ids=[4, 5]),
    FirstTokenReady(FIRST, {"prefix pull": 0.1}),
    PrefillResult(16, 64, FIRST, {"queue+compute+send": 0.2}),
    DecodeReserve("r1", "router-a", [1, 2], SamplingParams(), transfer_id="t1", prefill_id="prefill-0"),
    DecodePlan(remote=True, cached_tokens=16, first_block=1, dst_block_ids=[7, 8], num_tokens=48,
               prefix_block_ids=[3], expecting="prefill-0"),
    StepOutput("r1", [5, 6], "ab", FinishReason.LENGTH, Usage(prompt_tokens=2, completion_tokens=2)),
    OutputError("r1", "KV transfer failed"),
    WorkerLostNotice("decode-0", "worker decode-0 lost"),
    WorkerInfo("decode-0", "decode", pid=7, node="n1", host="h", kv_blocks_total=64),
    ClusterState((WorkerEntry("decode-0", "decode", "ready", "ns:decode-0", pid=7, stats=WorkerStats("decode-0", "decode")),
                  WorkerEntry("prefill-0", "prefill", "dead", error="no GPU")),
                 {"decode": PoolState(1, 1, 1, 1), "prefill": PoolState(0, 1, 1, 1)},
                 AutoscalerDecision(1.7e9, 1, 1, ("hold",)), rendezvous="h:1", namespace="ns"),
]


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_every_message_crosses_a_process_boundary_unchanged(msg):
    assert pickle.loads(pickle.dumps(msg)) == msg


def test_plans_and_outputs_answer_the_questions_their_readers_ask():
    assert DecodePlan(remote=False, cached_tokens=5).mode == "local"
    assert DecodePlan(remote=True, cached_tokens=0).mode == "remote"
    assert StepOutput("r", [1], "a", FinishReason.STOP).finished
    assert not StepOutput("r", [1], "a").finished


def test_sampling_parameters_are_validated_where_they_are_made():
    with pytest.raises(errors.InvalidRequestError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    with pytest.raises(errors.InvalidRequestError, match="top_p"):
        SamplingParams(top_p=0.0)


@pytest.mark.parametrize("kind", [errors.WorkerUnavailable, errors.NoReservation, errors.TransferFailed,
                                  errors.WorkerLost, errors.InvalidRequestError, errors.UnknownWorker,
                                  errors.UnknownPool, errors.InvalidPoolBounds])
def test_each_failure_kind_keeps_its_type_and_message_across_the_boundary(kind):
    e = pickle.loads(pickle.dumps(kind("why it failed")))
    assert type(e) is kind and str(e) == "why it failed"


def test_the_engine_speaks_the_same_types():
    from tandem.engine.request import Request

    r = Request("r1", [1, 2], SamplingParams(max_tokens=2))
    assert type(r.sampling) is SamplingParams and Request("r2", [1]).sampling == SamplingParams()
