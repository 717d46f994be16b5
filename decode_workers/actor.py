"""The decode pool's Ray actor: a thin shell around `DecodeWorker` (no policy lives here). It
builds the real engine and transport endpoint and hands them to the worker."""

from __future__ import annotations

import ray

from tandem.kv_transfer.config import KVTransferConfig
from tandem.runtime.pool_actor import ACTOR_CONCURRENCY, PoolActorBase
from tandem.runtime.process import after_startup, setup_process
from tandem.wire.messages import DecodePlan, DecodeReserve, FirstToken, Output


@ray.remote(**ACTOR_CONCURRENCY)
class DecodeActor(PoolActorBase):
    pool = "decode"

    def __init__(self, worker_id: str, engine_config, local_prefill_threshold: float, rendezvous: str | None,
                 num_cpus: float = 1.0, transfer_config=None):
        setup_process(num_cpus)
        # torch loads only now, after setup_process set CUDA_MODULE_LOADING for this process
        from tandem.decode_workers.worker import DecodeWorker, warm_up  # noqa: PLC0415
        from tandem.engine.engine import LLMEngine  # noqa: PLC0415
        from tandem.kv_transfer.torch_dist import DistConnector  # noqa: PLC0415

        self.worker_id = worker_id
        engine = LLMEngine(engine_config)
        warmup = warm_up(engine, worker_id)
        tcfg = transfer_config or KVTransferConfig(start_timeout_s=600.0)
        connector = (DistConnector(worker_id, rendezvous, engine.kv_cache.device, tcfg)
                     if rendezvous is not None else None)
        self.worker = DecodeWorker(worker_id, engine, connector, local_prefill_threshold=local_prefill_threshold,
                                   transfer_config=tcfg, warmup=warmup)
        after_startup()

    def reserve(self, req: DecodeReserve) -> DecodePlan:
        return self.worker.reserve(req)

    def first_token(self, *, request_id: str, first: FirstToken) -> bool:
        return self.worker.first_token(request_id, first)

    def expect(self, *, spec) -> None:
        return self.worker.expect(spec)

    def send_prefix(self, *, spec) -> None:
        return self.worker.send_prefix(spec)

    def get_outputs(self, *, router_id: str, timeout_s: float = 1.0) -> list[Output]:
        return self.worker.get_outputs(router_id, timeout_s)
