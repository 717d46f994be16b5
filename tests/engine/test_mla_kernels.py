"""engine.kernels.mla_decode against engine.mla.latent_attention_torch (float64), under Triton's
interpreter on CPU (tests/engine/test_kernels.py sets it up and says how errors are bounded):
decode and verify batches, context slices merged (splits 1 to 5, including empty slices), a rank
that is no power of two, head counts below and above one head block; bad input refused. bf16 runs
on CUDA only (and in tests/gpu/test_mla_gpu.py): Triton 3.9's interpreter computes bf16 tl.dot wrongly
(the existing attention kernels' CPU tests are fp32-only for the same reason)."""

import pytest
import torch

from tests.engine.test_kernels import DEVICE, make_batch, rel_err  # sets TRITON_INTERPRET first
from tandem.engine.attention import AttentionMetadata  # noqa: I001 (after the interpreter is set)
from tandem.engine.kernels.mla_decode import choose_splits, mla_decode, token_positions
from tandem.engine.mla import latent_attention_torch

CASES = {
    # name: (query_lens, ctx_lens, heads, rank, rope, block_size, splits)
    "decode-4heads": ([1, 1, 1], [0, 21, 70], 4, 32, 8, 16, None),
    "decode-split3": ([1, 1], [40, 95], 16, 32, 8, 16, 3),
    "verify-20heads": ([4, 1, 3, 5], [30, 0, 65, 12], 20, 24, 8, 16, 2),
    "one-seq-split5-empty-slices": ([2], [7], 4, 32, 16, 8, 5),
}


def _reference(q, cache, meta, rank, scale):
    meta64 = AttentionMetadata(**{**meta.__dict__, "block_tables": meta.block_tables.cpu()})
    return latent_attention_torch(q.cpu().double(), cache.cpu().double(), rank, meta64, scale)


DTYPES = [(torch.float32, 1e-4)] + ([(torch.bfloat16, 2e-2)] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("dtype,bound", DTYPES)
@pytest.mark.parametrize("case", list(CASES))
def test_mla_decode_matches_torch(case, dtype, bound):
    query_lens, ctx_lens, heads, rank, rope, block_size, splits = CASES[case]
    gen = torch.Generator().manual_seed(hash(case) % 1000)
    q, cache, _, meta = make_batch(gen, query_lens, ctx_lens, heads, 1, rank + rope, block_size, dtype=dtype)
    scale = (rank + rope) ** -0.5 * 0.7
    out = mla_decode(q, cache, meta, rank, scale, splits=splits)
    assert out.shape == (q.shape[0], heads, rank) and out.dtype == dtype
    assert rel_err(out.cpu(), _reference(q, cache, meta, rank, scale)) < bound


def test_token_positions_and_padding_rows():
    """Each token's sequence and visible length; graph padding rows clamp into the last sequence."""
    meta = AttentionMetadata(slot_mapping=torch.zeros(0), query_start_loc=torch.tensor([0, 3, 4], dtype=torch.int32),
                             seq_lens=torch.tensor([10, 5], dtype=torch.int32), block_tables=torch.zeros(2, 1),
                             query_lens_cpu=[3, 1], seq_lens_cpu=[10, 5], max_query_len=3, max_seq_len=10)
    seq, kv_len = token_positions(meta, 6)
    assert seq.tolist() == [0, 0, 0, 1, 1, 1]
    assert kv_len[:4].tolist() == [8, 9, 10, 5] and (kv_len >= 1).all()


def test_choose_splits():
    assert choose_splits(1, 16, 132) == 32  # batch 1: slices fill the GPU (capped)
    assert choose_splits(64, 16, 132) == 4  # 256 programs: about one wave of 132 SMs
    assert choose_splits(512, 16, 132) == 1  # a big verify step fills it already


def test_bad_input_is_refused():
    gen = torch.Generator().manual_seed(0)
    q, cache, _, meta = make_batch(gen, [1], [5], 4, 1, 40, 16)
    with pytest.raises(ValueError, match="rank"):
        mla_decode(q, cache, meta, 40, 1.0)
    with pytest.raises(ValueError, match="must be"):
        mla_decode(q[..., :32], cache, meta, 24, 1.0)
    with pytest.raises(ValueError, match="dtype"):
        mla_decode(q.half(), cache, meta, 32, 1.0)
    assert DEVICE is not None
