"""Speculative decoding never changes what a request gets: greedy output is token-identical to
plain decoding (n-gram and draft-model drafts, any k per sequence, mixed in one batch with
sequences that do not speculate), sampled output keeps the target distribution, rejected drafts
leave no KV blocks behind, and EOS / max_tokens / stop strings cut exactly where plain decoding
stops."""

from __future__ import annotations

import math
import random
from statistics import NormalDist

import pytest
import torch

from tandem.engine.config import CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig
from tandem.engine.engine import LLMEngine
from tandem.engine.speculative.draft_model import early_exit_model
from tandem.engine.speculative.ngram import NgramProposer, find_continuation
from tandem.engine.speculative.proposer import Draft
from tandem.engine.speculative.verify import accept_drafts
from tandem.engine.tokenizer import ByteTokenizer
from tandem.engine.weights import load_model

FALSE_ALARM = 1e-3  # per chi-square test: how often a correct implementation fails it by chance


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """These tests run many small forwards: one torch thread keeps them fast on a shared machine,
    where a multi-threaded op stalls whenever another process holds one of its cores."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def chi2_threshold(df: int, alpha: float = FALSE_ALARM) -> float:
    """Upper alpha quantile of chi-square(df), Wilson-Hilferty: (X/df)^(1/3) is about normal with
    mean 1 - 2/(9 df) and variance 2/(9 df). Within 1% of the exact quantile for df >= 3 at 1e-3."""
    z = NormalDist().inv_cdf(1 - alpha)
    v = 2 / (9 * df)
    return df * (1 - v + z * math.sqrt(v)) ** 3


def chi2_goodness_of_fit(counts: dict, probs: dict, n: int) -> tuple[float, int]:
    """Pearson's statistic of observed `counts` against expected n * probs, over outcomes whose
    expected count is at least 5, the rest pooled into one bin (merged into the smallest bin when
    it expects < 5 itself). -> (statistic, degrees of freedom)."""
    bins, pooled_obs, pooled_exp = [], 0, 0.0
    for x, p in probs.items():
        if n * p >= 5:
            bins.append([counts.get(x, 0), n * p])
        else:
            pooled_obs += counts.get(x, 0)
            pooled_exp += n * p
    pooled_obs += sum(c for x, c in counts.items() if x not in probs)
    if pooled_exp >= 5 or not bins:
        bins.append([pooled_obs, pooled_exp])
    else:  # too small to stand alone: merge it into the smallest bin
        smallest = min(bins, key=lambda b: b[1])
        smallest[0] += pooled_obs
        smallest[1] += pooled_exp
    stat = sum((o - e) ** 2 / e for o, e in bins)
    return stat, len(bins) - 1


@pytest.fixture
def spec_engine():
    """spec_engine(model, tok, method, cache/scheduler sizes..., speculative knobs..., draft_model=,
    proposer=) -> a speculative LLMEngine; afterwards every KV block, the draft model's too, must
    be free."""
    made: list[LLMEngine] = []

    def make(model, tok, method="ngram", *, num_blocks=512, block_size=16, max_num_seqs=64,
             max_num_batched_tokens=2048, draft_model=None, proposer=None, **spec) -> LLMEngine:
        spec.setdefault("verify_token_cost", 0.0)  # positions below the knee are free (the GPU's model)
        cfg = EngineConfig(model="test", cache=CacheConfig(block_size=block_size, num_blocks=num_blocks),
                           scheduler=SchedulerConfig(max_num_seqs=max_num_seqs,
                                                     max_num_batched_tokens=max_num_batched_tokens),
                           speculative=SpeculativeConfig(method=method, **spec))
        e = LLMEngine(cfg, model=model, tokenizer=tok, draft_model=draft_model, proposer=proposer)
        made.append(e)
        return e

    yield make
    for e in made:
        assert not e.has_unfinished(), "a test left requests in flight"
        e.allocator.check_invariants()
        assert e.allocator.num_free_blocks == e.allocator.num_blocks, f"{e.allocator.num_used_blocks} blocks held"
        assert_draft_cache_free(e)


def run_checked(e: LLMEngine, requests: list[dict]) -> list[dict]:
    """generate(), checking block accounting after every step (target and draft caches)."""
    step = e.step

    def checked_step(*a, **kw):
        out = step(*a, **kw)
        e.allocator.check_invariants()
        draft_alloc = getattr(e.speculator.proposer, "allocator", None) if e.speculator else None
        if draft_alloc is not None:
            draft_alloc.check_invariants()
        return out

    e.step = checked_step
    try:
        return e.generate(requests)
    finally:
        del e.step


def assert_draft_cache_free(e: LLMEngine) -> None:
    alloc = getattr(e.speculator.proposer, "allocator", None)
    if alloc is not None:
        alloc.check_invariants()
        assert alloc.num_free_blocks == alloc.num_blocks, f"{alloc.num_used_blocks} draft blocks still held"


# ---- n-gram lookup ------------------------------------------------------------------------------
def test_ngram_lookup_prefers_longest_then_most_recent_match():
    toks = [1, 2, 3, 9, 7, 2, 3, 8, 5, 1, 2, 3]
    # suffix [1, 2, 3] occurs at 0..2 (followed by 9); [2, 3] alone more recently (followed by 8)
    assert find_continuation(toks, 3, 2, 4) == [9, 7, 2]
    assert find_continuation(toks, 3, 2, 2) == [8, 5, 1]  # n = 2 only: the most recent wins
    assert find_continuation(toks, 3, 4, 5) == []
    assert find_continuation([4, 5, 4, 5], 8, 2, 3) == [4, 5]  # the continuation may overlap the suffix
    # the incremental index gives what a fresh scan gives, token by token
    from tandem.engine.request import Request

    rng = random.Random(0)
    seq = [rng.randrange(6) for _ in range(200)]
    req = Request("r", seq[:10])
    prop = NgramProposer(2, 4)
    for i in range(10, 200):
        req.output_token_ids = seq[10:i]
        got = prop.propose([(req, 4)]).get("r", Draft([])).token_ids
        assert got == find_continuation(seq[:i], 4, 2, 4)


# ---- greedy: identical tokens -------------------------------------------------------------------
CODE = '''def total_price(items, tax_rate):
    total = 0
    for item in items:
        total += item.price * item.quantity
    return total * (1 + tax_rate)
'''
CODE2 = '''class Counter:
    def __init__(self):
        self.count = 0

    def increment(self, step=1):
        self.count += step
        return self.count
'''
EDITS = [
    f"Rename the variable `total` to `subtotal` in this function. Reply with the full function.\n```python\n{CODE}```",
    f"Add a docstring to this function and show the whole function:\n```python\n{CODE}```",
    f"Rename the class `Counter` to `Tally`; reply with the code only.\n```python\n{CODE2}```",
]


def test_greedy_ngram_matches_plain_on_code_edits(smollm2, make_engine, spec_engine):
    model, tok = smollm2
    reqs = [{"messages": [{"role": "user", "content": c}], "max_tokens": 32} for c in EDITS]
    reqs += [{"prompt": "The capital of France is", "max_tokens": 12}]  # no n-gram to find: plain decode
    plain = make_engine(model, tok).generate(reqs)
    # a different k per sequence, one of them off
    for r, k in zip(reqs, [2, 8, None, 0]):
        r["num_speculative_tokens"] = k
    e = spec_engine(model, tok, "ngram", num_tokens=5, max_verify_tokens=4096)
    spec = run_checked(e, reqs)
    assert [r["token_ids"] for r in spec] == [r["token_ids"] for r in plain]
    assert [r["text"] for r in spec] == [r["text"] for r in plain]
    assert e.stats.accepted_draft_tokens > 0, "code edits were meant to give n-gram hits"
    assert spec[3]["usage"]["draft_tokens"] == 0
    assert sum(r["usage"]["accepted_draft_tokens"] for r in spec) == e.stats.accepted_draft_tokens
    assert all(r["usage"]["completion_tokens"] == len(r["token_ids"]) for r in spec)


def test_greedy_suffix_matches_plain_on_multi_turn_edits(smollm2, make_engine, spec_engine):
    """Sessions whose later turns carry the earlier answers (own-token drafts) and one request
    repeating another's answer after it finished (drafts from the shared corpus)."""
    model, tok = smollm2
    first = [{"messages": [{"role": "user", "content": c}], "max_tokens": 32, "request_id": f"t1-{i}"}
             for i, c in enumerate(EDITS[:2])]
    plain1 = make_engine(model, tok).generate(first)
    second = [{"messages": [*r["messages"], {"role": "assistant", "content": p["text"]},
                            {"role": "user", "content": "Now rename `item` to `entry` as well. Full function."}],
               "max_tokens": 32, "request_id": f"t2-{i}"} for i, (r, p) in enumerate(zip(first, plain1))]
    second += [{"prompt": "Say it again:" + plain1[0]["text"][:20], "max_tokens": 24, "request_id": "again"}]
    plain2 = make_engine(model, tok).generate(second)
    e = spec_engine(model, tok, "suffix", num_tokens=8, max_verify_tokens=4096)
    spec1 = run_checked(e, first)
    assert e.speculator.proposer.shared.num_tokens > 0, "finished outputs join the shared corpus"
    spec2 = run_checked(e, second)
    assert [r["token_ids"] for r in spec1 + spec2] == [r["token_ids"] for r in plain1 + plain2]
    assert [r["text"] for r in spec1 + spec2] == [r["text"] for r in plain1 + plain2]
    assert spec2[-1]["usage"]["accepted_draft_tokens"] > 0, "the repeated answer was meant to hit"
    assert e.stats.accepted_draft_tokens > e.stats.draft_tokens / 2
    assert sum(r["usage"]["draft_tokens"] for r in spec1 + spec2) == e.stats.draft_tokens
    assert sum(r["usage"]["draft_steps"] for r in spec1 + spec2) == e.stats.draft_seq_steps > 0
    assert not e.speculator.proposer.local, "per-request state is dropped when requests finish"


