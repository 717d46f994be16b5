"""Suffix drafting (SuffixDecoding, arXiv 2411.04975): drafts from what this session and other
requests on this engine have already said. No model, pure Python, no torch.

Two corpora are searched for the sequence's longest suffix that occurred before:
- the request's own tokens (prompt and output so far: agents re-emit files they read, code they
  wrote in an earlier turn, tool output);
- a global corpus of recent requests' outputs on this engine, capped at `max_global_tokens`
  tokens, the least recently used (added or drafted from) evicted first.

Each corpus indexes every `min_match`-gram to the positions where it ends (extended as tokens
are appended). A lookup extends each occurrence of the sequence's last `min_match` tokens
backwards to its match length (up to `max_match`); the occurrences sharing the longest match are
the node a suffix tree would reach, and their continuations, counted as a trie, give each next
token a frequency: count(child) / count(node). The draft follows the most frequent child while
the path's probability (the product of those frequencies) stays at least `min_token_prob`, for at
most `max_spec_factor` x the match length tokens and the k the length policy granted. With
`tree_nodes` > 0 the draft is a tree instead (engine.speculative.tree): the trie's nodes of
probability at least `min_token_prob`, most probable first, up to `tree_nodes` nodes and that
depth, so where earlier occurrences went on in several ways (an edited and an unedited copy of a
file), several branches are verified at once. Between the
two corpora the draft with the higher score (expected accepted tokens: the sum of the path's
probabilities; then the longer match) wins; with trees, both are merged into one tree (a mixture
of the two, weighted by their scores, cut to `tree_nodes`). Seeded sampled requests draft from their own tokens
only: their output then depends on nothing but their input and seed (greedy output never depends
on the drafts).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from tandem.engine.request import Request
from tandem.engine.speculative.proposer import Draft
from tandem.engine.speculative.tree import MAX_TREE_ROWS

MAX_CANDIDATES = 64  # most recent occurrences examined per lookup (bounds the cost on repetitive text)


@dataclass
class Candidate:
    """A draft from one corpus: its tokens, the probability of each prefix (node), the match
    length, and for a tree each node's parent."""
    token_ids: list[int]
    probs: list[float]
    match_len: int
    parents: list[int] | None = None

    @property
    def score(self) -> float:
        return sum(self.probs)


@dataclass
class _Seq:
    tokens: list[int]
    indexed: int = 0  # grams ending before this position are in the index
    counted: int = 0  # tokens counted in the corpus' num_tokens (`tokens` may grow in place)


@dataclass
class SuffixCorpus:
    """Token sequences (by key) and the index of their `min_match`-grams: {gram: [(key, end)]}."""
    min_match: int
    seqs: "OrderedDict[object, _Seq]" = field(default_factory=OrderedDict)  # least recently used first
    ends: dict[tuple[int, ...], list[tuple[object, int]]] = field(default_factory=dict)
    num_tokens: int = 0
    stale: int = 0  # index entries of removed sequences (dropped when they outnumber the live ones)

    def extend(self, key, tokens: list[int]) -> None:
        """Sequence `key` is now `tokens` (it only ever grows: the new tail is indexed)."""
        s = self.seqs.get(key)
        if s is None:
            s = self.seqs[key] = _Seq([], self.min_match)
        self.num_tokens += len(tokens) - s.counted
        s.tokens, s.counted = tokens, len(tokens)
        n = self.min_match
        for e in range(s.indexed, len(tokens) + 1):
            self.ends.setdefault(tuple(tokens[e - n:e]), []).append((key, e))
        s.indexed = max(s.indexed, len(tokens) + 1)

    def remove(self, key) -> None:
        s = self.seqs.pop(key, None)
        if s is None:
            return
        self.num_tokens -= s.counted
        self.stale += max(0, s.counted - self.min_match + 1)
        if self.stale > self.num_tokens:
            self._reindex()

    def touch(self, key) -> None:
        if key in self.seqs:
            self.seqs.move_to_end(key)

    def _reindex(self) -> None:
        self.ends = {gram: live for gram, occ in self.ends.items()
                     if (live := [(k, e) for k, e in occ if k in self.seqs])}
        self.stale = 0

    def lookup(self, context: list[int], k: int, max_match: int, min_token_prob: float,
               max_spec_factor: float, tree_nodes: int = 0) -> tuple[Candidate | None, object]:
        """The draft following the longest earlier match of `context`'s suffix (see module doc),
        and the key of the most recent sequence it matched in. An occurrence at the end of its
        sequence (`context` itself, when it is in the corpus) has nothing after it and is skipped."""
        n = self.min_match
        if k <= 0 or len(context) < n:
            return None, None
        occ = self.ends.get(tuple(context[-n:]))
        if not occ:
            return None, None
        best, matches = 0, []
        for key, e in reversed(occ[-MAX_CANDIDATES:]):
            s = self.seqs.get(key)
            if s is None or e >= len(s.tokens):
                continue
            m = _match_len(s.tokens, e, context, n, max_match)
            if m > best:
                best, matches = m, [(s.tokens, e, key)]
            elif m == best:
                matches.append((s.tokens, e, key))
        if not matches:
            return None, None
        length = min(k, max(1, int(max_spec_factor * best)))
        continuations = [toks[e:e + length] for toks, e, _ in matches]
        if tree_nodes:
            ids, parents, probs = _frequent_tree(continuations, min_token_prob, tree_nodes)
        else:
            (ids, probs), parents = _frequent_path(continuations, min_token_prob), None
        if not ids:
            return None, None
        return Candidate(ids, probs, best, parents), matches[0][2]


