"""engine.kernels.mla_prepare (the latent's RMSNorm, rope on k_pe and every head's q_pe, the cache
write, in one launch) against engine.mla's torch steps, under Triton's interpreter on CPU: both rope
layouts, a rank and head count that are no power of two, q as a view of the fused projection's
output, padding rows (slot -1) writing nothing; bad input refused. bf16 on CUDA here and in
tests/gpu/test_mla_gpu.py. Also mla_decode's split query (the latent part as the W_UK product's
transposed [H, T, rank], q_pe apart) against the same query concatenated."""

import pytest
import torch

from tests.engine.test_kernels import DEVICE, make_batch, rel_err  # sets TRITON_INTERPRET first
from tandem.engine.kernels.mla_decode import mla_decode  # noqa: I001 (after the interpreter is set)
from tandem.engine.kernels.mla_prepare import mla_prepare
from tandem.engine.mla import apply_latent_rope, write_latent_torch
from tandem.engine.model import RMSNorm

CASES = {  # name: (tokens, heads, nope, rank, rope, interleave)
    "v2-lite-like": (3, 4, 16, 32, 8, True),
    "odd-sizes-rotate-half": (5, 3, 8, 24, 12, False),
}
DTYPES = [torch.float32] + ([torch.bfloat16] if torch.cuda.is_available() else [])


def _inputs(gen, tokens, heads, nope, rank, rope, dtype):
    proj = torch.randn(tokens, heads * (nope + rope) + rank + rope, generator=gen)  # the fused GEMM's output
    cos_sin = torch.randn(64, rope, generator=gen)
    positions = torch.randint(0, 64, (tokens,), generator=gen)
    weight = 1 + 0.1 * torch.randn(rank, generator=gen)
    cache = torch.randn(6, 4, 1, rank + rope, generator=gen)
    slots = torch.randperm(24, generator=gen)[:tokens]
    slots[1] = -1  # a graph's padding row
    to = lambda t: t.to(DEVICE)  # noqa: E731
    return (to(proj.to(dtype)), to(cos_sin), to(positions), to(weight.to(dtype)), to(cache.to(dtype)), to(slots))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", list(CASES))
def test_mla_prepare_matches_torch(case, dtype):
    tokens, heads, nope, rank, rope, interleave = CASES[case]
    proj, cos_sin, positions, weight, cache, slots = _inputs(torch.Generator().manual_seed(1), tokens, heads, nope,
                                                            rank, rope, dtype)
    q = proj[:, :heads * (nope + rope)].view(tokens, heads, nope + rope)
    kv = proj[:, heads * (nope + rope):]
    ref_cache = cache.clone()
    norm = RMSNorm(rank, 1e-6).to(DEVICE, dtype)
    norm.weight.data.copy_(weight)
    c, k_pe = kv.split([rank, rope], dim=-1)
    ref_q_pe = apply_latent_rope(q[..., nope:], positions, cos_sin, interleave)
    k_rot = apply_latent_rope(k_pe[:, None], positions, cos_sin, interleave)[:, 0]
    keep = slots >= 0
    write_latent_torch(torch.cat([norm(c), k_rot], dim=-1)[keep], ref_cache, slots[keep])

    q_pe = mla_prepare(q, kv, positions, cos_sin, weight, 1e-6, cache, slots, nope, interleave)
    bound = 1e-5 if dtype == torch.float32 else 1e-2
    assert q_pe.shape == (tokens, heads, rope) and q_pe.dtype == dtype
    assert rel_err(q_pe.float().cpu(), ref_q_pe.float().cpu()) < bound
    assert rel_err(cache.float().cpu(), ref_cache.float().cpu()) < bound
    assert torch.equal(cache.view(-1, rank + rope)[-1], ref_cache.view(-1, rank + rope)[-1])  # slot -1: untouched


def test_mla_prepare_refuses_bad_input():
    proj, cos_sin, positions, weight, cache, slots = _inputs(torch.Generator().manual_seed(2), 3, 4, 16, 32, 8,
                                                            torch.float32)
    q, kv = proj[:, :96].view(3, 4, 24), proj[:, 96:]
    with pytest.raises(ValueError, match="nope"):
        mla_prepare(q, kv, positions, cos_sin, weight, 1e-6, cache, slots, 12, True)
    with pytest.raises(ValueError, match="norm_weight"):
        mla_prepare(q, kv, positions, cos_sin, weight[:16], 1e-6, cache, slots, 16, True)
    with pytest.raises(ValueError, match="cos_sin"):
        mla_prepare(q, kv, positions, cos_sin.double(), weight, 1e-6, cache, slots, 16, True)
    with pytest.raises(ValueError, match="tokens"):
        mla_prepare(q, kv[:2], positions, cos_sin, weight, 1e-6, cache, slots, 16, True)


def test_mla_decode_split_query_matches_the_concatenated_one():
    gen = torch.Generator().manual_seed(3)
    heads, rank, rope = 20, 24, 8
    q, cache, _, meta = make_batch(gen, [2, 1, 3], [30, 5, 12], heads, 1, rank + rope, 16)
    whole = mla_decode(q, cache, meta, rank, 0.3, splits=2)
    q_lat = q[..., :rank].transpose(0, 1).contiguous().transpose(0, 1)  # [T, H, rank] laid out [H, T, rank]
    split = mla_decode(q_lat, cache, meta, rank, 0.3, splits=2, q_pe=q[..., rank:].contiguous())
    assert split.transpose(0, 1).is_contiguous()  # W_UV's batched GEMM reads it as [H, T, rank]
    assert rel_err(split.cpu(), whole.cpu()) < 1e-6
    with pytest.raises(ValueError, match="q_pe"):
        mla_decode(q_lat, cache, meta, rank, 0.3, q_pe=q[..., rank + 1:].contiguous())
