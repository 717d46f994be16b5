"""Autoscaling policy: pure, driven with a fake clock (`now` is just a number), no sleeping."""

import random

import pytest
from hypothesis import given, settings, strategies as st

from tandem.cluster.autoscaler import (AutoscalerConfig, DecodeMetrics, MetricsSnapshot, PolicyState,
                                PrefillMetrics, apply_ratio, decide, ratio_ok)
from tandem.wire.errors import ConfigError

CAP = 8000.0  # prefill tokens/s per worker
BLOCKS = 1000  # KV blocks per decode worker


def make_config(**overrides) -> AutoscalerConfig:
    base = dict(prefill_min=1, prefill_max=10, decode_min=1, decode_max=10, upscale_delay_s=10.0,
                downscale_delay_s=60.0, period_s=5.0, ttft_target_s=1.0, tpot_target_s=0.05,
                prefill_tokens_per_s_per_worker=CAP, max_seqs_per_worker=64)
    return AutoscalerConfig(**{**base, **overrides})


def prefill(size: int, **kw) -> PrefillMetrics:
    return PrefillMetrics(size=size, **kw)


def decode(size: int, kv_frac: float = 0.2, **kw) -> DecodeMetrics:
    return DecodeMetrics(size=size, kv_blocks_total=BLOCKS * size,
                         kv_blocks_used=int(kv_frac * BLOCKS * size), **kw)


def calm(p: int, d: int) -> MetricsSnapshot:
    """A fixed light load: 0.6 prefill workers' worth, 0.6 decode workers' worth of KV. At 2 + 2
    workers that is inside the dead band: too much to shrink, too little to grow."""
    return MetricsSnapshot(prefill(p, prompt_tokens_per_s=0.6 * CAP, ttft_p90=0.3),
                           DecodeMetrics(size=d, kv_blocks_total=BLOCKS * d, kv_blocks_used=600,
                                         running_seqs=20, tpot_p90=0.02))


def drive(cfg, make_snapshot, periods: int, start=(2, 2)):
    """Run the policy `periods` times; pools follow their targets at once. Returns the targets."""
    state, sizes, out = PolicyState(), start, []
    for i in range(periods):
        d = decide(make_snapshot(*sizes, i), cfg, state, now=i * cfg.period_s)
        state, sizes = d.state, (d.prefill_target, d.decode_target)
        out.append(sizes)
    return out


def changes(seq) -> int:
    return sum(a != b for a, b in zip(seq, seq[1:]))


def test_calm_load_holds_and_idle_shrinks_to_min():
    cfg = make_config()
    assert drive(cfg, lambda p, d, i: calm(p, d), 40)[-1] == (2, 2)
    def idle(p, d, i):
        return MetricsSnapshot(prefill(p), decode(d, kv_frac=0.0))

    assert drive(cfg, idle, 100)[-1] == (1, 1)


def test_prompt_burst_grows_prefill_not_decode():
    cfg = make_config()

    def burst(p, d, i):
        s = calm(p, d)
        return MetricsSnapshot(prefill(p, queued_prompt_tokens=60_000, prompt_tokens_per_s=3 * CAP,
                                       ttft_p90=4.0), s.decode)
    targets = drive(cfg, burst, 20)
    assert targets[-1][0] > 2
    assert all(d == 2 for _, d in targets)


def test_long_running_sequences_grow_decode_not_prefill():
    cfg = make_config()

    def heavy_kv(p, d, i):
        return MetricsSnapshot(calm(p, d).prefill,
                               decode(d, kv_frac=0.97, running_seqs=20 * d, waiting_seqs=5, tpot_p90=0.04))
    targets = drive(cfg, heavy_kv, 20)
    assert targets[-1][1] > 2
    assert all(p == 2 for p, _ in targets)


@pytest.mark.parametrize("signal", ["queue", "arrivals", "ttft"])
def test_prefill_grows_on_each_of_its_signals(signal):
    cfg = make_config(upscale_delay_s=0.0)
    kw = {"queue": {"queued_prompt_tokens": 50_000}, "arrivals": {"prompt_tokens_per_s": 5 * CAP},
          "ttft": {"ttft_p90": 2.5}}[signal]
    snap = MetricsSnapshot(prefill(2, **kw), calm(2, 2).decode)
    d = decide(snap, cfg, PolicyState(), now=0.0)
    assert (d.prefill_target, d.decode_target) == (4, 2)  # max_step_up = 2


