"""Engine configuration: frozen dataclasses validated on construction; no torch import.

`ModelConfig` is the architecture (what a checkpoint's config.json says); `CacheConfig`,
`SchedulerConfig`, `SpeculativeConfig` and `EngineConfig` are the deployment's knobs. Presets for
the `*-random` models live here so every process agrees on their shapes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tandem.wire.errors import ConfigError


@dataclass(frozen=True)
class MLAConfig:
    """Multi-head latent attention (DeepSeek-V2/V3, engine.mla): q through a low-rank bottleneck
    (`q_lora_rank`) or directly (None, as V2-Lite); K and V from one compressed latent per token
    (`kv_lora_rank`) plus one rope key shared by all heads (`qk_rope_head_dim`), which is all the
    paged cache holds."""
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool = True  # DeepSeek's rope pairs (x0, x1), (x2, x3), ...; False: rotate-half

    def __post_init__(self) -> None:
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            if getattr(self, name) < 1:
                raise ConfigError(f"model config: mla.{name} must be >= 1, got {getattr(self, name)}")
        if self.q_lora_rank is not None and self.q_lora_rank < 1:
            raise ConfigError(f"model config: mla.q_lora_rank must be >= 1 or null, got {self.q_lora_rank}")
        if self.qk_rope_head_dim % 2:
            raise ConfigError(f"model config: mla.qk_rope_head_dim must be even, got {self.qk_rope_head_dim}")

    @property
    def latent_dim(self) -> int:
        """Elements per token per layer in the cache: the latent and the rope key."""
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True)
class MoEConfig:
    """Mixture-of-experts MLPs (engine.moe): each token's `top_k` of `num_experts` routed experts
    (each a SiLU MLP of width `intermediate_size`), weighted by the router, plus `num_shared_experts`
    always-on experts fused into one MLP of `num_shared_experts * intermediate_size` (DeepSeek).

    Routing: `scoring` softmax (Qwen3-MoE, DeepSeek-V2) or sigmoid (DeepSeek-V3); `topk_method`
    greedy (plain top-k), group_limited_greedy (V2: top-k inside the `topk_group` of `n_group` groups
    with the highest best score) or noaux_tc (V3: groups ranked by the sum of their two best
    bias-corrected scores, experts chosen on the corrected scores and weighted by the raw ones);
    `norm_topk_prob` renormalises the chosen weights to sum to one, then all are multiplied by
    `routed_scaling_factor`. `dense_layers`: the layers that keep the dense MLP."""
    num_experts: int
    top_k: int
    intermediate_size: int
    num_shared_experts: int = 0
    scoring: str = "softmax"  # softmax | sigmoid
    topk_method: str = "greedy"  # greedy | group_limited_greedy | noaux_tc
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = False
    routed_scaling_factor: float = 1.0
    dense_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for name in ("num_experts", "top_k", "intermediate_size", "n_group", "topk_group"):
            if getattr(self, name) < 1:
                raise ConfigError(f"model config: moe.{name} must be >= 1, got {getattr(self, name)}")
        if self.num_shared_experts < 0:
            raise ConfigError(f"model config: moe.num_shared_experts must be >= 0, got {self.num_shared_experts}")
        if self.scoring not in MOE_SCORING:
            raise ConfigError(f"model config: moe.scoring {self.scoring!r} is not implemented "
                              f"({', '.join(MOE_SCORING)})")
        if self.topk_method not in MOE_TOPK_METHODS:
            raise ConfigError(f"model config: moe.topk_method {self.topk_method!r} is not implemented "
                              f"({', '.join(MOE_TOPK_METHODS)})")
        if self.topk_method == "noaux_tc" and self.scoring != "sigmoid":
            raise ConfigError("model config: moe.topk_method noaux_tc needs sigmoid scoring")
        if self.num_experts % self.n_group or self.topk_group > self.n_group:
            raise ConfigError(f"model config: moe needs n_group ({self.n_group}) to divide num_experts "
                              f"({self.num_experts}) and topk_group ({self.topk_group}) <= n_group")
        if self.top_k > self.num_experts or self.top_k > self.topk_group * (self.num_experts // self.n_group):
            raise ConfigError(f"model config: moe.top_k {self.top_k} is more than the experts it may choose from")

    def is_sparse(self, layer: int) -> bool:
        return layer not in self.dense_layers

    @property
    def uses_score_bias(self) -> bool:
        """The router holds `e_score_correction_bias` (DeepSeek-V3's aux-loss-free balancing)."""
        return self.topk_method == "noaux_tc"


MOE_SCORING = ("softmax", "sigmoid")
MOE_TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int = 8192
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # Llama-3 style: {"rope_type": "llama3", "factor", "low_freq_factor", "high_freq_factor",
    # "original_max_position_embeddings"}; None for plain RoPE.
    rope_scaling: dict[str, Any] | None = None
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # the family (engine.architectures) and the decoder switches it sets
    architecture: str = "LlamaForCausalLM"
    qkv_bias: bool = False  # Qwen2: biases on the q/k/v projections
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim of each q and k head, before rotary
    sliding_window: int | None = None  # Mistral: a token attends to itself and the window - 1 before it
    # an FP8 checkpoint (engine.quant.scheme): its projections ship as e4m3 with scales, per tensor
    # or channel (`weight_scale`), or per [128, 128] block (`weight_block_size`, `weight_scale_inv`)
    quant_method: str | None = None
    weight_block_size: tuple[int, int] | None = None
    mla: MLAConfig | None = None  # DeepSeek: latent attention (head_dim is qk_nope + qk_rope)
    moe: MoEConfig | None = None  # Qwen3-MoE, DeepSeek: mixture-of-experts MLPs (engine.moe)
    # DeepSeek-V3 (and Kimi K2): multi-token-prediction layers, model.layers.{num_layers}.. in the
    # checkpoint (num_nextn_predict_layers). Decoding does not run them: their tensors are left
    # unread, as transformers' DeepseekV3ForCausalLM leaves them.
    mtp_layers: int = 0

    def __post_init__(self) -> None:
        if self.mtp_layers < 0:
            raise ConfigError(f"model config: mtp_layers must be >= 0, got {self.mtp_layers}")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ConfigError(f"model config: sliding_window must be >= 1, got {self.sliding_window}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            if getattr(self, name) < 1:
                raise ConfigError(f"model config: {name} must be >= 1, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"model config: num_heads ({self.num_heads}) must be a multiple of "
                              f"num_kv_heads ({self.num_kv_heads})")

    def to_hf(self) -> dict[str, Any]:
        """A config.json dict that transformers reads back to the same architecture (the inverse of
        engine.architectures.config_from_hf); the features a family lacks are written as off."""
        d: dict[str, Any] = {
            "architectures": [self.architecture],
            "model_type": self.architecture.removesuffix("ForCausalLM").lower(),  # llama, qwen2, ...
            "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size, "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads, "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim, "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps, "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling, "tie_word_embeddings": self.tie_word_embeddings,
            "hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "use_sliding_window": False,
            "sliding_window": self.sliding_window,
        }
        if self.bos_token_id is not None:
            d["bos_token_id"] = self.bos_token_id
        if self.quant_method is not None:
            d["quantization_config"] = {"quant_method": self.quant_method, "activation_scheme": "dynamic"}
            if self.weight_block_size is not None:
                d["quantization_config"]["weight_block_size"] = list(self.weight_block_size)
        if self.mla is not None:
            d.update(_mla_to_hf(self))
        if self.moe is not None:
            d.update(_moe_to_hf(self))
        if self.eos_token_ids:
            d["eos_token_id"] = list(self.eos_token_ids) if len(self.eos_token_ids) > 1 else self.eos_token_ids[0]
        return d

    @property
    def kv_bytes_per_token(self) -> int:
        """Per element byte count is the cache dtype's; this is elements per token (K and V, all layers;
        with latent attention one latent + rope vector per layer)."""
        if self.mla is not None:
            return self.num_layers * self.mla.latent_dim
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim


def _mla_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """DeepSeek's config.json keys for latent attention (transformers sets head_dim to the rope part)."""
    m = cfg.mla
    d: dict[str, Any] = {
        "model_type": {"DeepseekV2ForCausalLM": "deepseek_v2"}.get(cfg.architecture, "deepseek_v3"),
        "q_lora_rank": m.q_lora_rank, "kv_lora_rank": m.kv_lora_rank, "qk_nope_head_dim": m.qk_nope_head_dim,
        "qk_rope_head_dim": m.qk_rope_head_dim, "v_head_dim": m.v_head_dim, "head_dim": m.qk_rope_head_dim,
        "rope_interleave": m.rope_interleave}
    if cfg.architecture == "DeepseekV3ForCausalLM":
        d["num_nextn_predict_layers"] = cfg.mtp_layers
    if getattr(cfg, "moe", None) is None:  # every layer dense
        d["first_k_dense_replace"] = cfg.num_layers
    return d


def _moe_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """The config.json keys of the MoE layers, in the family's names (engine.architectures reads
    them back): Qwen3-MoE lists its dense layers; DeepSeek's are the first `first_k_dense_replace`."""
    m = cfg.moe
    if cfg.architecture.startswith("Deepseek"):
        return {"n_routed_experts": m.num_experts, "num_experts_per_tok": m.top_k,
                "moe_intermediate_size": m.intermediate_size, "n_shared_experts": m.num_shared_experts,
                "scoring_func": m.scoring, "topk_method": m.topk_method, "n_group": m.n_group,
                "topk_group": m.topk_group, "norm_topk_prob": m.norm_topk_prob,
                "routed_scaling_factor": m.routed_scaling_factor, "first_k_dense_replace": len(m.dense_layers),
                "moe_layer_freq": 1}
    return {"model_type": "qwen3_moe", "num_experts": m.num_experts, "num_experts_per_tok": m.top_k,
            "moe_intermediate_size": m.intermediate_size, "norm_topk_prob": m.norm_topk_prob,
            "decoder_sparse_step": 1, "mlp_only_layers": list(m.dense_layers)}


LLAMA3_ROPE_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                       "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}

# Real shapes with seeded random weights, and a tiny config for tests. The big ones are for GPU
# benchmarks: qwen2.5-32b-random (Qwen2: q/k/v biases; bf16 ~65 GB), llama3-70b-random (bf16
# ~141 GB: FP8 on one H200, --quantization fp8, ~72 GB). engine.build makes them layer by layer.
PRESETS: dict[str, ModelConfig] = {
    "llama3-70b-random": ModelConfig(
        vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_layers=80, num_heads=64,
        num_kv_heads=8, head_dim=128, max_position_embeddings=131072, rms_norm_eps=1e-5,
        rope_theta=500000.0, rope_scaling=LLAMA3_ROPE_SCALING, tie_word_embeddings=False,
        bos_token_id=128000, eos_token_ids=(128001, 128009)),
    "qwen2.5-32b-random": ModelConfig(
        vocab_size=152064, hidden_size=5120, intermediate_size=27648, num_layers=64, num_heads=40,
        num_kv_heads=8, head_dim=128, max_position_embeddings=32768, rms_norm_eps=1e-6,
        rope_theta=1000000.0, tie_word_embeddings=False, bos_token_id=151643, eos_token_ids=(151645, 151643),
        architecture="Qwen2ForCausalLM", qkv_bias=True),
    # Qwen3-30B-A3B's shapes: every layer 128 experts of width 768, 8 per token (30.5B total, 3.3B
    # active; bf16 ~61 GB: one H200)
    "qwen3-30b-a3b-random": ModelConfig(
        vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_layers=48, num_heads=32,
        num_kv_heads=4, head_dim=128, max_position_embeddings=40960, rms_norm_eps=1e-6,
        rope_theta=1000000.0, tie_word_embeddings=False, bos_token_id=151643, eos_token_ids=(151645, 151643),
        architecture="Qwen3MoeForCausalLM", qk_norm=True,
        moe=MoEConfig(num_experts=128, top_k=8, intermediate_size=768, norm_topk_prob=True)),
    "llama3-8b-random": ModelConfig(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
        num_kv_heads=8, head_dim=128, max_position_embeddings=131072, rms_norm_eps=1e-5,
        rope_theta=500000.0, rope_scaling=LLAMA3_ROPE_SCALING, tie_word_embeddings=False,
        bos_token_id=128000, eos_token_ids=(128001, 128009)),
    # DeepSeek-V2-Lite's shapes (15.7B total, 2.4B active; bf16 ~31 GB): latent attention with no q
    # LoRA, 64 routed experts (6 active) + 2 shared after one dense layer, YaRN rope (factor 40)
    "deepseek-v2-lite-random": ModelConfig(
        vocab_size=102400, hidden_size=2048, intermediate_size=10944, num_layers=27, num_heads=16,
        num_kv_heads=16, head_dim=192, max_position_embeddings=163840, rms_norm_eps=1e-6, rope_theta=10000.0,
        rope_scaling={"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
                      "mscale": 0.707, "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1},
        tie_word_embeddings=False, bos_token_id=100000, eos_token_ids=(100001,),
        architecture="DeepseekV2ForCausalLM",
        mla=MLAConfig(q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128),
        moe=MoEConfig(num_experts=64, top_k=6, intermediate_size=1408, num_shared_experts=2, scoring="softmax",
                      topk_method="greedy", dense_layers=(0,))),
    "smollm2-135m-random": ModelConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
        num_kv_heads=3, head_dim=64, max_position_embeddings=8192, rms_norm_eps=1e-5,
        rope_theta=100000.0, tie_word_embeddings=True, bos_token_id=1, eos_token_ids=(2,)),
    # GQA, Llama-3 rope scaling and untied embeddings, small enough for every CPU test.
    "tiny-random": ModelConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
        num_kv_heads=2, head_dim=16, max_position_embeddings=2048, rms_norm_eps=1e-5,
        rope_theta=10000.0, rope_scaling={**LLAMA3_ROPE_SCALING, "original_max_position_embeddings": 256},
        tie_word_embeddings=False, bos_token_id=1, eos_token_ids=(2,)),
}


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    # None: size the cache from `max_cache_bytes` (CPU) or the free device memory fraction (GPU).
    num_blocks: int | None = None
    max_cache_bytes: int = 2 << 30
    gpu_memory_utilization: float = 0.85
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ConfigError(f"cache: block_size must be a power of two, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 2:
            raise ConfigError(f"cache: num_blocks must be >= 2, got {self.num_blocks}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError("cache: gpu_memory_utilization must be in (0, 1]")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256  # sequences in the running batch
    max_num_batched_tokens: int = 2048  # per-step token budget; prompts beyond it are chunked
    enable_chunked_prefill: bool = True

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ConfigError("scheduler: max_num_seqs and max_num_batched_tokens must be >= 1")


QUANTIZATIONS = (None, "none", "fp8")
SPECULATIVE_METHODS = ("off", "ngram", "draft", "suffix")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding: who proposes draft tokens, how many, and when to stop bothering.

    `method`: "off"; "ngram" (prompt lookup: the tokens that followed the most recent earlier
    occurrence of the sequence's last `max_n`..`min_n` tokens); "draft" (a smaller model with the
    same vocabulary: `draft_model` names one, or, with `draft_model` None, the target's own first
    `draft_num_layers` layers + final norm + LM head, weights shared); "suffix" (suffix drafting:
    the most frequent continuation of the sequence's longest earlier match, `min_n` to
    `suffix_max_match` tokens, in its own tokens or in recent requests' outputs on this engine;
    engine.speculative.suffix)."""
    method: str = "off"  # off | ngram | draft | suffix
    num_tokens: int = 5  # k: the most drafts per sequence per step
    min_n: int = 2
    max_n: int = 5
    draft_model: str | None = None
    draft_num_layers: int | None = None
    draft_num_blocks: int | None = None  # the draft's own KV cache; None: as many blocks as the target's
    suffix_max_match: int = 32  # the longest suffix matched
    suffix_min_token_prob: float = 0.1  # a draft stops where its path's frequency falls below this
    suffix_max_spec_factor: float = 2.0  # drafts at most this many times the match length
    suffix_max_global_tokens: int = 1 << 18  # finished requests' outputs kept for drafting (LRU)
    # 0: suffix drafts are chains; n in [2, 63]: trees of up to n nodes, verified in one pass
    suffix_tree_nodes: int = 0
    # length policy (engine.speculative.policy). The knee: up to this many tokens (1 + k per
    # sequence, plus prefill chunks) a forward costs about one decode step; past it, about
    # tokens / max_verify_tokens steps. None: 256 on GPUs, 8 on CPUs (bench/speculative.py).
    max_verify_tokens: int | None = None
    # what one more token in a step costs, relative to the step's fixed part (weights read, launch
    # and host overhead); None: 0 on GPUs (below the knee tokens are free), 0.1 on CPUs (the
    # step's cost grows with its tokens at once: bench/speculative.py)
    verify_token_cost: float | None = None
    min_acceptance: float = 0.3  # below this per-token acceptance a sequence stops drafting
    min_draft_gain: float = 0.1  # draft position j is proposed only if acceptance**j reaches this
    initial_acceptance: float = 0.7  # per-token acceptance assumed for a new sequence
    ema_decay: float = 0.8  # weight of the past in the acceptance estimate, per verify step
    probe_interval: int = 16  # steps a sequence stays off before it is probed again

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ConfigError(f"speculative: method must be off, ngram, draft or suffix, got {self.method!r}")
        if not 1 <= self.num_tokens <= 64:
            raise ConfigError(f"speculative: num_tokens must be in [1, 64], got {self.num_tokens}")
        if not 1 <= self.min_n <= self.max_n:
            raise ConfigError(f"speculative: need 1 <= min_n <= max_n, got {self.min_n}, {self.max_n}")
        if self.method == "draft" and self.draft_model is None and not self.draft_num_layers:
            raise ConfigError("speculative: method 'draft' needs draft_model or draft_num_layers")
        if self.draft_num_layers is not None and self.draft_num_layers < 1:
            raise ConfigError(f"speculative: draft_num_layers must be >= 1, got {self.draft_num_layers}")
        if self.draft_num_blocks is not None and self.draft_num_blocks < 2:
            raise ConfigError(f"speculative: draft_num_blocks must be >= 2, got {self.draft_num_blocks}")
        if self.verify_token_cost is not None and not 0 <= self.verify_token_cost < 10:
            raise ConfigError(f"speculative: verify_token_cost must be in [0, 10), got {self.verify_token_cost}")
        if self.max_verify_tokens is not None and self.max_verify_tokens < 1:
            raise ConfigError(f"speculative: max_verify_tokens must be >= 1, got {self.max_verify_tokens}")
        if self.suffix_max_match < self.min_n or self.suffix_max_global_tokens < 0 or self.suffix_max_spec_factor <= 0:
            raise ConfigError("speculative: need suffix_max_match >= min_n, suffix_max_global_tokens >= 0 "
                              "and suffix_max_spec_factor > 0")
        for name in ("initial_acceptance", "min_acceptance", "min_draft_gain", "suffix_min_token_prob"):
            if not 0 < getattr(self, name) <= 1:
                raise ConfigError(f"speculative: {name} must be in (0, 1], got {getattr(self, name)}")
        if not 0 <= self.ema_decay < 1:
            raise ConfigError(f"speculative: ema_decay must be in [0, 1), got {self.ema_decay}")
        if self.probe_interval < 1:
            raise ConfigError(f"speculative: probe_interval must be >= 1, got {self.probe_interval}")
        if self.suffix_tree_nodes and (self.method != "suffix" or not 2 <= self.suffix_tree_nodes <= 63):
            raise ConfigError("speculative: suffix_tree_nodes is 0 (chains) or in [2, 63] with method "
                              f"'suffix', got {self.suffix_tree_nodes} with {self.method!r}")

    @property
    def enabled(self) -> bool:
        return self.method != "off"


@dataclass(frozen=True)
class EngineConfig:
    model: str = "smollm2-135m"
    dtype: str = "float32"  # float32 | bfloat16 | float16
    device: str = "cpu"
    seed: int = 0  # for `*-random` weights
    # actors run LLMEngine.warmup() before serving (kernels compiled, decode graphs captured);
    # None: on CUDA only
    warmup: bool | None = None
    # vLLM's names. tensor_parallel_size: ranks per worker, one process each (engine.parallel);
    # quantization "fp8": the projections quantized to FP8 e4m3 per output channel at load
    # (engine.quant); None/"none": weights as the checkpoint ships them (FP8 checkpoints load as FP8)
    tensor_parallel_size: int = 1
    quantization: str | None = None
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)

    def __post_init__(self) -> None:
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ConfigError(f"engine: dtype must be float32, bfloat16 or float16, got {self.dtype!r}")
        if self.warmup not in (None, True, False):
            raise ConfigError(f"engine: warmup must be true, false or null (CUDA only), got {self.warmup!r}")
        if not isinstance(self.tensor_parallel_size, int) or self.tensor_parallel_size < 1:
            raise ConfigError(f"engine: tensor_parallel_size must be an integer >= 1, got {self.tensor_parallel_size!r}")
        if self.tensor_parallel_size > 1 and self.speculative.method == "draft":
            raise ConfigError("engine: speculative method 'draft' is not implemented with tensor_parallel_size > 1 "
                              "(ngram and suffix are)")
        if self.tensor_parallel_size > 1 and self.speculative.suffix_tree_nodes:
            raise ConfigError("engine: tree drafts (speculative suffix_tree_nodes) are not implemented with "
                              "tensor_parallel_size > 1 (the accepted path's KV is moved on rank 0 only)")
        if self.quantization not in QUANTIZATIONS:
            raise ConfigError(f"engine: quantization {self.quantization!r} is not implemented "
                              "(none: weights in --dtype; fp8: FP8 e4m3 weights, per-channel scales)")
