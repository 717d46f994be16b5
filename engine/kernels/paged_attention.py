"""Paged attention on the GPU: the Triton twins of `engine.attention.paged_attention_torch`.

Same contract as the reference: q is the varlen batch of new tokens [T, Hq, D]; K/V (new tokens
included, already written) are read through each sequence's block table from
`k_cache, v_cache: [num_blocks, block_size, Hkv, D]` (views allowed: only the last dim must be
contiguous); token j of sequence b sits at position seq_lens[b] - query_lens[b] + j and sees KV
positions [0, that position]; with a sliding window W (`sliding_window`, Mistral) only the positions
(that position - W, that position].

- `paged_prefill_attention`: any query lengths, cached prefixes, in one launch. Flash-attention
  style: one program per (query head, tile of BLOCK_M query rows, sequence), online softmax over
  tiles of BLOCK_N keys; the causal mask is applied only on the tiles that straddle the diagonal.
  A short chunk over a long cached prefix (an agent's later turn: 128 new tokens over 8k) has few
  such programs (llama3-8b: 32 on 132 SMs), each reading the whole prefix; with
  `SplitPolicy.prefill_split` its keys are split into partitions as the decode kernel's are
  (`attention_split.choose_prefill_partition`), one program each, merged by the decode split's
  merge kernel.
- `paged_decode_attention`: up to MAX_DECODE_QUERY_LEN query tokens per sequence (decode, and the
  speculative verifier's 1 + k). One program per (sequence, KV head, partition of the context):
  its rows are every (query token, query head of the group), so each K/V tile is read once per
  KV group. Long contexts are split into partitions (flash-decoding) so that a small batch still
  fills the GPU; a second kernel merges the partitions' softmax states.
- A sliding window (constexpr SLIDING, the window a runtime int) starts each program's key loop at
  the first tile its earliest query can see and masks every tile (no unmasked fast path).
- Tree drafts (`meta.tree_mask`, constexpr TREE; engine.speculative.tree): each query token's
  int64 ancestor bitmask over its sequence's query tokens; the masked tiles also hide query key s
  from rows without bit s. The context and the root (query token 0, every node's ancestor) stay
  unmasked, so the decode kernel's tile split is unchanged; the prefill kernel masks from the root.
- `paged_attention`: the decode kernel when every sequence has at most MAX_DECODE_QUERY_LEN new
  tokens, else the prefill kernel; a mixed batch whose short sequences come first runs as two
  launches (decode kernel on those, prefill kernel on the rest).

Grids depend on host-side sizes (number of sequences, max query length, and for split decode
meta.max_seq_len), so a CUDA graph captured for one batch shape replays only for that shape, and
with a split plan only while every context stays within the captured meta.max_seq_len.

Integer arguments that change from step to step (a launch's first sequence, the block table's
width, the partition size and the partition buffers' strides) are `do_not_specialize`: Triton
would otherwise compile one variant per divisibility class of each (== 1, % 16 == 0, other), and
every new combination is a compile of a second or more in the middle of serving.

Constraints: head_dim a power of two in [16, 256]; Hq a multiple of Hkv; q, caches and out of one
dtype (fp32, bf16 or fp16); metadata tensors int32 on q's device. Scores, softmax and the output
accumulator are fp32; P is cast to the cache dtype for the P @ V product (as flash-attention does).
fp32 inputs use full-precision (ieee) dot products, not tf32: exact enough for tests, but on the
GPU that path runs on FMA units and spills registers; serve in bf16 or fp16.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from tandem.engine.attention import AttentionMetadata
from tandem.engine.kernels import attention_split, pdl
from tandem.engine.kernels.attention_split import (choose_partition_size, choose_prefill_partition, merge_partitions,
                                                   partial_states)
from tandem.engine.kernels.validate import (FLOAT_DTYPES, next_power_of_2, require_runnable, require_same,
                                     require_tensor)

MAX_DECODE_QUERY_LEN = 16
_LOG2E = 1.4426950408889634
# Finite "minus infinity" for running maxima: a row with no visible key in a tile (or a whole
# partition) keeps m = -1e30, and exp2(m_old - m_new) stays a number instead of NaN (-inf - -inf).
_NEG_BIG = tl.constexpr(-1.0e30)


@triton.jit
def _attend_tile(acc, m_i, l_i, q, q_pos, start_n, seq_len, kv_head, table_ptr,
                 k_cache_ptr, v_cache_ptr,
                 stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, scale_log2, window,
                 tree_bits, ctx_len,
                 HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                 PRECISION: tl.constexpr, MASKED: tl.constexpr, SLIDING: tl.constexpr, TREE: tl.constexpr):
    """One online-softmax step over keys [start_n, start_n + BLOCK_N) for rows q [M, D] at
    positions q_pos [M]. MASKED: apply the causal and length masks (else all keys are visible);
    SLIDING (with MASKED): also hide keys at or before q_pos - window; TREE (with MASKED): also
    hide query key s (KV index ctx_len + s) from rows whose tree_bits [M] lack bit s."""
    kv_pos = start_n + tl.arange(0, BLOCK_N)
    dims = tl.arange(0, HEAD_DIM)
    kv_ok = kv_pos < seq_len
    # the block table is read per key: a tile may span several cache blocks
    block_ids = tl.load(table_ptr + kv_pos // BLOCK_SIZE, mask=kv_ok, other=0).to(tl.int64)
    slots = kv_pos % BLOCK_SIZE
    k_rows = block_ids * stride_kb + slots * stride_ks + kv_head * stride_kh  # [N]
    v_rows = block_ids * stride_vb + slots * stride_vs + kv_head * stride_vh
    if MASKED:
        k = tl.load(k_cache_ptr + k_rows[:, None] + dims[None, :], mask=kv_ok[:, None], other=0.0)
    else:
        k = tl.load(k_cache_ptr + k_rows[:, None] + dims[None, :])
    qk = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2  # [M, N], log2 domain
    if MASKED:
        visible = (kv_pos[None, :] <= q_pos[:, None]) & kv_ok[None, :]
        if SLIDING:
            visible = visible & (kv_pos[None, :] > q_pos[:, None] - window)
        if TREE:
            rel = kv_pos[None, :] - ctx_len
            bit = (tree_bits[:, None] >> tl.minimum(tl.maximum(rel, 0), 63).to(tl.int64)) & 1
            visible = visible & ((rel < 0) | (bit != 0))
        qk = tl.where(visible, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(qk - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if MASKED:
        v = tl.load(v_cache_ptr + v_rows[:, None] + dims[None, :], mask=kv_ok[:, None], other=0.0)
    else:
        v = tl.load(v_cache_ptr + v_rows[:, None] + dims[None, :])
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return acc, m_new, l_i


@triton.jit(do_not_specialize=['first_seq', 'stride_bt', 'window', 'partition_size', 'stride_pt', 'stride_ph'])
def _prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_out_ptr, part_ml_ptr,
    query_start_loc_ptr, seq_lens_ptr, block_tables_ptr, tree_mask_ptr,
    scale_log2, first_seq, window, partition_size, num_heads,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_bt, stride_pt, stride_ph,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, SLIDING: tl.constexpr,
    TREE: tl.constexpr, SPLIT: tl.constexpr,
):
    # heads vary fastest, so one KV group's programs run together and share K/V in L2; SPLIT: axis
    # 0 is (key partition, head), the program's keys that partition's, its output a partial state
    head = tl.program_id(0) % num_heads
    part_start = (tl.program_id(0) // num_heads) * partition_size
    # the last query tiles see the most keys: start them first so they do not form the tail
    m_block = tl.num_programs(1) - 1 - tl.program_id(1)
    seq = first_seq + tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if m_block * BLOCK_M >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    if SPLIT and part_start >= seq_len:
        return  # past this sequence's partitions: the merge reads cdiv(seq_len, partition_size)
    ctx_len = seq_len - q_len
    kv_head = head // GROUP
    rows = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, HEAD_DIM)
    row_ok = rows < q_len
    tokens = (q_start + rows).to(tl.int64)
    q = tl.load(q_ptr + tokens[:, None] * stride_qt + head * stride_qh + dims[None, :],
                mask=row_ok[:, None], other=0.0)
    q_pos = ctx_len + rows  # padded rows get positions >= seq_len: they see every key, never NaN
    tree_bits = tl.load(tree_mask_ptr + tokens, mask=row_ok, other=-1) if TREE else 0  # padded: all
    m_i = tl.full([BLOCK_M], _NEG_BIG, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    table_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bt
    unmasked_start, unmasked_end, masked_start, kv_end = _prefill_key_tiles(
        ctx_len, ctx_len + m_block * BLOCK_M, seq_len, window, part_start, partition_size,
        BLOCK_M, BLOCK_N, SLIDING, TREE, SPLIT)
    for start_n in range(unmasked_start, unmasked_end, BLOCK_N):
        acc, m_i, l_i = _attend_tile(acc, m_i, l_i, q, q_pos, start_n, seq_len, kv_head, table_ptr,
                                     k_cache_ptr, v_cache_ptr, stride_kb, stride_ks, stride_kh,
                                     stride_vb, stride_vs, stride_vh, scale_log2, window, tree_bits, ctx_len,
                                     HEAD_DIM, BLOCK_SIZE, BLOCK_N, PRECISION, False, SLIDING, TREE)
    for start_n in range(masked_start, kv_end, BLOCK_N):
        acc, m_i, l_i = _attend_tile(acc, m_i, l_i, q, q_pos, start_n, seq_len, kv_head, table_ptr,
                                     k_cache_ptr, v_cache_ptr, stride_kb, stride_ks, stride_kh,
                                     stride_vb, stride_vs, stride_vh, scale_log2, window, tree_bits, ctx_len,
                                     HEAD_DIM, BLOCK_SIZE, BLOCK_N, PRECISION, True, SLIDING, TREE)

    if SPLIT:  # partial states [tokens of the launch, Hq, P, D] and [.., 2], as the decode split's
        first_token = tl.load(query_start_loc_ptr + first_seq)
        _store_partial(acc, m_i, l_i, tokens - first_token, head, part_start // partition_size, row_ok,
                       part_out_ptr, part_ml_ptr, stride_pt, stride_ph, HEAD_DIM)
    else:
        tl.store(out_ptr + tokens[:, None] * stride_ot + head * stride_oh + dims[None, :],
                 (acc / l_i[:, None]).to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


@triton.jit
def _store_partial(acc, m_i, l_i, rows, head, part, row_ok, part_out_ptr, part_ml_ptr, stride_pt, stride_ph,
                   HEAD_DIM: tl.constexpr):
    """A split launch's partial softmax state of token rows `rows` (of the launch) at one head and
    partition: acc [M, D] unnormalised and (m, l) [M] in part_out [T, Hq, P, D], part_ml [T, Hq, P, 2]."""
    at = rows * stride_pt + head * stride_ph + part
    tl.store(part_out_ptr + at[:, None] * HEAD_DIM + tl.arange(0, HEAD_DIM)[None, :], acc, mask=row_ok[:, None])
    tl.store(part_ml_ptr + at * 2, m_i, mask=row_ok)
    tl.store(part_ml_ptr + at * 2 + 1, l_i, mask=row_ok)


@triton.jit
def _prefill_key_tiles(ctx_len, first_pos, seq_len, window, part_start, partition_size,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SLIDING: tl.constexpr,
                       TREE: tl.constexpr, SPLIT: tl.constexpr):
    """-> (unmasked_start, unmasked_end, masked_start, kv_end): a prefill tile whose first row sits
    at first_pos reads keys [unmasked_start, unmasked_end) unmasked, then [masked_start, kv_end)
    masked. Keys below the tile's first position are visible to all its rows (TREE: only the
    context and the root, the first query token, every node's ancestor); SLIDING masks every
    tile from the first one the first row can see; SPLIT cuts both ranges to the partition
    [part_start, part_start + partition_size) (its bounds are multiples of BLOCK_N)."""
    unmasked_end = (((ctx_len if TREE else first_pos) + 1) // BLOCK_N) * BLOCK_N
    kv_end = tl.minimum(first_pos + BLOCK_M, seq_len)
    masked_start = unmasked_end
    if SLIDING:
        unmasked_end = 0
        masked_start = (tl.maximum(first_pos - window + 1, 0) // BLOCK_N) * BLOCK_N
    unmasked_start = 0
    if SPLIT:
        unmasked_start = part_start
        unmasked_end = tl.minimum(unmasked_end, part_start + partition_size)
        masked_start = tl.maximum(masked_start, part_start)
        kv_end = tl.minimum(kv_end, part_start + partition_size)
    return unmasked_start, unmasked_end, masked_start, kv_end


@triton.jit
def _decode_key_tiles(part_start, part_end, ctx_len, window, BLOCK_N: tl.constexpr, SLIDING: tl.constexpr):
    """-> (unmasked_end, masked_start): a decode program reads keys [part_start, unmasked_end)
    without the mask and [masked_start, part_end) with it."""
    # keys up to ctx_len are visible to every query token; only the last tiles need the mask
    unmasked_end = part_start + ((tl.minimum(part_end, ctx_len + 1) - part_start) // BLOCK_N) * BLOCK_N
    unmasked_end = tl.maximum(unmasked_end, part_start)
    masked_start = unmasked_end
    if SLIDING:  # every tile masked, from the first one the earliest query (at ctx_len) can see;
        # a partition wholly before the window keeps m = -1e30, l = 0, and weighs 0 in the merge
        unmasked_end = part_start
        masked_start = tl.maximum((tl.maximum(ctx_len - window + 1, 0) // BLOCK_N) * BLOCK_N, part_start)
    return unmasked_end, masked_start


@triton.jit(do_not_specialize=['partition_size', 'first_seq', 'stride_bt', 'stride_pt', 'stride_ph', 'window'])
def _decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_out_ptr, part_ml_ptr,
    query_start_loc_ptr, seq_lens_ptr, block_tables_ptr, tree_mask_ptr,
    k_ptr, v_ptr, positions_ptr, cos_sin_ptr, slot_ptr, counter_ptr,
    scale_log2, partition_size, first_seq, window,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_bt, stride_pt, stride_ph, stride_kt, stride_knh, stride_vt, stride_vnh, stride_cs,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_Q: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr, SPLIT: tl.constexpr, SLIDING: tl.constexpr, TREE: tl.constexpr,
    ROPE: tl.constexpr = False, MERGE: tl.constexpr = False, MTILE: tl.constexpr = 16, USE_PDL: tl.constexpr = False,
    EARLY: tl.constexpr = False,
):
    pdl.release(USE_PDL, EARLY)  # the kernel after this one (merge, o projection) scheduled now: EARLY_RELEASE
    seq = first_seq + tl.program_id(0)
    kv_head = tl.program_id(1)
    part = tl.program_id(2)
    # Before the PDL wait (pdl.enter) only what the kernel before this one (QKV projection or KV
    # write), which may still run, does not write: the host's metadata, the rotary table. (The first
    # K/V tile here too: no faster at batch 1 on the H200, 6-10% slower at 64 and 256.)
    seq_len = tl.load(seq_lens_ptr + seq)
    part_start = part * partition_size
    if part_start >= seq_len:
        return
    part_end = tl.minimum(part_start + partition_size, seq_len)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    ctx_len = seq_len - q_len
    table_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bt
    t, tokens, heads, dims, row_ok = _group_rows(q_start, q_len, kv_head, GROUP, BLOCK_G, BLOCK_Q, HEAD_DIM)
    if ROPE:  # the angles of the query rows and of the new keys this partition writes
        q_cos, q_sin = _angles(positions_ptr + tokens, row_ok, cos_sin_ptr, stride_cs, dims, HEAD_DIM)
        new_tokens, new_ok, new_slots, k_cos, k_sin = _new_kv_targets(
            slot_ptr, positions_ptr, cos_sin_ptr, stride_cs, q_start, q_len, ctx_len, part_start, part_end, dims,
            BLOCK_Q, HEAD_DIM)
    pdl.enter_released(USE_PDL, EARLY)

    q_rows = q_ptr + tokens[:, None] * stride_qt + heads[:, None] * stride_qh
    q = tl.load(q_rows + dims[None, :], mask=row_ok[:, None], other=0.0)
    if ROPE:  # q rotated in registers (q itself stays as it is), then the step's new keys in this
        # partition rotated, with their values, into the cache (their loads in flight with q's)
        q = _rotate(q, q_rows, dims, row_ok, q_cos, q_sin, HEAD_DIM)
        _write_new_kv(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, new_tokens, new_ok, new_slots, k_cos, k_sin,
                      kv_head, stride_kt, stride_knh, stride_vt, stride_vnh,
                      stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, BLOCK_SIZE, HEAD_DIM)
        tl.debug_barrier()  # the program's stores are visible to its own loads below
    q_pos = ctx_len + t
    tree_bits = 0
    if TREE:  # keys up to ctx_len (context + root) are every tree row's: the unmasked tiles hold
        tree_bits = tl.load(tree_mask_ptr + tokens, mask=row_ok, other=-1)

    acc, m_i, l_i = _attend_partition(q, q_pos, part_start, part_end, seq_len, ctx_len, window, tree_bits, kv_head,
                                      table_ptr, k_cache_ptr, v_cache_ptr, stride_kb, stride_ks, stride_kh,
                                      stride_vb, stride_vs, stride_vh, scale_log2, BLOCK_Q * BLOCK_G, HEAD_DIM,
                                      BLOCK_SIZE, BLOCK_N, PRECISION, SLIDING, TREE)
    _store_decode(acc, m_i, l_i, tokens, heads, dims, row_ok, part, first_seq, query_start_loc_ptr,
                  out_ptr, part_out_ptr, part_ml_ptr, stride_ot, stride_oh, stride_pt, stride_ph, counter_ptr, seq,
                  kv_head, q_start, q_len, tl.cdiv(seq_len, partition_size), HEAD_DIM, SPLIT, MERGE, GROUP, BLOCK_G,
                  MTILE)


@triton.jit
def _attend_partition(q, q_pos, part_start, part_end, seq_len, ctx_len, window, tree_bits, kv_head, table_ptr,
                      k_cache_ptr, v_cache_ptr, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                      scale_log2, ROWS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                      BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, SLIDING: tl.constexpr, TREE: tl.constexpr):
    """A decode program's online softmax over keys [part_start, part_end): -> (acc, m, l) of its
    ROWS query rows, unnormalised."""
    m_i = tl.full([ROWS], _NEG_BIG, tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, HEAD_DIM], tl.float32)
    unmasked_end, masked_start = _decode_key_tiles(part_start, part_end, ctx_len, window, BLOCK_N, SLIDING)
    for start_n in range(part_start, unmasked_end, BLOCK_N):
        acc, m_i, l_i = _attend_tile(acc, m_i, l_i, q, q_pos, start_n, seq_len, kv_head, table_ptr,
                                     k_cache_ptr, v_cache_ptr, stride_kb, stride_ks, stride_kh,
                                     stride_vb, stride_vs, stride_vh, scale_log2, window, tree_bits, ctx_len,
                                     HEAD_DIM, BLOCK_SIZE, BLOCK_N, PRECISION, False, SLIDING, TREE)
    for start_n in range(masked_start, part_end, BLOCK_N):
        acc, m_i, l_i = _attend_tile(acc, m_i, l_i, q, q_pos, start_n, part_end, kv_head, table_ptr,
                                     k_cache_ptr, v_cache_ptr, stride_kb, stride_ks, stride_kh,
                                     stride_vb, stride_vs, stride_vh, scale_log2, window, tree_bits, ctx_len,
                                     HEAD_DIM, BLOCK_SIZE, BLOCK_N, PRECISION, True, SLIDING, TREE)
    return acc, m_i, l_i


@triton.jit
def _group_rows(q_start, q_len, kv_head, GROUP: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_Q: tl.constexpr,
                HEAD_DIM: tl.constexpr):
    """The rows of a (sequence, KV head) program: every (query token t, head g of the KV group),
    t-major, [BLOCK_Q * BLOCK_G]. -> (t, tokens, heads, dims, row_ok)."""
    rows = tl.arange(0, BLOCK_Q * BLOCK_G)
    t = rows // BLOCK_G
    g = rows % BLOCK_G
    tokens = (q_start + t).to(tl.int64)
    return t, tokens, kv_head * GROUP + g, tl.arange(0, HEAD_DIM), (t < q_len) & (g < GROUP)


@triton.jit
def _angles(pos_ptrs, ok, cos_sin_ptr, stride_cs, dims, HEAD_DIM: tl.constexpr):
    """The rotary angles of rows at positions *pos_ptrs [M] -> (cos, sin) [M, D] fp32, each half
    of a row repeated (rotate-half pairing). cos_sin [max_position, D]: cos in the first half of a
    row, sin in the second."""
    pos = tl.load(pos_ptrs, mask=ok, other=0)
    angle = cos_sin_ptr + pos.to(tl.int64)[:, None] * stride_cs + dims[None, :] % (HEAD_DIM // 2)
    cos = tl.load(angle, mask=ok[:, None], other=0.0).to(tl.float32)
    sin = tl.load(angle + HEAD_DIM // 2, mask=ok[:, None], other=0.0).to(tl.float32)
    return cos, sin


@triton.jit
def _rotate(x, row_ptrs, dims, ok, cos, sin, HEAD_DIM: tl.constexpr):
    """Rows x [M, D] (at row_ptrs [M, 1] + dims) rotated by the angles cos, sin [M, D] (_angles),
    rotate-half pairing, in fp32, rounded to x's dtype: what engine.kernels.fused's rotary stores."""
    pair = tl.load(row_ptrs + (dims[None, :] + HEAD_DIM // 2) % HEAD_DIM, mask=ok[:, None], other=0.0)
    xf, pf = x.to(tl.float32), pair.to(tl.float32)
    return tl.where(dims[None, :] < HEAD_DIM // 2, xf * cos - pf * sin, xf * cos + pf * sin).to(x.dtype)


@triton.jit
def _new_kv_targets(slot_ptr, positions_ptr, cos_sin_ptr, stride_cs, q_start, q_len, ctx_len, part_start, part_end,
                    dims, BLOCK_Q: tl.constexpr, HEAD_DIM: tl.constexpr):
    """The step's new tokens whose keys (context index ctx_len + t) fall in [part_start, part_end)
    and have a slot (-1 skips) -> (tokens [BLOCK_Q], ok, slots, cos, sin): what _write_new_kv
    needs that the host wrote, loaded before the PDL wait."""
    t = tl.arange(0, BLOCK_Q)
    tokens = (q_start + t).to(tl.int64)
    slot = tl.load(slot_ptr + tokens, mask=t < q_len, other=-1).to(tl.int64)
    ok = (t < q_len) & (ctx_len + t >= part_start) & (ctx_len + t < part_end) & (slot >= 0)
    cos, sin = _angles(positions_ptr + tokens, ok, cos_sin_ptr, stride_cs, dims, HEAD_DIM)
    return tokens, ok, tl.where(ok, slot, 0), cos, sin


@triton.jit
def _write_new_kv(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, tokens, ok, slot, cos, sin, kv_head,
                  stride_kt, stride_knh, stride_vt, stride_vnh,
                  stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                  BLOCK_SIZE, HEAD_DIM: tl.constexpr):
    """The new tokens `ok` of _new_kv_targets: k [T, Hkv, D] rotated and v, this KV head's, to
    their cache slots, as engine.kernels.attention_rope_kv.rotary_write_kv writes them."""
    dims = tl.arange(0, HEAD_DIM)
    k_rows = k_ptr + tokens[:, None] * stride_kt + kv_head * stride_knh
    k = _rotate(tl.load(k_rows + dims[None, :], mask=ok[:, None], other=0.0), k_rows, dims, ok, cos, sin, HEAD_DIM)
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    k_dst = k_cache_ptr + (block * stride_kb + offset * stride_ks + kv_head * stride_kh)[:, None] + dims[None, :]
    tl.store(k_dst, k, mask=ok[:, None])
    v = tl.load(v_ptr + tokens[:, None] * stride_vt + kv_head * stride_vnh + dims[None, :], mask=ok[:, None], other=0.0)
    v_dst = v_cache_ptr + (block * stride_vb + offset * stride_vs + kv_head * stride_vh)[:, None] + dims[None, :]
    tl.store(v_dst, v, mask=ok[:, None])


@triton.jit
def _store_decode(acc, m_i, l_i, tokens, heads, dims, row_ok, part, first_seq, query_start_loc_ptr,
                  out_ptr, part_out_ptr, part_ml_ptr, stride_ot, stride_oh, stride_pt, stride_ph, counter_ptr, seq,
                  kv_head, q_start, q_len, num_parts, HEAD_DIM: tl.constexpr, SPLIT: tl.constexpr,
                  MERGE: tl.constexpr, GROUP: tl.constexpr, BLOCK_G: tl.constexpr, MTILE: tl.constexpr):
    if SPLIT:
        # unnormalised partial state of this launch's token rows: acc [rows, Hq, P, D] and
        # (m, l) [rows, Hq, P, 2], merged by a second kernel, or (MERGE) by the last program
        first_token = tl.load(query_start_loc_ptr + first_seq)
        part_rows = (tokens - first_token) * stride_pt + heads * stride_ph + part
        tl.store(part_out_ptr + part_rows[:, None] * HEAD_DIM + dims[None, :], acc,
                 mask=row_ok[:, None])
        tl.store(part_ml_ptr + part_rows * 2, m_i, mask=row_ok)
        tl.store(part_ml_ptr + part_rows * 2 + 1, l_i, mask=row_ok)
        if MERGE:
            _merge_if_last(counter_ptr, out_ptr, part_out_ptr, part_ml_ptr, first_token, first_seq, seq, kv_head,
                           q_start, q_len, num_parts, stride_ot, stride_oh, stride_pt, stride_ph,
                           GROUP, BLOCK_G, HEAD_DIM, MTILE)
    else:
        out = acc / l_i[:, None]
        tl.store(out_ptr + tokens[:, None] * stride_ot + heads[:, None] * stride_oh + dims[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


@triton.jit
def _merge_if_last(counter_ptr, out_ptr, part_out_ptr, part_ml_ptr, first_token, first_seq, seq, kv_head,
                   q_start, q_len, num_parts, stride_ot, stride_oh, stride_pt, stride_ph,
                   GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, MTILE: tl.constexpr):
    """The merge inside the split launch: the partial states are stored; the program that finishes
    a (sequence, KV head)'s partitions last (a counter per pair, counter_ptr [launch's sequences,
    KV heads], left at 0 again) merges them for every query token and head of the group, as
    attention_split._merge_partitions_kernel does, MTILE partitions a round."""
    tl.debug_barrier()  # every thread's partial state is stored before the counter moves
    counter = counter_ptr + (seq - first_seq) * tl.num_programs(1) + kv_head
    # acq_rel at GPU scope: releases this program's stores, and the last one acquires the others'
    if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") != num_parts - 1:
        return
    tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")  # ready for the next launch (graph replays)
    g = tl.arange(0, BLOCK_G)
    p = tl.arange(0, MTILE)
    dims = tl.arange(0, HEAD_DIM)
    heads = kv_head * GROUP + g
    for t in range(0, q_len):
        base = (q_start + t - first_token).to(tl.int64) * stride_pt + heads * stride_ph  # [G]
        m = tl.full([BLOCK_G], _NEG_BIG, tl.float32)
        denom = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, HEAD_DIM], tl.float32)
        for p0 in range(0, num_parts, MTILE):
            ok = ((p0 + p) < num_parts)[:, None] & (g < GROUP)[None, :]  # [P, G]
            at = base[None, :] + p0 + p[:, None]
            m_p = tl.load(part_ml_ptr + at * 2, mask=ok, other=_NEG_BIG, cache_modifier=".cg")
            l_p = tl.load(part_ml_ptr + at * 2 + 1, mask=ok, other=0.0, cache_modifier=".cg")
            o_p = tl.load(part_out_ptr + at[:, :, None] * HEAD_DIM + dims[None, None, :], mask=ok[:, :, None],
                          other=0.0, cache_modifier=".cg")
            m_new = tl.maximum(m, tl.max(m_p, 0))
            a = tl.exp2(m - m_new)
            b = tl.exp2(m_p - m_new[None, :])  # [P, G]; masked partitions weigh 0
            acc = acc * a[:, None] + tl.sum(o_p * b[:, :, None], 0)
            denom = denom * a + tl.sum(l_p * b, 0)
            m = m_new
        token = (q_start + t).to(tl.int64)
        tl.store(out_ptr + token * stride_ot + heads[:, None] * stride_oh + dims[None, :],
                 (acc / denom[:, None]).to(out_ptr.dtype.element_ty), mask=(g < GROUP)[:, None])


@triton.jit(do_not_specialize=['partition_size', 'first_seq', 'stride_pt', 'stride_ph'])
def _reduce_partitions_kernel(
    out_ptr, part_out_ptr, part_ml_ptr, query_start_loc_ptr, seq_lens_ptr,
    partition_size, first_seq, stride_ot, stride_oh, stride_pt, stride_ph,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_Q: tl.constexpr, HEAD_DIM: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    pdl.enter(USE_PDL)
    seq = first_seq + tl.program_id(0)
    kv_head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + seq)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    num_parts = tl.cdiv(seq_len, partition_size)

    _, tokens, heads, dims, row_ok = _group_rows(q_start, q_len, kv_head, GROUP, BLOCK_G, BLOCK_Q, HEAD_DIM)
    base_rows = (tokens - tl.load(query_start_loc_ptr + first_seq)) * stride_pt + heads * stride_ph

    m = tl.full([BLOCK_Q * BLOCK_G], _NEG_BIG, tl.float32)
    denom = tl.zeros([BLOCK_Q * BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_Q * BLOCK_G, HEAD_DIM], tl.float32)
    for part in range(0, num_parts):
        part_rows = base_rows + part
        m_p = tl.load(part_ml_ptr + part_rows * 2, mask=row_ok, other=_NEG_BIG)
        l_p = tl.load(part_ml_ptr + part_rows * 2 + 1, mask=row_ok, other=0.0)
        o_p = tl.load(part_out_ptr + part_rows[:, None] * HEAD_DIM + dims[None, :],
                      mask=row_ok[:, None], other=0.0)
        m_new = tl.maximum(m, m_p)
        a = tl.exp2(m - m_new)
        b = tl.exp2(m_p - m_new)
        acc = acc * a[:, None] + o_p * b[:, None]
        denom = denom * a + l_p * b
        m = m_new
    denom = tl.where(row_ok, denom, 1.0)
    out = acc / denom[:, None]
    tl.store(out_ptr + tokens[:, None] * stride_ot + heads[:, None] * stride_oh + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


def _check_attention_args(q, k_cache, v_cache, meta, out, kernel, sliding_window=None) -> torch.Tensor:
    """Validates the shared contract; returns `out` (allocated when None)."""
    if sliding_window is not None and (not isinstance(sliding_window, int) or sliding_window < 1):
        raise ValueError(f"sliding_window must be None or an int >= 1, got {sliding_window!r}")
    require_tensor("q", q, ndim=3, dtypes=FLOAT_DTYPES)
    require_tensor("k_cache", k_cache, ndim=4, dtypes=FLOAT_DTYPES)
    require_tensor("v_cache", v_cache, ndim=4, dtypes=FLOAT_DTYPES)
    require_same("k_cache", k_cache, "q", q)
    require_same("v_cache", v_cache, "k_cache", k_cache, shape=True)
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    if k_cache.shape[3] != head_dim:
        raise ValueError(f"q has head_dim {head_dim} but k_cache is [blocks, block_size, kv_heads, "
                         f"head_dim] = {tuple(k_cache.shape)}")
    if head_dim < 16 or head_dim > 256 or head_dim & (head_dim - 1):
        raise ValueError(f"head_dim must be a power of two in [16, 256], got {head_dim}")
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads are not a multiple of {num_kv_heads} KV heads")
    num_seqs = len(meta.seq_lens_cpu)
    for name, t, ndim, rows in (("meta.query_start_loc", meta.query_start_loc, 1, num_seqs + 1),
                                ("meta.seq_lens", meta.seq_lens, 1, num_seqs),
                                ("meta.block_tables", meta.block_tables, 2, num_seqs)):
        require_tensor(name, t, ndim=ndim, dtypes=(torch.int32,), last_dim_contiguous=(ndim == 2))
        require_same(name, t, "q", q, dtype=False)
        if t.shape[0] != rows:
            raise ValueError(f"{name} has {t.shape[0]} rows, expected {rows} for {num_seqs} sequences")
    if meta.query_start_loc.stride(0) != 1 or meta.seq_lens.stride(0) != 1:
        raise ValueError("meta.query_start_loc and meta.seq_lens must be contiguous")
    if meta.tree_mask is not None:
        if sliding_window is not None:
            raise ValueError("tree drafts (meta.tree_mask) with a sliding window are not supported")
        require_tensor("meta.tree_mask", meta.tree_mask, ndim=1, dtypes=(torch.int64,))
        require_same("meta.tree_mask", meta.tree_mask, "q", q, dtype=False)
        if meta.tree_mask.shape[0] != num_tokens or meta.tree_mask.stride(0) != 1:
            raise ValueError(f"meta.tree_mask must be contiguous with one entry per query token "
                             f"({num_tokens}), got {tuple(meta.tree_mask.shape)}")
    if len(meta.query_lens_cpu) != num_seqs or sum(meta.query_lens_cpu) != num_tokens:
        raise ValueError(f"meta.query_lens_cpu sums to {sum(meta.query_lens_cpu)} over "
                         f"{len(meta.query_lens_cpu)} sequences; q has {num_tokens} tokens, "
                         f"{num_seqs} sequences")
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    else:
        require_tensor("out", out, ndim=3, dtypes=FLOAT_DTYPES)
        require_same("out", out, "q", q, shape=True)
    require_runnable(q, kernel)
    return out


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"  # "tf32" is ignored for 16-bit inputs


class NewKV(NamedTuple):
    """A step's new keys and values as the q/k/v projection left them (not rotated, not in the
    cache), for the decode kernel to rotate and write (`paged_decode_attention(rope=...)`):
    k, v [T, Hkv, D] (views allowed), positions [T], the cos/sin cache [max_position, D] (cos in
    the first half of a row), slot_mapping [T] (-1: no write)."""
    k: torch.Tensor
    v: torch.Tensor
    positions: torch.Tensor
    cos_sin: torch.Tensor
    slot_mapping: torch.Tensor


class _SeqRange:
    """The sequences [first, first + count) of a batch, with their host-side maxima."""

    def __init__(self, meta: AttentionMetadata, first: int = 0, count: int | None = None):
        count = meta.num_seqs - first if count is None else count
        self.first, self.count = first, count
        self.num_tokens = sum(meta.query_lens_cpu[first:first + count])
        self.max_query_len = max(meta.query_lens_cpu[first:first + count], default=0)
        self.max_seq_len = max(meta.seq_lens_cpu[first:first + count], default=0)


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            meta: AttentionMetadata, scale: float,
                            out: torch.Tensor | None = None, sliding_window: int | None = None) -> torch.Tensor:
    """Causal varlen attention over a paged cache for any mix of query lengths, in one launch.
    q: [T, Hq, D] -> out [T, Hq, D] (written into `out` when given)."""
    out = _check_attention_args(q, k_cache, v_cache, meta, out, _prefill_kernel, sliding_window)
    if q.shape[0]:
        _prefill(q, k_cache, v_cache, meta, scale, out, _SeqRange(meta), sliding_window)
    return out


_PREFILL_BLOCK_N = 64


def _prefill_tile(max_query_len: int, head_dim: int) -> tuple[int, int]:
    """(BLOCK_M, num_warps) of the prefill launch for this longest query."""
    if max_query_len >= 128 and head_dim <= 128:
        return 128, 8
    return max(16, min(64, next_power_of_2(max_query_len))), 4


def _prefill(q, k_cache, v_cache, meta, scale, out, seqs: _SeqRange, sliding_window=None,
             partition_size: int | None = None):
    block_m, num_warps = _prefill_tile(seqs.max_query_len, q.shape[2])
    if partition_size is None and meta.tree_mask is None:   # tree-mask steps keep one pass (split untested there)
        programs = q.shape[1] * triton.cdiv(seqs.max_query_len, block_m) * seqs.count
        partition_size = choose_prefill_partition(programs, seqs.max_seq_len, _num_sms(q.device), _PREFILL_BLOCK_N)
    _launch_prefill(q, k_cache, v_cache, meta, scale, out, block_m, _PREFILL_BLOCK_N, num_warps,
                    num_stages=2, seqs=seqs, sliding_window=sliding_window, partition_size=partition_size)


def _launch_prefill(q, k_cache, v_cache, meta, scale, out, block_m, block_n, num_warps, num_stages,
                    seqs: _SeqRange | None = None, sliding_window: int | None = None,
                    partition_size: int | None = None):
    seqs = seqs or _SeqRange(meta)
    num_heads, head_dim = q.shape[1:]
    split = partition_size is not None and partition_size < seqs.max_seq_len
    if split and partition_size % block_n:
        raise ValueError(f"a prefill partition must be a multiple of the key tile {block_n}, got {partition_size}")
    num_parts = triton.cdiv(seqs.max_seq_len, partition_size) if split else 1
    if split:   # these sequences' token rows, merged below
        part_out, part_ml = partial_states(seqs.num_tokens, num_heads, num_parts, head_dim, q.device)
    else:
        part_out = part_ml = out  # unused by the kernel
    grid = (num_heads * num_parts, triton.cdiv(seqs.max_query_len, block_m), seqs.count)
    tree = meta.tree_mask
    _prefill_kernel[grid](
        q, k_cache, v_cache, out, part_out, part_ml, meta.query_start_loc, meta.seq_lens, meta.block_tables,
        tree if tree is not None else meta.seq_lens,
        scale * _LOG2E, seqs.first, sliding_window or 0, partition_size if split else _WHOLE_CONTEXT, num_heads,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        meta.block_tables.stride(0), num_heads * num_parts, num_parts,
        GROUP=num_heads // k_cache.shape[2], HEAD_DIM=head_dim, BLOCK_SIZE=k_cache.shape[1],
        BLOCK_M=block_m, BLOCK_N=block_n, PRECISION=_precision(q.dtype), SLIDING=sliding_window is not None,
        TREE=tree is not None, SPLIT=split, num_warps=num_warps, num_stages=num_stages,
    )
    if split:
        merge_partitions(out, part_out, part_ml, meta, partition_size, seqs.first, seqs.count, seqs.max_query_len)


_SM_COUNTS: dict[int, int] = {}


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 1
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNTS:
        _SM_COUNTS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNTS[index]


_DECODE_BLOCK_N = 64
# under PDL, the decode kernel lets the kernel after it be scheduled before it waits (pdl.release).
# Off: llama3-8b batch 1 on the H200 with it (and the merge's, SplitPolicy.early_release) took 2.429
# ms (FP8) and 4.050 (bf16) at 1k against 2.422 and 4.020 with the merge's alone; 2.729 against
# 2.743 (FP8) at 8k (bench/gemv_gpu.py's "early2" variant token)
EARLY_RELEASE = False
# one pass reads each sequence's whole context, whatever meta.max_seq_len says (graph replays)
_WHOLE_CONTEXT = 2**30


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           meta: AttentionMetadata, scale: float, out: torch.Tensor | None = None,
                           partition_size: int | str | None = "auto",
                           sliding_window: int | None = None, rope: NewKV | None = None) -> torch.Tensor:
    """Attention for 1..MAX_DECODE_QUERY_LEN new tokens per sequence (decode, speculative verify).
    q: [T, Hq, D] -> out [T, Hq, D]. partition_size: "auto" picks the split-K plan from the batch
    shape and the SM count; None forces one pass; an int (a multiple of 64) forces that split.
    `rope`: q and the step's new keys are not rotated yet and the new K/V not in the cache: the
    kernel rotates q in registers (q itself is left as it is) and writes the new K/V first, each
    program the keys of its own partition, as attention_rope_kv.rotary_write_kv would (checked
    there: `rotary_kv_attention` is the entry point)."""
    out = _check_attention_args(q, k_cache, v_cache, meta, out, _decode_kernel, sliding_window)
    if meta.max_query_len > MAX_DECODE_QUERY_LEN:
        raise ValueError(f"paged_decode_attention takes at most {MAX_DECODE_QUERY_LEN} query tokens "
                         f"per sequence, got max_query_len={meta.max_query_len}; use "
                         "paged_prefill_attention")
    if partition_size not in ("auto", None) and (not isinstance(partition_size, int)
                                                 or partition_size <= 0
                                                 or partition_size % _DECODE_BLOCK_N):
        raise ValueError(f"partition_size must be \"auto\", None or a positive multiple of "
                         f"{_DECODE_BLOCK_N}, got {partition_size!r}")
    if q.shape[0]:
        _decode(q, k_cache, v_cache, meta, scale, out, _SeqRange(meta), partition_size, sliding_window, rope)
    return out


def _decode(q, k_cache, v_cache, meta, scale, out, seqs: _SeqRange, partition_size="auto",
            sliding_window=None, rope: NewKV | None = None):
    if partition_size == "auto":
        partition_size = choose_partition_size(seqs.count, k_cache.shape[2], seqs.max_seq_len,
                                               _num_sms(q.device), _DECODE_BLOCK_N)
    _launch_decode(q, k_cache, v_cache, meta, scale, out, partition_size, _DECODE_BLOCK_N,
                   num_warps=4, num_stages=2, seqs=seqs, sliding_window=sliding_window, rope=rope)


def _launch_decode(q, k_cache, v_cache, meta, scale, out, partition_size, block_n, num_warps,
                   num_stages, seqs: _SeqRange | None = None, sliding_window: int | None = None,
                   rope: NewKV | None = None):
    seqs = seqs or _SeqRange(meta)
    num_heads, head_dim = q.shape[1:]
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    block_g = next_power_of_2(group)
    # tl.dot needs at least 16 rows: pad with (masked) query-token rows
    block_q = max(next_power_of_2(seqs.max_query_len), triton.cdiv(16, block_g))
    split = partition_size is not None and partition_size < seqs.max_seq_len
    num_parts = triton.cdiv(seqs.max_seq_len, partition_size) if split else 1
    if split:   # these sequences' token rows
        part_out, part_ml = partial_states(seqs.num_tokens, num_heads, num_parts, head_dim, q.device)
    else:
        part_out = part_ml = out  # unused by the kernel
    common = dict(GROUP=group, BLOCK_G=block_g, BLOCK_Q=block_q, HEAD_DIM=head_dim)
    tree = meta.tree_mask
    new = rope or NewKV(q, q, meta.seq_lens, q, meta.seq_lens)  # unread stand-ins without rope
    policy = attention_split.POLICY
    counters = (attention_split.merge_counters(q.device, seqs.count * num_kv_heads)
                if split and policy.fused_merge else None)
    _decode_kernel[(seqs.count, num_kv_heads, num_parts)](
        q, k_cache, v_cache, out, part_out, part_ml,
        meta.query_start_loc, meta.seq_lens, meta.block_tables, tree if tree is not None else meta.seq_lens,
        new.k, new.v, new.positions, new.cos_sin, new.slot_mapping,
        counters if counters is not None else meta.seq_lens,
        scale * _LOG2E, partition_size if split else _WHOLE_CONTEXT, seqs.first, sliding_window or 0,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        meta.block_tables.stride(0), num_heads * num_parts, num_parts,
        new.k.stride(0), new.k.stride(1), new.v.stride(0), new.v.stride(1), new.cos_sin.stride(0),
        BLOCK_SIZE=k_cache.shape[1], BLOCK_N=block_n, PRECISION=_precision(q.dtype), SPLIT=split,
        SLIDING=sliding_window is not None, TREE=tree is not None, ROPE=rope is not None,
        MERGE=counters is not None, MTILE=max(1, min(attention_split.MERGE_TILE, 64 // block_g)),
        EARLY=EARLY_RELEASE, num_warps=num_warps, num_stages=num_stages, **common, **pdl.launch_options(q.device),
    )
    if counters is not None:
        return
    if split and policy.vector_merge:
        merge_partitions(out, part_out, part_ml, meta, partition_size, seqs.first, seqs.count, seqs.max_query_len)
    elif split:
        _reduce_partitions_kernel[(seqs.count, num_kv_heads)](
            out, part_out, part_ml, meta.query_start_loc, meta.seq_lens,
            partition_size, seqs.first, out.stride(0), out.stride(1), num_heads * num_parts,
            num_parts, num_warps=4, **common, **pdl.launch_options(q.device),
        )


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float,
                    out: torch.Tensor | None = None, sliding_window: int | None = None) -> torch.Tensor:
    """The GPU twin of `paged_attention_torch`. Every sequence has at most MAX_DECODE_QUERY_LEN new
    tokens: the decode kernel. None has: the prefill kernel. A mix whose short sequences come
    first (decode and verify rows before prefill chunks, as the scheduler should order a batch):
    the decode kernel on those and the prefill kernel on the rest, two launches. Any other mix:
    the prefill kernel for all (correct, but a short row then costs a whole query tile per head)."""
    window = sliding_window
    if meta.max_query_len <= MAX_DECODE_QUERY_LEN:
        return paged_decode_attention(q, k_cache, v_cache, meta, scale, out, sliding_window=window)
    num_short = 0
    for q_len in meta.query_lens_cpu:
        if q_len > MAX_DECODE_QUERY_LEN:
            break
        num_short += 1
    if num_short == 0 or any(n <= MAX_DECODE_QUERY_LEN for n in meta.query_lens_cpu[num_short:]):
        return paged_prefill_attention(q, k_cache, v_cache, meta, scale, out, window)
    out = _check_attention_args(q, k_cache, v_cache, meta, out, _decode_kernel, window)
    _decode(q, k_cache, v_cache, meta, scale, out, _SeqRange(meta, 0, num_short), sliding_window=window)
    _prefill(q, k_cache, v_cache, meta, scale, out, _SeqRange(meta, num_short), window)
    return out


def compile_variants(k_cache: torch.Tensor, v_cache: torch.Tensor, num_heads: int,
                     sliding_window: int | None = None, trees: bool = False,
                     rope_cache: torch.Tensor | None = None, index_dtype: torch.dtype = torch.int32) -> int:
    """Launch every kernel variant the dispatch above can pick for this cache (each prefill tile
    shape; each decode query tile, with and without split-K) on a small problem, so Triton has
    compiled them (or loaded them from its cache) before serving needs one: a first compile takes
    a second or more, and inside a step it stalls every sequence of the batch. Reads blocks 0..15
    of the cache and writes nothing to it. `trees`: the tree-mask variants too (tree drafts on).
    `rope_cache` (the model's cos/sin cache): each decode variant also as the model's decode steps
    launch it, rotating and writing the new K/V itself (`rope`; positions and slots of
    `index_dtype`, every slot -1: nothing is written). Returns the number of launches."""
    device, dtype = k_cache.device, k_cache.dtype
    block_size, num_kv_heads, head_dim = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    context = 256
    num_blocks = triton.cdiv(context, block_size)
    if k_cache.shape[0] < num_blocks:
        return 0
    table = torch.arange(num_blocks, dtype=torch.int32, device=device)[None]

    def meta(q_len: int, tree: bool = False) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=torch.zeros(q_len, dtype=torch.int64, device=device),
            query_start_loc=torch.tensor([0, q_len], dtype=torch.int32, device=device),
            seq_lens=torch.tensor([context], dtype=torch.int32, device=device), block_tables=table,
            query_lens_cpu=[q_len], seq_lens_cpu=[context], max_query_len=q_len, max_seq_len=context,
            tree_mask=torch.full((q_len,), -1, dtype=torch.int64, device=device) if tree else None)

    def q(n: int) -> torch.Tensor:
        return torch.randn(n, num_heads, head_dim, dtype=dtype, device=device)

    launches = 0
    block_g = next_power_of_2(num_heads // num_kv_heads)
    tiles = {max(next_power_of_2(n), triton.cdiv(16, block_g)): n for n in range(MAX_DECODE_QUERY_LEN, 0, -1)}
    for tree in (False, True) if trees and sliding_window is None else (False,):
        for q_len in (16, 17, 33, 128):          # prefill tiles: BLOCK_M 16, 32, 64, 128
            paged_prefill_attention(q(q_len), k_cache, v_cache, meta(q_len, tree), 1.0, sliding_window=sliding_window)
            launches += 1
            if attention_split.POLICY.prefill_split and not tree:   # and split into 64-key partitions
                m, x = meta(q_len, tree), q(q_len)
                _prefill(x, k_cache, v_cache, m, 1.0, torch.empty_like(x), _SeqRange(m), sliding_window,
                         partition_size=_PREFILL_BLOCK_N)
                launches += 1
        for q_len in sorted(tiles.values()):     # decode tiles (BLOCK_Q), one pass and split-K
            q_len = max(q_len, 2) if tree else q_len  # a tree step: the root and a node at least
            ropes = [None] if rope_cache is None else [None, NewKV(
                q(q_len)[:, :num_kv_heads], q(q_len)[:, :num_kv_heads],
                torch.zeros(q_len, dtype=index_dtype, device=device), rope_cache,
                torch.full((q_len,), -1, dtype=index_dtype, device=device))]
            for partition in (None, _DECODE_BLOCK_N):
                for rope in ropes:
                    paged_decode_attention(q(q_len), k_cache, v_cache, meta(q_len, tree), 1.0,
                                           partition_size=partition, sliding_window=sliding_window, rope=rope)
                    launches += 1
    return launches
