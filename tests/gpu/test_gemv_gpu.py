"""The one-token GEMV with its norm / SiLU folded in (engine/kernels/gemv.py) on the GPU: at
llama3-8b's projection shapes against the two launches it replaces (bf16 and FP8 weights), fp32
against float64; a norm folded between two GEMVs against the three launches it replaces; and in
the engine: one sequence decoding through CUDA graphs with every projection fused (and every
norm folded, every SiLU in its gate/up GEMV) gives the CPU path's greedy tokens (fp32)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from tandem.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from tandem.engine.engine import LLMEngine
from tandem.engine.quant.fp8 import dequantize_fp8, quantize_fp8
from tandem.engine.weights import load_model

SHAPES = [(6144, 4096, "norm"), (4096, 4096, "none"), (28672, 4096, "norm"), (4096, 14336, "silu")]


def rel_err(out, ref):
    assert torch.isfinite(out).all()
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


@pytest.mark.parametrize("n,k,before", SHAPES)
@pytest.mark.parametrize("weight", ["bf16", "fp8", "fp32"])
def test_fused_gemv_matches_the_separate_launches(n, k, before, weight):
    from tandem.engine.kernels import gemv
    from tandem.engine.kernels.fused import rms_norm, silu_and_mul

    torch.manual_seed(n + k)
    dt = torch.float32 if weight == "fp32" else torch.bfloat16
    w = torch.randn(n, k, device="cuda") * k ** -0.5
    if weight == "fp8":
        q, scale = quantize_fp8(w)
        w_ref = dequantize_fp8(q, scale, 0, torch.float64)
    else:
        q, scale = w.to(dt), None
        w_ref = q.double()
    x = torch.randn(1, 2 * k if before == "silu" else k, device="cuda").to(dt)
    res = torch.randn(1, k, device="cuda").to(dt)
    g = (torch.rand(k, device="cuda") + 0.5).to(dt)
    if before == "norm":
        h, new_res = rms_norm(x, g, 1e-5, res)
        out, got_res = gemv.norm_gemv(x, res, g, 1e-5, q, scale)
        assert torch.equal(got_res, new_res)
    elif before == "silu":
        h = silu_and_mul(x)
        out = gemv.silu_gemv(x, q, scale)
    else:
        h = x
        out = gemv.gemv(x, q, scale)
    ref = h.double() @ w_ref.T
    assert rel_err(out, ref) < (1e-5 if weight == "fp32" else 1e-2)
    if weight == "bf16":  # and next to what cuBLAS gives on the same rounded input
        assert rel_err(out, F.linear(h, q)) < 1e-2


@pytest.mark.parametrize("n,k,silu,n2", [(4096, 4096, False, 6144), (4096, 14336, True, 28672)])
@pytest.mark.parametrize("weight", ["bf16", "fp8"])
def test_norm_folded_between_gemvs_matches_the_separate_launches(n, k, silu, n2, weight):
    """o (or down with its SiLU) begins the next RMSNorm, q/k/v (or gate/up) finishes it
    (gemv.residual_gemv, gemv.scaled_gemv) at llama3-8b's shapes, PDL launches as an FP8 model's
    forward makes them: the residual stream bit for bit, the second output against float64."""
    from tandem.engine.kernels import gemv, pdl
    from tandem.engine.kernels.fused import rms_norm, silu_and_mul

    torch.manual_seed(n2 + k)
    weights = []
    for rows, cols in ((n, k), (n2, n)):
        w = torch.randn(rows, cols, device="cuda") * cols ** -0.5
        if weight == "fp8":
            q, scale = quantize_fp8(w)
            weights.append((q, scale, dequantize_fp8(q, scale, 0, torch.float64)))
        else:
            weights.append((w.bfloat16(), None, w.bfloat16().double()))
    (q1, s1, w1), (q2, s2, w2) = weights
    x = torch.randn(1, 2 * k if silu else k, device="cuda").bfloat16()
    residual = (torch.randn(1, n, device="cuda") * 3).bfloat16()
    g = (torch.rand(n, device="cuda") + 0.5).bfloat16()
    with pdl.auto(weight == "fp8"):
        out1 = gemv.silu_gemv(x, q1, s1) if silu else gemv.gemv(x, q1, s1)
        h, ref_residual = rms_norm(out1, g, 1e-5, residual)
        row, new_residual = gemv.residual_gemv(x, q1, s1, residual=residual, norm_weight=g, eps=1e-5, silu=silu)
        out = gemv.scaled_gemv(row, q2, s2)
    assert torch.equal(new_residual, ref_residual)
    assert rel_err(out, h.double() @ w2.T) < 1e-2
    h_ref = (silu_and_mul(x) if silu else x).double() @ w1.T + residual.double()
    assert rel_err(new_residual, h_ref) < 1e-2


@pytest.mark.parametrize("weight", ["bf16", "fp8"])
def test_silu_epilogue_is_the_gate_up_gemv_then_silu_and_mul(weight):
    """llama3-8b's gate/up [28672, 4096] finishing a folded norm with SiLU-and-mul as its epilogue
    (gemv.scaled_gemv(..., silu_out=True), PDL launches as an FP8 forward makes them, the tuned
    tile): silu_and_mul of the plain GEMV's output, bit for bit."""
    from tandem.engine.kernels import gemv, pdl
    from tandem.engine.kernels.fused import silu_and_mul

    torch.manual_seed(5)
    w = torch.randn(28672, 4096, device="cuda") * 4096 ** -0.5
    q, scale = quantize_fp8(w) if weight == "fp8" else (w.bfloat16(), None)
    o = torch.randn(4096, 4096, device="cuda").bfloat16() * 4096 ** -0.5
    x, residual = torch.randn(2, 1, 4096, device="cuda").bfloat16()
    g = (torch.rand(4096, device="cuda") + 0.5).bfloat16()
    with pdl.auto(weight == "fp8"):
        row, _ = gemv.residual_gemv(x, o, residual=residual, norm_weight=g, eps=1e-5)
        act = gemv.scaled_gemv(row, q, scale, silu_out=True)
        ref = silu_and_mul(gemv.scaled_gemv(row, q, scale))
    assert act.shape == (1, 14336) and torch.equal(act, ref)


