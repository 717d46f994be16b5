"""The simulator's service times beyond plain decoding: speculative verify tokens, tokens emitted per
step (fractions carried deterministically), per-step host time, and the control path."""

from dataclasses import replace

import pytest

from tandem.cluster.sim_model import SLO
from tandem.cluster.sim_workers import SimSeq
from tandem.cluster.simulator import simulate
from tandem.cluster.workloads import RequestSpec
from tandem.perf_model import PerfModel
from tandem.wire.errors import ConfigError

# one decode step of one sequence: 10 ms; a prefill of 10 tokens: 1 ms
PERF = PerfModel(prefill_base_s=0.0, prefill_per_token_s=1e-4, prefill_attn_s=0.0, decode_base_s=0.008,
                 decode_per_seq_s=0.002, decode_per_ctx_token_s=0.0, transfer_base_s=0.0,
                 transfer_per_token_s=0.0, max_batch=8, max_step_tokens=512, kv_capacity_tokens=100_000)


def one(perf: PerfModel, output_tokens: int = 41, prompt: int = 10):
    r = simulate([RequestSpec("s", 0, 0.0, prompt, output_tokens)], 0, 1, perf, SLO(), colocated=True)
    return r.requests[0]


def test_emit_carries_fractions_and_never_passes_the_output():
    s = SimSeq(RequestSpec("s", 0, 0.0, 10, 12), 0)
    s.generated = 1
    got = []
    while s.generated < 12:
        n = s.emit(1.25)
        s.generated += n
        got.append(n)
    assert got[:8] == [1, 1, 1, 2, 1, 1, 1, 2]       # 1.25 a step: a second token every fourth
    assert sum(got) == 11 and s.generated == 12      # the last step stops at the output length


def test_plain_decoding_is_one_step_per_token():
    r = one(PERF)
    assert r.tpot_s == pytest.approx(0.010)
    assert r.ttft_s == pytest.approx(0.001)


def test_speculation_divides_tpot_by_tokens_per_step_and_verify_tokens_cost_like_tokens():
    spec = replace(PERF, spec_verify_tokens=3.0, spec_tokens_per_step=2.0)
    # a step verifies 1 + 3 tokens of the sequence: 8 + 2 * 4 = 16 ms, and emits 2 tokens
    assert one(spec).tpot_s == pytest.approx(0.016 / 2)
    # fractional acceptance: 1.25 tokens a step, 40 tokens after the first in 32 steps
    frac = replace(PERF, spec_verify_tokens=1.0, spec_tokens_per_step=1.25)
    assert one(frac).tpot_s == pytest.approx(32 * 0.012 / 40)


def test_a_step_is_padded_to_its_widest_draft():
    """Where a run measured how often a sequence drafts (p) and how much (L), every sequence of a
    step pays the step's widest draft: L * (1 - (1 - p) ** batch). One sequence: the mean, p * L."""
    padded = replace(PERF, spec_verify_tokens=0.25, spec_draft_prob=0.1, spec_draft_len=2.5)
    mean = replace(PERF, spec_verify_tokens=0.25)
    assert padded.verify_tokens(1) == pytest.approx(mean.verify_tokens(1)) == pytest.approx(0.25)
    assert padded.verify_tokens(8) == pytest.approx(2.5 * (1 - 0.9 ** 8))
    assert padded.verify_tokens(256) == pytest.approx(2.5, rel=1e-6)
    b = 16
    extra = padded.decode_step_s(b, 1000) - mean.decode_step_s(b, 1000)
    assert extra == pytest.approx(PERF.decode_per_seq_s * b * (padded.verify_tokens(b) - 0.25))
    assert extra > 0
    with pytest.raises(ConfigError, match="spec_draft_prob"):
        replace(PERF, spec_draft_prob=1.5)


def test_step_host_time_is_paid_by_every_step_prefill_included():
    host = replace(PERF, step_host_s=0.003)
    r = one(host)
    assert r.tpot_s == pytest.approx(0.013)
    assert r.ttft_s == pytest.approx(0.001 + 0.003)   # the prefill step alone pays it too


def test_the_control_path_delays_what_the_client_sees_not_the_engine():
    r = one(replace(PERF, request_overhead_s=0.02))
    assert r.ttft_s == pytest.approx(0.021)
    assert r.tpot_s == pytest.approx(0.010)          # both ends shift alike


def test_verify_tokens_use_the_step_token_budget():
    """A step's budget holds each decoding sequence's 1 + drafts, then prefill chunks: with 8
    sequences verifying 3 drafts each, a 64-token budget leaves 32 tokens for a prompt."""
    tight = replace(PERF, max_step_tokens=64, spec_verify_tokens=3.0, block_tokens=16)
    reqs = [RequestSpec(f"d{i}", 0, 0.0, 4, 200) for i in range(8)] + [RequestSpec("p", 0, 0.5, 320, 2)]
    plain = simulate(reqs, 0, 1, replace(tight, spec_verify_tokens=0.0), SLO(), colocated=True)
    spec = simulate(reqs, 0, 1, tight, SLO(), colocated=True)
    ttft = {r.session_id: r.ttft_s for r in spec.requests}["p"]
    assert ttft > {r.session_id: r.ttft_s for r in plain.requests}["p"]
    assert ttft >= 10 * 0.016                        # 320 tokens, 32 a step: at least 10 steps


