"""`python -m bench.validate_simulator` on recorded runs: the table, then `max error N%` within the
bound each run achieved when the simulator's service-time model last changed (docs/benchmarks.md,
"The simulator against measured runs"). A model change that makes a replay worse fails here."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


# (run, its rates, its achieved max error rounded up), replayed closed loop as the bench sent it, each
# request with its own tokens per step, the idle calibration plus the load terms fitted on the other
# traced runs of the same model (2026-12-04, docs/benchmarks.md "Load terms"). Before the load terms
# the bounds were 46, 22, 43, 49, 31, 27, 42, 36, 26, 25 in this order; h200-colocated-9 is the one
# run they make worse (26% -> 59%: its small prefills took 20 ms where the other runs' took 33-49 ms,
# so the mixed-step and admission costs fitted on those over-charge its TTFT p50 at 0.5 and 1/s;
# `--load-terms none` keeps its old figure, tested below)
@pytest.mark.parametrize("run, rates, bound", [("h200-colocated-5", ["0.5", "1", "2", "3"], 0.40),
                                               ("h200-colocated-nospec", ["0.5", "1", "2", "3"], 0.17),
                                               ("h200-colocated-6", ["0.5", "1", "2", "3"], 0.38),
                                               ("h200-colocated-7", ["0.5", "1", "2", "3"], 0.39),
                                               ("h200-colocated-8", ["0.5", "1", "2", "3"], 0.22),
                                               ("h200-colocated-9", ["0.5", "1", "2", "3"], 0.60),
                                               ("h200-colocated-10", ["1", "2", "3"], 0.34),
                                               ("h200-colocated-11", ["2"], 0.12),
                                               ("h200-colocated-12", ["1"], 0.18),
                                               ("cpu-colocated-3", ["0.05", "0.1"], 0.16),
                                               ("cpu-colocated-4", ["0.05", "0.1"], 0.21),
                                               ("cpu-colocated-5", ["0.05", "0.1"], 0.24)])
def test_validate_simulator_replays_a_recorded_run_within_its_bound(run, rates, bound):
    out = subprocess.run([sys.executable, "-m", "bench.validate_simulator", f"bench/results/{run}"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120, check=True).stdout
    lines = out.strip().splitlines()
    rows = [ln for ln in lines if ln.startswith(run + " ")]
    assert [ln.split()[1] for ln in rows] == rates
    m = re.search(r"^max error (\d+)%$", out, re.M)
    assert m, out
    assert int(m.group(1)) / 100 <= bound


def test_a_run_with_a_step_trace_gets_the_step_table():
    """cpu-colocated-3 traced its engine's steps: after the replay, each rate's steps by kind, measured
    against the perf model for what each carried (cluster/step_check.py)."""
    out = subprocess.run([sys.executable, "-m", "bench.validate_simulator", "bench/results/cpu-colocated-3"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120, check=True).stdout
    table = out.split("traced steps, measured against the perf model")[1].strip().splitlines()[2:]
    kinds = {(ln.split()[0], ln.split()[1] + " " + ln.split()[2]) for ln in table}
    assert {("0.05", "decode 1-8"), ("0.1", "decode 1-8"), ("0.05", "prefill <500")} <= kinds
    for ln in table:
        steps = int(ln.split()[3])
        assert steps > 0


def test_a_directory_that_is_not_a_recorded_run_is_refused_by_name():
    """bench/results also holds the soak test's results: no run.json, so a one-line error naming the
    directory and what it lacks, not a traceback."""
    done = subprocess.run([sys.executable, "-m", "bench.validate_simulator", "bench/results/h200-colocated-9",
                           "bench/results/soak"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "Traceback" not in done.stderr
    assert "bench/results/soak: not a recorded run (no run.json or perf.json)" in done.stderr


def test_load_terms_come_from_the_other_traced_runs_and_can_be_left_out():
    """Each run's load terms are fitted on the traced runs beside it of the same model, never on its
    own steps; `--load-terms none` replays with the idle calibration alone (run 9's 26%)."""
    out = subprocess.run([sys.executable, "-m", "bench.validate_simulator", "bench/results/h200-colocated-9"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120, check=True).stdout
    line = next(ln for ln in out.splitlines() if ln.startswith("h200-colocated-9: load terms"))
    sources = line.split(" of ", 1)[1].rstrip(")").split(", ")
    assert "h200-colocated-9" not in sources and "h200-colocated-10" in sources
    assert not any(s.startswith("cpu-") for s in sources)          # another model, another device
    admit = float(re.search(r"admit_host ([\d.]+) ms", line).group(1))
    assert 1.0 < admit < 10.0
    none = subprocess.run([sys.executable, "-m", "bench.validate_simulator", "bench/results/h200-colocated-9",
                           "--load-terms", "none"], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          check=True).stdout
    assert "load terms" not in none
    assert int(re.search(r"^max error (\d+)%$", none, re.M).group(1)) <= 27
