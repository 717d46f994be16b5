"""Programmatic dependent launch (engine/kernels/pdl.py) for the small kernels of a decode step.

The USE_PDL branch runs only on a Hopper GPU, never under the interpreter, so each kernel is
compiled here for sm_90 with Triton's own ptxas (no GPU needed): a mistake in that branch fails CI
instead of a GPU run. Before its wait (griddepcontrol.wait) a kernel may read only what the kernel
launched just before it cannot be writing: the PTX is followed from each pointer parameter to the
global loads issued before the wait. On the CPU the launch options never ask for PDL."""

import os
import subprocess
import sys
import threading

import pytest
import torch

_COMPILE = r"""
import re
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from tandem.engine.config import PRESETS
from tandem.engine.kernels import (attention_rope_kv, attention_split, fused, mla_decode, mla_prepare, moe_decode,
                                   moe_route, paged_attention)

POINTERS = {"positions_ptr": "*i64", "slot_ptr": "*i64", "query_start_loc_ptr": "*i32", "seq_lens_ptr": "*i32",
            "block_tables_ptr": "*i32", "tree_mask_ptr": "*i32", "part_out_ptr": "*fp32", "part_ml_ptr": "*fp32",
            "cos_sin_ptr": "*fp32", "counter_ptr": "*i32", "pos_ptr": "*i64", "tables_ptr": "*i32",
            "tok_seq_ptr": "*i32", "kv_len_ptr": "*i32", "acc_ptr": "*fp32", "ml_ptr": "*fp32", "logits_ptr": "*fp32",
            "bias_ptr": "*fp32", "ids_ptr": "*i32", "weights_ptr": "*fp32"}
decode = dict(GROUP=4, BLOCK_G=4, BLOCK_Q=4, HEAD_DIM=128, BLOCK_SIZE=16, BLOCK_N=64, PRECISION="tf32",
              SLIDING=False, TREE=False, ROPE=False, MERGE=False, MTILE=16, EARLY=False)
KERNELS = {
    "rms_norm": (fused._rms_norm_kernel, dict(HIDDEN=4096, BLOCK=4096, HAS_RESIDUAL=True)),
    "silu_and_mul": (fused._silu_and_mul_kernel, dict(INTER=14336, BLOCK=1024)),
    "rotary_write_kv": (attention_rope_kv._rotary_write_kv_kernel,
                        dict(NUM_Q_HEADS=32, NUM_KV_HEADS=8, HALF=64, BLOCK_QH=32, BLOCK_KH=8, BLOCK_HALF=64)),
    "decode": (paged_attention._decode_kernel, dict(decode, SPLIT=True)),
    "decode_whole": (paged_attention._decode_kernel, dict(decode, SPLIT=False)),
    "decode_rope": (paged_attention._decode_kernel, dict(decode, SPLIT=True, ROPE=True)),
    "decode_merge": (paged_attention._decode_kernel, dict(decode, SPLIT=True, ROPE=True, MERGE=True)),
    "decode_early": (paged_attention._decode_kernel, dict(decode, SPLIT=True, ROPE=True, EARLY=True)),
    "reduce_partitions": (paged_attention._reduce_partitions_kernel,
                          dict(GROUP=4, BLOCK_G=4, BLOCK_Q=4, HEAD_DIM=128)),
    "merge_partitions": (attention_split._merge_partitions_kernel, dict(HEAD_DIM=128, TILE=16, EARLY=False)),
    "merge_partitions_early": (attention_split._merge_partitions_kernel, dict(HEAD_DIM=128, TILE=16, EARLY=True)),
}
# DeepSeek-V2-Lite's shapes: latent attention's prepare, decode and merge kernels, the MoE decode launches
prepare = dict(RANK=512, NOPE=128, HALF=32, INTERLEAVE=True, BLOCK_R=512, BLOCK_H=16, HALF_PAD=32)
moe_tile = dict(BLOCK_N=16, BLOCK_K=512, VEC=8, EVEN_K=True)
KERNELS.update({
    "mla_prepare": (mla_prepare._prepare_kernel, prepare),
    "mla_prepare_uk": (mla_prepare._prepare_uk_kernel, dict(prepare, NOPE_PAD=128, BLOCK_UK=64)),
    "mla_partial": (mla_decode._mla_partial_kernel, dict(RANK=512, ROPE=64, SPLITS=32, IEEE=False, BLOCK_HEADS=16,
                                                         BLOCK_N=32, BLOCK_R=512, BLOCK_P=64)),
    "mla_merge": (mla_decode._mla_merge_kernel, dict(RANK=512, SPLITS=32, BLOCK_S=32, BLOCK_R=512, BLOCK_RM=128,
                                                     EARLY=False)),
    "mla_merge_early": (mla_decode._mla_merge_kernel, dict(RANK=512, SPLITS=32, BLOCK_S=32, BLOCK_R=512,
                                                           BLOCK_RM=512, EARLY=True)),
    "mla_uv": (mla_decode._uv_kernel, dict(RANK=512, V=128, BLOCK_V=16, BLOCK_R=512)),
    "mla_merge_uv": (mla_decode._mla_merge_uv_kernel, dict(RANK=512, V=128, SPLITS=32, BLOCK_S=32, BLOCK_R=512,
                                                           CHUNK_R=64, BLOCK_V=32)),
    "moe_router_shared": (moe_decode._router_shared_kernel, dict(moe_tile, NORM=True, BLOCK_H=2048)),
    "moe_routed_gate_up": (moe_decode._routed_gate_up_kernel,
                           dict(moe_tile, **moe_route.route_constants(PRESETS["deepseek-v2-lite-random"].moe))),
    "moe_down_sum": (moe_decode._down_sum_kernel, dict(TOP_K=6, HAS_SHARED=True, BLOCK_N=4, BLOCK_K=512, VEC=8,
                                                       EVEN_I=False, EVEN_I_S=False)),
})
for name, (kernel, const) in KERNELS.items():
    const = {**const, "USE_PDL": True}
    sig = {}
    for arg in kernel.arg_names:
        if arg in const:
            sig[arg] = "constexpr"
        elif arg.endswith("_ptr"):
            sig[arg] = POINTERS.get(arg, "*bf16")
        else:
            sig[arg] = "fp32" if arg in ("eps", "scale_log2", "scale") else "i32"
    ptx = triton.compile(ASTSource(kernel, sig, constexprs=const), target=GPUTarget("cuda", 90, 32),
                         options={"num_warps": 4, "launch_pdl": True}).asm["ptx"]
    body = ptx[ptx.index(".entry"):]
    before = body[:body.index("griddepcontrol.wait")]
    # which pointer parameters reach the address of a global load before the wait: each register
    # is tainted by the parameters its definitions read (PTX before the wait has no loop)
    params = [a for a in kernel.arg_names if sig[a] != "constexpr"]
    taint = {}
    for line in before.splitlines():
        line = line.split("//")[0].strip().lstrip("@!%p0123456789 ")
        regs = re.findall(r"%[a-z]+[0-9]+", line)
        param = re.search(r"_param_([0-9]+)\]", line)
        if line.startswith("ld.global"):
            address = re.search(r"\[([^\]]*)\]", line).group(1)
            for reg in re.findall(r"%[a-z]+[0-9]+", address):
                print(name, "reads", *sorted(taint.get(reg, ())))
        if not regs:
            continue
        if line.startswith("ld.global"):
            continue  # a loaded value is data, not an address of the same provenance
        sources = set().union(*(taint.get(r, set()) for r in regs[1:]))
        if param and sig[params[int(param.group(1))]].startswith("*"):
            sources.add(params[int(param.group(1))])
        taint[regs[0]] = taint.get(regs[0], set()) | sources
    print(name, "launches_dependents", "griddepcontrol.launch_dependents" in body)
    print(name, "releases_before_wait", "griddepcontrol.launch_dependents" in before)
"""

