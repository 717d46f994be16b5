"""cluster.loadgen_client's driver against a fake Generation stub (no server): each session's turns
go out in order, the second carrying the first's answer in its prompt, streamed tokens and usage
land in the records, a failed call is recorded with its status, and a turn due past the duration
is not sent."""

from __future__ import annotations

import asyncio

import aiohttp
import grpc
from aiohttp.test_utils import TestServer

from tandem.cluster.loadgen import BenchConfig, Session
from tandem.cluster.loadgen_client import run_rate
from tandem.cluster.loadgen_transport import OpenAITransport
from tandem.cluster.workloads import RequestSpec
from tandem.protos.tandem.v1 import generation_pb2 as pb
from tandem.router.admission import Overloaded
from tandem.router.openai_api import make_app
from tandem.router.validation import RequestLimits


class FakeError(grpc.aio.AioRpcError):
    def __init__(self, code=grpc.StatusCode.RESOURCE_EXHAUSTED, hint_ms: int | None = None) -> None:
        trailing = grpc.aio.Metadata(("retry-after-ms", str(hint_ms))) if hint_ms is not None else None
        super().__init__(code, None, trailing, details="too busy")


class FakeStub:
    """Answers each request with its max_tokens tokens in two messages; sessions named in `fail`
    get RESOURCE_EXHAUSTED; `refuse`: a session's first N calls get `refusal` (a FakeError)."""

    def __init__(self, fail=(), refuse=None, refusal=None) -> None:
        self.requests: list[pb.GenerateRequest] = []
        self.fail = set(fail)
        self.refuse, self.refusal = dict(refuse or {}), refusal

    def Generate(self, req, timeout=None, metadata=()):
        self.requests.append(req)
        return self._answer(req)

    async def _answer(self, req):
        if any(req.session_id.endswith(s) for s in self.fail):
            raise FakeError()
        left = self.refuse.get(req.session_id, 0)
        if left:
            self.refuse[req.session_id] = left - 1
            raise self.refusal
        n = req.sampling.max_tokens
        ids = [7 + i for i in range(n)]
        yield pb.GenerateResponse(token_ids=ids[: n // 2])
        await asyncio.sleep(0)
        yield pb.GenerateResponse(token_ids=ids[n // 2:], finish_reason=pb.LENGTH,
                                  usage=pb.Usage(prompt_tokens=len(req.prompt_token_ids), completion_tokens=n))


def session(sid: str, turns: int, think_s: float = 0.0, start_s: float = 0.0) -> Session:
    specs = tuple(RequestSpec(sid, t, 0.0, 16 + 8 * t, 4, shared_prefix_tokens=20 * t if t else 0, think_s=think_s)
                  for t in range(turns))
    return Session(sid, specs, start_s)


def test_sessions_run_closed_loop_and_their_records_carry_what_came_back():
    stub = FakeStub(fail={"s-b"})
    cfg = BenchConfig(target="fake", workload="agent", rates=(1.0,), duration_s=5.0, drain_timeout_s=1.0)
    sessions = [session("s-a", 2), session("s-b", 1, start_s=0.01)]
    records, not_started, elapsed = asyncio.run(run_rate(
        stub, sessions, cfg, session_workload=True, rate=1.0, vocab_size=1000, run_tag="t"))
    assert not_started == 0 and elapsed < 5
    by = {(r.session_id, r.turn): r for r in records}
    first = by[("s-a", 0)]
    assert by[("s-a", 1)].status == "OK"
    assert first.status == "OK" and first.finish_reason == "LENGTH"
    assert len(first.token_times_s) == 4 and first.completion_tokens == 4
    sent = {r.request_id: r for r in stub.requests}
    # the second turn's prompt starts with the first's prompt and answer, as a real session's does
    assert list(sent["t-s-a-t1"].prompt_token_ids[:20]) == (list(sent["t-s-a-t0"].prompt_token_ids) + [7, 8, 9, 10])
    assert by[("s-b", 0)].status == "RESOURCE_EXHAUSTED" and by[("s-b", 0)].error == "too busy"


def test_a_turn_due_past_the_duration_is_not_sent():
    stub = FakeStub()
    cfg = BenchConfig(target="fake", workload="agent", rates=(1.0,), duration_s=0.2, drain_timeout_s=1.0)
    records, not_started, _ = asyncio.run(run_rate(
        stub, [session("s-a", 3, think_s=0.5)], cfg, session_workload=True, rate=1.0, vocab_size=1000,
        run_tag="t"))
    assert [r.turn for r in records] == [0] and not_started == 2
    assert len(stub.requests) == 1




def _run(stub, sessions, duration_s=5.0, retries=0):
    cfg = BenchConfig(target="fake", workload="agent", rates=(1.0,), duration_s=duration_s, drain_timeout_s=1.0,
                      retries=retries)
    return asyncio.run(run_rate(stub, sessions, cfg, session_workload=True, rate=1.0, vocab_size=1000,
                                run_tag="t"))[0]


def test_retries_send_a_refused_turn_again_after_the_routers_hint():
    """--retries: a turn refused before its first token waits the router's hint and goes again
    (a request id of its own each time); its TTFT counts from its first send; the session then
    goes on. Without retries the refusal is the turn's status."""
    refusal = FakeError(hint_ms=200)
    stub = FakeStub(refuse={"t-s-a": 2}, refusal=refusal)
    records = _run(stub, [session("s-a", 2)], retries=3)
    first, second = sorted(records, key=lambda r: r.turn)
    assert first.status == "OK" and first.retries == 2 and second.status == "OK" and second.retries == 0
    assert first.ttft_s >= 0.4                       # two waits of the 200 ms hint before it was served
    assert [r.request_id for r in stub.requests] == ["t-s-a-t0", "t-s-a-t0-r1", "t-s-a-t0-r2", "t-s-a-t1"]
    once = _run(FakeStub(refuse={"t-s-a": 2}, refusal=refusal), [session("s-a", 2)], retries=1)
    assert sorted((r.turn, r.status, r.retries) for r in once) == [(0, "RESOURCE_EXHAUSTED", 1), (1, "OK", 0)]
    none = _run(FakeStub(refuse={"t-s-a": 1}, refusal=refusal), [session("s-a", 1)])
    assert [(r.status, r.retries) for r in none] == [("RESOURCE_EXHAUSTED", 0)]


def test_retries_stop_at_the_duration_and_never_retry_a_bad_request():
    late = FakeError(hint_ms=3000)                  # the wait would end past the 1 s duration
    records = _run(FakeStub(refuse={"t-s-a": 1}, refusal=late), [session("s-a", 1)], duration_s=1.0, retries=5)
    assert [(r.status, r.retries) for r in records] == [("RESOURCE_EXHAUSTED", 0)]
    bad = FakeError(grpc.StatusCode.INVALID_ARGUMENT)
    stub = FakeStub(refuse={"t-s-a": 1}, refusal=bad)
    assert [(r.status, r.retries) for r in _run(stub, [session("s-a", 1)], retries=5)] == [("INVALID_ARGUMENT", 0)]
    assert len(stub.requests) == 1
    gone = FakeError(grpc.StatusCode.UNAVAILABLE)   # no hint: backoff_s' 0.5 s
    records = _run(FakeStub(refuse={"t-s-a": 1}, refusal=gone), [session("s-a", 1)], retries=1)
    assert [(r.status, r.retries) for r in records] == [("OK", 1)] and records[0].ttft_s >= 0.5


class FakeRouter:
    """The OpenAI edge's Router: answers like FakeStub, sheds sessions named in `fail` (429)."""

    def __init__(self, fail=(), shed_first=0, hint_s=1.0):
        self.stub, self.limits = FakeStub(), RequestLimits()
        self.fail, self.shed_first, self.hint_s = set(fail), shed_first, hint_s

    async def admit_and_generate(self, request, client, deadline=None):
        if any(request.session_id.endswith(s) for s in self.fail) or self.shed_first > 0:
            self.shed_first -= 1
            raise Overloaded("queue full", self.hint_s)
        self.stub.requests.append(request)
        async for resp in self.stub._answer(request):
            yield resp

    def record_error(self, e, code):
        pass


def test_the_openai_api_runs_the_same_plan_with_the_same_records():
    """`tandem bench --api openai`: the same sessions over POST /v1/completions (token ids in and
    out through return_token_ids), statuses mapped back to gRPC names."""
    router = FakeRouter(fail={"s-b"})
    cfg = BenchConfig(target="fake", workload="agent", rates=(1.0,), duration_s=5.0, drain_timeout_s=1.0)
    sessions = [session("s-a", 2), session("s-b", 1, start_s=0.01)]

    async def go():
        async with TestServer(make_app(router, "m")) as server, aiohttp.ClientSession() as http:
            transport = await OpenAITransport.connect(http, str(server.make_url("")))
            assert transport.model == "m"
            return await run_rate(transport, sessions, cfg, session_workload=True, rate=1.0, vocab_size=1000,
                                  run_tag="t")

    records, not_started, _ = asyncio.run(go())
    by = {(r.session_id, r.turn): r for r in records}
    first = by[("s-a", 0)]
    assert first.status == "OK" and first.finish_reason == "LENGTH" and by[("s-a", 1)].status == "OK"
    assert len(first.token_times_s) == 4 and first.completion_tokens == 4 and first.usage_prompt_tokens == 16
    sent = [r for r in router.stub.requests if r.session_id == "t-s-a"]
    assert list(sent[1].prompt_token_ids[:20]) == list(sent[0].prompt_token_ids) + [7, 8, 9, 10]
    assert sent[0].sampling.ignore_eos and sent[0].sampling.temperature == 0
    assert by[("s-b", 0)].status == "RESOURCE_EXHAUSTED" and "queue full" in by[("s-b", 0)].error


def test_the_openai_api_s_retry_hint_reaches_the_bench():
    """Over HTTP the hint is the 429's retry-after-ms header: a retried turn waits it."""
    router = FakeRouter(shed_first=1, hint_s=0.3)
    cfg = BenchConfig(target="fake", workload="agent", rates=(1.0,), duration_s=5.0, drain_timeout_s=1.0, retries=2)

    async def go():
        async with TestServer(make_app(router, "m")) as server, aiohttp.ClientSession() as http:
            transport = await OpenAITransport.connect(http, str(server.make_url("")))
            return await run_rate(transport, [session("s-a", 1)], cfg, session_workload=True, rate=1.0,
                                  vocab_size=1000, run_tag="t")

    records, _, _ = asyncio.run(go())
    assert [(r.status, r.retries) for r in records] == [("OK", 1)]
    assert 0.3 <= records[0].ttft_s < 0.5          # the hint, not the 0.5 s backoff of a hint-less refusal
