"""router.admission: bounded running + queue, per-client limits, retry hints from the service rate
(fake clock), and the RESOURCE_EXHAUSTED + retry-after-ms mapping through a real grpc.aio server."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from tandem.router.admission import (RETRY_AFTER_KEY, AdmissionConfig, AdmissionLimiter, Overloaded,
                              ServiceRate, client_identity)


class FakeClock:
    def __init__(self, now: float = 100.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def make_limiter(clock=None, **overrides) -> AdmissionLimiter:
    changes = []
    limiter = AdmissionLimiter(AdmissionConfig(**{"max_in_flight": 2, "max_queue": 2, **overrides}),
                               clock or FakeClock(), on_change=lambda r, w: changes.append((r, w)))
    limiter.changes = changes
    return limiter


async def settle():
    for _ in range(3):
        await asyncio.sleep(0)


def test_runs_then_queues_fifo_then_refuses():
    async def main():
        clock = FakeClock()
        lim = make_limiter(clock)
        a = await lim.acquire("c1")
        b = await lim.acquire("c2")
        assert (lim.running, lim.waiting, a.queued_s) == (2, 0, 0.0)
        third = asyncio.create_task(lim.acquire("c3"))
        fourth = asyncio.create_task(lim.acquire("c4"))
        await settle()
        assert (lim.running, lim.waiting) == (2, 2)
        with pytest.raises(Overloaded, match="queue limit") as refused:
            await lim.acquire("c5")
        assert refused.value.retry_after_s == lim.config.default_retry_after_s  # no rate yet

        clock.now += 4.0
        lim.release(a)
        lim.release(a)  # idempotent
        await settle()
        assert third.done() and not fourth.done()  # FIFO: the oldest waiter gets the slot
        assert third.result().queued_s == 4.0
        assert (lim.running, lim.waiting) == (2, 1)
        lim.release(b)
        await settle()
        for adm in (third.result(), fourth.result()):
            lim.release(adm)
        assert (lim.running, lim.waiting) == (0, 0)
        assert lim.changes[-1] == (0, 0) and (2, 2) in lim.changes

    asyncio.run(main())


def test_cancelled_waiter_leaves_the_queue_and_a_handed_slot_is_passed_on():
    async def main():
        lim = make_limiter(max_in_flight=1)
        first = await lim.acquire("a")
        waiter = asyncio.create_task(lim.acquire("b"))
        nxt = asyncio.create_task(lim.acquire("c"))
        await settle()
        waiter.cancel()  # the client hung up while queued
        await settle()
        assert lim.waiting == 1 and lim.streams_of("b") == 0

        late = asyncio.create_task(lim.acquire("d"))
        await settle()
        lim.release(first)  # the slot goes to "c"...
        nxt.cancel()  # ...which is cancelled before it runs: the slot moves on to "d"
        await settle()
        assert nxt.cancelled() and late.done()
        assert (lim.running, lim.waiting) == (1, 0)
        lim.release(late.result())
        assert lim.running == 0 and lim.streams_of("c") == 0

    asyncio.run(main())


def test_per_client_stream_limit():
    async def main():
        lim = make_limiter(max_in_flight=10, max_streams_per_client=2)
        async with lim.admit("peer:10.0.0.1"), lim.admit("peer:10.0.0.1"):
            with pytest.raises(Overloaded, match="2 streams open, the limit is 2"):
                await lim.acquire("peer:10.0.0.1")
            async with lim.admit("peer:10.0.0.2") as other:
                assert other.queued_s == 0.0
        assert lim.streams_of("peer:10.0.0.1") == 0
        await lim.acquire("peer:10.0.0.1")

    asyncio.run(main())


def test_retry_hint_follows_the_recent_service_rate():
    clock = FakeClock(0.0)
    cfg = AdmissionConfig(rate_window_s=10.0, min_retry_after_s=0.05, max_retry_after_s=30.0)
    rate = ServiceRate(cfg, clock)
    assert rate.per_second() is None and rate.retry_after(5) == cfg.default_retry_after_s
    for _ in range(20):  # 4 releases per second over 5 s
        clock.now += 0.25
        rate.record_release()
    assert rate.per_second() == pytest.approx(4.0)
    assert rate.retry_after(8) == pytest.approx(2.0)  # 8 ahead at 4/s
    assert rate.retry_after(10_000) == 30.0 and rate.retry_after(0) == 0.05  # clamped
    clock.now += 7.6  # only the releases of the last 10 s count: 10 of them
    assert rate.per_second() == pytest.approx(1.0)
    clock.now += 11.0
    assert rate.per_second() is None


def test_expected_wait_limit_and_overloaded_metadata():
    async def main():
        clock = FakeClock(0.0)
        lim = make_limiter(clock, max_in_flight=100, max_queue=100, max_expected_wait_s=3.0, min_start_samples=4)
        for _ in range(4):  # one request started per second while others waited
            adm = await lim.acquire("x")
            clock.now += 1.0
            lim.started(adm)
            lim.release(adm)
        assert lim.starts.per_second() == pytest.approx(1.0)
        held = [await lim.acquire("x") for _ in range(3)]   # 3 ahead: 3 s, at the limit
        lim.check("x")
        held.append(await lim.acquire("x"))
        with pytest.raises(Overloaded, match="4 requests are waiting for their first token, about 4.0 s of work at the "
                                             "recent rate, over the 3 s limit") as refused:
            await lim.acquire("x")
        assert refused.value.trailing_metadata() == ((RETRY_AFTER_KEY, "1000"),)
        lim.release(held.pop())        # failed before its first token: no longer ahead, no start counted
        lim.check("x")
        assert lim.starts.per_second() == pytest.approx(1.0)

    asyncio.run(main())


def test_admit_now_counts_and_refuses_as_acquire_does_without_an_event_loop():
    """The simulator's entry: no event loop, the same predicted-wait refusal, the same start rate."""
    clock = FakeClock(0.0)
    lim = make_limiter(clock, max_in_flight=2, max_queue=10, max_expected_wait_s=3.0, min_start_samples=4)
    for _ in range(4):
        adm = lim.admit_now("x")
        clock.now += 1.0
        lim.started(adm)
        lim.release(adm)
    assert lim.starts.per_second() == pytest.approx(1.0)
    held = [lim.admit_now("x") for _ in range(4)]     # past max_in_flight: the caller queues them itself
    assert lim.running == 4 and lim.waiting == 0
    with pytest.raises(Overloaded, match="4 requests are waiting for their first token"):
        lim.admit_now("x")
    assert lim.running == 4                            # a refused request took nothing
    lim.started(held[0])                               # one ahead started: 3 s of work, at the limit
    lim.admit_now("x")
    for adm in held:
        lim.release(adm)
    assert lim.running == 1


