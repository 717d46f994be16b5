"""Split-K decode attention (engine.kernels.attention_split): the partition plan, and the vector
merge kernel against the plain-torch reference (under TRITON_INTERPRET=1 on CPU), with the same
batches the looping reduce is checked on in test_kernels."""

import pytest
import torch

from tests.engine.test_kernels import TOL, make_batch, reference, rel_err  # sets TRITON_INTERPRET

import tandem.engine.kernels.paged_attention as pa  # noqa: E402
from tandem.engine.kernels import attention_split  # noqa: E402
from tandem.engine.kernels.attention_split import choose_partition_size, set_split_policy  # noqa: E402


@pytest.fixture
def policy():
    """Restores the process's split plan after the test."""
    old = attention_split.POLICY
    yield set_split_policy
    attention_split.POLICY = old


@pytest.mark.parametrize("vector_merge,fused_merge", [(False, False), (True, False), (True, True)],
                         ids=["loop-reduce", "vector-merge", "fused-merge"])
@pytest.mark.parametrize("query_lens,ctx_lens", [
    ([1, 1, 1], [200, 63, 1100]),     # decode; 1101 keys in 64-key partitions: 18, two merge tiles
    ([3, 1, 2], [130, 0, 70]),        # verify rows
], ids=["decode", "verify"])
def test_split_merge_matches_reference(monkeypatch, policy, vector_merge, fused_merge, query_lens, ctx_lens):
    """Each merge of the split launch's partitions against the reference: the looping reduce, the
    vector merge kernel, and the merge inside the launch (`fused_merge`: no second launch, the
    counters left at 0 for the next launch)."""
    policy(vector_merge=vector_merge, fused_merge=fused_merge)
    merges = []
    monkeypatch.setattr(pa, "merge_partitions", lambda *a: merges.append(a) or attention_split.merge_partitions(*a))
    gen = torch.Generator().manual_seed(sum(ctx_lens))
    q, k_cache, v_cache, meta = make_batch(gen, query_lens, ctx_lens, 4, 2, 32, 16)
    ref = reference(q, k_cache, v_cache, meta, 0.2)
    for partition_size in (64, 192):
        out = torch.full_like(q, float("nan"))
        pa.paged_decode_attention(q, k_cache, v_cache, meta, 0.2, out=out, partition_size=partition_size)
        assert rel_err(out, ref) < TOL[torch.float32], partition_size
    splits = sum(p < meta.max_seq_len for p in (64, 192))  # a partition as long as the context: one pass
    assert len(merges) == (splits if vector_merge and not fused_merge else 0)   # the policy picks the merge
    if fused_merge:
        assert not attention_split.merge_counters(q.device, 1).any()


def test_merge_inside_the_launch_over_three_merge_tiles_and_grown_counters(policy):
    """The fused merge where the vector merge's tests do not reach it: 40 partitions in tiles of 8
    (8 query heads per KV head: a smaller tile), and counters grown for a bigger launch while the
    old ones stay alive (graphs captured with them still point at them)."""
    policy(fused_merge=True)
    gen = torch.Generator().manual_seed(12)
    q, k_cache, v_cache, meta = make_batch(gen, [2, 1], [90, 2530], 8, 1, 16, 16)
    out = torch.full_like(q, float("nan"))
    pa.paged_decode_attention(q, k_cache, v_cache, meta, 0.3, out=out, partition_size=64)
    assert rel_err(out, reference(q, k_cache, v_cache, meta, 0.3)) < TOL[torch.float32]
    small = attention_split.merge_counters(q.device, 1)
    assert attention_split.merge_counters(q.device, 5000).numel() >= 5000
    assert any(t is small for t in attention_split._RETIRED)


@pytest.mark.parametrize("fused_merge", [False, True], ids=["vector-merge", "fused-merge"])
def test_merge_of_a_launch_that_starts_past_the_first_sequence(policy, fused_merge):
    # a decode launch over sequences [1, 3) of the batch: partial states (and the fused merge's
    # counters) are indexed from the launch's first, the output rows are the batch's
    policy(vector_merge=True, fused_merge=fused_merge)
    gen = torch.Generator().manual_seed(5)
    q, k_cache, v_cache, meta = make_batch(gen, [2, 1, 3], [90, 300, 150], 4, 1, 16, 16)
    ref = reference(q, k_cache, v_cache, meta, 0.3)
    out = torch.full_like(q, float("nan"))
    pa._decode(q, k_cache, v_cache, meta, 0.3, out, pa._SeqRange(meta, 1, 2), partition_size=64)
    assert out[:2].isnan().all()                      # sequence 0's rows: not this launch's
    assert rel_err(out[2:], ref[2:]) < TOL[torch.float32]


