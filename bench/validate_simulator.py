"""Replay recorded `tandem bench` runs through the simulator and print, per rate, simulated against
measured TTFT p50/p90, TPOT p50/p90 and goodput with the relative error; last, `max error N%`.

    python -m bench.validate_simulator bench/results/cpu-colocated bench/results/h200-colocated ...

Each run directory (written by bench/record_run.py) holds the requests as sent (replayed as the bench
sent them: a session's first turn at its recorded time, each later turn its recorded think time after
the turn before it ended; their lengths, sessions and turns), the cluster's config (its layout, local-prefill threshold,
decode slots, step budget, KV blocks) and the perf model `tandem profile` calibrated for that
machine and model, with the served step and the control path calibrated on the running cluster
by probe requests (cluster/calibration.py) and speculation's drafts
and tokens per step from the run's usage (per rate, with how often a sequence drafts, where the
run counted its draft steps). Nothing is fitted to the latencies being validated, nor to the run's
own steps: what a loaded worker pays beyond the idle calibration (each arriving request's host
time, mixed steps' extra cost, extra host time per sequence and per step: cluster/step_check.py
`fit_load`) comes from the step traces of the *other* recorded runs of the same model (the run
directories beside it, `sibling_load_terms`; `--load-terms others`, the default; `none`: the idle
calibration alone). The router's admission limiter, worker overload limits and (for the adaptive
layout, replayed by the adaptive simulation) batch guard run in the replay as the run's config set
them (`layouts.router_limits`: a request predicted to wait past `max_expected_wait_s` for its first
token is refused, as live),
and a simulated request still running at the bench's deadline (duration + drain timeout) failed, as
the bench cancels it. A run recorded with its engines' step traces (`steps/`) gets a second table:
the model against each step the run made (cluster/step_check.py), after the `max error` line.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

from tandem.cluster.layouts import (bench_deadline, bench_retries, recorded_mode, recorded_perf, recorded_router,
                                    router_limits)
from tandem.cluster.profiling import with_counted_drafts
from tandem.cluster.sim_model import SLO, RequestResult
from tandem.cluster.simulator import simulate
from tandem.cluster.step_check import format_steps, sibling_load_terms, step_rows
from tandem.cluster.workloads import RequestSpec
from tandem.perf_model import PerfModel


FIGURES = ("ttft_p50", "ttft_p90", "tpot_p50", "tpot_p90", "goodput")


def load_run(run_dir: str | Path) -> tuple[dict, PerfModel, dict]:
    """-> (run.json, the perf model of perf.json, perf.json's provenance notes)."""
    d = Path(run_dir)
    missing = [name for name in ("run.json", "perf.json") if not (d / name).is_file()]
    if missing:
        raise SystemExit(f"{d}: not a recorded run (no {' or '.join(missing)}); bench/record_run.py "
                         "writes one directory per run")
    run = json.loads((d / "run.json").read_text())
    perf = json.loads((d / "perf.json").read_text())
    return run, PerfModel.from_dict(perf["perf_model"]), perf.get("notes", {})


def requests_of(run: dict, rate_run: dict) -> list[dict]:
    return [dict(zip(run["columns"], row)) for row in rate_run["requests"]]


def tokens_per_step(r: dict) -> float | None:
    """What each of the request's decode steps emitted, from its usage (speculation accepts more
    drafts on some requests' text than on others'); None where it did not end or had one token."""
    out = (r.get("completion_tokens") or 0) - 1
    if r["status"] != "OK" or out <= 0:
        return None
    accepted = r.get("accepted_draft_tokens") or 0
    return out / max(out - accepted, 1)


def replay_specs(requests: list[dict]) -> list[RequestSpec]:
    """The requests as the simulator replays them, with their recorded lengths, session and turn: a
    session's first turn at its recorded send time, each later turn its recorded think time after
    the turn before it ended, as `tandem bench` sends them (closed loop). The think time is the
    client's (send time minus the previous turn's send time and end-to-end latency), so a turn the
    simulation ends later is followed later, as live, instead of arriving before its prefix is
    cached."""
    prev: dict[str, dict] = {}
    out = []
    for r in sorted(requests, key=lambda r: (r["session_id"], r["turn"])):
        p = prev.get(r["session_id"])
        think = 0.0
        if p is not None:
            think = max(0.0, r["arrival_s"] - p["arrival_s"] - (p["e2e_s"] if p["e2e_s"] is not None else 0.0))
        prev[r["session_id"]] = r
        out.append(RequestSpec(r["session_id"], r["turn"], r["arrival_s"], r["prompt_tokens"], r["max_tokens"],
                               r["shared_prefix_tokens"], think_s=think, tokens_per_step=tokens_per_step(r)))
    return sorted(out, key=lambda x: x.arrival_s)


def _pct(xs: list[float], q: float) -> float:
    """Linear interpolation between closest ranks, as `tandem bench` computes its percentiles."""
    xs = sorted(xs)
    if not xs:
        return math.nan
    k = (len(xs) - 1) * q / 100
    lo = math.floor(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def figures(rows: list[tuple[float, float | None, float | None, float | None]], slo: SLO) -> dict[str, float]:
    """(arrival, ttft, tpot, e2e) of each request (ttft None: failed) -> the five figures, computed
    the same way for the measurement and the simulation: percentiles over the requests that ended,
    goodput = requests meeting both SLOs per second from the rate's start to its last answer."""
    ok = [r for r in rows if r[1] is not None]
    good = sum(t <= slo.ttft_s and (p is None or p <= slo.tpot_s) for _, t, p, _ in ok)
    end = max((a + e for a, _, _, e in ok), default=1.0)
    return {"ttft_p50": _pct([r[1] for r in ok], 50), "ttft_p90": _pct([r[1] for r in ok], 90),
            "tpot_p50": _pct([r[2] for r in ok if r[2] is not None], 50),
            "tpot_p90": _pct([r[2] for r in ok if r[2] is not None], 90), "goodput": good / end}


def measured_rows(requests: list[dict]) -> list[tuple]:
    return [(r["arrival_s"], r["ttft_s"], r["tpot_s"], r["e2e_s"]) if r["status"] == "OK" else (r["arrival_s"],
            None, None, None) for r in requests]


def simulated_rows(results: list[RequestResult]) -> list[tuple]:
    return [(r.arrival_s, r.ttft_s, r.tpot_s, r.e2e_s) for r in results]


def validate_run(run_dir: str | Path, load_terms: str = "others") -> list[dict]:
    """-> one row per rate: {run, rate, requests, measured: figures, simulated: figures, error: {figure: rel},
    load: the LoadTerms applied or None}. `load_terms`: "others" (sibling_load_terms) or "none"."""
    run, perf, _ = load_run(run_dir)
    model, colocated, n_prefill, n_decode = recorded_perf(run["cluster"], perf)
    terms = sibling_load_terms(run_dir, run) if load_terms == "others" else None
    if terms is not None:
        model = terms.apply(model)
    slo = SLO(run["bench"]["slo"]["ttft_ms"] / 1e3, run["bench"]["slo"]["tpot_ms"] / 1e3)
    out = []
    for rate_run in run["runs"]:
        reqs = requests_of(run, rate_run)
        if not any(r["status"] == "OK" for r in reqs):
            continue                    # nothing was sent (or nothing ended) at this rate
        sim = simulate(replay_specs(reqs), n_prefill, n_decode, with_counted_drafts(model, reqs), slo,
                       pull_prefix=True, closed_loop=True, **router_limits(recorded_router(run["cluster"])),
                       cancel_at_s=bench_deadline(run["bench"]), **recorded_mode(run["cluster"], colocated),
                       **bench_retries(run["bench"]))
        m, s = figures(measured_rows(reqs), slo), figures(simulated_rows(sim.requests), slo)
        err = {k: abs(s[k] - m[k]) / m[k] if m[k] else (0.0 if not s[k] else math.inf) for k in FIGURES}
        out.append({"run": Path(run_dir).name, "rate": rate_run["rate"], "requests": len(reqs),
                    "measured": m, "simulated": s, "error": err, "load": terms})
    return out


def format_rows(rows: list[dict]) -> str:
    head = (f"{'run':<22} {'rate':>5} {'reqs':>5}  {'TTFT p50 ms':>18} {'TTFT p90 ms':>18} {'TPOT p50 ms':>18} "
            f"{'TPOT p90 ms':>18} {'goodput r/s':>18}")
    lines = [head, "(each figure: simulated / measured, relative error)"]
    for r in rows:
        cells = []
        for k in FIGURES:
            scale, fmt = (1.0, "{:.2f}") if k == "goodput" else (1e3, "{:.0f}" if k.startswith("ttft") else "{:.1f}")
            sim, meas = (fmt.format(r[side][k] * scale) for side in ("simulated", "measured"))
            cells.append(f"{sim}/{meas} {r['error'][k]:4.0%}".rjust(18))
        lines.append(f"{r['run']:<22} {r['rate']:>5g} {r['requests']:>5}  " + " ".join(cells))
    return "\n".join(lines)


def max_error(rows: list[dict]) -> float:
    return max((e for r in rows for e in r["error"].values()), default=0.0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", help="run directories (bench/results/<run>)")
    ap.add_argument("--load-terms", choices=("others", "none"), default="others",
                    help="what a loaded worker pays beyond the idle calibration: fitted on the other "
                         "traced runs of the same model beside each run (default), or none")
    args = ap.parse_args(argv)
    rows = [row for d in args.runs for row in validate_run(d, args.load_terms)]
    print(format_rows(rows))
    for d in args.runs:
        terms = next((r["load"] for r in rows if r["run"] == Path(d).name), None)
        if terms is not None:
            print(f"{Path(d).name}: load terms step_host +{terms.step_host_s * 1e3:.2f} ms, admit_host "
                  f"{terms.admit_host_s * 1e3:.2f} ms, mixed_step {terms.mixed_step_s * 1e3:.2f} ms, per sequence "
                  f"+{terms.per_seq_s * 1e6:.0f} us (from {terms.steps} steps of {', '.join(terms.runs)})")
    for d in args.runs:
        mine = [r for r in rows if r["run"] == Path(d).name]
        print(f"{Path(d).name}: max error {max_error(mine):.0%}")
    errors = [e for r in rows for e in r["error"].values()]
    if errors:
        print(f"mean error {sum(errors) / len(errors):.1%}, median {statistics.median(errors):.1%}; "
              f"{sum(e <= 0.15 for e in errors)} of {len(errors)} figures within 15%")
    print(f"max error {max_error(rows) * 100:.0f}%")
    for d in args.runs:     # where a run traced its engines' steps: was it the step costs or the steps?
        if (Path(d) / "steps").is_dir():
            run, perf, _ = load_run(d)
            print("\n" + format_steps(Path(d).name, step_rows(d, run, recorded_perf(run["cluster"], perf)[0])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
