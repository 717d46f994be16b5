"""Pool workers as Ray actors behind the controller's `Member` checks (cluster.members):
`ActorStarter` starts a named actor `<namespace>:<worker id>` with its pool's Ray resources (routers
look it up by that name), and `ActorMember` owns its handle and answers every check without
waiting on it (ray.wait with a zero timeout). The only module of the controller that calls Ray on
a worker.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any

import ray

from tandem.cluster.config import ClusterConfig, PoolConfig
from tandem.cluster.members import Probe, ProbeResult
from tandem.wire.cluster import WORKER_NAME
from tandem.workers.actor import WorkerActor
from tandem.workers.tp_ranks import find_placement, rank_placement, release_placement

SET_ROLE_TIMEOUT_S = 5.0   # the actor answers set_role on its health threads, at once
MOVE_OUT_TIMEOUT_S = 30.0  # move_out runs on the worker's loop: after the step in flight
log = logging.getLogger(__name__)


class ActorMember:
    """One pool worker's Ray actor behind non-blocking checks (see the module docstring)."""

    def __init__(self, worker_id: str, pool: str, handle: Any, health_timeout_s: float, placement: Any = None) -> None:
        self.worker_id, self.pool, self.handle = worker_id, pool, handle
        self.health_timeout_s = health_timeout_s
        self.placement = placement  # a tensor-parallel worker's placement group (its ranks' bundles)
        self._ready_ref = handle.ready.remote()
        self._stats_ref: Any = None
        self._stats_sent_at = 0.0
        self._stop_ref: Any = None
        self._stop_deadline = 0.0

    def check_ready(self) -> ProbeResult:
        done, _ = ray.wait([self._ready_ref], timeout=0)
        if not done:
            return ProbeResult.pending()
        try:
            return ProbeResult(Probe.OK, ray.get(self._ready_ref))
        except Exception as e:  # noqa: BLE001 - the actor failed to start
            return ProbeResult(Probe.FAILED, error=e, dead=True)

    def check_health(self, now: float) -> ProbeResult:
        if self._stats_ref is None:
            self._stats_ref, self._stats_sent_at = self.handle.stats.remote(), now
            return ProbeResult.pending()
        done, _ = ray.wait([self._stats_ref], timeout=0)
        if not done:
            if now - self._stats_sent_at < self.health_timeout_s:
                return ProbeResult.pending()
            self._stats_ref = None
            return ProbeResult(Probe.FAILED, error=TimeoutError(
                f"stats() unanswered after {self.health_timeout_s:g} s"))
        ref, self._stats_ref = self._stats_ref, None
        try:
            stats = ray.get(ref)
        except ray.exceptions.RayActorError as e:
            return ProbeResult(Probe.FAILED, error=e, dead=True)
        except Exception as e:  # noqa: BLE001 - a missed health check
            return ProbeResult(Probe.FAILED, error=e)
        if stats.loop_error:     # its engine loop stopped for good: no later check can pass
            return ProbeResult(Probe.FAILED, stats, error=RuntimeError(f"engine loop stopped: {stats.loop_error}"),
                               dead=True, sent_at=self._stats_sent_at)
        return ProbeResult(Probe.OK, stats, sent_at=self._stats_sent_at)

    def drain(self, move: bool = True) -> None:
        try:
            self.handle.set_draining.remote(True, move=move)
        except Exception:  # noqa: BLE001 - a dead actor's checks will say so
            pass

    def move_out(self, count: int | None) -> int:
        """Pause up to `count` running sequences (None: all) for their routers to move them."""
        return ray.get(self.handle.move_out.remote(count=count), timeout=MOVE_OUT_TIMEOUT_S)

    def set_role(self, role: str) -> None:
        ray.get(self.handle.set_role.remote(role), timeout=SET_ROLE_TIMEOUT_S)

    def begin_stop(self, now: float, timeout_s: float) -> None:
        if self._stop_ref is None:
            self._stop_ref, self._stop_deadline = self.handle.shutdown.remote(), now + timeout_s

    def check_stopped(self, now: float) -> bool:
        if self._stop_ref is None:
            return True
        done, _ = ray.wait([self._stop_ref], timeout=0)
        return bool(done) or now >= self._stop_deadline

    def kill(self) -> None:
        try:
            ray.kill(self.handle)
        except Exception:  # noqa: BLE001 - already gone
            pass
        release_placement(self.placement)  # its other ranks go with it


