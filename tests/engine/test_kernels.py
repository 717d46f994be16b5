"""Every Triton kernel of engine.kernels against its plain-torch reference, on small shapes.

On CPU they run under Triton's interpreter: TRITON_INTERPRET=1 must be set before triton is first
imported in the process (tests/engine/conftest.py does it, and so does the top of this module).
Inputs are fresh random draws per case; outputs are poisoned with NaN before each run and must come
back fully written. Error is ||out - ref|| / ||ref|| against a float64 reference on the same inputs:
in fp32 (full-precision dots) the kernels land near 1e-7, so 1e-4 is a loose bound that any
indexing or masking mistake (an O(1) error) still breaks; fp16 operands (P @ V in fp16, output
rounding) land near 3e-4, bound 3e-3; bf16 near 3e-3, bound 1e-2."""

import os
import sys
import zlib

import torch

if not torch.cuda.is_available() and "TRITON_INTERPRET" not in os.environ:
    # Triton 3.9 decides interpreter-or-compiler for its own library functions (tl.zeros, ...) when
    # triton is first imported, so the variable must be set before that, in this process
    if "triton" in sys.modules:
        raise RuntimeError("triton was imported before TRITON_INTERPRET=1 was set, so its kernels "
                           "cannot run on CPU; set it in a conftest.py above this module or in the "
                           "environment (TRITON_INTERPRET=1 pytest ...)")
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

from tandem.engine.attention import AttentionMetadata, paged_attention_torch, write_kv_torch  # noqa: E402
from tandem.engine.kernels import triton_available  # noqa: E402

if not triton_available():  # a missing install must fail CI, not hide the kernels' tests
    pytest.fail("Triton is not installed, or there is no CUDA and TRITON_INTERPRET is off; "
                "`make setup` installs triton", pytrace=False)

from tandem.engine.kernels.block_copy import copy_blocks  # noqa: E402
from tandem.engine.kernels.fused import rms_norm, rotary_embedding, silu_and_mul  # noqa: E402
from tandem.engine.kernels.kv_write import write_kv  # noqa: E402
import tandem.engine.kernels.paged_attention as pa  # noqa: E402
from tandem.engine.kernels.paged_attention import (_launch_prefill, choose_partition_size,  # noqa: E402
                                            paged_attention, paged_decode_attention,
                                            paged_prefill_attention)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-4, torch.float16: 3e-3, torch.bfloat16: 1e-2}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert not out.isnan().any(), "output has unwritten (NaN) elements"
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def make_batch(gen, query_lens, ctx_lens, num_heads, num_kv_heads, head_dim, block_size,
               dtype=torch.float32, num_layers=2, layer=1, spare_blocks=3):
    """A random paged cache (the layer's K/V are views into [L, 2, blocks, bs, Hkv, D]), shuffled
    block tables, random q, and the metadata of the batch."""
    seq_lens = [c + q for c, q in zip(ctx_lens, query_lens)]
    blocks_per_seq = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    # block-major storage seen as [L, 2, blocks, ...]: the layer's views are offset AND strided
    kv = torch.randn(num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim, generator=gen)
    kv = kv.to(dtype).permute(1, 2, 0, 3, 4, 5)
    order = torch.randperm(num_blocks, generator=gen).tolist()
    width = max(blocks_per_seq) + 2  # rows padded with 0 past each sequence's blocks
    tables = torch.zeros(len(seq_lens), width, dtype=torch.int32)
    slots = []
    for b, (n, q_len, s) in enumerate(zip(blocks_per_seq, query_lens, seq_lens)):
        row = [order.pop() for _ in range(n)]
        tables[b, :n] = torch.tensor(row, dtype=torch.int32)
        slots += [row[p // block_size] * block_size + p % block_size for p in range(s - q_len, s)]
    starts = torch.tensor([0] + query_lens).cumsum(0).to(torch.int32)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=DEVICE),
        query_start_loc=starts.to(DEVICE),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        block_tables=tables.to(DEVICE),
        query_lens_cpu=list(query_lens), seq_lens_cpu=seq_lens,
        max_query_len=max(query_lens), max_seq_len=max(seq_lens))
    q = torch.randn(sum(query_lens), num_heads, head_dim, generator=gen).to(dtype).to(DEVICE)
    kv = kv.to(DEVICE)
    return q, kv[layer, 0], kv[layer, 1], meta


