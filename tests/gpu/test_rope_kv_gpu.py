"""The fused rotary + KV write (engine.kernels.attention_rope_kv) at Llama-3-8B sizes in bf16 on
CUDA: the same bytes as the two launches it replaces (rotary_embedding, then write_kv), on views
of a fused qkv output and a strided layer of the paged cache, with padding rows (slot -1)."""

import torch

if torch.cuda.is_available():  # elsewhere conftest.py skips these, and triton stays unimported
    from tandem.engine.kernels.attention_rope_kv import rotary_write_kv


def _case(tokens=64, heads=32, kv_heads=8, head_dim=128, blocks=64):
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    qkv = torch.randn(tokens, heads + 2 * kv_heads, head_dim, generator=gen, device="cuda", dtype=torch.bfloat16)
    cache = torch.randn(2, 2, blocks, 16, kv_heads, head_dim, generator=gen, device="cuda", dtype=torch.bfloat16)
    positions = torch.randint(0, 8000, (tokens,), generator=gen, device="cuda")
    slots = torch.randperm(blocks * 16, generator=gen, device="cuda")[:tokens]
    slots[::7] = -1
    angles = torch.arange(8192, device="cuda").float()[:, None] * 500000.0 ** (
        -torch.arange(0, head_dim, 2, device="cuda").float() / head_dim)
    cos_sin = torch.cat([angles.cos(), angles.sin()], -1)
    return qkv, cache, positions, slots, cos_sin


def _run(case, fused):
    qkv, cache, positions, slots, cos_sin = case
    q, k, v = qkv[:, :32], qkv[:, 32:40], qkv[:, 40:]
    rotary_write_kv(q, k, v, positions, cos_sin, cache[1, 0], cache[1, 1], slots, fused=fused)
    torch.cuda.synchronize()


def test_fused_rotary_kv_write_equals_the_two_launches():
    for tokens in (1, 64, 300):
        a = _case(tokens)
        b = tuple(t.clone() for t in a)
        _run(a, True)
        _run(b, False)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
