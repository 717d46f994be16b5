"""engine.kernels.moe's grouped GEMM against engine.moe.experts_torch, on small shapes under
Triton's interpreter on CPU (tests/engine/conftest.py sets TRITON_INTERPRET=1 before triton loads;
tests/gpu/test_moe_gpu.py runs the same comparison compiled, in bf16 too).

Shapes are chosen to break what the kernels index: an intermediate size and a hidden size that
are no multiple of the tiles (masks), experts no token chose and experts chosen by many (padding
and skipped blocks), one token (decode) and more tokens than one tile. fp32 with full-precision
dots: the error against the reference is ~1e-7 relative, so 1e-5 still catches any O(1) slip.
Both paths (grouped, gemv) at T = 1, 7 and 40; test_moe_route.py checks the align and router kernels."""

from __future__ import annotations

import pytest
import torch

from tandem.engine.kernels.moe import MoEKernelConfig, align_by_expert, fused_experts
from tandem.engine.moe import experts_torch


def _case(tokens: int, experts: int, top_k: int, hidden: int, inter: int, seed: int, skew: bool = False):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=gen) * hidden ** -0.5
    w2 = torch.randn(experts, hidden, inter, generator=gen) * inter ** -0.5
    logits = torch.randn(tokens, experts, generator=gen)
    if skew:  # most tokens pick experts 0 and 1: runs longer than one tile, most experts unused
        logits[:, :2] += 4.0
    weights, ids = logits.softmax(-1).topk(top_k, dim=-1)
    return x, w13, w2, weights.contiguous(), ids


