"""Drafting with a smaller model of the same vocabulary, over its own paged KV cache.

The draft model keeps, per request, a shadow sequence: the tokens whose draft KV it has computed
(the target's tokens, then its own drafts) and the blocks holding that KV in its own cache, from
its own block allocator. Each `propose` first rolls the shadow back to the longest prefix that
still matches the request's tokens (drafts the target rejected are dropped, their blocks freed),
then runs one batched forward that catches every sequence up to its last token and samples the
first draft, then one batched single-token forward per further draft position.

`early_exit_model(target, n)`: a draft made of the target's own first n layers, final norm and LM
head (weights shared, nothing copied), for models that ship without a draft.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn

from tandem.engine.block_manager import BlockAllocator
from tandem.engine.kv_cache import KVCache
from tandem.engine.model import LlamaForCausalLM
from tandem.engine.model_runner import ModelRunner
from tandem.engine.request import Request
from tandem.engine.sampler import Sampler, probs_for
from tandem.engine.scheduler import ScheduledRequest, SchedulerOutput
from tandem.engine.speculative.proposer import Draft


def early_exit_model(target: LlamaForCausalLM, num_layers: int) -> LlamaForCausalLM:
    """The target's first `num_layers` layers + its final norm and LM head, sharing its weights."""
    if not 1 <= num_layers <= target.config.num_layers:
        raise ValueError(f"draft layers must be in [1, {target.config.num_layers}], got {num_layers}")
    cfg = dataclasses.replace(target.config, num_layers=num_layers)
    with torch.device("meta"):
        draft = LlamaForCausalLM(cfg, max_positions=1)
    draft.embed_tokens = target.embed_tokens
    draft.layers = nn.ModuleList(list(target.layers[:num_layers]))  # layer i still writes cache layer i
    draft.norm, draft.lm_head, draft.rotary = target.norm, target.lm_head, target.rotary
    draft.ops = target.ops
    return draft.eval()


@dataclass
class _Shadow:
    seq: Request  # token_ids: what the draft KV was (or is being) computed from; blocks: the draft cache's
    known: int = 0  # positions of `seq` known to equal the request's own tokens


class DraftModelProposer:
    def __init__(self, model: LlamaForCausalLM, num_blocks: int, block_size: int, sampler: Sampler):
        weight = model.embed_tokens.weight
        self.model = model
        self.kv_cache = KVCache(model.kv_cache_shape(num_blocks, block_size), weight.dtype, weight.device)
        self.allocator = BlockAllocator(num_blocks, block_size, enable_prefix_caching=False)
        self.runner = ModelRunner(model, self.kv_cache, weight.device)
        self.sampler = sampler
        self.shadows: dict[str, _Shadow] = {}
        self.tokens_computed = 0  # positions run through the draft model

    def _sync(self, req: Request) -> _Shadow:
        """Roll the shadow back to the draft KV that is still valid for `req`'s tokens, and point it
        at them. At least the last token is left to compute (its logits give the first draft)."""
        sh = self.shadows.get(req.request_id)
        if sh is None:
            sh = self.shadows[req.request_id] = _Shadow(Request(req.request_id, [], req.sampling))
        tokens = req.all_token_ids
        fed, computed = sh.seq.prompt_token_ids, sh.seq.num_computed_tokens
        valid = min(sh.known, computed)
        limit = min(computed, len(tokens) - 1)
        while valid < limit and fed[valid] == tokens[valid]:
            valid += 1
        valid = min(valid, limit)
        self.allocator.truncate(sh.seq, valid)
        sh.seq.num_computed_tokens = valid
        sh.seq.prompt_token_ids = tokens  # a fresh list: drafts get appended to it below
        sh.known = len(tokens)
        return sh

    def propose(self, wanted: list[tuple[Request, int]]) -> dict[str, Draft]:
        group: list[tuple[Request, _Shadow, int]] = []
        for req, k in wanted:
            if k <= 0:
                continue
            sh = self._sync(req)
            # KV for every position up to the last draft fed back in: num_tokens + k - 1
            if not self.allocator.grow(sh.seq, req.num_tokens + k - 1 - sh.seq.num_computed_tokens):
                self.release(req.request_id)  # draft cache full: this one decodes plainly for now
                continue
            group.append((req, sh, k))
        drafts: dict[str, list[int]] = {req.request_id: [] for req, _, _ in group}
        probs: dict[str, list[torch.Tensor]] = {req.request_id: [] for req, _, _ in group}
        while group:
            sched = SchedulerOutput([ScheduledRequest(sh.seq, sh.seq.num_tokens - sh.seq.num_computed_tokens)
                                     for _, sh, _ in group])
            logits = self.runner.execute(self.runner.prepare(sched))  # [len(group), V]
            self.tokens_computed += sched.num_tokens
            greedy_ids = logits.argmax(-1).tolist()
            still: list[tuple[Request, _Shadow, int]] = []
            for i, (req, sh, k) in enumerate(group):
                sh.seq.num_computed_tokens = sh.seq.num_tokens
                rid, sp = req.request_id, req.sampling
                if sp.greedy:
                    tok = greedy_ids[i]
                else:
                    q = probs_for(logits[i].cpu(), sp)
                    tok = int(torch.multinomial(q, 1, generator=self.sampler.generator(rid, sp.seed)).item())
                    probs[rid].append(q)
                drafts[rid].append(tok)
                if len(drafts[rid]) < k:
                    sh.seq.prompt_token_ids.append(tok)
                    still.append((req, sh, k))
            group = still
        return {rid: Draft(ids, torch.stack(probs[rid]) if probs[rid] else None) for rid, ids in drafts.items()}

    def release(self, request_id: str) -> None:
        sh = self.shadows.pop(request_id, None)
        if sh is not None:
            self.allocator.free(sh.seq)