def reference(q, k_cache, v_cache, meta, scale):
    meta64 = AttentionMetadata(**{**meta.__dict__, "seq_lens": meta.seq_lens.cpu(),
                                  "block_tables": meta.block_tables.cpu()})
    return paged_attention_torch(q.cpu().double(), k_cache.cpu().double(), v_cache.cpu().double(),
                                 meta64, scale)


ATTENTION_CASES = {
    # name: (query_lens, ctx_lens, heads, kv_heads, head_dim, block_size)
    "decode-mha-bs16": ([1, 1, 1], [0, 21, 70], 2, 2, 32, 16),
    "decode-gqa4-bs32": ([1, 1], [40, 95], 8, 2, 32, 32),
    "verify-gqa3": ([4, 1, 3, 5], [30, 0, 65, 12], 6, 2, 16, 16),
    "prefill-cached-prefix-gqa2": ([20, 37, 1], [0, 45, 9], 4, 2, 32, 16),
    "prefill-mha-bs32": ([70, 5], [10, 80], 2, 2, 16, 32),
    "mixed-decode-first": ([1, 3, 40, 25], [70, 20, 10, 100], 4, 2, 32, 16),
}


@pytest.mark.parametrize("case", list(ATTENTION_CASES))
def test_paged_attention_matches_reference(case):
    query_lens, ctx_lens, heads, kv_heads, head_dim, block_size = ATTENTION_CASES[case]
    gen = torch.Generator().manual_seed(zlib.crc32(case.encode()))
    q, k_cache, v_cache, meta = make_batch(gen, query_lens, ctx_lens, heads, kv_heads, head_dim,
                                           block_size)
    assert not k_cache.is_contiguous()
    scale = head_dim ** -0.5
    ref = reference(q, k_cache, v_cache, meta, scale)
    out = torch.full_like(q, float("nan"))
    result = paged_attention(q, k_cache, v_cache, meta, scale, out=out)
    assert result is out
    assert rel_err(out, ref) < TOL[torch.float32]
    if meta.max_query_len <= 16:  # the prefill kernel must handle decode-shaped batches too
        out.fill_(float("nan"))
        paged_prefill_attention(q, k_cache, v_cache, meta, scale, out=out)
        assert rel_err(out, ref) < TOL[torch.float32]


def random_batch_shape(gen):
    """A random mix of decode (1), verify (1 + k) and prefill query lengths; contexts often sit
    next to multiples of 64 keys (the kernels' tile width), where off-by-one masks would show."""
    def pick(options):
        return options[torch.randint(len(options), (1,), generator=gen).item()]

    num_seqs = pick([1, 2, 3, 5])
    query_lens = [pick([1, 1, pick([2, 4, 6]), pick([17, 40, 90])]) for _ in range(num_seqs)]
    ctx_lens = [pick([0, 3, 64 * pick([1, 2]) + pick([-2, -1, 0, 1]), pick([30, 110])])
                for _ in range(num_seqs)]
    kv_heads, group = pick([(1, 4), (2, 1), (2, 3), (1, 2)])
    return query_lens, ctx_lens, kv_heads * group, kv_heads, pick([16, 32, 64]), pick([16, 32])


@pytest.mark.parametrize("seed", range(12))
def test_paged_attention_random_batches(seed):
    gen = torch.Generator().manual_seed(1000 + seed)
    query_lens, ctx_lens, heads, kv_heads, head_dim, block_size = random_batch_shape(gen)
    q, k_cache, v_cache, meta = make_batch(gen, query_lens, ctx_lens, heads, kv_heads, head_dim,
                                           block_size)
    ref = reference(q, k_cache, v_cache, meta, head_dim ** -0.5)
    out = torch.full_like(q, float("nan"))
    paged_attention(q, k_cache, v_cache, meta, head_dim ** -0.5, out=out)
    assert rel_err(out, ref) < TOL[torch.float32], (query_lens, ctx_lens, heads, kv_heads)


