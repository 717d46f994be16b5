"""The one-token GEMV with its prologue folded in (engine/kernels/gemv.py), under Triton's
interpreter, against the launches it replaces (engine.kernels.fused's rms_norm and silu_and_mul,
then a plain matmul): model-dtype and FP8 weights (per channel and block scales), bias, K tiles
that do not divide K, the first layer (no residual yet), and bad input refused by name.

Tolerances: fp32 activations near 1e-7 relative (bound 1e-5); bf16 outputs differ from the
two-launch path only by the output's rounding and the accumulation order (bound 1e-2); a wrong
index, scale or norm is O(1). The new residual stream is the same bits as rms_norm's."""

import os
import sys

import torch

if not torch.cuda.is_available() and "TRITON_INTERPRET" not in os.environ:
    if "triton" in sys.modules:
        raise RuntimeError("triton was imported before TRITON_INTERPRET=1 was set (see test_kernels.py)")
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

from tandem.engine.kernels import triton_available  # noqa: E402
from tandem.engine.quant.fp8 import dequantize_fp8, quantize_fp8  # noqa: E402

if not triton_available():
    pytest.fail("Triton is not installed, or there is no CUDA and TRITON_INTERPRET is off", pytrace=False)

from tandem.engine.kernels.fused import rms_norm, silu_and_mul  # noqa: E402
from tandem.engine.kernels.gemv import (GemvConfig, choose_gemv_config, gemv, norm_gemv, residual_gemv,  # noqa: E402
                                        scaled_gemv, silu_gemv)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# 64 does not divide K = 96 or 160; thread_sums: each 16-byte run of columns summed in its thread
TILES = (GemvConfig(8, 32, 2, 2), GemvConfig(8, 32, 2, 2, True), GemvConfig(4, 64, 1, 1), GemvConfig(4, 64, 1, 1, True))
BLOCK_TILES = TILES[:2]  # block_k must divide group_k = 32


def rel_err(out, ref):
    assert not out.isnan().any()
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def weights(kind, n, k, gen, dtype):
    """-> (weight, scale, group_k, the weight as the reference multiplies it in fp64)"""
    w = torch.randn(n, k, generator=gen) * k ** -0.5
    if kind == "model":
        w = w.to(dtype)
        return w.to(DEVICE), None, 0, w.double()
    q, scale = quantize_fp8(w)
    group_k = 32 if kind == "fp8-block" else 0
    if group_k:
        scale = torch.rand(n, -(-k // group_k), generator=gen) + 0.5
    return q.to(DEVICE), scale.to(DEVICE), group_k, dequantize_fp8(q, scale, group_k, torch.float64)


def tol(dtype):
    return 1e-5 if dtype == torch.float32 else 1e-2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["model", "fp8", "fp8-block"])
@pytest.mark.parametrize("k,bias", [(96, False), (160, True)])
def test_gemv_matches_torch(dtype, kind, k, bias):
    gen = torch.Generator().manual_seed(k + len(kind))
    n = 24
    w, scale, group_k, ref_w = weights(kind, n, k, gen, dtype)
    x = torch.randn(1, k, generator=gen).to(dtype).to(DEVICE)
    b = torch.randn(n, generator=gen).to(dtype).to(DEVICE) if bias else None
    ref = x.double() @ ref_w.T + (0 if b is None else b.double())
    for cfg in TILES if group_k != 32 else BLOCK_TILES:
        out = gemv(x, w, scale, b, group_k=group_k, config=cfg)
        assert out.dtype == dtype and out.shape == (1, n)
        assert rel_err(out, ref) < tol(dtype), cfg


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["model", "fp8", "fp8-block"])
@pytest.mark.parametrize("first_layer", [False, True])
def test_norm_gemv_is_rms_norm_then_gemv(dtype, kind, first_layer):
    gen = torch.Generator().manual_seed(3 + first_layer)
    n, k = 40, 96
    w, scale, group_k, ref_w = weights(kind, n, k, gen, dtype)
    x = (torch.randn(1, k, generator=gen) * 3).to(dtype).to(DEVICE)
    residual = None if first_layer else torch.randn(1, k, generator=gen).to(dtype).to(DEVICE)
    g = (torch.rand(k, generator=gen) + 0.5).to(dtype).to(DEVICE)
    h, ref_residual = rms_norm(x, g, 1e-5, residual)
    ref = h.double() @ ref_w.T
    for cfg in TILES if group_k != 32 else BLOCK_TILES:
        out, new_residual = norm_gemv(x, residual, g, 1e-5, w, scale, group_k=group_k, config=cfg)
        assert torch.equal(new_residual, ref_residual)  # the residual stream, bit for bit
        assert (new_residual is x) == first_layer
        assert rel_err(out, ref) < tol(dtype), cfg
    # the norm really is applied: scaling x (first layer) or x and residual leaves the output alone
    out2, _ = norm_gemv(x * 4, None if residual is None else residual * 4, g, 1e-5, w, scale, group_k=group_k)
    assert rel_err(out2, ref) < tol(dtype) * 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["model", "fp8"])
