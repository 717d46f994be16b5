"""The absorbed form's fused launches for small steps (engine.mla.LatentAttention.fused_absorb) under
Triton's interpreter on CPU:

- mla_prepare_uk (W_UK in the prepare launch) against torch.bmm, with mla_prepare's q_pe and cache
  write; the merge with W_UV (engine.kernels.mla_decode.merge_partials) against the plain merge then
  torch.bmm, splits 1 and more (some slices empty). fp32 and bf16: these kernels multiply with tl.sum,
  not tl.dot (whose bf16 the interpreter computes wrongly, tests/engine/test_mla_kernels.py), but the
  interpreter rounds fp32 to bf16 by truncation where the GPU rounds to nearest, hence the bf16 bound
  1e-2 (tests/engine/test_kernels.py's). That bound would admit a moved rounding point, so one test
  holds the W_UV product to o_lat rounded first, on inputs where that decides an exact 0.
- the layer's attention (`_attend` on the Triton path) against its plain-torch path in float64, from 1
  token to the pair limit: decode and verify batches, graph padding rows (slot -1), splits 1 and more,
  launch blocks that cut the rank and v with a partial last block; spies check the fused kernels ran,
  and that past the limit, or with the flag off, the bmm form runs. bf16 on CUDA only (tl.dot)."""

import copy
import functools

import pytest
import torch

from tests.engine.test_kernels import DEVICE, rel_err  # sets TRITON_INTERPRET first
from tandem.engine.attention import AttentionMetadata  # noqa: I001 (after the interpreter is set)
from tandem.engine.config import MLAConfig, ModelConfig
from tandem.engine.kernels import mla_decode as decode_mod
from tandem.engine.kernels import mla_prepare as prepare_mod
from tandem.engine.mla import LatentAttention, LatentRotary

BF16 = 1e-2
KERNEL_DTYPES = [(torch.float32, 1e-5), (torch.bfloat16, BF16)]


def _small_blocks(monkeypatch):
    """Launch blocks that cut rank 24-32 and v 12-20 into several, the last partial."""
    monkeypatch.setattr(prepare_mod, "UK_BLOCK", 16)
    monkeypatch.setitem(decode_mod.UV_LAUNCH, "block_v", 8)
    monkeypatch.setitem(decode_mod.UV_LAUNCH, "chunk_r", 16)
    monkeypatch.setattr(decode_mod, "UV_GEMV_ROWS", 8)