@pytest.mark.parametrize("fused_merge", [False, True], ids=["vector-merge", "fused-merge"])
def test_merge_with_a_sliding_window(policy, fused_merge):
    # partitions wholly before the window keep m = -1e30, l = 0 and weigh nothing in the merge
    policy(vector_merge=True, fused_merge=fused_merge)
    gen = torch.Generator().manual_seed(9)
    q, k_cache, v_cache, meta = make_batch(gen, [1, 2], [400, 90], 4, 2, 32, 16)
    out = torch.full_like(q, float("nan"))
    pa.paged_decode_attention(q, k_cache, v_cache, meta, 0.2, out=out, partition_size=64, sliding_window=100)
    ref = torch.full_like(q, float("nan"))
    pa.paged_decode_attention(q, k_cache, v_cache, meta, 0.2, out=ref, partition_size=None, sliding_window=100)
    assert rel_err(out, ref) < TOL[torch.float32]


def test_partition_plan_follows_the_policy(policy):
    # llama3-8b at batch 1 x 1k on 132 SMs: 8 programs unsplit
    policy(min_partition=256, programs_per_sm=2, bucket_plan=False)   # the plan before the sweep
    assert choose_partition_size(1, 8, 1024, 132) == 256          # 4 partitions
    policy(min_partition=64)
    assert choose_partition_size(1, 8, 1024, 132) == 64           # 16 partitions, 128 programs
    assert choose_partition_size(64, 8, 1024, 132) is None        # 512 programs: no split
    policy(programs_per_sm=4)
    assert choose_partition_size(32, 8, 8192, 132) == 2752        # 256 programs -> 3 partitions
    assert choose_partition_size(1, 8, 40, 132) is None           # shorter than one partition


def test_default_plan_is_the_sweeps_best():
    # the H200 sweep's fastest partition per shape (bench/step_profile.py --attn), at the contexts a
    # graph of the 2k / 16k bucket serves
    assert choose_partition_size(1, 8, 1040, 132) == 64
    assert choose_partition_size(16, 8, 1040, 132) == 256
    assert choose_partition_size(64, 8, 1040, 132) is None
    assert choose_partition_size(1, 8, 8200, 132) == 256  # the sweep's 128, floored (long_partition)
    assert choose_partition_size(8, 8, 8200, 132) == 960
    assert choose_partition_size(32, 8, 8200, 132) == 2752
    # 33 sequences (264 programs, 2 per SM) split in two: unsplit, they read K/V at 78% of the
    # copy rate; 64 (512 programs) stay whole
    assert choose_partition_size(33, 8, 5800, 132) == 2048
    assert choose_partition_size(48, 8, 5800, 132) == 2048
    assert choose_partition_size(64, 8, 5800, 132) is None
    assert attention_split.POLICY.vector_merge


def test_long_partition_floors_the_partitions_of_long_contexts(policy):
    # batch 1 on 132 SMs: the program count alone would cut an 8k context into 64-key partitions;
    # the floor keeps them 256 keys long, and leaves a 1k context its 64-key ones
    policy(long_partition=0)
    assert choose_partition_size(1, 8, 8000, 132) == 64
    assert choose_partition_size(1, 8, 8200, 132) == 128
    policy(long_partition=256, long_parts=16)
    assert choose_partition_size(1, 8, 8000, 132) == 256
    assert choose_partition_size(1, 8, 3000, 132) == 128    # plan 2048 / 16
    assert choose_partition_size(1, 8, 1040, 132) == 64
    assert choose_partition_size(1, 8, 40, 132) is None     # still: shorter than one partition
    assert choose_partition_size(8, 8, 8200, 132) == 960    # already longer: unchanged
    policy(long_parts=4)
    assert choose_partition_size(1, 8, 1040, 132) == 256


def test_set_split_policy_refuses_unknown_or_bad_fields(policy):
    with pytest.raises(ValueError, match="no field 'min_parts'"):
        policy(min_parts=64)
    with pytest.raises(ValueError, match="positive int"):
        policy(min_partition=0)
    with pytest.raises(ValueError, match="long_partition must be an int >= 0"):
        policy(long_partition=-64)


def test_bucket_plan_serves_every_context_of_a_graph_bucket(policy):
    # a graph captured for contexts up to 16384 plans 8192 keys: an 8.2k context still gets five
    # partitions (the bucket's own plan would give two, one of them nearly empty)
    policy(programs_per_sm=8, bucket_plan=True)
    assert choose_partition_size(32, 8, 8200, 132) == choose_partition_size(32, 8, 16384, 132) == 1664
    assert choose_partition_size(32, 8, 8192, 132) == 832     # the bucket below: (4096, 8192]
    policy(bucket_plan=False)
    assert choose_partition_size(32, 8, 16384, 132) == 3328


