"""cluster.layouts: the layout comparison's cluster configs (the two headline modes, and --layouts for
the pool-ratio sweep: P:D splits, 0:N colocated) that `tandem up` is started with, and the
simulator's predictions beside them (cluster.layout_predictions)."""

import json
import math
from types import SimpleNamespace

import pytest
import yaml

from tandem.cluster.layout_predictions import print_predictions, simulate_beside
from tandem.cluster.config import load_config
from tandem.cluster.layouts import engine_overlaps, layout_perf, mode_configs, predict, recorded_router, router_limits
from tandem.perf_model import PerfModel
from tandem.placement import OverloadLimits
from tandem.router.admission import AdmissionConfig


def _args(**kw):
    base = dict(device="cuda", model="llama3-8b-random", chunk=8192, max_num_seqs=64, speculative="ngram",
                num_blocks=0, gpus=2, prefill=0, threshold=256, layouts="")
    return SimpleNamespace(**{**base, **kw})


def test_two_modes_split_the_gpus():
    c = mode_configs(_args())
    assert (c["disaggregated"]["prefill"]["replicas"], c["disaggregated"]["decode"]["replicas"]) == (1, 1)
    assert c["disaggregated"]["decode"]["local_prefill_threshold"] == 256
    assert math.isinf(c["disaggregated"]["prefill"]["max_queued_tokens"])
    assert mode_configs(_args(prefill_queue_limit=16384))["disaggregated"]["prefill"]["max_queued_tokens"] == 16384
    assert (c["colocated"]["prefill"]["replicas"], c["colocated"]["decode"]["replicas"]) == (0, 2)
    assert math.isinf(c["colocated"]["decode"]["local_prefill_threshold"])
    assert c["colocated"]["decode"]["num_gpus"] == 1 and c["colocated"]["model"]["dtype"] == "bfloat16"
    # the same decode slots in both: the one decode actor holds both GPUs' worth
    assert c["disaggregated"]["scheduler"]["max_num_seqs"] == 128
    assert c["colocated"]["scheduler"]["max_num_seqs"] == 64
    assert c["colocated"]["scheduler"]["max_num_batched_tokens"] == 8192


def test_the_perf_model_overlaps_steps_where_the_layouts_engine_does():
    """`LLMEngine.overlap`: CUDA, one rank, no speculation; the simulator replays what ran."""
    c = mode_configs(_args(speculative="off"))["colocated"]
    assert engine_overlaps(c) and layout_perf(c, PerfModel())[0].overlap
    assert not engine_overlaps(mode_configs(_args())["colocated"])                   # n-gram drafts
    assert not engine_overlaps(mode_configs(_args(speculative="off", device="cpu"))["colocated"])
    tp2 = {**c, "decode": {**c["decode"], "tensor_parallel_size": 2}}
    assert not engine_overlaps(tp2)


def test_a_recorded_router_section_gives_the_limits_the_router_enforced():
    """The replay sheds what the recorded router shed: its admission limits and worker overload
    limits, RouterConfig's defaults for what the section leaves out, and a key that RouterConfig no
    longer names (an older run's) ignored rather than refused."""
    router = recorded_router({"router": {"max_expected_wait_s": None, "max_queue": 7, "worker_max_waiting": 3,
                                         "batch_guard": False, "retired_option": 1}})
    limits = router_limits(router)
    assert limits["admission"] == AdmissionConfig(max_queue=7, max_expected_wait_s=None)
    assert limits["overload"] == OverloadLimits(max_waiting=3)
    assert limits["batch_guard"] is False
    assert router_limits(recorded_router({})) == {"admission": AdmissionConfig(), "overload": OverloadLimits(),
                                                  "batch_guard": True}


def test_layouts_give_one_config_per_split():
    c = mode_configs(_args(layouts="1:3,2:2,3:1,0:4"))
    assert list(c) == ["1P:3D", "2P:2D", "3P:1D", "colocated x4"]
    assert [(v["prefill"]["replicas"], v["decode"]["replicas"]) for v in c.values()] == [(1, 3), (2, 2), (3, 1), (0, 4)]
    assert c["3P:1D"]["decode"]["local_prefill_threshold"] == 256
    assert [v["scheduler"]["max_num_seqs"] for v in c.values()] == [86, 128, 256, 64]
    assert math.isinf(c["colocated x4"]["decode"]["local_prefill_threshold"])
    with pytest.raises(SystemExit, match="P:D"):
        mode_configs(_args(layouts="2:0"))


