"""`tandem simulate --ramp`: the rate ramp that `tandem bench --rates R1,R2,.. --duration S` sends to
a session workload, run through the simulator (with the autoscaler in the loop when asked), and
reported in `tandem bench`'s JSON shape (runs with their requests, `pool_timeline`), so one plot
draws a simulated ramp and a measured one the same way.

The steps run back to back; the bench also waits between steps for the requests still in flight.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
from pathlib import Path
from typing import Any, Sequence

from tandem.cluster.loadgen import RampPlan, load_sessions, parse_workload, plan_ramp, sessions_needed
from tandem.cluster.loadgen_report import plot_timeline
from tandem.cluster.autoscaler import AutoscalerConfig
from tandem.cluster.sim_model import SLO, PoolSample, SimResult, SimSummary, summarize
from tandem.perf_model import PerfModel
from tandem.cluster.simulator import format_table, simulate


def ramp_plan(workload: str, rates: Sequence[float], step_s: float, seed: int = 0) -> RampPlan:
    """The bench's sessions for `workload` (a session profile), planned for every step."""
    kind, path = parse_workload(workload)
    if path is not None:
        raise ValueError(f"--ramp needs a session workload (coding-agent, coding-agent-small), not {workload!r}")
    if not rates or min(rates) <= 0 or step_s <= 0:
        raise ValueError("--ramp rates and --step-s must be > 0")
    sessions = load_sessions(kind, None, random.Random(seed), num_sessions=sessions_needed(max(rates), step_s),
                             max_context=None)
    return plan_ramp(sessions, rates, step_s)


def run_ramp(plan: RampPlan, prefill: int, decode: int, perf: PerfModel, slo: SLO,
             autoscaler: AutoscalerConfig | None, **options: Any) -> SimResult:
    """Every step's sessions, closed loop, each cut at its step's end. `options` go to `simulate`."""
    return simulate(plan.specs, prefill, decode, perf, slo, autoscaler, closed_loop=True,
                    send_until_s=plan.send_until_s, **options)


def step_summaries(result: SimResult, plan: RampPlan, rates: Sequence[float], slo: SLO) -> list[SimSummary]:
    """One summary per step, over the requests of the sessions it started (their tails may run
    into the next step); `mean_workers` over the pool samples inside the step."""
    out = []
    ends = list(plan.step_starts_s[1:]) + [math.inf]
    for i, (rate, t0, t1) in enumerate(zip(rates, plan.step_starts_s, ends)):
        reqs = [r for r in result.requests if r.session_id.startswith(f"r{i}-")]
        samples = [s for s in result.pool_sizes if t0 <= s.time_s < t1]
        out.append(summarize(reqs, slo, f"step {i + 1}: {rate:g}/s", result.summary.prefill,
                             result.summary.decode, samples))
    return out


def pool_range(samples: list[PoolSample]) -> str:
    """'prefill 1-3, decode 1-2' over the samples (live workers, draining ones excluded)."""
    if not samples:
        return "-"
    p = [s.prefill_live for s in samples]
    d = [s.decode_live for s in samples]
    return f"prefill {min(p)}-{max(p)}, decode {min(d)}-{max(d)}"


def _finite(x: Any) -> Any:
    return None if isinstance(x, float) and not math.isfinite(x) else x


def ramp_report(result: SimResult, plan: RampPlan, rates: Sequence[float], step_s: float, slo: SLO,
                label: str, config: dict[str, Any]) -> dict[str, Any]:
    """`tandem bench`'s report shape: runs (rate, started_s, summary, requests with arrival_s from
    the step's start) and pool_timeline ({t, pools: {name: {size, target, draining}}})."""
    runs = []
    for i, (rate, t0, summary) in enumerate(zip(rates, plan.step_starts_s, step_summaries(result, plan, rates, slo))):
        reqs = [r for r in result.requests if r.session_id.startswith(f"r{i}-")]
        runs.append({"rate": rate, "started_s": t0,
                     "summary": {k: _finite(v) for k, v in dataclasses.asdict(summary).items()},
                     "requests": [{**{k: _finite(v) for k, v in dataclasses.asdict(r).items()},
                                   "arrival_s": r.arrival_s - t0,
                                   "status": "OK" if r.ttft_s is not None else "REJECTED"} for r in reqs]})
    timeline = [{"t": s.time_s, "pools": {
        "prefill": {"size": s.prefill_live, "target": s.prefill_target, "draining": s.prefill_draining},
        "decode": {"size": s.decode_live, "target": s.decode_target, "draining": s.decode_draining}}}
        for s in result.pool_sizes]
    return {"label": label, "simulated": True,
            "config": {**config, "rates": list(rates), "duration_s": step_s,
                       "slo": {"ttft_ms": slo.ttft_s * 1e3, "tpot_ms": slo.tpot_s * 1e3}},
            "summary": {k: _finite(v) for k, v in dataclasses.asdict(result.summary).items()},
            "runs": runs, "pool_timeline": timeline}


def print_ramp(result: SimResult, plan: RampPlan, rates: Sequence[float], slo: SLO) -> None:
    steps = step_summaries(result, plan, rates, slo)
    print(format_table([*steps, result.summary]))
    if result.pool_sizes:
        ends = list(plan.step_starts_s[1:]) + [math.inf]
        print("\nlive workers per step (autoscaler samples):")
        for s, t0, t1 in zip(steps, plan.step_starts_s, ends):
            inside = [x for x in result.pool_sizes if t0 <= x.time_s < t1]
            print(f"  {s.label:<16} {pool_range(inside):<28} mean {s.mean_workers:.2f} workers")


def write_ramp(report: dict[str, Any], out_dir: str | Path, label: str) -> list[Path]:
    """sim-LABEL.json and, when the autoscaler ran and matplotlib is there, sim-LABEL-timeline.png."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / f"sim-{label}.json"]
    paths[0].write_text(json.dumps(report, indent=1))
    if not report["pool_timeline"]:
        return paths
    try:
        import matplotlib  # noqa: PLC0415 - optional (the `bench` extra); without it, no plots
    except ImportError:
        return paths
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415 - after choosing the Agg backend

    paths.append(plot_timeline(report, out / f"sim-{label}-timeline.png", plt,
                               title=f"tandem simulate {label}: pools and latency over time (simulated)"))
    return paths
