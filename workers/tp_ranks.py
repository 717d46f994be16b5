"""The ranks of a tensor-parallel pool worker, as Ray actors in one placement group.

The controller reserves one bundle per rank, packed on one node (`rank_placement`); the
`WorkerActor` runs in bundle 0 as rank 0 (its engine is the driver) and starts `ShardActor`s in
bundles 1..N-1 (`TPRanks`), which it owns: when the worker's actor dies, Ray ends them. The
other way round, a rank that dies or stops on its own makes the worker useless, so `TPRanks`
watches them and the worker exits (the controller sees a dead actor, routers move its requests:
the worker-lost path every pool actor has) rather than hanging in a collective.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, get_placement_group, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from tandem.runtime.process import setup_process

log = logging.getLogger(__name__)

_KV_CALL_TIMEOUT_S = 120.0   # a settle waits up to tp_ends.SETTLE_TIMEOUT_S (60 s) on the rank


def _bundle(num_cpus: float, num_gpus: float, resource_name: str = "") -> dict[str, float]:
    b = {"CPU": num_cpus, "GPU": num_gpus, **({resource_name: 1} if resource_name else {})}
    b = {k: v for k, v in b.items() if v > 0}
    return b or {"CPU": 0.001}  # Ray refuses an empty bundle


def rank_placement(opts: dict[str, Any], world: int) -> tuple[dict[str, Any], PlacementGroup | None]:
    """A worker actor's options (`actor_options`) for a worker of `world` ranks: one bundle per
    rank on one node (STRICT_PACK), rank 0 in bundle 0 with the pool's custom resource, detached
    when the actor is; -> (the options, the placement group; None for one rank)."""
    if world == 1:
        return opts, None
    res = opts.get("resources", {})
    name = next(iter(res), "")
    cpus, gpus = opts.get("num_cpus", 1.0), opts.get("num_gpus", 0.0)
    bundles = [_bundle(cpus, gpus, name)] + [_bundle(cpus, gpus) for _ in range(world - 1)]
    # named after the actor, so a controller that adopts the worker finds it (`find_placement`)
    pg = placement_group(bundles, strategy="STRICT_PACK", lifetime=opts.get("lifetime"),
                         name=placement_name(opts["name"]) if opts.get("name") else "")
    opts = {**opts, "num_cpus": bundles[0].get("CPU", 0), "num_gpus": gpus,
            "scheduling_strategy": PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=0)}
    return opts, pg


def placement_name(actor_name: str) -> str:
    return f"{actor_name}/ranks"


def find_placement(actor_name: str) -> PlacementGroup | None:
    """The placement group `rank_placement` made for the worker actor `actor_name` (None: a
    single-rank worker, or gone)."""
    try:
        return get_placement_group(placement_name(actor_name))
    except ValueError:
        return None


def release_placement(pg: PlacementGroup | None) -> None:
    if pg is not None:
        try:
            remove_placement_group(pg)
        except Exception:  # noqa: BLE001 - already gone
            pass


@ray.remote(max_concurrency=4)
class ShardActor:
    """Rank r > 0: joins the worker's group, loads its shard, runs rank 0's steps (`serve`), and
    moves its KV heads to and from other workers' ranks as rank 0 asks (`kv`)."""

    def __init__(self, rank: int, num_cpus: float):
        setup_process(num_cpus)
        self.rank = rank
        self.transport = None
        self._ready = threading.Event()

    def pid(self) -> int:
        return os.getpid()

    def serve(self, engine_config, init_method: str, kv: tuple | None = None) -> int:
        """`kv`: (worker id, rendezvous address, KVTransferConfig) for this rank's KV transport."""
        from tandem.engine.parallel.group import init_tensor_parallel  # noqa: PLC0415 (torch after setup_process)
        from tandem.engine.parallel.shard import ShardWorker  # noqa: PLC0415 (as above)

        group = init_tensor_parallel(self.rank, engine_config.tensor_parallel_size, init_method, engine_config.device)
        shard = ShardWorker(engine_config, group)
        try:
            if kv is not None:
                self.transport = _rank_transport(shard, self.rank, *kv)
                shard.after_step = self.transport.stepped
                shard.layer_done = self.transport.layer_written
        finally:
            self._ready.set()
        try:
            return shard.serve()
        finally:
            if self.transport is not None:
                self.transport.close()

    def kv(self, op: str, *args):
        """One call of this rank's KV transport (kv_transfer.rank_ends.RankTransport)."""
        if not self._ready.wait(600) or self.transport is None:
            raise RuntimeError(f"tensor-parallel rank {self.rank} has no KV transport")
        return self.transport.call(op, *args)

    def set_rendezvous(self, address: str) -> None:
        if self.transport is not None:
            self.transport.connector.set_store(address)


