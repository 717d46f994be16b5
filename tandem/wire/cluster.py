"""What the controller answers its callers (the routers' cluster views, the Admin service, the CLI,
tests) across Ray: the cluster's state (each pool's size, target and bounds; each worker's
membership state, role and latest stats; the autoscaler's last decision; the latest role
changes), one worker after a drain or a role change, one pool after new bounds, and the decision
and role-change logs. Frozen dataclasses, read by attribute."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from tandem.wire.stats import WorkerStats

# a pool worker's Ray actor name, "<namespace>:<worker id>" (worker ids are "<pool>-<n>")
WORKER_NAME = re.compile(r"(?P<ns>.+):(?P<wid>(?P<pool>prefill|decode)-\d+)")


@dataclass(frozen=True)
class WorkerEntry:
    """One member of a pool as the controller knows it."""
    worker_id: str
    pool: str                          # "prefill" | "decode"
    state: str                         # "starting" | "ready" | "draining" | "dead"
    actor_name: str = ""               # "<namespace>:<worker id>", for ray.get_actor
    pid: int = 0                       # from the worker's readiness answer; 0 until it is ready
    node: str = ""
    host: str = ""
    error: str | None = None           # why it failed to start
    stats: WorkerStats | None = None   # its latest stats; None until the first answer
    # what it serves now: "prefill" (prefills for other workers), "decode" (decodes, prefilling its
    # own short prompts), "mixed" (both). It starts as its pool's; the controller may lend it to the
    # other role (`set_role`) without a restart. "": its pool's.
    role: str = ""

    def serves(self, part: str) -> bool:
        """Whether new work of `part` ("prefill" | "decode") may go to it (its state aside)."""
        role = self.role or self.pool
        return role == part or role == "mixed"

    def load(self) -> WorkerStats:
        """Its latest stats, or all zeros while it has none."""
        return self.stats or WorkerStats(self.worker_id, self.pool)


@dataclass(frozen=True)
class PoolState:
    size: int                          # ready workers
    target: int
    min: int
    max: int
    draining: int = 0
    target_pinned: bool = False        # an operator pinned the target; the autoscaler leaves it


@dataclass(frozen=True)
class AutoscalerDecision:
    at_unix_s: float
    prefill_target: int
    decode_target: int
    reasons: tuple[str, ...] = ()
    prefill_size: int = 0              # the pools' ready sizes it decided from
    decode_size: int = 0


@dataclass(frozen=True)
class RoleChange:
    """One role change of one worker (`Controller.set_role`), for the role-change log."""
    at_unix_s: float
    worker_id: str
    pool: str
    from_role: str
    to_role: str
    reason: str = ""
    took_s: float = 0.0                # until the worker answered that it applied it


@dataclass(frozen=True)
class ClusterState:
    workers: tuple[WorkerEntry, ...] = ()
    pools: dict[str, PoolState] = field(default_factory=dict)
    last_decision: AutoscalerDecision | None = None
    rendezvous: str = ""               # host:port of the KV-transfer groups' store
    namespace: str = ""
    local_prefill_threshold: int = 0
    role_changes: tuple[RoleChange, ...] = ()   # the latest role changes, oldest first

    def worker(self, worker_id: str) -> WorkerEntry | None:
        return next((w for w in self.workers if w.worker_id == worker_id), None)
