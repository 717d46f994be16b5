"""One speculative step around the target's forward: before it, choose k per decoding sequence
(length policy) and get that many drafts (proposer); after it, turn each sequence's 1 + k logits
rows into its new tokens (verify) and feed the outcome back to the policy.

The engine keeps its step as schedule -> run -> postprocess; this object only adds the drafts to
what is scheduled and replaces plain sampling with acceptance. Sequences without drafts (prefill
chunks, sequences the policy turned off, n-gram misses) sample as plain decoding does, in the
same batch. A tree draft (the suffix proposer's, `Draft.parents`) is cut to the nodes that pay
(`policy.choose_nodes`), verified in the same forward (engine.speculative.tree), and its accepted
path's KV and logits rows are moved to where a chain's would be (`move_kv`).
"""

from __future__ import annotations

from collections.abc import Collection

import torch

from tandem.engine.config import SpeculativeConfig
from tandem.engine.request import Request
from tandem.engine.sampler import Sampler, probs_for
from tandem.engine.speculative.draft_model import DraftModelProposer, early_exit_model
from tandem.engine.speculative.ngram import NgramProposer
from tandem.engine.speculative.policy import SpeculationLengthPolicy
from tandem.engine.speculative.proposer import Draft, Proposer
from tandem.engine.speculative.suffix import SuffixProposer
from tandem.engine.speculative.tree import accept_tree_greedy, depths, kv_moves
from tandem.engine.speculative.verify import accept_greedy, accept_sampled, accept_tree_sampled
from tandem.engine.weights import load_model


