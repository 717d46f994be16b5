"""The prefill pool's Ray actor: a thin shell around `PrefillWorker` (no policy lives here)."""

from __future__ import annotations

import ray

from tandem.runtime.pool_actor import ACTOR_CONCURRENCY, PoolActorBase
from tandem.runtime.process import after_startup, setup_process


@ray.remote(**ACTOR_CONCURRENCY)
class PrefillActor(PoolActorBase):
    pool = "prefill"

    def __init__(self, worker_id: str, engine_config, rendezvous: str, num_cpus: float = 1.0,
                 transfer_config=None):
        setup_process(num_cpus)
        from tandem.prefill_workers.worker import PrefillWorker

        self.worker_id = worker_id
        self.worker = PrefillWorker(worker_id, engine_config, rendezvous, transfer_config=transfer_config)
        after_startup()

    def reserve(self, transfer_id, prompt_token_ids, sampling=None):
        return self.worker.reserve(transfer_id, prompt_token_ids, sampling)

    def expect_pull(self, spec_msg, covers_tokens):
        return self.worker.expect_pull(spec_msg, covers_tokens)

    def start(self, spec_msg):
        return self.worker.start(spec_msg)

    def first_token(self, transfer_id):
        return self.worker.first_token(transfer_id)
