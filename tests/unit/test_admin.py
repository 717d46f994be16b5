"""The Admin service (router/admin.py) through a real grpc.aio server and client, over the
controller's real pools (fake members, no Ray): its answers in protobuf terms, and each of the
controller's refusals reaching the client as the status code of the router's one table, with the
controller's message, also when it comes wrapped the way Ray re-raises an actor's error."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import traceback

import grpc
import pytest
import ray

from tandem.cluster.cli import main
from tandem.cluster.members import Probe, ProbeResult
from tandem.protos.tandem.v1 import admin_pb2, admin_pb2_grpc
from tandem.router.admin import AdminService
from tandem.router.status_codes import status_code
from tandem.wire.errors import InvalidPoolBounds, UnknownPool, UnknownWorker
from tests.unit.pool_factories import BUSY, make_pools


class _Method:
    """`controller.<method>.remote(...)`: awaitable; an error comes back as Ray re-raises it (a
    RayTaskError that is also an instance of the actor's error type)."""

    def __init__(self, fn):
        self.fn = fn

    async def remote(self, *args, **kw):
        try:
            return self.fn(*args, **kw)
        except Exception as e:
            tb = "".join(traceback.format_exception(e))
            raise ray.exceptions.RayTaskError(self.fn.__name__, tb, e, proctitle="controller", pid=1,
                                              ip="127.0.0.1").as_instanceof_cause() from None


class FakeController:
    """The controller's API over real Pools, minus Ray."""

    def __init__(self, pools) -> None:
        self.cluster_state = _Method(pools.state)
        self.drain_worker = _Method(pools.drain_worker)
        self.set_pool_bounds = _Method(pools.set_bounds)
        self.set_role = _Method(pools.set_role)
        self.move_sequences = _Method(pools.move_sequences)


def call_admin(method: str, request):
    """One Admin call through a real server; returns the answer or the grpc error."""
    pools, _, _ = make_pools()
    pools.check()
    return call_admin_on(pools, method, request)


def call_admin_on(pools, method: str, request):
    async def call(target: str):
        async with grpc.aio.insecure_channel(target) as ch:
            try:
                return await getattr(admin_pb2_grpc.AdminStub(ch), method)(request, timeout=5)
            except grpc.aio.AioRpcError as e:
                return e

    return serve_admin(pools, call)


def serve_admin(pools, client):
    """`await client("host:port")` against a real Admin server over `pools`; returns its answer."""
    async def run():
        server = grpc.aio.server()
        admin_pb2_grpc.add_AdminServicer_to_server(AdminService(FakeController(pools)), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            return await client(f"127.0.0.1:{port}")
        finally:
            await server.stop(None)

    return asyncio.run(run())


@pytest.mark.parametrize("error, code", [
    (UnknownWorker("unknown worker 'decode-9'"), grpc.StatusCode.NOT_FOUND),
    (UnknownPool("unknown pool 'embed'"), grpc.StatusCode.INVALID_ARGUMENT),
    (InvalidPoolBounds("bounds must satisfy 0 <= min <= max"), grpc.StatusCode.INVALID_ARGUMENT),
])
def test_each_controller_refusal_has_one_status_code_in_the_routers_table(error, code):
    assert status_code(error) is code
    wrapped = ray.exceptions.RayTaskError("m", "", error, proctitle="c", pid=1, ip="127.0.0.1").as_instanceof_cause()
    assert status_code(wrapped) is code                  # as Ray re-raises it in the router


@pytest.mark.parametrize("method, request_, code, needle", [
    ("DrainWorker", admin_pb2.DrainWorkerRequest(worker_id="decode-9"), grpc.StatusCode.NOT_FOUND,
     "unknown worker 'decode-9'"),
    ("SetPoolBounds", admin_pb2.SetPoolBoundsRequest(pool="embed", min=0, max=1), grpc.StatusCode.INVALID_ARGUMENT,
     "unknown pool 'embed'"),
    ("SetPoolBounds", admin_pb2.SetPoolBoundsRequest(pool="decode", min=3, max=1), grpc.StatusCode.INVALID_ARGUMENT,
     "bounds must satisfy 0 <= min <= max, got min=3 max=1"),
    ("SetWorkerRole", admin_pb2.SetWorkerRoleRequest(worker_id="decode-0", role="both"),
     grpc.StatusCode.INVALID_ARGUMENT, "unknown role 'both'"),
    ("MoveSequences", admin_pb2.MoveSequencesRequest(worker_id="decode-9"), grpc.StatusCode.NOT_FOUND,
     "unknown worker 'decode-9'"),
], ids=["unknown-worker", "unknown-pool", "bad-bounds", "bad-role", "move-unknown-worker"])
def test_each_controller_refusal_reaches_an_admin_client_as_its_status_code(method, request_, code, needle):
    err = call_admin(method, request_)
    assert isinstance(err, grpc.aio.AioRpcError), err
    assert err.code() == code
    assert err.details().startswith(needle) and "Traceback" not in err.details()   # the message, not Ray's


def test_admin_answers_read_the_controllers_typed_state():
    state = call_admin("GetClusterState", admin_pb2.GetClusterStateRequest())
    assert {p.name: (p.size, p.target, p.min, p.max) for p in state.pools} == {"prefill": (1, 1, 1, 1),
                                                                               "decode": (2, 2, 2, 2)}
    assert state.totals.workers == 3 and state.totals.running_requests == 3 * 3   # BUSY: 3 running each
    w = call_admin("DrainWorker", admin_pb2.DrainWorkerRequest(worker_id="decode-1"))
    assert (w.id, w.pool, w.state) == ("decode-1", "decode", admin_pb2.WORKER_STATE_DRAINING)
    p = call_admin("SetPoolBounds", admin_pb2.SetPoolBoundsRequest(pool="decode", min=1, max=4, target=3))
    assert (p.name, p.target, p.min, p.max, p.target_pinned) == ("decode", 3, 1, 4, True)


def test_a_role_change_through_admin_shows_in_the_workers_role_and_the_role_change_log():
    pools, _, _ = make_pools()
    pools.check()
    pools.set_role("prefill-0", "decode", "lent to decode")
    state = asyncio.run(AdminService(FakeController(pools)).GetClusterState(admin_pb2.GetClusterStateRequest(), None))
    roles = {w.id: w.role for p in state.pools for w in p.workers}
    assert roles == {"prefill-0": "decode", "decode-0": "decode", "decode-1": "decode"}
    [c] = state.role_changes
    assert (c.worker_id, c.pool, c.from_role, c.to_role, c.reason) == ("prefill-0", "prefill", "prefill", "decode",
                                                                        "lent to decode")
    w = call_admin("SetWorkerRole", admin_pb2.SetWorkerRoleRequest(worker_id="decode-1", role="mixed", reason="r"))
    assert (w.id, w.pool, w.role, w.state) == ("decode-1", "decode", "mixed", admin_pb2.WORKER_STATE_READY)


def test_move_sequences_and_drain_reach_the_worker_with_what_the_operator_asked():
    pools, fleet, _ = make_pools()
    pools.check()
    assert call_admin_on(pools, "MoveSequences", admin_pb2.MoveSequencesRequest(worker_id="decode-0", count=1)).paused == 1
    assert fleet.members["decode-0"].moved == 1
    assert call_admin_on(pools, "MoveSequences", admin_pb2.MoveSequencesRequest(worker_id="decode-0")).paused == 2
    assert fleet.members["decode-0"].moved is None                      # 0: all of them
    call_admin_on(pools, "DrainWorker", admin_pb2.DrainWorkerRequest(worker_id="decode-1", finish_in_place=True))
    assert fleet.members["decode-1"].draining and not fleet.members["decode-1"].move
    err = call_admin_on(pools, "MoveSequences", admin_pb2.MoveSequencesRequest(worker_id="decode-1"))
    assert err.code() == grpc.StatusCode.UNAVAILABLE          # not ready: nothing to move there


# distinct values, so a counter read into another's field shows
MOVES = {"sequences_migrated": 3, "kv_tokens_migrated": 300, "sequences_migrated_in": 4, "pressure_moves": 1,
         "tokens_recomputed": 7, "kv_tokens_precopied": 256, "move_precopy_seconds": 0.25,
         "move_tail_seconds": 0.0125, "migrations_resumed": 2}


def test_a_workers_move_counters_reach_tandem_status_json(capsys):
    """Each move counter in a worker's stats, through the controller's pools, the Admin service over
    gRPC and `tandem status --json`, under its own name (uint64s print as JSON strings)."""
    pools, fleet, _ = make_pools()
    fleet.members["decode-0"].health = ProbeResult(Probe.OK, dataclasses.replace(BUSY, **MOVES))
    pools.check()
    assert serve_admin(pools, lambda target: asyncio.to_thread(main, ["status", "--target", target, "--json"])) == 0
    listed = {w["id"]: w for p in json.loads(capsys.readouterr().out)["pools"] for w in p["workers"]}
    assert {k: type(v)(listed["decode-0"][k]) for k, v in MOVES.items()} == MOVES
    assert all(float(listed["decode-1"][k]) == 0 for k in MOVES)
