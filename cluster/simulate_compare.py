"""`tandem simulate --compare adaptive,colocated,1:1 --gpus N --rates R,...`: the same sessions
replayed against each layout of N GPUs at each rate (new sessions per second, closed loop: a turn
is sent its think time after the previous answer, none past `--duration`), one result per (layout,
rate): a table, or with `--json` one JSON object per line. Layouts: `adaptive` (every worker
decodes and prefills, the cost model places each prompt and the role policy lends workers to
prefill only; the router's batch guard as the router config sets it, on by default),
`adaptive-unguarded` (the same, never refusing by the batch guard), `colocated` (N replicas), `P:D`
(a static split)."""

from __future__ import annotations

import dataclasses
import json
import math
import random
from typing import Any

from tandem.cluster.config import RouterConfig
from tandem.cluster.layouts import UNGUARDED, router_limits
from tandem.cluster.roles import RoleConfig
from tandem.cluster.sim_model import SLO, SimResult
from tandem.cluster.simulator import format_table, simulate
from tandem.cluster.workloads import PROFILES, coding_agent_sessions, load_workload
from tandem.perf_model import PerfModel


def add_compare_args(sm) -> None:
    sm.add_argument("--compare", metavar="LAYOUTS",
                    help="e.g. adaptive,colocated,1:1: each layout of --gpus GPUs at each of --rates")
    sm.add_argument("--gpus", type=int, default=2, help="GPUs per layout with --compare (default 2)")
    sm.add_argument("--rates", help="with --compare: new sessions per second, e.g. 2,4,8 (default: --session-rate)")
    sm.add_argument("--duration", type=float, default=120.0, help="with --compare: seconds of new sessions")
    sm.add_argument("--max-context", type=int, help="with --compare: the sessions' context limit in tokens "
                                                    "(default: the workload profile's, 32k)")
    sm.add_argument("--ttft-slo-ms", type=float, help="TTFT p90 SLO in ms (instead of --ttft-slo s)")
    sm.add_argument("--tpot-slo-ms", type=float, help="TPOT p90 SLO in ms (instead of --tpot-slo s)")
    sm.add_argument("--json", action="store_true", help="with --compare: one JSON object per (layout, rate)")


def parse_layout(name: str, gpus: int) -> dict[str, Any]:
    """simulate()'s arguments for one layout name."""
    if name in ("adaptive", UNGUARDED):     # UNGUARDED: without the router's batch guard
        return {"prefill": 0, "decode": gpus, "adaptive": RoleConfig(),
                **({"batch_guard": False} if name == UNGUARDED else {})}
    if name == "colocated":
        return {"prefill": 0, "decode": gpus, "colocated": True}
    p, sep, d = name.partition(":")
    if not sep or not (p.isdigit() and d.isdigit()) or int(d) < 1 or int(p) + int(d) > gpus:
        raise ValueError(f"--compare: {name!r} is not adaptive, {UNGUARDED}, colocated or P:D with P + D <= --gpus "
                         f"({gpus})")
    return {"prefill": int(p), "decode": int(d)}


def sessions(workload: str, rate: float, duration_s: float, seed: int, max_context: int | None) -> list:
    """The sessions started in `duration_s` at `rate` per second (the same seed: the same sessions)."""
    rng = random.Random(seed)
    n = max(1, math.ceil(rate * duration_s))
    if workload in PROFILES:
        profile = PROFILES[workload]
        if max_context:
            profile = dataclasses.replace(profile, max_context_tokens=max_context)
        specs = coding_agent_sessions(rng, n, rate, profile)
    else:
        specs = load_workload(workload, rng, num_sessions=n, session_rate_per_s=rate)
    return [s for s in specs if s.turn > 0 or s.arrival_s < duration_s]


def row(name: str, rate: float, gpus: int, slo: SLO, r: SimResult, role_changes: int | None) -> dict:
    s = r.summary

    def ms(x: float) -> float | None:
        return None if math.isnan(x) else round(x * 1e3, 2)
    out = {"layout": name, "rate": rate, "gpus": gpus, "goodput": round(s.goodput_rps, 4),
           "slo_attainment": round(s.slo_attainment, 4), "requests": s.requests, "rejected": s.rejected,
           "ttft_p50_ms": ms(s.ttft_p50), "ttft_p90_ms": ms(s.ttft_p90), "tpot_p50_ms": ms(s.tpot_p50),
           "tpot_p90_ms": ms(s.tpot_p90), "ttft_slo_ms": slo.ttft_s * 1e3, "tpot_slo_ms": slo.tpot_s * 1e3}
    if role_changes is not None:
        out["role_changes"] = role_changes
    return out


def compare(perf: PerfModel, layouts: list[str], gpus: int, rates: list[float], slo: SLO, *,
            workload: str = "coding-agent", duration_s: float = 120.0, seed: int = 0,
            max_context: int | None = None, limits: dict | None = None) -> list[tuple[dict, SimResult]]:
    """Each layout at each rate on the same sessions: (row, result) pairs, layouts within a rate.
    `limits`: the router's (layouts.router_limits; default: a default RouterConfig's, as `tandem
    up` serves; {}: none, every request waits however long its queue is)."""
    if limits is None:
        limits = router_limits(RouterConfig())
    out = []
    for rate in rates:
        specs = sessions(workload, rate, duration_s, seed, max_context)
        for name in layouts:
            kw = parse_layout(name, gpus)
            changes: list = []
            if "adaptive" in kw:
                kw["role_log"] = changes
            res = simulate(specs, perf=perf, slo=slo, closed_loop=True, send_until_s=duration_s,
                           label=f"{name} @{rate:g}/s", **{**limits, **kw})
            out.append((row(name, rate, gpus, slo, res, len(changes) if "adaptive" in kw else None), res))
    return out


def run_compare(args, perf: PerfModel, limits: dict) -> int:
    slo = SLO(args.ttft_slo_ms / 1e3 if args.ttft_slo_ms else args.ttft_slo,
              args.tpot_slo_ms / 1e3 if args.tpot_slo_ms else args.tpot_slo)
    rates = [float(x) for x in args.rates.split(",")] if args.rates else [args.session_rate]
    layouts = [x.strip() for x in args.compare.split(",") if x.strip()]
    for name in layouts:
        parse_layout(name, args.gpus)           # refuse a bad name before any work
    results = compare(perf, layouts, args.gpus, rates, slo, workload=args.workload, duration_s=args.duration,
                      seed=args.seed, max_context=args.max_context, limits=limits)
    if args.json:
        for r, _ in results:
            print(json.dumps(r))
        return 0
    print(f"{args.gpus} GPUs, workload {args.workload}; SLO TTFT p90 <= {slo.ttft_s * 1e3:g} ms, "
          f"TPOT p90 <= {slo.tpot_s * 1e3:g} ms")
    print(format_table([res for _, res in results]))
    return 0
