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
