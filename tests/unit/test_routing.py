"""tandem.placement (worker choice, prefill placement) and router.prefix_index: affinity, prefix preference, load, determinism."""

from __future__ import annotations

import random

import pytest

from tandem.router.prefix_index import PrefixIndex, block_hashes, hash_block
from tandem.placement import (DEAD, DRAINING, OverloadLimits, WorkerView, any_ready, choose_worker,
                              prefill_placement)


def make_workers(n: int, **overrides) -> list[WorkerView]:
    """n ready, idle decode workers d0..d{n-1}; `overrides` maps worker id -> field changes."""
    return [WorkerView(worker_id=f"d{i}", pool="decode", kv_blocks_total=100,
                       **overrides.get(f"d{i}", {})) for i in range(n)]


# --- choose_worker ----------------------------------------------------------------------------

def test_session_affinity_beats_prefix_and_load():
    workers = make_workers(3, d2={"running": 9, "kv_blocks_used": 90})
    assert choose_worker(workers, "d2", {"d0": 50}) == "d2"


@pytest.mark.parametrize("state", [DRAINING, DEAD])
def test_session_worker_not_ready_is_skipped(state):
    workers = make_workers(3, d0={"state": state}, d1={"running": 2})
    assert choose_worker(workers, "d0", {"d0": 100}) == "d2"


def test_session_worker_gone_is_skipped():
    assert choose_worker(make_workers(2, d0={"running": 1}), "d9", {}) == "d1"


def test_session_worker_overloaded_is_skipped():
    overloaded = OverloadLimits(max_waiting=4)
    workers = make_workers(3, d0={"waiting": 5}, d1={"running": 3}, d2={"running": 1})
    assert choose_worker(workers, "d0", {}, overload_fn=overloaded) == "d2"
    assert choose_worker(workers, "d0", {}) == "d0"  # same inputs, no overload limit


def test_most_cached_prefix_wins_over_load():
    workers = make_workers(3, d1={"running": 8}, d2={"running": 1})
    assert choose_worker(workers, None, {"d1": 40, "d2": 10}) == "d1"


def test_prefix_from_view_or_hits_whichever_is_larger():
    workers = make_workers(2, d0={"cached_prefix_tokens": 30})
    assert choose_worker(workers, None, {"d1": 20}) == "d0"
    assert choose_worker(workers, None, {"d1": 31}) == "d1"


def test_least_loaded_then_kv_use():
    workers = make_workers(3, d0={"running": 2, "kv_blocks_used": 20},
                           d1={"running": 1, "waiting": 1, "kv_blocks_used": 50},
                           d2={"running": 2, "kv_blocks_used": 10})
    assert choose_worker(workers, None, {}) == "d2"  # all load 2: lowest KV use
    workers[0] = WorkerView("d0", "decode", running=1)
    assert choose_worker(workers, None, {}) == "d0"


def test_tie_breaks_by_id_and_ignores_input_order():
    workers = make_workers(5)
    for seed in range(5):
        random.Random(seed).shuffle(workers)
        assert choose_worker(workers, None, {}) == "d0"
        assert choose_worker(workers, None, {"d3": 1, "d4": 1}) == "d3"


def test_overloaded_workers_are_avoided():
    overloaded = OverloadLimits(max_kv_usage=0.9, max_load=10)
    workers = make_workers(3, d0={"kv_blocks_used": 95}, d1={"running": 11})
    assert choose_worker(workers, None, {"d0": 100, "d1": 100}, overload_fn=overloaded) == "d2"


def test_none_when_no_worker_can_take_it():
    overloaded = OverloadLimits(max_waiting=0)
    busy = make_workers(2, d0={"waiting": 1}, d1={"waiting": 3})
    assert choose_worker(busy, None, {}, overload_fn=overloaded) is None
    assert any_ready(busy)  # -> RESOURCE_EXHAUSTED
    gone = make_workers(2, d0={"state": DEAD}, d1={"state": DRAINING})
    assert choose_worker(gone, "d1", {}) is None
    assert not any_ready(gone)  # -> UNAVAILABLE
    assert choose_worker([], None, {}) is None


def test_worker_view_derived_fields():
    w = WorkerView("p0", "prefill", running=2, waiting=3, kv_blocks_used=25, kv_blocks_total=100)
    assert (w.load, w.kv_usage) == (5, 0.25)
    assert WorkerView("p1", "prefill").kv_usage == 0.0


# --- block hashes -----------------------------------------------------------------------------

def test_block_hashes_chain_and_share_prefixes():
    a = block_hashes(list(range(40)), 16)
    b = block_hashes(list(range(32)) + [7] * 20, 16)
    assert len(a) == 2 and len(b) == 3  # partial blocks have no hash
    assert a == b[:2]
    assert all(len(h) == 8 for h in a)
    # Chained: the same block content after a different prefix hashes differently.
    assert block_hashes([1] * 16 + [2] * 16, 16)[1] != block_hashes([3] * 16 + [2] * 16, 16)[1]


def test_block_hashes_resume_from_a_parent():
    tokens = list(range(100))
    full = block_hashes(tokens, 8)
    assert block_hashes(tokens, 8, parent=full[4], start_block=5) == full[5:]
    assert hash_block(None, tokens[:8]) == full[0]
    assert hash_block(full[0], tokens[8:16]) == full[1]


