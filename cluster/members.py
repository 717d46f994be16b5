"""The controller's handle on one pool worker: `ActorMember` owns the worker's Ray actor and
answers without blocking (Ray Serve's ActorReplicaWrapper is the model), so the controller's
bookkeeping never waits on an actor and runs in tests against a fake member without Ray.

Every check is a poll: it sends a call when none is in flight and reports what came back since.
- `check_ready()`: PENDING until the actor's `ready()` answers; then OK with its description
  (pid, node, KV blocks), or FAILED with the error (the actor failed to start).
- `check_health(now)`: OK with the worker's stats from the latest answered `stats()` call (and
  `sent_at`, when that call went out: an answer may predate what the controller did since);
  FAILED when the call raised, the worker reports a loop error, or no answer came within
  `health_timeout_s`; PENDING while the call is in flight. `dead` is True when the actor itself
  is gone (no further checks needed).
- `drain()` tells the worker to take no new requests; `begin_stop(now, timeout_s)` asks it to
  shut down, and `check_stopped(now)` is True once it did or `timeout_s` passed; `kill()` ends
  the actor.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace
from typing import Any, Protocol

import ray

from tandem.cluster.config import ClusterConfig, PoolConfig
from tandem.decode_workers.actor import DecodeActor
from tandem.prefill_workers.actor import PrefillActor
from tandem.wire.stats import WorkerStats


class Probe(enum.Enum):
    PENDING = "pending"
    OK = "ok"
    FAILED = "failed"


@dataclass(frozen=True)
class ProbeResult:
    status: Probe
    value: dict[str, Any] | WorkerStats | None = None  # OK: ready()'s description, or stats()'s WorkerStats
    error: BaseException | None = None  # FAILED: why
    dead: bool = False  # FAILED because the actor is gone: no later check can pass
    sent_at: float | None = None  # an answered stats() call: when it was sent (the caller's clock)

    @classmethod
    def pending(cls) -> "ProbeResult":
        return cls(Probe.PENDING)


class Member(Protocol):
    """What the controller needs of a worker; `ActorMember` and the tests' fake provide it."""

    worker_id: str
    pool: str

    def check_ready(self) -> ProbeResult: ...
    def check_health(self, now: float) -> ProbeResult: ...
    def drain(self) -> None: ...
    def begin_stop(self, now: float, timeout_s: float) -> None: ...
    def check_stopped(self, now: float) -> bool: ...
    def kill(self) -> None: ...


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
        if pool == "decode":
            handle = DecodeActor.options(**opts).remote(worker_id, engine_cfg, pcfg.local_prefill_threshold,
                                                        self.rendezvous, pcfg.num_cpus, self.config.kv_transfer)
        else:
            handle = PrefillActor.options(**opts).remote(worker_id, engine_cfg, self.rendezvous, pcfg.num_cpus,
                                                         self.config.kv_transfer)
        return ActorMember(worker_id, pool, handle, self.health_timeout_s)