# what each kernel may read before its PDL wait: the host's metadata and the rotary table; never
# the outputs of the kernel before it (q, the new k and v, the split launch's partial states)
_BEFORE_WAIT = {
    "decode": {"seq_lens_ptr", "query_start_loc_ptr"},
    "merge_partitions": {"seq_lens_ptr", "query_start_loc_ptr"},
}
_BEFORE_WAIT["merge_partitions_early"] = _BEFORE_WAIT["merge_partitions"]
_BEFORE_WAIT.update(decode_whole=_BEFORE_WAIT["decode"], decode_merge=_BEFORE_WAIT["decode"] | {
    "positions_ptr", "cos_sin_ptr", "slot_ptr"})
_BEFORE_WAIT["decode_rope"] = _BEFORE_WAIT["decode_early"] = _BEFORE_WAIT["decode_merge"]
# weights, which no kernel writes: W_UK's slice, the router's and the shared experts' first tile
_BEFORE_WAIT.update(mla_prepare_uk={"w_ptr"}, mla_uv={"w_ptr"}, moe_router_shared={"wr_ptr", "ws_ptr"})


def test_small_kernels_compile_for_hopper_with_pdl_and_wait_before_loading():
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_DEFAULT_FP_FUSION": "1"}
    done = subprocess.run([sys.executable, "-c", _COMPILE], env=env, capture_output=True, text=True, timeout=600)
    if "ptxas" in done.stderr and "not found" in done.stderr:
        pytest.fail(f"Triton's ptxas is missing: {done.stderr[-500:]}")
    assert done.returncode == 0, done.stderr[-3000:]
    launches, early, reads = {}, {}, {}
    for line in done.stdout.strip().splitlines():
        name, what, *rest = line.split()
        if what == "launches_dependents":
            launches[name] = rest == ["True"]
        elif what == "releases_before_wait":
            early[name] = rest == ["True"]
        else:
            reads.setdefault(name, set()).update(rest)
    assert launches == dict.fromkeys(("rms_norm", "silu_and_mul", "rotary_write_kv", "decode", "decode_whole",
                                      "decode_rope", "decode_merge", "reduce_partitions", "merge_partitions",
                                      "merge_partitions_early", "decode_early", "mla_prepare", "mla_prepare_uk",
                                      "mla_partial", "mla_merge", "mla_merge_early", "mla_uv", "mla_merge_uv",
                                      "moe_router_shared",
                                      "moe_routed_gate_up", "moe_down_sum"), True)
    # only the kernels asked to (SplitPolicy.early_release, paged_attention.EARLY_RELEASE, the latent
    # merges before W_UV's launch or with W_UV) let the next kernel start before their wait
    assert {name for name, yes in early.items() if yes} == {"merge_partitions_early", "decode_early",
                                                             "mla_merge_early", "mla_merge_uv"}, early
    for name in launches:  # nothing the kernel before may be writing is read before the wait
        assert reads.get(name, set()) <= _BEFORE_WAIT.get(name, set()), (name, reads.get(name))
    # and the decode kernel's metadata and rotary angles are in flight before it
    assert {"seq_lens_ptr", "query_start_loc_ptr"} <= reads["decode"], reads["decode"]
    assert {"cos_sin_ptr", "positions_ptr", "slot_ptr"} <= reads["decode_rope"], reads["decode_rope"]
    # and the weight tiles that stream before the wait do (the MoE launch's router branch: the PTX up to
    # the first wait; its shared-experts branch runs the same _dot_rows)
    assert reads["mla_prepare_uk"] == reads["mla_uv"] == {"w_ptr"} and "wr_ptr" in reads["moe_router_shared"], reads


