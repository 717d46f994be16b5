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

    async def admit_and_generate(self, request, client, deadline=None):
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


@pytest.mark.parametrize("text, scrubbed", [
    ("prompt_token_ids[1] is 100000000; token ids must be in [0, 49152)",
     "prompt_token_ids[1] is 100000000; token ids must be in [0, 49152)"),   # indices are not addresses
    ("stop[a] and messages[0]", "stop[a] and messages[0]"),
    ("peer [fe80::1]:50051 gone", "peer <address> gone"),
    ("peer [::1] gone", "peer <address> gone"),
    ("peer fe80::1 gone", "peer <address> gone"),
    ("peer 10.0.3.17:6379 gone", "peer <address> gone"),
])
def test_one_line_masks_addresses_not_list_indices(text, scrubbed):
    assert one_line(text) == scrubbed


class FakeHub:
    def __init__(self):
        self.finished = []

    def record_finished(self, *, code, finish_reason, e2e_seconds):
        self.finished.append(code)


def _router(body):
    """A Router whose request path is `body` (an async generator function)."""
    from types import SimpleNamespace

    from tandem.router.generation import Router
    from tandem.router.request_ids import ActiveRequests

    class Scripted(Router):
        def __init__(self):
            self.counters = {"requests": 0}
            self.active = ActiveRequests("router-t")
            self.hub = FakeHub()

        def prepare(self, request):
            return SimpleNamespace(request_id="rid-42"), [1], None

        def _generate(self, *a):
            return body()

    return Scripted()


def test_the_detail_is_logged_under_the_request_id(caplog):
    async def boom():
        raise ValueError(LEAKY)
        yield

    router = _router(boom)

    async def run():
        with pytest.raises(ValueError) as err:
            async for _ in router.generate(pb.GenerateRequest(), "c"):
                pass
        return err.value

    with caplog.at_level(logging.ERROR):
        e = asyncio.run(run())
    assert e.tandem_request_id == "rid-42"
    assert any("rid-42" in r.getMessage() and r.exc_info for r in caplog.records)
    assert router.hub.finished == ["INTERNAL"]


def test_requests_total_names_cancelled_deadline_and_failed_apart():
    """Defect (issue 27): all three were counted under one code, CANCELLED_OR_FAILED."""
    import time

    async def slow():
        yield pb.GenerateResponse(token_ids=[1])
        await asyncio.sleep(30)
        yield pb.GenerateResponse(token_ids=[2])

    async def cancel_after_first(deadline):
        router = _router(slow)

        async def consume():
            async for _ in router.generate(pb.GenerateRequest(), "c", deadline):
                pass
        task = asyncio.ensure_future(consume())
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return router.hub.finished

    assert asyncio.run(cancel_after_first(None)) == ["CANCELLED"]
    assert asyncio.run(cancel_after_first(time.monotonic() + 60)) == ["CANCELLED"]
    assert asyncio.run(cancel_after_first(time.monotonic())) == ["DEADLINE_EXCEEDED"]

    async def no_worker():
        from tandem.wire.errors import NoWorkerReady
        raise NoWorkerReady("no decode worker is ready")
        yield

    async def failed():
        router = _router(no_worker)
        with pytest.raises(Exception):
            async for _ in router.generate(pb.GenerateRequest(), "c"):
                pass
        return router.hub.finished

    assert asyncio.run(failed()) == ["UNAVAILABLE"]