def _rel(out, ref):
    return ((out - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("tokens,skew,path", [(1, False, "grouped"), (7, False, "grouped"), (40, True, "grouped"),
                                             (1, False, "gemv"), (7, True, "gemv")])  # skew: runs of many tokens
def test_both_paths_match_the_torch_path(tokens, skew, path):
    x, w13, w2, weights, ids = _case(tokens, experts=8, top_k=2, hidden=48, inter=40, seed=tokens, skew=skew)
    ref = experts_torch(x.double(), w13.double(), w2.double(), weights.double(), ids).float()
    out = fused_experts(x, w13, w2, weights, ids, MoEKernelConfig(block_m=16, block_n=32, block_k=32), path=path)
    assert out.shape == ref.shape and out.dtype == x.dtype
    assert _rel(out, ref) < 1e-5


@pytest.mark.parametrize("parallel", [True, False], ids=["parallel-align", "torch-align"])
def test_grouped_path_above_the_one_program_align(parallel, monkeypatch):
    """Above FUSED_ALIGN_MAX_PAIRS pairs (80, skewed: runs of many tiles), with PARALLEL_ALIGN (the
    default) and with the torch align."""
    import tandem.engine.kernels.moe as moe_kernels

    monkeypatch.setattr(moe_kernels, "PARALLEL_ALIGN", parallel)
    x, w13, w2, weights, ids = _case(40, experts=8, top_k=2, hidden=48, inter=40, seed=11, skew=True)
    assert ids.numel() > moe_kernels.FUSED_ALIGN_MAX_PAIRS
    ref = experts_torch(x.double(), w13.double(), w2.double(), weights.double(), ids).float()
    out = fused_experts(x, w13, w2, weights, ids, MoEKernelConfig(block_m=16, block_n=32, block_k=32), path="grouped")
    assert _rel(out, ref) < 1e-5


@pytest.mark.parametrize("split", [True, False], ids=["split-down", "looping-down"])
@pytest.mark.parametrize("tokens,with_add", [(1, True), (7, False)])
def test_gemv_path_both_down_forms(tokens, with_add, split, monkeypatch):
    """SPLIT_DOWN_GEMV (the default): the down projection a program per (pair, column block), the k
    slots (and the shared output) summed by the sum kernel; off: a program per (token, column block)
    looping over the token's experts."""
    import tandem.engine.kernels.moe as moe_kernels

    monkeypatch.setattr(moe_kernels, "SPLIT_DOWN_GEMV", split)
    x, w13, w2, weights, ids = _case(tokens, experts=8, top_k=3, hidden=48, inter=40, seed=20 + tokens)
    add = torch.randn(tokens, 48, generator=torch.Generator().manual_seed(3)) if with_add else None
    ref = experts_torch(x.double(), w13.double(), w2.double(), weights.double(), ids).float()
    out = fused_experts(x, w13, w2, weights, ids, add=add, path="gemv")
    assert _rel(out, ref + (add if with_add else 0)) < 1e-5


def test_grouped_path_with_the_prefill_tile():
    """The 128 x 128 tile of PREFILL_TILE_128 (8 warps) on a skewed run longer than one tile."""
    x, w13, w2, weights, ids = _case(150, experts=4, top_k=2, hidden=48, inter=40, seed=12, skew=True)
    ref = experts_torch(x.double(), w13.double(), w2.double(), weights.double(), ids).float()
    out = fused_experts(x, w13, w2, weights, ids, MoEKernelConfig(128, 128, 64, 8, 3), path="grouped")
    assert _rel(out, ref) < 1e-5


@pytest.mark.parametrize("path", ["grouped", "gemv"])
def test_the_added_output_enters_before_the_rounding(path):
    """`add` (the shared experts' output) is summed in fp32 with the routed experts' and rounded
    once; in fp16 (the interpreter's bf16 tl.dot is broken; tests/gpu covers bf16), fp32 reference
    on the same fp16 values."""
    x, w13, w2, weights, ids = _case(5, experts=4, top_k=2, hidden=32, inter=16, seed=4)
    add = torch.randn(5, 32, generator=torch.Generator().manual_seed(9)).half()
    x, w13, w2 = x.half(), w13.half(), w2.half()
    ref = experts_torch(x.float(), w13.float(), w2.float(), weights, ids) + add.float()
    out = fused_experts(x, w13, w2, weights, ids, add=add, path=path)
    assert out.dtype == torch.float16 and _rel(out.float(), ref) < 2e-3


@pytest.mark.parametrize("tokens", [3, 20])  # the default picks gemv, then grouped
def test_default_path_top_k_one_and_int32_ids(tokens):
    x, w13, w2, weights, ids = _case(tokens, experts=4, top_k=1, hidden=32, inter=16, seed=3)
    ref = experts_torch(x.double(), w13.double(), w2.double(), weights.double(), ids).float()
    assert _rel(fused_experts(x, w13, w2, weights, ids.int()), ref) < 1e-5


def test_align_by_expert_groups_and_pads_each_expert():
    ids = torch.tensor([[3, 0], [3, 1], [0, 3], [3, 2]])  # expert 3: 4 pairs, 0: 2, 1 and 2: 1
    pairs, block_expert, num_padded = align_by_expert(ids, num_experts=5, block_m=2)
    n = ids.numel()
    used = int(num_padded)
    assert used == 2 + 2 + 2 + 4  # each expert's run rounded up to 2 rows; expert 4 has none
    assert (pairs[used:] == n).all() and pairs.numel() % 2 == 0
    for block, expert in enumerate(block_expert[:used // 2].tolist()):
        rows = pairs[2 * block:2 * block + 2]
        real = rows[rows < n].long()
        assert (ids.reshape(-1)[real] == expert).all()
    assert sorted(pairs[pairs < n].tolist()) == list(range(n))  # every pair once


def test_bad_input_is_refused_by_name():
    x, w13, w2, weights, ids = _case(3, experts=4, top_k=2, hidden=32, inter=16, seed=0)
    with pytest.raises(ValueError, match="w2"):
        fused_experts(x, w13, w2[:, :, :8].contiguous(), weights, ids)
    with pytest.raises(ValueError, match="weights"):
        fused_experts(x, w13, w2, weights.half(), ids)
    with pytest.raises(ValueError, match="ids"):
        fused_experts(x, w13, w2, weights, ids[:2])
    with pytest.raises(ValueError, match="add"):
        fused_experts(x, w13, w2, weights, ids, add=x[:2])
    with pytest.raises(ValueError, match="path must be"):
        fused_experts(x, w13, w2, weights, ids, path="dense")
