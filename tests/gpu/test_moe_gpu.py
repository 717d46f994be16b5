"""The grouped expert GEMM (engine.kernels.moe) compiled on CUDA, at Qwen3-30B-A3B's expert
shapes (H 2048, I 768, 128 experts, 8 per token) in bf16 and at a small shape in fp32, against
engine.moe.experts_torch in fp32 on the same (upcast) weights; and the step captured in a CUDA
graph replays to the same output on both paths (gemv and grouped, the latter also with the
many-program align; none reads a device value on the host); the routing kernel against engine.moe.route at DeepSeek and Qwen3 shapes, and a
DeepSeek-V3-style layer (router, experts, shared experts) in a graph against the fp32 torch path; the
three-launch decode layer (engine.kernels.moe_decode) at DeepSeek-V2-Lite's shape against both
paths and in a graph. Bounds: fp32 1e-5 relative (ieee dots), bf16 1e-2 (bf16 operands and the
intermediate's rounding)."""

import pytest
import torch
import torch.nn.functional as F

from tandem.engine.config import ModelConfig, MoEConfig
from tandem.engine.moe import SparseMoE, experts_torch, route

if torch.cuda.is_available():  # elsewhere conftest.py skips these, and triton stays unimported
    from tandem.engine.kernels.moe import fused_experts
    from tandem.engine.kernels.moe_route import route_fused


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


@pytest.mark.parametrize("tokens,path", [(1, None), (64, None), (256, None), (1, "grouped"), (8, "gemv")])
def test_qwen3_30b_shapes_bf16(tokens, path):
    x, w13, w2, weights, ids = _case(tokens, 2048, 768, 128, 8, torch.bfloat16, seed=tokens)
    ref = experts_torch(x.float(), w13.float(), w2.float(), weights, ids)
    assert _rel(fused_experts(x, w13, w2, weights, ids, path=path), ref) < 1e-2


@pytest.mark.parametrize("tokens", [64, 256, 2048])
def test_qwen3_30b_shapes_bf16_parallel_align(tokens, monkeypatch):
    """The grouped path with the many-program align (moe_route.align_parallel) above 64 pairs."""
    import tandem.engine.kernels.moe as moe_kernels

    monkeypatch.setattr(moe_kernels, "PARALLEL_ALIGN", True)
    x, w13, w2, weights, ids = _case(tokens, 2048, 768, 128, 8, torch.bfloat16, seed=tokens)
    ref = experts_torch(x.float(), w13.float(), w2.float(), weights, ids)
    assert _rel(fused_experts(x, w13, w2, weights, ids, path="grouped"), ref) < 1e-2


@pytest.mark.parametrize("tokens", [1, 8])
def test_qwen3_30b_shapes_bf16_split_down(tokens, monkeypatch):
    """The GEMV path with the down projection split over (pair, column block) (SPLIT_DOWN_GEMV)."""
    import tandem.engine.kernels.moe as moe_kernels

    monkeypatch.setattr(moe_kernels, "SPLIT_DOWN_GEMV", True)
    x, w13, w2, weights, ids = _case(tokens, 2048, 768, 128, 8, torch.bfloat16, seed=tokens)
    ref = experts_torch(x.float(), w13.float(), w2.float(), weights, ids)
    assert _rel(fused_experts(x, w13, w2, weights, ids, path="gemv"), ref) < 1e-2


def test_prefill_tile_bf16(monkeypatch):
    """PREFILL_TILE_128: 8192 tokens x 8 on Qwen3's 128 experts (512 pairs each) with the 128 x 128 tile."""
    import tandem.engine.kernels.moe as moe_kernels

    monkeypatch.setattr(moe_kernels, "PREFILL_TILE_128", True)
    x, w13, w2, weights, ids = _case(8192, 2048, 768, 128, 8, torch.bfloat16, seed=7)
    assert moe_kernels.default_config(ids.numel(), 128, x.dtype).block_m == 128
    ref = experts_torch(x.float(), w13.float(), w2.float(), weights, ids)
    assert _rel(fused_experts(x, w13, w2, weights, ids, path="grouped"), ref) < 1e-2


@pytest.mark.parametrize("tokens", [3, 100])
def test_fp32_small_shapes(tokens):
    x, w13, w2, weights, ids = _case(tokens, 96, 80, 16, 4, torch.float32, seed=tokens)
    ref = experts_torch(x.double(), w13.double(), w2.double(), weights.double(), ids).float()
    assert _rel(fused_experts(x, w13, w2, weights, ids), ref) < 1e-5


