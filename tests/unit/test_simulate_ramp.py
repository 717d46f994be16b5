"""`tandem simulate --ramp`: the bench's rate ramp on one timeline, the autoscaler in the loop with
a GPU budget (`max_workers`), and the report in `tandem bench`'s shape. Small perf model, CPU only."""

import json
import random

import pytest
import yaml

from tandem.cluster.loadgen import load_sessions, plan_ramp, plan_sessions
from tandem.cluster.workloads import RequestSpec
from tandem.cluster.autoscaler import AutoscalerConfig
from tandem.cluster.cli import main
from tandem.cluster.simulate_ramp import ramp_plan, run_ramp, step_summaries
from tandem.cluster.sim_model import SLO
from tandem.perf_model import PerfModel
from tandem.cluster.simulator import simulate

# One prefill worker does ~5k prompt tokens/s: the small agent profile at 4 sessions/s overloads it.
PERF = PerfModel(prefill_base_s=0.001, prefill_per_token_s=2e-4, prefill_attn_s=0.0,
                 decode_base_s=0.005, decode_per_seq_s=0.002, decode_per_ctx_token_s=0.0,
                 transfer_base_s=0.0, transfer_per_token_s=1e-6, local_prefill_threshold=16,
                 max_batch=64, max_step_tokens=512, kv_capacity_tokens=400_000, block_tokens=16)
AUTO = AutoscalerConfig(prefill_min=1, prefill_max=3, decode_min=1, decode_max=3, period_s=1.0,
                        upscale_delay_s=2.0, downscale_delay_s=5.0, ttft_target_s=0.5, tpot_target_s=0.05)
SLO_ = SLO(0.5, 0.05)


def test_plan_ramp_lays_the_benchs_runs_end_to_end():
    sessions = load_sessions("agent-small", None, random.Random(0), num_sessions=80, max_context=None)
    plan = plan_ramp(sessions, [1.0, 3.0], 20.0)
    assert plan.step_starts_s == (0.0, 20.0)
    for i, (rate, t0) in enumerate(zip([1.0, 3.0], plan.step_starts_s)):
        bench = plan_sessions(sessions, session_workload=True, rate=rate, duration_s=20.0)
        mine = {sid: t for sid, t in plan.send_until_s.items() if sid.startswith(f"r{i}-")}
        assert len(mine) == len(bench) and set(mine.values()) == {t0 + 20.0}
        firsts = sorted(r.arrival_s for r in plan.specs if r.session_id in mine and r.turn == 0)
        assert firsts == pytest.approx(sorted(t0 + s.start_s for s in bench))
        assert sum(r.session_id in mine for r in plan.specs) == sum(len(s.specs) for s in bench)
    assert [r.arrival_s for r in plan.specs] == sorted(r.arrival_s for r in plan.specs)


def test_each_session_stops_at_its_own_cut_off():
    specs = [RequestSpec(sid, t, 0.0, 200, 20, shared_prefix_tokens=0 if t == 0 else 150, think_s=5.0)
             for sid in ("a", "b") for t in range(6)]
    res = simulate(specs, 1, 1, PERF, closed_loop=True, send_until_s={"a": 6.0, "b": 100.0})
    sent = {sid: [r for r in res.requests if r.session_id == sid] for sid in ("a", "b")}
    assert 1 <= len(sent["a"]) < 6 and all(r.arrival_s < 6.0 for r in sent["a"])
    assert len(sent["b"]) == 6


