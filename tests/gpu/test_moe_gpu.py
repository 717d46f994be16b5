"""The grouped expert GEMM (engine.kernels.moe) compiled on CUDA, at Qwen3-30B-A3B's expert
shapes (H 2048, I 768, 128 experts, 8 per token) in bf16 and at a small shape in fp32, against
engine.moe.experts_torch in fp32 on the same (upcast) weights; and the step captured in a CUDA
graph replays to the same output (the align step reads no device value on the host). Bounds:
fp32 1e-5 relative (ieee dots), bf16 1e-2 (bf16 operands and the intermediate's rounding)."""

import pytest
import torch

from tandem.engine.moe import experts_torch

if torch.cuda.is_available():  # elsewhere conftest.py skips these, and triton stays unimported
    from tandem.engine.kernels.moe import fused_experts


@pytest.fixture(autouse=True)
def _no_tf32():
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = old


def _case(tokens, hidden, inter, experts, top_k, dtype, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen, device="cuda").to(dtype)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=gen, device="cuda") * hidden ** -0.5).to(dtype)
    w2 = (torch.randn(experts, hidden, inter, generator=gen, device="cuda") * inter ** -0.5).to(dtype)
    weights, ids = torch.randn(tokens, experts, generator=gen, device="cuda").softmax(-1).topk(top_k, dim=-1)
    return x, w13, w2, weights.contiguous(), ids


def _rel(out, ref):
    return ((out.float() - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("tokens", [1, 64, 256])
def test_qwen3_30b_shapes_bf16(tokens):
    x, w13, w2, weights, ids = _case(tokens, 2048, 768, 128, 8, torch.bfloat16, seed=tokens)
    ref = experts_torch(x.float(), w13.float(), w2.float(), weights, ids)
    assert _rel(fused_experts(x, w13, w2, weights, ids), ref) < 1e-2


@pytest.mark.parametrize("tokens", [3, 100])
def test_fp32_small_shapes(tokens):
    x, w13, w2, weights, ids = _case(tokens, 96, 80, 16, 4, torch.float32, seed=tokens)
    ref = experts_torch(x.double(), w13.double(), w2.double(), weights.double(), ids).float()
    assert _rel(fused_experts(x, w13, w2, weights, ids), ref) < 1e-5


def test_captured_in_a_cuda_graph():
    x, w13, w2, weights, ids = _case(8, 256, 128, 32, 4, torch.bfloat16)
    want = fused_experts(x, w13, w2, weights, ids)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_experts(x, w13, w2, weights, ids)
    x2, _, _, weights2, ids2 = _case(8, 256, 128, 32, 4, torch.bfloat16, seed=1)
    x.copy_(x2), weights.copy_(weights2), ids.copy_(ids2)  # new tokens and routing, same buffers
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, fused_experts(x, w13, w2, weights, ids)) and not torch.equal(out, want)
