"""The adaptive layout in the simulator (cluster/sim_adaptive.py): prompts placed by the cost
model, workers lent to prefill only by the role policy, and `tandem simulate --compare`."""

from __future__ import annotations

import json
import random
from dataclasses import replace
from pathlib import Path

import pytest

from tandem.cluster.cli import main
from tandem.cluster.roles import RoleConfig
from tandem.cluster.sim_engine import Simulation
from tandem.cluster.sim_model import SLO
from tandem.cluster.simulate_compare import compare
from tandem.cluster.simulator import simulate
from tandem.cluster.workloads import PROFILES, RequestSpec, coding_agent_sessions
from tandem.perf_model import PerfModel

H200 = PerfModel(prefill_base_s=0.0028, prefill_per_token_s=2e-5, prefill_attn_s=8.4e-10, decode_base_s=0.0056,
                 decode_per_seq_s=1.2e-5, decode_per_ctx_token_s=3.4e-8, transfer_base_s=0.003,
                 transfer_per_token_s=4e-7, request_overhead_s=0.005, remote_overhead_s=0.015,
                 max_batch=256, max_step_tokens=8192, kv_capacity_tokens=800_000)


def agents(rate: float, n: int, seed: int = 0) -> list[RequestSpec]:
    return coding_agent_sessions(random.Random(seed), n, rate, PROFILES["coding-agent"])


def test_adaptive_is_never_much_worse_than_colocated_on_agent_sessions():
    specs = agents(0.5, 30)
    slo = SLO(1.0, 0.040)
    colo = simulate(specs, 0, 2, H200, slo, colocated=True, closed_loop=True, send_until_s=60).summary
    ada = simulate(specs, 0, 2, H200, slo, adaptive=RoleConfig(), closed_loop=True, send_until_s=60).summary
    assert ada.rejected == colo.rejected == 0
    assert ada.goodput_rps >= 0.97 * colo.goodput_rps
    assert ada.label == "adaptive x2"


def test_the_batch_guard_sheds_past_capacity_and_changes_nothing_below_it():
    """The cost-placing router's batch guard (RouterConfig.batch_guard), simulated: on two GPUs
    past capacity it refuses requests that would slow their batch past TPOT 15 ms, and serves more
    within both SLOs than admitting them all; below capacity it refuses none and the run is the
    same as without it."""
    slo = SLO(2.0, 0.015)

    def run(rate: float, n: int, guard: bool):
        return simulate(agents(rate, n), 0, 2, H200, slo, adaptive=RoleConfig(), closed_loop=True,
                        send_until_s=60, batch_guard=guard).summary
    over, guarded = run(6.0, 240, False), run(6.0, 240, True)
    assert over.rejected == 0 and guarded.rejected > 0
    assert guarded.goodput_rps > 1.3 * over.goodput_rps
    assert guarded.tpot_p90 < over.tpot_p90 / 2
    calm, calm_guarded = run(1.0, 60, False), run(1.0, 60, True)
    assert calm_guarded.rejected == 0 and calm_guarded == calm


def prompt_flood_then_decodes() -> list[RequestSpec]:
    """Long decodes beside a flood of long prompts (a prefill-heavy phase), on 4 workers."""
    decodes = [RequestSpec(f"d{i}", 0, 0.01 * i, 2000, 6000) for i in range(64)]
    prompts = [RequestSpec(f"p{i}", 0, 1.0 + 0.03 * i, 2000, 4) for i in range(1000)]
    return decodes + prompts


def test_a_prefill_heavy_phase_lends_workers_to_prefill_and_every_request_is_served():
    slo = SLO(1.0, 0.012)
    sim = Simulation(prompt_flood_then_decodes(), 0, 4, H200, slo, None, 0, False, 60.0, False, False,
                     adaptive=RoleConfig(min_hold_s=2.0, period_s=0.5, window_s=2.0))
    sim.run()
    res = sim.result("adaptive", 0, 4)
    assert res.summary.rejected == 0 and all(r.ttft_s is not None for r in res.requests)
    lent = [d for d in sim.role_log if d.prefill_workers > d.previous]
    assert lent, "no worker was lent to prefill"
    assert all(b.time_s - a.time_s >= 2.0 for a, b in zip(sim.role_log, sim.role_log[1:]))   # held
    assert any(r.prefill == "remote" for r in res.requests)
    # the flood over, the decodes alone: the workers come back to decode
    assert sim.role_log[-1].prefill_workers < max(d.prefill_workers for d in sim.role_log)


def test_a_remote_prefill_on_another_worker_delivers_its_kv_to_the_decode_worker():
    # worker 0 decodes 32 long sequences, worker 1 is lent to prefill: a long prompt's best place
    # is worker 1, which ships the KV back to worker 0
    reqs = [RequestSpec(f"b{i}", 0, 0.0, 8000, 800) for i in range(32)] + [RequestSpec("long", 0, 0.5, 16_000, 8)]
    sim = Simulation(reqs, 0, 2, H200, SLO(1.0, 0.015), None, 0, False, 60.0, False, False,
                     adaptive=RoleConfig(window_s=1e9))
    sim.decodes[1].role = "prefill"
    sim.run()
    res = sim.result("adaptive", 0, 2)
    long = next(r for r in res.requests if r.session_id == "long")
    assert long.prefill == "remote" and long.ttft_s is not None and long.tpot_s is not None
    assert res.summary.rejected == 0 and all(r.ttft_s is not None for r in res.requests)
    assert sim.decodes[1].cache.entries.get(("s", "long")) == 16_000    # cached where it was computed


