"""The speculation length policy: k bounded by each sequence's cap, off at large batch, off after
repeated failures, back on after a successful re-probe. Pure Python, no torch."""

from __future__ import annotations

import subprocess
import sys

from tandem.engine.speculative.policy import SpeculationLengthPolicy


def make_policy(**overrides) -> SpeculationLengthPolicy:
    kw = dict(max_verify_tokens=64, min_acceptance=0.3, min_draft_gain=0.1, initial_acceptance=0.7,
              ema_decay=0.8, probe_interval=4)
    kw.update(overrides)
    return SpeculationLengthPolicy(**kw)


def test_importable_without_torch():
    code = "import sys; sys.modules['torch'] = None; import engine.speculative.policy"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_k_bounded_by_cap_and_acceptance():
    p = make_policy()
    ks = p.choose({"a": 3, "b": 8, "c": 0})
    assert ks["a"] == 3
    assert ks["b"] == 6  # acceptance 0.7: 0.7**6 = 0.12 >= 0.1, 0.7**7 = 0.08 < 0.1
    assert "c" not in ks
    for _ in range(10):
        p.observe("b", 8, 8)  # always right: the estimate climbs towards 1
    assert p.choose({"b": 8})["b"] == 8
    assert p.choose({"b": 5})["b"] == 5
    assert all(p.length_for(a / 100, 6) <= 6 for a in range(101))
    assert p.length_for(0.29, 6) == 0


def test_off_at_large_batch():
    p = make_policy(max_verify_tokens=64)
    assert p.choose({f"r{i}": 5 for i in range(8)}) == {f"r{i}": 5 for i in range(8)}  # 48 tokens: free
    ks = p.choose({f"r{i}": 5 for i in range(40)})
    assert sum(ks.values()) == 64 - 40  # what the knee leaves free after one token per sequence
    # at the knee a draft position costs what a decode position does and yields less
    assert p.choose({f"r{i}": 5 for i in range(64)}) == {}
    assert p.choose({f"r{i}": 5 for i in range(100)}) == {}
    # prefill tokens sharing the step count towards the knee
    assert p.choose({"a": 5}, num_other_tokens=63) == {}


def test_budget_goes_to_the_best_sequences_first():
    p = make_policy(max_verify_tokens=6)
    for _ in range(10):
        p.observe("good", 4, 4)
        p.observe("poor", 4, 1)
    ks = p.choose({"good": 4, "poor": 4})
    assert ks == {"good": 4}  # 6 - 2 sequences = 4 free draft slots, all worth more on "good"


def test_off_after_repeated_failures_and_back_on_after_probe():
    p = make_policy(probe_interval=4)
    assert p.choose({"a": 5}) == {"a": 5}
    fails = 0
    while p.choose({"a": 5}).get("a"):
        p.observe("a", 5, 0)
        fails += 1
        assert fails < 10, "the policy never gave up on a sequence whose drafts always fail"
    assert p.acceptance("a") < 0.3
    # off: no drafts for probe_interval - 1 more steps, then one full-length probe
    seen = [p.choose({"a": 5}).get("a", 0) for _ in range(4)]
    assert seen[:2] == [0, 0] and max(seen) == 5
    # a failed probe keeps it off until the next probe
    p.observe("a", 5, 0)
    assert p.choose({"a": 5}) == {}
    # successful probes turn it back on
    while not p.choose({"a": 5}).get("a"):
        pass
    p.observe("a", 5, 5)
    assert p.choose({"a": 5}).get("a", 0) >= 1


def test_probe_only_from_spare_budget_and_forget():
    p = make_policy(max_verify_tokens=4, probe_interval=1)
    for _ in range(8):
        p.observe("bad", 3, 0)
    assert p.choose({"bad": 5, "x": 5, "y": 5, "z": 5}).get("bad", 0) == 0  # no budget left
    assert p.choose({"bad": 5}) == {"bad": 3}  # alone, the probe fits in what is left
    p.forget("bad")
    assert p.acceptance("bad") == 0.7


def test_speculative_config_is_validated():
    import pytest

    from tandem.engine.config import EngineConfig, SpeculativeConfig
    from tandem.wire.errors import ConfigError

    assert not EngineConfig().speculative.enabled
    assert SpeculativeConfig(method="ngram").enabled
    for bad in (dict(method="medusa"), dict(method="draft"), dict(num_tokens=0), dict(min_n=3, max_n=2),
                dict(max_verify_tokens=0), dict(min_draft_gain=0.0), dict(min_acceptance=1.5), dict(ema_decay=1.0),
                dict(probe_interval=0)):
        with pytest.raises(ConfigError):
            SpeculativeConfig(**bad)


