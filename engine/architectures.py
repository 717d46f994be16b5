"""The model registry: which Hugging Face architectures serve, what each needs from a checkpoint,
and the refusal of everything else. No torch import (the router reads configs too).

Every family runs on the one decoder of engine.model; an `Architecture` names the switches it
turns on there:

- `LlamaForCausalLM` (Llama 2/3, SmolLM2): the base decoder; Llama-3 and linear rope scaling.
- `MistralForCausalLM`: + sliding-window attention when config.json sets `sliding_window`.
- `Qwen2ForCausalLM` (Qwen2, Qwen2.5): + biases on the q/k/v projections.
- `Qwen3ForCausalLM`: + a per-head RMSNorm on q and on k before rotary; head_dim from the config.
- `Qwen3MoeForCausalLM`: Qwen3's attention, and a mixture of experts (engine.moe: softmax top-k,
  `norm_topk_prob`) as the MLP of every layer that `decoder_sparse_step` / `mlp_only_layers` make sparse.
- `DeepseekV2ForCausalLM`, `DeepseekV3ForCausalLM`: multi-head latent attention (engine.mla; DeepSeek's
  interleaved rope, YaRN scaling) and MoE layers after `first_k_dense_replace` (engine.moe).

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

from tandem.engine.config import MLAConfig, ModelConfig, MoEConfig
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
    mla: bool = False  # multi-head latent attention and DeepSeek's MoE keys (engine.mla, engine.moe)


ARCHITECTURES: dict[str, Architecture] = {a.name: a for a in (
    Architecture("LlamaForCausalLM", "llama", must_be_off=("attention_bias", "mlp_bias")),
    Architecture("MistralForCausalLM", "mistral", sliding_window=True, must_be_off=("attention_bias",)),
    Architecture("Qwen2ForCausalLM", "qwen2", qkv_bias=True, must_be_off=("use_sliding_window",)),
    Architecture("Qwen3ForCausalLM", "qwen3", qk_norm=True,
                 must_be_off=("attention_bias", "use_sliding_window")),
    Architecture("Qwen3MoeForCausalLM", "qwen3_moe", qk_norm=True,
                 must_be_off=("attention_bias", "use_sliding_window", "shared_expert_intermediate_size")),
    Architecture("DeepseekV2ForCausalLM", "deepseek_v2", mla=True, must_be_off=("attention_bias", "mlp_bias")),
    Architecture("DeepseekV3ForCausalLM", "deepseek_v3", mla=True, must_be_off=("attention_bias",)),
)}
ROPE_TYPES = ("default", "linear", "llama3")
# YaRN (DeepSeek): needed keys, then the optional ones carried along
_YARN_ROPE_KEYS = ("factor", "original_max_position_embeddings")
_YARN_OPTIONAL_KEYS = ("mscale", "mscale_all_dim", "beta_fast", "beta_slow", "attention_factor", "truncate")
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
    kinds = ("default", "yarn") if arch.mla else ROPE_TYPES
    if kind not in kinds:
        raise _refuse(source, arch, f"rope_scaling type {kind!r} (implemented: {', '.join(kinds)})")
    if kind == "default":
        return theta, None
    needed = {"llama3": _LLAMA3_ROPE_KEYS, "yarn": _YARN_ROPE_KEYS}.get(kind, ("factor",))
    missing = [k for k in needed if scaling.get(k) is None]
    if missing:
        raise UnsupportedModelError(f"{source}: rope_scaling type {kind!r} lacks {missing}")
    optional = {k: scaling[k] for k in _YARN_OPTIONAL_KEYS if kind == "yarn" and scaling.get(k) is not None}
    return theta, {"rope_type": kind, **{k: scaling[k] for k in needed}, **optional}


def _deepseek_fields(cfg: dict[str, Any], arch: Architecture, source: str) -> dict[str, Any]:
    """ModelConfig fields of a DeepSeek config.json: the latent attention and the MoE layers, refusing
    what transformers' deepseek_v2/v3 would not compute as written."""
    heads = cfg["num_attention_heads"]
    if (cfg.get("num_key_value_heads") or heads) != heads:
        raise _refuse(source, arch, f"num_key_value_heads={cfg['num_key_value_heads']} != num_attention_heads")
    keys = ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
    missing = [k for k in keys if cfg.get(k) is None]
    if missing:
        raise UnsupportedModelError(f"{source}: lacks {missing}")
    mla = MLAConfig(q_lora_rank=cfg.get("q_lora_rank"), **{k: cfg[k] for k in keys},
                    rope_interleave=arch.name == "DeepseekV2ForCausalLM" or cfg.get("rope_interleave", True) is not False)
    if cfg.get("quantization_config"):
        raise _refuse(source, arch, "quantization_config (FP8) with latent attention")
    mtp = (cfg.get("num_nextn_predict_layers") or 0) if arch.name == "DeepseekV3ForCausalLM" else 0
    if not isinstance(mtp, int) or mtp < 0:
        raise UnsupportedModelError(f"{source}: num_nextn_predict_layers must be an int >= 0, got {mtp!r}")
    return {"mla": mla, "moe": _deepseek_moe(cfg, arch, source), "mtp_layers": mtp}


