"""Factories for tests of the controller's pools (cluster.pools) without Ray: fake members whose
readiness and health a test sets, a fake clock, and `make_pools(overrides)` that builds the pools
around them with one prefill and two decode workers by default."""

from __future__ import annotations

import dataclasses

from tandem.cluster.config import load_config
from tandem.cluster.members import Probe, ProbeResult
from tandem.cluster.pools import Pools
from tandem.wire.stats import WorkerInfo, WorkerStats

IDLE = WorkerStats("w", "decode", running=0, waiting=0, in_flight=0)
BUSY = WorkerStats("w", "decode", running=3, waiting=1, in_flight=0)


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t

    def advance(self, seconds: float) -> None:
        self.t += seconds


class FakeMember:
    """A worker whose answers the test sets: `ready` for check_ready, `health` for check_health
    (an answer to a stats call sent `answer_lag_s` before the check)."""

    def __init__(self, worker_id: str, pool: str) -> None:
        self.worker_id, self.pool = worker_id, pool
        self.ready = ProbeResult(Probe.OK, WorkerInfo(worker_id, pool, pid=1, kv_blocks_total=64))
        self.health = ProbeResult(Probe.OK, BUSY)
        self.draining = self.killed = self.shut_down = False
        self.stop_deadline: float | None = None
        self.answer_lag_s = 0.0
        self.role = pool

    def check_ready(self) -> ProbeResult:
        return self.ready

    def check_health(self, now: float) -> ProbeResult:
        if self.health.value is None:
            return self.health
        return dataclasses.replace(self.health, sent_at=now - self.answer_lag_s)

    def drain(self, move: bool = True) -> None:
        self.draining, self.move = True, move

    def move_out(self, count: int | None) -> int:
        self.moved = count
        return 2 if count is None else min(2, count)

    def set_role(self, role: str) -> None:
        self.role = role

    def begin_stop(self, now: float, timeout_s: float) -> None:
        self.stop_deadline = now + timeout_s

    def check_stopped(self, now: float) -> bool:
        return self.shut_down or now >= self.stop_deadline

    def kill(self) -> None:
        self.killed = True


class FakeFleet:
    """start_member: every member it started, by worker id."""

    def __init__(self, ready: bool = True) -> None:
        self.members: dict[str, FakeMember] = {}
        self.ready = ready

    def __call__(self, pool: str, worker_id: str) -> FakeMember:
        m = FakeMember(worker_id, pool)
        if not self.ready:
            m.ready = ProbeResult.pending()
        self.members[worker_id] = m
        return m


def make_pools(overrides=None, ready=True, dead_after_failures=3):
    config = load_config(None, {"prefill.replicas": 1, "decode.replicas": 2, **(overrides or {})})
    fleet, clock = FakeFleet(ready), FakeClock()
    pools = Pools(config, fleet, clock, wall_clock=lambda: 1.7e9 + clock.t,
                  dead_after_failures=dead_after_failures)
    pools.reconcile()
    return pools, fleet, clock