def test_token_cost_takes_positions_only_while_they_raise_tokens_per_cost():
    # r = 0.1: one sequence at acceptance 0.9 takes positions while 0.9**j > 0.1 * tokens / cost
    p = make_policy(max_verify_tokens=1000, initial_acceptance=0.9, token_cost=0.1, min_draft_gain=0.01)
    k1 = p.choose({"a": 64})["a"]
    tokens, cost = 1.0, 1.1
    for j in range(1, k1 + 1):
        assert 0.9 ** j * cost > 0.1 * tokens
        tokens, cost = tokens + 0.9 ** j, cost + 0.1
    assert 0.9 ** (k1 + 1) * cost <= 0.1 * tokens  # the next one would not pay
    # a batch of 8: each position must beat a higher bar (more tokens share the step's fixed cost)
    ks = make_policy(max_verify_tokens=1000, initial_acceptance=0.9, token_cost=0.1).choose(
        {f"s{i}": 64 for i in range(8)})
    assert len(ks) == 8 and 0 < max(ks.values()) < k1
    # low acceptance at a batch of 8: no position pays
    assert make_policy(max_verify_tokens=1000, initial_acceptance=0.4, token_cost=0.1).choose(
        {f"s{i}": 64 for i in range(8)}) == {}
    # token_cost 0 is the knee alone (as before)
    assert make_policy(max_verify_tokens=1000, initial_acceptance=0.9).choose({"a": 64})["a"] == 21


def test_padded_rows_keep_the_batch_times_the_query_tile_within_the_knee():
    """On a GPU every sequence's query is padded to the step's widest, rounded up to a power of two:
    at 64 sequences and a knee of 256, a draft of 5 (a tile of 8: 512 rows) would cost the whole
    step 1.18-1.45x, one of 3 (a tile of 4) about nothing; so k stops at 3, for probes too."""
    plain, padded = make_policy(max_verify_tokens=256), make_policy(max_verify_tokens=256, padded_rows=True)
    caps = {f"r{i}": 5 for i in range(64)}
    assert set(plain.choose(dict(caps)).values()) == {3}       # the knee alone: 192 spare positions
    few = {"a": 5, "b": 5}
    assert plain.choose(few) == padded.choose(few) == {"a": 5, "b": 5}
    for _ in range(10):       # acceptance near 1: every position is worth taking
        for p in (plain, padded):
            p.observe("a", 5, 5)
    assert padded.row_cap(64) == 3 and padded.row_cap(32) == 7 and padded.row_cap(65) == 1
    assert padded.row_cap(256) == 0 and padded.row_cap(1) == 255 and padded.row_cap(64, 64) == 2 - 1
    assert plain.row_cap(64) is None
    # one hot sequence among 63 that draft nothing (low acceptance, not yet due a probe)
    for i in range(63):
        for p in (plain, padded):
            for _ in range(3):
                p.observe(f"c{i}", 5, 0)
    batch = {"a": 5, **{f"c{i}": 5 for i in range(63)}}
    assert plain.choose(dict(batch)) == {"a": 5}                # a tile of 8 for all 64
    assert padded.choose(dict(batch)) == {"a": 3}               # a tile of 4
    # probes are bounded the same way
    probe = make_policy(max_verify_tokens=256, padded_rows=True, probe_interval=1)
    for i in range(64):
        for _ in range(3):
            probe.observe(f"c{i}", 5, 0)
    assert set(probe.choose({f"c{i}": 5 for i in range(64)}).values()) <= {1, 2, 3}


def test_padded_rows_bound_tree_nodes_keeping_a_tree():
    p = make_policy(max_verify_tokens=256, padded_rows=True)
    # 64 sequences: at most 3 nodes each; a tree of 6 nodes (parents first) keeps its best 3,
    # whose parents are kept too
    probs, depth = [1.0, 0.6, 0.4, 0.5, 0.3, 0.2], [1, 2, 2, 3, 3, 4]
    parents = [-1, 0, 0, 1, 1, 3]
    kept = p.choose_nodes({"a": (probs, depth)}, num_seqs=64)["a"]
    assert len(kept) == 3 and all(parents[n] in kept or parents[n] == -1 for n in kept)
    unbounded = make_policy(max_verify_tokens=256).choose_nodes({"a": (probs, depth)}, num_seqs=64)["a"]
    assert p.choose_nodes({"a": (probs, depth)}, num_seqs=8)["a"] == unbounded and len(unbounded) > 3
    low = make_policy(max_verify_tokens=256, padded_rows=True, min_acceptance=0.9)   # probing
    assert low.choose_nodes({"a": (probs, depth)}, num_seqs=64)["a"] == [0, 1, 2]
