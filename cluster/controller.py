"""The controller actor: the pools (cluster.pools: membership, health checks, targets and the
autoscaler), the rendezvous store for KV-transfer groups, and the loop that checks the pools every
`health_period_s`. It reaches workers only through `ActorMember`s (cluster.actor_members) and
never waits on one.

Workers are Ray actors named `<namespace>:<worker id>`; routers look them up by name and read
the membership and load from `cluster_state()`.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import replace

import ray

from tandem.cluster.config import ClusterConfig
from tandem.cluster.actor_members import ActorStarter
from tandem.cluster.pools import Pools
from tandem.kv_transfer.torch_dist import start_rendezvous_store
from tandem.wire.cluster import AutoscalerDecision, ClusterState, PoolState, RoleChange, WorkerEntry

log = logging.getLogger(__name__)


@ray.remote(num_cpus=0, max_concurrency=32)
class Controller:
    def __init__(self, config: ClusterConfig, namespace: str, health_period_s: float = 1.0,
                 dead_after_failures: int = 3, detached_pools: bool = False):
        """`detached_pools` (a detached controller, `tandem up --detached`): the workers outlive
        this actor, and when Ray restarts it after a crash it adopts the ones still serving
        (pointing them at its new rendezvous store) instead of starting new pools, so the
        streams on them never notice; the routers serve from their last view meanwhile."""
        self.config = config
        self.namespace = namespace
        self.health_period_s = health_period_s
        host = ray.util.get_node_ip_address()
        self._store, port = start_rendezvous_store(host=host)
        self.rendezvous = f"{host}:{port}"
        starter = ActorStarter(config, namespace, self.rendezvous, health_timeout_s=max(2.0, 2 * health_period_s),
                               detached=detached_pools)
        self.pools = Pools(config, starter, time.monotonic, time.time, dead_after_failures)
        self._stop = threading.Event()
        if detached_pools:
            adopted = starter.adopt()
            for member, info, stats in adopted:
                self.pools.adopt(member, info, stats)
            if adopted:
                log.warning("controller restarted: adopted %s", sorted(m.worker_id for m, _, _ in adopted))
        self.pools.reconcile()
        self._thread = threading.Thread(target=self._run, name="controller", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.health_period_s):
            try:
                self.pools.check()
                if self.pools.autoscale:
                    self.pools.maybe_autoscale()
                self.pools.maybe_roles()
            except Exception:  # noqa: BLE001 - keep checking
                log.exception("health check round failed")

    # ---- API (routers, Admin) -----------------------------------------------------------------
    def wait_ready(self, timeout_s: float = 300.0) -> ClusterState:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.pools.check()
            if self.pools.all_ready():
                return self.cluster_state()
            time.sleep(0.2)
        raise TimeoutError(f"pools not ready after {timeout_s:.0f} s: {self.cluster_state()}")

    def cluster_state(self) -> ClusterState:
        state = self.pools.state()
        workers = tuple(replace(w, actor_name=self._actor_name(w.worker_id)) for w in state.workers)
        return replace(state, workers=workers, rendezvous=self.rendezvous, namespace=self.namespace,
                       local_prefill_threshold=self.config.decode.local_prefill_threshold)

    def _actor_name(self, worker_id: str) -> str:
        return f"{self.namespace}:{worker_id}"

    def drain_worker(self, worker_id: str, move: bool = True) -> WorkerEntry:
        return replace(self.pools.drain_worker(worker_id, move), actor_name=self._actor_name(worker_id))

    def move_sequences(self, worker_id: str, count: int | None = None) -> int:
        """Move up to `count` (None: all) of a worker's running sequences elsewhere with their KV."""
        return self.pools.move_sequences(worker_id, count)

    def set_pool_bounds(self, pool: str, min_size: int, max_size: int, target: int | None = None) -> PoolState:
        return self.pools.set_bounds(pool, min_size, max_size, target)

    def decision_log(self) -> list[AutoscalerDecision]:
        return list(self.pools.decisions)

    def set_role(self, worker_id: str, role: str, reason: str = "") -> WorkerEntry:
        """Lend a worker to the other role, or back ("prefill" | "decode" | "mixed"), in place: it
        applies at once (new work of a dropped role goes elsewhere, work in flight finishes there);
        the change and `reason` go to the role-change log."""
        return replace(self.pools.set_role(worker_id, role, reason), actor_name=self._actor_name(worker_id))

    def role_log(self) -> list[RoleChange]:
        return list(self.pools.role_changes)

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Stop checking, ask every worker to shut down, and kill each once it did (or after
        `timeout_s`)."""
        self._stop.set()
        self.pools.stop_all(timeout_s)
        while not self.pools.all_stopped():
            time.sleep(0.05)