def test_seeded_sampling_with_suffix_drafts_is_reproducible(tiny, spec_engine):
    """The same seeded requests give the same tokens on a fresh engine and on one whose shared
    corpus is full of other requests' outputs (seeded samples draft from their own tokens)."""
    model, tok, _ = tiny
    reqs = [{"prompt": p, "max_tokens": 24, "temperature": 0.8, "seed": 7 + i, "request_id": f"s{i}"}
            for i, p in enumerate(TINY_PROMPTS[:4])]
    fresh = spec_engine(model, tok, "suffix", num_tokens=4, max_verify_tokens=4096).generate(reqs)
    e = spec_engine(model, tok, "suffix", num_tokens=4, max_verify_tokens=4096)
    e.generate([{"prompt": p, "max_tokens": 40, "request_id": f"o{i}"} for i, p in enumerate(TINY_PROMPTS)])
    assert e.speculator.proposer.shared.num_tokens > 0
    again = run_checked(e, reqs)
    assert [r["token_ids"] for r in again] == [r["token_ids"] for r in fresh]
    assert e.stats.draft_tokens > 0


TINY_PROMPTS = ["abcabcabcabc", "hello hello hello", "x = 1\ny = 2\nx = 1\n", "The quick brown fox",
                "zzzz", "0123456789" * 3, "speculative", "a"]


