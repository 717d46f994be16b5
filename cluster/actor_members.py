"""Pool workers as Ray actors behind the controller's `Member` checks (cluster.members):
`ActorStarter` starts a named actor `<namespace>:<worker id>` with its pool's Ray resources (routers
look it up by that name), and `ActorMember` owns its handle and answers every check without
waiting on it (ray.wait with a zero timeout). The only module of the controller that calls Ray on
a worker.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import ray

from tandem.cluster.config import ClusterConfig, PoolConfig
from tandem.cluster.members import Probe, ProbeResult
from tandem.workers.actor import WorkerActor

SET_ROLE_TIMEOUT_S = 5.0   # the actor answers set_role on its health threads, at once


class ActorMember:
    """One pool worker's Ray actor behind non-blocking checks (see the module docstring)."""

    def __init__(self, worker_id: str, pool: str, handle: Any, health_timeout_s: float) -> None:
        self.worker_id, self.pool, self.handle = worker_id, pool, handle
        self.health_timeout_s = health_timeout_s
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
        if stats.loop_error:
            return ProbeResult(Probe.FAILED, stats, error=RuntimeError(stats.loop_error),
                               sent_at=self._stats_sent_at)
        return ProbeResult(Probe.OK, stats, sent_at=self._stats_sent_at)

    def drain(self) -> None:
        try:
            self.handle.set_draining.remote(True)
        except Exception:  # noqa: BLE001 - a dead actor's checks will say so
            pass

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


def actor_options(pool: PoolConfig, name: str, namespace: str) -> dict[str, Any]:
    opts: dict[str, Any] = {"name": name, "namespace": namespace, "num_cpus": pool.num_cpus,
                            "num_gpus": pool.num_gpus}
    if pool.resource_name:
        opts["resources"] = {pool.resource_name: 1}
    return opts


class ActorStarter:
    """Starts pool workers as named Ray actors `<namespace>:<worker id>` (routers look them up by
    that name); the controller calls it with a pool and a fresh worker id."""

    def __init__(self, config: ClusterConfig, namespace: str, rendezvous: str, health_timeout_s: float):
        self.config, self.namespace, self.rendezvous = config, namespace, rendezvous
        self.health_timeout_s = health_timeout_s

    def __call__(self, pool: str, worker_id: str) -> ActorMember:
        pcfg = getattr(self.config, pool)
        opts = actor_options(pcfg, f"{self.namespace}:{worker_id}", self.namespace)
        engine_cfg = self.config.engine
        if pcfg.num_gpus > 0 and engine_cfg.device == "cpu":
            engine_cfg = replace(engine_cfg, device="cuda")
        # every worker can prefill for others and decode (tandem.workers); its pool gives its first role
        handle = WorkerActor.options(**opts).remote(worker_id, pool, engine_cfg, self.rendezvous,
                                                    self.config.decode.local_prefill_threshold, pcfg.num_cpus,
                                                    self.config.kv_transfer, role=pcfg.role or None)
        return ActorMember(worker_id, pool, handle, self.health_timeout_s)