def test_silu_gemv_is_silu_and_mul_then_gemv(dtype, kind):
    gen = torch.Generator().manual_seed(11)
    n, k = 24, 160
    w, scale, group_k, ref_w = weights(kind, n, k, gen, dtype)
    gate_up = torch.randn(1, 2 * k, generator=gen).to(dtype).to(DEVICE)
    ref = silu_and_mul(gate_up).double() @ ref_w.T
    for cfg in TILES:
        out = silu_gemv(gate_up, w, scale, config=cfg)
        assert rel_err(out, ref) < tol(dtype), cfg
    # gate and up are not interchangeable: swapping the halves changes the result
    swapped = torch.cat([gate_up[:, k:], gate_up[:, :k]], dim=1)
    assert rel_err(silu_gemv(swapped, w, scale), ref) > 0.1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["model", "fp8", "fp8-block"])
@pytest.mark.parametrize("silu", [False, True])
def test_a_norm_folded_between_two_gemvs_is_the_separate_launches(dtype, kind, silu):
    """residual_gemv (o or down: the output added to the residual stream, the next norm begun) then
    scaled_gemv (q/k/v or gate/up: the norm finished) against gemv, rms_norm, gemv: the new residual
    stream bit for bit, the second output within rounding, for every tile of either GEMV."""
    gen = torch.Generator().manual_seed(21 + silu)
    n, k, n2 = 64, 96, 40
    w1, s1, gk1, _ = weights(kind, n, k, gen, dtype)
    w2, s2, gk2, ref_w2 = weights(kind, n2, n, gen, dtype)
    x = torch.randn(1, 2 * k if silu else k, generator=gen).to(dtype).to(DEVICE)
    residual = (torch.randn(1, n, generator=gen) * 3).to(dtype).to(DEVICE)
    g = (torch.rand(n, generator=gen) + 0.5).to(dtype).to(DEVICE)
    bias2 = torch.randn(n2, generator=gen).to(dtype).to(DEVICE)  # Qwen2's q/k/v bias: after the 1/rms
    first = silu_gemv if silu else gemv
    tiles = TILES if gk1 != 32 else BLOCK_TILES
    for cfg, cfg2 in zip(tiles, reversed(tiles)):
        h, ref_residual = rms_norm(first(x, w1, s1, group_k=gk1, config=cfg), g, 1e-5, residual)
        row, new_residual = residual_gemv(x, w1, s1, residual=residual, norm_weight=g, eps=1e-5, silu=silu,
                                          group_k=gk1, config=cfg)
        assert torch.equal(new_residual, ref_residual), cfg  # the residual stream, bit for bit
        assert row.sums.numel() == -(-n // cfg.block_n) and row.norm_weight is g
        assert rel_err(row.finish(), h) < tol(dtype)
        out = scaled_gemv(row, w2, s2, bias2, group_k=gk2, config=cfg2)
        assert rel_err(out, h.double() @ ref_w2.T + bias2.double()) < tol(dtype), (cfg, cfg2)
    if not silu:  # the norm is really finished: the same stream scaled by 4 gives the same output
        row4, _ = residual_gemv(x * 4, w1, s1, residual=residual * 4, norm_weight=g, eps=1e-5, group_k=gk1)
        assert rel_err(scaled_gemv(row4, w2, s2, bias2, group_k=gk2), h.double() @ ref_w2.T + bias2.double()) < tol(dtype) * 2


@pytest.mark.parametrize("kind", ["model", "fp8", "fp8-block"])
def test_epilogue_reads_before_the_loop_give_the_same_bits(kind, monkeypatch):
    """EARLY_EPILOGUE (the FP8 rows' scales, the residual rows and the next norm's weight read
    before the K loop) against the reads after it: the same output, residual stream and sums of
    squares, bit for bit, for a plain GEMV and a residual-norm one, in bf16."""
    import tandem.engine.kernels.gemv as gemv_mod

    gen = torch.Generator().manual_seed(5)
    w, s, gk, _ = weights(kind, 64, 96, gen, torch.bfloat16)
    x = torch.randn(1, 96, generator=gen).bfloat16().to(DEVICE)
    residual = (torch.randn(1, 64, generator=gen) * 3).bfloat16().to(DEVICE)
    g = (torch.rand(64, generator=gen) + 0.5).bfloat16().to(DEVICE)
    got = {}
    for early in (False, True):
        monkeypatch.setattr(gemv_mod, "EARLY_EPILOGUE", early)
        row, stream = residual_gemv(x, w, s, residual=residual, norm_weight=g, eps=1e-5, group_k=gk)
        got[early] = (gemv(x, w, s, group_k=gk), stream, row.sums, row.finish())
    for a, b in zip(got[False], got[True]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["model", "fp8", "fp8-block"])
def test_silu_out_is_the_gemv_then_silu_and_mul(dtype, kind):
    """A gate/up projection with SiLU-and-mul as its epilogue (`silu_out`: each program takes gate
    and up rows of the same channels) gives silu_and_mul of the plain GEMV's output bit for bit, as a
    plain GEMV, with its norm (norm_gemv) and finishing a folded norm (scaled_gemv), for every tile;
    the intermediate size (36) is not a multiple of any tile's channels."""
    gen = torch.Generator().manual_seed(31 + len(kind))
    inter, k = 36, 96
    w, scale, group_k, _ = weights(kind, 2 * inter, k, gen, dtype)
    x = torch.randn(1, k, generator=gen).to(dtype).to(DEVICE)
    residual = torch.randn(1, k, generator=gen).to(dtype).to(DEVICE)
    g = (torch.rand(k, generator=gen) + 0.5).to(dtype).to(DEVICE)
    row, _ = residual_gemv(x, torch.eye(k).to(dtype).to(DEVICE), residual=residual, norm_weight=g, eps=1e-5)
    for cfg in TILES if group_k != 32 else BLOCK_TILES:
        plain = gemv(x, w, scale, group_k=group_k, config=cfg)
        out = gemv(x, w, scale, group_k=group_k, config=cfg, silu_out=True)
        assert out.shape == (1, inter) and torch.equal(out, silu_and_mul(plain)), cfg
        normed, stream = norm_gemv(x, residual, g, 1e-5, w, scale, group_k=group_k, config=cfg, silu_out=True)
        plain, stream_ref = norm_gemv(x, residual, g, 1e-5, w, scale, group_k=group_k, config=cfg)
        assert torch.equal(normed, silu_and_mul(plain)) and torch.equal(stream, stream_ref), cfg
        scaled = scaled_gemv(row, w, scale, group_k=group_k, config=cfg, silu_out=True)
        assert torch.equal(scaled, silu_and_mul(scaled_gemv(row, w, scale, group_k=group_k, config=cfg))), cfg
    # gate and up are not interchangeable: the up rows first give another output
    swapped = torch.cat([w[inter:], w[:inter]])
    s2 = None if scale is None else torch.cat([scale[inter:], scale[:inter]])
    assert not torch.allclose(gemv(x, swapped, s2, group_k=group_k, silu_out=True), out.to(DEVICE), atol=1e-2)


def test_configs_fit_block_scales():
    for n, k in ((6144, 4096), (4096, 14336), (5120, 27648)):
        for dtype in (torch.float8_e4m3fn, torch.bfloat16, torch.float32):
            for group_k in (0, 128):
                cfg = choose_gemv_config(n, k, dtype, group_k if dtype == torch.float8_e4m3fn else 0)
                assert cfg.block_n >= 1 and (not group_k or dtype != torch.float8_e4m3fn or group_k % cfg.block_k == 0)


def test_small_rows_get_no_tile_wider_than_the_row():
    for dtype in (torch.float8_e4m3fn, torch.bfloat16, torch.float32):
        cfg = choose_gemv_config(64, 96, dtype)
        assert cfg.block_k == 128, (dtype, cfg)


def test_one_token_fp8_gemm_runs_the_gemv_config_in_full(monkeypatch):
    """fp8_gemm leaves a one-token call's config to gemv, which picks the whole tuned one
    (thread_sums included: a copy of the config without it once made the 2048-column FP8 tiles
    40% slower in the step on the H200)."""
    import tandem.engine.kernels.fp8_gemm as fp8_gemm_mod

    seen = []

    def spy(x, weight, scale, bias, *, group_k, config):
        seen.append(config)
        return torch.zeros(1, weight.shape[0], dtype=x.dtype, device=x.device)

    monkeypatch.setattr(fp8_gemm_mod, "gemv", spy)
    q, scale = quantize_fp8(torch.randn(4096, 4096))
    fp8_gemm_mod.fp8_gemm(torch.randn(1, 4096).to(DEVICE), q.to(DEVICE), scale.to(DEVICE))
    assert seen == [None]
    assert choose_gemv_config(4096, 4096, torch.float8_e4m3fn).thread_sums


def test_bad_input_is_refused_by_name():
    x = torch.randn(1, 32).to(DEVICE)
    w = torch.randn(16, 32).to(DEVICE)
    q, scale = quantize_fp8(w.cpu())
    q, scale = q.to(DEVICE), scale.to(DEVICE)
    with pytest.raises(ValueError, match=r"x must be one token, \[1, K\]"):
        gemv(torch.randn(2, 32).to(DEVICE), w)
    with pytest.raises(ValueError, match="weight is"):
        gemv(torch.randn(1, 48).to(DEVICE), w)
    with pytest.raises(ValueError, match="needs its scale"):
        gemv(x, q)
    with pytest.raises(ValueError, match="only an FP8 weight takes one"):
        gemv(x, w, scale)
    with pytest.raises(ValueError, match="weight has dtype torch.bfloat16 but x has torch.float32"):
        gemv(x, w.bfloat16())
    with pytest.raises(ValueError, match="norm_weight has 8 elements for hidden size 32"):
        norm_gemv(x, None, torch.ones(8).to(DEVICE), 1e-5, w)
    with pytest.raises(ValueError, match="residual has shape"):
        norm_gemv(x, torch.randn(1, 16).to(DEVICE), torch.ones(32).to(DEVICE), 1e-5, w)
    with pytest.raises(ValueError, match="odd width"):
        silu_gemv(torch.randn(1, 33).to(DEVICE), w)
    with pytest.raises(ValueError, match=r"residual has shape \(1, 32\), the output is \[1, 16\]"):
        residual_gemv(x, w, residual=x, norm_weight=torch.ones(16).to(DEVICE), eps=1e-5)
    with pytest.raises(ValueError, match="norm_weight has 32 elements for hidden size 16"):
        residual_gemv(x, w, residual=torch.zeros(1, 16).to(DEVICE), norm_weight=torch.ones(32).to(DEVICE), eps=1e-5)
    with pytest.raises(ValueError, match="odd width"):
        residual_gemv(torch.randn(1, 33).to(DEVICE), w, residual=torch.zeros(1, 16).to(DEVICE),
                      norm_weight=torch.ones(16).to(DEVICE), eps=1e-5, silu=True)
    with pytest.raises(ValueError, match="block_k 64 must divide group_k 32"):
        gemv(x, q, torch.ones(16, 1).to(DEVICE), group_k=32, config=GemvConfig(4, 64))
    with pytest.raises(ValueError, match="even number of weight rows and of rows per program, got 15"):
        gemv(x, w[:15], silu_out=True)
    with pytest.raises(ValueError, match="got 16 and block_n 1"):
        gemv(x, w, silu_out=True, config=GemvConfig(1, 32))


# ---- in the model: TritonOps.norm_linear / silu_linear on one-token steps -----------------------
def _count_calls(monkeypatch):
    from tandem.engine.kernels import gemv as gemv_mod

    calls = {"norm_gemv": 0, "silu_gemv": 0, "residual_gemv": 0, "scaled_gemv": 0}
    for name in calls:
        real = getattr(gemv_mod, name)

        def counted(*a, _real=real, _name=name, **kw):
            calls[_name] += 1
            return _real(*a, **kw)
        monkeypatch.setattr(gemv_mod, name, counted)
    return calls


def _greedy(make_engine, model, tok, prompts, max_tokens=5):
    reqs = [{"prompt_token_ids": p, "max_tokens": max_tokens, "ignore_eos": True} for p in prompts]
    return [r["token_ids"] for r in make_engine(model, tok).generate(reqs)]


@pytest.mark.parametrize("fold", [False, True])
@pytest.mark.parametrize("quantization", [None, "fp8"])
@torch.inference_mode()
def test_one_token_steps_fold_norm_and_silu_and_keep_the_tokens(make_engine, monkeypatch, quantization, fold):
    """A single sequence decodes one token a step: under POLICY "all" each layer's two norms and
    its SiLU run inside the projections' GEMVs, and the greedy tokens are the plain torch path's
    (fp32, and FP8 weights, which both paths read the same). With the norms folded into the GEMVs
    before them (`fold`: FOLD_KINDS), o and down begin the next norm (residual_gemv) and q/k/v and
    gate/up finish it (scaled_gemv); only layer 0's input norm is norm_gemv's, and only the last
    down its own silu_gemv. Two sequences at once (T = 2) take the separate launches."""
    import copy

    from tandem.engine.kernels import gemv as gemv_mod
    from tandem.engine.model import TritonOps
    from tandem.engine.weights import load_model

    model, tok, cfg = load_model("tiny-random", seed=1234, quantization=quantization)
    prompt = list(range(7, 30))
    ref = _greedy(make_engine, model, tok, [prompt])
    fused = copy.deepcopy(model)
    fused.ops = TritonOps()
    monkeypatch.setattr(gemv_mod, "POLICY", "all")
    monkeypatch.setattr(gemv_mod, "FOLD_KINDS", frozenset({"fp8", "16bit", "fp32"} if fold else ()))
    monkeypatch.setattr(gemv_mod, "ACT_KINDS", frozenset())  # the SiLU in the down GEMV's prologue
    calls = _count_calls(monkeypatch)
    assert _greedy(make_engine, fused, tok, [prompt]) == ref
    steps, layers = 4, cfg.num_layers  # 5 tokens: the first from the prompt's step
    if fold:
        folded = (2 * layers - 1) * steps
        want = {"norm_gemv": steps, "silu_gemv": steps, "residual_gemv": folded, "scaled_gemv": folded}
    else:
        want = {"norm_gemv": 2 * layers * steps, "silu_gemv": layers * steps, "residual_gemv": 0, "scaled_gemv": 0}
    assert calls == want
    calls.update(dict.fromkeys(calls, 0))
    two = [prompt, prompt[::-1]]
    assert _greedy(make_engine, fused, tok, two, max_tokens=3) == _greedy(make_engine, model, tok, two, 3)
    assert set(calls.values()) == {0}


@torch.inference_mode()
def test_fp8_defaults_fold_the_norms_and_the_silu(make_engine, monkeypatch):
    """The default policy for an FP8 model: every norm after layer 0's input norm folded into the
    o and down GEMVs before it (FOLD_KINDS), SiLU-and-mul the gate/up GEMV's epilogue (ACT_KINDS:
    no SiLU launch in a one-token step, the down GEMV reads a plain input), the greedy tokens the
    plain torch path's."""
    import copy

    from tandem.engine.kernels import gemv as gemv_mod
    from tandem.engine.model import TritonOps
    from tandem.engine.weights import load_model

    assert gemv_mod.POLICY == "table" and gemv_mod.FOLD_KINDS == {"fp8"} and gemv_mod.ACT_KINDS == {"fp8"}
    model, tok, cfg = load_model("tiny-random", seed=99, quantization="fp8")
    prompt = list(range(3, 21))
    ref = _greedy(make_engine, model, tok, [prompt])
    fused = copy.deepcopy(model)
    fused.ops = TritonOps()
    silu_rows = []
    real_silu = fused.ops.silu_and_mul
    fused.ops.silu_and_mul = lambda x: silu_rows.append(x.shape[0]) or real_silu(x)
    calls = _count_calls(monkeypatch)
    counted, activated = gemv_mod.scaled_gemv, []
    monkeypatch.setattr(gemv_mod, "scaled_gemv",
                        lambda *a, **kw: activated.append(kw.get("silu_out", False)) or counted(*a, **kw))
    assert _greedy(make_engine, fused, tok, [prompt]) == ref
    steps = 4
    folded = (2 * cfg.num_layers - 1) * steps
    assert calls == {"norm_gemv": 0, "silu_gemv": 0, "residual_gemv": folded, "scaled_gemv": folded}
    assert sum(activated) == cfg.num_layers * steps  # every layer's gate/up, every one-token step
    assert silu_rows == [len(prompt)] * cfg.num_layers  # only the prompt's step launches SiLU


@pytest.mark.parametrize("quantization", [None, "fp8"])
@torch.inference_mode()
def test_forwards_ask_for_pdl_launches_for_fp8_weights_and_one_token_steps(make_engine, monkeypatch, quantization):
    """Every kernel launch of an FP8 model's forward (and its LM head) asks for PDL
    (engine.kernels.pdl.auto; off the GPU the launch itself stays plain); a 16-bit model's only in
    its one-token steps, not in its prompt's."""
    from tandem.engine.kernels import pdl
    from tandem.engine.model import TritonOps
    from tandem.engine.weights import load_model

    model, tok, _ = load_model("tiny-random", seed=5, quantization=quantization)
    model.ops = TritonOps()
    assert model.fp8_weights is (quantization == "fp8")
    monkeypatch.setattr(pdl, "ENABLED", None)
    asked = []  # (tokens of the forward, whether the launch asked for PDL)
    tokens = [0]
    real, layers = pdl.launch_options, model._layers_fused
    monkeypatch.setattr(pdl, "launch_options", lambda device: asked.append((tokens[0], pdl.on())) or real(device))

    def counted(input_ids, *args):
        tokens[0] = input_ids.shape[0]
        return layers(input_ids, *args)

    monkeypatch.setattr(model, "_layers_fused", counted)
    _greedy(make_engine, model, tok, [list(range(7, 20))], max_tokens=3)
    assert {n for n, _ in asked} == {13, 1}  # the prompt's step, then one-token steps
    assert all(on == (quantization == "fp8" or n == 1) for n, on in asked), sorted(set(asked))
    assert not pdl.on()  # nothing leaks past the forward


def test_policy_picks_weights_and_prologues():
    from tandem.engine.kernels import gemv as gemv_mod

    def w(dtype, n=6144, k=4096):
        return torch.empty(n, k, dtype=dtype)

    assert gemv_mod.POLICY == "table"
    assert gemv_mod.takes(w(torch.bfloat16), "norm") and gemv_mod.takes(w(torch.bfloat16, 4096, 4096))
    assert gemv_mod.takes(w(torch.bfloat16, 4096, 14336), "silu")  # llama3-8b's down with its SiLU
    assert not gemv_mod.takes(w(torch.bfloat16, 5120, 27648), "silu")  # cuBLAS keeps qwen2.5-32b's
    assert not gemv_mod.takes(w(torch.bfloat16, 8, 16), "norm")  # unmeasured shapes stay as they were
    assert not gemv_mod.takes(w(torch.float32), "norm")
    assert not gemv_mod.takes(w(torch.float8_e4m3fn), "norm")  # FP8 keeps its norm launch
    assert all(prologue in ("none", "norm", "silu") and kind in ("16bit", "fp8") for kind, _, _, prologue in gemv_mod.WINS)
    # the SiLU as the gate/up GEMV's epilogue: FP8 weights (ACT_KINDS), an even number of rows
    assert gemv_mod.activates(w(torch.float8_e4m3fn, 28672)) and not gemv_mod.activates(w(torch.float8_e4m3fn, 7))
    assert not gemv_mod.activates(w(torch.bfloat16, 28672))
    for policy, want in (("all", True), ("off", False)):
        old, gemv_mod.POLICY = gemv_mod.POLICY, policy
        try:
            assert gemv_mod.takes(w(torch.float32, 8, 16), "silu") == want, policy
            assert gemv_mod.activates(w(torch.float8_e4m3fn, 28672)) == want, policy
        finally:
            gemv_mod.POLICY = old


_HOPPER_COMPILE = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from tandem.engine.kernels.gemv import _gemv_kernel
sig = {"x_ptr": "*bf16", "r_ptr": "*bf16", "g_ptr": "*bf16", "new_r_ptr": "*bf16", "w_ptr": "*fp8e4nv",
       "s_ptr": "*fp32", "b_ptr": "*bf16", "out_ptr": "*bf16", "ss_ptr": "*fp32", "er_ptr": "*bf16",
       "eg_ptr": "*bf16", "enew_r_ptr": "*bf16", "N": "i32", "K": "i32", "stride_wn": "i32",
       "stride_sn": "i32", "eps": "fp32", "NUM_SS": "i32"}
# (prologue, PDL mode, 16-byte run, residual-norm epilogue, SiLU epilogue): 3 is the scaled input of
# a folded norm
for prologue, pdl, vec, fold, act in ((0, 1, 1, 0, 0), (0, 2, 1, 0, 0), (1, 2, 16, 0, 0), (2, 2, 16, 0, 0),
                                      (1, 1, 1, 0, 0), (0, 2, 16, 0, 0), (3, 2, 16, 0, 0), (3, 1, 1, 0, 0),
                                      (0, 2, 16, 1, 0), (2, 2, 16, 1, 0), (3, 2, 16, 0, 1), (1, 2, 16, 0, 1)):
    for i, (w, group_k) in enumerate((("*fp8e4nv", 0), ("*fp8e4nv", 128), ("*bf16", 0))):
        const = dict(PROLOGUE=prologue, HAS_RESIDUAL=True, SCALED=w != "*bf16", GROUP_K=group_k, HAS_BIAS=True,
                     BLOCK_N=4, BLOCK_K=128, EVEN_K=False, USE_PDL=pdl, VEC=vec if w != "*bf16" else max(1, vec // 2),
                     RESIDUAL_NORM=bool(fold), BLOCK_SS=1024, SILU_OUT=bool(act),
                     EARLY_EPILOGUE=(i + prologue + fold) % 2 == 0)  # the epilogue's reads before the loop, or after
        src = ASTSource(_gemv_kernel, {**sig, "w_ptr": w, **{k: "constexpr" for k in const}}, constexprs=const)
        k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 2, "launch_pdl": True})
        assert "griddepcontrol.wait" in k.asm["ptx"] and "griddepcontrol.launch_dependents" in k.asm["ptx"]
print("compiled")
"""


def test_the_dependent_launch_variant_compiles_for_hopper():
    """The PDL branch runs only on a Hopper GPU, never under the interpreter: compile it for sm_90
    here (Triton's own ptxas, no GPU needed), so a type error in it fails CI instead of a GPU run."""
    import subprocess

    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_DEFAULT_FP_FUSION": "1"}
    done = subprocess.run([sys.executable, "-c", _HOPPER_COMPILE], env=env, capture_output=True, text=True,
                          timeout=300)
    if "ptxas" in done.stderr and "not found" in done.stderr:
        pytest.fail(f"Triton's ptxas is missing: {done.stderr[-500:]}")
    assert done.returncode == 0 and "compiled" in done.stdout, done.stderr[-2000:]
