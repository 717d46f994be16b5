"""What-if simulator: replay a workload against N prefill and M decode workers, without GPUs.

A discrete-event simulation of Tandem's request path, with service times from a fitted `PerfModel`.
Every placement decision follows the router's and the decode worker's rules exactly: they are the
same functions (tandem.placement).

1. A request arrives; the router picks a decode worker: the session's own (unless it is draining or
   past the overload limits, none by default), else the one with the most of the prompt cached,
   then the least loaded, the lowest KV use, the smallest id.
2. It waits there (FIFO) for a batch slot and KV for prompt + output; the prompt's cached prefix
   (an LRU per worker, by session or by block hash) is reused, not reserved again.
3. Uncached part <= `local_prefill_threshold` (or no prefill workers, or every prefill worker holds
   `prefill_queue_limit` prompt tokens not yet delivered and the decode worker's own queue of
   prefills is the shorter): the decode worker prefills it itself, in chunks inside its steps.
   Otherwise the prefill worker the router picks (the session's, else the most cached, then the
   least loaded; the least queued with room when that one is backlogged) computes it FIFO, and
   streams the KV layer by layer, so the KV is ready at max(compute end, compute start + transfer
   time). That is the first token. (`pull_prefix`: what if the prefill worker received the decode
   worker's cached prefix instead of recomputing what its own cache lacks.)
4. Decode workers run continuous-batching steps, one token per running sequence per step.

Outputs per-request TTFT/TPOT/e2e and a summary; `sweep` tries every prefill:decode split of a
worker budget plus the colocated mode. With an `AutoscalerConfig` the policy in cluster.autoscaler
runs every period on the snapshot the live controller builds (cluster.pools.build_snapshot, on the
stats each simulated worker reports); new workers start after a delay.
Everything is deterministic for a given workload (ties break as the router breaks them).

Modules: cluster/sim_model.py (inputs and results), sim_workers.py (caches, workers, requests),
sim_engine.py (the events and rules), sim_control.py (the autoscaler in the loop); this one runs
them (`simulate`, `sweep`, `format_table`). Import each name from the module that defines it.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

from tandem.cluster.autoscaler import AutoscalerConfig
from tandem.cluster.roles import RoleConfig
from tandem.cluster.sim_engine import Simulation
from tandem.cluster.sim_model import SLO, RequestLike, SimResult, SimSummary
from tandem.perf_model import PerfModel
from tandem.placement import OverloadLimits
from tandem.router.admission import AdmissionConfig


def simulate(workload_requests: Sequence[RequestLike], prefill: int, decode: int, perf: PerfModel,
             slo: SLO = SLO(), autoscaler: AutoscalerConfig | None = None, seed: int = 0, *,
             colocated: bool = False, closed_loop: bool = False, pull_prefix: bool = False,
             worker_startup_s: float = 60.0, label: str | None = None,
             send_until_s: float | Mapping[str, float] | None = None,
             max_workers: int | None = None, overload: OverloadLimits = OverloadLimits(),
             adaptive: RoleConfig | None = None, role_log: list | None = None,
             admission: AdmissionConfig | None = None, cancel_at_s: float | None = None,
             batch_guard: bool = False, retries: int = 0, retry_until_s: float | None = None) -> SimResult:
    """Replay `workload_requests` against `prefill` + `decode` workers. `colocated`: no prefill
    pool, every decode worker prefills everything itself (chunked). `closed_loop`: a session's turn
    k+1 is sent `think_s` after turn k finishes (an agent waits for its answer) instead of at its
    `arrival_s`. With `autoscaler`, pools start at the given sizes and follow the policy; new workers
    take `worker_startup_s` to come up. `pull_prefix`: a prefill worker missing part of the prefix
    the decode worker holds receives that KV from it (transfer time) rather than recomputing it.
    `send_until_s` (closed loop): a turn due at or after it is not sent, nor are the session's later
    turns, as `tandem bench` stops sending at its duration; unsent turns are left out of the result.
    A mapping gives each session id its own cut-off (a ramp of runs). `max_workers` (GPUs in all):
    a new worker past it waits for a drained worker's slot, then starts. `overload`: the router's
    worker overload limits (RouterConfig.worker_max_*); a request no worker can take is rejected.
    `adaptive`: the adaptive layout with this role policy: `decode` workers that all decode and
    prefill, each prompt placed by the cost model (cluster/sim_adaptive.py), some workers lent to
    prefill only by the policy; `prefill` must be 0. `role_log`: gets its role changes.
    `admission`: the router's admission limits (AdmissionConfig.of(RouterConfig)); a request whose
    predicted wait for its first token is past `max_expected_wait_s` when it arrives is refused,
    as the router refuses it (router/admission.py, the same limiter on the simulation's clock; the
    in-flight and queue limits are not simulated: the workers' queues hold the requests). None:
    none refused. `cancel_at_s`: the client ends every call still running then (`tandem bench`
    at duration + drain timeout): such a request counts as failed, as the bench counts it.
    `batch_guard` (with `adaptive`, whose router places by the cost model): a request whose decode
    worker's batch is full for it (tandem.placement.BatchGuard at the SLO's TPOT) is refused, as
    the router refuses it (RouterConfig.batch_guard). `retries`: a refused request (the limiter,
    the batch guard, every worker overloaded or none up) is sent again after the retry policy's
    wait (tandem.client.errors.backoff_s, the router's hint) up to this many times while that is
    before `send_until_s` (else `retry_until_s`: a replay of recorded arrivals), its latencies counted from its first send, as `tandem bench --retries`
    sends it. `seed` is kept for callers: placement breaks ties deterministically."""
    if decode < 1 or prefill < 0:
        raise ValueError(f"need decode >= 1 and prefill >= 0, got prefill={prefill}, decode={decode}")
    if adaptive is not None and (prefill or colocated):
        raise ValueError("the adaptive layout has no prefill pool: every worker may prefill")
    if max_workers is not None and (0 if colocated else prefill) + decode > max_workers:
        raise ValueError(f"{prefill} prefill + {decode} decode workers exceed max_workers={max_workers}")
    sim = Simulation(workload_requests, prefill, decode, perf, slo, autoscaler, seed, colocated,
                     worker_startup_s, closed_loop, pull_prefix, send_until_s, max_workers, overload, adaptive,
                     admission, batch_guard, retries, retry_until_s)
    sim.run()
    if role_log is not None:
        role_log.extend(sim.role_log)
    label = label or ((f"adaptive x{decode}" if adaptive else f"colocated x{decode}" if colocated
                       else f"{prefill}P:{decode}D")
                      + (" autoscaled" if autoscaler else ""))
    return sim.result(label, 0 if colocated else prefill, decode, cancel_at_s)


def sweep(workload_requests: Sequence[RequestLike], total_workers: int, perf: PerfModel,
          slo: SLO = SLO(), seed: int = 0, *, colocated: bool = True, **options: Any) -> list[SimResult]:
    """Every split of `total_workers` into prefill >= 1 and decode >= 1 workers, then (if
    `colocated`) all of them colocated. `options` go to `simulate` (closed_loop, pull_prefix)."""
    out = [simulate(workload_requests, p, total_workers - p, perf, slo, seed=seed, **options)
           for p in range(1, total_workers)]
    if colocated:
        out.append(simulate(workload_requests, 0, total_workers, perf, slo, seed=seed, colocated=True,
                            **options))
    return out


def format_table(results: Sequence[SimResult | SimSummary]) -> str:
    """A plain-text table, one row per result, best goodput marked with '*'."""
    rows = [r.summary if isinstance(r, SimResult) else r for r in results]
    best = max((r.goodput_rps for r in rows), default=None)

    def f(v: float, scale: float = 1.0, digits: int = 2) -> str:
        return "-" if v is None or math.isnan(v) else f"{v * scale:.{digits}f}"
    head = ["split", "TTFT p50 s", "p90", "p99", "TPOT p50 ms", "p90", "p99", "goodput r/s",
            "SLO met", "refused", "cached", "out tok/s"]
    body = [[r.label + (" *" if r.goodput_rps == best else ""), f(r.ttft_p50), f(r.ttft_p90),
             f(r.ttft_p99), f(r.tpot_p50, 1e3, 1), f(r.tpot_p90, 1e3, 1), f(r.tpot_p99, 1e3, 1),
             f(r.goodput_rps, digits=3), f(r.slo_attainment, 100, 1) + "%", str(r.rejected),
             f(r.cached_token_ratio, 100, 1) + "%", f(r.output_tok_s, digits=0)] for r in rows]
    widths = [max(len(x) for x in col) for col in zip(head, *body)]
    lines = ["  ".join(x.rjust(w) if i else x.ljust(w) for i, (x, w) in enumerate(zip(row, widths)))
             for row in [head, *body]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
