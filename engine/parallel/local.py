"""Tensor-parallel ranks as local processes (spawned, one per rank beyond 0), for `tandem generate`
and tests; pool workers start theirs as Ray actors instead (workers/). Rank 0 stays in the caller.
"""

from __future__ import annotations

import multiprocessing as mp
import socket

from tandem.engine.config import EngineConfig
from tandem.engine.engine import LLMEngine
from tandem.engine.parallel.group import destroy_tensor_parallel, init_tensor_parallel
from tandem.engine.parallel.shard import ShardWorker
from tandem.engine.parallel.sharding import check_shardable
from tandem.engine.weights import load_tokenizer


def free_init_method(host: str = "127.0.0.1") -> str:
    """A tcp:// rendezvous on a port free now, for rank 0 to listen on."""
    with socket.socket() as s:
        s.bind((host, 0))
        return f"tcp://{host}:{s.getsockname()[1]}"


def run_shard(configs: list[EngineConfig], rank: int, init_method: str, timeout_s: float = 600.0) -> None:
    """A shard rank's whole life: join the group, then serve each config's engine in turn (rank 0
    builds an engine per config, in the same order, and closes it before the next)."""
    group = init_tensor_parallel(rank, configs[0].tensor_parallel_size, init_method, configs[0].device, timeout_s)
    try:
        for config in configs:
            ShardWorker(config, group).serve()
    finally:
        destroy_tensor_parallel()


def spawn_shards(configs: list[EngineConfig], init_method: str, timeout_s: float = 600.0) -> list[mp.Process]:
    """Start ranks 1..N-1 (N = configs[0].tensor_parallel_size) serving `configs` in turn; the
    caller then joins as rank 0 (init_tensor_parallel(0, N, init_method)) and builds its engines."""
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=run_shard, args=(configs, r, init_method, timeout_s), daemon=True,
                         name=f"tandem-tp-rank{r}")
             for r in range(1, configs[0].tensor_parallel_size)]
    for p in procs:
        p.start()
    return procs


def start_local_engine(config: EngineConfig) -> LLMEngine:
    """An engine in this process; with tensor_parallel_size N > 1 it is rank 0, ranks 1..N-1 run
    as spawned processes (ended with this one). A model the ranks cannot split is refused before
    anything is spawned."""
    world = config.tensor_parallel_size
    if world > 1:
        check_shardable(load_tokenizer(config.model)[1], world, config.model)
        init = free_init_method()
        spawn_shards([config], init)
        init_tensor_parallel(0, world, init, config.device)
    return LLMEngine(config)
