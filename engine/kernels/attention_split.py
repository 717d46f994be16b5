"""Split-K plans for the decode attention kernel (flash-decoding), and the merge of the partitions.

A decode launch (`paged_attention._decode_kernel`) has one program per (sequence, KV head): at a
small batch that is far fewer programs than the GPU has SMs (llama3-8b at batch 1: 8 programs on
132 SMs), so each sequence's context is split into partitions, one program each, whose softmax
states a second kernel merges. `choose_partition_size` picks the split from the grid: enough
programs for `SplitPolicy.programs_per_sm` per SM, partitions of at least `min_partition` keys.

Two merge kernels, the same arithmetic (fp32, m/l rescaling in the log2 domain):
- `paged_attention._reduce_partitions_kernel`: one program per (sequence, KV head), looping over
  the partitions one at a time (each iteration waits for its loads);
- `_merge_partitions_kernel` here: one program per (query token, query head), loading up to
  MERGE_TILE partitions' states at once ([MERGE_TILE, head_dim]), so a merge of 16 partitions is
  one round of loads. Used when `SplitPolicy.vector_merge` (the default: on the H200 it took 1 x 8k
  at 256-key partitions from 22.5 to 15.4 us, 1 x 1k at 64-key ones from 11.1 to 7.4).

With `SplitPolicy.fused_merge` there is no second kernel: each program of the split launch counts
itself done on a counter per (sequence, KV head) (`merge_counters`), and the last one merges (built
and checked on the CPU; off until it is timed on the H200).

`POLICY` is the process's plan; `set_split_policy` replaces it (benchmarks compare plans). CUDA
graphs record the plan in force at capture: set it before the engine captures any.
"""

from __future__ import annotations

import dataclasses
import os
import threading
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tandem.engine.kernels import pdl

MERGE_TILE = 16  # partitions one merge iteration loads
_NEG_BIG = tl.constexpr(-1.0e30)  # paged_attention's finite "minus infinity"


@dataclass(frozen=True)
class SplitPolicy:
    """Defaults from the H200 sweep (bench/step_profile.py --attn, docs/benchmarks.md issue 23):
    the kernel alone is fastest at about 4 programs per SM where the context allows it (1 x 1k:
    16 partitions of 64 keys, 7.4 us against 11.2 for the old plan's 4 of 256; 32 x 8k: 2048-key
    partitions, 250 us against 339 unsplit), and with 512 programs unsplit (64 x 1k) a split only
    adds the merge. `split_below` from bench/engine_gpu.py's floor rows at 32, 33 and 48 x 5.8k
    (docs/benchmarks.md, issue 22: the step-time cliff at 33 sequences)."""
    min_partition: int = 64  # keys: a partition is at least this long (a multiple of block_n)
    # split when the (sequence, KV head) programs are fewer than this per SM: at 2 per SM the
    # unsplit kernel reads K/V at 78% of the copy rate (33 x 5.8k: 7.65 ms a step against 5.79
    # split at 32 x 5.8k; a step 23% slower for one more sequence), at 2.9 per SM at 97% (48 x 5.8k)
    split_below: int = 3
    programs_per_sm: int = 4  # then split until the programs reach this many per SM
    # and a partition is at least min(long_partition, plan / long_parts) keys (0: no such floor).
    # Inside the step many short partitions lose what the kernel alone gains: llama3-8b batch 1
    # at 8k context on the H200, 125 partitions of 64 keys took the step to 3.11 ms (FP8) and 4.58
    # (bf16), 32 of 256 to 2.74 and 4.30; a 1k context still wants its 16 of 64 (4 of 256: 7%
    # slower). docs/benchmarks.md, issue 24
    long_partition: int = 256
    long_parts: int = 16
    vector_merge: bool = True  # merge with _merge_partitions_kernel (else the looping reduce)
    # merge inside the split launch: the last program of each (sequence, KV head) to finish merges
    # its partitions (paged_attention._merge_if_last), no second launch. Off until timed on the H200
    fused_merge: bool = False
    # plan for the lower end of the context's power-of-two bucket, as a CUDA graph of that bucket
    # must (its plan serves every context in it); else for max_seq_len itself
    bucket_plan: bool = True
    # under PDL, the merge lets the kernel after it be scheduled before it waits for the split
    # launch (engine.kernels.pdl.release): the o projection's one-token GEMV then loads its first
    # weight tile while the attention runs on the few SMs it takes, instead of during the merge.
    # llama3-8b batch 1 on the H200: FP8 2.422 ms against 2.463 at 1k, bf16 4.023 against 4.063 (both
    # PDL launches); the decode kernel releasing its merge early as well gained nothing at 1k
    early_release: bool = True
    # a prefill launch with fewer programs than prefill_split_below per SM (a short chunk over a long
    # cached prefix: an agent's later turn) splits its keys into partitions of at least
    # prefill_min_partition keys, up to programs_per_sm programs per SM (choose_prefill_partition).
    # llama3-8b bf16 on the H200, per layer (bench/kernels_gpu.py --prefill-split): 32 new tokens
    # over 4k 34 us against 118 one pass, 128 over 8k 111 against 234, 128 over 32k 312 against
    # 903, 256 over 8k (64 programs) 193 against 237; 512 over 8k (128 programs, one per SM
    # already) 341 against 243: the partial states' traffic grows with the tokens, hence the line
    # at half a program per SM
    prefill_split: bool = True
    prefill_split_below: float = 0.5
    prefill_min_partition: int = 256


