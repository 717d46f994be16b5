"""The perf model against the steps a recorded run really made (its `steps/`, engine.step_trace):
each traced step priced by `PerfModel.step_s` for what it carried (decoding sequences, their
context, the widest draft every sequence was padded to, prefill chunks) beside the time it took.
`python -m bench.validate_simulator` prints this table after the replay's for every run that has
traces: where the replay is off, it says whether the step costs are (the model) or the steps are not
the ones the simulator made (the scheduling).

`fit_load` fits what a loaded worker pays beyond an idle cluster's calibration on such traces: the
host time each arriving request takes from its worker's serving loop (`admit_host_s`), what a step
mixing decodes with prefill chunks costs beyond both (`mixed_step_s`), and extra host time per
decoding sequence and per step (other requests' streams and ends, graph captures of shapes first
met while serving); `python -m bench.validate_simulator` applies them to each run from the other
traced runs of the same model (`sibling_load_terms`).
"""

from __future__ import annotations

import bisect
import dataclasses
import json
import statistics
from pathlib import Path

import numpy as np

from tandem.cluster.layouts import recorded_perf
from tandem.engine.step_trace import read_traces, step_times
from tandem.perf_model import PerfModel

# step kinds: decode-only by batch, then steps that prefill, by the prompt tokens they compute
KINDS = (("decode 1-8", 1, 8), ("decode 9-32", 9, 32), ("decode 33+", 33, 1 << 30))
PREFILL = (("prefill <500", 0, 499), ("prefill 500-2k", 500, 1999), ("prefill 2k+", 2000, 1 << 30))
CAPTURE = "graph capture"   # a step that captured a CUDA graph: a one-off stall the model does not price
UNCAPTURED = "eager, no graph"  # a graph-shaped step run eagerly: its shape not captured yet
SPLIT = "split, no graph"  # such a step run on the piecewise graphs instead


def kind_of(step: list) -> str:
    if len(step) > 9 and step[9]:
        return CAPTURE
    if len(step) > 10 and step[10]:
        return UNCAPTURED
    if len(step) > 11 and step[11]:
        return SPLIT
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
        for name in [k[0] for k in KINDS + PREFILL] + [CAPTURE, UNCAPTURED, SPLIT]:
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


@dataclasses.dataclass(frozen=True)
class LoadTerms:
    """What a worker under load pays beyond its idle calibration, fitted on traced steps."""
    step_host_s: float      # added to every step's host time
    admit_host_s: float     # per request arriving at the worker
    mixed_step_s: float     # per step carrying decodes and prefill chunks
    per_seq_s: float        # per decoding sequence per step (added to decode_per_seq_s)
    steps: int              # traced steps fitted on
    runs: tuple[str, ...]   # the runs they came from

    def apply(self, model: PerfModel) -> PerfModel:
        return dataclasses.replace(model, step_host_s=model.step_host_s + self.step_host_s,
                                   admit_host_s=model.admit_host_s + self.admit_host_s,
                                   mixed_step_s=model.mixed_step_s + self.mixed_step_s,
                                   decode_per_seq_s=model.decode_per_seq_s + self.per_seq_s)


@dataclasses.dataclass(frozen=True)
class LoadSample:
    """One traced step: what happened during it and its time beyond what the model charged."""
    arrivals: int           # requests that arrived at the worker during the step
    mixed: bool             # it carried decodes and prefill chunks
    decoding: int           # decoding sequences
    excess_s: float


def load_samples(run_dir: str | Path, run: dict, model: PerfModel) -> list[LoadSample]:
    """Every timed step of a traced run while a rate ran, graph captures and eager steps included
    (under load they happen), against `model` (the run's own calibration)."""
    d = Path(run_dir)
    timed = sorted((st for steps in read_traces(d / "steps") for st in step_times(steps)), key=lambda x: x[0][0])
    out = []
    for rate_run in run["runs"]:
        t0 = rate_run.get("started_unix")
        if t0 is None:
            continue
        col = run["columns"].index("arrival_s")
        arrivals = sorted(t0 + row[col] for row in rate_run["requests"])
        for s, dt in timed:
            if t0 <= s[0] < t0 + rate_run["elapsed_s"]:
                n = bisect.bisect_left(arrivals, s[0] + dt) - bisect.bisect_left(arrivals, s[0])
                out.append(LoadSample(n, bool(s[2] and s[6]), s[2], dt - model_s(model, s)))
    return out