def test_launch_options(monkeypatch):
    from tandem.engine.kernels import pdl

    assert pdl.ENABLED is {"1": True, "0": False}.get(os.environ.get("TANDEM_PDL", ""))  # None: per model
    monkeypatch.setattr(pdl, "ENABLED", None)
    monkeypatch.setattr(pdl, "supported", lambda device: True)
    cpu = torch.device("cpu")
    assert pdl.launch_options(cpu) == {"USE_PDL": False}  # off outside a forward that asks for it
    with pdl.auto(True):
        assert pdl.launch_options(cpu) == {"USE_PDL": True, "launch_pdl": True}
        with pdl.auto(False):
            assert pdl.launch_options(cpu) == {"USE_PDL": False}
        assert pdl.on()
    assert not pdl.on()
    seen = []  # another thread's forward does not see this one's choice
    with pdl.auto(True):
        t = threading.Thread(target=lambda: seen.append(pdl.on()))
        t.start()
        t.join()
    assert seen == [False]
    monkeypatch.setattr(pdl, "ENABLED", False)  # set: it wins over the forward's choice
    with pdl.auto(True):
        assert pdl.launch_options(cpu) == {"USE_PDL": False}
    monkeypatch.undo()
    monkeypatch.setattr(pdl, "ENABLED", True)
    assert pdl.launch_options(torch.device("cpu")) == {"USE_PDL": False}  # never off Hopper
    monkeypatch.setattr(pdl, "supported", lambda device: True)
    assert pdl.launch_options(torch.device("cpu")) == {"USE_PDL": True, "launch_pdl": True}
    assert pdl.launch_options(torch.device("cpu"), allowed=False) == {"USE_PDL": False}  # the kernel's own switch
    monkeypatch.setattr(pdl, "ENABLED", False)
    assert pdl.launch_options(torch.device("cpu")) == {"USE_PDL": False}


def test_gemv_modes_by_weight_kind(monkeypatch):
    """On Hopper a model-dtype GEMV prefetches its first tile before it waits; an FP8 one too,
    but only where the small kernels before it are PDL launches (docs/benchmarks.md: after plain
    launches it lost)."""
    from tandem.engine.kernels import gemv, pdl

    monkeypatch.setattr(pdl, "supported", lambda device: True)
    dev = torch.device("cpu")
    monkeypatch.setattr(pdl, "ENABLED", True)
    assert gemv._pdl(dev, torch.bfloat16) == 2 and gemv._pdl(dev, torch.float8_e4m3fn) == 2
    monkeypatch.setattr(pdl, "ENABLED", False)
    assert gemv._pdl(dev, torch.bfloat16) == 2 and gemv._pdl(dev, torch.float8_e4m3fn) == 0
    monkeypatch.setattr(gemv, "PDL_FP8", "wait")
    assert gemv._pdl(dev, torch.float8_e4m3fn) == 1
    monkeypatch.setattr(pdl, "supported", lambda device: False)
    assert gemv._pdl(dev, torch.bfloat16) == 0