def _prepare_inputs(gen, tokens, heads, nope, rank, rope, v, dtype):
    proj = torch.randn(tokens, heads * (nope + rope) + rank + rope, generator=gen)  # the fused GEMM's output
    w = torch.randn(heads * (nope + v), rank, generator=gen) * rank ** -0.5  # kv_b_proj.weight
    cos_sin = torch.randn(64, rope, generator=gen)
    positions = torch.randint(0, 64, (tokens,), generator=gen)
    norm = 1 + 0.1 * torch.randn(rank, generator=gen)
    cache = torch.randn(2 * tokens + 2, 4, 1, rank + rope, generator=gen)
    slots = torch.randperm(cache.shape[0] * 4 - 1, generator=gen)[:tokens]  # the last slot never written
    slots[tokens // 2] = -1  # a graph's padding row
    to = lambda t, d=dtype: t.to(DEVICE, d)  # noqa: E731
    return to(proj), to(w), to(cos_sin, torch.float32), to(positions, torch.int64), to(norm), to(cache), to(slots,
                                                                                                          torch.int64)


@pytest.mark.parametrize("dtype,bound", KERNEL_DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("tokens,heads,nope,rank,v,interleave,small", [
    (1, 4, 16, 32, 12, True, False), (5, 3, 8, 24, 20, False, True), (16, 4, 16, 32, 12, True, True)],
    ids=["1-token", "odd-sizes-rotate-half-small-blocks", "16-tokens-small-blocks"])
def test_prepare_uk_matches_bmm(tokens, heads, nope, rank, v, interleave, small, dtype, bound, monkeypatch):
    if small:
        _small_blocks(monkeypatch)
    rope = 8
    proj, w, cos_sin, positions, norm, cache, slots = _prepare_inputs(torch.Generator().manual_seed(tokens), tokens,
                                                                     heads, nope, rank, rope, v, dtype)
    q = proj[:, :heads * (nope + rope)].view(tokens, heads, nope + rope)
    kv = proj[:, heads * (nope + rope):]
    w_uk = w.view(heads, nope + v, rank)[:, :nope]
    ref_cache = cache.clone()
    ref_q_pe = prepare_mod.mla_prepare(q, kv, positions, cos_sin, norm, 1e-6, ref_cache, slots, nope, interleave)
    ref_q_lat = torch.bmm(q[..., :nope].double().transpose(0, 1), w_uk.double()).transpose(0, 1)

    q_lat, q_pe = prepare_mod.mla_prepare_uk(q, kv, positions, cos_sin, norm, 1e-6, cache, slots, nope, interleave,
                                             w_uk)
    assert q_lat.shape == (tokens, heads, rank) and q_lat.dtype == dtype and q_pe.dtype == dtype
    assert rel_err(q_lat.cpu(), ref_q_lat.cpu()) < bound
    assert torch.equal(q_pe, ref_q_pe) and torch.equal(cache, ref_cache)  # the per-token work as mla_prepare's


def _partials(gen, tokens, heads, splits, block_r):
    """Random (acc, ml) as the partial kernel leaves them: slice 1 of every other token empty."""
    acc = torch.randn(tokens, heads, splits, block_r, generator=gen)
    ml = torch.stack([torch.randn(tokens, heads, splits, generator=gen),
                      torch.rand(tokens, heads, splits, generator=gen) + 0.5], dim=-1)
    if splits > 1:
        ml[::2, :, 1, 0], ml[::2, :, 1, 1] = float("-inf"), 0.0
        acc[::2, :, 1] = 0.0
    return acc.to(DEVICE), ml.to(DEVICE)


@pytest.mark.parametrize("dtype,bound", KERNEL_DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("tokens,heads,rank,v,splits,small", [
    (1, 4, 32, 12, 1, False), (3, 3, 24, 20, 5, True), (16, 4, 32, 12, 2, True)],
    ids=["1-token-1-split", "rank24-5-splits-small-blocks", "16-tokens-2-splits-small-blocks"])
def test_merge_with_w_uv_matches_merge_then_bmm(tokens, heads, rank, v, splits, small, dtype, bound, monkeypatch):
    if small:
        _small_blocks(monkeypatch)
    gen = torch.Generator().manual_seed(10 + tokens)
    acc, ml = _partials(gen, tokens, heads, splits, 32)
    w = (torch.randn(heads * (16 + v), rank, generator=gen) * rank ** -0.5).to(DEVICE, dtype)
    w_uv = w.view(heads, 16 + v, rank)[:, 16:]
    o_lat = decode_mod.merge_partials(acc, ml, rank, dtype)  # the plain merge: o_lat rounded to dtype
    ref = torch.bmm(o_lat.double().transpose(0, 1), w_uv.double().transpose(1, 2)).transpose(0, 1)
    out = decode_mod.merge_partials(acc, ml, rank, dtype, w_uv)
    assert out.shape == (tokens, heads, v) and out.dtype == dtype and out.is_contiguous()
    assert rel_err(out.cpu(), ref.cpu()) < bound


@pytest.mark.parametrize("block", [8, 16])
def test_merge_by_rank_blocks_matches_whole_rank(block, monkeypatch):
    """The plain merge with several programs per (token, head) (MERGE_RANK_BLOCK) gives the whole-rank
    merge's bits, rank 24 in blocks of 8 and 16 (the last partial), some slices empty."""
    gen = torch.Generator().manual_seed(7)
    acc, ml = _partials(gen, 3, 4, 5, 32)
    whole = decode_mod.merge_partials(acc, ml, 24, torch.float32)
    monkeypatch.setattr(decode_mod, "MERGE_RANK_BLOCK", block)
    blocked = decode_mod.merge_partials(acc, ml, 24, torch.float32)
    assert blocked.shape == whole.shape == (3, 4, 24)
    assert torch.equal(blocked, whole)


@pytest.mark.parametrize("dtype,bound", KERNEL_DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("tokens,heads,rank,v,rows", [(1, 4, 32, 12, 16), (3, 3, 24, 20, 8)])
def test_uv_gemv_matches_bmm(tokens, heads, rank, v, rows, dtype, bound, monkeypatch):
    """apply_uv (W_UV's own launch after the merge) on the merge's [H, T, rank] layout against
    torch.bmm in fp64, blocks of `rows` outputs (the last partial where v is not a multiple)."""
    monkeypatch.setattr(decode_mod, "UV_GEMV_ROWS", rows)
    gen = torch.Generator().manual_seed(tokens + rank)
    o_lat = torch.randn(heads, tokens, rank, generator=gen).to(DEVICE, dtype).transpose(0, 1)  # [T, H, rank] view
    w = (torch.randn(heads * (16 + v), rank, generator=gen) * rank ** -0.5).to(DEVICE, dtype)
    w_uv = w.view(heads, 16 + v, rank)[:, 16:]  # kv_b_proj's V rows per head: a view, rows contiguous
    out = decode_mod.apply_uv(o_lat, w_uv)
    ref = torch.bmm(o_lat.double().transpose(0, 1), w_uv.double().transpose(1, 2)).transpose(0, 1)
    assert out.shape == (tokens, heads, v) and out.dtype == dtype and out.is_contiguous()
    assert rel_err(out.cpu(), ref.cpu()) < bound
    with pytest.raises(ValueError, match="w_uv"):
        decode_mod.apply_uv(o_lat, w_uv[:, :, :8])


def test_merge_rounds_o_lat_before_w_uv():
    """The W_UV product reads o_lat rounded to bf16, as the bmm form's (whose merge stores it): with
    o_lat[0] = 1 + 2^-9 (a quarter of bf16's step at 1, so it rounds to 1 either way) and o_lat[1] = 1,
    the row W_UV[0] = e0 - e1 gives exactly 0, and 2^-9 if the product took o_lat unrounded."""
    acc = torch.zeros(2, 3, 1, 32)
    acc[..., 0, 0], acc[..., 0, 1], acc[..., 0, 2] = 1 + 2 ** -9, 1.0, 3.0
    ml = torch.tensor([0.0, 1.0]).expand(2, 3, 1, 2).contiguous()  # one slice: max 0, sum 1, so o_lat = acc
    w_uv = torch.zeros(3, 2, 32)
    w_uv[:, 0, 0], w_uv[:, 0, 1], w_uv[:, 1, 2] = 1.0, -1.0, 2.0
    out = decode_mod.merge_partials(acc.to(DEVICE), ml.to(DEVICE), 32, torch.bfloat16, w_uv.to(DEVICE, torch.bfloat16))
    assert out[..., 0].eq(0).all() and out[..., 1].eq(6).all()


def test_bad_weights_are_refused():
    proj, w, cos_sin, positions, norm, cache, slots = _prepare_inputs(torch.Generator().manual_seed(0), 3, 4, 16, 32,
                                                                     8, 12, torch.float32)
    q, kv = proj[:, :96].view(3, 4, 24), proj[:, 96:]
    w3 = w.view(4, 28, 32)
    with pytest.raises(ValueError, match="w_uk"):
        prepare_mod.mla_prepare_uk(q, kv, positions, cos_sin, norm, 1e-6, cache, slots, 16, True, w3[:, :12])
    with pytest.raises(ValueError, match="w_uk"):
        prepare_mod.mla_prepare_uk(q, kv, positions, cos_sin, norm, 1e-6, cache, slots, 16, True,
                                   w3[:, :16].double())
    meta = AttentionMetadata(slot_mapping=slots, query_start_loc=torch.tensor([0, 3], dtype=torch.int32),
                             seq_lens=torch.tensor([3], dtype=torch.int32), block_tables=torch.zeros(1, 2, dtype=torch.int32),
                             query_lens_cpu=[3], seq_lens_cpu=[3], max_query_len=3, max_seq_len=3)
    q_lat = torch.randn(3, 4, 32)
    with pytest.raises(ValueError, match="w_uv"):
        decode_mod.mla_decode(q_lat, cache, meta, 32, 0.3, q_pe=torch.randn(3, 4, 8), w_uv=w3[:3, 16:])
    with pytest.raises(ValueError, match="w_uv"):
        decode_mod.mla_decode(q_lat, cache, meta, 32, 0.3, q_pe=torch.randn(3, 4, 8), w_uv=w3[:, 16:, :24])


# the layer's attention: name -> (query_lens, ctx_lens, padding rows, heads, rank, v, interleave, splits, small blocks)
LAYER_CASES = {
    "decode-1-token": ([1], [20], 0, 4, 32, 12, True, None, False),
    "decode-3-padded-split1": ([1, 1, 1], [0, 9, 33], 1, 4, 32, 12, True, 1, True),
    "verify-rank24-split3-padded": ([4, 3], [10, 25], 1, 3, 24, 20, False, 3, True),
    "verify-at-the-limit": ([4, 4, 4, 4], [5, 0, 12, 30], 0, 4, 32, 12, True, 2, False),
    "20-heads-two-head-blocks": ([1, 2], [7, 15], 0, 20, 32, 16, True, 2, False),
}
LAYER_DTYPES = [(torch.float32, 1e-4)] + ([(torch.bfloat16, 2e-2)] if torch.cuda.is_available() else [])


def _layer(heads, rank, v, interleave, dtype, seed=0):
    cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=heads,
                      num_kv_heads=heads, head_dim=24, architecture="DeepseekV2ForCausalLM",
                      mla=MLAConfig(q_lora_rank=None, kv_lora_rank=rank, qk_nope_head_dim=16, qk_rope_head_dim=8,
                                    v_head_dim=v, rope_interleave=interleave))
    torch.manual_seed(seed)
    attn = LatentAttention(cfg, 0)
    for name, p in attn.named_parameters():
        p.data = (1 + 0.1 * torch.randn_like(p)) if "layernorm" in name else torch.randn_like(p) * p.shape[-1] ** -0.5
    return attn.to(DEVICE, dtype), LatentRotary(cfg, 256).cos_sin.to(DEVICE)


def _step(gen, query_lens, ctx_lens, pad, latent_dim, dtype, block_size=8):
    """-> (x rows, positions, kv_cache [1, 1, blocks, block_size, 1, D], meta of the padded step, meta
    of its real tokens): `pad` rows past the batch's tokens, slot -1, as a graph replays them."""
    seq_lens = [c + q for c, q in zip(ctx_lens, query_lens)]
    blocks = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks) + 2
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables = torch.zeros(len(seq_lens), max(blocks) + 1, dtype=torch.int32)
    slots, positions = [], []
    for b, (n, q_len, s) in enumerate(zip(blocks, query_lens, seq_lens)):
        row = [order.pop() for _ in range(n)]
        tables[b, :n] = torch.tensor(row, dtype=torch.int32)
        slots += [row[p // block_size] * block_size + p % block_size for p in range(s - q_len, s)]
        positions += list(range(s - q_len, s))
    n = sum(query_lens)
    kv_cache = torch.randn(1, 1, num_blocks, block_size, 1, latent_dim, generator=gen).to(DEVICE, dtype)
    to = lambda xs: torch.tensor(xs, dtype=torch.int64, device=DEVICE)  # noqa: E731
    meta = AttentionMetadata(
        slot_mapping=to(slots + [-1] * pad), query_start_loc=torch.tensor([0] + query_lens).cumsum(0).to(DEVICE, torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE), block_tables=tables.to(DEVICE),
        query_lens_cpu=list(query_lens), seq_lens_cpu=seq_lens, max_query_len=max(query_lens), max_seq_len=max(seq_lens))
    real = AttentionMetadata(**{**meta.__dict__, "slot_mapping": meta.slot_mapping[:n]})
    return torch.randn(n + pad, 32, generator=gen).to(DEVICE, dtype), to(positions + [0] * pad), kv_cache, meta, real


def _spy(monkeypatch) -> list[str]:
    """Wraps the fused kernels' wrappers: -> the names of those called, in order."""
    calls = []
    real_uk, real_merge, real_uv = prepare_mod.mla_prepare_uk, decode_mod.merge_partials, decode_mod.apply_uv
    monkeypatch.setattr(prepare_mod, "mla_prepare_uk", lambda *a, **kw: calls.append("prepare_uk") or real_uk(*a, **kw))
    monkeypatch.setattr(decode_mod, "merge_partials", lambda acc, ml, rank, dtype, w_uv=None, **kw: calls.append(
        "merge" if w_uv is None else "merge_uv") or real_merge(acc, ml, rank, dtype, w_uv, **kw))
    monkeypatch.setattr(decode_mod, "apply_uv", lambda *a: calls.append("uv") or real_uv(*a))
    return calls


UV_MODES = {"uv-in-merge": (True, True, ["prepare_uk", "merge_uv"]), "uv-gemv": (False, True, ["prepare_uk", "merge", "uv"]),
            "uv-bmm": (False, False, ["prepare_uk", "merge"])}


@pytest.mark.parametrize("uv", list(UV_MODES))
@pytest.mark.parametrize("dtype,bound", LAYER_DTYPES, ids=[str(d).removeprefix("torch.") for d, _ in LAYER_DTYPES])
@pytest.mark.parametrize("case", list(LAYER_CASES))
def test_fused_absorbed_layer_matches_the_torch_path(case, dtype, bound, uv, monkeypatch):
    query_lens, ctx_lens, pad, heads, rank, v, interleave, splits, small = LAYER_CASES[case]
    in_merge, gemv, want_calls = UV_MODES[uv]
    monkeypatch.setattr(LatentAttention, "fused_uv", in_merge)
    monkeypatch.setattr(LatentAttention, "uv_gemv", gemv)
    if small:
        _small_blocks(monkeypatch)
    attn, cos_sin = _layer(heads, rank, v, interleave, dtype)
    gen = torch.Generator().manual_seed(len(case))
    x, positions, kv_cache, meta, real = _step(gen, query_lens, ctx_lens, pad, rank + 8, dtype)
    n = sum(query_lens)
    assert attn.absorbs_in_kernels(n + pad, meta)
    ref_cache = kv_cache.double()
    ref = copy.deepcopy(attn).double()._attend(x[:n].double(), positions[:n], cos_sin, ref_cache, real, kernel=None)

    calls = _spy(monkeypatch)
    out = attn._attend(x, positions, cos_sin, kv_cache, meta, kernel=functools.partial(decode_mod.mla_decode,
                                                                                       splits=splits))
    assert calls == want_calls
    assert out.shape == (n + pad, attn.o_proj.out_features) and not out.isnan().any()
    assert rel_err(out[:n].cpu(), ref.cpu()) < bound
    assert rel_err(kv_cache.cpu(), ref_cache.cpu()) < bound  # the new latents written, nothing else touched


@pytest.mark.parametrize("flag,limit", [(True, 4), (False, 64)], ids=["past-the-limit", "flag-off"])
def test_the_bmm_form_runs_past_the_limit_or_with_the_flag_off(flag, limit, monkeypatch):
    monkeypatch.setattr(LatentAttention, "fused_absorb", flag)
    monkeypatch.setattr(LatentAttention, "fused_absorb_max_pairs", limit)
    attn, cos_sin = _layer(4, 32, 12, True, torch.float32)
    x, positions, kv_cache, meta, _ = _step(torch.Generator().manual_seed(4), [1, 1], [6, 3], 0, 40, torch.float32)
    fused = copy.deepcopy(attn)
    fused.fused_absorb, fused.fused_absorb_max_pairs = True, 64
    want = fused._attend(x, positions, cos_sin, kv_cache.clone(), meta, kernel=decode_mod.mla_decode)
    calls = _spy(monkeypatch)
    out = attn._attend(x, positions, cos_sin, kv_cache, meta, kernel=decode_mod.mla_decode)
    assert calls == ["merge"]
    assert rel_err(out, want) < 1e-5
