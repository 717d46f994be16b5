"""What a client reads of a failure (issue 27 item 6): one line, without tracebacks, file paths,
pids, addresses, actor ids or ANSI codes, over a real grpc.aio server; the detail goes to the log."""

from __future__ import annotations

import asyncio
import logging

import grpc
import pytest

from tandem.protos.tandem.v1 import generation_pb2 as pb, generation_pb2_grpc
from tandem.router.server import GenerationService
from tandem.router.status_codes import client_message, one_line
from tandem.wire.errors import MigrationsExhausted, UnknownWorker

LEAKY = ("\x1b[36m(WorkerActor pid=48213, ip=10.0.3.17)\x1b[0m Traceback (most recent call last):\n"
         '  File "/work/main/decode_workers/worker.py", line 176, in _reserve\n'
         "ValueError: request id 'r/1' is already in flight; actor_id=c4b1e0a9f2d34c5b6a7e8f90a1b2c3d4e5f60718")


class FailingRouter:
    def __init__(self, error):
        self.error, self.recorded = error, []

    async def admit_and_generate(self, request, client):
        yield pb.GenerateResponse(token_ids=[1])
        self.error.tandem_request_id = "req-7"
        raise self.error

    def record_error(self, e, code):
        self.recorded.append(code)


async def _call(error) -> grpc.aio.AioRpcError:
    server = grpc.aio.server()
    generation_pb2_grpc.add_GenerationServicer_to_server(GenerationService(FailingRouter(error)), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for _ in generation_pb2_grpc.GenerationStub(ch).Generate(pb.GenerateRequest(prompt="x")):
                    pass
            return err.value
    finally:
        await server.stop(None)


@pytest.mark.parametrize("error", [ValueError(LEAKY), RuntimeError(LEAKY), MigrationsExhausted("gone: " + LEAKY)])
def test_a_failure_in_the_cluster_reaches_the_client_as_one_clean_line(error):
    e = asyncio.run(_call(error))
    details = e.details()
    assert "\n" not in details and "\x1b" not in details
    for leak in ("Traceback", "/work/main", "48213", "10.0.3.17", "c4b1e0a9f2d3"):
        assert leak not in details, details
    assert "req-7" in details


def test_refusals_keep_their_own_message():
    assert client_message(UnknownWorker("no worker 'decode-9'")) == "no worker 'decode-9'"
    assert one_line(LEAKY) == "(WorkerActor pid=<pid>, ip=<address>)"


def test_the_detail_is_logged_under_the_request_id(caplog):
    from tandem.router.generation import Router

    class Boom(Router):
        def __init__(self):
            from tandem.router.request_ids import ActiveRequests
            self.counters = {"requests": 0}
            self.active = ActiveRequests("router-t")

        def prepare(self, request):
            from types import SimpleNamespace
            return SimpleNamespace(request_id="rid-42"), [1], None

        async def _generate(self, *a):
            raise ValueError(LEAKY)
            yield

    async def run():
        with pytest.raises(ValueError) as err:
            async for _ in Boom().generate(pb.GenerateRequest(), "c"):
                pass
        return err.value

    with caplog.at_level(logging.ERROR):
        e = asyncio.run(run())
    assert e.tandem_request_id == "rid-42"
    assert any("rid-42" in r.getMessage() and r.exc_info for r in caplog.records)