PREFILL_SPLIT_ENV = "TANDEM_PREFILL_SPLIT"


def _policy_from_env() -> SplitPolicy:
    """The default plan, with `prefill_split` from $TANDEM_PREFILL_SPLIT where it is set (1 on,
    0 off: an A/B switch that Ray's workers inherit)."""
    raw = os.environ.get(PREFILL_SPLIT_ENV, "").strip()
    if not raw:
        return SplitPolicy()
    if raw not in ("0", "1"):
        raise ValueError(f"${PREFILL_SPLIT_ENV} must be 1 (split short prefill chunks' keys) or 0, got {raw!r}")
    return SplitPolicy(prefill_split=raw == "1")


POLICY = _policy_from_env()


def set_split_policy(**changes) -> SplitPolicy:
    """Replace fields of the process's split plan; returns the previous plan (to restore it)."""
    global POLICY
    for name, value in changes.items():
        if name not in SplitPolicy.__dataclass_fields__:
            raise ValueError(f"SplitPolicy has no field {name!r}")
        if name in ("min_partition", "split_below", "programs_per_sm", "long_parts") and (
                not isinstance(value, int) or value < 1):
            raise ValueError(f"SplitPolicy.{name} must be a positive int, got {value!r}")
        if name == "long_partition" and (not isinstance(value, int) or value < 0):
            raise ValueError(f"SplitPolicy.long_partition must be an int >= 0, got {value!r}")
        if name == "prefill_split_below" and (isinstance(value, bool) or not isinstance(value, (int, float))
                                              or not value > 0):
            raise ValueError(f"SplitPolicy.prefill_split_below must be a number > 0 (programs per SM), got {value!r}")
        if name == "prefill_min_partition" and (not isinstance(value, int) or value < 64 or value % 64):
            raise ValueError(f"SplitPolicy.prefill_min_partition must be a positive multiple of 64 keys, got {value!r}")
    old, POLICY = POLICY, dataclasses.replace(POLICY, **changes)
    return old