def _deepseek_moe(cfg: dict[str, Any], arch: Architecture, source: str) -> MoEConfig | None:
    layers, first_dense = cfg["num_hidden_layers"], cfg.get("first_k_dense_replace", 0) or 0
    if not cfg.get("n_routed_experts") or first_dense >= layers:
        return None
    if cfg.get("moe_layer_freq", 1) != 1:
        raise _refuse(source, arch, f"moe_layer_freq={cfg['moe_layer_freq']!r} (only 1)")
    v3 = arch.name == "DeepseekV3ForCausalLM"
    scoring = cfg.get("scoring_func") or ("sigmoid" if v3 else "softmax")
    method = cfg.get("topk_method") or ("noaux_tc" if v3 else "greedy")  # transformers' defaults
    # transformers' routers: V2 softmax, greedy or group-limited, no renormalisation; V3 sigmoid noaux_tc
    allowed = {"sigmoid": ("noaux_tc",)} if v3 else {"softmax": ("greedy", "group_limited_greedy")}
    if method not in allowed.get(scoring, ()):
        raise _refuse(source, arch, f"scoring_func={scoring!r} with topk_method={method!r}")
    if not v3 and cfg.get("norm_topk_prob"):
        raise _refuse(source, arch, "norm_topk_prob=true")
    return MoEConfig(
        num_experts=cfg["n_routed_experts"], top_k=cfg["num_experts_per_tok"],
        intermediate_size=cfg["moe_intermediate_size"], num_shared_experts=cfg.get("n_shared_experts") or 0,
        scoring=scoring, topk_method=method, n_group=cfg.get("n_group") or 1, topk_group=cfg.get("topk_group") or 1,
        norm_topk_prob=bool(cfg.get("norm_topk_prob")) and v3,
        routed_scaling_factor=cfg.get("routed_scaling_factor", 1.0), dense_layers=tuple(range(first_dense)))


def _qwen3_moe_fields(cfg: dict[str, Any], arch: Architecture, source: str) -> dict[str, Any]:
    """Qwen3-MoE's experts (transformers 5 writes `num_local_experts` where the Hub's configs say
    `num_experts`); a layer is sparse unless listed in `mlp_only_layers` or off `decoder_sparse_step`."""
    if arch.name != "Qwen3MoeForCausalLM":
        return {}
    missing = [k for k in ("num_experts_per_tok", "moe_intermediate_size") if k not in cfg]
    experts = cfg.get("num_experts", cfg.get("num_local_experts"))
    if missing or experts is None:
        raise UnsupportedModelError(f"{source}: lacks {missing or ['num_experts']}")
    step, dense = cfg.get("decoder_sparse_step", 1) or 1, set(cfg.get("mlp_only_layers") or [])
    dense_layers = tuple(i for i in range(cfg["num_hidden_layers"]) if i in dense or (i + 1) % step)
    return {"moe": MoEConfig(num_experts=experts, top_k=cfg["num_experts_per_tok"],
                             intermediate_size=cfg["moe_intermediate_size"],
                             norm_topk_prob=bool(cfg.get("norm_topk_prob", False)), dense_layers=dense_layers)}


def _refuse_fp8_experts(cfg: dict[str, Any], arch: Architecture, source: str) -> None:
    if any(cfg.get(k) for k in ("num_experts", "num_local_experts", "n_routed_experts")):
        raise _refuse(source, arch, "an FP8 quantization_config with mixture-of-experts layers")


def eos_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, list) else (value,)


def _head_dim(cfg: dict[str, Any], mla: MLAConfig | None) -> int:
    if mla is not None:  # q and k heads (config.json's head_dim is the rope part, as transformers sets it)
        return mla.qk_nope_head_dim + mla.qk_rope_head_dim
    return cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]