LOAD_TERMS = {"step_host_s": lambda x: 1.0, "admit_host_s": lambda x: float(x.arrivals),
              "mixed_step_s": lambda x: float(x.mixed), "per_seq_s": lambda x: float(x.decoding)}


def fit_load(samples: list[LoadSample], runs: tuple[str, ...] = ()) -> LoadTerms | None:
    """Least squares of each step's extra time on a constant (extra `step_host_s`), the requests
    that arrived during it (`admit_host_s`), whether it mixed decodes with prefill chunks
    (`mixed_step_s`) and its decoding sequences (`per_seq_s`). A term the samples cannot show (no
    step with arrivals, no mixed step) is 0, as is one fitted negative (the idle calibration
    already charged it): the most negative is dropped and the rest fitted again. None without
    samples."""
    if not samples:
        return None
    y = np.array([x.excess_s for x in samples])
    cols = {name: np.array([f(x) for x in samples]) for name, f in LOAD_TERMS.items()}
    cols = {k: v for k, v in cols.items() if k == "step_host_s" or np.ptp(v) > 0}
    fit: dict[str, float] = {}
    while cols:
        coef = np.linalg.lstsq(np.column_stack(list(cols.values())), y, rcond=None)[0]
        fit = dict(zip(cols, (float(c) for c in coef)))
        worst = min(fit, key=fit.get)
        if fit[worst] >= 0:
            break
        del cols[worst]
        fit = {}
    return LoadTerms(**{k: fit.get(k, 0.0) for k in LOAD_TERMS}, steps=len(samples), runs=tuple(runs))


def model_key(run: dict) -> tuple:
    """Runs whose load terms carry over: the same model, device and dtype."""
    m = run["cluster"].get("model") or {}
    return (m.get("name"), m.get("device"), m.get("dtype"))


def load_terms_from(run_dirs) -> LoadTerms | None:
    """`fit_load` over the traced runs among `run_dirs` (bench/record_run.py's directories: run.json,
    perf.json, steps/), each run's steps charged by its own calibrated model as its layout ran it.
    None when none of them traced its steps."""
    samples, used = [], []
    for d in map(Path, run_dirs):
        if not (d / "steps").is_dir():
            continue
        run = json.loads((d / "run.json").read_text())
        perf = PerfModel.from_dict(json.loads((d / "perf.json").read_text())["perf_model"])
        got = load_samples(d, run, recorded_perf(run["cluster"], perf)[0])
        if got:
            samples += got
            used.append(d.name)
    return fit_load(samples, tuple(used))


def sibling_load_terms(run_dir: str | Path, run: dict) -> LoadTerms | None:
    """The load terms fitted on the traced runs beside `run_dir` (its parent directory) of the same
    model, device and dtype, this run left out, and of the same build (bench/record_run.py
    `build_id`): runs recorded before builds were recorded with each other, a run of a build with
    the others of it, or, where none is of its build, with every run of its model recorded before
    it (`created_unix`). So a new run beside them never changes an older run's replay."""
    d = Path(run_dir).resolve()
    key = model_key(run)
    others = []
    for o in sorted(d.parent.iterdir()):
        if o == d or not (o / "steps").is_dir() or not (o / "perf.json").is_file():
            continue
        other = json.loads((o / "run.json").read_text())
        if model_key(other) == key:
            others.append((o, other.get("build"), other.get("created_unix")))
    build = run.get("build")
    same = [o for o, b, _ in others if b == build]
    if same or build is None:
        return load_terms_from(same)
    created = run.get("created_unix")
    return load_terms_from([o for o, _, t in others if created is None or (t is not None and t < created)])
