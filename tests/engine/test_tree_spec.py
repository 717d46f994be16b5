"""Tree drafts end to end: the flat tree helpers, the suffix trie's trees, the policy's node
budget, the multi-draft rejection rule keeping the target distribution, and the engine verifying
trees losslessly (greedy token-exact with speculation off, accepted paths off the first branch
moved into place, seeded sampling reproducible, no KV block leaked)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tandem.engine.config import SpeculativeConfig
from tandem.engine.sampler import Sampler
from tandem.engine.speculative.policy import SpeculationLengthPolicy
from tandem.engine.speculative.proposer import Draft
from tandem.engine.speculative.speculator import build_speculator
from tandem.engine.speculative.suffix import Candidate, SuffixProposer, _frequent_tree, merge_trees
from tandem.engine.speculative.tree import (accept_tree_greedy, ancestor_masks, check_tree, depths,
                                            kv_moves)
from tandem.engine.speculative.verify import accept_tree_sampled
from tests.engine import test_speculative
from tests.engine.test_speculative import TINY_PROMPTS, chi2_goodness_of_fit, chi2_threshold, run_checked

one_thread, spec_engine = test_speculative.one_thread, test_speculative.spec_engine  # its fixtures

TREE = [-1, 0, 0, 1, 1, 2, -1, 6]


def test_tree_layout_helpers():
    assert depths(TREE) == [1, 2, 2, 3, 3, 3, 1, 2]
    m = ancestor_masks(TREE)
    assert m[0] == 1 and m[1] == 0b11 and m[4] == 0b10111 and m[7] == 0b10000001
    check_tree([-1, 0])
    with pytest.raises(ValueError, match="parents must come first"):
        check_tree([-1, 1])
    with pytest.raises(ValueError, match="at most 63 nodes"):
        check_tree(list(range(-1, 63)))
    tokens = [10, 11, 12, 13, 14, 15, 16, 17]
    # target argmax per row (root, node 0..7): root -> 10 (node 0), node 0 -> 12 (node 2), node 2 -> 15
    target = [10, 12, 0, 15, 0, 0, 99, 0, 0]
    path, new = accept_tree_greedy(target, tokens, TREE)
    assert path == [0, 2, 5] and new == [10, 12, 15, 99]
    assert kv_moves(path) == [(3, 2), (6, 3)]  # node 2 (row 3) to row 2, node 5 (row 6) to row 3
    assert accept_tree_greedy([7] + [0] * 8, tokens, TREE) == ([], [7])
    assert kv_moves([0, 1, 2]) == []  # a chain stays in place
    d = Draft(tokens, parents=TREE, worth=[1.0] * 8)
    assert d.is_tree and not Draft([1, 2], parents=[-1, 0]).is_tree
    sub = d.select([0, 2, 5, 6])
    assert sub.token_ids == [10, 12, 15, 16] and sub.parents == [-1, 0, 1, -1]
    assert d.head(3).parents == [-1, 0, 0]


def test_suffix_trie_branches_where_continuations_differ():
    ids, parents, probs = _frequent_tree([[1, 2, 3, 4], [1, 2, 5, 6], [1, 2, 3, 7]], 0.1, 6)
    assert ids == [1, 2, 3, 5, 4, 6] and parents == [-1, 0, 1, 1, 2, 3]
    assert probs == pytest.approx([1, 1, 2 / 3, 1 / 3, 1 / 3, 1 / 3])
    # an edited and an unedited copy of the same lines: the draft holds both branches
    old = [5, 6, 7, 8, 9, 10, 11, 12]
    new = [5, 6, 7, 8, 20, 21, 11, 12]
    from tandem.engine.request import Request  # noqa: PLC0415 (only here)
    p = SuffixProposer(min_match=2, max_match=8, tree_nodes=8)
    req = Request("r", [1] + old + [2] + new + [3, 5, 6, 7])
    d = p.propose([(req, 6)])["r"]
    assert d.is_tree and len(d) <= 8
    paths = {tuple(_path(d, i)) for i in range(len(d))}
    assert (8, 9) in paths and (8, 20) in paths
    chains = SuffixProposer(min_match=2, max_match=8).propose([(req, 6)])["r"]
    assert chains.parents is None
    # the request's own guess and the shared corpus' guess, merged where they differ
    a = Candidate([1, 2, 3], [1.0, 1.0, 1.0], 4, [-1, 0, 1])
    b = Candidate([1, 2, 9, 8], [1.0, 0.5, 0.5, 0.5], 3, None)
    m = merge_trees(a, b, 4)  # weights 3 / 5.5 and 2.5 / 5.5 (the scores: sums of probabilities)
    assert (m.token_ids, m.parents) == ([1, 2, 3, 9], [-1, 0, 1, 1])
    assert m.probs == pytest.approx([1.0, 4.25 / 5.5, 3 / 5.5, 1.25 / 5.5])


def _path(d: Draft, node: int) -> list[int]:
    out = []
    while node >= 0:
        out.insert(0, d.token_ids[node])
        node = d.parents[node]
    return out


def test_policy_spends_the_node_budget_on_the_most_likely_nodes():
    pol = SpeculationLengthPolicy(8, initial_acceptance=0.9)
    trees = {"a": ([1.0, 0.5, 0.5, 0.5], [1, 2, 2, 3]), "b": ([1.0, 1.0, 1.0], [1, 2, 3])}
    kept = pol.choose_nodes(trees, num_seqs=2)
    # 6 free positions below the knee of 8: b's chain (0.9, 0.81, 0.73), a's root child (0.9),
    # then a's branches at 0.405 each (the deeper one, 0.36, is left out)
    assert sorted(kept["b"]) == [0, 1, 2] and sorted(kept["a"]) == [0, 1, 2]
    cpu = SpeculationLengthPolicy(128, initial_acceptance=0.9, token_cost=0.1)
    kept = cpu.choose_nodes({"a": ([1.0, 0.5, 0.5, 0.05], [1, 2, 2, 3])}, num_seqs=8)
    assert kept == {"a": [0]}, "with 8 sequences' tokens in the step a 0.45 branch does not pay on a CPU"


def test_tree_rejection_rule_keeps_the_target_distribution():
    """A root with three children (the third one's token also a likely one), the first child with
    two children of its own: the first token is distributed as p at the root, the second, given
    the first, as p at that node (where the step produced a second token), the third likewise."""
    g = torch.Generator().manual_seed(3)
    V, n = 10, 20_000
    parents = [-1, -1, -1, 0, 0]
    p = torch.softmax(1.5 * torch.randn(len(parents) + 1, V, generator=g), -1)
    order = p[0].argsort(descending=True).tolist()
    tokens = [order[0], order[1], order[4], int(p[1].argmax()), int(p[1].argsort()[V // 2])]
    gen = torch.Generator().manual_seed(4)
    outs = [accept_tree_sampled(p, tokens, parents, gen) for _ in range(n)]
    assert 0.1 < sum(len(path) == 2 for path, _ in outs) / n < 0.9
    firsts = [new[0] for _, new in outs]
    _chi2(firsts, p[0])
    row_of_first = {tokens[0]: 1, tokens[1]: 2, tokens[2]: 3}
    for t1, row in row_of_first.items():
        seconds = [new[1] for path, new in outs if len(new) > 1 and new[0] == t1]
        if len(seconds) > 500:
            _chi2(seconds, p[row])
    thirds = [new[2] for path, new in outs if len(new) > 2 and new[1] == tokens[3]]
    _chi2(thirds, p[4])


def _chi2(samples: list[int], probs: torch.Tensor) -> None:
    counts: dict[int, int] = {}
    for x in samples:
        counts[x] = counts.get(x, 0) + 1
    stat, df = chi2_goodness_of_fit(counts, dict(enumerate(probs.tolist())), len(samples))
    assert df >= 3 and stat < chi2_threshold(df), f"chi2 {stat:.1f} on {df} df over {len(samples)}"


class OffBranchOracle:
    """Trees whose first child at every level is wrong and whose second is what plain greedy
    decoding gives next: every accepted path leaves the first branch, so its KV must be moved."""

    def __init__(self, future: dict[str, list[int]], vocab: int):
        self.future, self.vocab = future, vocab

    def propose(self, wanted):
        out = {}
        for r, k in wanted:
            nxt = self.future[r.request_id][len(r.output_token_ids):][:k]
            tokens, parents, at = [], [], -1
            for tok in nxt:
                tokens += [(tok + 1) % self.vocab, tok]
                parents += [at, at]
                at = len(tokens) - 1
            if tokens:
                out[r.request_id] = Draft(tokens, parents=parents, worth=[1.0] * len(tokens))
        return out

    def release(self, request_id):
        pass


def test_greedy_trees_off_the_first_branch_match_plain(tiny, make_engine, spec_engine):
    model, tok, _ = tiny
    reqs = [{"prompt": p, "max_tokens": 24, "request_id": f"r{i}", "logprobs": 2} for i, p in enumerate(TINY_PROMPTS)]
    plain = make_engine(model, tok).generate(reqs)
    oracle = OffBranchOracle({r["request_id"]: r["token_ids"] for r in plain}, model.config.vocab_size)
    e = spec_engine(model, tok, "suffix", num_tokens=6, max_verify_tokens=4096, block_size=4, num_blocks=256,
                    proposer=oracle)
    moved = []
    move_kv = e.speculator.move_kv
    e.speculator.move_kv = lambda cache, reqs_, moves: (moved.append(len(moves)), move_kv(cache, reqs_, moves))
    spec = run_checked(e, [dict(r) for r in reqs])
    assert [r["token_ids"] for r in spec] == [r["token_ids"] for r in plain]
    for s, p in zip(spec, plain):  # each token's logprob from its parent's row, not its index's
        assert [[t for t, _ in x.top] for x in s["logprobs"]] == [[t for t, _ in x.top] for x in p["logprobs"]]
        assert [x.logprob for x in s["logprobs"]] == pytest.approx([x.logprob for x in p["logprobs"]], abs=1e-4)
    assert sum(moved) > 20, "accepted paths off the first branch were meant to be moved"
    assert e.stats.accepted_draft_tokens > e.stats.draft_tokens / 3


def test_greedy_suffix_trees_match_plain_and_seeded_samples_repeat(tiny, make_engine, spec_engine):
    model, tok, _ = tiny
    reqs = [{"prompt": p * 2, "max_tokens": 32, "request_id": f"g{i}"} for i, p in enumerate(TINY_PROMPTS)]
    plain = make_engine(model, tok).generate(reqs)
    e = spec_engine(model, tok, "suffix", num_tokens=8, max_verify_tokens=4096, suffix_tree_nodes=12,
                    min_n=1, block_size=4, num_blocks=256)
    spec = run_checked(e, reqs)
    assert [r["token_ids"] for r in spec] == [r["token_ids"] for r in plain]
    assert e.stats.accepted_draft_tokens > 0
    sampled = [{"prompt": p, "max_tokens": 24, "temperature": 0.8, "seed": 5 + i, "request_id": f"s{i}"}
               for i, p in enumerate(TINY_PROMPTS[:4])]
    first = run_checked(e, [dict(r) for r in sampled])
    again = spec_engine(model, tok, "suffix", num_tokens=8, max_verify_tokens=4096, suffix_tree_nodes=12,
                        min_n=1).generate([dict(r) for r in sampled])
    assert [r["token_ids"] for r in first] == [r["token_ids"] for r in again]


def test_tree_config_is_refused_where_it_cannot_work():
    from tandem.engine.config import EngineConfig, SpeculativeConfig  # noqa: PLC0415 (only here)
    from tandem.wire.errors import ConfigError  # noqa: PLC0415 (only here)

    with pytest.raises(ConfigError, match="suffix_tree_nodes"):
        SpeculativeConfig(method="ngram", suffix_tree_nodes=8)
    with pytest.raises(ConfigError, match="suffix_tree_nodes"):
        SpeculativeConfig(method="suffix", suffix_tree_nodes=64)
    with pytest.raises(ConfigError, match="tree drafts"):
        EngineConfig(model="x", tensor_parallel_size=2,
                     speculative=SpeculativeConfig(method="suffix", suffix_tree_nodes=8))



def test_graph_query_limit_bounds_drafts_and_trees():
    """Past the CUDA graphs' query rows per sequence a step runs eager (3.5-6x a decode step on an
    H200 at batch 1-8): the engine's bound caps every sequence's drafts, chain or tree, whatever a
    request or the config asks."""
    cfg = SpeculativeConfig(method="suffix", num_tokens=40, suffix_tree_nodes=40)
    target = torch.nn.Module()
    target.embed_tokens = torch.nn.Embedding(8, 4)
    bounded = build_speculator(cfg, target, Sampler(), num_blocks=8, block_size=4, dtype="float32", seed=0,
                               max_rows=16)
    assert bounded.proposer.tree_nodes == 15
    free = build_speculator(cfg, target, Sampler(), num_blocks=8, block_size=4, dtype="float32", seed=0)
    assert free.proposer.tree_nodes == 40
    req = SimpleNamespace(request_id="r", prefill_only=False, num_computed_tokens=9, num_tokens=10,
                          output_token_ids=[1], sampling=SimpleNamespace(num_speculative_tokens=None, max_tokens=100,
                                                                 penalized=False))
    assert bounded.caps([req]) == ({"r": 15}, 0)
    assert free.caps([req]) == ({"r": 40}, 0)
    req.sampling.num_speculative_tokens = 30   # a request's own k is bounded too
    assert bounded.caps([req]) == ({"r": 15}, 0)