def test_block_hashes_are_stable_across_processes_and_platforms():
    # Pinned values: changing the hash silently breaks every router/worker pair mid-upgrade.
    assert block_hashes(list(range(8)), 4) == [bytes.fromhex("f61dbdf56a3d9efa"),
                                                bytes.fromhex("81e0b47deaa06892")]


def test_block_hashes_match_the_engine():
    import tandem.engine.block_manager as block_manager
    tokens = [random.Random(0).randrange(128256) for _ in range(1000)]
    assert block_hashes(tokens, 16) == block_manager.block_hashes(tokens, 16)


# --- PrefixIndex --------------------------------------------------------------------------------

def chain(seed: int, num_blocks: int, block_size: int = 4) -> list[bytes]:
    rng = random.Random(seed)
    return block_hashes([rng.randrange(50000) for _ in range(num_blocks * block_size)], block_size)


def test_match_counts_leading_blocks_per_worker():
    index = PrefixIndex()
    prompt = chain(0, 10)
    index.record("d0", prompt[:6])
    index.record("d1", prompt[:3])
    index.record("d2", chain(1, 10))
    assert index.match(prompt) == {"d0": 6, "d1": 3}
    assert index.match(chain(2, 5)) == {}
    assert index.match([]) == {}


def test_match_stops_at_the_first_gap():
    index = PrefixIndex()
    prompt = chain(0, 6)
    index.record("d0", [prompt[0], prompt[1], prompt[3], prompt[4]])
    assert index.match(prompt) == {"d0": 2}


def test_forget_worker():
    index = PrefixIndex()
    prompt = chain(0, 4)
    index.record("d0", prompt)
    index.record("d1", prompt[:2])
    index.forget_worker("d0")
    assert index.match(prompt) == {"d1": 2}
    index.forget_worker("d1")
    assert len(index) == 0 and list(index.workers()) == []
    index.forget_worker("never-seen")


def test_lru_bound_trims_chain_tails_first():
    index = PrefixIndex(max_hashes=8)
    old, new = chain(0, 6), chain(1, 4)
    index.record("d0", old)
    index.record("d1", new)
    assert len(index) == 8
    assert index.match(old) == {"d0": 4}  # its last two blocks went, the prefix still matches
    assert index.match(new) == {"d1": 4}


def test_match_keeps_a_prefix_warm():
    index = PrefixIndex(max_hashes=6)
    hot, cold = chain(0, 3), chain(1, 3)
    index.record("d0", hot)
    index.record("d1", cold)
    index.match(hot)  # now the most recently used
    index.record("d2", chain(2, 3))
    assert index.match(hot) == {"d0": 3}
    assert index.match(cold) == {}


def test_record_is_idempotent():
    index = PrefixIndex(max_hashes=100)
    for turn in range(50):  # a growing agent session: each turn's prompt extends the last
        index.record("d0", chain(0, 10 + turn)[: 10 + turn])
    assert len(index) == 59
    assert index.match(chain(0, 59)) == {"d0": 59}


# --- prefill_placement (prefill.max_queued_tokens) ----------------------------------------------

def test_prefill_placement_keeps_the_hint_with_room_else_the_least_queued_with_room():
    assert prefill_placement("p0", ["p0", "p1"], {}, 0, 5000, 16384) == "p0"
    assert prefill_placement("p0", ["p0", "p1"], {"p0": 12000}, 0, 5000, 16384) == "p1"
    assert prefill_placement("p0", ["p0", "p1", "p2"], {"p0": 12000, "p1": 9000, "p2": 3000}, 0, 5000, 16384) == "p2"
    assert prefill_placement("p0", ["p0"], {"p0": 0}, 10**6, 50000, 16384) == "p0"   # idle: any prompt
    assert prefill_placement(None, [], {}, 0, 5000, 16384) is None
    assert prefill_placement("p0", ["p0"], {"p0": 30000}, 0, 5000, float("inf")) == "p0"


def test_prefill_placement_overflows_to_local_only_while_the_local_queue_is_shorter():
    full = {"p0": 14000, "p1": 15000}
    assert prefill_placement("p0", ["p0", "p1"], full, 0, 5000, 16384) is None          # decode idle
    assert prefill_placement("p0", ["p0", "p1"], full, 13999, 5000, 16384) is None
    # the decode actor's own queue is as long as the shortest prefill queue: wait there instead
    assert prefill_placement("p1", ["p0", "p1"], full, 14000, 5000, 16384) == "p0"
    assert prefill_placement("p1", ["p0", "p1"], full, 10**6, 5000, 16384) == "p0"


def test_prefill_placement_splits_a_burst_between_the_two_queues():
    """Prompts arriving together past the cap alternate between the prefill queue and the decode
    actor's own: neither grows far past the other (before, every one went local)."""
    prefill, local = {"p0": 0}, 0
    for _ in range(40):
        where = prefill_placement("p0", ["p0"], prefill, local, 4000, 16384)
        if where is None:
            local += 4000
        else:
            prefill[where] += 4000
    assert abs(prefill["p0"] - local) <= 4000 and prefill["p0"] >= 16384
