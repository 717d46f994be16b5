"""`tandem drain-worker` (a pool pod's preStop hook): finds this host's workers, drains them
through the Admin API and waits until they are gone or the deadline passes. Pure waiting with a
fake clock; the command against a fake Admin service over real gRPC."""

from __future__ import annotations

import argparse
from concurrent import futures

import grpc
import pytest

from tandem.cluster import commands, lifecycle
from tandem.protos.tandem.v1 import admin_pb2, admin_pb2_grpc

READY, DRAINING, DEAD = admin_pb2.WORKER_STATE_READY, admin_pb2.WORKER_STATE_DRAINING, admin_pb2.WORKER_STATE_DEAD


def _state(*workers) -> admin_pb2.ClusterState:
    out = admin_pb2.ClusterState()
    pool = out.pools.add(name="decode")
    for wid, host, state, running in workers:
        pool.workers.add(id=wid, pool="decode", host=host, state=state, running_requests=running)
    return out


def test_select_by_host_or_id_skips_dead():
    s = _state(("d0", "pod-a", READY, 1), ("d1", "pod-b", READY, 0), ("d2", "pod-a", DEAD, 0))
    assert lifecycle.select_workers(s, host="pod-a") == ["d0"]
    assert lifecycle.select_workers(s, ids=["d1", "d2"]) == ["d1"]
    assert lifecycle.select_workers(s, host="") == []


class FakeClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t

    def sleep(self, s):
        self.t += s


def test_wait_until_gone():
    clock = FakeClock()
    states = iter([_state(("d0", "a", DRAINING, 2)), _state(("d0", "a", DRAINING, 1)), _state()])
    left = lifecycle.wait_drained(lambda: next(states), ["d0"], 60, 1.0, clock, clock.sleep)
    assert left == {} and clock.t == 2.0


def test_deadline_returns_what_is_left():
    clock = FakeClock()
    left = lifecycle.wait_drained(lambda: _state(("d0", "a", DRAINING, 3)), ["d0"], 5, 2.0, clock, clock.sleep)
    assert left == {"d0": 3} and clock.t == 5.0


def test_failed_poll_is_retried():
    clock = FakeClock()
    calls = []

    class Unavailable(grpc.RpcError):
        def code(self):
            return grpc.StatusCode.UNAVAILABLE

    def state():
        calls.append(1)
        if len(calls) == 1:
            raise Unavailable()
        return _state(("d0", "a", DEAD, 0))
    assert lifecycle.wait_drained(state, ["d0"], 10, 1.0, clock, clock.sleep, log=lambda m: None) == {}


class FakeAdmin(admin_pb2_grpc.AdminServicer):
    """Two workers on pod-a, one on pod-b; a drained worker is gone after two state reads."""

    def __init__(self):
        self.workers = {"p0": "pod-a", "d0": "pod-a", "d1": "pod-b"}
        self.drained: dict[str, int] = {}
        self.tokens = []
        self.stuck = False                     # True: drained workers never finish

    def GetClusterState(self, request, context):
        self.tokens.append(dict(context.invocation_metadata()).get("authorization"))
        for wid in self.drained:
            self.drained[wid] += 0 if self.stuck else 1
        live = [(w, h, DRAINING if w in self.drained else READY, 1) for w, h in self.workers.items()
                if self.drained.get(w, 0) < 3]
        return _state(*live)

    def DrainWorker(self, request, context):
        self.drained[request.worker_id] = 0
        return admin_pb2.Worker(id=request.worker_id, state=DRAINING)


@pytest.fixture
def admin():
    server = grpc.server(futures.ThreadPoolExecutor(4))
    fake = FakeAdmin()
    admin_pb2_grpc.add_AdminServicer_to_server(fake, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield fake, f"127.0.0.1:{port}"
    server.stop(0)


def _args(argv):
    parser = argparse.ArgumentParser()
    commands.register(parser.add_subparsers())
    return parser.parse_args(argv)


def test_drain_self_drains_this_pods_workers_and_waits(admin, monkeypatch):
    fake, target = admin
    monkeypatch.setattr(lifecycle.socket, "gethostname", lambda: "pod-a")
    monkeypatch.setenv("TANDEM_ADMIN_TOKEN", "admin-secret")
    args = _args(["drain-worker", "--self", "--target", target, "--deadline", "10", "--poll", "0.01"])
    assert args.func(args) == 0
    assert sorted(fake.drained) == ["d0", "p0"]          # pod-b's worker untouched
    assert fake.tokens[0] == "Bearer admin-secret"      # the Admin API takes only admin tokens


def test_drain_deadline_fails_the_hook(admin):
    fake, target = admin
    fake.stuck = True
    args = _args(["drain-worker", "d1", "--target", target, "--deadline", "0.05", "--poll", "0.01"])
    assert args.func(args) == 1


def test_drain_needs_a_selection():
    args = _args(["drain-worker"])
    assert args.func(args) == 2


def test_admin_state_carries_each_workers_host():
    """The router's ClusterState gives each worker's host (its pod's name), which --self matches."""
    from tandem.router.admin import cluster_state_proto
    from tandem.wire.cluster import ClusterState, PoolState, WorkerEntry

    state = ClusterState(workers=(WorkerEntry("d0", "decode", "ready", host="tandem-blue-decode-x7k2p"),),
                         pools={"decode": PoolState(1, 1, 0, 4)})
    proto = cluster_state_proto(state)
    assert proto.pools[0].workers[0].host == "tandem-blue-decode-x7k2p"
    assert lifecycle.select_workers(proto, host="tandem-blue-decode-x7k2p") == ["d0"]
