"""Tiny random DeepSeek-V2/V3 checkpoints written by transformers (its config and model classes,
`save_pretrained` as safetensors, the byte-level tokenizer of tests/engine/families.py).

V2 is shaped as V2-Lite (q_proj, no q LoRA, default rope); V3 has the q LoRA and YaRN rope with
mscale (so the softmax scale and the cos/sin attention factor both matter) over a short original
context. v_head_dim differs from qk_nope_head_dim, as a wrong split of kv_b_proj would show.
`moe=True` makes every layer but the first a DeepSeek MoE layer (engine.moe)."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.engine.families import COMMON, _redraw, write_tokenizer

MLA = {**COMMON, "num_key_value_heads": 4, "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8,
       "v_head_dim": 12}
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32,
        "mscale": 0.707, "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1}
VERSIONS = {
    "v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM", {"q_lora_rank": None}),
    "v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", {"q_lora_rank": 24, "rope_parameters": YARN}),
}
MOE = {
    "v2": {"n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "n_shared_experts": 1,
           "topk_method": "group_limited_greedy", "n_group": 4, "topk_group": 2, "routed_scaling_factor": 1.5},
    "v3": {"n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "n_shared_experts": 1,
           "n_group": 4, "topk_group": 2, "norm_topk_prob": True, "routed_scaling_factor": 2.5},
}


def build_deepseek_dir(version: str, path: Path, *, moe: bool = False, seed: int = 0):
    """Writes the tiny checkpoint into `path`; -> transformers' model on it (fp32, eval)."""
    import transformers

    config_cls, model_cls, extra = VERSIONS[version]
    layers = {**MOE[version], "first_k_dense_replace": 1} if moe else {"first_k_dense_replace": MLA["num_hidden_layers"]}
    config = getattr(transformers, config_cls)(**{**MLA, **extra, **layers})
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).float().eval()
    _redraw(model, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():  # V3's router bias: a zero bias would hide one the engine dropped
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(0.05 * torch.randn(buf.shape, generator=gen))
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(path), safe_serialization=True)
    write_tokenizer(path)
    return model