def config_from_hf(cfg: dict[str, Any], source: str = "config.json") -> ModelConfig:
    """A Hugging Face config.json dict -> ModelConfig, refusing what the decoder does not implement.
    `source` names the file in error messages."""
    arch = architecture_of(cfg, source)
    _check_features(cfg, arch, source)
    theta, scaling = _rope(cfg, arch, source)
    quant = _quantization(cfg, source)
    if quant is not None:
        _refuse_fp8_experts(cfg, arch, source)
    missing = [k for k in _REQUIRED_KEYS if k not in cfg]
    if missing:
        raise UnsupportedModelError(f"{source}: lacks {missing}")
    heads = cfg["num_attention_heads"]
    window = cfg.get("sliding_window") if arch.sliding_window else None
    try:
        family = _deepseek_fields(cfg, arch, source) if arch.mla else _qwen3_moe_fields(cfg, arch, source)
        return ModelConfig(
            vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"], num_layers=cfg["num_hidden_layers"],
            num_heads=heads, num_kv_heads=heads if arch.mla else cfg.get("num_key_value_heads") or heads,
            head_dim=_head_dim(cfg, family.get("mla")),
            max_position_embeddings=cfg.get("max_position_embeddings", 8192),
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-5), rope_theta=theta, rope_scaling=scaling,
            tie_word_embeddings=cfg.get("tie_word_embeddings", False), bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids(cfg.get("eos_token_id")), architecture=arch.name,
            qkv_bias=arch.qkv_bias, qk_norm=arch.qk_norm, sliding_window=window,
            quant_method=None if quant is None else "fp8", weight_block_size=None if quant is None else quant.block_size,
            **family)
    except (ConfigError, TypeError) as e:  # shapes that do not fit together, or a value of the wrong type
        raise UnsupportedModelError(f"{source}: {e}") from None


def mlp_tensor_shapes(cfg: ModelConfig, layer: int, prefix: str) -> dict[str, tuple[int, ...]]:
    """Layer `layer`'s MLP tensors under `prefix` (`model.layers.{i}.mlp.`): gate/up/down, or the
    router, each routed expert's gate/up/down and the shared experts' (engine.moe.build_mlp)."""
    h, moe = cfg.hidden_size, cfg.moe

    def swiglu(p: str, width: int) -> dict[str, tuple[int, ...]]:
        return {p + "gate_proj.weight": (width, h), p + "up_proj.weight": (width, h), p + "down_proj.weight": (h, width)}

    if moe is None or not moe.is_sparse(layer):
        return swiglu(prefix, cfg.intermediate_size)
    out = {prefix + "gate.weight": (moe.num_experts, h)}
    if moe.uses_score_bias:
        out[prefix + "gate.e_score_correction_bias"] = (moe.num_experts,)
    for e in range(moe.num_experts):
        out.update(swiglu(f"{prefix}experts.{e}.", moe.intermediate_size))
    if moe.num_shared_experts:
        out.update(swiglu(prefix + "shared_experts.", moe.num_shared_experts * moe.intermediate_size))
    return out


def expected_tensors(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the decoder loads for `cfg`, under its Hugging Face name, with its shape."""
    h, d = cfg.hidden_size, cfg.head_dim
    q, kv = cfg.num_heads * d, cfg.num_kv_heads * d
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, h), "model.norm.weight": (h,)}
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = (cfg.vocab_size, h)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        attn = (latent_tensor_shapes(cfg, p + "self_attn.") if cfg.mla is not None else
                {p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                 p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q)})
        out.update(attn)
        out.update({p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,)})
        out.update(mlp_tensor_shapes(cfg, i, p + "mlp."))
        if cfg.qkv_bias:
            out.update({p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                        p + "self_attn.v_proj.bias": (kv,)})
        if cfg.qk_norm:
            out.update({p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,)})
    return out


def latent_tensor_shapes(cfg: ModelConfig, prefix: str) -> dict[str, tuple[int, ...]]:
    """The tensors of one layer's latent attention (engine.mla) under `prefix` ("model.layers.{i}.self_attn.")."""
    m, h, heads = cfg.mla, cfg.hidden_size, cfg.num_heads
    qk = m.qk_nope_head_dim + m.qk_rope_head_dim
    out = ({"q_proj.weight": (heads * qk, h)} if m.q_lora_rank is None else
           {"q_a_proj.weight": (m.q_lora_rank, h), "q_a_layernorm.weight": (m.q_lora_rank,),
            "q_b_proj.weight": (heads * qk, m.q_lora_rank)})
    out.update({"kv_a_proj_with_mqa.weight": (m.latent_dim, h), "kv_a_layernorm.weight": (m.kv_lora_rank,),
                "kv_b_proj.weight": (heads * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank),
                "o_proj.weight": (h, heads * m.v_head_dim)})
    return {prefix + k: v for k, v in out.items()}


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
    # DeepSeek-V3's multi-token-prediction layers follow the decoder's: shipped, not run (unread)
    mtp = tuple(f"model.layers.{i}." for i in range(cfg.num_layers, cfg.num_layers + cfg.mtp_layers))
    for name, (_, file) in sorted(found.items()):
        if name not in expected and not name.endswith(_IGNORED_SUFFIXES) and not name.startswith(mtp):
            hint = " (config.json has tie_word_embeddings true)" if name == "lm_head.weight" else ""
            raise UnsupportedModelError(f"{file}: tensor {name!r} is not used by {cfg.architecture}{hint}")
