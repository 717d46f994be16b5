"""engine.kernels.moe_decode (a decode step's MoE layer in three launches) under Triton's
interpreter on CPU, against the torch reference (engine.moe.route on the kernel's own fp32 logits,
experts_torch, the shared experts' MLP) for Qwen3's routing (softmax, renormalised, no shared
experts), DeepSeek-V2's (greedy and group-limited, scaled, shared experts) and V3's (sigmoid, score
bias, noaux_tc), 1 to MAX_TOKENS tokens, fp32 and bf16; the experts it chooses are route's; ties go
to the lower expert as route_fused sends them; NaN rows keep ids in range; SparseMoE takes it within
the limit; and a tiny DeepSeek MoE model decodes through it with the plain path's greedy tokens.

Tolerances: fp32 against an fp64 reference, 1e-5 relative (the test_moe_kernels bound). bf16
against the fp64 reference on the same bf16 weights, 3e-2: the interpreter converts fp32 to bf16
by truncation, not to nearest, which biases each of the four roundings (tests/gpu/test_moe_gpu.py
holds the compiled kernels to 1e-2); against the seven-launch Triton path with the same routing,
whose roundings are the same, at most a few elements one bf16 ulp apart."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from tandem.engine.config import MoEConfig
from tandem.engine.kernels import moe_decode as md
from tandem.engine.kernels.gemv import gemv, silu_gemv
from tandem.engine.kernels.moe import fused_experts
from tandem.engine.kernels.moe_route import route_fused
from tandem.engine.moe import experts_torch, route
from tests.engine.mla_models import build_deepseek_dir
from tests.engine.test_gpu_path_cpu import PROMPTS, _engine

H, I, E = 48, 24, 16  # noqa: E741 (the experts' width): neither a power of two nor a tile's multiple
ROUTINGS = {
    "qwen3": MoEConfig(num_experts=E, top_k=4, intermediate_size=I, norm_topk_prob=True),
    "v2-greedy": MoEConfig(num_experts=E, top_k=4, intermediate_size=I, num_shared_experts=2,
                           routed_scaling_factor=2.5),
    "v2-group-limited": MoEConfig(num_experts=E, top_k=3, intermediate_size=I, num_shared_experts=2,
                                  topk_method="group_limited_greedy", n_group=4, topk_group=2,
                                  routed_scaling_factor=2.5),
    "v3-noaux-tc": MoEConfig(num_experts=E, top_k=4, intermediate_size=I, num_shared_experts=1, scoring="sigmoid",
                             topk_method="noaux_tc", n_group=4, topk_group=2, norm_topk_prob=True,
                             routed_scaling_factor=2.5),
}


def _layer(moe: MoEConfig, tokens: int, dtype: torch.dtype, seed: int):
    """-> (x, router weight, score bias, w13, w2, shared gate/up, shared down), weights in dtype."""
    gen = torch.Generator().manual_seed(seed)

    def draw(*shape, fan_in):
        return (torch.randn(*shape, generator=gen) * fan_in ** -0.5).to(dtype)

    inter_s = moe.num_shared_experts * moe.intermediate_size
    bias = torch.randn(E, generator=gen) * 0.1 if moe.uses_score_bias else None
    shared = (draw(2 * inter_s, H, fan_in=H), draw(H, inter_s, fan_in=inter_s)) if inter_s else (None, None)
    return (draw(tokens, H, fan_in=1), draw(E, H, fan_in=H), bias, draw(E, 2 * I, H, fan_in=H),
            draw(E, H, I, fan_in=I), *shared)


def _reference(x, moe, bias, w13, w2, shared_gate_up, shared_down, logits):
    """The torch path in fp64 on the kernel's logits: route, experts_torch, the shared MLP."""
    weights, ids = route(logits, moe, bias)
    out = experts_torch(x.double(), w13.double(), w2.double(), weights.double(), ids)
    if shared_gate_up is not None:
        gate, up = F.linear(x.double(), shared_gate_up.double()).chunk(2, dim=-1)
        out = out + F.linear(F.silu(gate) * up, shared_down.double())
    return out, weights, ids


