"""Split-K decode attention at Llama-3-8B sizes in bf16 on CUDA (engine.kernels.attention_split):
both merge kernels and the merge inside the launch, at the partition sizes the plan picks and at extremes (64 keys: up to 128
partitions, several merge tiles), against the fp32 torch reference, and inside a CUDA graph
captured for a longer context bucket than the step's (as the engine replays them)."""

import pytest
import torch

from tests.gpu.test_kernels_gpu import BF16_TOL, HEAD_DIM, KV_HEADS, check_attention, make_batch, rel_err

if torch.cuda.is_available():  # elsewhere conftest.py skips these, and triton stays unimported
    from tandem.engine.kernels import attention_split
    from tandem.engine.kernels.attention_split import choose_partition_size, set_split_policy
    from tandem.engine.kernels.paged_attention import _num_sms, paged_attention, paged_decode_attention


@pytest.fixture
def policy():
    old = attention_split.POLICY
    yield set_split_policy
    attention_split.POLICY = old


MERGES = {"loop-reduce": dict(vector_merge=False), "vector-merge": dict(vector_merge=True),
          "fused-merge": dict(fused_merge=True)}   # fused: the last program of each pair merges in the launch


@pytest.mark.parametrize("merge", MERGES)
@pytest.mark.parametrize("batch,ctx", [(1, 8191), (1, 1040), (4, 1040), (32, 8200)])
def test_split_decode_matches_reference(policy, merge, batch, ctx):
    policy(**MERGES[merge])
    lens = [ctx - 37 * i for i in range(batch)]
    q, k_cache, v_cache, meta = make_batch(batch * 7 + ctx, [1] * batch, lens)
    check_attention(paged_attention, q, k_cache, v_cache, meta)             # the plan in force
    for size in (64, 128, 2048):
        check_attention(paged_decode_attention, q, k_cache, v_cache, meta, partition_size=size)


@pytest.mark.parametrize("merge", MERGES)
def test_graph_of_a_context_bucket_replays_shorter_contexts(policy, merge):
    # captured with the grid of a 16384-key bucket, replayed for 8.2k-key contexts: programs past
    # a context return at once and the merge counts only the partitions the context has (fused:
    # the counters the capture's run left at 0 serve the replays)
    policy(**MERGES[merge], programs_per_sm=4, bucket_plan=True)
    batch = 32
    q, k_cache, v_cache, meta = make_batch(11, [1] * batch, [16000 - 5 * i for i in range(batch)])
    size = choose_partition_size(batch, KV_HEADS, 16384, _num_sms(q.device))
    assert size is not None and size < 8192
    out = torch.full_like(q, float("nan"))
    run = lambda: paged_decode_attention(q, k_cache, v_cache, meta, HEAD_DIM ** -0.5, out=out,  # noqa: E731
                                         partition_size=size)
    run()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    meta.seq_lens.copy_(torch.tensor([8200 - 3 * i for i in range(batch)], dtype=torch.int32, device="cuda"))
    shorter = type(meta)(**{**meta.__dict__, "seq_lens_cpu": meta.seq_lens.tolist(),
                            "max_seq_len": int(meta.seq_lens.max())})
    ref = torch.full_like(q, float("nan"))
    paged_decode_attention(q, k_cache, v_cache, shorter, HEAD_DIM ** -0.5, out=ref, partition_size=None)
    for _ in range(3):
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert rel_err(out, ref) < BF16_TOL


@pytest.mark.parametrize("query_lens,ctx", [([128], [8192]), ([32, 200], [4096, 30000]),
                                            ([1] * 16 + [128], [1024] * 16 + [8192])],
                         ids=["128-after-8k", "two-chunks", "decodes-then-chunk"])
def test_split_prefill_matches_reference(policy, query_lens, ctx):
    """A short chunk over a long cached prefix with its keys split (SplitPolicy.prefill_split):
    the plan the policy picks, and forced 256- and 2048-key partitions, against the reference."""
    from tandem.engine.kernels import paged_attention as pa

    policy(prefill_split=True, prefill_split_below=3.0)   # past the default line: two query tiles split too
    q, k_cache, v_cache, meta = make_batch(sum(ctx), query_lens, ctx)
    short = sum(n <= pa.MAX_DECODE_QUERY_LEN for n in query_lens)
    seqs = pa._SeqRange(meta, short)
    block_m, _ = pa._prefill_tile(seqs.max_query_len, HEAD_DIM)
    programs = q.shape[1] * -(-seqs.max_query_len // block_m) * seqs.count
    assert attention_split.choose_prefill_partition(programs, seqs.max_seq_len, _num_sms(q.device)) is not None
    check_attention(paged_attention, q, k_cache, v_cache, meta)             # the plan in force
    if not short:
        for size in (256, 2048):
            check_attention(lambda *a, out, **k: pa._prefill(*a, out, pa._SeqRange(meta), partition_size=size),
                            q, k_cache, v_cache, meta)