@pytest.mark.parametrize("signal", ["kv", "seqs", "tpot"])
def test_decode_grows_on_each_of_its_signals(signal):
    cfg = make_config(upscale_delay_s=0.0)
    kw = {"kv": {"kv_frac": 0.95}, "seqs": {"running_seqs": 128, "waiting_seqs": 40},
          "tpot": {"tpot_p90": 0.08}}[signal]
    snap = MetricsSnapshot(calm(2, 2).prefill, decode(2, **kw))
    d = decide(snap, cfg, PolicyState(), now=0.0)
    assert d.prefill_target == 2 and d.decode_target > 2


def test_steady_noisy_load_settles_and_never_flaps():
    """A closed loop: per-worker load and latency follow the pool size; the load itself is steady
    with +-15 % noise. After the first ramp the targets never change again."""
    cfg = make_config(upscale_delay_s=10.0, downscale_delay_s=30.0)
    rng = random.Random(7)
    prompt_rate, seqs = 4.5 * CAP, 150  # ~4.5 prefill workers' worth, 150 sequences

    def steady(p, d, i):
        def noise():
            return rng.uniform(0.85, 1.15)

        util = prompt_rate * noise() / (CAP * p)
        return MetricsSnapshot(
            prefill(p, prompt_tokens_per_s=prompt_rate * noise(), queued_prompt_tokens=int(2000 * util),
                    ttft_p90=0.2 + 0.3 * min(util, 3)),
            decode(d, kv_frac=min(1.0, 0.6 * seqs / (d * 40) * noise()), running_seqs=int(seqs * noise()),
                   tpot_p90=0.01 + 0.0002 * seqs / d))
    targets = drive(cfg, steady, 600, start=(1, 1))
    settled = targets[100:]
    assert changes(settled) == 0, settled[:20]
    prefill_t = [p for p, _ in targets]
    decode_t = [d for _, d in targets]
    assert prefill_t == sorted(prefill_t) and decode_t == sorted(decode_t)  # only ever grew
    assert 6 <= settled[0][0] <= 8 and settled[0][1] >= 3


def test_scale_down_waits_its_delay_then_steps_down():
    cfg = make_config(downscale_delay_s=60.0, max_step_down=1)
    state = PolicyState()
    hot = MetricsSnapshot(prefill(2, prompt_tokens_per_s=5 * CAP), calm(2, 2).decode)
    d = decide(hot, make_config(upscale_delay_s=0.0, max_step_up=4), state, now=0.0)
    assert d.prefill_target == 6
    state, now, history = d.state, 0.0, []
    while now < 200.0:
        now += cfg.period_s
        d = decide(MetricsSnapshot(prefill(d.prefill_target), calm(6, 2).decode), cfg, state, now)
        state = d.state
        history.append((now, d.prefill_target))
    first_drop = next(t for t, p in history if p < 6)
    assert first_drop >= 5.0 + cfg.downscale_delay_s  # wanted from t=5, so not before t=65
    drops = [b - a for (_, a), (_, b) in zip([(0, 6)] + history, history) if b != a]
    assert all(step == -1 for step in drops)
    assert history[-1][1] == 3  # one step per delay: t=65, 125, 185


def test_a_short_spike_is_ignored():
    cfg = make_config(upscale_delay_s=20.0)
    hot = MetricsSnapshot(prefill(2, prompt_tokens_per_s=5 * CAP), calm(2, 2).decode)
    state = PolicyState()
    for i in range(30):  # 10 s hot, 10 s calm, repeated: never hot for the full 20 s
        snap = hot if (i // 2) % 2 == 0 else calm(2, 2)
        d = decide(snap, cfg, state, now=i * 5.0)
        state = d.state
        assert d.prefill_target == 2


def test_step_limits_hold():
    cfg = make_config(upscale_delay_s=0.0, downscale_delay_s=0.0, max_step_up=3, max_step_down=2,
                      prefill_max=50, decode_max=50)
    huge = MetricsSnapshot(prefill(1, prompt_tokens_per_s=100 * CAP),
                           decode(1, kv_frac=1.0, running_seqs=3000))
    targets = drive(cfg, lambda p, d, i: huge if i < 10 else MetricsSnapshot(prefill(p), decode(d, 0.0)), 40,
                    start=(1, 1))
    steps = [(b[0] - a[0], b[1] - a[1]) for a, b in zip([(1, 1)] + targets, targets)]
    assert all(-2 <= dp <= 3 and -2 <= dd <= 3 for dp, dd in steps)
    assert max(p for p, _ in targets) == 31 and targets[-1] == (1, 1)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10_000))