def _tiny_requests(ks):
    return [{"prompt": p, "max_tokens": 20 + 3 * i, "num_speculative_tokens": k}
            for i, (p, k) in enumerate(zip(TINY_PROMPTS, ks))]


@pytest.mark.parametrize("draft", ["early_exit", "other_seed"])
def test_greedy_draft_model_matches_plain(tiny, make_engine, spec_engine, draft):
    model, tok, _ = tiny
    ks = [1, 2, 3, 4, 5, 8, 0, None]
    plain = make_engine(model, tok).generate(_tiny_requests(ks))
    dm = early_exit_model(model, 1) if draft == "early_exit" else load_model("tiny-random", seed=99)[0]
    # a small draft cache of small blocks: its rollbacks cross block boundaries
    e = spec_engine(model, tok, "draft", draft_num_layers=1, num_tokens=4, max_verify_tokens=4096,
                    draft_num_blocks=64, block_size=4, num_blocks=256, draft_model=dm)
    spec = run_checked(e, _tiny_requests(ks))
    assert [r["token_ids"] for r in spec] == [r["token_ids"] for r in plain]
    assert e.stats.draft_tokens > 0
    assert spec[6]["usage"]["draft_tokens"] == 0
    assert_draft_cache_free(e)


class RandomProposer:
    """Drafts that are (almost) always wrong: uniform random tokens."""

    def __init__(self, vocab: int, seed: int = 0):
        self.vocab = vocab
        self.rng = random.Random(seed)
        self.proposed = 0

    def propose(self, wanted):
        self.proposed += sum(k for _, k in wanted)
        return {r.request_id: Draft([self.rng.randrange(self.vocab) for _ in range(k)]) for r, k in wanted}

    def release(self, request_id):
        pass