def test_compare_runs_each_layout_on_the_same_sessions():
    rows = compare(replace(H200, max_batch=64), ["adaptive", "colocated", "1:1"], 2, [0.5], SLO(1.0, 0.04),
                   duration_s=20)
    assert [r["layout"] for r, _ in rows] == ["adaptive", "colocated", "1:1"]
    assert len({r["requests"] for r, _ in rows}) >= 1
    assert {"goodput", "ttft_p90_ms", "tpot_p90_ms", "rate"} <= set(rows[0][0])
    assert rows[0][0]["role_changes"] >= 0 and "role_changes" not in rows[1][0]


def test_simulate_compare_prints_one_json_object_per_layout_and_rate(capsys):
    rc = main(["simulate", "--compare", "adaptive,colocated,1:1", "--gpus", "2", "--rates", "0.5,1",
               "--duration", "10", "--ttft-slo-ms", "1000", "--tpot-slo-ms", "40", "--json"])
    assert rc == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [(x["layout"], x["rate"]) for x in lines] == [(lay, r) for r in (0.5, 1.0)
                                                         for lay in ("adaptive", "colocated", "1:1")]
    assert all(x["tpot_slo_ms"] == 40 and x["ttft_slo_ms"] == 1000 for x in lines)


def test_compare_runs_the_adaptive_layout_with_and_without_its_batch_guard():
    rows = {r["layout"]: r for r, _ in compare(H200, ["adaptive", "adaptive-unguarded"], 2, [6.0],
                                               SLO(2.0, 0.015), duration_s=40)}
    guarded, unguarded = rows["adaptive"], rows["adaptive-unguarded"]
    assert guarded["rejected"] > unguarded["rejected"] == 0
    assert guarded["tpot_p90_ms"] < unguarded["tpot_p90_ms"] and guarded["goodput"] > unguarded["goodput"]


def test_simulate_compare_refuses_a_layout_it_does_not_know(capsys):
    assert main(["simulate", "--compare", "adaptive,3:3", "--gpus", "2", "--json"]) == 2
    assert "3:3" in capsys.readouterr().err


def test_simulate_compare_sheds_what_the_configs_router_sheds(tmp_path, capsys):
    """--compare runs the router's admission limiter as --config sets it: an overloaded GPU whose
    router refuses a predicted wait past 0.5 s rejects requests (and serves the rest sooner), the
    default router (15 s) rejects none of these, and --no-admission turns the limiter off."""
    cfg = tmp_path / "cluster.yaml"
    cfg.write_text("router:\n  max_expected_wait_s: 0.5\n")
    argv = ["simulate", "--compare", "colocated", "--gpus", "1", "--rates", "3", "--duration", "20", "--json"]

    def run(*extra):
        assert main(argv + list(extra)) == 0
        return json.loads(capsys.readouterr().out.splitlines()[0])
    default, strict, off = run(), run("--config", str(cfg)), run("--config", str(cfg), "--no-admission")
    assert default["rejected"] == 0 and off == default
    assert strict["rejected"] > 0 and strict["ttft_p50_ms"] < default["ttft_p50_ms"] / 2


def test_simulate_adds_the_load_terms_of_recorded_runs(capsys):
    """`--load-from RUN_DIR`: the perf model plus what the run's loaded worker paid beyond its idle
    calibration (fitted on its step trace), so the same workload's TPOT comes out higher; a
    directory without a step trace is refused by name."""
    root = Path(__file__).resolve().parents[2]
    argv = ["simulate", "--compare", "colocated", "--gpus", "1", "--rates", "1", "--duration", "20",
            "--perf", str(root / "bench/perf/h200-llama3-8b-calibrated.json"), "--json"]
    assert main(argv) == 0
    plain = json.loads(capsys.readouterr().out.splitlines()[0])
    assert main(argv + ["--load-from", str(root / "bench/results/h200-colocated-11")]) == 0
    loaded = json.loads(capsys.readouterr().out.splitlines()[0])
    assert loaded["tpot_p90_ms"] > plain["tpot_p90_ms"] * 1.02
    assert main(argv + ["--load-from", str(root / "bench/results/h200-colocated-2")]) == 2
    assert "h200-colocated-2 holds a step trace" in capsys.readouterr().err


def test_profile_takes_load_terms_only_from_runs_of_its_model(tmp_path, capsys):
    """`tandem profile --load-from`: the terms of a run of this model, device and dtype go into the
    written model; a run of another model is refused by name (its loaded worker is not this one)."""
    root = Path(__file__).resolve().parents[2]
    base = ["profile", "--from", str(root / "bench/perf/cpu-smollm2-135m-profile-4.json"), "-o", str(tmp_path / "p.json")]
    assert main(base + ["--load-from", str(root / "bench/results/cpu-colocated-3")]) == 0
    written = json.loads((tmp_path / "p.json").read_text())
    assert written["load_terms"]["runs"] == ["cpu-colocated-3"]
    plain = json.loads((root / "bench/perf/cpu-smollm2-135m-profile-4.json").read_text())["perf_model"]
    terms = written["load_terms"]
    assert terms["per_seq_s"] > 0
    assert written["perf_model"]["decode_per_seq_s"] == pytest.approx(plain["decode_per_seq_s"] + terms["per_seq_s"])
    assert written["perf_model"]["step_host_s"] == pytest.approx(plain["step_host_s"] + terms["step_host_s"])
    capsys.readouterr()
    assert main(base + ["--load-from", str(root / "bench/results/h200-colocated-9")]) == 2
    assert "h200-colocated-9: recorded ('llama3-8b-random', 'cuda', 'bfloat16')" in capsys.readouterr().err
