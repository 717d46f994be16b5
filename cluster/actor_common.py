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