@pytest.mark.parametrize("path,tokens,split", [("gemv", 8, False), ("gemv", 8, True), ("grouped", 8, False),
                                               ("grouped", 40, False)],
                         ids=["gemv", "gemv-split-down", "grouped", "grouped-parallel-align"])
def test_captured_in_a_cuda_graph(path, tokens, split, monkeypatch):
    import tandem.engine.kernels.moe as moe_kernels

    monkeypatch.setattr(moe_kernels, "PARALLEL_ALIGN", True)  # used from 64 pairs on (40 tokens here)
    monkeypatch.setattr(moe_kernels, "SPLIT_DOWN_GEMV", split)
    x, w13, w2, weights, ids = _case(tokens, 256, 128, 32, 4, torch.bfloat16)
    want = fused_experts(x, w13, w2, weights, ids, path=path)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_experts(x, w13, w2, weights, ids, path=path)
    x2, _, _, weights2, ids2 = _case(tokens, 256, 128, 32, 4, torch.bfloat16, seed=1)
    x.copy_(x2), weights.copy_(weights2), ids.copy_(ids2)  # new tokens and routing, same buffers
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, fused_experts(x, w13, w2, weights, ids, path=path)) and not torch.equal(out, want)


ROUTINGS = {  # real shapes: Qwen3-30B-A3B, DeepSeek-V2 (160 experts), V2-Lite, V3
    "qwen3": MoEConfig(num_experts=128, top_k=8, intermediate_size=1, norm_topk_prob=True),
    "v2": MoEConfig(num_experts=160, top_k=6, intermediate_size=1, topk_method="group_limited_greedy", n_group=8,
                    topk_group=3, routed_scaling_factor=16.0),
    "v2-lite": MoEConfig(num_experts=64, top_k=6, intermediate_size=1),
    "v3": MoEConfig(num_experts=256, top_k=8, intermediate_size=1, scoring="sigmoid", topk_method="noaux_tc",
                    n_group=8, topk_group=4, norm_topk_prob=True, routed_scaling_factor=2.5),
}


@pytest.mark.parametrize("kind", list(ROUTINGS))
def test_route_fused_at_real_shapes(kind):
    """The routing kernel against engine.moe.route on 256 tokens: the same experts (a token whose
    k-th and k+1-th scores are within an ulp may differ by exp's rounding: at most one such) and
    the same weights."""
    moe = ROUTINGS[kind]
    gen = torch.Generator(device="cuda").manual_seed(3)
    logits = torch.randn(256, moe.num_experts, generator=gen, device="cuda")
    bias = torch.randn(moe.num_experts, generator=gen, device="cuda") * 0.1 if moe.uses_score_bias else None
    want_w, want_ids = route(logits, moe, bias)
    got_w, got_ids = route_fused(logits, moe, bias)
    want_ids, order = want_ids.sort(-1)
    got_ids, got_order = got_ids.long().sort(-1)
    same = (want_ids == got_ids).all(-1)
    assert same.sum() >= 255
    assert torch.allclose(got_w.gather(1, got_order)[same], want_w.gather(1, order)[same], rtol=1e-5, atol=1e-6)


@torch.inference_mode()
def test_deepseek_v3_layer_in_a_graph_matches_the_torch_path():
    """SparseMoE.forward_fused in bf16 (router GEMM with an fp32 output, routing kernel, experts,
    shared experts added in the last launch), captured and replayed on new tokens, against forward
    on an fp32 copy of the same weights."""
    moe = MoEConfig(num_experts=64, top_k=6, intermediate_size=128, num_shared_experts=2, scoring="sigmoid",
                    topk_method="noaux_tc", n_group=8, topk_group=4, norm_topk_prob=True, routed_scaling_factor=2.5)
    cfg = ModelConfig(vocab_size=32, hidden_size=512, intermediate_size=256, num_layers=1, num_heads=4,
                      num_kv_heads=4, head_dim=128, moe=moe)
    torch.manual_seed(0)
    with torch.device("cuda"):
        layer = SparseMoE(cfg)
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape) * p.shape[-1] ** -0.5)
        layer.to(torch.bfloat16)  # the score bias stays fp32
        ref_layer = SparseMoE(cfg)  # the same (rounded) values in fp32: the same choices up to ulps
        ref_layer.load_state_dict({k: v.float() for k, v in layer.state_dict().items()})
        from tandem.engine.model import TritonOps  # noqa: PLC0415 (triton loads only with CUDA)
        ops = TritonOps()
        for tokens in (1, 64):
            x = torch.randn(tokens, 512).bfloat16()
            layer.forward_fused(x, ops)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = layer.forward_fused(x, ops)
            x.copy_(torch.randn(tokens, 512))
            graph.replay()
            torch.cuda.synchronize()
            assert _rel(out, ref_layer(x.float())) < 2e-2


