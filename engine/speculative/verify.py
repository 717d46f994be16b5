"""Acceptance: turning the target's 1 + k logits rows of a sequence into its new tokens, so that
the output is exactly what plain decoding gives: the same tokens for greedy requests, the same
distribution for sampled ones.

- greedy: keep drafts while each equals the target's argmax at its position; then add the target's
  argmax at the first mismatch (or after the last draft: the bonus token).
- sampled (standard speculative sampling): keep draft d at position i with probability
  min(1, p_i(d) / q_i(d)); at the first rejection draw from normalize(max(0, p_i - q_i)) and stop;
  if all k are kept, draw the bonus token from p_k. With deterministic drafts (n-gram) q_i is
  one-hot at d: keep it with probability p_i(d), else draw from p_i with d removed.
- trees (deterministic drafts: engine.speculative.tree): at a node, try its children in order:
  keep child c with probability p'(c), p' being the target's distribution at the node with the
  siblings rejected before c zeroed and renormalised; the kept child becomes the node; when every
  child is rejected (or the node is a leaf) draw the next token from p' and stop. The chain rule
  above is the one-child case. Each rejection removes exactly the mass the draft would have
  claimed, so every step's token is distributed as p (multi-draft speculative sampling with
  one-hot drafts, as SpecInfer).
Every random draw comes from the request's own generator, so a seeded request is reproducible.
"""

from __future__ import annotations

import torch

from tandem.engine.speculative.tree import children


def accept_greedy(target_ids: list[int], draft: list[int]) -> list[int]:
    """target_ids: the target's argmax at the 1 + k positions; draft: the k draft ids.
    -> the accepted drafts followed by one token from the target."""
    out: list[int] = []
    for i, d in enumerate(draft):
        if target_ids[i] != d:
            out.append(target_ids[i])
            return out
        out.append(d)
    out.append(target_ids[len(draft)])
    return out


def accept_drafts(p: torch.Tensor, draft: torch.Tensor, q: torch.Tensor | None,
                  u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The rejection rule on a batch of sequences with k drafts each.

    p: [B, k + 1, V] target probabilities; draft: [B, k] int64; q: [B, k, V] draft probabilities
    (None: one-hot at the drafts); u: [B, k] uniform draws in [0, 1).
    -> (accepted [B] int64: drafts kept per row, next_probs [B, V]: the unnormalised distribution
    the token after the kept drafts is drawn from)."""
    B, k1, V = p.shape
    k = k1 - 1
    rows = torch.arange(B)
    if k == 0:
        return torch.zeros(B, dtype=torch.int64), p[:, 0]
    p_d = p[:, :k].gather(2, draft[..., None]).squeeze(2)  # [B, k]
    q_d = torch.ones_like(p_d) if q is None else q.gather(2, draft[..., None]).squeeze(2)
    keep = u * q_d < p_d  # u < p/q, without dividing by a q that may underflow
    # accepted = length of the leading run of kept drafts
    accepted = torch.cumprod(keep.to(torch.int64), dim=1).sum(1)
    at = accepted.clamp(max=k - 1)  # first rejected position (clamped where none was)
    p_at = p[rows, at]  # [B, V]
    if q is None:
        residual = p_at.scatter(1, draft[rows, at][:, None], 0.0)
    else:
        residual = (p_at - q[rows, at]).clamp_min(0.0)
    # p == q up to rounding can leave nothing; then p itself is the right distribution
    empty = residual.sum(1, keepdim=True) <= 0
    residual = torch.where(empty, p_at, residual)
    next_probs = torch.where((accepted == k)[:, None], p[:, k], residual)
    return accepted, next_probs


def accept_sampled(p: torch.Tensor, draft: list[int], q: torch.Tensor | None,
                   generator: torch.Generator) -> list[int]:
    """One sequence: p [1 + k, V] (CPU), its k drafts, q [k, V] or None. -> accepted drafts + one."""
    k = len(draft)
    u = torch.rand(k, generator=generator)
    d = torch.tensor(draft, dtype=torch.int64)
    accepted, next_probs = accept_drafts(p[None], d[None], None if q is None else q[None], u[None])
    n = int(accepted.item())
    tok = int(torch.multinomial(next_probs[0], 1, generator=generator).item())
    return draft[:n] + [tok]


def accept_tree_sampled(p: torch.Tensor, token_ids: list[int], parents: list[int],
                        generator: torch.Generator) -> tuple[list[int], list[int]]:
    """One sequence's tree of deterministic drafts: p [1 + n, V] (CPU; row 0 the root, row 1 + i
    node i). -> (accepted nodes root to leaf, new tokens: theirs and then one drawn token)."""
    kids = children(parents)
    path: list[int] = []
    row = 0
    while True:
        dist = p[row].clone()  # p': the siblings rejected so far zeroed (unnormalised)
        for c in kids[row]:
            tok = token_ids[c]
            total = float(dist.sum())
            if total <= 0:  # rounding removed everything: the target's own row is the right law
                dist, total = p[row].clone(), float(p[row].sum())
            if float(torch.rand((), generator=generator)) * total < float(dist[tok]):
                path.append(c)
                row = c + 1
                break
            dist[tok] = 0.0
        else:
            if float(dist.sum()) <= 0:
                dist = p[row]
            tok = int(torch.multinomial(dist, 1, generator=generator).item())
            return path, [token_ids[c] for c in path] + [tok]
