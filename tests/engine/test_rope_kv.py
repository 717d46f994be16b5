"""The fused rotary + KV write (engine.kernels.attention_rope_kv) against plain torch (rotate-half
rotary, then the cache scatter), on views of a fused qkv output and a strided layer of a paged
cache, under TRITON_INTERPRET=1 on CPU; the decode attention kernel that rotates and writes the new
K/V itself against that launch then attention, bit for bit; and a tiny model decoding the same
greedy tokens with each on and off."""

import dataclasses

import pytest
import torch

from tests.engine.test_kernels import (DEVICE, make_batch, make_cos_sin_cache, rel_err,  # sets TRITON_INTERPRET
                                       rotary_reference)

from tandem.engine.attention import paged_attention_torch, write_kv_torch  # noqa: E402
from tandem.engine.kernels import attention_rope_kv  # noqa: E402
from tandem.engine.kernels import paged_attention as pa  # noqa: E402
from tandem.engine.kernels.attention_rope_kv import rotary_kv_attention, rotary_write_kv  # noqa: E402


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


def _step(query_lens, ctx_lens, seed, tree=False):
    gen = torch.Generator().manual_seed(seed)
    q, k_cache, v_cache, meta = make_batch(gen, query_lens, ctx_lens, 8, 2, 32, 16, dtype=torch.float16)
    kv = torch.randn(q.shape[0], 4, 32, generator=gen).to(torch.float16).to(DEVICE)  # a q/k/v output's k, v
    # rotary positions need not be the slots' (tree drafts rotate by depth)
    positions = torch.randint(0, 500, (q.shape[0],), generator=gen).to(DEVICE)
    if tree:  # per sequence: the root, a child, and the root's second child (not the first's)
        bits = [b for n in query_lens for b in (1, 3, 5, 11)[:n]]
        meta = dataclasses.replace(meta, tree_mask=torch.tensor(bits, dtype=torch.int64, device=DEVICE))
    return q, kv[:, :2], kv[:, 2:], positions, k_cache, v_cache, meta, make_cos_sin_cache(512, 32).to(DEVICE)


@pytest.mark.parametrize("query_lens,ctx_lens,partition,window,tree", [
    ([1], [300], 64, None, False),              # one new token, the context split in partitions
    ([4], [126], 64, None, False),              # new keys on both sides of a partition boundary
    ([1], [319], 64, None, False),              # the new key in the last partition's unmasked tile
    ([1, 3, 2], [40, 190, 7], None, None, False),  # one pass per sequence, verify rows
    ([2, 1], [150, 90], 64, 50, False),         # a sliding window
    ([3, 4], [100, 61], 64, None, True),        # tree drafts
])
def test_decode_kernel_that_writes_the_new_kv_is_the_fused_launch_then_attention(query_lens, ctx_lens, partition,
                                                                                  window, tree):
    """paged_decode_attention(rope=...) rotates q in registers and writes the step's new K/V
    (each program the keys of its partition) before it reads them: its output and the cache are
    rotary_write_kv then paged_decode_attention's, bit for bit; q is left unrotated."""
    q, k, v, positions, k_cache, v_cache, meta, cos_sin = _step(query_lens, ctx_lens, len(query_lens) + ctx_lens[0], tree)
    q_ref, k_ref, kc_ref, vc_ref = q.clone(), k.clone(), k_cache.clone(), v_cache.clone()
    rotary_write_kv(q_ref, k_ref, v, positions, cos_sin, kc_ref, vc_ref, meta.slot_mapping, fused=True)
    ref = pa.paged_decode_attention(q_ref, kc_ref, vc_ref, meta, 0.3, partition_size=partition, sliding_window=window)
    q_before, k_before = q.clone(), k.clone()
    out = pa.paged_decode_attention(q, k_cache, v_cache, meta, 0.3, partition_size=partition, sliding_window=window,
                                    rope=pa.NewKV(k, v, positions, cos_sin, meta.slot_mapping))
    assert torch.equal(out, ref)
    # and both are attention over the written cache (a tile read before its new keys were written
    # would be wrong in both)
    assert rel_err(out, paged_attention_torch(q_ref, kc_ref, vc_ref, meta, 0.3, sliding_window=window)) < 1e-2
    assert torch.equal(k_cache, kc_ref) and torch.equal(v_cache, vc_ref)
    assert torch.equal(q, q_before) and torch.equal(k, k_before)
    assert not torch.equal(k_cache, k_cache.new_zeros(()).expand_as(k_cache))


def test_rotary_kv_attention_takes_the_decode_kernel_only_for_decode_steps(monkeypatch):
    """rotary_kv_attention: a decode/verify step in one launch (IN_ATTENTION), the same output and
    cache as the two launches; a step with a long prefill row takes the two launches; bad input
    is refused as rotary_write_kv refuses it."""
    launches = []
    real = pa.paged_decode_attention
    monkeypatch.setattr(attention_rope_kv, "paged_decode_attention",
                        lambda *a, **kw: launches.append(kw.get("rope") is not None) or real(*a, **kw))
    for query_lens, fused_launches in (([1, 2], [True]), ([1, 20], [])):
        q, k, v, positions, k_cache, v_cache, meta, cos_sin = _step(query_lens, [70, 33], 9)
        a = (q.clone(), k.clone(), v, positions, cos_sin, k_cache.clone(), v_cache.clone(), meta, 0.3)
        b = (q.clone(), k.clone(), v, positions, cos_sin, k_cache.clone(), v_cache.clone(), meta, 0.3)
        launches.clear()
        out = rotary_kv_attention(*a, in_attention=True)
        assert launches == fused_launches
        assert torch.equal(out, rotary_kv_attention(*b, in_attention=False))
        assert torch.equal(a[5], b[5]) and torch.equal(a[6], b[6])
    with pytest.raises(ValueError, match="one entry per token"):
        rotary_kv_attention(q, k, v, positions[:3], cos_sin, k_cache, v_cache, meta, 0.3, in_attention=True)


def test_tiny_model_decodes_the_same_tokens_fused(make_engine, monkeypatch):
    from tandem.engine.model import TritonOps
    from tandem.engine.model_runner import ModelRunner
    from tandem.engine.weights import load_model

    model, tok, _ = load_model("tiny-random", seed=7)
    model.ops = TritonOps()
    prompts = [{"prompt_token_ids": list(range(3, 3 + n)), "max_tokens": 5, "ignore_eos": True} for n in (7, 20)]
    tokens, in_attention = [], []
    real = pa.paged_decode_attention
    monkeypatch.setattr(attention_rope_kv, "paged_decode_attention",
                        lambda *a, **kw: in_attention.append(1) or real(*a, **kw))
    for on, inside in ((False, False), (True, False), (True, True)):
        monkeypatch.setattr(attention_rope_kv, "ENABLED", on)
        monkeypatch.setattr(attention_rope_kv, "IN_ATTENTION", 64 if inside else 0)
        in_attention.clear()
        e = make_engine(model, tok)
        e.runner = ModelRunner(model, e.kv_cache, "cpu", cuda_graphs=True, capture=False)
        tokens.append([o["token_ids"] for o in e.generate(prompts)])
        assert bool(in_attention) == inside  # the decode steps' attention wrote their K/V itself
    assert tokens[0] == tokens[1] == tokens[2]
