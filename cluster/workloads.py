"""Workloads as lists of `RequestSpec`: a coding-agent session generator and public-trace parsers.

A spec says when a request arrives, how long its prompt and output are and how much of the prompt an
earlier request already had (`shared_prefix_tokens`, or Mooncake-style `hash_ids`). The simulator
and the load generator consume the same specs; `iter_token_ids` turns them into concrete token ids
whose prefixes really are shared and whose outputs copy spans of their input. Randomness always
comes from a `random.Random` passed in; lists come back sorted by arrival.
"""

from __future__ import annotations

import csv
import json
import math
import random
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import Path
from typing import Iterator

MOONCAKE_BLOCK_TOKENS = 512


@dataclass(frozen=True)
class RequestSpec:
    session_id: str
    turn: int  # 0-based index within the session
    arrival_s: float  # seconds from the start of the workload
    input_tokens: int
    output_tokens: int
    # Leading prompt tokens identical to an earlier request's (the previous turn's prompt + output).
    shared_prefix_tokens: int = 0
    think_s: float = 0.0  # client think time before this turn; closed-loop replays wait this long
    hash_ids: tuple[int, ...] = ()  # block hashes (Mooncake): equal leading ids = shared prefix
    hash_block_tokens: int = MOONCAKE_BLOCK_TOKENS
    # tokens a decode step emits for this request (1 + its accepted drafts per step), where a replay
    # knows it from the request's usage; None: the perf model's spec_tokens_per_step
    tokens_per_step: float | None = None


@dataclass(frozen=True)
class AgentProfile:
    """Shape of a coding-agent session. Defaults: long contexts (up to 32k) for GPU work."""
    turns: tuple[int, int] = (20, 60)  # per session, uniform
    system_prompt_tokens: int = 3000  # tools + instructions; survives compaction
    first_prompt_tokens: tuple[int, int] = (500, 3000)  # task and first files, uniform
    tool_output_mean: float = 700.0  # new tokens per turn (tool results), lognormal
    tool_output_sigma: float = 1.0
    output_mean: float = 150.0  # tokens the model writes per turn, lognormal
    output_sigma: float = 0.8
    output_range: tuple[int, int] = (16, 2048)
    think_s: tuple[int | float, int | float] = (1.0, 8.0)  # tool run time between turns, uniform
    max_context_tokens: int = 32768
    compact_to_tokens: tuple[int, int] = (2000, 5000)  # summary length when the context is full
    # Open-loop traces place turn k+1 after turn k's expected service time plus think time.
    assumed_ttft_s: float = 0.5
    assumed_tpot_s: float = 0.03

    @classmethod
    def small(cls) -> "AgentProfile":
        """CPU scale: contexts ~200-1000 tokens, outputs 8-32."""
        return cls(turns=(8, 24), system_prompt_tokens=120, first_prompt_tokens=(40, 150),
                   tool_output_mean=40.0, tool_output_sigma=0.6, output_mean=16.0, output_sigma=0.5,
                   output_range=(8, 32), think_s=(0.05, 0.5), max_context_tokens=1024,
                   compact_to_tokens=(60, 200), assumed_ttft_s=0.05, assumed_tpot_s=0.01)


PROFILES = {"coding-agent": AgentProfile(), "coding-agent-small": AgentProfile.small()}


def _lognormal(rng: random.Random, mean: float, sigma: float) -> float:
    return rng.lognormvariate(math.log(mean) - sigma * sigma / 2, sigma)


def coding_agent_sessions(rng: random.Random, num_sessions: int, session_rate_per_s: float,
                          profile: AgentProfile = AgentProfile(), start_s: float = 0.0) -> list[RequestSpec]:
    """Sessions start as a Poisson process; each turn's prompt is the previous prompt + its output +
    new tool output, so consecutive turns share ~90-99 % of their tokens. A prompt that would not fit
    `max_context_tokens` is compacted: system prompt + a summary, sharing only the system prompt."""
    p = profile
    specs: list[RequestSpec] = []
    t = start_s
    lo_out, hi_out = p.output_range
    for s in range(num_sessions):
        t += rng.expovariate(session_rate_per_s)
        sid, arrival, think = f"agent-{s}", t, 0.0
        prev_context = 0  # prompt + output of the previous turn
        for turn in range(rng.randint(*p.turns)):
            out = int(min(hi_out, max(lo_out, _lognormal(rng, p.output_mean, p.output_sigma))))
            if turn == 0:
                prompt, shared = p.system_prompt_tokens + rng.randint(*p.first_prompt_tokens), 0
            else:
                prompt = prev_context + max(1, int(_lognormal(rng, p.tool_output_mean, p.tool_output_sigma)))
                shared = prev_context
                if prompt + out > p.max_context_tokens:
                    prompt = p.system_prompt_tokens + rng.randint(*p.compact_to_tokens)
                    shared = p.system_prompt_tokens
            prompt = min(prompt, p.max_context_tokens - out)
            specs.append(RequestSpec(sid, turn, arrival, prompt, out, min(shared, prompt), think))
            prev_context = prompt + out
            think = rng.uniform(*p.think_s)
            arrival += p.assumed_ttft_s + out * p.assumed_tpot_s + think
    specs.sort(key=lambda r: (r.arrival_s, r.session_id, r.turn))
    return specs


def prefix_reuse_ratio(specs: list[RequestSpec]) -> float:
    """Shared prompt tokens over all prompt tokens: the best prefix-cache hit rate possible."""
    total = sum(r.input_tokens for r in specs)
    return sum(r.shared_prefix_tokens for r in specs) / total if total else 0.0


