"""FP8 weights on the GPU: the compiled Triton weight-only GEMM and `torch._scaled_mm` against the
plain-torch reference on real projection shapes, the path `fp8_linear` picks, and a quantized
model through the engine (CUDA graphs) against eager and the CPU path.

Bounds: the kernel in bf16 against a float64 reference on the same FP8 weights is output rounding
(~3e-3 relative; bound 1e-2); `_scaled_mm` also quantizes the activations per token to e4m3
(~2.5% relative; bound 6e-2); an indexing or scale mistake is O(1)."""

from __future__ import annotations

import copy

import pytest
import torch

from tandem.engine.config import CacheConfig, EngineConfig
from tandem.engine.engine import LLMEngine
from tandem.engine.quant import fp8 as fp8_quant
from tandem.engine.quant.fp8 import quantize_fp8, scaled_mm_linear, torch_linear
from tandem.engine.weights import load_model

MODEL = "smollm2-135m-random"


def rel_err(out, ref):
    assert not out.isnan().any()
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


@pytest.mark.parametrize("m", [1, 7, 16, 64, 200])
@pytest.mark.parametrize("n,k,group_k", [(6144, 4096, 0), (4096, 14336, 0), (1536, 576, 0), (2048, 1024, 128)])
def test_fp8_gemm_matches_torch_on_gpu(m, n, k, group_k):
    from tandem.engine.kernels.fp8_gemm import GemmConfig, fp8_gemm

    gen = torch.Generator(device="cuda").manual_seed(m + n)
    x = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
    q, scale = quantize_fp8(torch.randn(n, k, device="cuda", generator=gen))
    if group_k:
        scale = torch.rand(n, k // group_k, device="cuda", generator=gen) + 0.5
    bias = torch.randn(n, device="cuda", generator=gen).bfloat16()
    ref = torch_linear(x.double(), q, scale.double(), bias.double(), group_k)
    gemvs = (GemmConfig(1, 16, group_k or 512, gemv=True), GemmConfig(1, 4, group_k or 256, 2, 4, gemv=True))
    for cfg in (None, *gemvs) if m == 1 else (None,):
        assert rel_err(fp8_gemm(x, q, scale, bias, group_k=group_k, config=cfg), ref) < 1e-2, cfg
    out32 = fp8_gemm(x.float(), q, scale, None, group_k=group_k)  # fp32 activations: ieee dots
    assert rel_err(out32, torch_linear(x.double(), q, scale.double(), None, group_k)) < 1e-5


@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096),
                                 (7168, 5120), (5120, 5120), (55296, 5120), (5120, 27648), (152064, 5120),
                                 (10240, 8192), (8192, 8192), (57344, 8192), (8192, 28672), (128256, 8192)])
def test_committed_one_token_config_is_right_on_every_swept_shape(n, k):
    """choose_config's one-token pick for each projection and LM head shape bench/fp8_sweep.py
    tunes (llama3-8b, qwen2.5-32b, llama3-70b) compiles and computes the reference's result."""
    from tandem.engine.kernels.fp8_gemm import choose_config, fp8_gemm

    assert choose_config(1, n, k, 0).gemv
    q, scale = quantize_fp8(torch.randn(n, k, device="cuda", dtype=torch.bfloat16))
    x = torch.randn(1, k, device="cuda").bfloat16()
    assert rel_err(fp8_gemm(x, q, scale), torch_linear(x.double(), q, scale.double(), None)) < 1e-2


def test_quantize_rows_is_exactly_the_torch_rule():
    from tandem.engine.kernels.fp8_gemm import quantize_rows

    x = torch.randn(300, 14336, device="cuda").bfloat16()
    q, scale = quantize_rows(x)
    q_ref, scale_ref = fp8_quant.quantize_tokens(x)
    assert torch.equal(scale, scale_ref) and torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))


