"""The pool actors' garbage-collector monitor: a collection is timed, counted by generation, and
one longer than the threshold is logged (the engine loop stops for that long)."""

import gc

from cluster.actor_common import GCMonitor


def test_collections_are_timed_counted_and_long_ones_logged(caplog):
    m = GCMonitor(log_over_s=0.0)   # every collection counts as long
    try:
        with caplog.at_level("WARNING", logger="cluster.actor_common"):
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
