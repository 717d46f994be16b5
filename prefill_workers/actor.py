"""The prefill pool's Ray actor: a thin shell around `PrefillWorker` (no policy lives here). It
builds the real engine and transport endpoint and hands them to the worker."""

from __future__ import annotations

import ray

from tandem.kv_transfer.config import KVTransferConfig
from tandem.runtime.pool_actor import ACTOR_CONCURRENCY, PoolActorBase
from tandem.runtime.process import after_startup, setup_process
from tandem.wire.messages import FirstTokenReady, PrefillReservation, PrefillReserve, PrefillResult


@ray.remote(**ACTOR_CONCURRENCY)
class PrefillActor(PoolActorBase):
    pool = "prefill"

    def __init__(self, worker_id: str, engine_config, rendezvous: str, num_cpus: float = 1.0,
                 transfer_config=None):
        setup_process(num_cpus)
        # torch loads only now, after setup_process set CUDA_MODULE_LOADING for this process
        from tandem.engine.engine import LLMEngine  # noqa: PLC0415
        from tandem.kv_transfer.torch_dist import DistConnector  # noqa: PLC0415
        from tandem.prefill_workers.worker import PrefillWorker, warm_up  # noqa: PLC0415

        self.worker_id = worker_id
        engine = LLMEngine(engine_config)
        warmup = warm_up(engine, worker_id)
        tcfg = transfer_config or KVTransferConfig(start_timeout_s=600.0)
        self.worker = PrefillWorker(worker_id, engine, DistConnector(worker_id, rendezvous, engine.kv_cache.device, tcfg),
                                    transfer_config=tcfg, warmup=warmup)
        after_startup()

    def reserve(self, req: PrefillReserve) -> PrefillReservation:
        return self.worker.reserve(req)

    def expect_pull(self, *, spec, owner: str, covers_tokens: int) -> None:
        return self.worker.expect_pull(spec, owner, covers_tokens)

    def start(self, *, spec) -> PrefillResult:
        return self.worker.start(spec)

    def first_token(self, *, transfer_id: str) -> FirstTokenReady:
        return self.worker.first_token(transfer_id)
