"""`tandem bench`'s pure part: percentiles, TPOT, SLO checks, per-rate summaries, the table, and
the plans (start times, prompt splicing) the driver follows. Hand-built records, no gRPC."""

import random

import pytest

from tandem.cluster.loadgen import (fit_context, group_sessions, load_sessions, parse_workload, plan_sessions, splice_prompt,
                           trace_mean_rate, trace_prompts)
from tandem.cluster.loadgen_report import (SLO, RequestRecord, meets_slo, percentile, summarize, table_header, table_notes,
                                  table_row, tpot_s)
from tandem.cluster.workloads import RequestSpec, read_mooncake

SLO_1S_40MS = SLO(ttft_s=1.0, tpot_s=0.040)


def rec(status="OK", times=(), prompt=100, cached=0, draft=0, accepted=0, e2e=None, turn=0):
    times = list(times)
    return RequestRecord("s", turn, 0.0, prompt, len(times) or 1, status=status, token_times_s=times,
                         e2e_s=e2e if e2e is not None else (times[-1] if times else None),
                         usage_prompt_tokens=prompt if status == "OK" else 0, cached_prompt_tokens=cached,
                         completion_tokens=len(times), draft_tokens=draft, accepted_draft_tokens=accepted)


def test_percentile_interpolates_between_ranks_and_skips_missing_values():
    xs = [40, None, 10, 30, 20]
    assert percentile(xs, 50) == pytest.approx(25.0)
    assert percentile(xs, 90) == pytest.approx(37.0)
    assert percentile(xs, 99) == pytest.approx(39.7)
    assert percentile(xs, 0) == 10 and percentile(xs, 100) == 40
    assert percentile([7.5], 99) == 7.5
    assert percentile([], 50) is None and percentile([None], 50) is None


def test_tpot_is_the_mean_gap_after_the_first_token():
    assert tpot_s([0.1, 0.1, 0.3, 0.5]) == pytest.approx(0.4 / 3)  # two tokens in the first message
    assert tpot_s([0.2]) is None and tpot_s([]) is None
    r = rec(times=[0.25, 0.30, 0.45])
    assert r.ttft_s == 0.25 and r.tpot_s == pytest.approx(0.1)
    j = r.to_json()
    assert j["ttft_s"] == 0.25 and j["tpot_s"] == pytest.approx(0.1) and j["token_times_s"] == [0.25, 0.3, 0.45]


def test_slo_needs_ok_and_both_bounds():
    assert meets_slo(rec(times=[0.5, 0.53, 0.56]), SLO_1S_40MS)
    assert meets_slo(rec(times=[1.0, 1.5]), SLO(ttft_s=1.0, tpot_s=0.5))  # bounds are inclusive
    assert not meets_slo(rec(times=[1.2, 1.21]), SLO_1S_40MS)  # TTFT over
    assert not meets_slo(rec(times=[0.1, 0.15, 0.2]), SLO_1S_40MS)  # TPOT 50 ms
    assert meets_slo(rec(times=[0.3]), SLO_1S_40MS)  # one token: no TPOT to miss
    assert not meets_slo(rec(status="UNAVAILABLE", times=[0.1, 0.11]), SLO_1S_40MS)
    assert not meets_slo(rec(times=[]), SLO_1S_40MS)  # OK with no token: no TTFT


def test_summary_counts_goodput_cache_and_drafts_over_ok_requests_only():
    records = [
        rec(times=[0.1, 0.12, 0.14], prompt=100, cached=90, draft=10, accepted=6),  # meets both
        rec(times=[2.0, 2.01], prompt=200, cached=100),  # TTFT over
        rec(times=[0.2, 0.3, 0.4], prompt=100, cached=0, draft=4, accepted=2),  # TPOT over
        rec(status="UNAVAILABLE"),
        rec(status="DEADLINE_EXCEEDED", times=[0.3, 0.31], prompt=300, cached=300, draft=50, accepted=50),
    ]
    s = summarize(records, rate=2.0, elapsed_s=2.0, slo=SLO_1S_40MS, not_started=7)
    assert (s["requests"], s["ok"], s["failed"], s["not_started"]) == (5, 3, 2, 7)
    assert s["errors"] == {"DEADLINE_EXCEEDED": 1, "UNAVAILABLE": 1}
    assert s["throughput_rps"] == pytest.approx(1.5)
    assert s["goodput_rps"] == pytest.approx(0.5)
    assert s["slo_attainment"] == pytest.approx(1 / 5)
    assert s["output_tok_s"] == pytest.approx(8 / 2.0)
    assert s["cached_ratio"] == pytest.approx(190 / 400)
    assert s["spec_acceptance"] == pytest.approx(8 / 14)
    assert s["ttft_ms"]["p50"] == pytest.approx(200.0)
    assert s["ttft_ms"]["p90"] == pytest.approx(1640.0)
    assert s["ttft_ms"]["p99"] == pytest.approx(1964.0)
    assert s["tpot_ms"]["p50"] == pytest.approx(20.0)  # of 20, 10 and 100 ms
    assert s["e2e_ms"]["p50"] == pytest.approx(400.0)  # of 140, 2010 and 400 ms