def test_bounds_and_ratio_always_hold(seed):
    rng = random.Random(seed)
    pmin, dmin = rng.randint(0, 3), rng.randint(1, 3)
    lo = rng.choice([None, 0.25, 0.5, 1.0])
    hi = rng.choice([None, 1.0, 2.0, 3.0])
    if lo is not None and hi is not None and lo > hi:
        lo, hi = hi, lo
    try:
        cfg = make_config(prefill_min=pmin, prefill_max=pmin + rng.randint(0, 8), decode_min=dmin,
                          decode_max=dmin + rng.randint(0, 8), min_ratio=lo, max_ratio=hi,
                          max_workers=rng.choice([None, pmin + dmin + rng.randint(0, 6)]),
                          upscale_delay_s=rng.choice([0.0, 10.0]), downscale_delay_s=rng.choice([0.0, 30.0]),
                          max_step_up=rng.randint(1, 4), max_step_down=rng.randint(1, 3))
    except ConfigError:
        return  # infeasible bounds are rejected up front
    state = PolicyState()
    p, d = rng.randint(0, 12), rng.randint(0, 12)  # live sizes may start anywhere
    for i in range(40):
        snap = MetricsSnapshot(
            prefill(p, queued_prompt_tokens=rng.randint(0, 200_000),
                    prompt_tokens_per_s=rng.uniform(0, 20 * CAP),
                    ttft_p90=rng.choice([None, rng.uniform(0, 5)])),
            DecodeMetrics(size=d, running_seqs=rng.randint(0, 500), waiting_seqs=rng.randint(0, 50),
                          kv_blocks_total=BLOCKS * d, kv_blocks_used=rng.randint(0, BLOCKS * d),
                          tpot_p90=rng.choice([None, rng.uniform(0, 0.2)])))
        dec = decide(snap, cfg, state, now=i * cfg.period_s)
        state = dec.state
        assert cfg.prefill_min <= dec.prefill_target <= cfg.prefill_max
        assert cfg.decode_min <= dec.decode_target <= cfg.decode_max
        assert ratio_ok(dec.prefill_target, dec.decode_target, cfg)
        if cfg.max_workers is not None:
            assert dec.prefill_target + dec.decode_target <= cfg.max_workers
        if rng.random() < 0.7:  # pools usually reach their targets, sometimes lag
            p, d = dec.prefill_target, dec.decode_target


def test_a_pool_past_its_need_gives_its_gpu_to_the_other_at_once():
    """Four GPUs, pools 1..3 each: prefill grew to 3 for a burst that is over (it needs 1 now, but
    its scale-down waits 60 s), and decode's KV is full. Without a budget decode would ask for a
    fifth GPU that no node has; with it, prefill gives one up now (bounds 1..3 on each pool and
    four GPUs let whichever pool grew first lock the other out: the simulated four-H200 ramp)."""
    cfg = make_config(prefill_max=3, decode_max=3, max_workers=4, upscale_delay_s=0.0)
    state = PolicyState()
    busy = MetricsSnapshot(prefill(3, queued_prompt_tokens=int(5 * CAP), ttft_p90=3.0), decode(1, kv_frac=0.3))
    d = decide(busy, cfg, state, now=0.0)
    assert (d.prefill_target, d.decode_target) == (3, 1)
    quiet = MetricsSnapshot(prefill(3, prompt_tokens_per_s=0.2 * CAP, ttft_p90=0.2), decode(1, kv_frac=0.99))
    d = decide(quiet, cfg, d.state, now=5.0)
    assert (d.prefill_target, d.decode_target) == (2, 2)
    assert any("budget of 4 workers" in r for r in d.reasons)
    unbounded = make_config(prefill_max=3, decode_max=3, upscale_delay_s=0.0)
    d = decide(quiet, unbounded, decide(busy, unbounded, PolicyState(), now=0.0).state, now=5.0)
    assert (d.prefill_target, d.decode_target) == (3, 2)        # five: one actor would never start


