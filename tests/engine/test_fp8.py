"""FP8 weights (issue 24 item 4) on CPU: quantize / dequantize, the Triton weight-only kernel under
Triton's interpreter against the plain-torch reference, the Linear layer, quantization at load,
and a quantized tiny model against its fp32 self.

Tolerances. e4m3 keeps 3 mantissa bits: an element quantized per channel is within 1/16 of its
own size (round to nearest: half an ulp of 2^-3), or within 2^-10 of the row's scale * 448 near 0
(subnormals). The kernel against the reference on the same FP8 weights: fp32 near 2e-7 relative
(bound 1e-5); bf16 output rounding near 3e-3 (bound 1e-2); an indexing or scale mistake is O(1)."""

import os
import sys

import torch

if not torch.cuda.is_available() and "TRITON_INTERPRET" not in os.environ:
    if "triton" in sys.modules:
        raise RuntimeError("triton was imported before TRITON_INTERPRET=1 was set (see test_kernels.py)")
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

from tandem.engine.config import EngineConfig  # noqa: E402
from tandem.engine.kernels import triton_available  # noqa: E402
from tandem.engine.linear import Linear  # noqa: E402
from tandem.engine.quant.fp8 import (FP8_DTYPE, FP8_INV_MAX, FP8_MAX, dequantize_fp8,  # noqa: E402
                                     quantize_fp8, quantize_tokens, torch_linear)
from tandem.engine.weights import load_model  # noqa: E402
from tandem.wire.errors import ConfigError  # noqa: E402

if not triton_available():
    pytest.fail("Triton is not installed, or there is no CUDA and TRITON_INTERPRET is off", pytrace=False)

import tandem.engine.kernels.fp8_gemm as fp8_gemm_mod  # noqa: E402
from tandem.engine.kernels.fp8_gemm import GemmConfig, choose_config, fp8_gemm, quantize_rows  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SMALL = GemmConfig(16, 16, 32, num_warps=4, num_stages=2)  # tiny tiles: the interpreter is slow
GEMV = GemmConfig(1, 16, 32, gemv=True)  # the one-token kernel
GEMV_RAGGED = GemmConfig(1, 8, 64, num_warps=2, gemv=True)  # K tiles that do not divide K (160, 96)


def rel_err(out, ref):
    assert not out.isnan().any()
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def test_quantize_per_channel_error_bound_and_scale():
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(32, 80, generator=gen) * torch.logspace(-3, 1, 32)[:, None]  # rows of any size
    q, scale = quantize_fp8(w)
    assert q.dtype == FP8_DTYPE and scale.shape == (32, 1) and scale.dtype == torch.float32
    assert torch.equal(q.float().abs().amax(1), torch.full((32,), FP8_MAX))  # each row's max maps to 448
    back = dequantize_fp8(q, scale)
    bound = w.abs() / 16 + scale * 2.0 ** -10 + 1e-12
    assert ((back - w).abs() <= bound).all()
    assert torch.allclose(torch_linear(torch.eye(80), q, scale, None), back.t())


def test_dequantize_block_scales():
    q = torch.randn(5, 40).to(FP8_DTYPE)
    scale = torch.tensor([[1.0, 2.0, 4.0]]).repeat(5, 1)  # groups of 16 columns: 16, 16, 8
    ref = q.float() * torch.cat([torch.full((16,), 1.0), torch.full((16,), 2.0), torch.full((8,), 4.0)])
    assert torch.equal(dequantize_fp8(q, scale, group_k=16), ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,n,k,group_k,bias", [(1, 48, 160, 0, False), (5, 40, 96, 0, True),
                                                (3, 48, 160, 128, True), (20, 33, 64, 32, False),
                                                (1, 33, 96, 32, True)])