@pytest.mark.parametrize("fold", [False, True])
def test_one_sequence_through_graphs_with_every_projection_fused_matches_cpu(monkeypatch, fold):
    from tandem.engine.kernels import gemv

    model, tok, _ = load_model("smollm2-135m-random", "float32", "cpu", seed=7)
    prompt = torch.randint(3, model.config.vocab_size, (37,), generator=torch.Generator().manual_seed(1)).tolist()
    req = [{"prompt_token_ids": prompt, "max_tokens": 24, "ignore_eos": True}]

    def generate(device):
        cfg = EngineConfig(model="test", device=device, cache=CacheConfig(block_size=16, num_blocks=64),
                           scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64))
        e = LLMEngine(cfg, model=copy.deepcopy(model).to(device), tokenizer=tok)
        return e.generate(req)[0]["token_ids"], e

    ref, _ = generate("cpu")
    calls = []
    real = gemv.norm_gemv
    monkeypatch.setattr(gemv, "norm_gemv", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    monkeypatch.setattr(gemv, "POLICY", "all")
    monkeypatch.setattr(gemv, "FOLD_KINDS", frozenset({"fp32"} if fold else ()))
    monkeypatch.setattr(gemv, "ACT_KINDS", frozenset({"fp32"} if fold else ()))  # SiLU: gate/up's epilogue
    folded = []
    real_fold = gemv.residual_gemv
    monkeypatch.setattr(gemv, "residual_gemv", lambda *a, **kw: folded.append(1) or real_fold(*a, **kw))
    tokens, e = generate("cuda")
    assert bool(folded) == fold
    assert calls, "no one-token step took the fused GEMV"
    assert e.runner.graph_stats["replays"] > 0
    assert tokens == ref


@pytest.mark.parametrize("n,k", [(n, k) for n, k, _ in SHAPES])
@pytest.mark.parametrize("weight", ["bf16", "fp8"])
def test_gemv_rows_matches_float64_at_8b_shapes(n, k, weight):
    """engine.kernels.gemv_rows at llama3-8b's projections, 2 to 8 rows of x (the committed tiles,
    and the path a projection takes: fp8_gemm and TritonOps.linear route to it where `takes` says),
    each row against float64 and against the GEMV of that row alone."""
    from tandem.engine.kernels import gemv, gemv_rows
    from tandem.engine.kernels.fp8_gemm import fp8_gemm

    torch.manual_seed(n + k + 1)
    w = torch.randn(n, k, device="cuda") * k ** -0.5
    q, scale = quantize_fp8(w) if weight == "fp8" else (w.bfloat16(), None)
    w_ref = dequantize_fp8(q, scale, 0, torch.float64) if weight == "fp8" else q.double()
    for m in (2, 3, 4, 8):
        x = torch.randn(m, k, device="cuda").bfloat16()
        out = gemv_rows.gemv_rows(x, q, scale)
        ref = x.double() @ w_ref.T
        for i in range(m):
            assert rel_err(out[i], ref[i]) < 1e-2, (m, i)
            one = gemv.gemv(x[i:i + 1], q, scale)
            assert rel_err(out[i], one[0]) < 1e-2, (m, i)
        if weight == "fp8" and gemv_rows.takes(q, m):  # the FP8 projection path takes it, same bits
            assert torch.equal(fp8_gemm(x, q, scale), out), m