def actor_options(pool: PoolConfig, name: str, namespace: str, detached: bool = False) -> dict[str, Any]:
    opts: dict[str, Any] = {"name": name, "namespace": namespace, "num_cpus": pool.num_cpus,
                            "num_gpus": pool.num_gpus}
    if detached:    # outlives the controller: a restarted one adopts it (`adopt`)
        opts["lifetime"] = "detached"
    if pool.resource_name:
        opts["resources"] = {pool.resource_name: 1}
    return opts


class ActorStarter:
    """Starts pool workers as named Ray actors `<namespace>:<worker id>` (routers look them up by
    that name); the controller calls it with a pool and a fresh worker id."""

    def __init__(self, config: ClusterConfig, namespace: str, rendezvous: str, health_timeout_s: float,
                 detached: bool = False):
        """`detached`: the workers outlive the controller (a detached controller's, which Ray
        restarts: the restarted one adopts them, `adopt`)."""
        self.config, self.namespace, self.rendezvous = config, namespace, rendezvous
        self.health_timeout_s = health_timeout_s
        self.detached = detached

    def __call__(self, pool: str, worker_id: str) -> ActorMember:
        pcfg = getattr(self.config, pool)
        opts = actor_options(pcfg, f"{self.namespace}:{worker_id}", self.namespace, self.detached)
        engine_cfg = self.config.engine_for(pool)
        if pcfg.num_gpus > 0 and engine_cfg.device == "cpu":
            engine_cfg = replace(engine_cfg, device="cuda")
        opts, placement = rank_placement(opts, engine_cfg.tensor_parallel_size)  # one bundle per rank
        # every worker can prefill for others and decode (tandem.workers); its pool gives its first role
        handle = WorkerActor.options(**opts).remote(worker_id, pool, engine_cfg, self.rendezvous,
                                                    self.config.decode.local_prefill_threshold, pcfg.num_cpus,
                                                    self.config.kv_transfer, role=pcfg.role or None,
                                                    placement=placement,
                                                    latency_window_s=self.config.autoscaler.latency_window_s)
        return ActorMember(worker_id, pool, handle, self.health_timeout_s, placement)

    def adopt(self, timeout_s: float = 30.0) -> list[tuple[ActorMember, Any, Any]]:
        """The workers a previous controller of this namespace started that still answer, each
        pointed at this controller's rendezvous store: (member, its ready() info, its stats). One
        that does not answer within `timeout_s` is killed (nobody else would)."""
        found = []
        for entry in ray.util.list_named_actors(all_namespaces=True):
            name = entry["name"]
            m = WORKER_NAME.fullmatch(name)
            if entry.get("namespace") != self.namespace or m is None or m["ns"] != self.namespace:
                continue
            handle = ray.get_actor(name, namespace=self.namespace)
            placement = find_placement(name)   # a tensor-parallel worker's ranks: released with it
            try:
                ray.get(handle.set_rendezvous.remote(self.rendezvous), timeout=timeout_s)
                info, stats = ray.get([handle.ready.remote(), handle.stats.remote()], timeout=timeout_s)
            except Exception as e:  # noqa: BLE001 - gone or stuck: not adopted
                log.warning("not adopting %s: %s", name, e)
                ActorMember(m["wid"], m["pool"], handle, self.health_timeout_s, placement).kill()
                continue
            found.append((ActorMember(m["wid"], m["pool"], handle, self.health_timeout_s, placement), info, stats))
        return found