@pytest.mark.parametrize("ctx", [62, 63, 64, 65, 126])
def test_causal_boundary_next_to_tile_edge(ctx):
    # query rows at positions ctx, ctx + 1, ...: the first masked key tile starts right there, and
    # for ctx = 65 a full 64-row tile's last key opens a new key tile
    gen = torch.Generator().manual_seed(ctx)
    for query_lens, run in (([3, 70], paged_prefill_attention),
                            ([3, 16], lambda *a, **kw: paged_decode_attention(*a, **kw, partition_size=64))):
        q, k_cache, v_cache, meta = make_batch(gen, query_lens, [ctx, ctx], 2, 1, 16, 16)
        ref = reference(q, k_cache, v_cache, meta, 0.25)
        out = torch.full_like(q, float("nan"))
        run(q, k_cache, v_cache, meta, 0.25, out=out)
        assert rel_err(out, ref) < TOL[torch.float32], query_lens


@pytest.mark.parametrize("query_lens,launches", [
    ([1, 3, 1, 40, 25], [("_decode", 0, 3), ("_prefill", 3, 2)]),  # decode rows first: two kernels
    ([40, 1, 3, 1, 25], [("_prefill", 0, 5)]),  # any other order: the prefill kernel for all
])
def test_mixed_batch_dispatch(monkeypatch, query_lens, launches):
    monkeypatch.setattr(pa, "_num_sms", lambda device: 64)  # so the auto plan splits long contexts
    calls = []
    for name in ("_decode", "_prefill"):
        original = getattr(pa, name)
        def spy(*args, _name=name, _original=original, **kwargs):
            seqs = args[6]
            calls.append((_name, seqs.first, seqs.count))
            return _original(*args, **kwargs)
        monkeypatch.setattr(pa, name, spy)
    gen = torch.Generator().manual_seed(len(calls) + query_lens[0])
    q, k_cache, v_cache, meta = make_batch(gen, query_lens, [600, 20, 300, 10, 100], 4, 2, 32, 16)
    ref = reference(q, k_cache, v_cache, meta, 0.2)
    out = torch.full_like(q, float("nan"))
    paged_attention(q, k_cache, v_cache, meta, 0.2, out=out)
    assert calls == launches
    assert rel_err(out, ref) < TOL[torch.float32]


def test_prefill_small_tiles_cross_the_diagonal():
    # 16-row tiles: several query tiles per sequence, unmasked and masked key loops both run
    gen = torch.Generator().manual_seed(1)
    q, k_cache, v_cache, meta = make_batch(gen, [40, 17, 3], [29, 0, 50], 4, 1, 16, 16)
    ref = reference(q, k_cache, v_cache, meta, 0.3)
    out = torch.full_like(q, float("nan"))
    _launch_prefill(q, k_cache, v_cache, meta, 0.3, out, block_m=16, block_n=16, num_warps=4,
                    num_stages=1)
    assert rel_err(out, ref) < TOL[torch.float32]


@pytest.mark.parametrize("query_lens", [[1, 1, 1], [3, 1, 2]], ids=["decode", "verify"])
def test_decode_split_k_matches_reference(query_lens):
    gen = torch.Generator().manual_seed(len(query_lens) + sum(query_lens))
    q, k_cache, v_cache, meta = make_batch(gen, query_lens, [200, 63, 130], 4, 2, 32, 16)
    ref = reference(q, k_cache, v_cache, meta, 0.2)
    for partition_size in (64, 128, None):
        out = torch.full_like(q, float("nan"))
        paged_decode_attention(q, k_cache, v_cache, meta, 0.2, out=out, partition_size=partition_size)
        assert rel_err(out, ref) < TOL[torch.float32], partition_size


@pytest.mark.parametrize("dtype", [torch.float16], ids=["fp16"])
def test_attention_half_precision(dtype):
    # bf16 dots are wrong in Triton 3.9's interpreter (it multiplies the raw uint16 bits), so the
    # CPU run checks the 16-bit path in fp16; tests/gpu checks bf16 on the device
    gen = torch.Generator().manual_seed(7)
    for query_lens, ctx in (([1, 2], [50, 9]), ([30, 1], [20, 33])):
        q, k_cache, v_cache, meta = make_batch(gen, query_lens, ctx, 4, 2, 32, 16, dtype=dtype)
        ref = reference(q, k_cache, v_cache, meta, 0.25)
        out = torch.full_like(q, float("nan"))
        paged_attention(q, k_cache, v_cache, meta, 0.25, out=out)
        assert rel_err(out, ref) < TOL[dtype]


