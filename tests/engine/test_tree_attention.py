"""Tree-draft verification in one forward: the tree attention mask in the torch path (batched and
per-sequence) and in the Triton kernels (decode, prefill, split-K, mixed batches; Triton's
interpreter on CPU) against a plain per-row reference, and a tiny model's tree-verify logits
against running each root-to-node path as an ordinary sequence."""

import collections
import os
import sys

import torch

if not torch.cuda.is_available() and "TRITON_INTERPRET" not in os.environ:
    if "triton" in sys.modules:  # see tests/engine/test_kernels.py
        raise RuntimeError("triton was imported before TRITON_INTERPRET=1 was set")
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

from tandem.engine.attention import AttentionMetadata, paged_attention_torch  # noqa: E402
from tandem.engine.model_runner import ModelRunner  # noqa: E402
from tandem.engine.kv_cache import KVCache  # noqa: E402
from tandem.engine.request import Request  # noqa: E402
from tandem.engine.scheduler import ScheduledRequest, SchedulerOutput  # noqa: E402
from tandem.engine.speculative.tree import ancestor_masks, depths  # noqa: E402
from tandem.engine.block_manager import BlockAllocator  # noqa: E402

TREE = [-1, 0, 0, 1, 1, 2, -1, 6]  # two roots' children, branching at depth 1 and 2
CHAIN = None  # causal rows (-1 masks)


def signed(bits: list[int]) -> list[int]:
    return [b - (1 << 64) if b >= 1 << 63 else b for b in bits]


def tree_batch(gen, trees, ctx_lens, heads=4, kv_heads=2, head_dim=16, block_size=16, dtype=torch.float32,
               device="cpu", chain_lens=None):
    """Random paged cache and q for sequences whose query rows are a draft tree (parents list: root +
    nodes) or a causal run (None: chain_lens[b] rows). -> q, k_cache, v_cache, meta, per-row masks."""
    qlens = [1 + len(t) if t is not None else chain_lens[b] for b, t in enumerate(trees)]
    seq_lens = [c + q for c, q in zip(ctx_lens, qlens)]
    nblk = [-(-s // block_size) for s in seq_lens]
    total = sum(nblk) + 2
    k = torch.randn(total, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(total, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    order = torch.randperm(total, generator=gen).tolist()
    table = torch.zeros(len(trees), max(nblk) + 1, dtype=torch.int32)
    for b, n in enumerate(nblk):
        table[b, :n] = torch.tensor([order.pop() for _ in range(n)], dtype=torch.int32)
    masks = []
    for t, q in zip(trees, qlens):
        masks += signed(ancestor_masks(t)) if t is not None else [-1] * q
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(sum(qlens), dtype=torch.int64, device=device),
        query_start_loc=torch.tensor([0] + qlens).cumsum(0).to(torch.int32).to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device), block_tables=table.to(device),
        query_lens_cpu=qlens, seq_lens_cpu=seq_lens, max_query_len=max(qlens), max_seq_len=max(seq_lens),
        tree_mask=torch.tensor(masks, dtype=torch.int64, device=device))
    q = torch.randn(sum(qlens), heads, head_dim, generator=gen).to(dtype)
    return q.to(device), k.to(device), v.to(device), meta


def reference(q, k_cache, v_cache, meta, scale):
    """Row by row in float64: context keys, then the query keys the row's mask (and causality) allow."""
    out = torch.empty(q.shape, dtype=torch.float64)
    q, k_cache, v_cache = q.cpu().double(), k_cache.cpu().double(), v_cache.cpu().double()
    bits = meta.tree_mask.cpu().tolist()
    group = q.shape[1] // k_cache.shape[2]
    start = 0
    for b, (qlen, slen) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu)):
        ctx = slen - qlen
        blocks = meta.block_tables[b].cpu().long()
        k = k_cache[blocks].flatten(0, 1)[:slen].repeat_interleave(group, 1)  # [L, H, D]
        v = v_cache[blocks].flatten(0, 1)[:slen].repeat_interleave(group, 1)
        for t in range(qlen):
            keys = list(range(ctx)) + [ctx + s for s in range(t + 1) if (bits[start + t] >> s) & 1]
            att = torch.einsum("hd,lhd->hl", q[start + t], k[keys]) * scale
            out[start + t] = torch.einsum("hl,lhd->hd", att.softmax(-1), v[keys])
        start += qlen
    return out