class Speculator:
    def __init__(self, proposer: Proposer, policy: SpeculationLengthPolicy, sampler: Sampler, num_tokens: int,
                 max_drafts: int | None = None):
        self.proposer = proposer
        self.policy = policy
        self.sampler = sampler
        self.num_tokens = num_tokens  # default k for requests that do not set their own
        self.max_drafts = max_drafts  # per sequence per step, whatever a request asks (None: no bound)
        self._tracked: set[str] = set()

    def caps(self, running: list[Request]) -> tuple[dict[str, int], int]:
        """(request id -> most drafts this step, for sequences decoding; prefill tokens in flight)."""
        caps: dict[str, int] = {}
        other = 0
        for r in running:
            if r.prefill_only or r.num_computed_tokens != r.num_tokens - 1:
                other += r.num_tokens - r.num_computed_tokens
                continue
            if r.sampling.penalized:  # its logits are penalized by what precedes each row: no drafts
                continue
            k = r.sampling.num_speculative_tokens
            k = self.num_tokens if k is None else k
            k = k if self.max_drafts is None else min(k, self.max_drafts)
            # every accepted draft plus the bonus token is output: never draft past max_tokens
            caps[r.request_id] = min(k, r.sampling.max_tokens - len(r.output_token_ids) - 1)
        return caps, other

    def propose(self, running: list[Request], alive: Collection[str]) -> dict[str, Draft]:
        """Drafts for this step's decoding sequences; `alive`: ids of requests still in flight
        (per-request state of the others is dropped)."""
        for rid in [r for r in self._tracked if r not in alive]:
            self.release(rid)
        caps, other = self.caps(running)
        self._tracked.update(caps)  # the policy keeps state for every sequence it was asked about
        ks = self.policy.choose(caps, other)
        if not ks:
            return {}
        by_id = {r.request_id: r for r in running}
        wanted = [(by_id[rid], k) for rid, k in ks.items()]
        drafts = self.proposer.propose(wanted)
        drafts = {rid: d if d.parents is not None else d.head(ks[rid]) for rid, d in drafts.items()
                  if len(d) and rid in ks}
        trees = {rid: (d.worth or [1.0] * len(d), depths(d.parents))
                 for rid, d in drafts.items() if d.parents is not None}
        if trees:  # the proposer's trees, cut to the nodes that pay (k bounded their depth)
            kept = self.policy.choose_nodes(trees, len(caps), other)
            for rid in trees:
                drafts[rid] = drafts[rid].select(kept[rid]) if kept.get(rid) else None
            drafts = {rid: d for rid, d in drafts.items() if d is not None}
        return drafts

    def verify(self, logits: torch.Tensor, owners: list[tuple[str, int]], drafts: dict[str, Draft],
               requests: dict[str, Request]) -> tuple[dict[str, list[int]], dict[str, int], dict[str, list[tuple[int, int]]]]:
        """logits [N, V]: `owners` lists (request id, rows) in order, rows = 1 + its drafts.
        -> (request id -> new tokens: accepted drafts + one, request id -> drafts accepted,
        request id -> the KV rows to copy (source, destination) to put a tree's accepted path in
        place: engine.speculative.tree.kv_moves)."""
        target_ids = logits.argmax(-1).tolist()
        sampled: dict[str, list[int]] = {}
        accepted: dict[str, int] = {}
        moves: dict[str, list[tuple[int, int]]] = {}
        row = 0
        for rid, rows in owners:
            sp = requests[rid].sampling
            draft = drafts.get(rid)
            if draft is not None and draft.is_tree:
                new = self._verify_tree(logits[row:row + rows], target_ids[row:row + rows], draft, rid, sp, moves)
                if rid in moves:  # the accepted path's rows to the front, as its KV: logprobs read them there
                    src, dst = ([row + pair[i] for pair in moves[rid]] for i in (0, 1))
                    with torch.inference_mode():  # the runner's logits are an inference tensor
                        logits[dst] = logits[src]
            else:
                ids = draft.token_ids[:rows - 1] if draft is not None else []
                if sp.greedy:
                    new = accept_greedy(target_ids[row:row + rows], ids)
                else:
                    p = probs_for(logits[row:row + rows].cpu(), sp)  # [1 + k, V]
                    q = None if draft is None or draft.probs is None else draft.probs[:rows - 1].to(p.device)
                    new = accept_sampled(p, ids, q, self.sampler.generator(rid, sp.seed))
                if ids:
                    self.policy.observe(rid, len(ids), len(new) - 1)
            if draft is not None and len(draft):
                accepted[rid] = len(new) - 1
            sampled[rid] = new
            row += rows
        return sampled, accepted, moves

    def _verify_tree(self, logits, target_ids, draft: Draft, rid, sp, moves) -> list[int]:
        if draft.probs is not None:
            raise ValueError("tree drafts must be deterministic (Draft.probs None): sampled drafts "
                             "in a tree are not verified")
        if sp.greedy:
            path, new = accept_tree_greedy(target_ids, draft.token_ids, draft.parents)
        else:
            p = probs_for(logits.cpu(), sp)  # [1 + n, V]
            path, new = accept_tree_sampled(p, draft.token_ids, draft.parents, self.sampler.generator(rid, sp.seed))
        # the walk stopped at a rejection unless it reached a leaf: that is one more depth tried
        end = path[-1] if path else -1
        rejected = any(p == end for p in draft.parents)
        self.policy.observe(rid, len(path) + rejected, len(path))
        if kv_moves(path):
            moves[rid] = kv_moves(path)
        return new

    @staticmethod
    def move_kv(kv_cache: torch.Tensor, requests: dict[str, Request],
                moves: dict[str, list[tuple[int, int]]]) -> None:
        """Copy each tree's accepted nodes' K/V to the sequence's next positions, before the
        scheduler counts them computed: `moves[rid]` rows are relative to the verify step's first
        position (the sequence's computed tokens). kv_cache: [layers, 2, blocks, block_size, Hkv, D]."""
        if not moves:
            return
        bs = kv_cache.shape[3]
        src, dst = [], []
        for rid, pairs in moves.items():
            req = requests[rid]
            for a, b in pairs:
                for rows, row in ((src, a), (dst, b)):
                    pos = req.num_computed_tokens + row
                    rows.append(req.block_ids[pos // bs] * bs + pos % bs)
        flat = kv_cache.flatten(2, 3)  # [layers, 2, slots, Hkv, D] (a view)
        index = [torch.tensor(x, dtype=torch.long).to(kv_cache.device, non_blocking=True) for x in (src, dst)]
        flat[:, :, index[1]] = flat[:, :, index[0]]  # gathered first: sources never overlap later writes

    def release(self, request_id: str) -> None:
        self._tracked.discard(request_id)
        self.policy.forget(request_id)
        self.proposer.release(request_id)


def resolve_max_verify_tokens(cfg: SpeculativeConfig, device: torch.device) -> int:
    if cfg.max_verify_tokens is not None:
        return cfg.max_verify_tokens
    # where a forward stops being bound by reading the weights (bench/speculative.py): Llama-3-8B
    # in bf16 on an H200 verifies 64 x 4 tokens for 1.36 decode steps and 64 x 5 for 2.3; on a CPU
    # core every token costs from the first (verify_token_cost), so the knee only bounds the step
    return 256 if device.type == "cuda" else 128


def resolve_verify_token_cost(cfg: SpeculativeConfig, device: torch.device) -> float:
    if cfg.verify_token_cost is not None:
        return cfg.verify_token_cost
    # smollm2-135m fp32 on one CPU core (bench/speculative.py, 2026-12-01): a step of 1 + k tokens
    # for one sequence costs about 1 + 0.13 k decode steps (fp32 weights are read once per step);
    # 8 sequences with 4 tokens each cost ~1.4x their decode step
    return 0.0 if device.type == "cuda" else 0.1


def build_speculator(cfg: SpeculativeConfig, target, sampler: Sampler, *, num_blocks: int, block_size: int,
                     dtype: str, seed: int, draft_model=None, proposer: Proposer | None = None,
                     max_rows: int | None = None) -> Speculator:
    """The proposer named by `cfg.method` (or the one given), with its length policy. max_rows:
    the most query rows (1 + drafts, chain or tree) a sequence may verify in a step; the engine
    passes the CUDA graphs' limit, since past it a step runs eager, which costs 3.5-6x a decode
    step on an H200 at batch 1-8 where a graphed 16-row tree costs 1.1x (docs/benchmarks.md)."""
    device = target.embed_tokens.weight.device
    max_drafts = None if max_rows is None else max_rows - 1
    tree_nodes = cfg.suffix_tree_nodes if max_drafts is None else min(cfg.suffix_tree_nodes, max_drafts)
    if proposer is None:
        if cfg.method == "ngram":
            proposer = NgramProposer(cfg.min_n, cfg.max_n)
        elif cfg.method == "suffix":
            proposer = SuffixProposer(min_match=cfg.min_n, max_match=cfg.suffix_max_match,
                                      min_token_prob=cfg.suffix_min_token_prob,
                                      max_spec_factor=cfg.suffix_max_spec_factor,
                                      max_global_tokens=cfg.suffix_max_global_tokens,
                                      tree_nodes=tree_nodes)
        elif cfg.method == "draft":
            if draft_model is None:
                if cfg.draft_model is not None:
                    draft_model, _, _ = load_model(cfg.draft_model, dtype, str(device), seed + 1)
                else:
                    draft_model = early_exit_model(target, cfg.draft_num_layers)
            if draft_model.config.vocab_size != target.config.vocab_size:
                raise ValueError(f"the draft model's vocabulary ({draft_model.config.vocab_size}) differs "
                                 f"from the target's ({target.config.vocab_size})")
            proposer = DraftModelProposer(draft_model, cfg.draft_num_blocks or num_blocks, block_size, sampler)
        else:
            raise ValueError(f"speculative method {cfg.method!r} has no proposer")
    policy = SpeculationLengthPolicy.from_config(cfg, resolve_max_verify_tokens(cfg, device),
                                                 resolve_verify_token_cost(cfg, device),
                                                 padded_rows=device.type == "cuda")
    return Speculator(proposer, policy, sampler, cfg.num_tokens, max_drafts)