def test_always_wrong_drafts_roll_back_exactly(tiny, make_engine, spec_engine):
    model, tok, _ = tiny
    reqs = _tiny_requests([8] * len(TINY_PROMPTS))
    plain = make_engine(model, tok).generate(reqs)
    # the policy never gives up (probe every step), blocks of 4 tokens, a cache small enough to
    # preempt: every step rolls back up to 8 positions across block boundaries
    e = spec_engine(model, tok, "ngram", num_tokens=8, max_verify_tokens=4096, probe_interval=1,
                    block_size=4, num_blocks=48, max_num_batched_tokens=64,
                    proposer=RandomProposer(model.config.vocab_size))
    spec = run_checked(e, reqs)
    assert [r["token_ids"] for r in spec] == [r["token_ids"] for r in plain]
    assert e.stats.draft_tokens > 200
    assert e.stats.accepted_draft_tokens < e.stats.draft_tokens / 20
    assert e.stats.preemptions > 0, "the cache was meant to be small enough to preempt"
    assert e.allocator.num_free_blocks == e.allocator.num_blocks


# ---- stop conditions inside a run of accepted drafts --------------------------------------------
class OracleProposer:
    """Proposes the tokens plain greedy decoding will produce next: every draft is accepted."""

    def __init__(self, future: dict[str, list[int]]):
        self.future = future

    def propose(self, wanted):
        out = {}
        for r, k in wanted:
            nxt = self.future[r.request_id][len(r.output_token_ids):][:k]
            if nxt:
                out[r.request_id] = Draft(nxt)
        return out

    def release(self, request_id):
        pass


def test_eos_and_max_tokens_mid_draft(tiny, make_engine, spec_engine):
    model, tok, _ = tiny
    base = make_engine(model, tok).generate([{"prompt": p, "max_tokens": 30, "request_id": f"r{i}"}
                                              for i, p in enumerate(TINY_PROMPTS)])
    # make a token from the middle of request 0's output an end-of-sequence token
    eos = base[0]["token_ids"][11]
    etok = ByteTokenizer(tok.vocab_size, (eos,))
    reqs = [{"prompt": p, "max_tokens": 13 + i, "request_id": f"r{i}"} for i, p in enumerate(TINY_PROMPTS)]
    plain = make_engine(model, etok).generate(reqs)
    assert plain[0]["finish_reason"] == "stop" and len(plain[0]["token_ids"]) <= 12
    e = spec_engine(model, etok, "ngram", num_tokens=8, max_verify_tokens=4096,
                    proposer=OracleProposer({b["request_id"]: b["token_ids"] for b in base}))
    spec = run_checked(e, reqs)
    for p, s in zip(plain, spec):
        assert (s["token_ids"], s["finish_reason"], s["text"]) == (p["token_ids"], p["finish_reason"], p["text"])
        assert s["usage"]["completion_tokens"] == len(p["token_ids"])
        assert s["usage"]["accepted_draft_tokens"] <= s["usage"]["draft_tokens"]
    # every draft is right, but those past an EOS are never output and so not counted as accepted
    assert e.stats.draft_tokens - 8 <= e.stats.accepted_draft_tokens < e.stats.draft_tokens
    assert e.stats.steps < sum(len(p["token_ids"]) for p in plain) / 3