def test_partition_plan():
    assert choose_partition_size(64, 8, 8192, 132) is None  # 512 programs fill 132 SMs
    size = choose_partition_size(1, 8, 8192, 132)
    assert size % 64 == 0 and 8 * -(-8192 // size) >= 2 * 132 * 0.9
    assert choose_partition_size(1, 8, 100, 132) is None  # too short to split


@pytest.mark.parametrize("layout", ["layer-major", "block-major"])
@pytest.mark.parametrize("block_size", [16, 32])
def test_write_kv_matches_reference(block_size, layout):
    gen = torch.Generator().manual_seed(block_size)
    num_tokens, kv_heads, head_dim, num_blocks = 11, 2, 16, 4
    shape = (num_blocks, block_size, kv_heads, head_dim)
    if layout == "layer-major":  # [L, 2, blocks, ...]: the layer's views are offset
        cache = torch.full((2, 2, *shape), float("nan"), device=DEVICE)
    else:  # [blocks, L, 2, ...] seen as [L, 2, blocks, ...]: the views are strided too
        cache = torch.full((num_blocks, 2, 2, *shape[1:]), float("nan"), device=DEVICE)
        cache = cache.permute(1, 2, 0, 3, 4, 5)
    qkv = torch.randn(num_tokens, 3 * kv_heads, head_dim, generator=gen).to(DEVICE)
    k, v = qkv[:, kv_heads:2 * kv_heads], qkv[:, 2 * kv_heads:]  # non-contiguous views
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[[2, 7]] = -1  # padding tokens
    slots = slots.to(DEVICE)
    expected = cache.clone(memory_format=torch.contiguous_format)  # flat-viewable for write_kv_torch
    keep = slots >= 0
    write_kv_torch(k[keep], v[keep], expected[1, 0], expected[1, 1], slots[keep])
    write_kv(k, v, cache[1, 0], cache[1, 1], slots.to(torch.int32))
    torch.testing.assert_close(cache, expected, rtol=0, atol=0, equal_nan=True)


def test_write_then_attend_matches_reference():
    # one layer step: the new tokens' K/V go to meta.slot_mapping, then attention reads them back
    gen = torch.Generator().manual_seed(21)
    q, k_cache, v_cache, meta = make_batch(gen, [1, 4, 30], [50, 7, 20], 4, 2, 16, 16)
    k_new, v_new = (torch.randn(q.shape[0], 2, 16, generator=gen).to(DEVICE) for _ in range(2))
    k_ref = k_cache.clone(memory_format=torch.contiguous_format)
    v_ref = v_cache.clone(memory_format=torch.contiguous_format)
    write_kv_torch(k_new, v_new, k_ref, v_ref, meta.slot_mapping)
    ref = reference(q, k_ref, v_ref, meta, 0.25)
    write_kv(k_new, v_new, k_cache, v_cache, meta.slot_mapping)
    out = torch.full_like(q, float("nan"))
    paged_attention(q, k_cache, v_cache, meta, 0.25, out=out)
    assert rel_err(out, ref) < TOL[torch.float32]


def rms_norm_reference(x, weight, eps, residual=None):
    # Hugging Face LlamaRMSNorm, with the residual add in the model dtype before it
    if residual is not None:
        x = x + residual
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype), x


DTYPES = [torch.float32, torch.bfloat16, torch.float16]
DTYPE_IDS = ["fp32", "bf16", "fp16"]


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
def test_rms_norm_matches_reference(dtype, with_residual):
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(5, 48, generator=gen).to(dtype).to(DEVICE)
    residual = torch.randn(5, 48, generator=gen).to(dtype).to(DEVICE) if with_residual else None
    weight = (1 + 0.1 * torch.randn(48, generator=gen)).to(dtype).to(DEVICE)
    ref_out, ref_res = rms_norm_reference(x, weight, 1e-5, residual)
    out, new_res = rms_norm(x, weight, 1e-5, residual)
    assert rel_err(out, ref_out) < TOL[dtype]
    # fp32 sums are exact; in 16 bits, Triton's interpreter truncates where the GPU rounds to nearest
    assert rel_err(new_res, ref_res) < TOL[dtype] / 2
    if dtype == torch.float32 or DEVICE == "cuda":
        assert torch.equal(new_res, ref_res)
    if not with_residual:
        assert new_res is x


def rotary_reference(x, positions, cos_sin_cache):
    cos, sin = cos_sin_cache[positions].float().chunk(2, dim=-1)  # [T, D/2] each
    cos, sin = torch.cat([cos, cos], -1)[:, None], torch.cat([sin, sin], -1)[:, None]
    x1, x2 = x.float().chunk(2, dim=-1)
    return x.float() * cos + torch.cat([-x2, x1], -1) * sin