def test_fp8_gemm_matches_torch(dtype, m, n, k, group_k, bias):
    gen = torch.Generator().manual_seed(m * 1000 + n)
    x = torch.randn(m, k, generator=gen).to(dtype).to(DEVICE)
    q, scale = quantize_fp8(torch.randn(n, k, generator=gen))
    if group_k:
        scale = torch.rand(n, -(-k // group_k), generator=gen) + 0.5
    b = torch.randn(n, generator=gen).to(dtype).to(DEVICE) if bias else None
    q, scale = q.to(DEVICE), scale.to(DEVICE)
    ref = torch_linear(x.double(), q, scale.double(), None if b is None else b.double(), group_k)
    for cfg in (SMALL, GEMV, GEMV_RAGGED if group_k != 32 else GEMV) if m == 1 else (SMALL,):
        out = fp8_gemm(x, q, scale, b, group_k=group_k, config=cfg)
        assert out.dtype == dtype and out.shape == (m, n)
        assert rel_err(out, ref) < (1e-5 if dtype == torch.float32 else 1e-2), cfg


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_rows_matches_torch(dtype):
    gen = torch.Generator().manual_seed(7)
    x = (torch.randn(5, 100, generator=gen) * torch.logspace(-2, 2, 5)[:, None]).to(dtype).to(DEVICE)
    x[3] = 0  # an all-zero token gets the minimum scale, not 0 / 0
    x[4, 0] = 1.5 * x[4].abs().max()  # amax 1.5 * 2^k: amax * fp32(1 / 448) is one ulp off amax / 448
    q, scale = quantize_rows(x)
    q_ref, scale_ref = quantize_tokens(x)
    assert torch.equal(scale, scale_ref)
    # the rule is torch's on CUDA (a reciprocal multiply), on every device
    amax = x.abs().amax(dim=1, keepdim=True).float().cpu()
    assert torch.equal(scale_ref.cpu()[[0, 1, 2, 4]], (amax * fp8_gemm_mod.FP8_INV_MAX)[[0, 1, 2, 4]])
    assert fp8_gemm_mod.FP8_INV_MAX == FP8_INV_MAX
    a, b = q.float(), q_ref.float()
    if DEVICE == "cuda":
        assert torch.equal(a, b)
        return
    # Triton's interpreter rounds ties away from zero (168 -> 176, torch: to even, 160) and a value
    # that should round up into the next binade (127.6 -> 128) down to half of it (64): allow one
    # e4m3 step and that (the GPU test, tests/gpu/test_fp8_gpu.py, is exact)
    carried = (b.abs() == 2.0 ** b.abs().clamp_min(2.0 ** -9).log2().floor()) & (a == b / 2)
    assert ((a - b).abs() <= b.abs() / 8 + 2.0 ** -9).logical_or(carried).all()
    assert (a == b).float().mean() > 0.9


def test_chosen_tiles_fit_the_kernels():
    """One token takes the CUDA-core kernel; block scales get a K tile that divides their group."""
    for m in (1, 2, 16, 17, 32, 64, 65, 300):
        for n, k in ((6144, 4096), (28672, 4096), (4096, 14336)):
            for group_k in (0, 128):
                for elem in (2, 4):
                    cfg = choose_config(m, n, k, group_k, elem)
                    assert cfg.gemv == (m == 1) and (not group_k or group_k % cfg.block_k == 0), (m, n, cfg)
                    assert cfg.gemv or cfg.block_m >= min(m, 64) or cfg.block_m == 128


def test_fp8_gemm_refuses_bad_input_by_name():
    x = torch.randn(2, 32)
    q, scale = quantize_fp8(torch.randn(16, 32))
    with pytest.raises(ValueError, match="weight must have dtype in"):
        fp8_gemm(x, q.float(), scale)
    with pytest.raises(ValueError, match="weight is"):
        fp8_gemm(torch.randn(2, 48), q, scale)
    with pytest.raises(ValueError, match=r"scale must be \[16, 1\]"):
        fp8_gemm(x, q, scale[:8])
    with pytest.raises(ValueError, match="bias has 8 elements"):
        fp8_gemm(x, q, scale, torch.randn(8))
    with pytest.raises(ValueError, match="block_k 64 must divide group_k 32"):
        fp8_gemm(x, q, torch.ones(16, 1), group_k=32, config=GemmConfig(16, 16, 64))


def test_linear_is_nn_linear_until_quantized():
    torch.manual_seed(0)
    ref = torch.nn.Linear(24, 40, bias=True).bfloat16()
    lin = Linear(24, 40, bias=True, dtype=torch.bfloat16)
    lin.load_state_dict(ref.state_dict())
    assert [n for n, _ in lin.named_parameters()] == ["weight", "bias"]
    x = torch.randn(3, 24).bfloat16()
    assert torch.equal(lin(x), ref(x)) and not lin.is_fp8
    lin.to_fp8()
    assert lin.is_fp8 and lin.weight_scale.shape == (40, 1) and lin.bias.dtype == torch.bfloat16
    want = torch_linear(x, lin.weight, lin.weight_scale, lin.bias)
    assert torch.equal(lin(x), want)
    assert rel_err(lin(x).float(), ref(x).float()) < 0.05  # FP8 weights, bf16 activations


def test_quantization_option_is_checked():
    assert EngineConfig(quantization="fp8").quantization == "fp8"
    with pytest.raises(ConfigError, match="quantization 'int4' is not implemented"):
        EngineConfig(quantization="int4")
    with pytest.raises(ConfigError, match="quantization 'awq' is not implemented"):
        load_model("tiny-random", quantization="awq")


@torch.inference_mode()
def test_quantized_at_load_quantizes_projections_and_head_keeps_embeddings(make_engine):
    ref, tok, _ = load_model("tiny-random", seed=1234)
    model, _, _ = load_model("tiny-random", seed=1234, quantization="fp8")
    assert model.embed_tokens.weight.dtype == torch.float32
    assert torch.equal(model.embed_tokens.weight, ref.embed_tokens.weight)
    pairs = [(model.lm_head, ref.lm_head)] + [
        (layer.get_submodule(name), layer_ref.get_submodule(name)) for layer, layer_ref in zip(model.layers, ref.layers)
        for name in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")]
    for lin, lin_ref in pairs:
        assert isinstance(lin, Linear) and lin.is_fp8
        q, scale = quantize_fp8(lin_ref.weight)  # what quantization at load must have produced
        assert torch.equal(lin.weight.view(torch.uint8), q.view(torch.uint8))
        assert torch.equal(lin.weight_scale, scale)


@torch.inference_mode()
def test_tied_and_vocab_parallel_heads_stay_in_the_model_dtype():
    """A head tied to the embeddings stays the lookup table (the table stays in the model dtype);
    fp8_head leaves a head that is no plain nn.Linear (engine.parallel's shard) as it is."""
    from dataclasses import replace

    from tandem.engine.build import build_model, random_fill
    from tandem.engine.config import PRESETS
    from tandem.engine.linear import fp8_head

    cfg = replace(PRESETS["tiny-random"], tie_word_embeddings=True, num_layers=1)
    model = build_model(cfg, "cpu", torch.float32, random_fill(0, "cpu"), fp8=True)
    assert model.layers[0].mlp.down_proj.is_fp8
    assert model.lm_head.weight is model.embed_tokens.weight and model.lm_head.weight.dtype == torch.float32
    other = torch.nn.Bilinear(4, 4, 4)
    assert fp8_head(other) is other


@torch.inference_mode()
def test_quantized_tiny_model_greedy_agrees_with_fp32(make_engine):
    """Agreement stated, over 32 random prompts x 8 greedy tokens against the fp32 model: at least
    75% of the first tokens and 40% of all tokens match, and the last-position logits of one
    prompt are within 20% relative. Observed: 28/32 first tokens, 56% of tokens (with the LM head
    in FP8 too; 29/32 and 59% with it in fp32), logits ~11% (e4m3 per channel: 2.6% relative error
    per projection, compounded over the 8 projections).
    tiny-random's logits are nearly flat (LM head std 0.02), so that error flips greedy picks
    often (bf16 against fp32 here: 100% of first tokens, 92% of tokens); a broken scale or a
    transposed weight gives ~1/512 agreement and O(1) logit errors."""
    ref, tok, cfg = load_model("tiny-random", seed=1234)
    fp8, _, _ = load_model("tiny-random", seed=1234, quantization="fp8")
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, cfg.vocab_size, (24,), generator=gen).tolist() for _ in range(32)]
    reqs = [{"prompt_token_ids": p, "max_tokens": 8, "ignore_eos": True} for p in prompts]
    a = [r["token_ids"] for r in make_engine(ref, tok).generate(reqs)]
    b = [r["token_ids"] for r in make_engine(fp8, tok).generate(reqs)]
    first = sum(x[0] == y[0] for x, y in zip(a, b)) / len(a)
    tokens = sum(s == t for x, y in zip(a, b) for s, t in zip(x, y)) / sum(map(len, a))
    assert first >= 0.75 and tokens >= 0.4, (first, tokens)
    la, lb = (_last_logits(make_engine(m, tok), m, prompts[0]) for m in (ref, fp8))
    assert rel_err(lb, la) < 0.2, rel_err(lb, la)


def _last_logits(e, model, ids):
    e.add_request("x", prompt_token_ids=ids)
    batch = e.runner.prepare(e.scheduler.schedule())
    hidden = model(batch.input_ids, batch.positions, e.kv_cache.tensor, batch.meta)
    e.abort("x")
    return model.compute_logits(hidden)[-1]


@pytest.mark.parametrize("name,params,qkv_bias", [("llama3-70b-random", 70.55e9, False),
                                                  ("qwen2.5-32b-random", 32.76e9, True)])
def test_big_presets_have_the_real_shapes(name, params, qkv_bias):
    """The published parameter counts (Meta-Llama-3-70B 70.55B; Qwen2.5-32B 32.76B), on the meta device."""
    from tandem.engine.config import PRESETS
    from tandem.engine.model import LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(PRESETS[name], max_positions=16)
    count = sum(p.numel() for p in model.parameters())
    assert abs(count / params - 1) < 0.005, count
    assert (model.layers[0].self_attn.qkv_proj.bias is not None) == qkv_bias


_QUANTIZE_PTX = """
import re
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from tandem.engine.kernels.fp8_gemm import _quantize_rows_kernel
sig = {"x_ptr": "*bf16", "q_ptr": "*fp8e4nv", "s_ptr": "*fp32", "stride_x": "i32", "stride_q": "i32", "K": "i32"}
const = dict(FP8_MAX=448.0, FP8_INV_MAX=1 / 448, MIN_SCALE=1e-12, BLOCK=4096)
src = ASTSource(_quantize_rows_kernel, {**sig, **{k: "constexpr" for k in const}}, constexprs=const)
ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}).asm["ptx"]
print(sorted(set(re.findall(r"div\\.[a-z0-9.]+", ptx))))
"""


def test_quantize_rows_divides_as_torch_does_on_hopper():
    """tests/gpu checks quantize_rows bit for bit against torch on random input; Triton's plain `/`
    compiles to div.full.f32 (within 2 ulp), which broke that now and then. Compiled for sm_90 here
    (Triton's own ptxas, no GPU): every division must be IEEE-rounded."""
    import subprocess

    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_DEFAULT_FP_FUSION": "1"}
    done = subprocess.run([sys.executable, "-c", _QUANTIZE_PTX], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "['div.rn.f32']", done.stdout