def test_admission_config_of_a_router_config():
    from tandem.cluster.config import RouterConfig

    rc = RouterConfig(max_in_flight=7, max_queue=3, max_streams_per_client=2, max_expected_wait_s=None)
    assert AdmissionConfig.of(rc) == AdmissionConfig(max_in_flight=7, max_queue=3, max_streams_per_client=2,
                                                     max_expected_wait_s=None)
    assert AdmissionConfig.of(RouterConfig()) == AdmissionConfig()


def test_an_idle_spell_does_not_read_as_a_slow_cluster():
    async def main():
        clock = FakeClock(0.0)
        lim = make_limiter(clock, max_in_flight=100, max_queue=100, max_expected_wait_s=3.0, min_start_samples=4)
        for _ in range(6):  # requests 60 s apart, each started 0.5 s after it came
            clock.now += 60.0
            adm = await lim.acquire("x")
            clock.now += 0.5
            lim.started(adm)
            lim.release(adm)
        assert lim.starts.per_second() is None or lim.starts.per_second() == pytest.approx(2.0)
        burst = [await lim.acquire("x") for _ in range(5)]    # 5 ahead at 2/s: 2.5 s
        assert len(burst) == 5

    asyncio.run(main())


def test_default_admission_sheds_an_overload_by_predicted_wait():
    """Defect (issue 27): at 2.4x capacity for 60 s the default limits shed nothing, and every
    request waited longer and longer. Capacity here: a cluster that starts 4 requests a second, in
    order; 10 arrive each second."""
    async def main():
        clock = FakeClock(0.0)
        lim = AdmissionLimiter(AdmissionConfig(), clock)
        backlog, waits, shed = [], [], []
        for tick in range(600):                    # 60 s in steps of 0.1 s
            clock.now = tick / 10
            try:
                backlog.append((clock.now, await lim.acquire(f"c{tick}")))
            except Overloaded as e:
                shed.append(e.retry_after_ms)
            if tick % 10 >= 4 or not backlog:      # 4 starts per second (a start finishes the request here)
                continue
            arrived, adm = backlog.pop(0)
            waits.append(clock.now - arrived)
            lim.started(adm)
            lim.release(adm)
        return waits, shed

    waits, shed = asyncio.run(main())
    assert len(shed) > 200, "2.4x capacity must be shed"
    assert all(ms >= 50 for ms in shed)
    assert max(waits) < AdmissionConfig().max_expected_wait_s + 2, max(waits)