def test_summary_of_nothing_has_no_ratios():
    s = summarize([rec(status="UNAVAILABLE")], rate=1.0, elapsed_s=5.0, slo=SLO_1S_40MS)
    assert s["ok"] == 0 and s["goodput_rps"] == 0 and s["slo_attainment"] == 0
    assert s["cached_ratio"] is None and s["spec_acceptance"] is None and s["ttft_ms"]["p50"] is None
    assert "| - / - / - |" in table_row(s)


def test_table_states_the_slos_and_formats_a_row():
    slo = SLO(ttft_s=0.25, tpot_s=0.015)
    assert "TTFT <= 250 ms and TPOT <= 15 ms" in table_header(slo)
    records = [rec(times=[0.1, 0.12, 0.14], prompt=100, cached=90, draft=10, accepted=6), rec(status="UNAVAILABLE")]
    s = summarize(records, rate=0.5, elapsed_s=4.0, slo=slo, not_started=3)
    row = table_row(s)
    assert row.startswith("| 0.5 | 1 | 1 | 100 / 100 / 100 | 20.0 / 20.0 / 20.0 | 140 / 140 / 140 |")
    assert "| 0.25 |" in row and "| 90.0% | 60.0% |" in row
    assert table_notes(s) == "rate 0.5: 1 UNAVAILABLE, 3 not sent (due past the duration)"
    assert table_notes(summarize([rec(times=[0.1])], rate=1, elapsed_s=1, slo=slo)) == ""


def spec(sid, turn, arrival, inp=10, out=4, shared=0, think=0.0):
    return RequestSpec(sid, turn, arrival, inp, out, shared, think)


def test_trace_plan_scales_to_the_asked_mean_rate_and_stops_at_the_duration():
    sessions = group_sessions([spec(f"t{i}", 0, float(i)) for i in range(10)])  # 1 request/s
    assert trace_mean_rate([s[0] for s in sessions]) == pytest.approx(1.0)
    plan = plan_sessions(sessions, session_workload=False, rate=2.0, duration_s=3.0)
    assert [p.start_s for p in plan] == pytest.approx([0, 0.5, 1.0, 1.5, 2.0, 2.5])
    plan = plan_sessions(sessions, session_workload=False, rate=None, duration_s=3.0)  # the trace's own times
    assert [p.start_s for p in plan] == [0, 1, 2]
    assert len(plan_sessions(sessions, session_workload=False, rate=2.0, duration_s=3.0, max_sessions=4)) == 4


def test_session_plan_divides_start_times_by_the_rate_and_keeps_turns_in_order():
    specs = [spec("a", 1, 9.0), spec("a", 0, 1.0), spec("b", 0, 2.0), spec("c", 0, 4.0)]
    plan = plan_sessions(group_sessions(specs), session_workload=True, rate=2.0, duration_s=1.5)
    assert [(p.session_id, p.start_s, [s.turn for s in p.specs]) for p in plan] == [("a", 0.5, [0, 1]), ("b", 1.0, [0])]
    with pytest.raises(ValueError, match="rate"):
        plan_sessions(group_sessions(specs), session_workload=True, rate=None, duration_s=1.0)


def test_next_prompt_starts_with_the_real_answer_and_keeps_the_spec_length():
    context = [1, 2, 3, 4, 5]  # previous prompt + the answer the server really gave
    spec_prompt = [9, 9, 9, 9, 9, 7, 7]  # the workload's ids: its own guess of that context, then new
    assert splice_prompt(context, spec_prompt, 5) == [1, 2, 3, 4, 5, 7, 7]
    assert splice_prompt(context, spec_prompt, 2) == [1, 2, 9, 9, 9, 7, 7]  # compaction: only a prefix kept
    assert splice_prompt([1, 2], spec_prompt, 5) == [1, 2, 9, 9, 9, 7, 7]  # a short answer: spec ids fill in
    assert splice_prompt([], spec_prompt, 0) == spec_prompt


