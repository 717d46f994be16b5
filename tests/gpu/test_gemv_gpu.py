"""The one-token GEMV with its norm / SiLU folded in (engine/kernels/gemv.py) on the GPU: at
llama3-8b's projection shapes against the two launches it replaces (bf16 and FP8 weights), fp32
against float64, and in the engine: one sequence decoding through CUDA graphs with every
projection fused gives the CPU path's greedy tokens (fp32)."""

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


def test_one_sequence_through_graphs_with_every_projection_fused_matches_cpu(monkeypatch):
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
    tokens, e = generate("cuda")
    assert calls, "no one-token step took the fused GEMV"
    assert e.runner.graph_stats["replays"] > 0
    assert tokens == ref