# ---- split-K prefill: a short chunk over a long cached prefix -----------------------------------
@pytest.mark.parametrize("query_lens,ctx_lens,window", [
    ([20, 37], [300, 45], None),        # chunks over cached prefixes; the second's ends before most partitions
    ([150, 17], [200, 260], None),      # two query tiles of 128 rows: the first tile's partitions past its keys
    ([33], [400], 100),                 # a sliding window: partitions wholly before it weigh nothing
], ids=["chunks", "two-tiles", "sliding"])
@pytest.mark.parametrize("partition_size", [64, 128])
def test_split_prefill_matches_reference(query_lens, ctx_lens, window, partition_size):
    gen = torch.Generator().manual_seed(sum(ctx_lens) + partition_size)
    q, k_cache, v_cache, meta = make_batch(gen, query_lens, ctx_lens, 4, 2, 32, 16)
    ref = torch.full_like(q, float("nan"))
    pa._prefill(q, k_cache, v_cache, meta, 0.2, ref, pa._SeqRange(meta), window)        # one pass
    out = torch.full_like(q, float("nan"))
    merges = []
    real = pa.merge_partitions
    pa.merge_partitions = lambda *a: merges.append(a) or real(*a)
    try:
        pa._prefill(q, k_cache, v_cache, meta, 0.2, out, pa._SeqRange(meta), window, partition_size=partition_size)
    finally:
        pa.merge_partitions = real
    assert len(merges) == 1, "the split launch was not merged"
    assert rel_err(out, ref) < TOL[torch.float32]
    if window is None:
        assert rel_err(out, reference(q, k_cache, v_cache, meta, 0.2)) < TOL[torch.float32]


def test_split_prefill_through_the_dispatch_when_the_policy_is_on(monkeypatch, policy):
    """`paged_attention` on a mixed batch (decode rows first, then chunks) splits the chunks'
    launch when the policy is on and their programs are too few for the SMs (here 100 of them)."""
    gen = torch.Generator().manual_seed(21)
    q, k_cache, v_cache, meta = make_batch(gen, [1, 3, 40, 25], [70, 20, 600, 100], 4, 2, 32, 16)
    ref = reference(q, k_cache, v_cache, meta, 0.25)
    monkeypatch.setattr(pa, "_num_sms", lambda device: 100)
    launches = []
    real = pa._launch_prefill
    monkeypatch.setattr(pa, "_launch_prefill", lambda *a, **k: launches.append(k["partition_size"]) or real(*a, **k))
    for on in (False, True):
        policy(prefill_split=on, prefill_min_partition=128)
        out = torch.full_like(q, float("nan"))
        pa.paged_attention(q, k_cache, v_cache, meta, 0.25, out=out)
        assert rel_err(out, ref) < TOL[torch.float32], on
    assert launches[0] is None and launches[1] == 128   # 4 heads x 1 tile x 2 sequences: 8 programs


def test_prefill_partition_plan(policy):
    choose = attention_split.choose_prefill_partition
    # on by default: llama3-8b, 128 new tokens over an 8k prefix: 32 programs -> 17 partitions of 512 keys
    assert choose(32, 8320, 132) == 512
    assert choose(64, 8448, 132) == 960                        # 256 new tokens: 64 programs, 9 partitions
    assert choose(128, 8704, 132) is None                      # 512 new tokens: one program per SM already
    assert choose(32 * 16, 10240, 132) is None                 # 2048 new tokens: 512 programs fill the GPU
    assert choose(32, 300, 132) == 256                         # never shorter than prefill_min_partition
    assert choose(32, 200, 132) is None                        # one partition: no split
    policy(prefill_split_below=1.0)                            # the line is the policy's
    assert choose(128, 8704, 132) == 1792
    policy(prefill_split=False)
    assert choose(32, 8320, 132) is None
    with pytest.raises(ValueError, match="multiple of 64"):
        policy(prefill_min_partition=100)
    with pytest.raises(ValueError, match="prefill_split_below"):
        policy(prefill_split_below=0)


def test_prefill_split_env_switch(monkeypatch):
    """$TANDEM_PREFILL_SPLIT sets the default plan's prefill split (what Ray's workers inherit)."""
    monkeypatch.delenv(attention_split.PREFILL_SPLIT_ENV, raising=False)
    assert attention_split._policy_from_env().prefill_split is True
    monkeypatch.setenv(attention_split.PREFILL_SPLIT_ENV, "0")
    assert attention_split._policy_from_env().prefill_split is False
    monkeypatch.setenv(attention_split.PREFILL_SPLIT_ENV, "1")
    assert attention_split._policy_from_env() == attention_split.SplitPolicy()
    monkeypatch.setenv(attention_split.PREFILL_SPLIT_ENV, "yes")
    with pytest.raises(ValueError, match="TANDEM_PREFILL_SPLIT must be 1"):
        attention_split._policy_from_env()
