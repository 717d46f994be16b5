"""The suffix proposer: the longest earlier match wins, its most frequent continuation is drafted
while the path's frequency holds, drafts come from the request's own tokens or from finished
requests' outputs (a corpus capped in tokens, least recently used out), and the incremental
index gives what a scan from scratch gives. Pure Python, no torch."""

from __future__ import annotations

import random
import subprocess
import sys

import pytest

from tandem.engine.config import SpeculativeConfig
from tandem.engine.request import Request
from tandem.engine.speculative.suffix import SuffixCorpus, SuffixProposer
from tandem.wire.errors import ConfigError


def make_proposer(**overrides) -> SuffixProposer:
    kw = dict(min_match=2, max_match=16, min_token_prob=0.1, max_spec_factor=4.0, max_global_tokens=1000)
    kw.update(overrides)
    return SuffixProposer(**kw)


def draft(p: SuffixProposer, tokens: list[int], k: int, rid: str = "r") -> list[int]:
    req = p.requests.get(rid) or Request(rid, tokens)
    req.prompt_token_ids, req.output_token_ids = tokens, []
    d = p.propose([(req, k)]).get(rid)
    return d.token_ids if d is not None else []


def test_importable_without_torch():
    code = "import sys; sys.modules['torch'] = None; import tandem.engine.speculative.suffix"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_longest_match_wins_over_a_more_recent_shorter_one():
    toks = [1, 2, 3, 9, 7, 2, 3, 8, 5, 1, 2, 3]
    # [1, 2, 3] occurs at 0..2 (then 9 7); [2, 3] alone more recently (then 8 5)
    assert draft(make_proposer(), toks, 2) == [9, 7]
    assert draft(make_proposer(max_match=2), toks, 2) == [8, 5]  # equal matches: most frequent, then recent


def test_most_frequent_continuation_and_its_probability_cut():
    # [9, 5, 6] (each occurrence matches 3 tokens) is followed by 1 1 twice and by 2 once:
    # 1 (p 2/3), then 1 (p 2/3 still)
    toks = [9, 5, 6, 1, 1, 0, 9, 5, 6, 2, 3, 0, 9, 5, 6, 1, 1, 4, 8, 9, 5, 6]
    c = make_proposer().candidate(Request("r", toks), 4)
    assert c.token_ids[:2] == [1, 1] and c.probs[:2] == pytest.approx([2 / 3, 2 / 3])
    # after 1 1 the two branches split (0 and 4): p 1/3
    assert c.token_ids[2] in (0, 4) and c.probs[2] == pytest.approx(1 / 3)
    assert draft(make_proposer(min_token_prob=0.5), toks, 4) == [1, 1]


def test_length_is_capped_by_the_match_and_by_k():
    toks = [7, 8, 1, 2, 3, 4, 5, 6, 9, 7, 8]
    assert draft(make_proposer(max_spec_factor=1.0), toks, 8) == [1, 2]  # match of 2: 2 tokens
    assert draft(make_proposer(max_spec_factor=4.0), toks, 8) == [1, 2, 3, 4, 5, 6, 9, 7]
    assert draft(make_proposer(max_spec_factor=4.0), toks, 3) == [1, 2, 3]
    assert draft(make_proposer(), [1, 2, 3], 4) == []  # nothing earlier matches
    assert draft(make_proposer(), toks, 0) == []


def test_finished_outputs_draft_for_other_requests():
    p = make_proposer()
    a = Request("a", [50, 51])
    assert p.propose([(a, 4)]) == {}
    a.output_token_ids = [10, 11, 12, 13, 14, 15]  # what request a said
    p.release("a")
    assert "a" not in p.requests and "a" not in p.local
    b = Request("b", [60, 61, 10, 11])  # another session starts saying it too
    assert p.propose([(b, 4)])["b"].token_ids == [12, 13, 14, 15]


