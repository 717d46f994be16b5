"""engine.step_trace: what each step carried and how long it took, as a served engine writes it
under $TANDEM_STEP_TRACE_DIR, and the step check that prices those steps with the perf model
(cluster/step_check.py, printed by bench.validate_simulator)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from tandem.cluster.step_check import kind_of, model_s, step_rows
from tandem.engine.config import CacheConfig, EngineConfig
from tandem.engine.engine import LLMEngine
from tandem.engine.step_trace import TRACE_ENV, StepTrace, read_traces, step_times
from tandem.perf_model import PerfModel
from tandem.wire.messages import SamplingParams


def _sched(*items):
    """ScheduledRequest-likes: (computed, prompt, new, drafts)."""
    return [SimpleNamespace(request=SimpleNamespace(num_computed_tokens=c, num_prompt_tokens=p),
                            num_new_tokens=n, num_draft_tokens=d) for c, p, n, d in items]


def test_a_step_is_split_into_its_decode_part_and_prefill_chunks(tmp_path):
    t = StepTrace(tmp_path / "steps-1.jsonl", flush_s=0.0)
    # two decoding sequences (100 and 50 tokens in, 3 and 1 drafts), one prompt chunk of 64 at 128
    t.begin(1000.0, _sched((99, 40, 4, 3), (49, 20, 2, 1), (128, 300, 64, 0)))
    t.end(overlapped=False, more=True, captured=True)
    t.begin(1001.0, _sched((103, 40, 1, 0)))
    t.end(overlapped=True, more=False, uncaptured=True)
    t.begin(1002.0, _sched((104, 40, 1, 0)))
    t.end(overlapped=False, more=False, split=True)
    ((line, second, third),) = read_traces(tmp_path)
    assert line[0] == 1000.0 and line[1] >= line[0]
    assert line[2:7] == [2, 103 + 51, 4, 3, [[64, 192]]]
    assert line[7:] == [False, True, True, False, False]
    assert second[7:] == [True, False, False, True, False]
    assert third[7:] == [False, False, False, False, True]


def _step(start, end, overlapped=False, more=True, decode=1):
    return [start, end, decode, 100, 0, 0, [], overlapped, more]


def test_step_times_follow_the_serving_loop():
    # resolved steps with more work: call start to the next call's start (the loop's work between is part)
    plain = [_step(0.0, 0.008), _step(0.010, 0.018), _step(0.020, 0.028, more=False), _step(5.0, 5.008)]
    got = [dt for _, dt in step_times(plain)]
    assert got == pytest.approx([0.010, 0.010, 0.008])   # the third: idle after it, its own call
    # overlapped: a step ran from its call's end to the end of the next call, which read it
    over = [_step(0.0, 0.001, True), _step(0.0012, 0.009, True), _step(0.0092, 0.017, True)]
    got = [dt for _, dt in step_times(over)]
    assert got == pytest.approx([0.008, 0.008])
    # an overlapped step whose next call came much later (the engine idled, a settle read it): left out
    assert step_times([_step(0.0, 0.001, True), _step(3.0, 3.009, True)]) == []


def test_the_step_check_prices_each_step_by_what_it_carried(tmp_path):
    perf = PerfModel(prefill_base_s=0.01, prefill_per_token_s=1e-4, prefill_attn_s=0.0, decode_base_s=0.005,
                     decode_per_seq_s=1e-3, decode_per_ctx_token_s=0.0, step_host_s=0.0, verify_step_s=0.002)
    decode = [0.0, 0.0, 4, 4000, 8, 2, [], False, True]
    assert kind_of(decode) == "decode 1-8"
    # padded to the widest draft, and the verify pass a drafting step pays
    assert model_s(perf, decode) == pytest.approx(0.005 + 4 * 0.001 * (1 + 2) + 0.002)
    assert model_s(perf, [0.0, 0.0, 4, 4000, 0, 0, [], False, True]) == pytest.approx(0.005 + 4 * 0.001)
    mixed = [0.0, 0.0, 4, 4000, 0, 0, [[600, 5000]], False, True]
    assert kind_of(mixed) == "prefill 500-2k"
    assert kind_of(decode + [True]) == "graph capture" and kind_of(decode + [False]) == "decode 1-8"
    assert kind_of(decode + [False, True]) == "eager, no graph" and kind_of(decode + [False, False]) == "decode 1-8"
    assert kind_of(decode + [False, False, True]) == "split, no graph"
    assert kind_of(decode + [False, False, False]) == "decode 1-8"
    assert model_s(perf, mixed) == pytest.approx(0.005 + 0.004 + 0.01 + 600 * 1e-4)
    # two rates' windows; each step 20 ms apart, so 20 ms each
    d = tmp_path / "steps"
    d.mkdir()
    rows = [[100.0 + 0.02 * i, 100.0 + 0.02 * i + 0.01, 4, 4000, 0, 0, [], False, True] for i in range(50)]
    (d / "steps-1.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    run = {"runs": [{"rate": 1, "started_unix": 100.0, "elapsed_s": 0.5}, {"rate": 2, "started_unix": 100.5,
                                                                            "elapsed_s": 0.5}]}
    got = step_rows(tmp_path, run, perf)
    assert [(r["rate"], r["kind"], r["steps"]) for r in got] == [(1, "decode 1-8", 25), (2, "decode 1-8", 24)]
    assert got[0]["measured_p50"] == pytest.approx(0.02) and got[0]["model_p50"] == pytest.approx(0.009)


def test_a_served_engine_traces_its_steps_only_when_asked(tmp_path, monkeypatch):
    monkeypatch.delenv(TRACE_ENV, raising=False)
    assert LLMEngine(EngineConfig(model="tiny-random", cache=CacheConfig(num_blocks=64))).trace is None
    monkeypatch.setenv(TRACE_ENV, str(tmp_path / "steps"))
    e = LLMEngine(EngineConfig(model="tiny-random", cache=CacheConfig(num_blocks=64)))
    e.add_request("a", prompt_token_ids=list(range(3, 40)), sampling=SamplingParams(max_tokens=5, ignore_eos=True))
    while e.has_unfinished():
        e.step()
    e.trace.flush()
    (steps,) = read_traces(tmp_path / "steps")
    assert steps[0][2] == 0 and steps[0][6] == [[37, 37]]       # the prompt, in one chunk
    assert [s[2:4] for s in steps[1:]] == [[1, 38], [1, 39], [1, 40], [1, 41]]  # then one sequence decodes
    assert steps[-1][8] is False                                  # nothing left after the last
    assert not any(s[9] for s in steps)                           # no CUDA graph on this CPU


def test_the_load_fit_separates_admission_mixed_steps_sequences_and_the_rest(tmp_path):
    """Traced steps the model prices at 10 ms that took 20 ms plus 0.2 ms per decoding sequence,
    4 ms more when a request arrived during them and 6 ms more when they mixed decodes with a
    prefill chunk: the fit gives back each term; the arrivals come from the run's run.json."""
    from tandem.cluster.step_check import fit_load, load_samples

    perf = PerfModel(prefill_base_s=0.0, prefill_per_token_s=0.0, prefill_attn_s=0.0, decode_base_s=0.010,
                     decode_per_seq_s=0.0, decode_per_ctx_token_s=0.0, step_host_s=0.0)
    rows, t, arrivals = [], 100.0, []
    for i in range(300):
        arrived, mixed, batch = i % 7 == 3, i % 5 == 1, 1 + i % 11
        dt = 0.020 + 0.0002 * batch + (0.004 if arrived else 0.0) + (0.006 if mixed else 0.0)
        rows.append([t, t + dt / 2, batch, 4000, 0, 0, [[8, 8]] if mixed else [], False, True])
        if arrived:
            arrivals.append(t + dt / 3 - 100.0)
        t += dt
    rows.append([t, t + 0.01, 4, 4000, 0, 0, [], False, False])
    (tmp_path / "steps").mkdir()
    (tmp_path / "steps" / "steps-1.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    run = {"columns": ["session_id", "arrival_s"], "runs": [{"rate": 1, "started_unix": 100.0, "elapsed_s": t - 100.0,
                                                              "requests": [["s", a] for a in arrivals]}]}
    samples = load_samples(tmp_path, run, perf)
    assert len(samples) == 300 and sum(x.arrivals for x in samples) == len(arrivals)   # the last ends the window
    terms = fit_load(samples, ("r",))
    assert terms.step_host_s == pytest.approx(0.010, abs=1e-6)
    assert terms.admit_host_s == pytest.approx(0.004, abs=1e-6)
    assert terms.mixed_step_s == pytest.approx(0.006, abs=1e-6)
    assert terms.per_seq_s == pytest.approx(0.0002, abs=1e-8)
    loaded = terms.apply(perf)
    assert loaded.step_s(4, 4000, [(8, 8)]) == pytest.approx(0.010 + 0.010 + 4 * 0.0002 + 0.006)
    assert loaded.admit_host_s == pytest.approx(0.004, abs=1e-6)


def test_a_load_term_the_idle_calibration_already_charged_is_not_fitted_negative():
    from tandem.cluster.step_check import LoadSample, fit_load

    # steps 1 ms over the model, mixed steps 2 ms under it (the idle calibration over-charges them)
    samples = [LoadSample(i % 3, False, 4, 0.001) for i in range(30)] + [LoadSample(0, True, 4, -0.002)] * 10
    terms = fit_load(samples)
    assert terms.mixed_step_s == 0.0
    assert min(terms.step_host_s, terms.admit_host_s, terms.per_seq_s) >= 0.0
    assert fit_load([]) is None
