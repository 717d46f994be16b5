"""The model registry: which Hugging Face architectures serve, what each needs from a checkpoint,
and the refusal of everything else. No torch import (the router reads configs too).

Every family runs on the one decoder of engine.model; an `Architecture` names the switches it
turns on there:

- `LlamaForCausalLM` (Llama 2/3, SmolLM2): the base decoder; Llama-3 and linear rope scaling.
- `MistralForCausalLM`: + sliding-window attention when config.json sets `sliding_window`.
- `Qwen2ForCausalLM` (Qwen2, Qwen2.5): + biases on the q/k/v projections.
- `Qwen3ForCausalLM`: + a per-head RMSNorm on q and on k before rotary; head_dim from the config.

`config_from_hf` turns a config.json dict into a `ModelConfig` (`ModelConfig.to_hf` is its
inverse) and `expected_tensors` lists the
tensors (name -> shape) the decoder loads for it. Anything the decoder would otherwise compute
wrongly in silence (another architecture, an unimplemented config value, a tensor it does not use
or lacks) raises `UnsupportedModelError`, whose message names the thing and the file: a model
either serves the tokens transformers would produce, or does not load.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tandem.engine.config import ModelConfig
from tandem.engine.quant.scheme import FP8Scheme, QuantConfigError, fp8_scheme
from tandem.wire.errors import ConfigError


class UnsupportedModelError(ValueError):
    """A checkpoint this engine cannot serve faithfully; the message names the thing and the file."""


@dataclass(frozen=True)
class Architecture:
    name: str  # config.json "architectures"[0]
    model_type: str
    qkv_bias: bool = False  # biases on q/k/v (never on o_proj)
    qk_norm: bool = False  # per-head RMSNorm of q and k before rotary
    sliding_window: bool = False  # honours config.json's `sliding_window`
    # config keys this family reads as "off"; true there means a feature the decoder lacks
    must_be_off: tuple[str, ...] = ()


ARCHITECTURES: dict[str, Architecture] = {a.name: a for a in (
    Architecture("LlamaForCausalLM", "llama", must_be_off=("attention_bias", "mlp_bias")),
    Architecture("MistralForCausalLM", "mistral", sliding_window=True, must_be_off=("attention_bias",)),
    Architecture("Qwen2ForCausalLM", "qwen2", qkv_bias=True, must_be_off=("use_sliding_window",)),
    Architecture("Qwen3ForCausalLM", "qwen3", qk_norm=True,
                 must_be_off=("attention_bias", "use_sliding_window")),
)}
ROPE_TYPES = ("default", "linear", "llama3")
_LLAMA3_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
# checkpoint tensors transformers itself drops on load (old Llama exports carry rotary buffers)
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)
_REQUIRED_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


def architecture_of(cfg: dict[str, Any], source: str) -> Architecture:
    names = cfg.get("architectures")
    if not isinstance(names, list) or len(names) != 1:
        raise UnsupportedModelError(f"{source}: 'architectures' must name one architecture, got {names!r} "
                                    f"(supported: {', '.join(ARCHITECTURES)})")
    arch = ARCHITECTURES.get(names[0])
    if arch is None:
        raise UnsupportedModelError(f"{source}: architecture {names[0]!r} is not supported "
                                    f"(supported: {', '.join(ARCHITECTURES)})")
    return arch


def _refuse(source: str, arch: Architecture, what: str) -> UnsupportedModelError:
    return UnsupportedModelError(f"{source}: {what} is not implemented for {arch.name}")


def _check_features(cfg: dict[str, Any], arch: Architecture, source: str) -> None:
    for key in arch.must_be_off:
        if cfg.get(key):
            raise _refuse(source, arch, f"{key}={cfg[key]!r}")
    if cfg.get("hidden_act", "silu") != "silu":
        raise _refuse(source, arch, f"hidden_act={cfg['hidden_act']!r} (only silu)")
    # one kind of attention in every layer: sliding where the family and config set a window
    windowed = arch.sliding_window and cfg.get("sliding_window") is not None
    other = sorted(set(cfg.get("layer_types") or []) - {"sliding_attention" if windowed else "full_attention"})
    if other:
        raise _refuse(source, arch, f"layer_types {other}")
    for key in ("partial_rotary_factor",):
        if cfg.get(key, 1.0) != 1.0:
            raise _refuse(source, arch, f"{key}={cfg[key]!r}")


def _quantization(cfg: dict[str, Any], source: str) -> FP8Scheme | None:
    if not cfg.get("quantization_config"):
        return None
    try:
        return fp8_scheme(cfg["quantization_config"])
    except QuantConfigError as e:
        raise UnsupportedModelError(f"{source}: {e}") from None


def _rope(cfg: dict[str, Any], arch: Architecture, source: str) -> tuple[float, dict[str, Any] | None]:
    """-> (rope_theta, rope_scaling or None). Reads both layouts: `rope_theta` + `rope_scaling`
    (checkpoints on the Hub) and transformers 5's `rope_parameters` (theta inside)."""
    params = dict(cfg.get("rope_parameters") or {})
    theta = float(params.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
    scaling = dict(cfg.get("rope_scaling") or params)
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise _refuse(source, arch, f"rope_scaling type {kind!r} (implemented: {', '.join(ROPE_TYPES)})")
    if kind == "default":
        return theta, None
    needed = _LLAMA3_ROPE_KEYS if kind == "llama3" else ("factor",)
    missing = [k for k in needed if k not in scaling]
    if missing:
        raise UnsupportedModelError(f"{source}: rope_scaling type {kind!r} lacks {missing}")
    return theta, {"rope_type": kind, **{k: scaling[k] for k in needed}}


def eos_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, list) else (value,)