def make_cos_sin_cache(max_pos, head_dim, base=10000.0):
    inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2).float() / head_dim)
    angles = torch.arange(max_pos).float()[:, None] * inv_freq[None, :]
    return torch.cat([angles.cos(), angles.sin()], dim=-1)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_rotary_embedding_matches_reference(dtype):
    gen = torch.Generator().manual_seed(4)
    tokens, heads, kv_heads, head_dim = 6, 3, 1, 32
    qkv = torch.randn(tokens, heads + 2 * kv_heads, head_dim, generator=gen).to(dtype).to(DEVICE)
    q, k = qkv[:, :heads], qkv[:, heads:heads + kv_heads]  # in-place on views of a fused output
    v_before = qkv[:, heads + kv_heads:].clone()
    positions = torch.randint(0, 100, (tokens,), generator=gen).to(DEVICE)
    cache = make_cos_sin_cache(100, head_dim).to(DEVICE)
    q_ref, k_ref = rotary_reference(q, positions, cache), rotary_reference(k, positions, cache)
    rotary_embedding(q, k, positions, cache)
    assert rel_err(q, q_ref) < TOL[dtype] and rel_err(k, k_ref) < TOL[dtype]
    assert torch.equal(qkv[:, heads + kv_heads:], v_before)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_silu_and_mul_matches_reference(dtype):
    gen = torch.Generator().manual_seed(5)
    gate_up = torch.randn(4, 2 * 40, generator=gen).to(dtype).to(DEVICE)
    gate, up = gate_up.float().chunk(2, dim=-1)
    out = silu_and_mul(gate_up)
    assert out.shape == (4, 40)
    assert rel_err(out, torch.nn.functional.silu(gate) * up) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layers, row", [(range(0, 3), (4, 2, 8)), (range(2, 3), (3, 1, 5))])
