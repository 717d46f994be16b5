"""The perf model against the steps a recorded run really made (its `steps/`, engine.step_trace):
each traced step priced by `PerfModel.step_s` for what it carried (decoding sequences, their
context, the widest draft every sequence was padded to, prefill chunks) beside the time it took.
`python -m bench.validate_simulator` prints this table after the replay's for every run that has
traces: where the replay is off, it says whether the step costs are (the model) or the steps are not
the ones the simulator made (the scheduling).
"""

from __future__ import annotations

import dataclasses
import statistics
from pathlib import Path

from tandem.engine.step_trace import read_traces, step_times
from tandem.perf_model import PerfModel

# step kinds: decode-only by batch, then steps that prefill, by the prompt tokens they compute
KINDS = (("decode 1-8", 1, 8), ("decode 9-32", 9, 32), ("decode 33+", 33, 1 << 30))
PREFILL = (("prefill <500", 0, 499), ("prefill 500-2k", 500, 1999), ("prefill 2k+", 2000, 1 << 30))
CAPTURE = "graph capture"   # a step that captured a CUDA graph: a one-off stall the model does not price
UNCAPTURED = "eager, no graph"  # a graph-shaped step run eagerly: its shape not captured yet


def kind_of(step: list) -> str:
    if len(step) > 9 and step[9]:
        return CAPTURE
    if len(step) > 10 and step[10]:
        return UNCAPTURED
    chunks = step[6]
    if chunks:
        n = sum(c[0] for c in chunks)
        return next(name for name, lo, hi in PREFILL if lo <= n <= hi)
    return next(name for name, lo, hi in KINDS if lo <= step[2] <= hi)


def model_s(model: PerfModel, step: list) -> float:
    """What the model charges this step: every decoding sequence verifies the step's widest draft
    (the engine pads them to it), and a step with any draft pays `verify_step_s`."""
    _, _, decode, context, _, widest, chunks = step[:7]
    drafted = 1.0 if widest else 0.0
    m = dataclasses.replace(model, spec_verify_tokens=float(widest), spec_draft_prob=drafted,
                            spec_draft_len=float(widest))
    return m.step_s(decode, context, [(n, ctx) for n, ctx in chunks])


def step_rows(run_dir: str | Path, run: dict, model: PerfModel) -> list[dict]:
    """-> per rate (and per step kind) the traced steps, their measured and modelled times."""
    timed = [st for steps in read_traces(Path(run_dir) / "steps") for st in step_times(steps)]
    rows = []
    for rate_run in run["runs"]:
        t0 = rate_run.get("started_unix")
        if t0 is None:
            continue
        t1 = t0 + rate_run["elapsed_s"]
        mine = [(s, dt) for s, dt in timed if t0 <= s[0] < t1]
        for name in [k[0] for k in KINDS + PREFILL] + [CAPTURE, UNCAPTURED]:
            got = [(dt, model_s(model, s)) for s, dt in mine if kind_of(s) == name]
            if not got:
                continue
            measured, modelled = [g[0] for g in got], [g[1] for g in got]
            rows.append({"rate": rate_run["rate"], "kind": name, "steps": len(got),
                         "measured_p50": statistics.median(measured), "model_p50": statistics.median(modelled),
                         "measured_s": sum(measured), "model_s": sum(modelled)})
    return rows


def format_steps(run: str, rows: list[dict]) -> str:
    lines = [f"{run}: traced steps, measured against the perf model for what each carried",
             f"{'rate':>5} {'kind':<15} {'steps':>6} {'p50 ms meas/model':>18} {'total s meas/model':>19} {'error':>6}"]
    for r in rows:
        err = (r["model_s"] - r["measured_s"]) / r["measured_s"] if r["measured_s"] else 0.0
        lines.append(f"{r['rate']:>5g} {r['kind']:<15} {r['steps']:>6} "
                     f"{r['measured_p50'] * 1e3:>8.1f}/{r['model_p50'] * 1e3:<9.1f} "
                     f"{r['measured_s']:>9.2f}/{r['model_s']:<9.2f} {err:>+6.0%}")
    return "\n".join(lines)

