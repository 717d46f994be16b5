"""The MoE layer's small steps in one launch each (the decode-size fixes for issue 29): the router's
choice (`route_fused`: scores, group restriction, top-k, renormalisation and scaling, one program per
token) and the sort of (token, slot) pairs by expert (`align_fused`: counts, prefix sums, the padded
order and each tile's expert, one program; `align_parallel`, the same in five launches of many programs
for any number of pairs). They replace chains of small torch kernels (about 10 for
the router, 25 for the align step) and read no device value on the host, so a step with them can be
captured in a CUDA graph. engine.moe.route and engine.kernels.moe.align_by_expert are the references.
One token's choice is `_route_token`, which engine.kernels.moe_decode's programs call too.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem.engine.config import MoEConfig
from tandem.engine.kernels.validate import INDEX_DTYPES, next_power_of_2, require_runnable, require_tensor

GREEDY, GROUP_MAX, GROUP_TOP2 = 0, 1, 2
_GROUP_RANKING = {"greedy": GREEDY, "group_limited_greedy": GROUP_MAX, "noaux_tc": GROUP_TOP2}


@triton.jit
def _first_max(values, index, big: tl.constexpr):
    """The lowest index holding the maximum of a 2-D block (ties go to the lower expert)."""
    best = tl.max(tl.max(values, 1), 0)
    return tl.min(tl.min(tl.where(values == best, index, big), 1), 0)


@triton.jit
def _route_token(row_ptr, bias_ptr, scale,
                 N_GROUP: tl.constexpr, GROUP_SIZE: tl.constexpr, TOPK_GROUP: tl.constexpr, TOP_K: tl.constexpr,
                 G_PAD: tl.constexpr, S_PAD: tl.constexpr, K_PAD: tl.constexpr, SOFTMAX: tl.constexpr,
                 HAS_BIAS: tl.constexpr, RANKING: tl.constexpr, RENORM: tl.constexpr, BIG: tl.constexpr):
    """One token's choice from its logits at row_ptr: -> (ids [K_PAD] int32, weights [K_PAD] fp32,
    renormalised and scaled; slots from TOP_K on hold 0). _route_kernel and engine.kernels.moe_decode's
    gate/up programs both route with it, so they choose alike."""
    # the token's experts seen as [group, expert in group]: expert id = g * GROUP_SIZE + j
    g = tl.arange(0, G_PAD)[:, None]
    j = tl.arange(0, S_PAD)[None, :]
    idx = g * GROUP_SIZE + j
    valid = (g < N_GROUP) & (j < GROUP_SIZE)
    logit = tl.load(row_ptr + idx, mask=valid, other=float("-inf"))
    if SOFTMAX:
        e = tl.exp(logit - tl.max(tl.max(logit, 1), 0))
        scores = e / tl.sum(tl.sum(e, 1), 0)
    else:
        scores = 1.0 / (1.0 + tl.exp(-logit))
    choice = scores
    if HAS_BIAS:
        choice += tl.load(bias_ptr + idx, mask=valid, other=0.0)
    # NaN (a padding row of a static batch holds whatever was in memory) ranks lowest: every id
    # written stays in [0, E), as torch.topk's do, so no other token's rows can be overwritten
    choice = tl.where(valid & (choice == choice), choice, float("-inf"))
    if RANKING != 0:
        group_score = tl.max(choice, 1)  # [G_PAD]: a group's best (group_limited_greedy)
        if RANKING == 2:  # noaux_tc: its two best (one if a group holds one expert)
            first = tl.min(tl.where(choice == group_score[:, None], j, S_PAD), 1)
            second = tl.max(tl.where(j == first[:, None], float("-inf"), choice), 1)
            if GROUP_SIZE > 1:
                group_score += second
        gi = tl.arange(0, G_PAD)
        group_score = tl.where(gi < N_GROUP, group_score, float("-inf"))
        keep = gi < 0
        for _ in tl.static_range(TOPK_GROUP):
            best = tl.max(group_score, 0)
            pick = tl.min(tl.where(group_score == best, gi, G_PAD), 0)
            keep = keep | (gi == pick)
            group_score = tl.where(gi == pick, float("-inf"), group_score)
        choice = tl.where(keep[:, None], choice, float("-inf"))
    slots = tl.arange(0, K_PAD)
    chosen = tl.zeros((K_PAD,), dtype=tl.int32)
    weights = tl.zeros((K_PAD,), dtype=tl.float32)
    for s in tl.static_range(TOP_K):
        pick = _first_max(tl.where(valid, choice, float("-inf")), tl.where(valid, idx, BIG), BIG)
        w = tl.sum(tl.sum(tl.where(idx == pick, scores, 0.0), 1), 0)
        chosen = tl.where(slots == s, pick, chosen)
        weights = tl.where(slots == s, w, weights)
        choice = tl.where(idx == pick, float("-inf"), choice)
    if RENORM:
        weights = weights / (tl.sum(weights, 0) + 1e-20)
    return chosen, weights * scale


@triton.jit
def _route_kernel(logits_ptr, bias_ptr, weights_ptr, ids_ptr, stride_l, scale,
                  N_GROUP: tl.constexpr, GROUP_SIZE: tl.constexpr, TOPK_GROUP: tl.constexpr, TOP_K: tl.constexpr,
                  G_PAD: tl.constexpr, S_PAD: tl.constexpr, K_PAD: tl.constexpr, SOFTMAX: tl.constexpr,
                  HAS_BIAS: tl.constexpr, RANKING: tl.constexpr, RENORM: tl.constexpr, BIG: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)  # one program per token
    chosen, weights = _route_token(logits_ptr + t * stride_l, bias_ptr, scale, N_GROUP, GROUP_SIZE, TOPK_GROUP,
                                   TOP_K, G_PAD, S_PAD, K_PAD, SOFTMAX, HAS_BIAS, RANKING, RENORM, BIG)
    slots = tl.arange(0, K_PAD)
    out = t * TOP_K + slots
    tl.store(weights_ptr + out, weights, mask=slots < TOP_K)
    tl.store(ids_ptr + out, chosen, mask=slots < TOP_K)


def route_constants(moe: MoEConfig) -> dict:
    """The compile-time arguments of `_route_token` (and so of every kernel that routes with it) for
    one routing config: the group layout, padded sizes and the scoring/ranking switches."""
    ranking = _GROUP_RANKING[moe.topk_method]
    n_group = 1 if ranking == GREEDY else moe.n_group
    group_size = moe.num_experts // n_group
    return dict(N_GROUP=n_group, GROUP_SIZE=group_size, TOPK_GROUP=moe.topk_group if ranking != GREEDY else 1,
                TOP_K=moe.top_k, G_PAD=next_power_of_2(n_group), S_PAD=next_power_of_2(group_size),
                K_PAD=next_power_of_2(moe.top_k), SOFTMAX=moe.scoring == "softmax", HAS_BIAS=moe.uses_score_bias,
                RANKING=ranking, RENORM=moe.norm_topk_prob,
                BIG=4 * next_power_of_2(n_group) * next_power_of_2(group_size))


def check_routing(logits_experts: int, device: torch.device, moe: MoEConfig, score_bias: torch.Tensor | None) -> None:
    """The checks route_fused and engine.kernels.moe_decode make of a router's experts and score bias."""
    if logits_experts != moe.num_experts:
        raise ValueError(f"logits have {logits_experts} experts but the config has num_experts {moe.num_experts}")
    if moe.uses_score_bias != (score_bias is not None):
        raise ValueError(f"score_bias must be given exactly when topk_method is noaux_tc (got "
                         f"{'one' if score_bias is not None else 'none'} for {moe.topk_method})")
    if score_bias is not None:
        require_tensor("score_bias", score_bias, ndim=1, dtypes=(torch.float32,))
        if score_bias.shape[0] != logits_experts or score_bias.device != device:
            raise ValueError(f"score_bias must be [{logits_experts}] on {device}, got "
                             f"{tuple(score_bias.shape)} on {score_bias.device}")


