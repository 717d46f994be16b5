"""What every pool actor does at start: pin its torch threads to the CPUs Ray gave it, and
describe itself (pid, node) for the controller."""

from __future__ import annotations

import os
import socket


def setup_process(num_cpus: float) -> None:
    import torch

    torch.set_num_threads(max(1, int(num_cpus)))


def describe(worker_id: str, pool: str) -> dict:
    node = ""
    try:
        import ray

        node = ray.get_runtime_context().get_node_id()
    except Exception:  # noqa: BLE001 - outside Ray
        pass
    return {"worker_id": worker_id, "pool": pool, "pid": os.getpid(), "node": node, "host": socket.gethostname()}


class PoolActorBase:
    """What every pool actor answers, around its runtime object `self.worker`."""

    worker: object
    worker_id: str
    pool: str

    def ready(self) -> dict:
        return {**describe(self.worker_id, self.pool), "kv_blocks_total": self.worker.engine.allocator.num_blocks}

    def abort(self, request_id):
        return self.worker.abort(request_id)

    def stats(self):
        return self.worker.stats()

    def set_draining(self, draining: bool = True):
        self.worker.draining = draining
        return self.worker.stats()

    def shutdown(self):
        self.worker.shutdown()

    def inject_step_failure(self, token_id: int | None = None) -> None:
        """Chaos testing: the next engine step that holds a request whose prompt contains
        `token_id` (any step if None) raises, once. Reachable only through Ray, like ray.kill."""
        self.worker.loop.run(self.worker.loop.inject_step_failure, token_id)