# DeepSeek-V2-Lite's MoE layer: hidden 2048, 64 routed experts of width 1408 (6 per token, softmax,
# greedy top-k, unscaled), 2 shared experts (one MLP of width 2816)
V2_LITE = MoEConfig(num_experts=64, top_k=6, intermediate_size=1408, num_shared_experts=2)


def _v2_lite_layer(fused_decode: bool, monkeypatch) -> SparseMoE:
    import tandem.engine.kernels.moe_decode as moe_decode  # noqa: PLC0415 (triton loads only with CUDA)

    monkeypatch.setattr(moe_decode, "FUSED_DECODE", fused_decode)
    cfg = ModelConfig(vocab_size=32, hidden_size=2048, intermediate_size=10944, num_layers=1, num_heads=16,
                      num_kv_heads=16, head_dim=128, moe=V2_LITE)
    gen = torch.Generator(device="cuda").manual_seed(0)
    with torch.device("cuda"):
        layer = SparseMoE(cfg).to(torch.bfloat16)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, device="cuda") * p.shape[-1] ** -0.5)
    return layer.requires_grad_(False)


@torch.inference_mode()
def test_decode_path_at_deepseek_v2_lite_shape_bf16(monkeypatch):
    """engine.kernels.moe_decode's three launches at 1 to MAX_TOKENS tokens: the logits are the
    fp32 GEMM's up to its summation order, the experts route_fused's on those logits (route's
    weights), the output within 1e-2 of the fp32 torch path on the same weights, and within one
    bf16 ulp of the seven-launch path on the same routing (the same roundings at the same points;
    the fp32 sums' order differs, so an intermediate that rounds the other way moves some outputs
    by one ulp: 0 to 8% of them at 1-4 tokens on the H200, 2026-12-04; near zero, where the terms
    cancel, by up to one ulp of the terms, hence the absolute 2^-8)."""
    from tandem.engine.kernels.moe_decode import MAX_TOKENS, moe_decode  # noqa: PLC0415 (CUDA only)
    from tandem.engine.model import TritonOps  # noqa: PLC0415 (as above)

    layer = _v2_lite_layer(True, monkeypatch)
    shared, ops = layer.shared_experts, TritonOps()
    gen = torch.Generator(device="cuda").manual_seed(1)
    for tokens in range(1, MAX_TOKENS + 1):
        x = torch.randn(tokens, 2048, generator=gen, device="cuda").bfloat16()
        got = moe_decode(x, layer.gate.weight, V2_LITE, None, layer.w13, layer.w2, shared.gate_up_proj.weight,
                         shared.down_proj.weight)
        assert _rel(got.logits, x.float() @ layer.gate.weight.float().T) < 1e-5
        weights, ids = route_fused(got.logits, V2_LITE)
        assert torch.equal(got.ids, ids) and torch.allclose(got.weights, weights, rtol=1e-6, atol=1e-7)
        want_w, want_ids = route(got.logits, V2_LITE)
        order = got.ids.long().argsort(-1)
        assert torch.equal(got.ids.long().gather(1, order), want_ids.sort(-1).values)
        ref = experts_torch(x.float(), layer.w13.float(), layer.w2.float(), want_w, want_ids)
        gate, up = F.linear(x.float(), shared.gate_up_proj.weight.float()).chunk(2, dim=-1)
        ref += F.linear(F.silu(gate) * up, shared.down_proj.weight.float())
        assert _rel(got.out, ref) < 1e-2, tokens
        seven = fused_experts(x, layer.w13, layer.w2, weights, ids, add=shared.forward_fused(x, ops), path="gemv")
        differ = got.out != seven
        assert differ.float().mean() < 0.2, (tokens, differ.sum())
        assert torch.allclose(got.out.float(), seven.float(), rtol=2 ** -7, atol=2 ** -8), tokens