def test_an_overlapped_engine_takes_new_work_a_step_later_unless_it_was_idle():
    """With `overlap` the engine schedules step N+1 while N computes: a prompt that reaches a busy
    worker mid-step misses the step already scheduled and waits one more decode step (10 ms here);
    on an idle worker it starts at once, as without overlap."""
    reqs = [RequestSpec("a", 0, 0.0, 10, 200), RequestSpec("b", 0, 0.015, 10, 5)]
    # a: prefill [0, 1 ms], decode steps from 1 ms every 10 ms; b arrives in the step [11, 21]
    plain = {r.session_id: r for r in simulate(reqs, 0, 1, PERF, SLO(), colocated=True).requests}
    over = {r.session_id: r for r in simulate(reqs, 0, 1, replace(PERF, overlap=True), SLO(),
                                               colocated=True).requests}
    assert plain["b"].ttft_s == pytest.approx(0.021 + 0.011 - 0.015)     # joins the step at 21 ms
    assert over["b"].ttft_s == pytest.approx(plain["b"].ttft_s + 0.010)   # the step at 31 ms
    assert over["a"].ttft_s == pytest.approx(plain["a"].ttft_s)           # a found the worker idle
    assert one(replace(PERF, overlap=True)).tpot_s == pytest.approx(0.010)  # steps cost the same


def test_a_request_can_carry_its_own_tokens_per_step():
    """A replay knows each request's accepted drafts from its usage: a request whose drafts were
    accepted twice as often emits twice the tokens per step, whatever the model's mean."""
    spec = replace(PERF, spec_tokens_per_step=1.5)
    reqs = [RequestSpec("a", 0, 0.0, 10, 41, tokens_per_step=1.0), RequestSpec("b", 0, 0.0, 10, 41, tokens_per_step=2.0),
            RequestSpec("c", 0, 0.0, 10, 41)]
    got = {r.session_id: r for r in simulate(reqs, 0, 1, spec, SLO(), colocated=True).requests}
    # 40 tokens after the first: 40, 20 and 27 steps of the same three-sequence batch, while it lasts
    assert got["a"].e2e_s > got["c"].e2e_s > got["b"].e2e_s
    assert got["b"].e2e_s - got["b"].ttft_s == pytest.approx(20 * spec.step_s(3, 0), rel=0.01)


def test_each_request_routed_to_a_worker_costs_its_next_step_the_admission_host_time():
    """`admit_host_s`: the serving loop takes a request in (its RPC, prefix lookup, stream) before
    the step that prefills it, and a request arriving mid-decode lengthens the decode step after."""
    admit = replace(PERF, admit_host_s=0.004)
    assert one(admit).ttft_s == pytest.approx(0.001 + 0.004)
    assert one(admit).tpot_s == pytest.approx(0.010)
    reqs = [RequestSpec("a", 0, 0.0, 10, 200), RequestSpec("b", 0, 0.018, 10, 5)]
    plain = {r.session_id: r for r in simulate(reqs, 0, 1, PERF, SLO(), colocated=True).requests}
    got = {r.session_id: r for r in simulate(reqs, 0, 1, admit, SLO(), colocated=True).requests}
    # a: prefill [0, 5) ms with its own admission, decode steps of 10 ms from 5; b lands in the step
    # [15, 25): the next, which prefills b beside a's decode, is 4 ms longer, [25, 40)
    assert got["b"].ttft_s == pytest.approx(0.040 - 0.018)
    assert plain["b"].ttft_s == pytest.approx(0.032 - 0.018)
    assert got["a"].e2e_s == pytest.approx(plain["a"].e2e_s + 2 * 0.004, abs=1e-9)


def test_a_step_carrying_decodes_and_prefill_chunks_pays_the_mixed_step_cost():
    mixed = replace(PERF, mixed_step_s=0.006)
    assert mixed.step_s(4, 0, [(100, 100)]) == pytest.approx(PERF.step_s(4, 0, [(100, 100)]) + 0.006)
    assert mixed.step_s(4, 0) == pytest.approx(PERF.step_s(4, 0))               # decode only
    assert mixed.step_s(0, 0, [(100, 100)]) == pytest.approx(PERF.step_s(0, 0, [(100, 100)]))  # prefill only
    with pytest.raises(ConfigError, match="must be >= 0"):
        replace(PERF, mixed_step_s=-0.001)
    with pytest.raises(ConfigError, match="must be >= 0"):
        replace(PERF, admit_host_s=-0.001)
