"""One `WorkerStats` for a worker of both parts (tandem.workers.worker): the controller, the routers
and the metrics read a worker the same way whatever its role. The engine's numbers (batch, KV
blocks, steps, busy time) are the engine's once; each part's own counters and latency come from
that part; the transfer counters, which both parts keep for their own transfers, add up."""

from __future__ import annotations

from dataclasses import replace

from tandem.wire.stats import WorkerStats

# kept by the prefill part only (the decode part leaves them at their defaults)
_PREFILL_FIELDS = ("in_flight", "queued_prompt_tokens", "prefills", "prompt_tokens", "computed_tokens",
                   "pulled_tokens", "prefill_latency", "reservations_expired")
# kept by both, each for its own transfers
_SUMMED_FIELDS = ("kv_transfer_bytes", "kv_transfer_count", "kv_transfer_seconds", "transfer_failures")


def merge_stats(prefill: WorkerStats, decode: WorkerStats, *, pool: str, role: str, draining: bool,
                engine_queue: int) -> WorkerStats:
    """Both parts' stats, taken in one pause between steps. `engine_queue`: the engine's waiting
    and ready requests, which both parts' `waiting` count (each adds its own reservations)."""
    buckets = [a + b for a, b in zip(prefill.kv_transfer_seconds_buckets, decode.kv_transfer_seconds_buckets)]
    return replace(
        decode, pool=pool, role=role, draining=draining,
        waiting=prefill.waiting + decode.waiting - engine_queue,
        step_failures=max(prefill.step_failures, decode.step_failures),   # both count each failed step
        kv_transfer_seconds_buckets=buckets or decode.kv_transfer_seconds_buckets,
        **{f: getattr(prefill, f) for f in _PREFILL_FIELDS},
        **{f: getattr(prefill, f) + getattr(decode, f) for f in _SUMMED_FIELDS})
