"""Tiny random checkpoints of every served family, written by transformers itself (its config
class, its model class, `save_pretrained` as safetensors) with a byte-level tokenizer.json, so the
engine is checked against transformers' own reading of the same directory.

Each family turns on what sets it apart from Llama: Llama-3 rope scaling (in transformers 5's
`rope_parameters` layout), Qwen2's q/k/v biases with tied embeddings, Qwen3's per-head q/k norms
with a head_dim that is not hidden / heads, Mistral's sliding window (16, shorter than the
prompts), Qwen3-MoE's experts (one sparse layer, one dense). Weights are redrawn with trained-like scales (transformers initialises biases to 0 and
norms to 1, which would hide a bias or a norm the engine dropped)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

# the tokenizer: 256 byte tokens, then these specials
SPECIALS = ["<s>", "</s>", "<|im_end|>"]
BOS, EOS, IM_END = 256, 257, 258
VOCAB = 256 + len(SPECIALS)
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
              rms_norm_eps=1e-6, bos_token_id=BOS, eos_token_id=EOS, tie_word_embeddings=False)
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
# family: (transformers config class, model class, what differs from COMMON)
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {"rope_parameters": LLAMA3_ROPE}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {"tie_word_embeddings": True}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 32}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 16}),
    # layer 0 a mixture of 8 experts (2 per token), layer 1 dense (mlp_only_layers)
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", {"head_dim": 32, "num_experts": 8, "num_experts_per_tok": 2,
                                                            "moe_intermediate_size": 32, "norm_topk_prob": True,
                                                            "mlp_only_layers": [1]}),
}
SLIDING_WINDOW = 16


def write_tokenizer(path: Path, chat_template: str | None = CHAT_TEMPLATE) -> None:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": False, "chat_template": chat_template}))


def _redraw(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            elif name.endswith(".bias"):
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))
            elif "embed" in name or "lm_head" in name:
                p.copy_(0.5 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(p.shape[-1] ** -0.5 * torch.randn(p.shape, generator=gen))


def build_family_dir(family: str, path: Path, seed: int = 0):
    """Writes the family's tiny checkpoint into `path`; -> transformers' model on it (fp32, eval).
    The Qwen families also list <|im_end|> as EOS in generation_config.json alone, as Qwen's
    instruct checkpoints do."""
    import transformers

    config_cls, model_cls, extra = FAMILIES[family]
    config = getattr(transformers, config_cls)(**{**COMMON, **extra})
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).float().eval()
    _redraw(model, seed)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(path), safe_serialization=True)
    if family.startswith("qwen"):
        gen = json.loads((path / "generation_config.json").read_text())
        (path / "generation_config.json").write_text(json.dumps({**gen, "eos_token_id": [EOS, IM_END]}))
        model.generation_config.eos_token_id = [EOS, IM_END]
    write_tokenizer(path)
    return model


def hf_greedy(hf, ids: list[int], n: int, eos) -> list[int]:
    """transformers' greedy continuation of `ids` (stops at an id in `eos`, which it keeps)."""
    with torch.inference_mode():
        out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                          max_new_tokens=n, do_sample=False, eos_token_id=eos,
                          pad_token_id=EOS if eos is None else (eos if isinstance(eos, int) else eos[0]))
    return out[0, len(ids):].tolist()
