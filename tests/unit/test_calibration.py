"""Calibration of the perf model's serving terms: speculation from a run's usage, host time from
whole engine steps, the mixed step, the served step and the control path (fake cluster), and the
engine profile's new samples on CPU (tiny model)."""

import dataclasses
import json
import math
import time
from pathlib import Path

import pytest

from tandem.cluster.calibration import fit_control_path, fit_serving_step
from tandem.cluster.profiling import (fit_mixed_step, fit_step_host, profile, speculation_from_requests,
                                      with_counted_drafts)
from tandem.perf_model import PerfModel
from tandem.wire.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
PERF = PerfModel(prefill_base_s=0.01, prefill_per_token_s=1e-5, prefill_attn_s=0.0, decode_base_s=0.005,
                 decode_per_seq_s=3e-5, decode_per_ctx_token_s=3e-8)


def test_speculation_comes_from_each_requests_usage():
    reqs = [{"status": "OK", "completion_tokens": 101, "draft_tokens": 30, "accepted_draft_tokens": 20},
            {"status": "OK", "completion_tokens": 1, "draft_tokens": 0, "accepted_draft_tokens": 0},
            {"status": "UNAVAILABLE", "completion_tokens": 50, "draft_tokens": 50, "accepted_draft_tokens": 50}]
    spec = speculation_from_requests(reqs)
    # 100 tokens after the first in 80 steps (20 came as accepted drafts): 1.25 a step, 30 drafts
    assert spec == pytest.approx({"spec_verify_tokens": 30 / 80, "spec_tokens_per_step": 100 / 80})
    assert speculation_from_requests([{**reqs[0], "draft_tokens": 0, "accepted_draft_tokens": 0}]) == {}
    # with the steps that drafted counted: 10 of the 80 steps drafted, 3 drafts each
    steps = speculation_from_requests([{**reqs[0], "draft_steps": 10}, reqs[1]])
    assert steps == pytest.approx({"spec_verify_tokens": 30 / 80, "spec_tokens_per_step": 100 / 80,
                                   "spec_draft_prob": 10 / 80, "spec_draft_len": 3.0})


def test_a_replay_takes_the_draft_width_from_requests_that_counted_their_draft_steps():
    """bench.validate_simulator replays each rate with its own requests' draft width where they
    counted draft steps; older runs keep perf.json's whole-run figures."""
    model = PerfModel(spec_verify_tokens=0.5, spec_tokens_per_step=1.1)
    req = {"status": "OK", "completion_tokens": 41, "draft_tokens": 20, "accepted_draft_tokens": 0}
    assert with_counted_drafts(model, [req]) is model
    m = with_counted_drafts(model, [{**req, "draft_steps": 4}])
    assert (m.spec_verify_tokens, m.spec_draft_prob, m.spec_draft_len) == (0.5, 0.1, 5.0)
    assert m.verify_tokens(8) > m.verify_tokens(1) == pytest.approx(0.5)


def test_step_host_is_what_whole_steps_take_beyond_the_forwards():
    steps = [(b, b * 1000, k, PERF.decode_step_s(b, b * 1000) + PERF.decode_per_seq_s * b * k + 0.002)
             for b in (1, 8, 32) for k in (0.0, 1.0)]
    assert fit_step_host(PERF, steps).step_host_s == pytest.approx(0.002)
    assert fit_step_host(PERF, []) is PERF


def test_mixed_steps_dearer_raise_the_prefill_base_cheaper_give_a_negative_mixed_term():
    mixed = [(8, 8000, n, 4000 + n, PERF.step_s(8, 8000, [(n, 4000 + n)]) + 0.015) for n in (128, 512, 2048)]
    dear = fit_mixed_step(PERF, mixed)
    assert dear.prefill_base_s == pytest.approx(0.025) and dear.mixed_step_s == 0.0
    # 3 ms cheaper than charged: one forward pays the fixed cost both bases charge
    cheap = fit_mixed_step(PERF, [(b, c, n, p, w - 0.018) for b, c, n, p, w in mixed])
    assert cheap.prefill_base_s == PERF.prefill_base_s and cheap.mixed_step_s == pytest.approx(-0.003)
    assert cheap.step_s(8, 8000, [(128, 4128)]) == pytest.approx(PERF.step_s(8, 8000, [(128, 4128)]) - 0.003)
    assert cheap.prefill_s(128, 128) == PERF.prefill_s(128, 128)        # a step without decodes: as before
    # never below one base: a mixed step costs at least its decode step and its chunks
    floor = fit_mixed_step(PERF, [(b, c, n, p, w - 1.0) for b, c, n, p, w in mixed])
    assert floor.mixed_step_s == pytest.approx(-min(PERF.prefill_base_s, PERF.decode_base_s))
    with pytest.raises(ConfigError, match="mixed_step_s"):
        dataclasses.replace(PERF, mixed_step_s=-0.5)


def test_served_step_is_a_line_in_the_batch_intercept_host_slope_per_sequence():
    served = [(b, b * 4000, 0.1, dataclasses.replace(PERF, spec_verify_tokens=0.1).decode_step_s(b, b * 4000)
               + 0.002 + 8e-5 * b) for b in (1, 8, 32)]
    fitted = fit_serving_step(PERF, served)
    assert fitted.step_host_s == pytest.approx(0.002)
    assert fitted.decode_per_seq_s == pytest.approx(PERF.decode_per_seq_s + 8e-5)