def test_fit_context_keeps_output_and_trims_prompt_and_shared_prefix():
    s = fit_context(spec("x", 3, 0.0, inp=1000, out=50, shared=900), 512)
    assert (s.input_tokens, s.output_tokens, s.shared_prefix_tokens) == (462, 50, 462)
    s = fit_context(spec("x", 0, 0.0, inp=10, out=4000), 512)
    assert (s.input_tokens, s.output_tokens) == (1, 511)
    assert fit_context(spec("x", 0, 0.0, inp=10, out=4), 512) == spec("x", 0, 0.0, inp=10, out=4)


def test_workload_names_and_sessions():
    assert parse_workload("agent-small") == ("agent-small", None)
    assert parse_workload("coding-agent") == ("agent", None)
    assert parse_workload("mooncake:a/b.jsonl") == ("mooncake", "a/b.jsonl")
    for bad in ("agents", "mooncake:", "csv:x.csv"):
        with pytest.raises(ValueError, match="unknown workload"):
            parse_workload(bad)
    sessions = load_sessions("agent-small", None, random.Random(3), num_sessions=4, max_context=300)
    assert len(sessions) == 4
    for turns in sessions:
        assert [s.turn for s in turns] == list(range(len(turns))) and len(turns) >= 8
        assert all(s.input_tokens + s.output_tokens <= 300 for s in turns)
    trace = load_sessions("mooncake", "bench/traces/mooncake_sample.jsonl", random.Random(0), num_sessions=5,
                          max_context=None)
    assert len(trace) == 5 and all(len(t) == 1 for t in trace)


def test_trace_prompts_share_leading_blocks_for_equal_hash_ids():
    specs = read_mooncake("bench/traces/mooncake_sample.jsonl", limit=2)  # hash ids [0,1,2] then [0,1,2,3,4]
    a, b = trace_prompts(specs, 1000, random.Random(0))
    assert len(a.prompt_token_ids) == specs[0].input_tokens and len(b.prompt_token_ids) == specs[1].input_tokens
    assert b.prompt_token_ids[:1500] == a.prompt_token_ids[:1500]
    assert b.prompt_token_ids[1536:1600] != a.prompt_token_ids[:64]
    assert all(3 <= t < 1000 for t in a.prompt_token_ids + b.prompt_token_ids)


def test_summary_keeps_the_first_message_of_each_error_code():
    a = rec(status="UNAVAILABLE")
    a.error = "request failed after 2 migrations: engine step failed"
    b = rec(status="UNAVAILABLE")
    b.error = "a later message"
    c = rec(status="INTERNAL")
    c.error = "request failed in the cluster (KeyError: 'x')"
    s = summarize([a, b, c, rec(times=[0.1, 0.12])], rate=1.0, elapsed_s=10.0, slo=SLO_1S_40MS)
    assert s["error_examples"] == {"INTERNAL": c.error, "UNAVAILABLE": a.error}
    notes = table_notes(s).splitlines()
    assert notes[0] == "rate 1: 1 INTERNAL, 2 UNAVAILABLE"
    assert notes[1:] == [f"  INTERNAL: {c.error}", f"  UNAVAILABLE: {a.error}"]


def test_a_rate_that_comes_back_in_a_ramp_sends_prompts_of_its_own():
    """The prompt tokens' seed: the first run of a rate keeps the seed earlier versions used; a
    later run at the same rate (a ramp coming back down) gets other prompts, so the cluster's
    prefix caches do not still hold them (the CPU ramp of issue 11 had 94.6% cache hits on its
    way down against 76.1% on its way up)."""
    import random

    from tandem.cluster.loadgen import load_sessions, token_seed
    from tandem.cluster.workloads import iter_token_ids

    assert token_seed(0, 0.4) == "0-0.4" and token_seed(0, 0.4, 0, "s1") == "0-0.4-s1"
    specs = load_sessions("agent-small", None, random.Random(0), num_sessions=1, max_context=None)[0]

    def first_prompt(repeat: int) -> list[int]:
        return list(next(iter_token_ids(list(specs), 1000, random.Random(token_seed(0, 0.4, repeat, "s1"))))
                    .prompt_token_ids)

    assert first_prompt(0) == first_prompt(0) and first_prompt(0) != first_prompt(1)
