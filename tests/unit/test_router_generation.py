"""router/generation.py and router/placing.py end to end against fake actors (no Ray): what the
client sees and what the metrics record, through the router's public `generate`."""

from __future__ import annotations

import asyncio
import concurrent.futures
from types import SimpleNamespace

import grpc
import pytest

from tandem.placement import OverloadLimits, WorkerView
from tandem.protos.tandem.v1 import generation_pb2
from tandem.router.generation import Router
from tandem.router.status_codes import status_code
from tandem.router.sessions import InMemorySessionStore, SessionState
from tandem.router.admission import Overloaded
from tandem.wire.errors import (InvalidRequestError, MigrationsExhausted, NoReservation, NoWorkerReady,
                                TransferFailed, WorkersOverloaded, WorkerUnavailable)
from tandem.wire.messages import (DecodePlan, FinishReason, FirstToken, FirstTokenReady, OutputError,
                                  PrefillReservation, PrefillResult, StepOutput, Usage)

BLOCK = 4
MODEL = SimpleNamespace(vocab_size=100, max_position_embeddings=256, num_layers=2)


class _Ref:
    """What a Ray actor call returns: awaitable, and `.future()` for a concurrent wait."""

    def __init__(self, value):
        self.value = value

    def __await__(self):
        async def answer():
            await asyncio.sleep(0)
            if isinstance(self.value, BaseException):
                raise self.value
            return self.value
        return answer().__await__()

    def future(self):
        f = concurrent.futures.Future()
        f.set_result(None)
        return f


class _Method:
    def __init__(self, actor, name):
        self.actor, self.name = actor, name

    def remote(self, *args, **kwargs):
        self.actor.calls.append((self.name, args, kwargs))
        return _Ref(getattr(self.actor, self.name)(*args, **kwargs))


class Handle:
    """An actor handle: `handle.method.remote(...)` calls the fake actor's method, logged in `calls`."""

    def __init__(self, actor):
        self._actor = actor

    def __getattr__(self, name):
        return _Method(self._actor, name)


class FakeActor:
    def __init__(self, worker_id: str):
        self.worker_id, self.calls = worker_id, []

    def called(self, name):
        return [c for c in self.calls if c[0] == name]


