"""tandem.client without a server: it loads nothing heavy, builds requests field by field, and maps
each gRPC status to its exception (RESOURCE_EXHAUSTED with the router's retry hint)."""

from __future__ import annotations

import subprocess
import sys

import grpc
import pytest

from tandem.client import errors
from tandem.client.types import build_request


def test_importing_the_client_loads_neither_torch_ray_nor_the_router():
    code = ("import sys, tandem.client; "
            "print(sorted(m for m in ('torch', 'ray', 'tandem.router', 'tandem.engine') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_build_request_sets_only_what_was_given():
    req = build_request(messages=[{"role": "user", "content": "hi"}], session_id="s", max_tokens=5, logprobs=0,
                        tools=[{"name": "f", "description": "d", "parameters": "{}"}])
    assert req.session_id == "s" and req.sampling.max_tokens == 5 and req.sampling.HasField("logprobs")
    assert not req.sampling.HasField("seed") and not req.HasField("prompt") and req.tools[0].name == "f"
    assert not build_request(prompt="x").sampling.HasField("logprobs")


class FakeRpcError(grpc.RpcError):
    def __init__(self, code, details, trailing=()):
        self._code, self._details, self._trailing = code, details, trailing

    def code(self):
        return self._code

    def details(self):
        return self._details

    def trailing_metadata(self):
        return self._trailing


@pytest.mark.parametrize("code, cls", [
    (grpc.StatusCode.INVALID_ARGUMENT, errors.InvalidRequest), (grpc.StatusCode.UNAUTHENTICATED, errors.Unauthenticated),
    (grpc.StatusCode.UNAVAILABLE, errors.Unavailable), (grpc.StatusCode.DEADLINE_EXCEEDED, errors.DeadlineExceeded),
    (grpc.StatusCode.NOT_FOUND, errors.NotFound), (grpc.StatusCode.CANCELLED, errors.Cancelled),
    (grpc.StatusCode.INTERNAL, errors.InternalError), (grpc.StatusCode.DATA_LOSS, errors.InternalError)])
def test_each_status_maps_to_its_class(code, cls):
    e = errors.error_from_rpc(FakeRpcError(code, "why"))
    assert type(e) is cls and e.details == "why" and e.code == code and isinstance(e, errors.TandemError)


def test_overloaded_carries_the_retry_hint():
    e = errors.error_from_rpc(FakeRpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, "busy", (("retry-after-ms", "1500"),)))
    assert isinstance(e, errors.Overloaded) and e.retry_after_s == 1.5
    assert errors.error_from_rpc(FakeRpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, "busy")).retry_after_s is None


def test_retry_delay_waits_the_hint_backs_off_without_one_and_never_retries_a_bad_request():
    import random

    rng = random.Random(0)
    assert errors.retry_delay(errors.Overloaded("full", 0.25), 0, rng) == 0.25
    assert errors.retry_delay(errors.Overloaded("full", 0.25), 5, rng) == 0.25       # the hint, every attempt
    assert errors.retry_delay(errors.Overloaded("full", errors.MAX_RETRY_WAIT_S + 1), 0, rng) is None
    first = [errors.retry_delay(errors.Unavailable("no worker"), 0, rng) for _ in range(50)]
    assert all(0.375 <= d <= 0.5 for d in first) and len(set(first)) > 1            # jittered
    assert 0.375 * 4 <= errors.retry_delay(errors.Overloaded("full"), 2, rng) <= 0.5 * 4
    assert 6.0 <= errors.retry_delay(errors.Unavailable("x"), 10, rng) <= 8.0          # capped
    for e in (errors.InvalidRequest("bad"), errors.DeadlineExceeded("late"), errors.InternalError("boom"),
              errors.Unauthenticated("who")):
        assert errors.retry_delay(e, 0, rng) is None


def test_max_retries_must_not_be_negative():
    from tandem.client import AsyncClient, Client

    with pytest.raises(ValueError, match="max_retries"):
        Client("127.0.0.1:1", max_retries=-1)
    with pytest.raises(ValueError, match="max_retries"):
        AsyncClient("127.0.0.1:1", max_retries=-1)