def _match_len(tokens: list[int], e: int, context: list[int], n: int, max_match: int) -> int:
    """How many tokens before position e of `tokens` equal the end of `context` (>= n, <= max_match)."""
    m, L = n, len(context)
    while m < max_match and m < e and m < L and tokens[e - m - 1] == context[L - m - 1]:
        m += 1
    return m


def _frequent_path(continuations: list[list[int]], min_token_prob: float) -> tuple[list[int], list[float]]:
    """Follow the most frequent next token through the continuations (a trie walk without
    building the trie): -> (tokens, probability of each prefix), cut where it drops below min_token_prob."""
    ids: list[int] = []
    probs: list[float] = []
    alive = continuations
    p = 1.0
    depth = 0
    while alive:
        counts: dict[int, int] = {}
        for c in alive:
            if len(c) > depth:
                counts[c[depth]] = counts.get(c[depth], 0) + 1
        if not counts:
            break
        tok, cnt = max(counts.items(), key=lambda kv: kv[1])  # ties: the most recent (first seen)
        p *= cnt / len(alive)  # continuations ending here count in the node, not in any child
        if p < min_token_prob:
            break
        ids.append(tok)
        probs.append(p)
        alive = [c for c in alive if len(c) > depth and c[depth] == tok]
        depth += 1
    return ids, probs


def _frequent_tree(continuations: list[list[int]], min_token_prob: float,
                   max_nodes: int) -> tuple[list[int], list[int], list[float]]:
    """The continuations' trie, cut to its `max_nodes` most probable nodes of probability >=
    min_token_prob (a node's probability: the share of continuations through it, the product of
    the frequencies on its path). -> (tokens, parents, probabilities), most probable first; a child
    is never more probable than its parent and ties go to the shallower, then earlier, node, so
    every node comes after its parent."""
    total = len(continuations)
    node_of: dict[tuple[int, int], int] = {}  # (parent node, token) -> node; nodes in first-seen order
    count: list[int] = []
    parent: list[int] = []
    depth: list[int] = []
    token: list[int] = []
    for c in continuations:
        at = -1
        for tok in c:
            node = node_of.get((at, tok))
            if node is None:
                node = node_of[at, tok] = len(count)
                count.append(0)
                parent.append(at)
                depth.append(1 if at < 0 else depth[at] + 1)
                token.append(tok)
            count[node] += 1
            at = node
    ranked = sorted((i for i in range(len(count)) if count[i] >= min_token_prob * total),
                    key=lambda i: (-count[i], depth[i], i))[:max_nodes]
    index = {node: i for i, node in enumerate(ranked)}
    return ([token[i] for i in ranked], [-1 if parent[i] < 0 else index[parent[i]] for i in ranked],
            [count[i] / total for i in ranked])


def merge_trees(a: Candidate, b: Candidate, max_nodes: int) -> Candidate:
    """One tree of both candidates' paths as a mixture of the two guesses, weighted by their scores:
    a node's probability is w_a p_a + w_b p_b (0 where a candidate lacks the path), so where they
    disagree the two branches share the mass instead of each claiming all of it. Cut to the
    `max_nodes` most probable as `_frequent_tree` cuts (ties: shallower, then a's nodes first)."""
    weights = (a.score / (a.score + b.score), b.score / (a.score + b.score))
    prob: dict[tuple[int, ...], float] = {}
    for c, w in zip((a, b), weights):
        paths: list[tuple[int, ...]] = []
        for tok, parent, p in zip(c.token_ids, c.parents or range(-1, len(c.token_ids) - 1), c.probs):
            paths.append((paths[parent] if parent >= 0 else ()) + (tok,))
            prob[paths[-1]] = prob.get(paths[-1], 0.0) + w * p
    order = {path: i for i, path in enumerate(prob)}
    ranked = sorted(prob, key=lambda path: (-prob[path], len(path), order[path]))[:max_nodes]
    index = {path: i for i, path in enumerate(ranked)}
    return Candidate([path[-1] for path in ranked], [prob[path] for path in ranked], max(a.match_len, b.match_len),
                     [index[path[:-1]] if len(path) > 1 else -1 for path in ranked])