class FakeDecode(FakeActor):
    def __init__(self, worker_id, view, remote=False, failures=0):
        super().__init__(worker_id)
        self.view, self.remote_plan, self.failures = view, remote, failures   # handovers it fails

    def reserve(self, ask):
        self.ask = ask
        if not (self.remote_plan and ask.transfer_id):
            self._soon(StepOutput(ask.request_id, [11], "a"),
                       StepOutput(ask.request_id, [12], "b", FinishReason.LENGTH, Usage(completion_tokens=2)))
            return DecodePlan(remote=False, cached_tokens=0)
        n = len(ask.prompt_token_ids)
        return DecodePlan(remote=True, cached_tokens=0, first_block=0, dst_block_ids=list(range(-(-n // BLOCK))),
                          num_tokens=n, expecting=ask.prefill_id)

    def first_token(self, request_id, first):
        if self.failures:
            self.failures -= 1
            self._soon(OutputError(request_id, "the step failed"))
        else:
            self._soon(StepOutput(request_id, [50], "z", FinishReason.LENGTH, Usage(completion_tokens=2)))
        return True

    def abort(self, request_id):
        return True

    def expect(self, spec):
        return None

    def _soon(self, *msgs):
        def put():
            for m in msgs:   # as the router's output pump does: an id nobody listens to is dropped
                if m.request_id in self.view.queues:
                    self.view.queues[m.request_id].put_nowait(m)
        asyncio.get_running_loop().call_soon(put)


class FakePrefill(FakeActor):
    def __init__(self, worker_id):
        super().__init__(worker_id)
        self.sampled = 40

    def reserve(self, ask):
        return PrefillReservation(cached_tokens=0, block_ids=list(range(-(-len(ask.prompt_token_ids) // BLOCK))))

    def start(self, spec):
        return PrefillResult(cached_tokens=0, computed_tokens=spec.num_tokens, first=None)

    def first_token(self, transfer_id):
        self.sampled += 1
        return FirstTokenReady(FirstToken(self.sampled, "p"), {"queue+compute": 0.01})

    def abort(self, transfer_id):
        return True


class FakeView:
    router_id = "router-test"

    def __init__(self):
        self.actors, self.stats = {}, {}
        self.inflight, self.queues = {}, {}

    def add(self, actor, pool, **stats):
        self.actors[actor.worker_id] = (actor, pool)
        self.stats[actor.worker_id] = stats

    def views(self, pool):
        return [WorkerView(wid, p, **self.stats[wid]) for wid, (_, p) in self.actors.items() if p == pool]

    def handle(self, wid):
        return Handle(self.actors[wid][0]) if wid in self.actors else None

    def actor(self, wid):
        return self.actors[wid][0]


class RecordingHub:
    def __init__(self):
        self.first_tokens, self.finished, self.migrations = [], [], []

    def record_first_token(self, s):
        self.first_tokens.append(s)

    def record_tokens(self, gap, n):
        pass

    def record_finished(self, **kw):
        self.finished.append(kw)

    def record_migration(self, reason):
        self.migrations.append(reason)

    def record_queue_time(self, s):
        pass


def make_router(view, **kw) -> Router:
    router = Router(view, tokenizer=None, model_config=MODEL, block_size=BLOCK, sessions=InMemorySessionStore(),
                    **kw)
    router.hub = RecordingHub()
    return router


def request(session_id="", max_tokens=4):
    return generation_pb2.GenerateRequest(prompt_token_ids=list(range(1, 17)), session_id=session_id,
                                          sampling=generation_pb2.SamplingParams(max_tokens=max_tokens))


async def run(router, req):
    return [r async for r in router.generate(req, None)]


def test_a_migration_that_prefills_remotely_again_records_ttft_once(caplog):
    """Defect: `first` started as a bool and was rebound to the prefill's first-token dict, so the
    second remote prefill's token was timed (and slow-logged) as a second first token."""
    view = FakeView()
    view.add(FakeDecode("d0", view, remote=True, failures=1), "decode")
    view.add(FakeDecode("d1", view, remote=True), "decode", running=1)   # d0 first, by load
    view.add(FakePrefill("p0"), "prefill")
    router = make_router(view, local_prefill_threshold=0)
    router.slow_ttft_s = 0.0            # every first token is "slow": each one is logged
    out = asyncio.run(run(router, request()))
    assert [list(r.token_ids) for r in out] == [[41], [42], [50]]
    assert router.hub.migrations == ["request_failed"]
    assert len(router.hub.first_tokens) == 1
    assert sum("slow first token" in r.getMessage() for r in caplog.records) == 1
    assert out[0].request_id and not out[1].request_id
    assert out[-1].finish_reason == generation_pb2.LENGTH and out[-1].usage.completion_tokens == 3


class CachingDecode(FakeDecode):
    """A decode actor that holds the prompt's first two blocks: the prefill actor must pull them."""

    def reserve(self, ask):
        plan = super().reserve(ask)
        if plan.remote:
            plan = DecodePlan(remote=True, cached_tokens=2 * BLOCK, first_block=2, dst_block_ids=[2, 3],
                              num_tokens=len(ask.prompt_token_ids), prefix_block_ids=[0, 1],
                              expecting=ask.prefill_id)
        return plan

    def send_prefix(self, spec):
        return None


class ExpiredPrefill(FakePrefill):
    """Its reservation is gone (expired or aborted) when the prefix pull is registered."""

    def expect_pull(self, spec, owner, covers_tokens):
        return NoReservation(owner)


def test_a_reservation_gone_before_its_prefix_pull_falls_back_to_local_prefill():
    view = FakeView()
    view.add(CachingDecode("d0", view, remote=True), "decode")
    view.add(ExpiredPrefill("p0"), "prefill")
    router = make_router(view, local_prefill_threshold=0)
    out = asyncio.run(run(router, request()))
    assert [list(r.token_ids) for r in out] == [[11], [12]]       # served by d0's own prefill
    assert view.actor("p0").called("expect_pull") and view.actor("p0").called("abort")
    assert len(view.actor("d0").called("reserve")) == 2           # remote plan, then the local one


class FailingPrefill(FakePrefill):
    """Its step fails: the transfer is aborted by the sender, the first token never comes."""

    def start(self, spec):
        return TransferFailed(f"KV transfer {spec.request_id} aborted by the sender")

    def first_token(self, transfer_id):
        return TransferFailed(f"KV transfer {transfer_id} aborted by the sender")


class LateErrorDecode(FakeDecode):
    """Reports its failed receive ("KV transfer aborted") late: after the router fell back to its
    local prefill, between the local prefill's tokens."""

    def reserve(self, ask):
        if ask.transfer_id:
            self.remote_id = ask.request_id
            return super().reserve(ask)
        self._soon(StepOutput(ask.request_id, [11], "a"), OutputError(self.remote_id, "KV transfer aborted"),
                   StepOutput(ask.request_id, [12], "b", FinishReason.LENGTH, Usage(completion_tokens=2)))
        return DecodePlan(remote=False, cached_tokens=0)


def test_an_error_for_the_remote_attempt_does_not_end_its_local_fallback():
    """Defect: the fallback reused the request's id on the decode actor, so the aborted transfer's
    late error moved the request again after its first local token, and the stream repeated it."""
    view = FakeView()
    view.add(LateErrorDecode("d0", view, remote=True), "decode")
    view.add(FailingPrefill("p0"), "prefill")
    router = make_router(view, local_prefill_threshold=0)
    out = asyncio.run(run(router, request()))
    assert [list(r.token_ids) for r in out] == [[11], [12]]
    assert router.hub.migrations == ["prefill_failed"]
    first, local = [c[1][0].request_id for c in view.actor("d0").called("reserve")]
    assert first != local and first.split("/")[0] == local.split("/")[0]
    assert first.startswith(out[0].request_id + "@")    # the cluster's id for the client's request


def test_an_overloaded_session_worker_is_left_for_another():
    """Defect: Router._pick never passed the overload limits, so a session stayed on its worker
    however overloaded it was."""
    view = FakeView()
    view.add(FakeDecode("d0", view), "decode", waiting=5)
    view.add(FakeDecode("d1", view), "decode", running=3)
    router = make_router(view, overload=OverloadLimits(max_waiting=4))
    asyncio.run(router.sessions.put("s", SessionState(decode_worker="d0", prefill_worker=None, num_tokens=8)))
    out = asyncio.run(run(router, request(session_id="s")))
    assert out[-1].finish_reason == generation_pb2.LENGTH
    assert view.actor("d1").called("reserve") and not view.actor("d0").called("reserve")


def test_every_worker_overloaded_is_resource_exhausted():
    view = FakeView()
    view.add(FakeDecode("d0", view), "decode", waiting=5)
    view.add(FakeDecode("d1", view), "decode", waiting=9)
    router = make_router(view, overload=OverloadLimits(max_waiting=4))
    with pytest.raises(WorkersOverloaded) as err:
        asyncio.run(run(router, request()))
    assert status_code(err.value) is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert not view.actor("d0").calls and not view.actor("d1").calls


def test_refusals_by_every_worker_come_with_spaced_retry_hints():
    """Every decode worker overloaded is a refusal of the whole router, as the limiter's are: the
    clients refused together get return times one start at the recent rate apart (the openai SDKs
    wait the hint exactly), the first the workers' own hint."""
    from tandem.router.admission import AdmissionConfig, AdmissionLimiter
    from tandem.wire.errors import WORKERS_RETRY_AFTER_S

    view = FakeView()
    view.add(FakeDecode("d0", view), "decode", waiting=5)
    router = make_router(view, overload=OverloadLimits(max_waiting=4))
    clock = SimpleNamespace(now=100.0)
    router.limiter = AdmissionLimiter(AdmissionConfig(min_start_samples=4), clock=lambda: clock.now)

    async def main():
        for _ in range(4):                  # 4 starts, one each 0.25 s of backlog: 4 a second
            adm = await router.limiter.acquire("warm")
            clock.now += 0.25
            router.limiter.started(adm)
            router.limiter.release(adm)
        hints = []
        for i in range(3):
            with pytest.raises(WorkersOverloaded) as err:
                [r async for r in router.admit_and_generate(request(), f"c{i}")]
            hints.append(err.value.retry_after_s)
        return hints

    hints = asyncio.run(main())
    assert hints == pytest.approx([WORKERS_RETRY_AFTER_S, WORKERS_RETRY_AFTER_S + 0.25, WORKERS_RETRY_AFTER_S + 0.5])
    assert router.limiter.running == 0 and router.limiter.waiting == 0    # the refused hold no slot


def test_without_limits_the_session_keeps_its_worker():
    view = FakeView()
    view.add(FakeDecode("d0", view), "decode", waiting=5)
    view.add(FakeDecode("d1", view), "decode")
    router = make_router(view)
    asyncio.run(router.sessions.put("s", SessionState(decode_worker="d0", prefill_worker=None, num_tokens=8)))
    asyncio.run(run(router, request(session_id="s")))
    assert view.actor("d0").called("reserve") and not view.actor("d1").called("reserve")


def test_per_request_speculation_reaches_the_decode_worker():
    view = FakeView()
    view.add(FakeDecode("d0", view), "decode")
    router = make_router(view)
    req = request()
    req.sampling.num_speculative_tokens = 0  # off for this request
    asyncio.run(run(router, req))
    assert view.actor("d0").ask.sampling.num_speculative_tokens == 0
    asyncio.run(run(router, request()))
    assert view.actor("d0").ask.sampling.num_speculative_tokens is None  # the worker's setting


@pytest.mark.parametrize("error, code", [
    (InvalidRequestError("bad"), grpc.StatusCode.INVALID_ARGUMENT),
    (Overloaded("full", 100), grpc.StatusCode.RESOURCE_EXHAUSTED),
    (WorkersOverloaded("all busy"), grpc.StatusCode.RESOURCE_EXHAUSTED),
    (NoWorkerReady("none"), grpc.StatusCode.UNAVAILABLE),
    (MigrationsExhausted("twice"), grpc.StatusCode.UNAVAILABLE),
    (WorkerUnavailable("draining"), grpc.StatusCode.UNAVAILABLE),
    (RuntimeError("a bug"), grpc.StatusCode.INTERNAL),
])
def test_each_error_type_has_one_status_code_at_the_edge(error, code):
    assert status_code(error) is code
