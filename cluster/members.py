"""What the controller needs of a pool worker (`Member`) and what its checks answer
(`ProbeResult`). Every check is a poll that never blocks (Ray Serve's ActorReplicaWrapper with its
non-blocking check_ready()/check_health() is the model): it sends a call when none is in flight and
reports what came back since. No Ray here: cluster.actor_members wraps the Ray actors, and the
controller's tests use a fake member.

- `check_ready()`: PENDING until the worker's readiness call answers; then OK with its description
  (pid, node, KV blocks), or FAILED with the error (the worker failed to start).
- `check_health(now)`: OK with the worker's stats from the latest answered stats call (and
  `sent_at`, when that call went out: an answer may predate what the controller did since);
  FAILED when the call raised, the worker reports a loop error, or no answer came within the
  health timeout; PENDING while the call is in flight. `dead` is True when the worker itself is
  gone (no further checks needed).
- `set_role(role)` tells the worker what to serve ("prefill" | "decode" | "mixed") and returns once
  it applied it (the one call that waits: milliseconds, bounded by a timeout); raises if it could not.
- `drain()` tells the worker to take no new requests; `begin_stop(now, timeout_s)` asks it to
  shut down, and `check_stopped(now)` is True once it did or `timeout_s` passed; `kill()` ends it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Protocol

from tandem.wire.stats import WorkerInfo, WorkerStats


class Probe(enum.Enum):
    PENDING = "pending"
    OK = "ok"
    FAILED = "failed"


@dataclass(frozen=True)
class ProbeResult:
    status: Probe
    value: WorkerInfo | WorkerStats | None = None  # OK: ready()'s WorkerInfo, or stats()'s WorkerStats
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
    def drain(self, move: bool = True) -> None: ...
    def move_out(self, count: int | None) -> int: ...
    def set_role(self, role: str) -> None: ...
    def begin_stop(self, now: float, timeout_s: float) -> None: ...
    def check_stopped(self, now: float) -> bool: ...
    def kill(self) -> None: ...