class _Resp:
    def __init__(self, tokens, finish=0):
        self.token_ids, self.finish_reason, self.usage = tokens, finish, None


class FakeStub:
    """A cluster whose first token takes `overhead` plus one decode step when the prompt is cached
    (sent before), plus a prefill of it otherwise."""

    def __init__(self, perf: PerfModel, overhead: float):
        self.perf, self.overhead, self.seen = perf, overhead, set()

    def Generate(self, req, timeout=None, metadata=()):
        ids = tuple(req.prompt_token_ids)
        engine = (self.perf.decode_step_s(1, len(ids)) if ids in self.seen
                  else self.perf.step_s(0, 0, [(len(ids), len(ids))]))
        self.seen.add(ids)
        time.sleep(self.overhead + engine)
        yield _Resp([7], finish=1)


def test_control_path_is_a_cached_prompts_ttft_less_one_step():
    perf = dataclasses.replace(PERF, step_host_s=0.001)
    notes = {}
    fitted = fit_control_path(FakeStub(perf, 0.02), perf, vocab_size=1000, threshold=float("inf"), probes=3,
                              local_tokens=256, notes=notes)
    assert fitted.request_overhead_s == pytest.approx(0.02, abs=0.004)
    assert notes["cached_prompt_tokens"] == 257            # whole blocks cached, the last token computed
    assert fitted.remote_overhead_s == 0.0


def test_old_perf_files_still_load_and_fit_takes_the_old_kinds():
    old = PerfModel.from_dict(json.loads((ROOT / "bench/perf/h200-llama3-8b.json").read_text()))
    assert old.spec_tokens_per_step == 1.0 and old.step_host_s == 0.0
    fitted = PerfModel.fit([("decode", (1, 100), 0.005), ("decode", (8, 800), 0.006), ("decode", (32, 3200), 0.01)])
    assert fitted.decode_per_seq_s > 0


def test_padded_steps_fit_a_verify_step_cost_and_a_per_row_cost_on_top_of_the_decode_fit():
    """A step in which one sequence drafts k costs the plain step + verify_step_s + verify_token_s *
    batch * k (every sequence padded to the widest draft); the decode coefficients are unchanged."""
    true = PerfModel(decode_base_s=0.005, decode_per_seq_s=3e-5, decode_per_ctx_token_s=3e-8)
    samples = []
    for b in (1, 8, 32):
        for ctx in (1024, 8192):
            samples.append(("decode", (b, b * ctx), true.decode_step_s(b, b * ctx)))
            for k in (2, 5):
                samples.append(("verify", (b, b * ctx, k), true.decode_step_s(b, b * ctx) + 3e-5 * b * k))
                samples.append(("padded", (b, b * ctx, k), true.decode_step_s(b, b * ctx) + 7e-4 + 1e-5 * b * k))
    m = PerfModel.fit(samples)
    assert (m.verify_step_s, m.verify_token_s, m.decode_per_seq_s) == pytest.approx((7e-4, 1e-5, 3e-5))
    # served: 1 in 10 sequence-steps draft 4 tokens; a batch of 16 pays the padded width and the
    # verify step whenever any of its sequences drafts
    served = dataclasses.replace(m, spec_draft_prob=0.1, spec_draft_len=4.0, spec_verify_tokens=0.4)
    any_draft = 1 - 0.9 ** 16
    assert served.decode_step_s(16, 16000) - m.decode_step_s(16, 16000) == pytest.approx(
        any_draft * 7e-4 + 16 * 1e-5 * 4.0 * any_draft)
    assert PerfModel.fit(samples[:1] + [s for s in samples if s[0] != "padded"]).verify_token_s is None


def test_profile_times_verify_host_and_mixed_steps_on_cpu():
    samples, steps, mixed = profile("tiny-random", prefill_lengths=(64, 256), contexts=(0, 256), batches=(1, 4),
                                    decode_contexts=(128, 512), draft_tokens=(3,), step_batches=(2,), threads=1)
    kinds = {k for k, _, _ in samples}
    assert kinds == {"prefill", "decode", "verify", "padded", "transfer"}
    assert all(k == 3 for _, (_, _, k), _ in [s for s in samples if s[0] in ("verify", "padded")])
    # one sequence of a batch drafts: batches of 4 only (a batch of 1 is the verify sample)
    assert sorted(f[0] for kind, f, _ in samples if kind == "padded") == [4, 4]
    assert steps and all(b == 2 and wall > 0 for b, _, _, wall in steps)
    # the next turn's prompt hits the prefix cache: only its new tokens are computed
    assert [(n, p) for _, _, n, p, _ in mixed] == [(128, 640), (512, 1024), (1534, 2046)]   # (capped by the 2048-token context)
    perf = fit_mixed_step(fit_step_host(PerfModel.fit(samples), steps), mixed)
    # timings of a tiny model on a shared CPU: the fit's coefficients are finite and clipped at 0
    # (a per-sequence cost can fit to 0 when two batch sizes time alike), and a step costs time
    coeffs = (perf.decode_base_s, perf.decode_per_seq_s, perf.step_host_s, perf.prefill_base_s,
              perf.prefill_per_token_s)
    assert all(math.isfinite(c) and c >= 0 for c in coeffs)
    assert perf.decode_step_s(4, 4 * 512) > 0 and perf.prefill_s(256, 256) > 0