def test_stop_string_mid_draft(smollm2, make_engine, spec_engine):
    model, tok = smollm2
    prompts = ["def add(a, b):", "SELECT name, email FROM users WHERE"]
    full = make_engine(model, tok).generate([{"prompt": p, "max_tokens": 24, "request_id": f"s{i}"}
                                             for i, p in enumerate(prompts)])
    reqs = []
    for i, (p, f) in enumerate(zip(prompts, full)):
        stop = f["text"][9:12]
        assert stop.strip(), f"pick another stop for {f['text']!r}"
        reqs.append({"prompt": p, "max_tokens": 24, "stop": [stop, "never-there"], "request_id": f"s{i}"})
    plain = make_engine(model, tok).generate(reqs)
    e = spec_engine(model, tok, "ngram", num_tokens=8, max_verify_tokens=4096,
                    proposer=OracleProposer({f["request_id"]: f["token_ids"] for f in full}))
    spec = run_checked(e, reqs)
    for p, s in zip(plain, spec):
        assert p["finish_reason"] == "stop"
        assert (s["token_ids"], s["text"], s["finish_reason"]) == (p["token_ids"], p["text"], p["finish_reason"])
        assert s["usage"]["completion_tokens"] == len(p["token_ids"])


# ---- sampling: the target distribution ----------------------------------------------------------
def _dist(g, n, V, peak):
    return torch.softmax(peak * torch.randn(n, V, generator=g), -1)