def test_when_both_pools_need_more_than_the_budget_neither_is_cut_below_what_it_has():
    from tandem.cluster.autoscaler import fit_budget

    cfg = make_config(prefill_max=6, decode_max=6, max_workers=6)
    assert fit_budget(3, 4, need=(3, 4), current=(3, 2), cfg=cfg) == (3, 3)   # decode gets the one GPU left
    assert fit_budget(4, 4, need=(4, 4), current=(2, 2), cfg=cfg) == (3, 3)   # growth shared
    assert fit_budget(5, 3, need=(5, 3), current=(1, 3), cfg=cfg) == (3, 3)   # the furthest short first
    assert fit_budget(2, 2, need=(2, 2), current=(2, 2), cfg=cfg) == (2, 2)   # within budget: unchanged
    assert fit_budget(3, 4, need=(1, 4), current=(3, 3), cfg=cfg) == (2, 4)   # prefill's spare goes


def test_ratio_conflicts_add_to_the_short_side_first():
    cfg = make_config(max_ratio=1.0, decode_max=6)
    assert apply_ratio(4, 2, cfg) == (4, 4)  # decode raised: nothing cut
    cfg = make_config(max_ratio=1.0, decode_max=3)
    assert apply_ratio(5, 2, cfg) == (3, 3)  # decode can only reach 3, so prefill is cut to 3
    cfg = make_config(min_ratio=0.5)
    assert apply_ratio(1, 6, cfg) == (3, 6)
    assert apply_ratio(2, 4, cfg) == (2, 4)  # already inside


def test_reasons_explain_the_decision():
    cfg = make_config(upscale_delay_s=0.0)
    snap = MetricsSnapshot(prefill(2, queued_prompt_tokens=12_800, prompt_tokens_per_s=2 * CAP, ttft_p90=1.8),
                           calm(2, 2).decode)
    d = decide(snap, cfg, PolicyState(), now=0.0)
    text = "\n".join(d.reasons)
    assert "prefill 2 -> 4" in text and "12800 tokens waiting" in text and "TTFT p90 1.8 s" in text
    assert "decode holds at 2" in text
    d = decide(snap, make_config(upscale_delay_s=30.0), PolicyState(), now=0.0)
    assert "up for 0 s of 30 s delay" in "\n".join(d.reasons)


def test_max_workers_must_hold_both_minimums():
    with pytest.raises(ConfigError, match="max_workers"):
        make_config(prefill_min=2, decode_min=2, max_workers=3)
    with pytest.raises(ConfigError, match="within max_workers"):
        make_config(prefill_min=1, decode_min=1, min_ratio=2.0, max_workers=2)
    assert make_config(max_workers=4).max_workers == 4


def test_config_validation_and_from_dict():
    assert AutoscalerConfig.from_dict({"prefill_max": 3, "max_ratio": 2.0}).prefill_max == 3
    assert AutoscalerConfig.from_dict(AutoscalerConfig().to_dict()) == AutoscalerConfig()
    bad = [{"decode_min": 0}, {"prefill_min": 3, "prefill_max": 2}, {"kv_low_watermark": 0.9},
           {"low_utilization": 0.9}, {"min_ratio": 2.0, "max_ratio": 1.0}, {"upscale_delay_s": -1},
           {"max_step_up": 0}, {"slo_percentile": "p75"}, {"ttft_target_s": 0},
           # ratio bounds no in-bounds pair can meet: prefill >= 5 but at most 1 per decode, decode <= 2
           {"prefill_min": 5, "prefill_max": 6, "decode_max": 2, "max_ratio": 1.0}]
    for b in bad:
        with pytest.raises(ConfigError):
            AutoscalerConfig.from_dict(b)
    with pytest.raises(ConfigError, match="unknown"):
        AutoscalerConfig.from_dict({"prefil_max": 3})