class SuffixProposer:
    def __init__(self, *, min_match: int = 2, max_match: int = 32, min_token_prob: float = 0.1,
                 max_spec_factor: float = 2.0, max_global_tokens: int = 1 << 18, tree_nodes: int = 0):
        if not 1 <= min_match <= max_match:
            raise ValueError(f"need 1 <= min_match <= max_match, got {min_match}, {max_match}")
        if tree_nodes and not 2 <= tree_nodes < MAX_TREE_ROWS:
            raise ValueError(f"tree_nodes must be 0 (chains) or in [2, {MAX_TREE_ROWS - 1}], got {tree_nodes}")
        self.tree_nodes = tree_nodes
        self.max_match = max_match
        self.min_token_prob = min_token_prob
        self.max_spec_factor = max_spec_factor
        self.max_global_tokens = max_global_tokens
        self.min_match = min_match
        self.local: dict[str, SuffixCorpus] = {}  # per request in flight: its own tokens
        self.requests: dict[str, Request] = {}
        self.shared = SuffixCorpus(min_match)  # finished requests' outputs, LRU-capped
        self._finished = 0

    def propose(self, wanted: list[tuple[Request, int]]) -> dict[str, Draft]:
        out: dict[str, Draft] = {}
        for req, k in wanted:
            if k <= 0:
                continue
            c = self.candidate(req, k)
            if c is not None:
                out[req.request_id] = Draft(c.token_ids, parents=c.parents,
                                            worth=c.probs if c.parents is not None else None)
        return out

    def candidate(self, req: Request, k: int) -> Candidate | None:
        """The better of the request's own and the shared corpus' drafts for `req`, up to k tokens."""
        rid = req.request_id
        local = self.local.get(rid)
        if local is None:
            local = self.local[rid] = SuffixCorpus(self.min_match)
            self.requests[rid] = req
        # the request's tokens, grown in place with its new outputs (`all_token_ids` would copy the
        # whole sequence, every sequence, every step)
        seq = local.seqs.get(rid)
        tokens = seq.tokens if seq is not None else list(req.prompt_token_ids)
        tokens.extend(req.output_token_ids[len(tokens) - req.num_prompt_tokens:])
        local.extend(rid, tokens)
        args = (k, self.max_match, self.min_token_prob, self.max_spec_factor, self.tree_nodes)
        mine, _ = local.lookup(tokens, *args)
        if req.sampling.seed is not None and not req.sampling.greedy:
            # a seeded sample's draws depend on its drafts: only its own tokens may shape them,
            # so the same seed gives the same output whatever else this engine served
            return mine
        theirs, key = self.shared.lookup(tokens, *args)
        if theirs is None:
            return mine
        self.shared.touch(key)  # a hit: that output stays in the corpus longer
        if mine is None:
            return theirs
        if self.tree_nodes:  # a tree holds both corpora's guesses where they differ
            first, second = (theirs, mine) if (theirs.score, theirs.match_len) > (mine.score, mine.match_len) else (mine, theirs)
            return merge_trees(first, second, self.tree_nodes)
        return theirs if (theirs.score, theirs.match_len) > (mine.score, mine.match_len) else mine

    def clear(self) -> None:
        """Forget the finished requests' outputs (benchmarks: each run starts from none)."""
        self.shared = SuffixCorpus(self.min_match)

    def release(self, request_id: str) -> None:
        """The request is done: its output joins the shared corpus (the oldest outputs leave it)."""
        self.local.pop(request_id, None)
        req = self.requests.pop(request_id, None)
        if req is None:
            return
        output = list(req.output_token_ids)
        if len(output) > self.min_match:
            self._finished += 1
            self.shared.extend(self._finished, output[-self.max_global_tokens:])
            while self.shared.num_tokens > self.max_global_tokens:
                self.shared.remove(next(iter(self.shared.seqs)))
