"""The Triton kernels at Llama-3-8B sizes in bf16 on CUDA (32 query heads, 8 KV heads, head_dim 128,
block size 16, contexts up to 8k, batches up to 64), against float32 references computed on the
upcast bf16 inputs. Outputs are poisoned with NaN first. Bound: ||out - ref|| / ||ref|| < 1e-2, the
bf16-operand range of the method (P @ V in bf16 and the bf16 output rounding land near 3e-3)."""

import pytest
import torch

from tandem.engine.attention import AttentionMetadata, paged_attention_torch, write_kv_torch

if torch.cuda.is_available():  # elsewhere conftest.py skips these, and triton stays unimported
    from tandem.engine.kernels.fused import rms_norm, rotary_embedding, silu_and_mul
    from tandem.engine.kernels.kv_write import write_kv
    from tandem.engine.kernels.paged_attention import (paged_attention, paged_decode_attention,
                                                paged_prefill_attention)

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16
BF16_TOL = 1e-2


@pytest.fixture(autouse=True)
def _no_tf32():
    # the fp32 references must be fp32, not tf32
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = old


def rel_err(out, ref):
    assert not out.isnan().any(), "output has unwritten (NaN) elements"
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def make_batch(seed, query_lens, ctx_lens, num_layers=2, layer=1):
    """Random bf16 cache [L, 2, blocks, 16, 8, 128] (the layer's K/V are strided views), shuffled
    block tables, random q, metadata."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    seq_lens = [c + q for c, q in zip(ctx_lens, query_lens)]
    blocks_per_seq = [-(-s // BLOCK) for s in seq_lens]
    num_blocks = sum(blocks_per_seq) + 8
    kv = torch.randn(num_blocks, num_layers, 2, BLOCK, KV_HEADS, HEAD_DIM, generator=gen,
                     device="cuda", dtype=torch.bfloat16).permute(1, 2, 0, 3, 4, 5)
    order = torch.randperm(num_blocks, generator=gen, device="cuda").int()
    tables = torch.zeros(len(seq_lens), max(blocks_per_seq) + 1, dtype=torch.int32, device="cuda")
    used = 0
    for b, n in enumerate(blocks_per_seq):
        tables[b, :n] = order[used:used + n]
        used += n
    meta = AttentionMetadata(
        slot_mapping=torch.empty(0, dtype=torch.int64, device="cuda"),
        query_start_loc=torch.tensor([0] + query_lens, device="cuda").cumsum(0).int(),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device="cuda"),
        block_tables=tables, query_lens_cpu=list(query_lens), seq_lens_cpu=seq_lens,
        max_query_len=max(query_lens), max_seq_len=max(seq_lens))
    q = torch.randn(sum(query_lens), HEADS, HEAD_DIM, generator=gen, device="cuda",
                    dtype=torch.bfloat16)
    return q, kv[layer, 0], kv[layer, 1], meta


def check_attention(fn, q, k_cache, v_cache, meta, **kwargs):
    scale = HEAD_DIM ** -0.5
    ref = paged_attention_torch(q.float(), k_cache.float(), v_cache.float(), meta, scale,
                                sliding_window=kwargs.get("sliding_window"))
    out = torch.full_like(q, float("nan"))
    fn(q, k_cache, v_cache, meta, scale, out=out, **kwargs)
    torch.cuda.synchronize()
    err = rel_err(out, ref)
    assert err < BF16_TOL, err
    return err


@pytest.mark.parametrize("batch,max_ctx", [(1, 8192), (8, 8192), (64, 2048)])
def test_decode_matches_reference(batch, max_ctx):
    gen = torch.Generator().manual_seed(batch)
    ctx = torch.randint(max_ctx // 8, max_ctx, (batch,), generator=gen).tolist()
    ctx[0] = max_ctx - 1
    q, k_cache, v_cache, meta = make_batch(batch, [1] * batch, ctx)
    check_attention(paged_attention, q, k_cache, v_cache, meta)  # automatic split-K plan
    for partition_size in (None, 512):
        check_attention(paged_decode_attention, q, k_cache, v_cache, meta,
                        partition_size=partition_size)


@pytest.mark.parametrize("batch", [4, 32])
def test_speculative_verify_matches_reference(batch):
    gen = torch.Generator().manual_seed(100 + batch)
    query_lens = torch.randint(1, 9, (batch,), generator=gen).tolist()  # 1 + k, k <= 7
    query_lens[0] = 16
    ctx = torch.randint(50, 4000, (batch,), generator=gen).tolist()
    q, k_cache, v_cache, meta = make_batch(200 + batch, query_lens, ctx)
    check_attention(paged_attention, q, k_cache, v_cache, meta)
    check_attention(paged_prefill_attention, q, k_cache, v_cache, meta)


@pytest.mark.parametrize("window", [4096, 1000, 64])
def test_sliding_window_matches_reference(window):
    """Mistral's window at 8B sizes: decode (whole and split-K), verify rows and prefill chunks over
    contexts longer than the window, so whole tiles and partitions fall before it."""
    q, k_cache, v_cache, meta = make_batch(window, [1] * 8, [8000, 6000, 4100, 3000, 1500, 900, 70, 5000])
    check_attention(paged_attention, q, k_cache, v_cache, meta, sliding_window=window)
    check_attention(paged_decode_attention, q, k_cache, v_cache, meta, partition_size=512,
                    sliding_window=window)
    q, k_cache, v_cache, meta = make_batch(window + 1, [1, 5, 2048, 512], [7000, 3000, 0, 6000])
    check_attention(paged_attention, q, k_cache, v_cache, meta, sliding_window=window)


@pytest.mark.parametrize("order", ["any", "decode-first"])
def test_prefill_with_cached_prefixes_matches_reference(order):
    # a fresh 2k prompt, a 512-token chunk after 6k cached, decode rows, a short turn, 1 + k rows;
    # decode-first batches run as two launches (decode kernel, then prefill kernel)
    query_lens, ctx = [2048, 512, 1, 100, 5], [0, 6000, 7000, 3000, 129]
    if order == "decode-first":
        query_lens, ctx = [1] * 24 + [5, 8] + [2048, 512, 100], [8000] * 24 + [129, 4000] + [0, 6000, 3000]
    q, k_cache, v_cache, meta = make_batch(7, query_lens, ctx)
    check_attention(paged_attention, q, k_cache, v_cache, meta)


def test_decode_replays_in_a_cuda_graph():
    # a decode step captured once replays for later steps: contexts grow in place on the device,
    # within the meta.max_seq_len bucket the graph was captured with (it sizes the split-K plan)
    q, k_cache, v_cache, meta = make_batch(11, [1] * 4, [3000, 100, 7999, 42])
    captured = AttentionMetadata(**{**meta.__dict__, "max_seq_len": 8192})
    scale = HEAD_DIM ** -0.5
    out = torch.empty_like(q)
    paged_attention(q, k_cache, v_cache, captured, scale, out=out)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        paged_attention(q, k_cache, v_cache, captured, scale, out=out)
    for step in range(1, 3):
        meta.seq_lens.add_(1)
        q.copy_(torch.randn_like(q))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        now = AttentionMetadata(**{**meta.__dict__,
                                   "seq_lens_cpu": [n + step for n in meta.seq_lens_cpu],
                                   "max_seq_len": meta.max_seq_len + step})
        ref = paged_attention_torch(q.float(), k_cache.float(), v_cache.float(), now, scale)
        assert rel_err(out, ref) < BF16_TOL, step


def test_write_kv_matches_reference():
    num_blocks, tokens = 512, 4096
    cache = torch.randn(num_blocks, 2, 2, BLOCK, KV_HEADS, HEAD_DIM, device="cuda",
                        dtype=torch.bfloat16).permute(1, 2, 0, 3, 4, 5)
    qkv = torch.randn(tokens, HEADS + 2 * KV_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    k, v = qkv[:, HEADS:HEADS + KV_HEADS], qkv[:, HEADS + KV_HEADS:]
    slots = torch.randperm(num_blocks * BLOCK, device="cuda")[:tokens]
    slots[::97] = -1
    expected = cache.clone(memory_format=torch.contiguous_format)  # flat-viewable for write_kv_torch
    keep = slots >= 0
    write_kv_torch(k[keep], v[keep], expected[1, 0], expected[1, 1], slots[keep])
    write_kv(k, v, cache[1, 0], cache[1, 1], slots)
    torch.cuda.synchronize()
    assert torch.equal(cache, expected)


@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_reference(with_residual):
    x = torch.randn(512, 4096, device="cuda", dtype=torch.bfloat16)
    residual = torch.randn_like(x) if with_residual else None
    weight = (1 + 0.1 * torch.randn(4096, device="cuda")).to(torch.bfloat16)
    summed = x + residual if with_residual else x
    xf = summed.float()
    ref = weight.float() * xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)
    out, new_residual = rms_norm(x, weight, 1e-5, residual)
    assert rel_err(out, ref) < BF16_TOL
    assert torch.equal(new_residual, summed)  # the bf16 sum, rounded as torch rounds it


def test_rotary_embedding_matches_reference():
    tokens, max_pos = 4096, 8192
    inv_freq = 1.0 / 500000.0 ** (torch.arange(0, HEAD_DIM, 2, device="cuda").float() / HEAD_DIM)
    angles = torch.arange(max_pos, device="cuda").float()[:, None] * inv_freq[None, :]
    cache = torch.cat([angles.cos(), angles.sin()], dim=-1)
    qkv = torch.randn(tokens, HEADS + 2 * KV_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    q, k = qkv[:, :HEADS], qkv[:, HEADS:HEADS + KV_HEADS]
    positions = torch.randint(0, max_pos, (tokens,), device="cuda")

    def reference(x):
        cos, sin = cache[positions].chunk(2, dim=-1)
        cos, sin = torch.cat([cos, cos], -1)[:, None], torch.cat([sin, sin], -1)[:, None]
        x1, x2 = x.float().chunk(2, dim=-1)
        return x.float() * cos + torch.cat([-x2, x1], -1) * sin

    q_ref, k_ref = reference(q), reference(k)
    rotary_embedding(q, k, positions, cache)
    assert rel_err(q, q_ref) < BF16_TOL and rel_err(k, k_ref) < BF16_TOL


def test_silu_and_mul_matches_reference():
    gate_up = torch.randn(1024, 2 * 14336, device="cuda", dtype=torch.bfloat16)
    gate, up = gate_up.float().chunk(2, dim=-1)
    assert rel_err(silu_and_mul(gate_up), torch.nn.functional.silu(gate) * up) < BF16_TOL


def test_block_copy_at_llama_sizes_matches_torch_indexing():
    """The KV transport's gather and scatter kernel on a Llama-3-8B-shaped bf16 cache: a 256 MiB
    message (8 layers x 512 shuffled blocks) out of the cache and into other blocks, equal to
    torch's index_select / index_copy_; other blocks untouched."""
    from tandem.engine.kernels.block_copy import copy_blocks

    gen = torch.Generator(device="cuda").manual_seed(5)
    cache = torch.randn(32, 2, 1100, BLOCK, KV_HEADS, HEAD_DIM, device="cuda", generator=gen).to(torch.bfloat16)
    perm = torch.randperm(1100, device="cuda", generator=gen)
    src, dst = perm[:512], perm[512:1024]
    layers = range(8, 16)
    buf = torch.empty(8, 2, 512, BLOCK, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
    copy_blocks(cache, layers, src, buf, to_buf=True)
    assert torch.equal(buf, cache[8:16].flatten(0, 1).index_select(1, src).view(buf.shape))
    ref = cache.clone()
    ref[8:16].flatten(0, 1).index_copy_(1, dst, buf.flatten(0, 1))
    copy_blocks(cache, layers, dst, buf, to_buf=False)
    assert torch.equal(cache, ref)


@pytest.mark.parametrize("check", [True, False])
def test_cache_to_cache_copy_at_llama_sizes_matches_torch_indexing(check):
    """The direct KV copy's kernel, compiled, at Llama-3-8B block rows, between caches of different
    block counts, with and without its argument checks; a source id past the cache is clamped."""
    from tandem.engine.kernels.block_copy import copy_cache_blocks

    g = torch.Generator("cuda").manual_seed(4)
    src = torch.randn(8, 2, 300, 16, 8, 128, device="cuda", generator=g).to(torch.bfloat16)
    dst = torch.zeros(8, 2, 200, 16, 8, 128, device="cuda", dtype=torch.bfloat16)
    s_ids = torch.randperm(300, device="cuda", generator=g)[:64]
    s_ids[5] = 10_000
    d_ids = torch.randperm(200, device="cuda", generator=g)[:64]
    copy_cache_blocks(src, dst, range(2, 7), s_ids, d_ids, check=check)
    ref = torch.zeros_like(dst)
    ref[2:7].index_copy_(2, d_ids, src[2:7].index_select(2, s_ids.clamp(max=299)))
    assert torch.equal(dst, ref)


def test_block_copy_compiles_once_per_direction_at_warmup():
    """Engine warmup compiles the block copy; transfers of any size, from any first layer, reuse
    those two binaries (a compile mid-serving stalls every request on the actor for a second)."""
    from tandem.engine.kernels import block_copy as bc

    cache = torch.zeros(6, 2, 64, BLOCK, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
    assert bc.compile_variants(cache) == 2
    compiled = lambda: sum(len(c[0]) for c in bc._block_copy_kernel.device_caches.values())  # noqa: E731
    before = compiled()
    for n, layers in ((37, range(1, 3)), (16, range(2, 6)), (1, range(5, 6)), (64, range(0, 6))):
        ids = torch.randperm(64, device="cuda")[:n]
        buf = torch.empty(len(layers), 2, n, BLOCK, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
        bc.copy_blocks(cache, layers, ids, buf, to_buf=True)
        bc.copy_blocks(cache, layers, ids, buf, to_buf=False)
    torch.cuda.synchronize()
    assert compiled() == before