def choose_partition_size(num_seqs: int, num_kv_heads: int, max_seq_len: int, num_sms: int,
                          block_n: int = 64, min_partition: int | None = None) -> int | None:
    """Split-K plan for decode: None (one pass) when the (sequence, KV head) programs already give
    every SM `split_below` programs, else a partition size (a multiple of block_n, at least
    min_partition keys, POLICY's when None) that brings the program count up to about
    `programs_per_sm` per SM, and at least min(long_partition, plan / long_parts) keys. With
    `bucket_plan`, the plan of a context in (2^(k-1), 2^k] is the plan of 2^(k-1) keys: one
    partition size for the bucket, its smallest contexts split enough."""
    policy = POLICY
    min_partition = max(block_n, policy.min_partition if min_partition is None else min_partition)
    programs = num_seqs * num_kv_heads
    if programs >= policy.split_below * num_sms:
        return None
    plan_len = max(1, (1 << max(0, max_seq_len - 1).bit_length()) // 2) if policy.bucket_plan else max_seq_len
    size = _partition(programs, plan_len, num_sms, min_partition, block_n)
    if size is None:
        return None
    floor = min(policy.long_partition, triton.cdiv(triton.cdiv(plan_len, policy.long_parts), block_n) * block_n)
    return max(size, floor)


def choose_prefill_partition(programs: int, max_seq_len: int, num_sms: int, block_n: int = 64) -> int | None:
    """Split-K plan of a prefill launch of `programs` (head, query tile, sequence) programs over
    contexts up to `max_seq_len` keys: None (one pass) unless `prefill_split` is on and the
    programs give the SMs fewer than `prefill_split_below` each; then partitions of at least
    `prefill_min_partition` keys (a multiple of block_n) that bring the programs up to about
    `programs_per_sm` per SM."""
    policy = POLICY
    if not policy.prefill_split or programs >= policy.prefill_split_below * num_sms:
        return None
    size = _partition(programs, max_seq_len, num_sms, policy.prefill_min_partition, block_n)
    return None if size is None else max(size, policy.prefill_min_partition)


def _partition(programs: int, keys: int, num_sms: int, min_partition: int, block_n: int) -> int | None:
    """Partitions of `keys` (a multiple of block_n) that bring `programs` up to about
    `programs_per_sm` per SM, none shorter than min_partition; None where that is one partition."""
    parts = min(triton.cdiv(POLICY.programs_per_sm * num_sms, programs), triton.cdiv(keys, min_partition))
    if parts <= 1:
        return None
    return triton.cdiv(triton.cdiv(keys, parts), block_n) * block_n


def partial_states(tokens: int, heads: int, parts: int, head_dim: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The fp32 partial softmax states a split launch writes and `merge_partitions` reads:
    acc [tokens, heads, parts, head_dim] and (m, l) [tokens, heads, parts, 2]."""
    return (torch.empty((tokens, heads, parts, head_dim), dtype=torch.float32, device=device),
            torch.empty((tokens, heads, parts, 2), dtype=torch.float32, device=device))


@triton.jit(do_not_specialize=['partition_size', 'first_seq', 'stride_ot', 'stride_oh', 'stride_pt', 'stride_ph'])
def _merge_partitions_kernel(
    out_ptr, part_out_ptr, part_ml_ptr, query_start_loc_ptr, seq_lens_ptr,
    partition_size, first_seq, stride_ot, stride_oh, stride_pt, stride_ph,
    HEAD_DIM: tl.constexpr, TILE: tl.constexpr, USE_PDL: tl.constexpr = False, EARLY: tl.constexpr = False,
):
    # grid: (sequences of the launch, query heads, longest query of the launch); the host's
    # metadata is read before the PDL wait, the partial states (the split launch's) after it.
    # EARLY: the kernel after this one is let start first (SplitPolicy.early_release)
    pdl.release(USE_PDL, EARLY)
    seq = first_seq + tl.program_id(0)
    head = tl.program_id(1)
    t = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + seq)
    if t >= tl.load(query_start_loc_ptr + seq + 1) - q_start:
        return
    num_parts = tl.cdiv(tl.load(seq_lens_ptr + seq), partition_size)
    # partial states: acc [tokens, Hq, P, D], (m, l) [tokens, Hq, P, 2], tokens counted from the
    # launch's first token
    row = (q_start + t - tl.load(query_start_loc_ptr + first_seq)).to(tl.int64) * stride_pt + head * stride_ph
    dims = tl.arange(0, HEAD_DIM)
    parts = tl.arange(0, TILE)
    pdl.enter_released(USE_PDL, EARLY)
    m = tl.full([1], _NEG_BIG, tl.float32)
    denom = tl.zeros([1], tl.float32)
    acc = tl.zeros([HEAD_DIM], tl.float32)
    for p0 in range(0, num_parts, TILE):
        ok = p0 + parts < num_parts
        at = row + p0 + parts  # [TILE]
        m_p = tl.load(part_ml_ptr + at * 2, mask=ok, other=_NEG_BIG)
        l_p = tl.load(part_ml_ptr + at * 2 + 1, mask=ok, other=0.0)
        o_p = tl.load(part_out_ptr + at[:, None] * HEAD_DIM + dims[None, :], mask=ok[:, None], other=0.0)
        m_new = tl.maximum(m, tl.max(m_p, 0))
        a = tl.exp2(m - m_new)
        b = tl.exp2(m_p - m_new)  # [TILE]; masked partitions: exp2(-1e30 - m_new) = 0
        acc = acc * a + tl.sum(o_p * b[:, None], 0)
        denom = denom * a + tl.sum(l_p * b, 0)
        m = m_new
    out = acc / denom
    token = (q_start + t).to(tl.int64)
    tl.store(out_ptr + token * stride_ot + head * stride_oh + dims, out.to(out_ptr.dtype.element_ty))


def merge_partitions(out, part_out, part_ml, meta, partition_size: int, first_seq: int, num_seqs: int,
                     max_query_len: int) -> None:
    """Merge the partial states of `_decode_kernel`'s split launch over sequences
    [first_seq, first_seq + num_seqs) into out [T, Hq, D]. part_out [tokens, Hq, P, D] and
    part_ml [tokens, Hq, P, 2] fp32 contiguous, tokens counted from the launch's first token."""
    num_heads, num_parts, head_dim = part_out.shape[1:]
    _merge_partitions_kernel[(num_seqs, num_heads, max_query_len)](
        out, part_out, part_ml, meta.query_start_loc, meta.seq_lens,
        partition_size, first_seq, out.stride(0), out.stride(1), num_heads * num_parts, num_parts,
        HEAD_DIM=head_dim, TILE=MERGE_TILE, EARLY=POLICY.early_release, num_warps=4,
        **pdl.launch_options(out.device),
    )


# (device, thread) -> the zeroed int32 counters of the merge inside a split launch; buffers a grown
# one replaced stay alive, since CUDA graphs captured with them still point at them
_COUNTERS: dict[tuple, torch.Tensor] = {}
_RETIRED: list[torch.Tensor] = []


def merge_counters(device: torch.device, n: int) -> torch.Tensor | None:
    """At least `n` int32 counters at 0 for a split launch's merge inside it (each program pair's
    last one leaves its counter at 0 again), one buffer per device and thread (two engines stepping
    at once on one GPU each have theirs). Grown only outside CUDA graph capture: None then (the
    caller merges with a second launch)."""
    key = (device, threading.get_ident())
    buf = _COUNTERS.get(key)
    if buf is None or buf.numel() < n:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        if buf is not None:
            _RETIRED.append(buf)
        buf = _COUNTERS[key] = torch.zeros(max(n, 1024), dtype=torch.int32, device=device)
    return buf
