"""Sliding-window attention (Mistral): the Triton paged-attention kernels against the plain-torch
reference with the same window, and the reference against a dense mask written out by hand.

On CPU the kernels run under Triton's interpreter (tests/engine/conftest.py sets TRITON_INTERPRET
before triton loads). Windows are chosen to end inside a key tile, exactly on tile edges (64), and
at 1 (a token sees only itself), with contexts long enough that whole tiles and whole split-K
partitions fall before the window."""

import zlib

import pytest
import torch
import torch.nn.functional as F

from tandem.engine.attention import AttentionMetadata, paged_attention_torch
from tests.engine.test_kernels import TOL, make_batch, rel_err  # (checks Triton runs here first)
import tandem.engine.kernels.paged_attention as pa

CASES = {
    # name: (query_lens, ctx_lens, heads, kv_heads, head_dim, block_size, window)
    "decode-w50": ([1, 1, 1], [5, 90, 300], 4, 2, 16, 16, 50),
    "decode-w64-tile-edge": ([1, 1], [64, 200], 2, 1, 32, 16, 64),
    "verify-w1": ([4, 3], [40, 130], 4, 2, 16, 16, 1),
    "prefill-w20": ([40, 7, 70], [0, 30, 100], 4, 2, 16, 16, 20),
    "prefill-w100-long": ([150], [60], 2, 2, 16, 32, 100),
    "mixed-w33": ([1, 2, 40], [150, 20, 90], 4, 2, 16, 16, 33),
}


def reference(q, k_cache, v_cache, meta, scale, window):
    meta64 = AttentionMetadata(**{**meta.__dict__, "seq_lens": meta.seq_lens.cpu(),
                                  "block_tables": meta.block_tables.cpu()})
    return paged_attention_torch(q.cpu().double(), k_cache.cpu().double(), v_cache.cpu().double(),
                                 meta64, scale, sliding_window=window)


def _batch(case):
    query_lens, ctx_lens, heads, kv_heads, head_dim, block_size, window = CASES[case]
    gen = torch.Generator().manual_seed(zlib.crc32(case.encode()))
    q, k_cache, v_cache, meta = make_batch(gen, query_lens, ctx_lens, heads, kv_heads, head_dim, block_size)
    return q, k_cache, v_cache, meta, head_dim ** -0.5, window


@pytest.mark.parametrize("case", list(CASES))
def test_kernels_mask_keys_older_than_the_window(case):
    q, k_cache, v_cache, meta, scale, window = _batch(case)
    ref = reference(q, k_cache, v_cache, meta, scale, window)
    full = reference(q, k_cache, v_cache, meta, scale, None)
    assert rel_err(full, ref) > 1e-2, "the case must have keys outside the window"
    out = torch.full_like(q, float("nan"))
    pa.paged_attention(q, k_cache, v_cache, meta, scale, out=out, sliding_window=window)
    assert rel_err(out, ref) < TOL[torch.float32]
    out.fill_(float("nan"))
    pa.paged_prefill_attention(q, k_cache, v_cache, meta, scale, out=out, sliding_window=window)
    assert rel_err(out, ref) < TOL[torch.float32]


@pytest.mark.parametrize("case", ["decode-w50", "decode-w64-tile-edge", "verify-w1"])
@pytest.mark.parametrize("partition", [None, 64])
def test_split_decode_with_partitions_before_the_window(case, partition):
    q, k_cache, v_cache, meta, scale, window = _batch(case)
    ref = reference(q, k_cache, v_cache, meta, scale, window)
    out = torch.full_like(q, float("nan"))
    pa.paged_decode_attention(q, k_cache, v_cache, meta, scale, out=out, partition_size=partition,
                              sliding_window=window)
    assert rel_err(out, ref) < TOL[torch.float32]


def test_bad_window_is_refused_by_the_wrapper():
    q, k_cache, v_cache, meta, scale, _ = _batch("decode-w50")
    with pytest.raises(ValueError, match="sliding_window"):
        pa.paged_attention(q, k_cache, v_cache, meta, scale, sliding_window=0)


def test_reference_window_is_transformers_mask():
    """Query at position p sees keys (p - W, p]: a dense mask written out, against the paged path
    for one sequence with a cached prefix (query rows at positions ctx .. ctx + n - 1)."""
    gen = torch.Generator().manual_seed(7)
    ctx, n, window = 30, 12, 9
    q, k_cache, v_cache, meta = make_batch(gen, [n], [ctx], 2, 2, 16, 16)
    q, k_cache, v_cache = q.cpu().double(), k_cache.cpu().double(), v_cache.cpu().double()
    table = meta.block_tables[0].cpu().long()
    k = k_cache[table].flatten(0, 1)[:ctx + n].transpose(0, 1)  # [H, L, D]
    v = v_cache[table].flatten(0, 1)[:ctx + n].transpose(0, 1)
    qpos = torch.arange(ctx, ctx + n)[:, None]
    kpos = torch.arange(ctx + n)[None, :]
    mask = (kpos <= qpos) & (qpos - kpos < window)
    dense = F.scaled_dot_product_attention(q.transpose(0, 1), k, v, attn_mask=mask, scale=0.25)
    meta_cpu = AttentionMetadata(**{**meta.__dict__, "seq_lens": meta.seq_lens.cpu(),
                                    "block_tables": meta.block_tables.cpu()})
    paged = paged_attention_torch(q, k_cache, v_cache, meta_cpu, 0.25, sliding_window=window)
    assert torch.allclose(paged, dense.transpose(0, 1), atol=1e-12)