# -- concrete token ids ------------------------------------------------------------------------

@dataclass(frozen=True)
class TokenizedRequest:
    spec: RequestSpec
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # a plausible output: spans copied from the prompt, plus fresh ids


def iter_token_ids(specs: list[RequestSpec], vocab_size: int, rng: random.Random, *,
                   copy_fraction: float = 0.6, copy_span: tuple[int, int] = (4, 32),
                   first_id: int = 3) -> Iterator[TokenizedRequest]:
    """Token ids for each spec, in order. A session's turn k+1 prompt starts with exactly the first
    `shared_prefix_tokens` of turn k's prompt + output; hash-id specs share one block of ids per
    hash id. About `copy_fraction` of each output is spans copied from its prompt (what edits and
    renames look like, and what n-gram speculation feeds on). Ids lie in [first_id, vocab_size)."""
    if vocab_size <= first_id:
        raise ValueError(f"vocab_size must exceed first_id ({first_id}), got {vocab_size}")

    def fresh(n: int) -> list[int]:
        return [rng.randrange(first_id, vocab_size) for _ in range(n)]

    contexts: dict[str, list[int]] = {}  # session -> previous prompt + output
    blocks: dict[int, list[int]] = {}  # hash id -> its block of ids
    for spec in specs:
        if spec.hash_ids:
            prompt: list[int] = []
            for h in spec.hash_ids:
                if h not in blocks:
                    blocks[h] = fresh(spec.hash_block_tokens)
                prompt += blocks[h]
            prompt = prompt[:spec.input_tokens]
        else:
            prompt = contexts.get(spec.session_id, [])[:spec.shared_prefix_tokens]
        prompt += fresh(spec.input_tokens - len(prompt))
        output: list[int] = []
        while len(output) < spec.output_tokens:
            n = rng.randint(*copy_span)
            if rng.random() < copy_fraction and len(prompt) > n:
                start = rng.randrange(len(prompt) - n)
                output += prompt[start:start + n]
            else:
                output += fresh(n)
        output = output[:spec.output_tokens]
        contexts[spec.session_id] = prompt + output
        yield TokenizedRequest(spec, prompt, output)


# -- public traces --------------------------------------------------------------------------

def read_mooncake(path: str | Path, limit: int | None = None) -> list[RequestSpec]:
    """Mooncake JSONL: {"timestamp": ms, "input_length", "output_length", "hash_ids": [...]}.

    Each hash id stands for a 512-token block, chained: equal leading ids mean an equal prefix. The
    trace has no sessions, so every request is its own session; `shared_prefix_tokens` counts the
    leading blocks seen in any earlier request."""
    rows = []
    with open(path) as f:
        for line in f:
            if line.strip():
                rows.append(json.loads(line))
            if limit is not None and len(rows) >= limit:
                break
    rows.sort(key=lambda r: r["timestamp"])
    seen: set[int] = set()
    specs = []
    t0 = rows[0]["timestamp"] if rows else 0
    for i, r in enumerate(rows):
        ids = tuple(int(h) for h in r.get("hash_ids", ()))
        lead = 0
        while lead < len(ids) and ids[lead] in seen:
            lead += 1
        seen.update(ids)
        n_in = int(r["input_length"])
        specs.append(RequestSpec(f"mooncake-{i}", 0, (r["timestamp"] - t0) / 1000.0, n_in,
                                 max(1, int(r["output_length"])),
                                 min(n_in, lead * MOONCAKE_BLOCK_TOKENS), hash_ids=ids))
    return specs


def _azure_time(text: str) -> float:
    """Seconds since the epoch from '2023-11-16 18:15:46.6805900' (7-digit fraction) or a number."""
    try:
        return float(text)
    except ValueError:
        pass
    whole, _, frac = text.strip().partition(".")
    return datetime.fromisoformat(whole).timestamp() + (float("0." + frac) if frac else 0.0)


def read_azure(path: str | Path, limit: int | None = None) -> list[RequestSpec]:
    """Azure LLM inference trace CSV: TIMESTAMP, ContextTokens, GeneratedTokens. No prefix info."""
    rows = []
    with open(path, newline="") as f:
        for r in csv.DictReader(f):
            rows.append((_azure_time(r["TIMESTAMP"]), int(r["ContextTokens"]), int(r["GeneratedTokens"])))
            if limit is not None and len(rows) >= limit:
                break
    rows.sort()
    t0 = rows[0][0] if rows else 0.0
    return [RequestSpec(f"azure-{i}", 0, round(t - t0, 6), n_in, max(1, n_out))
            for i, (t, n_in, n_out) in enumerate(rows)]


def load_workload(name: str, rng: random.Random, *, num_sessions: int = 50,
                  session_rate_per_s: float = 1.0, limit: int | None = None,
                  time_scale: float = 1.0) -> list[RequestSpec]:
    """A profile name from PROFILES, or a trace path (*.jsonl: Mooncake, *.csv: Azure).
    `time_scale` < 1 compresses arrival times (replays a trace faster)."""
    if name in PROFILES:
        specs = coding_agent_sessions(rng, num_sessions, session_rate_per_s, PROFILES[name])
    elif name.endswith(".jsonl"):
        specs = read_mooncake(name, limit)
    elif name.endswith(".csv"):
        specs = read_azure(name, limit)
    else:
        raise ValueError(f"unknown workload {name!r}: use one of {sorted(PROFILES)} or a .jsonl/.csv trace")
    if time_scale != 1.0:
        specs = [replace(s, arrival_s=s.arrival_s * time_scale, think_s=s.think_s * time_scale)
                 for s in specs]
    return specs