def test_autoscaled_ramp_grows_under_the_high_rate_and_shrinks_after_within_the_gpus():
    # two low steps after the high one: the high step's latencies stay in the workers' 30 s window
    # (which the simulated controller reads, as the live one does) through the first
    rates = [0.5, 4.0, 0.5, 0.5]
    plan = ramp_plan("coding-agent-small", rates, 30.0)
    res = run_ramp(plan, 1, 1, PERF, SLO_, AUTO, max_workers=4, worker_startup_s=3.0)
    samples = res.pool_sizes
    step = lambda i: [s for s in samples if 30.0 * i <= s.time_s < 30.0 * (i + 1)]  # noqa: E731
    live = lambda s: s.prefill_live + s.decode_live  # noqa: E731
    assert all(live(s) == 2 for s in step(0))                         # low rate: the minimum
    assert max(live(s) for s in step(1)) >= 3                          # high rate: grown
    assert samples[-1].prefill_target == samples[-1].decode_target == 1  # and back down after it
    assert min(live(s) for s in step(3)[-3:]) < max(live(s) for s in step(1))
    # four GPUs: the pools together never hold more, though the targets ask for more
    assert all(live(s) <= 4 for s in samples)
    assert any(s.prefill_target + s.decode_target > 4 for s in samples)
    assert max(s.prefill_live for s in samples) >= 2    # prefill got a GPU once decode drained one
    # nothing lost: every sent turn finished, each step's turns arrived inside it
    assert res.summary.rejected == 0 and all(r.e2e_s is not None for r in res.requests)
    for i in range(4):
        arrivals = [r.arrival_s for r in res.requests if r.session_id.startswith(f"r{i}-")]
        assert arrivals and 30.0 * i <= min(arrivals) and max(arrivals) < 30.0 * (i + 1)
    steps = step_summaries(res, plan, rates, SLO_)
    assert [s.label for s in steps] == ["step 1: 0.5/s", "step 2: 4/s", "step 3: 0.5/s", "step 4: 0.5/s"]
    assert sum(s.requests for s in steps) == res.summary.requests
    assert steps[1].mean_workers > steps[0].mean_workers


def test_start_sizes_past_max_workers_are_refused():
    with pytest.raises(ValueError, match="max_workers"):
        simulate([RequestSpec("a", 0, 0.0, 100, 4)], 3, 2, PERF, max_workers=4)


def test_cli_runs_the_ramp_from_a_cluster_yaml_and_writes_benchs_report_shape(tmp_path, capsys):
    cfg = tmp_path / "ramp.yaml"
    cfg.write_text(yaml.safe_dump({
        "decode": {"local_prefill_threshold": 16}, "scheduler": {"max_num_seqs": 64, "max_num_batched_tokens": 512},
        "autoscaler": {"enabled": True, **{k: v for k, v in AUTO.to_dict().items() if v is not None}}}))
    perf = tmp_path / "perf.json"
    perf.write_text(json.dumps(PERF.to_dict()))
    argv = ["simulate", "--workload", "coding-agent-small", "--config", str(cfg), "--perf", str(perf),
            "--ramp", "0.5,4,0.5", "--step-s", "30", "--max-workers", "4", "--worker-startup-s", "3",
            "--ttft-slo", "0.5", "--out", str(tmp_path), "--label", "t"]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "step 2: 4/s" in text and "live workers per step" in text
    report = json.loads((tmp_path / "sim-t.json").read_text())
    assert [r["rate"] for r in report["runs"]] == [0.5, 4.0, 0.5]
    assert [r["started_s"] for r in report["runs"]] == [0.0, 30.0, 60.0]
    assert report["config"]["autoscaler"]["prefill_max"] == 3 and report["config"]["perf"]["max_batch"] == 64
    assert max(p["pools"]["decode"]["size"] + p["pools"]["prefill"]["size"] for p in report["pool_timeline"]) >= 3
    assert all(r["status"] == "OK" and 0 <= r["arrival_s"] < 30.0 for run in report["runs"] for r in run["requests"])
    pytest.importorskip("matplotlib")
    assert (tmp_path / "sim-t-timeline.png").stat().st_size > 0


def test_cli_refuses_out_without_a_ramp_and_keeps_the_plain_run(tmp_path, capsys):
    assert main(["simulate", "--workload", "coding-agent-small", "--sessions", "4", "--out", str(tmp_path)]) == 2
    assert main(["simulate", "--workload", "coding-agent-small", "--sessions", "4", "--closed-loop"]) == 0
    assert "1P:1D" in capsys.readouterr().out

