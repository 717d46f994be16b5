"""A pool's Ray actor: a thin shell around `PoolWorker` (no policy lives here), which serves the
prefill actor's API and the decode actor's on one engine. It builds the real engine and transport
endpoint and hands them to the worker; the pool it starts in gives its first role.

Two calls share a name across the two APIs: `reserve` takes a PrefillReserve or a DecodeReserve
(dispatched on the type), and `first_token` is the prefill side's (`transfer_id=`: wait for the
token) or the decode side's (`request_id=, first=`: hand it over). `abort` takes either side's id."""

from __future__ import annotations

import logging
import os

import ray

from tandem.kv_transfer.config import KVTransferConfig
from tandem.runtime.latency import DEFAULT_WINDOW_S
from tandem.runtime.pool_actor import ACTOR_CONCURRENCY, PoolActorBase
from tandem.runtime.process import after_startup, setup_process
from tandem.workers.tp_ranks import TPRanks
from tandem.wire.messages import DecodePlan, DecodeReserve, FirstToken, FirstTokenReady, Output, PrefillReservation, \
    PrefillReserve, PrefillResult

log = logging.getLogger(__name__)


@ray.remote(**ACTOR_CONCURRENCY)
class WorkerActor(PoolActorBase):
    def __init__(self, worker_id: str, pool: str, engine_config, rendezvous: str, local_prefill_threshold: float,
                 num_cpus: float = 1.0, transfer_config=None, role: str | None = None, placement=None,
                 latency_window_s: float = DEFAULT_WINDOW_S):
        """`placement`: a tensor-parallel worker's placement group (rank r in bundle r; this actor is rank 0).
        `latency_window_s`: the span its TTFT and TPOT percentiles cover (autoscaler.latency_window_s)."""
        setup_process(num_cpus)
        # torch loads only now, after setup_process set CUDA_MODULE_LOADING for this process
        from tandem.decode_workers.worker import warm_up  # noqa: PLC0415
        from tandem.engine.engine import LLMEngine  # noqa: PLC0415
        from tandem.kv_transfer.torch_dist import DistConnector  # noqa: PLC0415
        from tandem.kv_transfer.tp_ends import TPLayout  # noqa: PLC0415
        from tandem.workers.worker import PoolWorker  # noqa: PLC0415

        self.worker_id, self.pool = worker_id, pool
        tcfg = transfer_config or KVTransferConfig(start_timeout_s=600.0)
        tp = engine_config.tensor_parallel_size
        # tensor parallel: ranks 1..N-1 start first (each with its own KV transport); this engine
        # joins their group as rank 0
        self.ranks = (TPRanks(engine_config, placement, num_cpus, self._rank_lost, kv=(worker_id, rendezvous, tcfg))
                      if tp > 1 else None)
        engine = LLMEngine(engine_config)
        warmup = warm_up(engine, worker_id)   # the decode warm-up (graphs too): any worker may decode
        self.connector = DistConnector(worker_id, rendezvous, engine.kv_cache.device, tcfg, tp_size=tp)
        # KV moves by head to and from workers of other tensor-parallel sizes (kv_transfer.tp_ends);
        # a rank's model config holds its share of the KV heads
        layout = TPLayout(worker_id, 0, tp, engine.model_config.num_kv_heads * tp, self.connector.peer_tp)
        self.worker = PoolWorker(worker_id, pool, engine, self.connector, role=role,
                                 local_prefill_threshold=local_prefill_threshold, transfer_config=tcfg, warmup=warmup,
                                 tp_layout=layout, tp_ranks=self.ranks, latency_window_s=latency_window_s)
        after_startup()

    def _rank_lost(self, why: str) -> None:
        """Without one of its ranks the worker cannot step: it exits (no step hangs in a collective),
        the controller finds its actor dead and routers move its requests elsewhere."""
        log.error("%s: %s; the worker exits", self.worker_id, why)
        os._exit(1)

    @ray.method(concurrency_group="health")
    def rank_pids(self) -> list[int]:
        """Process ids of this worker's ranks, rank 0 (this actor) first."""
        return [os.getpid()] + (self.ranks.pids() if self.ranks is not None else [])

    def shutdown(self):
        if self.ranks is not None:
            self.ranks.closing = True
        super().shutdown()
        if self.ranks is not None:
            self.ranks.kill()

    @ray.method(concurrency_group="health")
    def set_role(self, role: str) -> str:
        """"prefill" | "decode" | "mixed", at once (no step waits); returns the role it had."""
        return self.worker.set_role(role)

    @ray.method(concurrency_group="health")
    def set_rendezvous(self, address: str) -> None:
        """A restarted controller adopts this worker: KV links meet through its store from now on."""
        self.connector.set_store(address)
        if self.ranks is not None:
            self.ranks.set_rendezvous(address)

    def reserve(self, req: PrefillReserve | DecodeReserve) -> PrefillReservation | DecodePlan:
        return self.worker.reserve(req)

    def first_token(self, *, transfer_id: str | None = None, request_id: str | None = None,
                    first: FirstToken | None = None) -> FirstTokenReady | bool:
        if transfer_id is not None:
            return self.worker.prefill.first_token(transfer_id)
        return self.worker.decode.first_token(request_id, first)

    # ---- the prefill side ------------------------------------------------------------------------
    def expect_pull(self, *, spec, owner: str, covers_tokens: int) -> None:
        return self.worker.prefill.expect_pull(spec, owner, covers_tokens)

    def start(self, *, spec) -> PrefillResult:
        return self.worker.prefill.start(spec)

    # ---- the decode side -------------------------------------------------------------------------
    def expect(self, *, spec) -> None:
        return self.worker.decode.expect(spec)

    def send_prefix(self, *, spec) -> None:
        return self.worker.decode.send_prefix(spec)

    def move_out(self, *, count: int | None = None) -> int:
        return self.worker.decode.move_out(count)

    def start_move(self, *, request_id: str, precopy, tail, first_block: int) -> None:
        return self.worker.decode.start_move(request_id, precopy, tail, first_block)

    def take_moved(self, *, request_id: str, prompt_token_ids: list[int], sampling, handoff) -> bool:
        return self.worker.decode.take_moved(request_id, prompt_token_ids, sampling, handoff)

    def resume(self, *, request_id: str) -> bool:
        return self.worker.decode.resume(request_id)

    def get_outputs(self, *, router_id: str, timeout_s: float = 1.0) -> list[Output]:
        return self.worker.decode.get_outputs(router_id, timeout_s)