@torch.inference_mode()
def test_decode_path_captured_in_a_cuda_graph(monkeypatch):
    """SparseMoE.forward_fused through the three launches at V2-Lite's shape in bf16, captured and
    replayed on new tokens: the eager call's output on them (no host read, no device-sized buffer)."""
    import tandem.engine.kernels.moe_decode as moe_decode  # noqa: PLC0415 (CUDA only)
    from tandem.engine.model import TritonOps  # noqa: PLC0415 (as above)

    layer = _v2_lite_layer(True, monkeypatch)
    calls = []
    real = moe_decode.moe_decode
    monkeypatch.setattr(moe_decode, "moe_decode", lambda x, *a, **kw: calls.append(x.shape[0]) or real(x, *a, **kw))
    ops = TritonOps()
    for tokens in (1, moe_decode.MAX_TOKENS):
        x = torch.randn(tokens, 2048, device="cuda").bfloat16()
        before = layer.forward_fused(x, ops)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = layer.forward_fused(x, ops)
        x.copy_(torch.randn(tokens, 2048, device="cuda"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, layer.forward_fused(x, ops)) and not torch.equal(out, before), tokens
    assert calls and set(calls) == {1, moe_decode.MAX_TOKENS}


@torch.inference_mode()
def test_decode_path_with_pdl_launches_gives_the_plain_bits(monkeypatch):
    """The three launches as PDL launches (launch 1 loading its first weight tile before it waits),
    four MoE layers back to back, eager and replayed from a CUDA graph: the plain launches' bits."""
    from tandem.engine.kernels import pdl  # noqa: PLC0415 (CUDA only)
    from tandem.engine.model import TritonOps  # noqa: PLC0415 (as above)

    layer, ops = _v2_lite_layer(True, monkeypatch), TritonOps()
    for tokens in (1, 3):
        x = torch.randn(tokens, 2048, device="cuda").bfloat16()
        chain = lambda x: layer.forward_fused(layer.forward_fused(layer.forward_fused(  # noqa: E731
            layer.forward_fused(x, ops), ops), ops), ops)
        plain = chain(x)
        with pdl.auto(True):
            assert pdl.on() and pdl.supported(x.device)
            assert torch.equal(chain(x), plain), tokens
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = chain(x)
        for _ in range(2):
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, plain), tokens


@torch.inference_mode()
def test_norm_folded_into_launch_one_at_deepseek_v2_lite_shape(monkeypatch):
    """SparseMoE.norm_forward_fused with the post-attention norm inside launch 1 (NORM_FOLD), PDL on
    and off, eager and from a CUDA graph, against rms_norm's launch then the three: the same new
    residual stream, and the output within one bf16 ulp (the norm's sum of squares may be reduced
    in another order than rms_norm's, which would move a few outputs by an ulp)."""
    import tandem.engine.kernels.moe_decode as moe_decode  # noqa: PLC0415 (CUDA only)
    from tandem.engine.kernels import pdl  # noqa: PLC0415 (as above)
    from tandem.engine.model import RMSNorm, TritonOps  # noqa: PLC0415 (as above)

    layer, ops = _v2_lite_layer(True, monkeypatch), TritonOps()
    norm = RMSNorm(2048, 1e-6).cuda().bfloat16()
    norm.weight.normal_(1.0, 0.1)
    for tokens in (1, 4):
        x, residual = torch.randn(2, tokens, 2048, device="cuda").bfloat16()
        h, want_stream = ops.rms_norm(x, norm.weight, norm.eps, residual)
        want = layer.forward_fused(h, ops)
        for use_pdl in (False, True):
            with pdl.auto(use_pdl):
                out, stream = layer.norm_forward_fused(x, residual, norm, ops)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    g_out, g_stream = layer.norm_forward_fused(x, residual, norm, ops)
            graph.replay()
            torch.cuda.synchronize()
            for o, s in ((out, stream), (g_out, g_stream)):
                assert torch.equal(s, want_stream), (tokens, use_pdl)
                assert torch.allclose(o.float(), want.float(), rtol=2 ** -7, atol=2 ** -8), (tokens, use_pdl)
                assert (o != want).float().mean() < 0.01, (tokens, use_pdl, (o != want).sum())
    monkeypatch.setattr(moe_decode, "NORM_FOLD", False)
    calls = []
    real = ops.rms_norm
    ops.rms_norm = lambda *a: calls.append(1) or real(*a)
    layer.norm_forward_fused(x, residual, norm, ops)
    assert calls == [1]
