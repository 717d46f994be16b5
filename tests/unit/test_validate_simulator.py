"""`python -m bench.validate_simulator` on recorded runs: the table, then `max error N%` within the
bound each run achieved when the simulator's service-time model last changed (docs/benchmarks.md,
"The simulator against measured runs"). A model change that makes a replay worse fails here."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


# (run, its achieved max error rounded up): with n-gram speculation, 47% (TPOT p90 at 2 sessions/s)
# and, the sixth run (draft steps counted, the padded verify width charged), 42% (TPOT p90 at 3
# sessions/s, saturation); without speculation, 25%
@pytest.mark.parametrize("run, bound", [("h200-colocated-5", 0.50), ("h200-colocated-nospec", 0.26),
                                        ("h200-colocated-6", 0.43)])
def test_validate_simulator_replays_a_recorded_run_within_its_bound(run, bound):
    out = subprocess.run([sys.executable, "-m", "bench.validate_simulator", f"bench/results/{run}"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120, check=True).stdout
    lines = out.strip().splitlines()
    rows = [ln for ln in lines if ln.startswith(run + " ")]
    assert [ln.split()[1] for ln in rows] == ["0.5", "1", "2", "3"]
    m = re.fullmatch(r"max error (\d+)%", lines[-1])
    assert m, lines[-1]
    assert int(m.group(1)) / 100 <= bound
