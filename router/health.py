"""The router's readiness: `tandem.v1.Generation` (and the overall "" service, which the OpenAI
edge's /health reads) is SERVING only while a request can be served end to end, NOT_SERVING
otherwise, and SERVING again when a worker returns. `tandem.v1.Admin` stays SERVING: it works with
no workers at all.

End to end means a ready worker that serves decode (`WorkerEntry.serves("decode")`), and a prompt
prefill: a ready worker that serves prefill, or the decode worker's own (local) prefill, which
every decode-serving worker can run (the router sends prompts there when no prefill worker is
ready). `readiness` is pure; `HealthFollower` applies it to the gRPC health servicer on each
cluster-view refresh, once per change. After `enter_graceful_shutdown` the servicer ignores it.
"""

from __future__ import annotations

import asyncio
import logging

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tandem.wire.cluster import WorkerEntry

log = logging.getLogger(__name__)

SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


def readiness(workers: list[WorkerEntry], reachable=lambda _wid: True) -> tuple[bool, str]:
    """(whether a request can be served end to end now, why not). `reachable(worker_id)`: the
    router can call it (it has the actor's handle)."""
    ready = [w for w in workers if w.state == "ready" and reachable(w.worker_id)]
    decoders = [w for w in ready if w.serves("decode")]
    if not decoders:
        return False, "no ready worker serves decode"
    prefill_remote = any(w.serves("prefill") for w in ready)
    # a decode-serving worker prefills locally whenever no prefill worker is ready
    return True, "decode ready, prefill " + ("remote or local" if prefill_remote else "local")


class HealthFollower:
    """Sets `services`' health from each cluster state, logging each change."""

    def __init__(self, servicer, services: tuple[str, ...], reachable=lambda _wid: True) -> None:
        self.servicer, self.services, self.reachable = servicer, services, reachable
        self.serving: bool | None = None
        self._tasks: set[asyncio.Task] = set()

    def follow(self, workers: list[WorkerEntry]) -> None:
        ok, why = readiness(workers, self.reachable)
        if ok == self.serving:
            return
        if self.serving is not None or not ok:
            log.log(logging.INFO if ok else logging.WARNING, "generation health: %s (%s)",
                    "SERVING" if ok else "NOT_SERVING", why)
        self.serving = ok
        task = asyncio.ensure_future(self._set(SERVING if ok else NOT_SERVING))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _set(self, status) -> None:
        for svc in self.services:
            await self.servicer.set(svc, status)


async def serve_health(servicer, host: str, port: int) -> tuple[grpc.aio.Server, int]:
    """A plaintext gRPC server with only `servicer` (grpc.health.v1: the statuses the router's own
    port reports, NOT_SERVING from the drain's start), on `router.health_port`, for probes that
    cannot speak TLS (the kubelet's); -> (server, bound port)."""
    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if not bound:
        raise OSError(f"router.health_port: cannot listen on {host}:{port}")
    await server.start()
    return server, bound
