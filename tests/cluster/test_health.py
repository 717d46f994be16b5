"""Health tells the truth (issue 27 item 2), on real Ray and real gRPC: `tandem.v1.Generation` is
NOT_SERVING while no worker can decode and SERVING again once one is back; the OpenAI edge's
/health follows it."""

from __future__ import annotations

import time
import urllib.error
import urllib.request

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tandem.protos.tandem.v1 import admin_pb2

# the tiny random model: the pool's actors start in a few seconds (the model is not what is tested)
MODEL = {"model.name": "tiny-random", "cache.num_blocks": 256}
GEN = "tandem.v1.Generation"
S = health_pb2.HealthCheckResponse


def _status(stub, svc: str) -> int:
    return stub.Check(health_pb2.HealthCheckRequest(service=svc), timeout=5).status


def _http_health(port: int) -> int:
    try:
        return urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5).status
    except urllib.error.HTTPError as e:
        return e.code


def _wait_for(stub, want: int, timeout_s: float) -> float:
    t0 = time.monotonic()
    while _status(stub, GEN) != want:
        assert time.monotonic() - t0 < timeout_s, f"{GEN} never became {S.ServingStatus.Name(want)}"
        time.sleep(0.2)
    return time.monotonic() - t0


def test_generation_health_follows_the_decode_pool(make_cluster):
    c = make_cluster({**MODEL, "prefill.replicas": 1, "decode.replicas": 1})
    health = health_pb2_grpc.HealthStub(grpc.insecure_channel(c.target))
    http_port = c.routers[0][1].http_port
    assert _status(health, GEN) == S.SERVING and _http_health(http_port) == 200

    c.admin.SetPoolBounds(admin_pb2.SetPoolBoundsRequest(pool="decode", min=0, max=0, target=0), timeout=10)
    _wait_for(health, S.NOT_SERVING, 60)
    assert _status(health, "") == S.NOT_SERVING and _http_health(http_port) == 503
    assert _status(health, "tandem.v1.Admin") == S.SERVING      # Admin works without workers

    c.admin.SetPoolBounds(admin_pb2.SetPoolBoundsRequest(pool="decode", min=1, max=1, target=1), timeout=10)
    _wait_for(health, S.SERVING, 180)
    assert _http_health(http_port) == 200
    ids, _, last = c.generate(prompt="Hello there", max_tokens=4)
    assert len(ids) == 4