@pytest.mark.parametrize("one_hot", [False, True])
def test_acceptance_rule_keeps_the_target_distribution(one_hot):
    """10^5 sequences, k = 2 drafts from q (or fixed drafts, one-hot q), target p at 3 positions:
    the first token is distributed as p0, the second (when the step yields one) as p1, the bonus
    (all drafts accepted) as p2. Three chi-square tests, each at false-alarm rate 1e-3."""
    g = torch.Generator().manual_seed(1 if one_hot else 2)
    V, k, n = 12, 2, 100_000
    p = _dist(g, k + 1, V, 1.5)  # [3, V]
    q = _dist(g, k, V, 1.5)  # a different distribution: rejections happen
    if one_hot:  # a likely first draft, a middling second one
        draft = torch.tensor([int(p[0].argmax()), int(p[1].argsort()[V // 2])]).repeat(n, 1)
        qq = None
    else:
        draft = torch.stack([torch.multinomial(q[i], n, replacement=True, generator=g) for i in range(k)], 1)
        qq = q.expand(n, k, V)
    u = torch.rand(n, k, generator=g)
    accepted, next_probs = accept_drafts(p.expand(n, k + 1, V), draft, qq, u)
    nxt = torch.multinomial(next_probs, 1, generator=g)[:, 0]
    out = torch.cat([draft, torch.full((n, 1), -1)], 1)
    out[torch.arange(n), accepted] = nxt  # tokens of row i: out[i, :accepted[i] + 1]
    assert 0 < (accepted > 0).float().mean() < 1, "both acceptance and rejection must be exercised"
    for pos in range(k + 1):
        rows = accepted >= pos  # the step produced a token at this position
        toks = out[rows, pos]
        counts = dict(zip(*[t.tolist() for t in torch.unique(toks, return_counts=True)]))
        stat, df = chi2_goodness_of_fit(counts, dict(enumerate(p[pos].tolist())), int(rows.sum()))
        assert df >= 3
        assert stat < chi2_threshold(df), f"position {pos}: chi2 {stat:.1f} on {df} df"


@pytest.mark.parametrize("method", ["draft", "suffix", "suffix-tree"])
def test_sampled_through_engine_keeps_the_target_distribution(make_engine, spec_engine, method):
    """2000 requests, temperature 1, through the engine with a draft model whose
    distribution differs (the target's own first layer), or with suffix drafts (deterministic:
    the most frequent token that followed the first output token in the outputs of the requests
    finished before; suffix-tree: up to 4 of those tokens as sibling drafts, tried in turn): the
    joint distribution of the first two tokens matches the target's exact one (chi-square,
    false-alarm rate 1e-3). The second token comes from a verify step with one draft (for every
    draft-model request; for suffix requests, wherever it found one), or one tree of depth 1."""
    target, tok, _ = load_model("tiny-random", seed=1234)
    with torch.no_grad():
        target.lm_head.weight.mul_(30)  # peaky next-token distributions: few outcomes carry the mass
    prompt = tok.encode("The quick brown fox")
    n = 2000
    knobs = dict(draft_num_layers=1) if method == "draft" else dict(min_n=1, suffix_max_match=1)
    if method == "suffix-tree":
        method, knobs["suffix_tree_nodes"] = "suffix", 4
    e = spec_engine(target, tok, method, num_tokens=1, max_verify_tokens=1 << 16, num_blocks=1100,
                    max_num_seqs=256, max_num_batched_tokens=4096, **knobs)
    # suffix drafts from other requests' outputs only for unseeded requests (seeded ones stay
    # reproducible): those draw their generators' seeds from torch's, seeded here
    torch.manual_seed(1234)
    seed = (lambda s: s) if method == "draft" else (lambda s: None)  # noqa: E731
    res = e.generate([{"prompt_token_ids": prompt, "max_tokens": 3, "temperature": 1.0, "seed": seed(s),
                       "ignore_eos": True} for s in range(n)])
    drafted = sum(r["usage"]["draft_tokens"] for r in res)
    accepted = sum(r["usage"]["accepted_draft_tokens"] for r in res)
    assert (drafted == n) if method == "draft" else (drafted > n / 2), drafted
    if knobs.get("suffix_tree_nodes"):
        assert drafted > 1.2 * sum(r["usage"]["draft_tokens"] > 0 for r in res), "trees of one node only"
    assert 0.1 * drafted < accepted < 0.9 * drafted, (drafted, accepted)
    # exact target: p(x1) at the prompt, p(x2 | x1) for every x1, from one forward each
    V = target.config.vocab_size
    ref = make_engine(target, tok, num_blocks=256)
    p1 = _next_probs(ref, [prompt])[0]
    p2 = _next_probs(ref, [prompt + [x] for x in range(V)])  # [V, V]
    joint = (p1[:, None] * p2).flatten()
    probs = {i: v for i, v in enumerate(joint.tolist()) if v * n >= 1e-3}
    counts: dict[int, int] = {}
    for r in res:
        x1, x2 = r["token_ids"][:2]
        counts[x1 * V + x2] = counts.get(x1 * V + x2, 0) + 1
    stat, df = chi2_goodness_of_fit(counts, probs, n)
    assert df >= 10
    assert stat < chi2_threshold(df), f"chi2 {stat:.1f} on {df} df"


def _next_probs(e: LLMEngine, seqs: list[list[int]]) -> torch.Tensor:
    """Target next-token probabilities (temperature 1) after each sequence, via the engine."""
    from tandem.engine.request import Request
    from tandem.engine.scheduler import ScheduledRequest, SchedulerOutput

    out = []
    for i in range(0, len(seqs), 64):
        reqs = [Request(f"p{i + j}", s) for j, s in enumerate(seqs[i:i + 64])]
        for r in reqs:
            assert e.allocator.grow(r, r.num_tokens)
        sched = SchedulerOutput([ScheduledRequest(r, r.num_tokens) for r in reqs])
        out.append(e.runner.execute(e.runner.prepare(sched)).softmax(-1))
        for r in reqs:
            e.allocator.free(r)
    return torch.cat(out)
