"""engine.kernels.moe_route under Triton's interpreter on CPU: the one-launch router against
engine.moe.route for every gating variant (Qwen3's softmax top-k renormalised, DeepSeek-V2's greedy
and group-limited top-k scaled, DeepSeek-V3's sigmoid + bias noaux_tc), with ties, at T = 1 and 7 (and 40 for V3's);
and the one-launch align step against the torch one (engine.kernels.moe.align_by_expert), element
for element, including tokens that all chose the same experts and experts no token chose."""

from __future__ import annotations

import pytest
import torch

from tandem.engine.config import MoEConfig
from tandem.engine.kernels.moe import align_by_expert
from tandem.engine.kernels.moe_route import align_fused, align_parallel, route_fused
from tandem.engine.moe import route

GATINGS = {
    "qwen3": MoEConfig(num_experts=8, top_k=3, intermediate_size=4, norm_topk_prob=True),
    "v2-greedy": MoEConfig(num_experts=12, top_k=3, intermediate_size=4, routed_scaling_factor=2.5),
    "v2-group-limited": MoEConfig(num_experts=12, top_k=3, intermediate_size=4, topk_method="group_limited_greedy",
                                  n_group=4, topk_group=2, routed_scaling_factor=2.5),
    "v3-noaux-tc": MoEConfig(num_experts=16, top_k=4, intermediate_size=4, scoring="sigmoid", topk_method="noaux_tc",
                             n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5),
}


@pytest.mark.parametrize("kind", list(GATINGS))
def test_route_fused_matches_route(kind):
    moe = GATINGS[kind]
    gen = torch.Generator().manual_seed(len(kind))
    bias = torch.randn(moe.num_experts, generator=gen) * 0.1 if moe.uses_score_bias else None
    for tokens in (1, 7, 40) if kind == "v3-noaux-tc" else (1, 7):  # the interpreter runs a program per token
        logits = torch.randn(tokens, moe.num_experts, generator=gen) * 2
        want_w, want_ids = route(logits, moe, bias)
        got_w, got_ids = route_fused(logits, moe, bias)
        assert got_ids.dtype == torch.int32 and torch.equal(got_ids.long(), want_ids), (tokens, got_ids, want_ids)
        assert torch.allclose(got_w, want_w, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("kind", ["qwen3", "v3-noaux-tc"])
def test_route_fused_breaks_ties_toward_the_lower_expert(kind):
    moe = GATINGS[kind]
    logits = torch.zeros(2, moe.num_experts)
    logits[1, ::3] = 1.0  # token 0: all tied; token 1: ties among every third expert
    bias = torch.zeros(moe.num_experts) if moe.uses_score_bias else None
    weights, ids = route_fused(logits, moe, bias)
    want_w, _ = route(logits, moe, bias)  # torch.topk leaves the order of ties open: compare the weights
    assert ids[0].tolist() == list(range(moe.top_k))
    # v3: groups {0..3} and {12..15} hold two high experts each (0, 3 and 12, 15), groups 1 and 2 one
    assert ids[1].tolist() == ([0, 3, 6] if kind == "qwen3" else [0, 3, 12, 15])
    assert torch.allclose(weights, want_w)


@pytest.mark.parametrize("kind", ["qwen3", "v2-group-limited", "v3-noaux-tc"])
def test_route_fused_keeps_ids_in_range_on_nan_rows(kind):
    """A static batch's padding rows hold whatever was in memory: NaN logits must still give ids in
    [0, E) (an id past the end would send the align step's store over another token's row)."""
    moe = GATINGS[kind]
    logits = torch.randn(3, moe.num_experts)
    logits[1] = float("nan")
    logits[2, ::2] = float("nan")
    bias = torch.zeros(moe.num_experts) if moe.uses_score_bias else None
    _, ids = route_fused(logits, moe, bias)
    assert ((ids >= 0) & (ids < moe.num_experts)).all(), ids
    assert torch.equal(ids[0].long(), route(logits[:1], moe, bias)[1][0])


def test_route_fused_refuses_what_it_cannot_serve():
    moe = GATINGS["v3-noaux-tc"]
    logits = torch.randn(3, moe.num_experts)
    with pytest.raises(ValueError, match="score_bias"):
        route_fused(logits, moe, None)
    with pytest.raises(ValueError, match="score_bias"):
        route_fused(logits, moe, torch.zeros(moe.num_experts + 1))
    with pytest.raises(ValueError, match="num_experts"):
        route_fused(logits[:, :8], moe, torch.zeros(moe.num_experts))
    with pytest.raises(ValueError, match="logits"):
        route_fused(logits.double(), GATINGS["qwen3"])


@pytest.mark.parametrize("tokens,top_k,experts,block_m,same", [
    (1, 8, 128, 16, False), (7, 2, 12, 16, True), (40, 3, 5, 4, False), (300, 6, 64, 16, False)])
def test_align_fused_equals_the_torch_align(tokens, top_k, experts, block_m, same):
    gen = torch.Generator().manual_seed(tokens)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)])
    if same:  # every token chose the same experts: one long run per expert, most experts unused
        ids[:] = ids[0]
    want = align_by_expert(ids, experts, block_m)
    for dtype in (torch.int64, torch.int32):
        got = align_fused(ids.to(dtype), experts, block_m)
        assert all(torch.equal(g, w.to(torch.int32)) for g, w in zip(got, want))


@pytest.mark.parametrize("tokens,top_k,experts,block_m,same", [
    (1, 8, 128, 16, False), (7, 2, 12, 16, True), (40, 3, 5, 4, False), (300, 6, 64, 16, False)])
def test_align_parallel_equals_the_torch_align_up_to_order_within_an_expert(tokens, top_k, experts, block_m, same):
    """The same tiles, tile experts and rows in use; each expert's run holds the same pairs (their
    order within the run is the atomic adds', which the experts' outputs do not depend on)."""
    gen = torch.Generator().manual_seed(tokens + 1)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)])
    if same:
        ids[:] = ids[0]
    want_pairs, want_experts, want_used = align_by_expert(ids, experts, block_m)
    for dtype in (torch.int64, torch.int32):
        pairs, block_expert, used = align_parallel(ids.to(dtype), experts, block_m)
        assert torch.equal(used, want_used.to(torch.int32)) and torch.equal(block_expert, want_experts)
        assert pairs.shape == want_pairs.shape
        for tile in range(0, int(used), block_m):  # each tile: one expert's pairs (and padding), as a set
            assert sorted(pairs[tile:tile + block_m].tolist()) == sorted(want_pairs[tile:tile + block_m].tolist())
        assert (pairs[int(used):] == ids.numel()).all()
