"""What crosses between the ranks of a tensor-parallel worker, and the loop ranks 1..N-1 run.

Rank 0 owns the engine (scheduler, block manager, sampler, KV transfer). Once, at start-up, it
tells the other ranks how many KV blocks to allocate (`ShardHello`); then, for every step, its
runner's `before_execute` hook broadcasts the step's host inputs (token ids, positions, slots,
block tables: `_HostBatch`, a few KB) as vLLM's executor broadcasts a step's metadata. Every rank
then runs the same forward on its shard; the collectives inside the forward (the embedding's and
each row-parallel projection's all-reduce, the logits' all-gather) keep them in lock step. A
`None` message ends the loop.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tandem.engine.config import EngineConfig
from tandem.engine.kv_cache import KVCache
from tandem.engine.model_runner import BatchInputs, ModelRunner
from tandem.engine.parallel.group import TPGroup, current_group
from tandem.engine.parallel.loading import load_rank_model
from tandem.engine.weights import DTYPES

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ShardHello:
    num_blocks: int  # every rank's cache has as many blocks as rank 0's (same block ids)


class StepBroadcaster:
    """Rank 0's end: start-up, each step's inputs, and the stop."""

    def __init__(self, group: TPGroup, num_blocks: int):
        self.group = group
        self.steps = 0
        self.closed = False
        group.broadcast_object(ShardHello(num_blocks))

    def send_step(self, batch: BatchInputs) -> None:
        self.group.broadcast_object(batch.source)
        self.steps += 1

    def close(self) -> None:
        """The other ranks leave their loops (their processes stay: the caller ends them)."""
        if not self.closed:
            self.closed = True
            self.group.broadcast_object(None)


def start_shards(config: EngineConfig, runner: ModelRunner, num_blocks: int) -> StepBroadcaster | None:
    """On rank 0 of a tensor-parallel engine: tell the other ranks the cache size and hook the
    runner so each step's inputs reach them before its forward. None on a single rank."""
    if config.tensor_parallel_size == 1:
        return None
    shards = StepBroadcaster(current_group(config.tensor_parallel_size), num_blocks)
    runner.before_execute = shards.send_step
    return shards


class ShardWorker:
    """Rank r > 0 of a tensor-parallel worker: its shard of the model and of the KV cache."""

    def __init__(self, config: EngineConfig, group: TPGroup):
        self.group = group
        self.model, _, self.model_config = load_rank_model(config, group)
        hello: ShardHello = group.broadcast_object()
        shape = self.model.kv_cache_shape(hello.num_blocks, config.cache.block_size)
        self.kv_cache = KVCache(shape, DTYPES[config.dtype], config.device)
        self.runner = ModelRunner(self.model, self.kv_cache, config.device, cuda_graphs=False)
        self.steps = 0
        # after each step, with the steps run so far (this rank's KV transport starts the sends
        # that waited for the step: kv_transfer.rank_ends)
        self.after_step: Callable[[int], None] | None = None
        self.layer_done: Callable[[int], None] | None = None   # per layer written (the same transport)

    @torch.inference_mode()
    def serve(self) -> int:
        """Run rank 0's steps until it stops; -> steps run."""
        while (h := self.group.broadcast_object()) is not None:
            self.runner.execute(self.runner.prepare_host(h), layer_done=self.layer_done)
            self.steps += 1
            if self.after_step is not None:
                self.after_step(self.steps)
        log.info("tensor-parallel rank %d: stopped after %d steps", self.group.rank, self.steps)
        return self.steps
