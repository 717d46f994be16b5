"""The pool actors' garbage-collector monitor: a collection is timed, counted by generation, and
one longer than the threshold is logged (the engine loop stops for that long). And the GIL switch
interval they serve with (the cluster tests check a running actor's)."""

import gc
import sys

import pytest

from tandem.runtime import process as actor_common
from tandem.runtime.process import GCMonitor, gil_switch_interval


def test_collections_are_timed_counted_and_long_ones_logged(caplog):
    m = GCMonitor(log_over_s=0.0)   # every collection counts as long
    try:
        with caplog.at_level("WARNING", logger="tandem.runtime.process"):
            gc.collect()
        s = m.stats()
        assert s["gc_collections"][2] >= 1
        assert s["gc_pause_max_s"] > 0 and s["gc_pause_total_s"] >= s["gc_pause_max_s"]
        assert s["gc_long_pauses"] >= 1
        assert any("garbage collection paused the process" in r.getMessage() and "generation 2" in r.getMessage()
                   for r in caplog.records)
    finally:
        m.close()
    before = m.stats()["gc_collections"][2]
    gc.collect()
    assert m.stats()["gc_collections"][2] == before   # closed: no longer counting


def test_gil_switch_interval_default_override_and_bad_values(monkeypatch):
    monkeypatch.delenv(actor_common.GIL_SWITCH_INTERVAL_ENV, raising=False)
    assert gil_switch_interval() == actor_common.DEFAULT_GIL_SWITCH_INTERVAL_S < sys.getswitchinterval()
    monkeypatch.setenv(actor_common.GIL_SWITCH_INTERVAL_ENV, "0.005")
    assert gil_switch_interval() == 0.005
    for bad in ("fast", "0", "-1", "2"):
        monkeypatch.setenv(actor_common.GIL_SWITCH_INTERVAL_ENV, bad)
        with pytest.raises(ValueError, match="TANDEM_GIL_SWITCH_INTERVAL_S.*seconds between"):
            gil_switch_interval()


def test_after_startup_serves_with_the_interval(monkeypatch):
    before = sys.getswitchinterval()
    monkeypatch.setenv(actor_common.GIL_SWITCH_INTERVAL_ENV, "0.0003")
    try:
        actor_common.after_startup()
        assert sys.getswitchinterval() == pytest.approx(0.0003)
        assert actor_common.gc_stats()["gil_switch_interval_s"] == pytest.approx(0.0003)
    finally:
        sys.setswitchinterval(before)
        gc.unfreeze()
