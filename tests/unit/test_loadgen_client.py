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
    def __init__(self) -> None:
        super().__init__(grpc.StatusCode.RESOURCE_EXHAUSTED, None, None, details="too busy")


class FakeStub:
    """Answers each request with its max_tokens tokens in two messages; sessions named in `fail`
    get RESOURCE_EXHAUSTED."""

    def __init__(self, fail=()) -> None:
        self.requests: list[pb.GenerateRequest] = []
        self.fail = set(fail)

    def Generate(self, req, timeout=None, metadata=()):
        self.requests.append(req)
        return self._answer(req)

    async def _answer(self, req):
        if any(req.session_id.endswith(s) for s in self.fail):
            raise FakeError()
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




class FakeRouter:
    """The OpenAI edge's Router: answers like FakeStub, sheds sessions named in `fail` (429)."""

    def __init__(self, fail=()):
        self.stub, self.limits = FakeStub(), RequestLimits()
        self.fail = set(fail)

    async def admit_and_generate(self, request, client, deadline=None):
        if any(request.session_id.endswith(s) for s in self.fail):
            raise Overloaded("queue full", 1.0)
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