@pytest.mark.parametrize("m", [64, 256])
def test_scaled_mm_path_close_to_reference(m):
    x = torch.randn(m, 4096, device="cuda").bfloat16()
    q, scale = quantize_fp8(torch.randn(6144, 4096, device="cuda"))
    out = scaled_mm_linear(x, q, scale, None)
    assert out.dtype == torch.bfloat16 and rel_err(out, torch_linear(x.double(), q, scale.double(), None)) < 6e-2


def test_fp8_linear_picks_the_kernel_by_tokens(monkeypatch):
    calls = []
    monkeypatch.setattr(fp8_quant, "scaled_mm_linear", lambda *a: calls.append("scaled_mm") or torch_linear(*a))
    q, scale = quantize_fp8(torch.randn(256, 512, device="cuda"))
    for m in (1, fp8_quant.SCALED_MM_MIN_TOKENS - 1, fp8_quant.SCALED_MM_MIN_TOKENS):
        fp8_quant.fp8_linear(torch.randn(m, 512, device="cuda").bfloat16(), q, scale, None)
    assert calls == ["scaled_mm"]
    fp8_quant.fp8_linear(torch.randn(512, 512, device="cuda").bfloat16(), q, torch.ones(256, 4, device="cuda"),
                         None, group_k=128)  # block scales: always the Triton kernel
    assert calls == ["scaled_mm"]


@torch.inference_mode()
def test_quantized_engine_graphs_match_eager_and_cpu():
    """fp32 activations (ieee dots in the kernel): CUDA-graph decode gives exactly the eager
    path's tokens, and the CPU path's (dequantize, then matmul) on the same FP8 weights."""
    reqs = [{"prompt_token_ids": list(range(10 + i, 90 + 29 * i)), "max_tokens": 16, "ignore_eos": True}
            for i in range(5)]
    cpu, tok, _ = load_model(MODEL, "float32", "cpu", seed=7, quantization="fp8")  # seeded draws are per device
    gpu = copy.deepcopy(cpu).to("cuda")
    assert gpu.layers[0].mlp.down_proj.is_fp8
    out = {}
    for device, graphs, model in (("cuda", True, gpu), ("cuda", False, gpu), ("cpu", False, cpu)):
        e = LLMEngine(EngineConfig(model="test", device=device, cache=CacheConfig(num_blocks=256)),
                      model=model, tokenizer=tok)
        if not graphs:
            e.runner.graphs = None
        out[(device, graphs)] = [r["token_ids"] for r in e.generate(reqs)]
        if graphs:
            assert e.runner.graph_stats["replays"] > 0, e.runner.graph_stats
    assert out[("cuda", True)] == out[("cuda", False)], "graphs against eager"
    assert out[("cuda", False)] == out[("cpu", False)], "GPU against CPU"


def test_70b_fp8_builds_layer_by_layer_within_fp8_size():
    """Building part by part keeps the peak near the FP8 model's size: 12 of llama3-70b's 80
    layers with the real shapes, quantized at load, the LM head too. Peak < the finished model +
    the largest part in bf16 beside its fp32 draw (the LM head: 2.1 + 4.2 GB) + 1 GiB; building
    whole in bf16 first would need ~25 GB here."""
    from dataclasses import replace

    from tandem.engine.build import build_model, random_fill
    from tandem.engine.config import PRESETS

    cfg = replace(PRESETS["llama3-70b-random"], num_layers=12)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    model = build_model(cfg, "cuda", torch.bfloat16, random_fill(0, "cuda"), fp8=True)
    total = sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers()))
    draw = max(p.numel() for p in model.parameters()) * (4 + 2)
    peak = torch.cuda.max_memory_allocated() - base
    assert model.layers[11].mlp.gate_up_proj.is_fp8 and model.lm_head.is_fp8
    assert model.embed_tokens.weight.dtype == torch.bfloat16
    assert peak < total + draw + (1 << 30), (peak / 2**30, total / 2**30, draw / 2**30)
    del model
