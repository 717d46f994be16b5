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


def test_decode_attention_writing_the_new_kv_matches_the_fused_launch_then_attention():
    """rotary_kv_attention at llama3-8b's heads in bf16: the decode kernel that rotates q and writes
    the step's new K/V itself (each program the keys of its partition, read back after a barrier)
    against rotary_write_kv then paged_attention; batch 1 split in partitions, a verify step over a
    partition boundary, and 64 sequences in one pass. V bit for bit; K and the outputs within
    rounding, nearly all bits equal (the compiler may contract the rotation's products
    differently in the two kernels)."""
    from tests.engine.test_kernels import make_batch

    from tandem.engine.kernels.attention_rope_kv import rotary_kv_attention

    for query_lens, ctx_lens in (([1], [1000]), ([4], [1022]), ([1] * 64, list(range(200, 200 + 64 * 30, 30)))):
        gen = torch.Generator().manual_seed(len(query_lens) + ctx_lens[0])
        q, k_cache, v_cache, meta = make_batch(gen, query_lens, ctx_lens, 32, 8, 128, 16, dtype=torch.bfloat16)
        kv = torch.randn(q.shape[0], 16, 128, device="cuda", dtype=torch.bfloat16)
        positions = torch.tensor([c + t for c, n in zip(ctx_lens, query_lens) for t in range(n)], device="cuda")
        _, _, _, _, cos_sin = _case(1)
        outs, caches = [], []
        for inside in (True, False):
            kc, vc = k_cache.clone(), v_cache.clone()
            outs.append(rotary_kv_attention(q.clone(), kv[:, :8].clone(), kv[:, 8:], positions, cos_sin, kc, vc, meta,
                                            128 ** -0.5, in_attention=inside))
            caches.append((kc, vc))
        torch.cuda.synchronize()
        assert torch.equal(caches[0][1], caches[1][1]), query_lens      # V: copied
        for a, b in ((caches[0][0].float(), caches[1][0].float()), (outs[0].float(), outs[1].float())):
            assert (a - b).abs().max().item() < 2e-2 and (a == b).float().mean().item() > 0.999, query_lens


def test_decode_attention_under_pdl_reads_the_new_keys_after_its_wait(monkeypatch):
    """With PDL launches the decode kernel reads its metadata before its wait, while the rotary +
    KV write launched just before it may still run, and the K/V after it. Twenty steps back to back,
    each writing other new K/V into the same slots: every step's output is the one plain launches
    give one step at a time (a new key read before the write landed would be the step before's)."""
    from tests.engine.test_kernels import make_batch

    from tandem.engine.kernels import pdl
    from tandem.engine.kernels.attention_rope_kv import rotary_kv_attention

    for query_lens, ctx_lens in (([1], [1000]), ([4], [1022]), ([1] * 64, list(range(200, 200 + 64 * 30, 30)))):
        gen = torch.Generator().manual_seed(len(query_lens) + ctx_lens[0])
        q, k_cache, v_cache, meta = make_batch(gen, query_lens, ctx_lens, 32, 8, 128, 16, dtype=torch.bfloat16)
        positions = torch.tensor([c + t for c, n in zip(ctx_lens, query_lens) for t in range(n)], device="cuda")
        _, _, _, _, cos_sin = _case(1)
        steps = [torch.randn(q.shape[0], 16, 128, device="cuda", dtype=torch.bfloat16) for _ in range(20)]
        for inside in (False, True):
            monkeypatch.setattr(pdl, "ENABLED", True)
            kc, vc = k_cache.clone(), v_cache.clone()
            # (the two-launch path rotates q and k in place: each call gets its own)
            inputs = [(q.clone(), kv.clone()) for kv in steps]
            outs = [rotary_kv_attention(q_, kv[:, :8], kv[:, 8:], positions, cos_sin, kc, vc, meta, 128 ** -0.5,
                                        in_attention=inside) for q_, kv in inputs]
            monkeypatch.setattr(pdl, "ENABLED", False)
            kc, vc = k_cache.clone(), v_cache.clone()
            for out, kv in zip(outs, steps):
                kv = kv.clone()
                ref = rotary_kv_attention(q.clone(), kv[:, :8], kv[:, 8:], positions, cos_sin, kc, vc, meta,
                                          128 ** -0.5, in_attention=inside)
                torch.cuda.synchronize()
                diff = (out.float() - ref.float()).abs()
                assert diff.max().item() < 2e-2 and (diff == 0).float().mean().item() > 0.999, (query_lens, inside)


def test_gemv_scheduled_during_attention_reads_the_merged_output(monkeypatch):
    """SplitPolicy.early_release: the merge lets the o projection's GEMV be scheduled before it waits,
    so the GEMV's programs load their weight tiles while the split attention still runs. Twenty
    decode steps back to back under PDL (attention, merge, GEMV; bf16 and FP8 weights), each with
    other new K/V: every GEMV output equals the GEMV of that step's attention output computed with
    plain launches (one that read its input before the merge finished would hold the step before's)."""
    from tests.engine.test_kernels import make_batch

    from tandem.engine.kernels import attention_split, gemv, pdl
    from tandem.engine.kernels.attention_rope_kv import rotary_kv_attention
    from tandem.engine.quant.fp8 import quantize_fp8

    gen = torch.Generator().manual_seed(5)
    q, k_cache, v_cache, meta = make_batch(gen, [1], [1000], 32, 8, 128, 16, dtype=torch.bfloat16)
    positions = torch.tensor([1000], device="cuda")
    _, _, _, _, cos_sin = _case(1)
    steps = [torch.randn(1, 16, 128, device="cuda", dtype=torch.bfloat16) for _ in range(20)]
    w = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16) / 64
    w8, s8 = quantize_fp8(w)
    old = attention_split.set_split_policy(early_release=True)
    try:
        for weight, scale in ((w, None), (w8, s8)):
            monkeypatch.setattr(pdl, "ENABLED", True)
            kc, vc = k_cache.clone(), v_cache.clone()
            inputs = [(q.clone(), kv[:, :8].clone(), kv[:, 8:]) for kv in steps]  # no copy between the launches
            outs = []
            for q_, k_, v_ in inputs:
                o = rotary_kv_attention(q_, k_, v_, positions, cos_sin, kc, vc, meta, 128 ** -0.5)
                outs.append((o, gemv.gemv(o.view(1, 4096), weight, scale)))
            monkeypatch.setattr(pdl, "ENABLED", False)
            torch.cuda.synchronize()
            for o, y in outs:
                ref = gemv.gemv(o.view(1, 4096).clone(), weight, scale)
                torch.cuda.synchronize()
                assert torch.equal(y, ref), scale is not None
            # and the steps' attention outputs differ, so a stale read would show
            assert not torch.equal(outs[0][0], outs[1][0])
    finally:
        attention_split.POLICY = old
