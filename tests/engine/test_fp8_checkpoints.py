"""FP8 checkpoints in the common safetensors layouts, written here from transformers' tiny models:
per-tensor `weight_scale` (AutoFP8 / llm-compressor / vLLM exports), per-channel `weight_scale`
[N, 1], and DeepSeek/Qwen's `weight_block_size: [128, 128]` with `weight_scale_inv`. Each loads
into FP8 layers whose dequantized weights equal what was written exactly, and serves the tokens
transformers computes from those dequantized weights; what is not implemented is refused by name."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from tandem.engine.architectures import UnsupportedModelError
from tandem.engine.quant.checkpoint import PROJECTIONS
from tandem.engine.quant.fp8 import FP8_DTYPE, FP8_MAX, dequantize_fp8
from tandem.engine.weights import hf_state_dict, load_model

from tests.engine.families import build_family_dir, hf_greedy

BLOCK = 128


def _quantize(w: torch.Tensor, layout: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> (e4m3 weight, the scale tensor as the layout stores it, the dequantized weight)."""
    if layout == "tensor":
        scale = w.abs().max() / FP8_MAX
        expanded = scale.expand(w.shape[0], 1)
    elif layout == "channel":
        scale = expanded = w.abs().amax(1, keepdim=True) / FP8_MAX
    else:  # [128, 128] blocks: scale [ceil(N / 128), ceil(K / 128)]
        n, k = w.shape
        pad = torch.zeros(-(-n // BLOCK) * BLOCK, -(-k // BLOCK) * BLOCK)
        pad[:n, :k] = w.abs()
        scale = pad.view(pad.shape[0] // BLOCK, BLOCK, -1, BLOCK).amax((1, 3)) / FP8_MAX
        expanded = scale.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)[:n, :k]
    q = (w / expanded).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale.float().contiguous(), q.float() * expanded


def write_fp8_dir(src: Path, dst: Path, layout: str, ignored: tuple[str, ...] = ()):
    """A copy of HF directory `src` with its projections in FP8 (`layout`: tensor, channel, block),
    but those whose names contain one of `ignored`; -> {projection weight name: dequantized}."""
    shutil.copytree(src, dst)
    tensors, deq = load_file(str(src / "model.safetensors")), {}
    for name in list(tensors):
        stem = name.removesuffix(".weight")
        if not stem.endswith(PROJECTIONS) or name == stem or any(i in name for i in ignored):
            continue
        q, scale, deq[name] = _quantize(tensors[name], layout)
        tensors[name] = q
        tensors[stem + (".weight_scale_inv" if layout == "block" else ".weight_scale")] = scale
    save_file(tensors, str(dst / "model.safetensors"))
    qcfg = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    if layout == "block":
        qcfg["weight_block_size"] = [BLOCK, BLOCK]
    if ignored:
        qcfg["ignored_layers"] = list(ignored)
    _edit_config(dst, quantization_config=qcfg)
    return deq


def _edit_config(path: Path, **changes) -> None:
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, **changes}))


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """{family: directory} for llama (Llama-3 rope) and qwen2 (q/k/v biases, tied embeddings)."""
    root = tmp_path_factory.mktemp("fp8-src")
    for f in ("llama", "qwen2"):
        build_family_dir(f, root / f, seed=3)
    return {f: root / f for f in ("llama", "qwen2")}


@pytest.mark.parametrize("family,layout", [("llama", "tensor"), ("llama", "channel"), ("qwen2", "block"),
                                           ("llama", "block")])
@torch.inference_mode()
def test_fp8_checkpoint_loads_exactly_and_serves_transformers_tokens(plain, tmp_path, family, layout):
    src = plain[family]
    deq = write_fp8_dir(src, tmp_path / "fp8", layout)
    model, tok, cfg = load_model(str(tmp_path / "fp8"))
    assert cfg.quant_method == "fp8" and cfg.weight_block_size == ((BLOCK, BLOCK) if layout == "block" else None)
    layer = model.layers[0]
    lin = layer.self_attn.qkv_proj
    assert lin.is_fp8 and lin.group_k == (BLOCK if layout == "block" else 0)
    assert model.lm_head.weight.dtype == model.embed_tokens.weight.dtype == torch.float32
    # every projection, dequantized, is exactly the weight the checkpoint encodes
    ours = {}
    for i, layer in enumerate(model.layers):
        for lin, rows in ((layer.self_attn.qkv_proj, "qkv"), (layer.self_attn.o_proj, "o"),
                          (layer.mlp.gate_up_proj, "gate_up"), (layer.mlp.down_proj, "down")):
            w = dequantize_fp8(lin.weight, lin.weight_scale, lin.group_k)
            names = {"qkv": ["q_proj", "k_proj", "v_proj"], "o": ["o_proj"], "gate_up": ["gate_proj", "up_proj"],
                     "down": ["down_proj"]}[rows]
            sizes = [deq[f"model.layers.{i}.{'self_attn' if rows in ('qkv', 'o') else 'mlp'}.{n}.weight"].shape[0]
                     for n in names]
            for n, part in zip(names, w.split(sizes)):
                ours[f"model.layers.{i}.{'self_attn' if rows in ('qkv', 'o') else 'mlp'}.{n}.weight"] = part
    assert ours.keys() == deq.keys()
    for name, w in deq.items():
        assert torch.equal(ours[name], w), name
    # transformers on the dequantized weights (the rest of the checkpoint as is) gives the same tokens
    hf = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32).eval()
    for name, p in hf.named_parameters():
        if name in deq:
            p.copy_(deq[name])
    ids = tok.encode("def f(x):\n    return")
    got = _engine(model, tok).generate([{"prompt_token_ids": ids, "max_tokens": 12}])[0]["token_ids"]
    assert got == hf_greedy(hf, ids, 12, eos=list(cfg.eos_token_ids))


