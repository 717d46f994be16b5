"""Log-probabilities of the tokens a step produced, for the requests that asked for them
(`SamplingParams.logprobs` set); a step where none asked computes nothing.

Each token's logprob is taken from the distribution it was actually drawn from: the model's raw
logits for a greedy request, the temperature/top-k/top-p distribution (`sampler.filter_logits`)
for a sampled one, so a token outside top-k/top-p is -inf. A speculative step's accepted drafts and
its bonus token take the target's rows at their positions: speculative sampling draws each
position's token from that target distribution, so the logprobs are those plain decoding reports.
"""

from __future__ import annotations

import torch

from tandem.engine.request import Request
from tandem.engine.sampler import filter_logits
from tandem.wire.messages import SamplingParams, TokenLogprob


def token_logprobs(logits: torch.Tensor, sp: SamplingParams, token_ids: list[int]) -> list[TokenLogprob]:
    """logits [n, V] (row i gave token_ids[i]) -> one TokenLogprob per token, each with the
    `sp.logprobs` most likely tokens of its distribution."""
    logits = logits.float()
    if not sp.greedy:
        logits = filter_logits(logits, sp.temperature, sp.top_k, sp.top_p)
    logp = logits.log_softmax(-1)                                                   # [n, V]
    ids = torch.tensor(token_ids, dtype=torch.int64, device=logp.device)
    chosen = logp.gather(1, ids[:, None]).squeeze(1).tolist()                       # [n]
    k = min(sp.logprobs or 0, logp.shape[-1])
    if not k:
        return [TokenLogprob(lp) for lp in chosen]
    top = torch.topk(logp, k, dim=-1)
    top_ids, top_lps = top.indices.tolist(), top.values.tolist()
    return [TokenLogprob(lp, tuple(zip(i, v))) for lp, i, v in zip(chosen, top_ids, top_lps)]


def step_logprobs(produced: list[tuple[Request, list[int]]], logits: torch.Tensor,
                  owners: list[tuple[str, int]]) -> dict[str, list[TokenLogprob]]:
    """request id -> the logprobs of its new tokens, for the requests of this step that asked.
    `owners`: (request id, logits rows) in row order (`BatchInputs.logits_owner`); a request's new
    tokens are a prefix of its rows' tokens (EOS, max_tokens or a stop string may cut them)."""
    wanted = [(req, new) for req, new in produced if new and req.sampling.logprobs is not None]
    if not wanted:
        return {}
    start, row = {}, 0
    for rid, rows in owners:
        start[rid] = row
        row += rows
    out = {}
    for req, new in wanted:
        r0 = start[req.request_id]
        out[req.request_id] = token_logprobs(logits[r0:r0 + len(new)], req.sampling, new)
    return out