def _rank_transport(shard, rank: int, worker_id: str, rendezvous: str, transfer_config):
    from tandem.kv_transfer.rank_ends import RankTransport  # noqa: PLC0415 (torch after setup_process)
    from tandem.kv_transfer.reshard import rank_actor_id  # noqa: PLC0415 (as above)
    from tandem.kv_transfer.torch_dist import DistConnector  # noqa: PLC0415 (as above)
    from tandem.kv_transfer.tp_ends import TPLayout  # noqa: PLC0415 (as above)

    tp = shard.group.world_size
    connector = DistConnector(rank_actor_id(worker_id, rank), rendezvous, shard.kv_cache.device, transfer_config,
                              tp_size=tp)
    layout = TPLayout(worker_id, rank, tp, shard.model_config.num_kv_heads, connector.peer_tp)
    return RankTransport(shard.kv_cache, connector, transfer_config, layout)


class _Answer:
    def __init__(self, ref):
        self.ref = ref

    def ready(self) -> bool:
        return bool(ray.wait([self.ref], timeout=0)[0])

    def get(self):
        return ray.get(self.ref, timeout=_KV_CALL_TIMEOUT_S)


class TPRanks:
    """Rank 0's view of ranks 1..N-1: starts them, watches them, joins the group with them. From
    the start (a rank that fails to load must not leave rank 0 waiting in the rendezvous): if
    any rank's `serve` ends while this rank is not closing, the others are killed and `on_lost`
    gets why (the rank died, failed, or left its loop)."""

    def __init__(self, engine_config, placement: PlacementGroup | None, num_cpus: float,
                 on_lost: Callable[[str], None], kv: tuple | None = None):
        """`kv`: (worker id, rendezvous address, KVTransferConfig): each rank gets its own KV
        transport, which rank 0 drives (`call`) to move the rank's heads to and from other workers."""
        from tandem.engine.parallel.group import init_tensor_parallel  # noqa: PLC0415 (torch after setup_process)
        from tandem.engine.parallel.local import free_init_method  # noqa: PLC0415 (as above)

        world = engine_config.tensor_parallel_size
        init = free_init_method(ray.util.get_node_ip_address())
        gpus = 1 if engine_config.device.startswith("cuda") else 0
        self.actors = []
        for r in range(1, world):
            strategy = (PlacementGroupSchedulingStrategy(placement, placement_group_bundle_index=r)
                        if placement is not None else None)
            self.actors.append(ShardActor.options(num_cpus=0, num_gpus=gpus, scheduling_strategy=strategy).remote(r, num_cpus))
        self.serving = [a.serve.remote(engine_config, init, kv) for a in self.actors]
        self.closing = False
        threading.Thread(target=self._watch, args=(on_lost,), name="tp-rank-watch", daemon=True).start()
        init_tensor_parallel(0, world, init, engine_config.device)

    def _watch(self, on_lost: Callable[[str], None]) -> None:
        done, _ = ray.wait(self.serving, num_returns=1, timeout=None)
        if self.closing:
            return
        rank = 1 + self.serving.index(done[0])
        try:
            ray.get(done[0])
            why = f"tensor-parallel rank {rank} left its loop"
        except Exception as e:  # noqa: BLE001 - the reason, whatever it is
            why = f"tensor-parallel rank {rank} is lost: {type(e).__name__}: {e}"[:500]
        self.kill()
        on_lost(why)

    def call(self, rank: int, op: str, *args):
        """One call of rank `rank`'s KV transport (kv_transfer.tp_ends.RankEnds), waited for."""
        return ray.get(self.actors[rank - 1].kv.remote(op, *args), timeout=_KV_CALL_TIMEOUT_S)

    def post(self, rank: int, op: str, *args) -> None:
        """The same, not waited for (a failure shows when rank 0 settles the transfer)."""
        self.actors[rank - 1].kv.remote(op, *args)

    def ask(self, rank: int, op: str, *args, then: Callable[[], None] | None = None) -> "_Answer":
        """The same, answered later; `then` runs on a thread of its own once the answer is in."""
        ref = self.actors[rank - 1].kv.remote(op, *args)
        if then is not None:
            def wait() -> None:
                ray.wait([ref], timeout=_KV_CALL_TIMEOUT_S)
                then()
            threading.Thread(target=wait, name=f"tp-kv-answer-{rank}", daemon=True).start()
        return _Answer(ref)

    def set_rendezvous(self, address: str) -> None:
        ray.get([a.set_rendezvous.remote(address) for a in self.actors], timeout=_KV_CALL_TIMEOUT_S)

    def pids(self) -> list[int]:
        """Process ids of ranks 1..N-1."""
        return ray.get([a.pid.remote() for a in self.actors], timeout=30)

    def kill(self) -> None:
        self.closing = True
        for a in self.actors:
            try:
                ray.kill(a)
            except Exception:  # noqa: BLE001 - already gone
                pass
