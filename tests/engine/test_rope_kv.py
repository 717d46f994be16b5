"""The fused rotary + KV write (engine.kernels.attention_rope_kv) against plain torch (rotate-half
rotary, then the cache scatter), on views of a fused qkv output and a strided layer of a paged
cache, under TRITON_INTERPRET=1 on CPU; and a tiny model decoding the same greedy tokens with it
on and off."""

import pytest
import torch

from tests.engine.test_kernels import DEVICE, make_cos_sin_cache, rel_err, rotary_reference  # sets TRITON_INTERPRET

from tandem.engine.attention import write_kv_torch  # noqa: E402
from tandem.engine.kernels import attention_rope_kv  # noqa: E402
from tandem.engine.kernels.attention_rope_kv import rotary_write_kv  # noqa: E402


def _case(dtype, seed=0, tokens=5, heads=4, kv_heads=2, head_dim=32, block_size=16, num_blocks=6):
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(tokens, heads + 2 * kv_heads, head_dim, generator=gen).to(dtype).to(DEVICE)
    q, k, v = qkv[:, :heads], qkv[:, heads:heads + kv_heads], qkv[:, heads + kv_heads:]
    cache = torch.randn(3, 2, num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype).to(DEVICE)
    positions = torch.randint(0, 200, (tokens,), generator=gen).to(DEVICE)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens].to(DEVICE)
    slots[1] = -1  # a padding row: rotated, never written
    return qkv, q, k, v, cache, positions, slots, make_cos_sin_cache(256, head_dim).to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_fused_rotary_and_kv_write_match_torch(dtype):
    qkv, q, k, v, cache, positions, slots, cos_sin = _case(dtype)
    q_ref, k_ref = rotary_reference(q, positions, cos_sin), rotary_reference(k, positions, cos_sin)
    cache_ref = cache.clone()
    keep = slots >= 0
    write_kv_torch(k_ref[keep].to(dtype), v[keep], cache_ref[1, 0], cache_ref[1, 1], slots[keep])
    v_before = v.clone()
    rotary_write_kv(q, k, v, positions, cos_sin, cache[1, 0], cache[1, 1], slots, fused=True)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    assert rel_err(q, q_ref) < tol and rel_err(k, k_ref) < tol
    assert torch.equal(v, v_before)
    assert rel_err(cache, cache_ref) < tol                 # every other layer and slot untouched
    assert torch.equal(cache[0], cache_ref[0]) and torch.equal(cache[2], cache_ref[2])


def test_fused_equals_the_two_launches_bit_for_bit():
    a, b = _case(torch.float16, seed=3), _case(torch.float16, seed=3)
    rotary_write_kv(*a[1:4], a[5], a[7], a[4][1, 0], a[4][1, 1], a[6], fused=True)
    rotary_write_kv(*b[1:4], b[5], b[7], b[4][1, 0], b[4][1, 1], b[6], fused=False)
    assert torch.equal(a[0], b[0]) and torch.equal(a[4], b[4])


def test_fused_refuses_what_the_two_launches_refuse():
    qkv, q, k, v, cache, positions, slots, cos_sin = _case(torch.float32)
    with pytest.raises(ValueError, match="one entry per token"):
        rotary_write_kv(q, k, v, positions[:3], cos_sin, cache[1, 0], cache[1, 1], slots, fused=True)
    with pytest.raises(ValueError, match="k_cache"):
        rotary_write_kv(q, k, v, positions, cos_sin, cache[1, 0, :, :, :1], cache[1, 1, :, :, :1], slots, fused=True)


def test_tiny_model_decodes_the_same_tokens_fused(make_engine, monkeypatch):
    from tandem.engine.model import TritonOps
    from tandem.engine.model_runner import ModelRunner
    from tandem.engine.weights import load_model

    model, tok, _ = load_model("tiny-random", seed=7)
    model.ops = TritonOps()
    prompts = [{"prompt_token_ids": list(range(3, 3 + n)), "max_tokens": 5, "ignore_eos": True} for n in (7, 20)]
    tokens = []
    for on in (False, True):
        monkeypatch.setattr(attention_rope_kv, "ENABLED", on)
        e = make_engine(model, tok)
        e.runner = ModelRunner(model, e.kv_cache, "cpu", cuda_graphs=True, capture=False)
        tokens.append([o["token_ids"] for o in e.generate(prompts)])
    assert tokens[0] == tokens[1]
