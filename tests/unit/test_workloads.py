"""Workloads: the coding-agent generator's shape, the trace parsers, and shared token ids."""

import random
import statistics

import pytest

from tandem.cluster.workloads import (PROFILES, AgentProfile, RequestSpec, coding_agent_sessions, iter_token_ids,
                             load_workload, prefix_reuse_ratio, read_azure, read_mooncake)

MOONCAKE = "bench/traces/mooncake_sample.jsonl"
AZURE = "bench/traces/azure_code_sample.csv"


def by_session(specs):
    out: dict[str, list[RequestSpec]] = {}
    for s in specs:
        out.setdefault(s.session_id, []).append(s)
    return {k: sorted(v, key=lambda s: s.turn) for k, v in out.items()}


def test_agent_sessions_reuse_90_to_99_percent_of_prompt_tokens():
    specs = coding_agent_sessions(random.Random(1), 30, 0.5)
    assert 0.90 <= prefix_reuse_ratio(specs) <= 0.99
    sessions = by_session(specs)
    assert len(sessions) == 30 and statistics.mean(len(v) for v in sessions.values()) >= 20
    # at long contexts, 100-200 prompt tokens per output token on average
    long = [s for s in specs if s.input_tokens >= 8192]
    ratio = sum(s.input_tokens for s in long) / sum(s.output_tokens for s in long)
    assert 80 <= ratio <= 250
    assert max(s.input_tokens + s.output_tokens for s in specs) <= AgentProfile().max_context_tokens


def test_each_turn_extends_the_previous_one_unless_compacted():
    p = AgentProfile()
    for turns in by_session(coding_agent_sessions(random.Random(2), 10, 1.0)).values():
        assert turns[0].shared_prefix_tokens == 0
        for prev, cur in zip(turns, turns[1:]):
            assert cur.arrival_s > prev.arrival_s
            if cur.shared_prefix_tokens == prev.input_tokens + prev.output_tokens:
                assert cur.input_tokens > cur.shared_prefix_tokens  # plus new tool output
            else:  # compaction: only the system prompt survives
                assert cur.shared_prefix_tokens == p.system_prompt_tokens


def test_small_profile_fits_cpu_scale():
    specs = coding_agent_sessions(random.Random(3), 20, 2.0, PROFILES["coding-agent-small"])
    assert all(s.input_tokens + s.output_tokens <= 1024 and 8 <= s.output_tokens <= 32 for s in specs)
    assert 200 <= statistics.mean(s.input_tokens for s in specs) <= 1000
    assert 0.8 <= prefix_reuse_ratio(specs) <= 0.99
    assert specs == sorted(specs, key=lambda s: s.arrival_s)


def test_generator_is_seeded():
    a = coding_agent_sessions(random.Random(9), 5, 1.0)
    assert a == coding_agent_sessions(random.Random(9), 5, 1.0)
    assert a != coding_agent_sessions(random.Random(10), 5, 1.0)


def test_token_ids_really_share_prefixes_and_outputs_copy_input():
    specs = coding_agent_sessions(random.Random(4), 4, 2.0, PROFILES["coding-agent-small"])
    toks = list(iter_token_ids(specs, vocab_size=512, rng=random.Random(0)))
    last: dict[str, list[int]] = {}
    copied = total = 0
    for t in toks:
        s = t.spec
        assert len(t.prompt_token_ids) == s.input_tokens and len(t.output_token_ids) == s.output_tokens
        assert all(3 <= i < 512 for i in t.prompt_token_ids + t.output_token_ids)
        if s.shared_prefix_tokens:
            assert t.prompt_token_ids[:s.shared_prefix_tokens] == last[s.session_id][:s.shared_prefix_tokens]
        last[s.session_id] = t.prompt_token_ids + t.output_token_ids
        grams = {tuple(t.prompt_token_ids[i:i + 4]) for i in range(len(t.prompt_token_ids) - 3)}
        out = t.output_token_ids
        copied += sum(tuple(out[i:i + 4]) in grams for i in range(len(out) - 3))
        total += max(0, len(out) - 3)
    assert copied / total > 0.3  # n-gram speculation has something to find


def test_mooncake_parser_reads_the_sample_and_derives_shared_prefixes():
    specs = read_mooncake(MOONCAKE)
    assert len(specs) == 8
    assert [s.arrival_s for s in specs[:3]] == [0.0, 0.12, 0.45]
    assert specs[0].shared_prefix_tokens == 0
    assert specs[1].shared_prefix_tokens == 3 * 512  # hash ids 0, 1, 2 seen before
    assert specs[6].shared_prefix_tokens == 6 * 512
    assert specs[7].shared_prefix_tokens == 512  # only hash id 0
    assert specs[2].hash_ids == (5, 6) and specs[2].input_tokens == 700 and specs[2].output_tokens == 85
    assert len(read_mooncake(MOONCAKE, limit=3)) == 3


def test_mooncake_token_ids_share_blocks():
    specs = read_mooncake(MOONCAKE)
    toks = list(iter_token_ids(specs, vocab_size=1000, rng=random.Random(0)))
    assert toks[1].prompt_token_ids[:1500] == toks[0].prompt_token_ids  # request 0 has 1500 tokens
    assert toks[7].prompt_token_ids[:512] == toks[0].prompt_token_ids[:512]
    assert toks[7].prompt_token_ids[512:1024] != toks[0].prompt_token_ids[512:1024]


def test_azure_parser_reads_the_sample():
    specs = read_azure(AZURE)
    assert len(specs) == 8
    assert specs[0].arrival_s == 0.0 and specs[1].arrival_s == pytest.approx(4.314579, abs=1e-5)
    assert (specs[0].input_tokens, specs[0].output_tokens) == (4808, 10)
    assert all(s.shared_prefix_tokens == 0 and not s.hash_ids for s in specs)
    assert len({s.session_id for s in specs}) == 8


def test_load_workload_by_name_or_path():
    assert len(load_workload(MOONCAKE, random.Random(0))) == 8
    fast = load_workload(AZURE, random.Random(0), time_scale=0.5)
    assert fast[1].arrival_s == pytest.approx(read_azure(AZURE)[1].arrival_s / 2)
    assert load_workload("coding-agent-small", random.Random(0), num_sessions=3)
    with pytest.raises(ValueError, match="unknown workload"):
        load_workload("nope", random.Random(0))