def config_from_hf(cfg: dict[str, Any], source: str = "config.json") -> ModelConfig:
    """A Hugging Face config.json dict -> ModelConfig, refusing what the decoder does not implement.
    `source` names the file in error messages."""
    arch = architecture_of(cfg, source)
    _check_features(cfg, arch, source)
    theta, scaling = _rope(cfg, arch, source)
    quant = _quantization(cfg, source)
    missing = [k for k in _REQUIRED_KEYS if k not in cfg]
    if missing:
        raise UnsupportedModelError(f"{source}: lacks {missing}")
    heads = cfg["num_attention_heads"]
    window = cfg.get("sliding_window") if arch.sliding_window else None
    try:
        return ModelConfig(
            vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"], num_layers=cfg["num_hidden_layers"],
            num_heads=heads, num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            max_position_embeddings=cfg.get("max_position_embeddings", 8192),
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-5), rope_theta=theta, rope_scaling=scaling,
            tie_word_embeddings=cfg.get("tie_word_embeddings", False), bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids(cfg.get("eos_token_id")), architecture=arch.name,
            qkv_bias=arch.qkv_bias, qk_norm=arch.qk_norm, sliding_window=window,
            quant_method=None if quant is None else "fp8", weight_block_size=None if quant is None else quant.block_size)
    except (ConfigError, TypeError) as e:  # shapes that do not fit together, or a value of the wrong type
        raise UnsupportedModelError(f"{source}: {e}") from None


def expected_tensors(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the decoder loads for `cfg`, under its Hugging Face name, with its shape."""
    h, d = cfg.hidden_size, cfg.head_dim
    q, kv = cfg.num_heads * d, cfg.num_kv_heads * d
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, h), "model.norm.weight": (h,)}
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = (cfg.vocab_size, h)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        out.update({p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                    p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
                    p + "mlp.gate_proj.weight": (cfg.intermediate_size, h),
                    p + "mlp.up_proj.weight": (cfg.intermediate_size, h),
                    p + "mlp.down_proj.weight": (h, cfg.intermediate_size),
                    p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,)})
        if cfg.qkv_bias:
            out.update({p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                        p + "self_attn.v_proj.bias": (kv,)})
        if cfg.qk_norm:
            out.update({p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,)})
    return out


def check_tensors(cfg: ModelConfig, found: dict[str, tuple[tuple[int, ...], str]]) -> None:
    """`found`: name -> (shape, file) of every tensor in the checkpoint. Raises on the first tensor
    the decoder lacks, does not use, or would load with another shape."""
    expected = expected_tensors(cfg)
    files = sorted({f for _, f in found.values()}) or ["the checkpoint"]
    for name, shape in expected.items():
        if name not in found:
            hint = " (config.json has tie_word_embeddings false)" if name == "lm_head.weight" else ""
            raise UnsupportedModelError(f"{', '.join(files)}: tensor {name!r} that {cfg.architecture} needs "
                                        f"is missing{hint}")
        got, file = found[name]
        if tuple(got) != shape:
            raise UnsupportedModelError(f"{file}: tensor {name!r} has shape {list(got)}, "
                                        f"{cfg.architecture} with this config.json needs {list(shape)}")
    for name, (_, file) in sorted(found.items()):
        if name not in expected and not name.endswith(_IGNORED_SUFFIXES):
            hint = " (config.json has tie_word_embeddings true)" if name == "lm_head.weight" else ""
            raise UnsupportedModelError(f"{file}: tensor {name!r} is not used by {cfg.architecture}{hint}")