def test_simulator_predictions_replay_the_benchs_own_requests(tmp_path):
    """--simulate: for a measured layout and rate, the simulator runs the same sessions the bench
    sent (workload, seed, count, start times, duration cut-off) on that layout and reports its
    prediction beside the measurement."""
    (tmp_path / "config-1P_1D.yaml").write_text(yaml.safe_dump(
        {"prefill": {"replicas": 1}, "decode": {"replicas": 1, "local_prefill_threshold": 256}}))
    (tmp_path / "config-colocated_x2.yaml").write_text(yaml.safe_dump(
        {"prefill": {"replicas": 0}, "decode": {"replicas": 2, "local_prefill_threshold": float("inf")}}))
    measured = {"goodput_rps": 1.0, "ttft_ms": {"p90": 200.0}, "tpot_ms": {"p90": 12.0}, "requests": 30}
    report = {"config": {"workload": "agent", "seed": 0, "max_sessions": None, "rates": [0.5, 1.0],
                         "duration_s": 20.0, "max_context": 32768, "slo": {"ttft_ms": 1000.0, "tpot_ms": 40.0}},
              "runs": [{"rate": 0.5, "summary": measured}, {"rate": 1.0, "summary": measured}]}
    rows = simulate_beside({"1P:1D": report, "colocated x2": report}, tmp_path, None)
    assert [(r["layout"], r["rate"]) for r in rows] == [("1P:1D", 0.5), ("1P:1D", 1.0),
                                                        ("colocated x2", 0.5), ("colocated x2", 1.0)]
    for r in rows:
        assert r["goodput"][0] == 1.0 and r["goodput"][1] > 0
        assert r["ttft_p90_ms"][1] > 0 and r["tpot_p90_ms"][1] > 0
        assert r["requests"][1] > 0
    assert rows[1]["requests"][1] > rows[0]["requests"][1]        # twice the sessions at rate 1
    assert (tmp_path / "simulated.json").is_file()


def test_predict_gives_each_layout_the_benchs_decode_slots_and_starts_nothing(tmp_path, capsys):
    """--predict: every layout and rate through the simulator on the requests the bench would send,
    each layout with the decode slots the bench would give it; TTFT/TPOT p50/p90/p99 and goodput."""
    args = _args(layouts="1:1,0:2", workload="agent-small", rates="1,2", duration=10.0, seed=0, max_context=0,
                 model="tiny-random", perf=None, ttft_slo_ms=1000.0, tpot_slo_ms=40.0, out=str(tmp_path))
    configs = mode_configs(args)
    rows = print_predictions(configs, args)
    assert [(r["layout"], r["rate"], r["decode_slots"]) for r in rows] == [
        ("1P:1D", 1.0, 128), ("1P:1D", 2.0, 128), ("colocated x2", 1.0, 64), ("colocated x2", 2.0, 64)]
    assert all(r["requests"] > 0 and r["ttft_p99"] >= r["ttft_p90"] >= r["ttft_p50"] > 0 for r in rows)
    assert "TTFT ms p50/p90/p99" in capsys.readouterr().out
    saved = json.loads((tmp_path / "predicted.json").read_text())
    assert saved["bench"]["max_context"] == 2048 and len(saved["rows"]) == 4   # tiny-random's context
    # the slots matter: a 1P:1D decode worker held to 1 slot predicts a much longer TTFT
    bench = saved["bench"]
    one_slot = {**configs["1P:1D"], "scheduler": {**configs["1P:1D"]["scheduler"], "max_num_seqs": 1}}
    assert predict(one_slot, bench, PerfModel())[2.0].ttft_p90 > 2 * rows[1]["ttft_p90"]


def test_the_adaptive_layout_runs_live_as_tandem_up_would_and_is_predicted_by_the_adaptive_simulation(tmp_path):
    c = mode_configs(_args(layouts="adaptive,0:2,adaptive-unguarded", gpus=2, perf="p.json", ttft_slo_ms=500,
                           tpot_slo_ms=25))
    assert list(c) == ["adaptive x2", "colocated x2", "adaptive x2 unguarded"]
    ada = c["adaptive x2"]
    path = tmp_path / "ada.yaml"
    path.write_text(yaml.safe_dump(ada))
    cfg = load_config(path)                  # what `tandem up --config` reads
    assert cfg.roles.enabled and cfg.router.placement == "cost" and cfg.decode.role == "mixed"
    assert cfg.router.batch_guard
    unguarded = c["adaptive x2 unguarded"]
    assert unguarded["router"]["batch_guard"] is False and {**unguarded, "router": None} == {**ada, "router": None}
    assert (cfg.prefill.replicas, cfg.decode.replicas) == (0, 2) and cfg.decode.local_prefill_threshold == 0
    assert (cfg.router.perf_model, cfg.router.slo_ttft_ms, cfg.router.slo_tpot_ms) == ("p.json", 500, 25)
    with pytest.raises(SystemExit, match="0:N"):
        mode_configs(_args(layouts="colocated"))
    bench = {"workload": "agent", "seed": 0, "rates": [0.5], "duration_s": 20, "max_sessions": None,
             "max_context": 8192, "slo": {"ttft_ms": 500, "tpot_ms": 25}}
    perf = PerfModel()
    got = predict(ada, bench, perf)[0.5]
    assert got.label.startswith("adaptive") and got.requests > 0
