"""The prefill pool's Ray actor: a thin shell around `PrefillWorker` (no policy lives here)."""

from __future__ import annotations

from typing import Any

import ray

from cluster.actor_common import describe, setup_process


@ray.remote(max_concurrency=64)
class PrefillActor:
    def __init__(self, worker_id: str, engine_config, rendezvous: str, num_cpus: float = 1.0):
        setup_process(num_cpus)
        from prefill_workers.worker import PrefillWorker

        self.worker_id = worker_id
        self.worker = PrefillWorker(worker_id, engine_config, rendezvous)

    def ready(self) -> dict[str, Any]:
        return {**describe(self.worker_id, "prefill"), "kv_blocks_total": self.worker.engine.allocator.num_blocks}

    def reserve(self, transfer_id, prompt_token_ids, first_block, peer_cached_tokens=0):
        return self.worker.reserve(transfer_id, prompt_token_ids, first_block, peer_cached_tokens)

    def expect_pull(self, spec_msg, covers_tokens):
        return self.worker.expect_pull(spec_msg, covers_tokens)

    def start(self, spec_msg):
        return self.worker.start(spec_msg)

    def abort(self, transfer_id):
        return self.worker.abort(transfer_id)

    def stats(self):
        return self.worker.stats()

    def set_draining(self, draining: bool = True):
        self.worker.draining = draining
        return self.worker.stats()

    def shutdown(self):
        self.worker.shutdown()