def _engine(model, tok):
    from tandem.engine.config import CacheConfig, EngineConfig
    from tandem.engine.engine import LLMEngine

    return LLMEngine(EngineConfig(model="t", cache=CacheConfig(num_blocks=64)), model=model, tokenizer=tok)


@torch.inference_mode()
def test_ignored_layers_stay_unquantized_and_quantize_at_load_on_request(plain, tmp_path):
    src = plain["llama"]
    write_fp8_dir(src, tmp_path / "fp8", "channel", ignored=("mlp.down_proj",))
    model, _, _ = load_model(str(tmp_path / "fp8"))
    assert model.layers[0].self_attn.qkv_proj.is_fp8 and not model.layers[0].mlp.down_proj.is_fp8
    want = load_file(str(src / "model.safetensors"))["model.layers.1.mlp.down_proj.weight"]
    assert torch.equal(hf_state_dict(model)["model.layers.1.mlp.down_proj.weight"], want)
    model, _, _ = load_model(str(tmp_path / "fp8"), quantization="fp8")
    assert model.layers[0].mlp.down_proj.is_fp8
    model, _, _ = load_model(str(src), quantization="fp8")  # an unquantized checkpoint, quantized at load
    assert all(layer.mlp.gate_up_proj.is_fp8 for layer in model.layers)


def _refusal(path: Path, edit) -> str:
    edit(path)
    with pytest.raises(UnsupportedModelError) as e:
        load_model(str(path))
    return str(e.value)


def _add(path: Path, **extra) -> None:
    tensors = load_file(str(path / "model.safetensors"))
    save_file({**tensors, **extra}, str(path / "model.safetensors"))


@pytest.mark.parametrize("case,edit,needle", [
    ("compressed-tensors", lambda p: _edit_config(p, quantization_config={"quant_method": "compressed-tensors"}),
     "quant_method 'compressed-tensors' is not supported"),
    ("static", lambda p: _edit_config(p, quantization_config={"quant_method": "fp8", "activation_scheme": "static"}),
     "activation_scheme 'static' (static activation scales) is not implemented"),
    ("block-64", lambda p: _edit_config(p, quantization_config={"quant_method": "fp8", "weight_block_size": [64, 64]}),
     "weight_block_size [64, 64] is not implemented"),
    ("input-scale", lambda p: _add(p, **{"model.layers.0.self_attn.q_proj.input_scale": torch.ones(())}),
     "'model.layers.0.self_attn.q_proj.input_scale': static activation scales"),
    ("scale-shape", lambda p: _add(p, **{"model.layers.0.mlp.up_proj.weight_scale": torch.ones(3)}),
     "'model.layers.0.mlp.up_proj.weight_scale' has shape [3]"),
    ("head-scale", lambda p: _add(p, **{"lm_head.weight_scale": torch.ones(())}),
     "'lm_head.weight_scale' scales no FP8 projection"),
])
def test_unsupported_fp8_checkpoints_are_refused_by_name(plain, tmp_path, case, edit, needle):
    write_fp8_dir(plain["llama"], tmp_path / case, "channel")
    msg = _refusal(tmp_path / case, edit)
    assert needle in msg and (str(tmp_path / case) in msg), msg


def test_fp8_weights_without_a_quantization_config_are_refused(plain, tmp_path):
    path = tmp_path / "noconfig"
    write_fp8_dir(plain["llama"], path, "channel")
    tensors = {k: v for k, v in load_file(str(path / "model.safetensors")).items() if "scale" not in k}
    save_file(tensors, str(path / "model.safetensors"))
    msg = _refusal(path, lambda p: _edit_config(p, quantization_config=None))
    assert "is float8 but config.json has no fp8 quantization_config" in msg, msg
