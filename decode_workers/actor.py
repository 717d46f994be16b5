"""The decode pool's Ray actor: a thin shell around `DecodeWorker` (no policy lives here)."""

from __future__ import annotations

import ray

from tandem.runtime.pool_actor import ACTOR_CONCURRENCY, PoolActorBase
from tandem.runtime.process import after_startup, setup_process


@ray.remote(**ACTOR_CONCURRENCY)
class DecodeActor(PoolActorBase):
    pool = "decode"

    def __init__(self, worker_id: str, engine_config, local_prefill_threshold: float, rendezvous: str | None,
                 num_cpus: float = 1.0, transfer_config=None):
        setup_process(num_cpus)
        from tandem.decode_workers.worker import DecodeWorker

        self.worker_id = worker_id
        self.worker = DecodeWorker(worker_id, engine_config, local_prefill_threshold, rendezvous,
                                   transfer_config=transfer_config)
        after_startup()

    def reserve(self, request_id, router_id, prompt_token_ids, sampling, transfer_id=None, prefill_id=None):
        return self.worker.reserve(request_id, router_id, prompt_token_ids, sampling, transfer_id, prefill_id)

    def first_token(self, request_id, first):
        return self.worker.first_token(request_id, first)

    def expect(self, spec_msg):
        return self.worker.expect(spec_msg)

    def send_prefix(self, spec_msg):
        return self.worker.send_prefix(spec_msg)

    def get_outputs(self, router_id, timeout_s=1.0):
        return self.worker.get_outputs(router_id, timeout_s)