def test_config_and_identity():
    with pytest.raises(ValueError, match="max_in_flight"):
        AdmissionConfig(max_in_flight=0)
    with pytest.raises(ValueError, match="max_queue"):
        AdmissionConfig(max_queue=-1)
    assert Overloaded("x", 0.0001).retry_after_ms == 1
    assert client_identity("ipv4:10.0.0.7:51234") == "peer:10.0.0.7"
    assert client_identity("ipv6:[::1]:51234") == "peer:::1"
    assert client_identity("unix:/tmp/s.sock") == "peer:/tmp/s.sock"
    t = client_identity("ipv4:10.0.0.7:1", verified_token="secret-token")
    assert t.startswith("token:") and "secret" not in t and len(t) == len("token:") + 16


def test_overloaded_maps_to_resource_exhausted_over_grpc():
    from tandem.protos.tandem.v1 import generation_pb2, generation_pb2_grpc

    class Limited(generation_pb2_grpc.GenerationServicer):
        def __init__(self):
            self.limiter = AdmissionLimiter(AdmissionConfig(max_in_flight=1, max_queue=0))
            self.release = asyncio.Event()

        async def Generate(self, request, context):
            try:
                admission = await self.limiter.acquire(client_identity(context.peer()))
            except Overloaded as e:  # what router/server.py does, once, at the edge
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e),
                                    trailing_metadata=e.trailing_metadata())
            try:
                yield generation_pb2.GenerateResponse(text="first")
                await self.release.wait()
            finally:
                self.limiter.release(admission)

    async def main():
        servicer = Limited()
        server = grpc.aio.server()
        generation_pb2_grpc.add_GenerationServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                stub = generation_pb2_grpc.GenerationStub(ch)
                holder = stub.Generate(generation_pb2.GenerateRequest(prompt="a"), timeout=5)
                assert (await holder.read()).text == "first"
                refused = stub.Generate(generation_pb2.GenerateRequest(prompt="b"), timeout=5)
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await refused.read()
                assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert "server overloaded" in err.value.details()
                trailing = dict(err.value.trailing_metadata())
                assert int(trailing[RETRY_AFTER_KEY]) >= 1
                servicer.release.set()
                assert await holder.read() == grpc.aio.EOF
                assert await holder.code() == grpc.StatusCode.OK
        finally:
            await server.stop(None)

    asyncio.run(main())


def test_every_shed_request_gets_a_retry_hint_and_other_failures_none():
    from tandem.router.admission import retry_hint
    from tandem.wire.errors import NoWorkerReady, WorkersOverloaded

    assert retry_hint(Overloaded("full", 2.2)) == ((RETRY_AFTER_KEY, "2200"),) == Overloaded("full", 2.2).trailing_metadata()
    guard = WorkersOverloaded("no room", reason="batch_guard")
    assert retry_hint(guard) == ((RETRY_AFTER_KEY, "1000"),) and guard.reason == "batch_guard"
    assert WorkersOverloaded("every decode worker is overloaded").reason == "worker_overload"
    assert retry_hint(NoWorkerReady("none")) == () and retry_hint(ValueError("bad")) == ()


def test_router_wide_refusals_that_come_together_get_spaced_hints():
    """Clients shed together are told to come back one after another (one start at the recent
    rate apart, past the latest return time given), not all at the same moment; once those
    return times have passed, a refusal gets the plain hint again."""
    async def main():
        clock = FakeClock(0.0)
        lim = make_limiter(clock, max_in_flight=100, max_queue=100, max_expected_wait_s=2.0, min_start_samples=4)
        for _ in range(4):                  # 4 starts, one each 0.25 s of backlog: 4 a second
            adm = await lim.acquire("warm")
            clock.now += 0.25
            lim.started(adm)
            lim.release(adm)
        ahead, hints = [], []
        while not hints:                    # a backlog up to the 2 s limit, then the first refusal
            try:
                ahead.append(await lim.acquire(f"a{len(ahead)}"))
            except Overloaded as e:
                hints.append(e.retry_after_s)
        for i in range(3):
            with pytest.raises(Overloaded) as e:
                await lim.acquire(f"shed{i}")
            hints.append(e.value.retry_after_s)
        step = 1 / lim.starts.per_second()                           # one start at the recent rate
        assert 0.2 < step < 0.3 and hints[0] < 2 * step              # just over the limit
        assert [b - a for a, b in zip(hints, hints[1:])] == pytest.approx([step] * 3)   # one after another
        clock.now += 5.0                                             # the promises have passed
        with pytest.raises(Overloaded) as e:
            await lim.acquire("later")
        assert e.value.retry_after_s == pytest.approx(hints[0])
        for adm in ahead:
            lim.release(adm)

    asyncio.run(main())
