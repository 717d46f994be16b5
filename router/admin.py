"""`tandem.v1.Admin` and the cluster's state for operators: the Admin service (cluster state, pool
bounds, draining a worker, a worker's role) in protobuf terms, and the workers' stats published to the metrics hub
each time the router refreshes its view of the cluster."""

from __future__ import annotations

import logging

import ray

from tandem.protos.tandem.v1 import admin_pb2, admin_pb2_grpc
from tandem.router.status_codes import OWN_MESSAGES, client_message, status_code
from tandem.runtime.metrics import WorkerMetricsSnapshot
from tandem.wire.cluster import ClusterState

log = logging.getLogger(__name__)


class AdminService(admin_pb2_grpc.AdminServicer):
    def __init__(self, controller):
        self.controller = controller

    async def GetClusterState(self, request, context):
        return cluster_state_proto(await self._ask(context, self.controller.cluster_state.remote()))

    async def SetPoolBounds(self, request, context):
        target = request.target if request.HasField("target") else None
        await self._ask(context, self.controller.set_pool_bounds.remote(request.pool, request.min, request.max, target))
        state = cluster_state_proto(await self._ask(context, self.controller.cluster_state.remote()))
        return next(p for p in state.pools if p.name == request.pool)

    async def DrainWorker(self, request, context):
        r = await self._ask(context, self.controller.drain_worker.remote(request.worker_id,
                                                                        move=not request.finish_in_place))
        return admin_pb2.Worker(id=r.worker_id, pool=r.pool, state=_WORKER_STATE[r.state], role=r.role)

    async def MoveSequences(self, request, context):
        n = await self._ask(context, self.controller.move_sequences.remote(request.worker_id, request.count or None))
        return admin_pb2.MoveSequencesResponse(paused=n)

    async def SetWorkerRole(self, request, context):
        r = await self._ask(context, self.controller.set_role.remote(request.worker_id, request.role, request.reason))
        return admin_pb2.Worker(id=r.worker_id, pool=r.pool, state=_WORKER_STATE[r.state], role=r.role)

    @staticmethod
    async def _ask(context, call):
        """The controller's answer; its refusal (or its loss) leaves as the error's status code,
        with the controller's own message rather than Ray's traceback."""
        try:
            return await call
        except Exception as e:  # noqa: BLE001 - every failure leaves as a status, never UNKNOWN
            if not isinstance(e.cause if isinstance(e, ray.exceptions.RayTaskError) else e, OWN_MESSAGES):
                log.warning("admin call failed: %s", e)
            await context.abort(status_code(e), client_message(e))


# the worker's stats fields that `Worker` carries under the same names
_MOVE_COUNTERS = ("sequences_migrated", "kv_tokens_migrated", "sequences_migrated_in", "pressure_moves",
                  "tokens_recomputed", "kv_tokens_precopied", "move_precopy_seconds", "move_tail_seconds",
                  "migrations_resumed")
_WORKER_STATE = {"starting": admin_pb2.WORKER_STATE_STARTING, "ready": admin_pb2.WORKER_STATE_READY,
                 "draining": admin_pb2.WORKER_STATE_DRAINING, "dead": admin_pb2.WORKER_STATE_DEAD}


def cluster_state_proto(state: ClusterState) -> admin_pb2.ClusterState:
    out = admin_pb2.ClusterState()
    totals = out.totals
    for name, p in state.pools.items():
        pool = out.pools.add(name=name, size=p.size, target=p.target, min=p.min, max=p.max,
                             draining=p.draining, target_pinned=p.target_pinned)
        for w in state.workers:
            if w.pool != name:
                continue
            s = w.load()
            pool.workers.add(id=w.worker_id, pool=name, pid=w.pid, node=w.node, host=w.host,
                             state=_WORKER_STATE[w.state], running_requests=s.running,
                             waiting_requests=s.waiting, kv_blocks_used=s.kv_blocks_used,
                             kv_blocks_total=s.kv_blocks_total, role=w.role or w.pool,
                             **{k: getattr(s, k) for k in _MOVE_COUNTERS})
            totals.workers += 1
            totals.running_requests += s.running
            totals.waiting_requests += s.waiting
            totals.kv_blocks_used += s.kv_blocks_used
            totals.kv_blocks_total += s.kv_blocks_total
    d = state.last_decision
    if d is not None:
        out.last_decision.CopyFrom(admin_pb2.AutoscalerDecision(
            at_unix_s=d.at_unix_s, prefill_target=d.prefill_target, decode_target=d.decode_target,
            reasons=list(d.reasons)))
    for c in state.role_changes:
        out.role_changes.add(at_unix_s=c.at_unix_s, worker_id=c.worker_id, pool=c.pool, from_role=c.from_role,
                             to_role=c.to_role, reason=c.reason, took_s=c.took_s)
    return out


def publish_cluster_metrics(hub, state: ClusterState) -> None:
    hub.update_from_workers([WorkerMetricsSnapshot.from_worker_stats(w) for w in state.workers if w.stats is not None])
    for name, p in state.pools.items():
        roles: dict[str, int] = {}
        for w in state.workers:
            if w.pool == name and w.state in ("ready", "draining"):
                roles[w.role or w.pool] = roles.get(w.role or w.pool, 0) + 1
        hub.set_pool(name, p.size, p.target, roles)

