"""Overload and garbage: twice the capacity for 20 s sheds with RESOURCE_EXHAUSTED (with a retry
hint) while admitted requests finish; 1,000 random and malformed GenerateRequests each get a stream
or a status, the server keeps serving, and KV in use returns to zero."""

from __future__ import annotations

import dataclasses
import threading
import time

import grpc
from hypothesis import HealthCheck, given, settings, strategies as st

from tandem.protos.tandem.v1 import generation_pb2 as pb

TINY = {"model.name": "tiny-random", "cache.num_blocks": 256, "decode.local_prefill_threshold": 10**9,
        "prefill.replicas": 1, "decode.replicas": 1}


def test_twice_capacity_for_20s_sheds_and_serves(make_cluster):
    c = make_cluster({**TINY, "router.max_in_flight": 4, "router.max_queue": 4})
    # 20 s of overload is ~200 admitted requests and ~3,000 shed ones here: every assertion below
    # is met many times over (60 s only repeated the same steady state)
    stop = time.monotonic() + 20
    ok, shed, other, lock = [0], [0], [], threading.Lock()
    hints = []

    def client(k):
        while time.monotonic() < stop:
            try:
                ids, _, last = c.generate(prompt=f"load {k}", max_tokens=64, ignore_eos=True, timeout=60)
                assert len(ids) == 64 and last.finish_reason == pb.LENGTH
                with lock:
                    ok[0] += 1
            except grpc.RpcError as e:
                with lock:
                    if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                        shed[0] += 1
                        hints.append(dict(e.trailing_metadata() or ()).get("retry-after-ms"))
                    else:
                        other.append(e)
                time.sleep(0.05)

    # 16 concurrent clients against 4 running + 4 queued: twice what the router admits
    ts = [threading.Thread(target=client, args=(k,)) for k in range(16)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(180)
    assert not other, other[:3]
    assert ok[0] > 0 and shed[0] > 0, (ok, shed)
    assert all(h is not None and int(h) > 0 for h in hints)
    used = c.wait_idle()
    assert all(v == 0 for v in used.values()), used


roles = st.sampled_from(["user", "assistant", "system", "tool", "wizard", "", "USER"])
sampling = st.builds(
    pb.SamplingParams,
    max_tokens=st.one_of(st.none(), st.integers(-5, 3000)),
    temperature=st.one_of(st.floats(-2, 3), st.just(0.0), st.just(float("nan")), st.just(float("inf"))),
    top_p=st.one_of(st.none(), st.floats(-1, 2), st.just(float("nan"))),
    top_k=st.integers(-3, 100000),
    seed=st.one_of(st.none(), st.integers(0, 2**64 - 1)),
    stop=st.lists(st.text(max_size=5), max_size=3),
    ignore_eos=st.booleans())
requests = st.builds(
    pb.GenerateRequest,
    request_id=st.one_of(st.just(""), st.text(max_size=20)),
    session_id=st.one_of(st.just(""), st.text(alphabet="abc-", max_size=8)),
    prompt=st.one_of(st.none(), st.text(max_size=60)),
    prompt_token_ids=st.lists(st.integers(0, 2**32 - 1), max_size=20),
    messages=st.lists(st.builds(pb.ChatMessage, role=roles, content=st.text(max_size=30)), max_size=3),
    sampling=st.one_of(st.none(), sampling))


def test_fuzzed_requests_get_a_stream_or_a_status(make_cluster):
    c = make_cluster(TINY)
    # a request that leaves max_tokens unset gets the router's default (256), capped at the room
    # left: keep that path, with a default as short as the explicit cap below (each such request
    # took ~1 s to stream 256 tokens, most of the test's time)
    for _, router in c.routers:
        router.limits = dataclasses.replace(router.limits, default_max_tokens=8)
    outcomes = {"ok": 0}

    @settings(max_examples=1000, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(req=requests)
    def one(req):
        if req.sampling.HasField("max_tokens") and req.sampling.max_tokens > 8:
            req.sampling.max_tokens = 8  # keep each valid request short; validity unchanged
        try:
            for _ in c.stub.Generate(req, timeout=30):
                pass
            outcomes["ok"] += 1
        except grpc.RpcError as e:
            assert e.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED), (
                e.code(), e.details(), req)
            assert e.details()
            outcomes[e.code().name] = outcomes.get(e.code().name, 0) + 1

    one()
    assert outcomes["ok"] > 0 and outcomes.get("INVALID_ARGUMENT", 0) > 0, outcomes
    ids, _, _ = c.generate(prompt="after the storm", max_tokens=5, ignore_eos=True)
    assert len(ids) == 5
    used = c.wait_idle()
    assert all(v == 0 for v in used.values()), used