def _rel(out, ref):
    return ((out.double() - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kind", list(ROUTINGS))
def test_three_launches_match_the_torch_path(kind, dtype):
    moe = ROUTINGS[kind]
    for tokens in range(1, md.MAX_TOKENS + 1) if dtype == torch.float32 else (1, md.MAX_TOKENS):
        x, wr, bias, w13, w2, sg, sd = _layer(moe, tokens, dtype, seed=tokens + len(kind))
        got = md.moe_decode(x, wr, moe, bias, w13, w2, sg, sd)
        # the logits: model-dtype operands, exact products summed in fp32 (Router.logits' semantics)
        assert got.logits.dtype == torch.float32 and _rel(got.logits, F.linear(x.double(), wr.double())) < 1e-6
        ref, weights, ids = _reference(x, moe, bias, w13, w2, sg, sd, got.logits)
        assert torch.equal(got.ids.long(), ids), (tokens, got.ids, ids)
        assert torch.allclose(got.weights, weights, rtol=1e-6, atol=1e-7)
        assert got.out.dtype == dtype and got.out.shape == (tokens, H)
        assert _rel(got.out, ref) < (1e-5 if dtype == torch.float32 else 3e-2), tokens


@pytest.mark.parametrize("kind", ["qwen3", "v2-group-limited"])
def test_bf16_rounds_where_the_seven_launch_path_rounds(kind):
    """Against engine.kernels.moe's GEMV path on the same routing, the shared MLP through
    engine.kernels.gemv (so both sides convert to bf16 alike under the interpreter): the same
    roundings at the same points, only the fp32 sums' order differs."""
    moe = ROUTINGS[kind]
    x, wr, bias, w13, w2, sg, sd = _layer(moe, md.MAX_TOKENS, torch.bfloat16, seed=7)
    got = md.moe_decode(x, wr, moe, bias, w13, w2, sg, sd)
    weights, ids = route_fused(got.logits, moe, bias)
    shared = None if sg is None else torch.cat([silu_gemv(gemv(row[None], sg), sd) for row in x])
    want = fused_experts(x, w13, w2, weights, ids, add=shared, path="gemv")
    ulp = want.float().abs().clamp(min=2 ** -20) * 2 ** -7
    differ = got.out != want
    assert differ.sum() <= 3 and ((got.out.float() - want.float()).abs() <= ulp).all(), differ.sum()


@pytest.mark.parametrize("kind", ["qwen3", "v3-noaux-tc"])
def test_ties_go_to_the_lower_expert_and_nan_rows_stay_in_range(kind):
    """Experts 0, 5 and 10 hold the same router row (their logits tie exactly): the kernel chooses
    what route_fused chooses on its logits. A row of NaN (a static batch's padding) still gives ids
    in [0, E) and leaves the other rows alone."""
    moe = ROUTINGS[kind]
    x, wr, bias, w13, w2, sg, sd = _layer(moe, 3, torch.float32, seed=3)
    wr[5] = wr[10] = wr[0] = wr[0] * 3  # a tie near the top
    if bias is not None:
        bias[5] = bias[10] = bias[0]
    got = md.moe_decode(x, wr, moe, bias, w13, w2, sg, sd)
    assert torch.equal(got.ids, route_fused(got.logits, moe, bias)[1])
    x[1] = float("nan")
    nan = md.moe_decode(x, wr, moe, bias, w13, w2, sg, sd)
    assert ((nan.ids >= 0) & (nan.ids < E)).all(), nan.ids
    assert torch.equal(nan.ids[[0, 2]], got.ids[[0, 2]]) and torch.equal(nan.out[[0, 2]], got.out[[0, 2]])


def test_sparse_moe_takes_it_within_the_limit(monkeypatch):
    """SparseMoE.forward_fused: 1..MAX_TOKENS tokens under FUSED_DECODE through moe_decode (with
    the forward's output), more tokens or the flag off through the seven launches."""
    from tandem.engine.config import ModelConfig
    from tandem.engine.model import TritonOps
    from tandem.engine.moe import SparseMoE

    cfg = ModelConfig(vocab_size=32, hidden_size=H, intermediate_size=64, num_layers=1, num_heads=4,
                      num_kv_heads=2, head_dim=12, moe=ROUTINGS["v3-noaux-tc"])
    layer = SparseMoE(cfg)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5)
    calls = []
    real = md.moe_decode
    monkeypatch.setattr(md, "moe_decode", lambda x, *a, **kw: calls.append(x.shape[0]) or real(x, *a, **kw))
    x = torch.randn(md.MAX_TOKENS + 1, H, generator=gen)
    with torch.inference_mode():
        for flag, tokens in ((True, 1), (True, md.MAX_TOKENS), (True, md.MAX_TOKENS + 1), (False, 1)):
            monkeypatch.setattr(md, "FUSED_DECODE", flag)
            assert torch.allclose(layer.forward_fused(x[:tokens], TritonOps()), layer(x[:tokens]), rtol=1e-5, atol=1e-6)
    assert calls == [1, md.MAX_TOKENS]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("tokens,kind", [(1, "v2-greedy"), (3, "v2-greedy"), (2, "qwen3")])
def test_norm_folded_into_launch_one_gives_rms_norm_then_the_layer(tokens, kind, dtype):
    """moe_decode's `norm`: the layer on rms_norm(x, weight, eps, residual) with the norm worked out
    inside launch 1 gives that launch pair's bits: the new residual stream and the normalised input
    as rms_norm writes them, and the same routing and output; with shared experts and without
    (Qwen3's: launch 1 is the router alone)."""
    from tandem.engine.kernels.fused import rms_norm

    moe = ROUTINGS[kind]
    x, wr, bias, w13, w2, sg, sd = _layer(moe, tokens, dtype, seed=5)
    gen = torch.Generator().manual_seed(6)
    residual = torch.randn(tokens, H, generator=gen).to(dtype)
    weight = (1 + 0.1 * torch.randn(H, generator=gen)).to(dtype)
    h, want_residual = rms_norm(x, weight, 1e-6, residual)
    want = md.moe_decode(h, wr, moe, bias, w13, w2, sg, sd)
    got = md.moe_decode(x, wr, moe, bias, w13, w2, sg, sd, norm=(residual, weight, 1e-6))
    assert torch.equal(got.residual, want_residual) and torch.equal(got.normed, h)
    assert torch.equal(got.logits, want.logits) and torch.equal(got.ids, want.ids)
    assert torch.equal(got.out, want.out)
    assert want.residual is None and want.normed is None


def test_sparse_moe_folds_the_norm_where_it_takes_the_three_launches(monkeypatch):
    """SparseMoE.norm_forward_fused: within the limit moe_decode runs with the norm (no rms_norm
    launch), past it or with NORM_FOLD off rms_norm runs first; the same outputs and stream."""
    from tandem.engine.config import ModelConfig
    from tandem.engine.model import RMSNorm, TritonOps
    from tandem.engine.moe import SparseMoE

    cfg = ModelConfig(vocab_size=32, hidden_size=H, intermediate_size=64, num_layers=1, num_heads=4,
                      num_kv_heads=2, head_dim=12, moe=ROUTINGS["v2-greedy"])
    layer, norm = SparseMoE(cfg), RMSNorm(H, 1e-6)
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for p in [*layer.parameters(), norm.weight]:
            p.copy_(torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5)
    ops, calls = TritonOps(), []
    real_norm, real_decode = ops.rms_norm, md.moe_decode
    ops.rms_norm = lambda *a: calls.append("rms_norm") or real_norm(*a)
    monkeypatch.setattr(md, "moe_decode", lambda x, *a, **kw: calls.append(("decode", kw.get("norm") is not None)) or
                        real_decode(x, *a, **kw))
    x, residual = torch.randn(md.MAX_TOKENS + 1, H, generator=gen), torch.randn(md.MAX_TOKENS + 1, H, generator=gen)
    with torch.inference_mode():
        for fold, tokens, want_calls in ((True, 1, [("decode", True)]), (True, md.MAX_TOKENS + 1, ["rms_norm"]),
                                         (False, 1, ["rms_norm", ("decode", False)])):
            monkeypatch.setattr(md, "NORM_FOLD", fold)
            calls.clear()
            out, stream = layer.norm_forward_fused(x[:tokens], residual[:tokens], norm, ops)
            assert calls == want_calls, (fold, tokens, calls)
            ref_stream = x[:tokens] + residual[:tokens]
            assert torch.allclose(stream, ref_stream)
            assert torch.allclose(out, layer(norm(ref_stream)), rtol=1e-5, atol=1e-6), (fold, tokens)


def test_bad_input_is_refused_by_name():
    moe = ROUTINGS["v3-noaux-tc"]
    x, wr, bias, w13, w2, sg, sd = _layer(moe, 2, torch.float32, seed=0)
    with pytest.raises(ValueError, match="x must have dtype"):
        md.moe_decode(x.double(), wr, moe, bias, w13, w2, sg, sd)
    with pytest.raises(ValueError, match="MAX_TOKENS"):
        md.moe_decode(torch.zeros(md.MAX_TOKENS + 1, H), wr, moe, bias, w13, w2, sg, sd)
    with pytest.raises(ValueError, match="router_weight"):
        md.moe_decode(x, wr[:, :8], moe, bias, w13, w2, sg, sd)
    with pytest.raises(ValueError, match="w2"):
        md.moe_decode(x, wr, moe, bias, w13, w2[:, :, :8].contiguous(), sg, sd)
    with pytest.raises(ValueError, match="w13 has dtype"):
        md.moe_decode(x, wr, moe, bias, w13.half(), w2, sg, sd)
    with pytest.raises(ValueError, match="score_bias"):
        md.moe_decode(x, wr, moe, None, w13, w2, sg, sd)
    with pytest.raises(ValueError, match="num_experts"):
        md.moe_decode(x, wr, dataclasses.replace(ROUTINGS["qwen3"], num_experts=8), None, w13, w2, sg, sd)
    with pytest.raises(ValueError, match="shared_down"):
        md.moe_decode(x, wr, moe, bias, w13, w2, sg, None)
    with pytest.raises(ValueError, match="shared_gate_up"):
        md.moe_decode(x, wr, moe, bias, w13, w2, sg[:, :8], sd)
    with pytest.raises(ValueError, match="residual has shape"):
        md.moe_decode(x, wr, moe, bias, w13, w2, sg, sd, norm=(x[:1], torch.ones(H), 1e-6))
    with pytest.raises(ValueError, match="norm weight"):
        md.moe_decode(x, wr, moe, bias, w13, w2, sg, sd, norm=(x, torch.ones(H + 1), 1e-6))
    with pytest.raises(ValueError, match="gate_up_rows must be even"):
        md.moe_decode(x, wr, moe, bias, w13, w2, sg, sd, tiles=md.DecodeTiles(gate_up_rows=3))


@pytest.fixture(scope="module", params=["v2", "v3"])
def deepseek_moe(request, tmp_path_factory):
    from tandem.engine.weights import load_model

    path = tmp_path_factory.mktemp(f"tiny-deepseek-{request.param}-moe-decode")
    build_deepseek_dir(request.param, path, moe=True)
    model, tok, _ = load_model(str(path))
    return model, tok


def test_decode_steps_take_the_three_launches_and_keep_the_tokens(deepseek_moe, monkeypatch):
    """A tiny DeepSeek-V2 (group-limited greedy, softmax) or V3 (noaux_tc, sigmoid, score bias) MoE
    model with shared experts: a lone sequence's one-token steps and two sequences' two-token steps
    run each MoE layer through moe_decode in the static-buffer (CUDA graph) path, with the plain
    path's greedy tokens."""
    pytest.importorskip("triton")
    model, tok = deepseek_moe
    reqs = [{"prompt_token_ids": p, "max_tokens": 4, "ignore_eos": True} for p in PROMPTS[:2]]
    ref = [r["token_ids"] for r in _engine(model, tok).generate(reqs, arrivals=[0, 2])]
    tokens = []
    real = md.moe_decode
    monkeypatch.setattr(md, "moe_decode", lambda x, *a, **kw: tokens.append(x.shape[0]) or real(x, *a, **kw))
    monkeypatch.setattr(md, "FUSED_DECODE", True)
    e = _engine(model, tok, graphs=True)
    assert [r["token_ids"] for r in e.generate(reqs, arrivals=[0, 2])] == ref
    assert e.runner.graph_stats["replays"] > 0, "no step went through the static buffers"
    assert {1, 2} <= set(tokens), tokens