def test_block_copy_matches_torch_indexing(dtype, layers, row):
    """Gather blocks of a run of layers into a buffer and scatter them back elsewhere: the same
    bytes as torch's index_select / index_copy_ on the block dim; no other block is touched (odd
    row sizes exercise the row mask)."""
    gen = torch.Generator().manual_seed(11)
    cache = torch.randn(4, 2, 10, *row, generator=gen).to(dtype).to(DEVICE)
    ids = torch.tensor([7, 0, 3, 9], device=DEVICE)
    buf = torch.full((len(layers), 2, 4, *row), float("nan"), dtype=dtype, device=DEVICE)
    copy_blocks(cache, layers, ids, buf, to_buf=True)
    want = cache[layers.start:layers.stop].flatten(0, 1).index_select(1, ids).view(buf.shape)
    assert torch.equal(buf, want)
    dst = torch.zeros_like(cache)
    to = torch.tensor([1, 8, 2, 5], device=DEVICE, dtype=torch.int32)
    copy_blocks(dst, layers, to, buf, to_buf=False)
    ref = torch.zeros_like(cache)
    ref[layers.start:layers.stop].flatten(0, 1).index_copy_(1, to.long(), buf.flatten(0, 1))
    assert torch.equal(dst, ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cache_to_cache_block_copy_matches_indexing_and_clamps_source_ids(dtype):
    """The direct KV copy's kernel: blocks of a run of layers, block to block between two caches
    of one layout (different block counts), against index_select/index_copy_; a source id past
    the source cache (the ids may be read from the peer's memory) reads its last block."""
    from tandem.engine.kernels.block_copy import copy_cache_blocks

    gen = torch.Generator().manual_seed(21)
    row = (4, 2, 8)
    src = torch.randn(4, 2, 10, *row, generator=gen).to(dtype).to(DEVICE)
    dst = torch.zeros(4, 2, 7, *row, dtype=dtype, device=DEVICE)
    s_ids = torch.tensor([7, 0, 3, 42], device=DEVICE)
    d_ids = torch.tensor([1, 6, 2, 5], device=DEVICE, dtype=torch.int32)
    layers = range(1, 3)
    copy_cache_blocks(src, dst, layers, s_ids, d_ids)
    ref = torch.zeros_like(dst)
    ref[1:3].index_copy_(2, d_ids.long(), src[1:3].index_select(2, s_ids.clamp(max=9)))
    assert torch.equal(dst, ref)
    assert torch.equal(dst[1:3, :, 5], src[1:3, :, 9])        # 42 -> the last block, 9
    with pytest.raises(ValueError, match="caches differ"):
        copy_cache_blocks(src, torch.zeros(4, 2, 7, 4, 2, 4, dtype=dtype, device=DEVICE), layers, s_ids, d_ids)


def test_block_copy_warmup_leaves_the_cache_unchanged():
    from tandem.engine.kernels.block_copy import compile_variants as compile_block_copy

    cache = torch.randn(3, 2, 5, 4, 2, 8, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    before = cache.clone()
    assert compile_block_copy(cache) == 2
    assert torch.equal(cache, before)


def _attention_inputs():
    gen = torch.Generator().manual_seed(9)
    return make_batch(gen, [2, 1], [5, 7], 4, 2, 16, 16)


def _bad_attention_calls():
    q, k_cache, v_cache, meta = _attention_inputs()
    wide = torch.randn(q.shape[0], q.shape[1], 32, device=DEVICE)
    meta_i64 = AttentionMetadata(**{**meta.__dict__, "seq_lens": meta.seq_lens.long()})
    meta_long = AttentionMetadata(**{**meta.__dict__, "max_query_len": 17})
    return {
        "q-int-dtype": lambda: paged_attention(q.to(torch.int32), k_cache, v_cache, meta, 1.0),
        "cache-dtype-mismatch": lambda: paged_attention(q, k_cache.half(), v_cache.half(), meta, 1.0),
        "q-2d": lambda: paged_attention(q[:, 0], k_cache, v_cache, meta, 1.0),
        "head-dim-mismatch": lambda: paged_attention(wide, k_cache, v_cache, meta, 1.0),
        "head-dim-not-pow2": lambda: paged_attention(q[..., :12], k_cache[..., :12], v_cache[..., :12], meta, 1.0),
        "heads-not-multiple": lambda: paged_attention(q[:, :3], k_cache, v_cache, meta, 1.0),
        "q-strided-last-dim": lambda: paged_attention(
            torch.randn(*q.shape[:2], 32, device=DEVICE)[..., ::2], k_cache, v_cache, meta, 1.0),
        "seq-lens-int64": lambda: paged_attention(q, k_cache, v_cache, meta_i64, 1.0),
        "token-count-mismatch": lambda: paged_attention(q[:2], k_cache, v_cache, meta, 1.0),
        "out-wrong-dtype": lambda: paged_attention(q, k_cache, v_cache, meta, 1.0, out=q.half()),
        "decode-too-long": lambda: paged_decode_attention(q, k_cache, v_cache, meta_long, 1.0),
        "bad-partition": lambda: paged_decode_attention(q, k_cache, v_cache, meta, 1.0, partition_size=100),
    }


def _bad_other_calls():
    k = torch.randn(3, 2, 16, device=DEVICE)
    cache = torch.randn(4, 16, 2, 16, device=DEVICE)
    wide = torch.randn(4, 16, 2, 32, device=DEVICE)
    slots = torch.arange(3, device=DEVICE)
    x = torch.randn(3, 48, device=DEVICE)
    return {
        "write-kv-float-slots": lambda: write_kv(k, k, cache, cache, slots.float()),
        "write-kv-heads-mismatch": lambda: write_kv(k[:, :1], k[:, :1], cache, cache, slots),
        "write-kv-slot-count": lambda: write_kv(k, k, cache, cache, slots[:2]),
        "write-kv-strided-cache": lambda: write_kv(k, k, wide[..., ::2], wide[..., ::2], slots),
        "rms-norm-weight-size": lambda: rms_norm(x, torch.ones(47, device=DEVICE), 1e-5),
        "rms-norm-residual-dtype": lambda: rms_norm(x, torch.ones(48, device=DEVICE), 1e-5, x.half()),
        "rms-norm-int": lambda: rms_norm(x.int(), torch.ones(48, device=DEVICE), 1e-5),
        "rotary-cache-width": lambda: rotary_embedding(k, k, slots, torch.randn(8, 8, device=DEVICE)),
        "rotary-positions-float": lambda: rotary_embedding(k, k, slots.float(), torch.randn(8, 16, device=DEVICE)),
        "silu-odd-width": lambda: silu_and_mul(torch.randn(3, 7, device=DEVICE)),
        "silu-3d": lambda: silu_and_mul(torch.randn(3, 2, 8, device=DEVICE)),
        "block-copy-layers-out-of-range": lambda: copy_blocks(
            torch.zeros(2, 2, 4, 3, device=DEVICE), range(1, 3), slots, torch.zeros(2, 2, 3, 3, device=DEVICE), True),
        "block-copy-buf-shape": lambda: copy_blocks(
            torch.zeros(2, 2, 4, 3, device=DEVICE), range(0, 1), slots, torch.zeros(1, 2, 2, 3, device=DEVICE), True),
        "block-copy-buf-dtype": lambda: copy_blocks(
            torch.zeros(2, 2, 4, 3, device=DEVICE), range(0, 1), slots,
            torch.zeros(1, 2, 3, 3, device=DEVICE, dtype=torch.float16), True),
        "block-copy-float-ids": lambda: copy_blocks(
            torch.zeros(2, 2, 4, 3, device=DEVICE), range(0, 1), slots.float(), torch.zeros(1, 2, 3, 3, device=DEVICE), True),
    }


@pytest.mark.parametrize("name", list(_bad_attention_calls()) + list(_bad_other_calls()))
def test_wrappers_reject_bad_arguments(name):
    calls = {**_bad_attention_calls(), **_bad_other_calls()}
    with pytest.raises(ValueError):
        calls[name]()


def test_compile_variants_launches_every_tile_and_leaves_the_cache_alone(monkeypatch):
    """Engine warmup compiles each attention variant up front; it must reach every prefill tile
    (BLOCK_M) and every decode query tile (BLOCK_Q) with and without split-K, and read only."""
    from tandem.engine.kernels import attention_split

    # first with split prefills off: the prefill tiles in one pass only (on: the end of the test)
    monkeypatch.setattr(attention_split, "POLICY", attention_split.SplitPolicy(prefill_split=False))
    seen = set()
    for name in ("_prefill_kernel", "_decode_kernel"):
        kernel = getattr(pa, name)

        class Spy:
            def __init__(self, kernel, name):
                self.kernel, self.name = kernel, name

            def __getitem__(self, grid):
                launch = self.kernel[grid]

                def run(*args, **kw):
                    seen.add((self.name, kw.get("BLOCK_M"), kw.get("BLOCK_Q"), kw.get("SPLIT"), kw.get("ROPE")))
                    return launch(*args, **kw)
                return run
        monkeypatch.setattr(pa, name, Spy(kernel, name))
    kv = torch.randn(2, 20, 16, 2, 32)   # [K/V, blocks, block_size, Hkv, D]
    before = kv.clone()
    launches = pa.compile_variants(kv[0], kv[1], num_heads=8)   # group 4: BLOCK_Q 4, 8, 16
    assert {s[1] for s in seen if s[0] == "_prefill_kernel"} == {16, 32, 64, 128}
    assert {(s[2], s[3]) for s in seen if s[0] == "_decode_kernel"} == {(q, split) for q in (4, 8, 16)
                                                                         for split in (False, True)}
    assert launches == 4 + 6 == len(seen)
    assert torch.equal(kv, before)
    # with the model's cos/sin cache: each decode tile also rotating and writing the new K/V itself
    # (as a model's decode steps launch it), every slot -1: still nothing written
    seen.clear()
    launches = pa.compile_variants(kv[0], kv[1], num_heads=8, rope_cache=make_cos_sin_cache(64, 32))
    assert {(s[2], s[3], s[4]) for s in seen if s[0] == "_decode_kernel"} == {
        (q, split, rope) for q in (4, 8, 16) for split in (False, True) for rope in (False, True)}
    assert launches == 4 + 12 == len(seen)
    assert torch.equal(kv, before)
    assert pa.compile_variants(kv[0, :8], kv[1, :8], num_heads=8) == 0   # too few blocks: skipped
    # with split prefills on (SplitPolicy.prefill_split, the default), each prefill tile split as well
    monkeypatch.setattr(attention_split, "POLICY", attention_split.SplitPolicy(prefill_split=True))
    seen.clear()
    launches = pa.compile_variants(kv[0], kv[1], num_heads=8)
    assert {(s[1], s[3]) for s in seen if s[0] == "_prefill_kernel"} == {
        (m, split) for m in (16, 32, 64, 128) for split in (False, True)}
    assert launches == 8 + 6 and torch.equal(kv, before)