def rel_err(out, ref):
    assert not out.isnan().any()
    return ((out.double().cpu() - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("trees,ctx,chain_lens", [
    ([TREE, None, [-1, -1, 0]], [30, 17, 5], [None, 3, None]),   # batched: a tree, a chain, a fan
    ([TREE], [40], None),                                         # one sequence: the loop path
    ([None, TREE], [10, 20], [66, None]),                         # a long causal row: the loop path
])
def test_torch_tree_mask_matches_per_row_reference(trees, ctx, chain_lens):
    q, k, v, meta = tree_batch(torch.Generator().manual_seed(0), trees, ctx, chain_lens=chain_lens)
    out = paged_attention_torch(q, k, v, meta, 0.25)
    assert rel_err(out, reference(q, k, v, meta, 0.25)) < 1e-5
    # and the mask matters: the same rows under the causal mask differ
    causal = paged_attention_torch(q, k, v, AttentionMetadata(**{**meta.__dict__, "tree_mask": None}), 0.25)
    assert rel_err(causal, reference(q, k, v, meta, 0.25)) > 1e-2


WIDE = [-1] + [0] * 6 + list(range(1, 7)) + [7, 8]  # 15 nodes: 16 rows, the decode kernel's limit
DEEP = [-1, -1] + list(range(0, 38))  # 40 nodes: the prefill kernel


@pytest.mark.parametrize("trees,ctx,chain_lens,partition", [
    ([TREE, None, [-1, -1, 0]], [30, 17, 5], [None, 3, None], None),  # decode kernel
    ([WIDE, TREE], [130, 3], None, 64),                                 # decode kernel, split-K
    ([DEEP, None], [20, 9], [None, 1], None),                           # prefill kernel
    ([TREE, None], [12, 40], [None, 50], None),                         # decode then prefill kernel
])
def test_triton_tree_mask_matches_torch(trees, ctx, chain_lens, partition):
    from tandem.engine.kernels.paged_attention import paged_attention, paged_decode_attention  # noqa: PLC0415 (triton after TRITON_INTERPRET)

    q, k, v, meta = tree_batch(torch.Generator().manual_seed(1), trees, ctx, chain_lens=chain_lens)
    ref = reference(q, k, v, meta, 0.25)
    if partition is not None:
        out = paged_decode_attention(q, k, v, meta, 0.25, partition_size=partition)
    else:
        out = paged_attention(q, k, v, meta, 0.25)
    assert rel_err(out, ref) < 1e-4
    assert rel_err(paged_attention_torch(q, k, v, meta, 0.25), ref) < 1e-5


def test_triton_refuses_bad_tree_masks():
    from tandem.engine.kernels.paged_attention import paged_attention  # noqa: PLC0415 (as above)

    q, k, v, meta = tree_batch(torch.Generator().manual_seed(2), [TREE], [8])
    with pytest.raises(ValueError, match="sliding window"):
        paged_attention(q, k, v, meta, 0.25, sliding_window=4)
    with pytest.raises(ValueError, match="sliding window"):
        paged_attention_torch(q, k, v, meta, 0.25, sliding_window=4)
    bad = AttentionMetadata(**{**meta.__dict__, "tree_mask": meta.tree_mask.to(torch.int32)})
    with pytest.raises(ValueError, match="tree_mask"):
        paged_attention(q, k, v, bad, 0.25)


def test_tree_verify_logits_equal_each_path_run_plainly(tiny):
    """One verify step of a tree through the model runner (positions root + depth, the tree mask):
    every node's logits equal the logits after its root-to-node path computed as a plain sequence."""
    model, _, _ = tiny
    torch.manual_seed(0)
    prompt = torch.randint(3, model.config.vocab_size, (21,)).tolist()
    tokens = torch.randint(3, model.config.vocab_size, (len(TREE),)).tolist()
    kv = KVCache(model.kv_cache_shape(32, 8), torch.float32, "cpu")
    alloc = BlockAllocator(32, 8, enable_prefix_caching=False)
    runner = ModelRunner(model, kv, "cpu")
    req = Request("r", prompt)
    alloc.grow(req, len(prompt) - 1)
    runner.execute(runner.prepare(SchedulerOutput([ScheduledRequest(req, len(prompt) - 1)])))
    req.num_computed_tokens = len(prompt) - 1
    alloc.grow(req, 1 + len(TREE))
    sched = SchedulerOutput([ScheduledRequest(req, 1 + len(TREE), len(TREE))])
    batch = runner.prepare(sched, {"r": tokens}, {"r": TREE})
    assert batch.positions.tolist() == [20] + [20 + d for d in depths(TREE)]
    got = runner.execute(batch)  # [1 + nodes, V]
    for row in range(len(TREE) + 1):
        path, node = [], row - 1
        while node >= 0:
            path.insert(0, tokens[node])
            node = TREE[node]
        plain = Request(f"p{row}", prompt + path)
        alloc.grow(plain, plain.num_tokens)
        want = runner.execute(runner.prepare(SchedulerOutput([ScheduledRequest(plain, plain.num_tokens)])))
        alloc.free(plain)
        torch.testing.assert_close(got[row], want[0], rtol=1e-4, atol=1e-4)
    alloc.free(req)


def test_tree_steps_run_through_the_graph_buffers(tiny):
    """The CUDA-graph path's static buffers (run eagerly through the Triton kernels under the
    interpreter, `capture=False`): tree-verify steps pad to keys with tree=True, their masks go
    through the static tree-mask buffer, and greedy tokens equal plain decoding's."""
    import copy  # noqa: PLC0415 (only here)

    import numpy as np  # noqa: PLC0415 (only here)

    from tandem.engine.config import CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig  # noqa: PLC0415
    from tandem.engine.cuda_graphs import StaticInputs  # noqa: PLC0415
    from tandem.engine.engine import LLMEngine  # noqa: PLC0415
    from tandem.engine.model import TritonOps  # noqa: PLC0415
    from tests.engine.test_tree_spec import OffBranchOracle  # noqa: PLC0415

    s = StaticInputs(max_batch=4, max_tokens=8, max_blocks=2, device=torch.device("cpu"))
    s.upload(s.pack([1, 2, 3], [0, 1, 1], [0, 1, 2], [0, 1, 2], [0, 3], [3], np.zeros((1, 1), np.int32),
                    np.array([1, 3, -5], dtype=np.int64)), 1, 1)
    assert s.tree_mask[:4].tolist() == [1, 3, -5, -1]  # padded rows causal

    model, tok, _ = tiny
    prompts = [list(range(5, 30)), [9, 8, 7, 6, 5, 4, 3] * 2]
    reqs = [{"prompt_token_ids": p, "max_tokens": 7, "ignore_eos": True, "request_id": f"r{i}"}
            for i, p in enumerate(prompts)]

    def engine(proposer=None):
        cfg = EngineConfig(model="test", cache=CacheConfig(block_size=8, num_blocks=64),
                           scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64),
                           speculative=SpeculativeConfig(method="suffix" if proposer else "off", num_tokens=3,
                                                         max_verify_tokens=4096, verify_token_cost=0.0))
        return LLMEngine(cfg, model=model, tokenizer=tok, proposer=proposer)

    plain = engine().generate([dict(r) for r in reqs])
    fused = copy.deepcopy(model)
    fused.ops = TritonOps()
    e = engine(OffBranchOracle({r["request_id"]: r["token_ids"] for r in plain}, model.config.vocab_size))
    e.model = fused
    e.runner = ModelRunner(fused, e.kv_cache, "cpu", cuda_graphs=True, capture=False,
                           graph_batch_sizes=(1, 2, 4), max_graph_tokens=32)
    keys = []
    execute = e.runner.execute
    e.runner.execute = lambda batch, *a: (keys.append(batch.graph_key), execute(batch, *a))[1]
    assert [r["token_ids"] for r in e.generate([dict(r) for r in reqs])] == [r["token_ids"] for r in plain]
    assert any(k is not None and k.tree for k in keys), keys
    assert e.stats.accepted_draft_tokens > 0


def test_warmup_compiles_the_tree_variants_too(monkeypatch):
    import tandem.engine.kernels.paged_attention as pa  # noqa: PLC0415 (triton after TRITON_INTERPRET)
    from tandem.engine.kernels import attention_split  # noqa: PLC0415

    seen = []
    for name in ("_prefill_kernel", "_decode_kernel"):
        kernel = getattr(pa, name)

        class Spy:
            def __init__(self, kernel):
                self.kernel = kernel

            def __getitem__(self, grid, kernel=kernel):
                return lambda *a, **kw: seen.append(kw["TREE"])
        monkeypatch.setattr(pa, name, Spy(kernel))
    # the split passes' merges of the (never computed) partitions: not run, as the spied launches
    monkeypatch.setattr(pa, "merge_partitions", lambda *a, **kw: None)
    monkeypatch.setattr(pa, "_reduce_partitions_kernel", collections.defaultdict(lambda: lambda *a, **kw: None))
    kv = torch.randn(2, 20, 16, 2, 32)
    plain = pa.compile_variants(kv[0], kv[1], num_heads=8)
    assert plain == len(seen) and not any(seen)
    seen.clear()
    # every one-pass variant has a tree twin; the split prefill tiles (on by default) do not: a
    # tree-mask prefill keeps one pass
    split = 4 if attention_split.POLICY.prefill_split else 0
    assert pa.compile_variants(kv[0], kv[1], num_heads=8, trees=True) == 2 * plain - split == len(seen)
    assert sum(seen) == plain - split
    monkeypatch.setattr(attention_split, "POLICY", attention_split.SplitPolicy(prefill_split=False))
    seen.clear()
    plain = pa.compile_variants(kv[0], kv[1], num_heads=8)
    assert pa.compile_variants(kv[0], kv[1], num_heads=8, trees=True) == 2 * plain == len(seen) - plain