def test_own_tokens_beat_a_shorter_shared_match():
    p = make_proposer()
    a = Request("a", [0])
    a.output_token_ids = [3, 4, 20, 21, 22]
    p.propose([(a, 1)])
    p.release("a")
    # b's own text has [2, 3, 4] followed by 30 31; the shared output only [3, 4] -> 20 21
    assert draft(p, [1, 2, 3, 4, 30, 31, 32, 9, 2, 3, 4], 3, rid="b") == [30, 31, 32]


def test_shared_corpus_is_capped_least_recently_used_out():
    p = make_proposer(max_global_tokens=20)
    for i in range(3):  # three outputs of 8 tokens: the first one leaves
        r = Request(f"o{i}", [0])
        r.output_token_ids = [100 * (i + 1) + j for j in range(8)]
        p.propose([(r, 1)])
        p.release(r.request_id)
        if i == 1:  # o0 is used: o1 becomes the least recently used
            assert draft(p, [9, 100, 101], 2, rid="use") == [102, 103]
            p.release("use")
    assert p.shared.num_tokens <= 20
    assert draft(p, [9, 200, 201], 2, rid="x") == []
    assert draft(p, [9, 100, 101], 2, rid="y") == [102, 103]
    assert draft(p, [9, 300, 301], 2, rid="z") == [302, 303]


def test_removed_sequences_leave_the_index():
    c = SuffixCorpus(2)
    for i in range(50):
        c.extend(i, [i, i + 1, i + 2, i + 3])
    for i in range(45):
        c.remove(i)
    assert c.num_tokens == 20
    # stale entries are dropped whenever they outnumber the live tokens: the index stays O(live)
    assert sum(map(len, c.ends.values())) <= 5 * 3 + c.num_tokens
    assert c.lookup([46, 47], 2, 8, 0.1, 4.0)[0].token_ids == [48, 49]


def _reference(tokens: list[int], k: int, min_match: int, max_match: int, factor: float, min_prob: float) -> list[int]:
    """The module's contract, computed from scratch by a scan of every earlier position."""
    L = len(tokens)
    matches = []
    for e in range(min_match, L):
        m = 0
        while m < max_match and m < e and tokens[e - m - 1] == tokens[L - m - 1]:
            m += 1
        if m >= min_match:
            matches.append((m, e))
    if not matches:
        return []
    best = max(m for m, _ in matches)
    conts = [tokens[e:e + min(k, max(1, int(factor * best)))] for m, e in reversed(matches) if m == best]
    out, p = [], 1.0
    while conts:
        counts: dict[int, int] = {}
        for c in conts:
            if len(c) > len(out):
                counts[c[len(out)]] = counts.get(c[len(out)], 0) + 1
        if not counts:
            break
        tok, n = max(counts.items(), key=lambda kv: kv[1])
        p *= n / len(conts)
        if p < min_prob:
            break
        conts = [c for c in conts if len(c) > len(out) and c[len(out)] == tok]
        out.append(tok)
    return out


def test_incremental_index_matches_a_scan_from_scratch():
    rng = random.Random(0)
    seq = [rng.randrange(5) for _ in range(150)]
    p = make_proposer(max_match=6, max_spec_factor=1.5, min_token_prob=0.2)
    req = Request("r", seq[:10])
    for i in range(10, 150):
        req.output_token_ids = seq[10:i]
        got = p.propose([(req, 5)]).get("r")
        assert (got.token_ids if got else []) == _reference(seq[:i], 5, 2, 6, 1.5, 0.2), i


def test_config_knobs():
    from tandem.cluster.config import load_config

    assert SpeculativeConfig(method="suffix").enabled
    # what `tandem up --speculative suffix --num-speculative-tokens 8` overrides
    cfg = load_config(None, {"speculative.method": "suffix", "speculative.num_tokens": 8})
    assert (cfg.engine.speculative.method, cfg.engine.speculative.num_tokens) == ("suffix", 8)
    with pytest.raises(ConfigError):
        SpeculativeConfig(method="suffix", suffix_min_token_prob=0)
    with pytest.raises(ConfigError):
        SpeculativeConfig(method="suffix", min_n=4, suffix_max_match=3)
    with pytest.raises(ValueError):
        SuffixProposer(min_match=0)
