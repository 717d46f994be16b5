"""Malformed protobuf and invalid UTF-8 (issue 27 item 6): INVALID_ARGUMENT, not UNKNOWN, and one log
line per interval, not a traceback per request; over a real grpc.aio server on 127.0.0.1."""

from __future__ import annotations

import asyncio
import logging

import grpc

from tandem.protos.tandem.v1 import admin_pb2, admin_pb2_grpc, generation_pb2 as pb, generation_pb2_grpc
from tandem.router.malformed import MalformedRequestInterceptor, RateLimitedLog
from tandem.router.server import GenerationService

BAD_UTF8 = bytes([(3 << 3) | 2, 2, 0xFF, 0xFE])     # field 3 (prompt), length 2, not UTF-8
NOT_PROTO = b"\xff\xff\xff\xff\x0f garbage"


class OneToken:
    async def admit_and_generate(self, request, client, deadline=None):
        yield pb.GenerateResponse(token_ids=[7], text=request.prompt)

    def record_error(self, e, code):
        pass


class EmptyAdmin(admin_pb2_grpc.AdminServicer):
    async def GetClusterState(self, request, context):
        return admin_pb2.ClusterState()


async def _codes(bodies) -> list:
    server = grpc.aio.server(interceptors=[MalformedRequestInterceptor()])
    generation_pb2_grpc.add_GenerationServicer_to_server(GenerationService(OneToken()), server)
    admin_pb2_grpc.add_AdminServicer_to_server(EmptyAdmin(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    out = []
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            gen = ch.unary_stream("/tandem.v1.Generation/Generate")
            admin = ch.unary_unary("/tandem.v1.Admin/GetClusterState")
            for target, body in bodies:
                try:
                    if target == "gen":
                        out.append([pb.GenerateResponse.FromString(m).text async for m in gen(body)])
                    else:
                        await admin(body)
                        out.append("OK")
                except grpc.aio.AioRpcError as e:
                    out.append((e.code(), e.details()))
    finally:
        await server.stop(None)
    return out


def test_malformed_requests_get_invalid_argument_and_one_log_line(caplog):
    good = pb.GenerateRequest(prompt="hi").SerializeToString()
    assert pb.GenerateRequest.FromString(bytes([(3 << 3) | 2, 2]) + b"hi").prompt == "hi"   # field 3 is prompt
    bodies = [("gen", BAD_UTF8), ("gen", NOT_PROTO), ("admin", NOT_PROTO), ("gen", good)] + [("gen", NOT_PROTO)] * 5
    with caplog.at_level(logging.WARNING):
        out = asyncio.run(_codes(bodies))
    assert out[3] == ["hi"]
    for i in (0, 1, 2, *range(4, 9)):
        code, details = out[i]
        assert code == grpc.StatusCode.INVALID_ARGUMENT, out[i]
        assert "not a valid" in details and "\n" not in details
    lines = [r for r in caplog.records if "malformed" in r.getMessage()]
    assert len(lines) == 1 and lines[0].exc_info is None
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


def test_the_rate_limited_log_counts_what_it_dropped(caplog):
    now = [0.0]
    rl = RateLimitedLog(10.0, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING):
        assert rl.warning("x %s", 1) and not rl.warning("x %s", 2) and not rl.warning("x %s", 3)
        now[0] = 11.0
        assert rl.warning("x %s", 4)
    assert [r.getMessage() for r in caplog.records] == [
        "x 1 (0 more like it not logged in the last 10 s)", "x 4 (2 more like it not logged in the last 10 s)"]
