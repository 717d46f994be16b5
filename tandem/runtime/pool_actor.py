"""What every pool actor (prefill or decode) answers around its runtime object `self.worker`:
readiness with a description of itself (pid, node) for the controller, stats with the process's gc
and GIL numbers, drain, abort, shutdown. Threaded: health and control calls have threads of their
own (ACTOR_CONCURRENCY)."""

from __future__ import annotations

import dataclasses
import os
import socket

import ray

from tandem.runtime.process import gc_stats
from tandem.wire.stats import ProcessStats, WorkerInfo, WorkerStats


def describe(worker_id: str, pool: str, kv_blocks_total: int = 0) -> WorkerInfo:
    node = ""
    try:
        node = ray.get_runtime_context().get_node_id()
    except Exception:  # noqa: BLE001 - outside Ray
        pass
    return WorkerInfo(worker_id, pool, os.getpid(), node, socket.gethostname(), kv_blocks_total)


# Pool actors are threaded: each call holds a thread while it waits (a prefill's start until its
# KV is delivered, a reserve while a long step runs, an output long-poll), so under load hundreds
# can be waiting at once. Health and control calls have threads of their own: a pool full of
# waiting requests must not make the controller's health check time out and kill a busy actor
# (the two-GPU run lost its prefill actor that way at 8 sessions/s).
ACTOR_CONCURRENCY = {"max_concurrency": 256, "concurrency_groups": {"health": 4}}


class PoolActorBase:
    """What every pool actor answers, around its runtime object `self.worker`."""

    worker: object
    worker_id: str
    pool: str

    @ray.method(concurrency_group="health")
    def ready(self) -> WorkerInfo:
        return describe(self.worker_id, self.pool, self.worker.engine.allocator.num_blocks)

    def abort(self, request_id):
        return self.worker.abort(request_id)

    @ray.method(concurrency_group="health")
    def stats(self) -> WorkerStats:
        s = dataclasses.replace(self.worker.stats(), process=ProcessStats(**gc_stats()))
        error = self.worker.loop.error
        if error is not None and s.loop_error is None:  # the loop's last snapshot predates its stop
            s = dataclasses.replace(s, loop_error=repr(error)[:500])
        return s

    @ray.method(concurrency_group="health")
    def set_draining(self, draining: bool = True, move: bool = True):
        """Stop (or resume) taking new requests; `move`: hand running sequences to other decode
        workers with their KV (a worker with no decode part ignores it). The answer is the latest
        stats with the new state (the snapshot itself is taken by the engine loop between steps,
        so it may predate this)."""
        self.worker.drain(draining, move=move)
        return dataclasses.replace(self.worker.stats(), draining=draining)

    def shutdown(self):
        self.worker.shutdown()

    def inject_step_failure(self, token_id: int | None = None, times: int = 1) -> None:
        """Chaos testing: the next `times` engine steps that hold a request whose prompt contains
        `token_id` (any step if None) raise. Reachable only through Ray, like ray.kill."""
        self.worker.loop.run(self.worker.loop.inject_step_failure, token_id, times)