def route_fused(logits: torch.Tensor, moe: MoEConfig,
                score_bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """engine.moe.route in one launch: logits [T, E] fp32 -> (weights [T, top_k] fp32, ids [T, top_k]
    int32). Among tied scores the lower expert id is chosen (torch.topk leaves that order open)."""
    require_tensor("logits", logits, ndim=2, dtypes=(torch.float32,))
    require_runnable(logits, _route_kernel)
    tokens, experts = logits.shape
    check_routing(experts, logits.device, moe, score_bias)
    weights = torch.empty((tokens, moe.top_k), dtype=torch.float32, device=logits.device)
    ids = torch.empty((tokens, moe.top_k), dtype=torch.int32, device=logits.device)
    if tokens == 0:
        return weights, ids
    _route_kernel[(tokens,)](logits, score_bias if score_bias is not None else logits, weights, ids,
                             logits.stride(0), float(moe.routed_scaling_factor), **route_constants(moe))
    return weights, ids


@triton.jit
def _align_kernel(ids_ptr, sorted_ptr, block_expert_ptr, num_padded_ptr, num_pairs, num_experts, rows,
                  BLOCK_M: tl.constexpr, E_PAD: tl.constexpr, CHUNK: tl.constexpr):
    experts = tl.arange(0, E_PAD)
    offs = tl.arange(0, CHUNK)
    counts = tl.zeros((E_PAD,), dtype=tl.int32)
    for start in range(0, num_pairs, CHUNK):
        e = tl.load(ids_ptr + start + offs, mask=start + offs < num_pairs, other=-1).to(tl.int32)
        counts += tl.sum((e[:, None] == experts[None, :]).to(tl.int32), 0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, 0)
    starts = ends - padded
    total = tl.sum(padded, 0)
    tl.store(num_padded_ptr, total)
    # every row's expert (experts whose run ends at or before it); rows past an expert's pairs are padding
    for r0 in range(0, rows, CHUNK):
        r = r0 + offs
        e_row = tl.sum((ends[None, :] <= r[:, None]).to(tl.int32), 1)
        one_hot = e_row[:, None] == experts[None, :]
        in_run = r - tl.sum(tl.where(one_hot, starts[None, :], 0), 1) < tl.sum(tl.where(one_hot, counts[None, :], 0), 1)
        tl.store(sorted_ptr + r, num_pairs + 0 * r, mask=(r < rows) & ~((r < total) & in_run))
        tl.store(block_expert_ptr + r // BLOCK_M, tl.minimum(e_row, num_experts - 1),
                 mask=(r < rows) & (r % BLOCK_M == 0))
    # each pair's row: its expert's start + the pairs of that expert before it (pair order kept)
    seen = tl.zeros((E_PAD,), dtype=tl.int32)
    for start in range(0, num_pairs, CHUNK):
        p = start + offs
        e = tl.load(ids_ptr + p, mask=p < num_pairs, other=-1).to(tl.int32)
        one_hot = e[:, None] == experts[None, :]
        base = tl.sum(tl.where(one_hot, (starts + seen)[None, :], 0), 1)
        rank = tl.sum(((e[:, None] == e[None, :]) & (offs[None, :] < offs[:, None])).to(tl.int32), 1)
        tl.store(sorted_ptr + base + rank, p, mask=(p < num_pairs) & (e >= 0) & (e < num_experts))
        seen += tl.sum(one_hot.to(tl.int32), 0)


def align_fused(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """engine.kernels.moe.align_by_expert in one launch (the same outputs, element for element).
    One program walks the pairs twice and every padded row once: on an H200 it beats the ~25 torch
    kernels at a few dozen pairs and loses to them from a few hundred (engine.kernels.moe picks)."""
    require_tensor("ids", ids, ndim=2, dtypes=INDEX_DTYPES)
    require_runnable(ids, _align_kernel)
    if not ids.is_contiguous():
        raise ValueError("ids must be contiguous")
    pairs = ids.numel()
    rows = -(-(pairs + min(pairs, num_experts) * (block_m - 1)) // block_m) * block_m
    sorted_pairs = torch.empty((rows,), dtype=torch.int32, device=ids.device)
    block_expert = torch.empty((rows // block_m,), dtype=torch.int32, device=ids.device)
    num_padded = torch.empty((1,), dtype=torch.int32, device=ids.device)
    e_pad = next_power_of_2(num_experts)
    chunk = max(16, min(128, 8192 // e_pad))
    launch = {"num_warps": 8 if e_pad >= 256 else 4} if ids.device.type == "cuda" else {}
    _align_kernel[(1,)](ids, sorted_pairs, block_expert, num_padded, pairs, num_experts, rows,
                        BLOCK_M=block_m, E_PAD=e_pad, CHUNK=chunk, **launch)
    return sorted_pairs, block_expert, num_padded


@triton.jit
def _count_kernel(ids_ptr, counts_ptr, rank_ptr, num_pairs, BLOCK: tl.constexpr):
    # each pair's rank among its expert's pairs: the expert's count before this pair's atomic add
    p = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = p < num_pairs
    e = tl.load(ids_ptr + p, mask=m, other=0).to(tl.int32)
    rank = tl.atomic_add(counts_ptr + e, tl.full((BLOCK,), 1, tl.int32), mask=m)
    tl.store(rank_ptr + p, rank, mask=m)


@triton.jit
def _scan_kernel(counts_ptr, starts_ptr, block_expert_ptr, num_padded_ptr, num_experts, num_tiles,
                 BLOCK_M: tl.constexpr, E_PAD: tl.constexpr, CHUNK: tl.constexpr):
    experts = tl.arange(0, E_PAD)
    counts = tl.load(counts_ptr + experts, mask=experts < num_experts, other=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, 0)
    tl.store(starts_ptr + experts, ends - padded, mask=experts < num_experts)
    tl.store(num_padded_ptr, tl.sum(padded, 0))
    for t0 in range(0, num_tiles, CHUNK):
        tiles = t0 + tl.arange(0, CHUNK)
        e_tile = tl.sum((ends[None, :] <= tiles[:, None] * BLOCK_M).to(tl.int32), 1)
        tl.store(block_expert_ptr + tiles, tl.minimum(e_tile, num_experts - 1), mask=tiles < num_tiles)


@triton.jit
def _place_kernel(ids_ptr, rank_ptr, starts_ptr, sorted_ptr, num_pairs, BLOCK: tl.constexpr):
    p = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = p < num_pairs
    e = tl.load(ids_ptr + p, mask=m, other=0).to(tl.int32)
    row = tl.load(starts_ptr + e, mask=m, other=0) + tl.load(rank_ptr + p, mask=m, other=0)
    tl.store(sorted_ptr + row, p.to(tl.int32), mask=m)


def align_parallel(ids: torch.Tensor, num_experts: int,
                   block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """engine.kernels.moe.align_by_expert in five launches of many programs (the counts and each
    pair's rank by atomic adds, one program for the prefix sums and each tile's expert, the
    placement), for any number of pairs. The outputs equal the torch align's, except that the pairs
    of one expert come in the order the atomic adds ran, not pair order: every pair's rows are its
    own, so the experts' outputs do not depend on it."""
    require_tensor("ids", ids, ndim=2, dtypes=INDEX_DTYPES)
    require_runnable(ids, _count_kernel)
    if not ids.is_contiguous():
        raise ValueError("ids must be contiguous")
    pairs, dev = ids.numel(), ids.device
    rows = -(-(pairs + min(pairs, num_experts) * (block_m - 1)) // block_m) * block_m
    sorted_pairs = torch.full((rows,), pairs, dtype=torch.int32, device=dev)
    block_expert = torch.empty((rows // block_m,), dtype=torch.int32, device=dev)
    num_padded = torch.empty((1,), dtype=torch.int32, device=dev)
    counts = torch.zeros((num_experts,), dtype=torch.int32, device=dev)
    rank = torch.empty((pairs,), dtype=torch.int32, device=dev)
    starts = torch.empty((num_experts,), dtype=torch.int32, device=dev)
    block = 256
    grid = (triton.cdiv(pairs, block),)
    launch = {"num_warps": 4} if dev.type == "cuda" else {}
    _count_kernel[grid](ids, counts, rank, pairs, BLOCK=block, **launch)
    e_pad = next_power_of_2(num_experts)
    _scan_kernel[(1,)](counts, starts, block_expert, num_padded, num_experts, rows // block_m, BLOCK_M=block_m,
                       E_PAD=e_pad, CHUNK=max(16, min(128, 8192 // e_pad)), **launch)
    _place_kernel[grid](ids, rank, starts, sorted_pairs, pairs, BLOCK=block, **launch)
    return sorted_pairs, block_expert, num_padded
