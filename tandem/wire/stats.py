"""A pool worker's stats snapshot, as its actor answers `stats()`: taken by the engine loop
between steps, read by the controller (health, draining, the autoscaler's inputs), by the routers
(load for placement) and by the metrics hub. One flat type for both pools: a field the other pool
does not keep stays at its default (a decode worker has no `in_flight` prefills, a prefill worker
no `tpot`), so readers treat every worker alike."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class Percentiles:
    """Of a recent window of samples, in seconds; None while the window is empty."""
    p50: float | None = None
    p90: float | None = None
    p99: float | None = None


@dataclass(frozen=True)
class ProcessStats:
    """The actor process's own: Python's garbage collections and the GIL's switch interval."""
    gc_collections: list[int] = field(default_factory=lambda: [0, 0, 0])
    gc_pause_max_s: float = 0.0
    gc_pause_total_s: float = 0.0
    gc_long_pauses: int = 0
    gc_frozen_objects: int = 0
    gil_switch_interval_s: float = 0.0


@dataclass(frozen=True)
class WorkerInfo:
    """What a pool actor answers `ready()` with: who and where it is, once it can serve."""
    worker_id: str
    pool: str
    pid: int
    node: str = ""                     # Ray's node id
    host: str = ""
    kv_blocks_total: int = 0


@dataclass(frozen=True)
class WorkerStats:
    worker_id: str
    pool: str                          # "prefill" | "decode": the pool it started in
    role: str = ""                     # "prefill" | "decode" | "mixed" (tandem.workers); "": its pool
    # ---- load --------------------------------------------------------------------------------
    running: int = 0                   # sequences in the engine's running batch
    waiting: int = 0                   # queued or reserved, not running yet
    in_flight: int = 0                 # prefill: reserved or started transfers
    queued_prompt_tokens: int = 0      # prefill: prompt tokens still to compute
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    kv_blocks_waiting: int = 0         # decode: blocks the waiting requests will need
    draining: bool = False
    # ---- work done (cumulative) -------------------------------------------------------------
    prefix_queries: int = 0
    prefix_hits: int = 0
    tokens_computed: int = 0
    prompt_tokens_computed: int = 0    # engine: prompt positions computed (not cached, not received)
    prompts_completed: int = 0         # engine: prompts whose last position it computed
    prompt_tokens_completed: int = 0   # ... and their lengths
    steps: int = 0
    busy_s: float = 0.0
    requests: int = 0                  # decode: reserves taken
    remote_prefills: int = 0           # decode
    local_prefills: int = 0            # decode
    prefills: int = 0                  # prefill: transfers started
    prompt_tokens: int = 0             # prefill
    computed_tokens: int = 0           # prefill: prompt tokens computed (not cached, not pulled)
    pulled_tokens: int = 0             # prefill: prefix tokens pulled from a decode actor
    draft_tokens: int = 0              # decode: speculative decoding
    accepted_draft_tokens: int = 0
    # ---- KV transfers ------------------------------------------------------------------------
    kv_transfer_bytes: int = 0
    kv_transfer_count: int = 0
    kv_transfer_seconds: float = 0.0
    kv_transfer_seconds_buckets: list[int] = field(default_factory=list)   # cumulative, Prometheus-style
    transfer_failures: int = 0
    # ---- latency the pool controls ------------------------------------------------------------
    prefill_latency: Percentiles = field(default_factory=Percentiles)   # prefill: reserve -> KV delivered
    tpot: Percentiles = field(default_factory=Percentiles)              # decode: time per output token
    # ---- failures and health ----------------------------------------------------------------
    loop_error: str | None = None      # the engine loop stopped: the controller replaces the actor
    last_step_error: str | None = None
    step_failures: int = 0
    reservations_expired: int = 0      # prefill: reservations never started in time
    router_timeouts: int = 0           # decode: requests aborted because their router went silent
    # ---- moving running sequences (decode) ----------------------------------------------------
    sequences_migrated: int = 0        # sent to another decode worker with their KV
    kv_tokens_migrated: int = 0        # ... the KV positions sent for them
    sequences_migrated_in: int = 0     # taken from another decode worker with their KV
    migrations_resumed: int = 0        # paused to move, then resumed here (nowhere could take them)
    pressure_moves: int = 0            # paused to move because the KV cache was about to preempt one
    kv_tokens_precopied: int = 0       # ... of kv_tokens_migrated, sent while the sequence still decoded
    move_precopy_seconds: float = 0.0  # sent moves' pre-copies, summed: from the send to its end
    move_tail_seconds: float = 0.0     # ... their tails (sent once paused), to the sender letting go
    tokens_recomputed: int = 0         # prompt positions of moved-by-recompute requests computed again
    # ---- start-up and compilation -----------------------------------------------------------
    warmup_s: float = 0.0
    slow_steps: int = 0
    mid_step_calls: int = 0
    late_compiles: int = 0
    cuda_graphs: dict[str, Any] = field(default_factory=dict)
    process: ProcessStats | None = None   # the actor adds it

    def idle(self) -> bool:
        """Nothing running, waiting or in flight (a draining worker may stop)."""
        return self.running == 0 and self.waiting == 0 and self.in_flight == 0

    def to_dict(self) -> dict[str, Any]:
        """For JSON (logs, the CLI)."""
        return asdict(self)
