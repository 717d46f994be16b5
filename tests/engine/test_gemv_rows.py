"""The GEMV of a few tokens (engine/kernels/gemv_rows.py) under Triton's interpreter, against a
float64 matmul: model-dtype and FP8 weights (per channel and block scales), bias, 2-8 rows of x
(and odd counts that pad the row block), K tiles that do not divide K, and bad input refused by
name; and the Hopper (PDL) variant compiled for sm_90 on the CPU. Tolerances as test_gemv.py's."""

import os
import sys

import torch

if not torch.cuda.is_available() and "TRITON_INTERPRET" not in os.environ:
    if "triton" in sys.modules:
        raise RuntimeError("triton was imported before TRITON_INTERPRET=1 was set (see test_kernels.py)")
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

from tandem.engine.kernels import triton_available  # noqa: E402

if not triton_available():
    pytest.fail("Triton is not installed, or there is no CUDA and TRITON_INTERPRET is off", pytrace=False)

from tandem.engine.kernels import gemv_rows as rows_mod  # noqa: E402
from tandem.engine.kernels.gemv_rows import RowsConfig, gemv_rows  # noqa: E402
from tests.engine.test_gemv import DEVICE, _greedy, rel_err, tol, weights  # noqa: E402

# 64 does not divide K = 96 or 160; one and two warps; block_k 32 divides the block scales' 32
TILES = (RowsConfig(4, 32, 1, 2), RowsConfig(8, 64, 2, 1), RowsConfig(2, 32, 1, 1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["model", "fp8", "fp8-block"])
@pytest.mark.parametrize("m,k,bias", [(2, 96, False), (3, 160, True), (8, 96, True)])
def test_gemv_rows_matches_torch(dtype, kind, m, k, bias):
    gen = torch.Generator().manual_seed(k + m + len(kind))
    n = 24
    w, scale, group_k, ref_w = weights(kind, n, k, gen, dtype)
    x = torch.randn(m, k, generator=gen).to(dtype).to(DEVICE)
    b = torch.randn(n, generator=gen).to(dtype).to(DEVICE) if bias else None
    ref = x.double() @ ref_w.T + (0 if b is None else b.double())
    for cfg in (TILES[:2] if group_k != 32 else (TILES[0], TILES[2])):
        out = gemv_rows(x, w, scale, b, group_k=group_k, config=cfg)
        assert out.dtype == dtype and out.shape == (m, n)
        for i in range(m):  # every row, so a row computed from another's x shows
            assert rel_err(out[i], ref[i]) < tol(dtype), (cfg, i)


def test_rows_of_a_strided_batch_and_the_default_config():
    gen = torch.Generator().manual_seed(3)
    w, scale, _, ref_w = weights("fp8", 40, 96, gen, torch.float32)
    big = torch.randn(5, 200, generator=gen).to(DEVICE)
    x = big[:, 10:106]  # rows 200 apart
    out = gemv_rows(x, w, scale)
    assert rel_err(out, x.double() @ ref_w.T) < 1e-5


def test_bad_input_is_refused_by_name():
    w = torch.randn(8, 32, device=DEVICE)
    with pytest.raises(ValueError, match="2 to 8 rows"):
        gemv_rows(torch.randn(9, 32, device=DEVICE), w)
    with pytest.raises(ValueError, match="contiguous in its last dim"):
        gemv_rows(torch.randn(32, 4, device=DEVICE).T, w)
    with pytest.raises(ValueError, match="columns"):
        gemv_rows(torch.randn(4, 16, device=DEVICE), w)
    with pytest.raises(ValueError, match="block_k 64 must divide group_k 32"):
        q, s = torch.zeros(8, 64, dtype=torch.float8_e4m3fn, device=DEVICE), torch.ones(8, 2, device=DEVICE)
        gemv_rows(torch.randn(2, 64, device=DEVICE), q, s, group_k=32, config=RowsConfig(4, 64, 1, 1))


def test_takes_only_the_measured_row_counts(monkeypatch):
    bf16, fp8 = torch.empty(64, 64, dtype=torch.bfloat16), torch.empty(64, 64, dtype=torch.float8_e4m3fn)
    monkeypatch.setattr(rows_mod, "ROWS", {("fp8", 64, 64): 4, ("16bit", 32, 64): 2})
    monkeypatch.setattr(rows_mod, "ROWS_DEFAULT", {"fp8": 2})
    assert rows_mod.takes(fp8, 2) and rows_mod.takes(fp8, 4)  # the shape's entry
    assert not rows_mod.takes(fp8, 1) and not rows_mod.takes(fp8, 5)  # one row: gemv's; 5: the GEMM's
    other = torch.empty(96, 64, dtype=torch.float8_e4m3fn)
    assert rows_mod.takes(other, 2) and not rows_mod.takes(other, 3)  # the kind's default
    assert not rows_mod.takes(bf16, 2)  # no entry for this 16-bit shape, no 16-bit default
    assert rows_mod.takes(torch.empty(32, 64, dtype=torch.bfloat16), 2)
    assert not rows_mod.takes(torch.empty(64, 64, dtype=torch.int8), 2)
    # the committed table: llama3-8b's FP8 projections, where they won on the H200
    monkeypatch.undo()
    assert rows_mod.takes(torch.empty(4096, 14336, dtype=torch.float8_e4m3fn), 4)
    assert not rows_mod.takes(torch.empty(28672, 4096, dtype=torch.float8_e4m3fn), 3)
    assert not rows_mod.takes(torch.empty(6144, 4096, dtype=torch.bfloat16), 2)


@pytest.mark.parametrize("quantization", [None, "fp8"])
@torch.inference_mode()
def test_two_sequence_steps_take_it_and_keep_the_tokens(make_engine, monkeypatch, quantization):
    """Two sequences decoding together (steps of T = 2) with TritonOps: every projection of those
    steps runs here (16-bit through TritonOps.linear, FP8 through fp8_gemm; the tiny model's shapes
    enabled by kind), and the greedy tokens are the plain torch path's."""
    import copy

    from tandem.engine.model import TritonOps
    from tandem.engine.weights import load_model

    model, tok, cfg = load_model("tiny-random", seed=1234, quantization=quantization)
    two = [list(range(7, 30)), list(range(40, 20, -1))]
    ref = _greedy(make_engine, model, tok, two, max_tokens=3)
    fused = copy.deepcopy(model)
    fused.ops = TritonOps()
    monkeypatch.setattr(rows_mod, "ROWS_DEFAULT", {"fp8": 2, "fp32": 2})
    rows = []
    real = rows_mod.gemv_rows
    monkeypatch.setattr(rows_mod, "gemv_rows", lambda x, *a, **kw: rows.append(x.shape[0]) or real(x, *a, **kw))
    assert _greedy(make_engine, fused, tok, two, max_tokens=3) == ref
    # two decode steps (the first token comes from the prompts' step), four projections a layer
    assert set(rows) == {2} and len(rows) >= 2 * 4 * cfg.num_layers, len(rows)


_HOPPER_COMPILE = r"""
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from tandem.engine.kernels.gemv_rows import _gemv_rows_kernel as k
# each weight type and each PDL mode once (every pair: twice the compile time, 40 s more on CPU)
for wdt, pdl in (("*fp8e4nv", 1), ("*bf16", 2)):
    const = dict(SCALED=wdt == "*fp8e4nv", GROUP_K=0, HAS_BIAS=True, BLOCK_M=8, BLOCK_N=4, BLOCK_K=512, VEC=16,
                 EVEN_K=True, USE_PDL=pdl)
    sig = {a: "constexpr" if a in const else ("*bf16" if a != "w_ptr" else wdt) if a.endswith("_ptr") else "i32"
           for a in k.arg_names}
    sig["s_ptr"] = "*fp32"
    c = triton.compile(ASTSource(k, sig, constexprs=const), target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": 1, "launch_pdl": True})
    assert "griddepcontrol.wait" in c.asm["ptx"] and "griddepcontrol.launch_dependents" in c.asm["ptx"]
print("compiled")
"""


def test_the_dependent_launch_variant_compiles_for_hopper():
    import subprocess

    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_DEFAULT_FP_FUSION": "1"}
    done = subprocess.run([sys.executable, "-c", _HOPPER_COMPILE], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0 and "compiled" in done.stdout, done.stderr[-2000:]
