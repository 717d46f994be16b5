"""SIGTERM drains (issue 27 item 6: `server.stop(grace=10)` cut an 800-token stream at token 263):
the streams a router has finish up to router.drain_timeout_s, new calls are refused meanwhile,
health says NOT_SERVING; past the deadline the rest is cancelled. Real grpc.aio on 127.0.0.1."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from tandem.protos.tandem.v1 import generation_pb2 as pb, generation_pb2_grpc
from tandem.router.admission import AdmissionLimiter
from tandem.router.drain import drain_and_stop
from tandem.router.server import GenerationService


class SlowRouter:
    """Streams `n` tokens, one every `every_s`, behind a real admission limiter."""

    def __init__(self, n: int, every_s: float, servicer):
        self.n, self.every_s = n, every_s
        self.limiter = AdmissionLimiter()
        self.health, self.http = servicer, None
        self.view = SimpleNamespace(stop=_noop)
        self.sessions = SimpleNamespace(close=_noop)

    async def admit_and_generate(self, request, client, deadline=None):
        async with self.limiter.admit(client):
            for i in range(self.n):
                await asyncio.sleep(self.every_s)
                yield pb.GenerateResponse(token_ids=[i])

    def record_error(self, e, code):
        pass


async def _noop():
    return None


async def _drain_during_stream(n, every_s, drain_timeout_s):
    servicer = health.aio.HealthServicer()
    router = SlowRouter(n, every_s, servicer)
    server = grpc.aio.server()
    generation_pb2_grpc.add_GenerationServicer_to_server(GenerationService(router), server)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    await servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        stub = generation_pb2_grpc.GenerationStub(ch)
        got: list[int] = []

        async def consume():
            async for r in stub.Generate(pb.GenerateRequest(prompt="x")):
                got.extend(r.token_ids)
        stream = asyncio.ensure_future(consume())
        while len(got) < 3:
            await asyncio.sleep(0.02)
        drained = asyncio.ensure_future(drain_and_stop(server, router, drain_timeout_s))
        await asyncio.sleep(0.3)
        status = (await servicer.Check(health_pb2.HealthCheckRequest(service=""), None)).status
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            async for _ in stub.Generate(pb.GenerateRequest(prompt="late")):
                pass
        try:
            await stream
            error = None
        except grpc.aio.AioRpcError as e:
            error = e.code()
        return got, error, await drained, status, refused.value.code()


def test_a_stream_longer_than_the_old_10_s_grace_finishes():
    got, error, drained, status, refused = asyncio.run(_drain_during_stream(120, 0.1, 60))
    assert error is None and got == list(range(120)) and drained
    assert status == health_pb2.HealthCheckResponse.NOT_SERVING
    assert refused == grpc.StatusCode.UNAVAILABLE


def test_past_the_deadline_the_rest_is_cancelled():
    got, error, drained, _, _ = asyncio.run(_drain_during_stream(200, 0.05, 1.0))
    assert error is not None and len(got) < 200 and not drained


def test_drain_timeout_is_a_router_key():
    from tandem.cluster.config import load_config

    assert load_config(None, {"router.drain_timeout_s": 900}).router.drain_timeout_s == 900
