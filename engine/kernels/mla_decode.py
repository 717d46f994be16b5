"""Latent attention's absorbed form over the paged latent cache (the Triton twin of
`engine.mla.latent_attention_torch`): decode steps and speculative verify steps, any number of
query tokens per sequence, each causal at its own position.

q: [T, H, rank + rope] (the latent part already through W_UK, then the rotated rope part);
cache: one layer's [num_blocks, block_size, 1, rank + rope]. Each head scores its query against
every cached [c, k_pe] and sums the latents c: out [T, H, rank]. All heads of a token share the
cache rows, so one program takes a block of BLOCK_H heads (the scores are one [BLOCK_H, BLOCK_N]
matrix product) and one of `splits` slices of the context; a second kernel merges the slices'
partial softmax sums. Which sequence a token belongs to, and how many positions it sees, are
worked out on the device from query_start_loc and seq_lens: nothing reads a device value on the
host, so a CUDA graph captures the call. `splits` depends on the token count alone (not on the
contexts, which a graph captured at one context replays at others): slices past a token's context
are empty programs that return at once.

Given W_UV (`w_uv`, engine.mla's fused absorbed form for small steps), the merge also applies it,
so the heads' outputs [T, H, v] come out of the second kernel and torch.bmm's launch goes."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem.engine.attention import AttentionMetadata
from tandem.engine.kernels import pdl
from tandem.engine.kernels.validate import (FLOAT_DTYPES, INDEX_DTYPES, next_power_of_2, require_runnable,
                                            require_same, require_tensor)

BLOCK_H = 16  # heads per program (tl.dot needs 16 rows)
MAX_SPLITS = 32
# the partial kernel's launch: context positions per loop step, warps, pipeline stages (bench/mla_gpu.py
# --sweep times others on the GPU)
LAUNCH = {"block_n": 32, "num_warps": 4, "num_stages": 2}
# PDL launches (engine.kernels.pdl: where the forward asks for them) for the partial and merge kernels;
# the merge with W_UV lets the kernel after it (the o projection's GEMV, which loads weights before its
# own wait) be scheduled before it waits itself, as the split attention's merge does (few programs).
# False: plain launches (bench/mla_gpu.py's `nopdl` variant compares)
PDL = True
# W_UV's own GEMV (apply_uv, engine.mla.LatentAttention.uv_gemv): outputs per program; at V2-Lite's
# sizes (v 128, rank 512) 8 programs per head, 128 in a batch-1 step, each reading 16 KB of W_UV
UV_GEMV_ROWS = 16
# the plain merge's rank columns per program (a power of two; None: the whole rank, one program per
# (token, head)); bench/mla_gpu.py --step-variants mergeN times others
MERGE_RANK_BLOCK: int | None = None
# the merge with W_UV (mla_decode's w_uv): outputs per program and rank columns per loop step. At
# V2-Lite's sizes (v 128, rank 512) 4 programs per (token, head), 64 in a batch-1 step, each reading
# the head's partial sums (64 KB of fp32 at 32 slices) and a [32, 512] slice of W_UV (32 KB in
# bf16); with one program per head, 16 programs would read 128 KB of W_UV each. Not measured
# against other choices (bench/mla_gpu.py --absorb-launch sets them)
UV_LAUNCH = {"block_v": 32, "chunk_r": 64}


@triton.jit
def _mla_partial_kernel(
    q_ptr, q_pe_ptr, cache_ptr, tables_ptr, tok_seq_ptr, kv_len_ptr, acc_ptr, ml_ptr,
    scale, block_size, num_heads,
    stride_qt, stride_qh, stride_pt, stride_ph, stride_cb, stride_cs, stride_tb,
    RANK: tl.constexpr, ROPE: tl.constexpr, SPLITS: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_HEADS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    pdl.enter(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    head_block = tl.program_id(1)
    split = tl.program_id(2)
    seq = tl.load(tok_seq_ptr + t).to(tl.int64)
    kv_len = tl.load(kv_len_ptr + t)
    chunk = tl.cdiv(tl.cdiv(kv_len, SPLITS), BLOCK_N) * BLOCK_N
    start = split * chunk
    end = tl.minimum(start + chunk, kv_len)

    heads = head_block * BLOCK_HEADS + tl.arange(0, BLOCK_HEADS)
    hmask = heads < num_heads
    r = tl.arange(0, BLOCK_R)
    p = tl.arange(0, BLOCK_P)
    q_row = q_ptr + t * stride_qt + heads[:, None] * stride_qh
    q_lat = tl.load(q_row + r[None, :], mask=hmask[:, None] & (r[None, :] < RANK), other=0.0)  # [BH, BR]
    q_pe_row = q_pe_ptr + t * stride_pt + heads[:, None] * stride_ph
    q_pe = tl.load(q_pe_row + p[None, :], mask=hmask[:, None] & (p[None, :] < ROPE), other=0.0)

    m = tl.full([BLOCK_HEADS], float("-inf"), tl.float32)
    denom = tl.zeros([BLOCK_HEADS], tl.float32)
    acc = tl.zeros([BLOCK_HEADS, BLOCK_R], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        pmask = pos < end
        block = tl.load(tables_ptr + seq * stride_tb + pos // block_size, mask=pmask, other=0).to(tl.int64)
        row = cache_ptr + block * stride_cb + (pos % block_size) * stride_cs  # [BN]
        k_lat = tl.load(row[:, None] + r[None, :], mask=pmask[:, None] & (r[None, :] < RANK), other=0.0)
        k_pe = tl.load(row[:, None] + RANK + p[None, :], mask=pmask[:, None] & (p[None, :] < ROPE), other=0.0)
        if IEEE:
            s = tl.dot(q_lat, tl.trans(k_lat), input_precision="ieee")
            s += tl.dot(q_pe, tl.trans(k_pe), input_precision="ieee")
        else:
            s = tl.dot(q_lat, tl.trans(k_lat)) + tl.dot(q_pe, tl.trans(k_pe))
        s = tl.where(pmask[None, :], s * scale, float("-inf"))  # [BH, BN]
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp(m - m_new)
        prob = tl.exp(s - m_new[:, None])
        denom = denom * alpha + tl.sum(prob, 1)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(prob, k_lat, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(prob.to(k_lat.dtype), k_lat)
        m = m_new

    # partials: acc [T, H, SPLITS, BLOCK_R], (m, l) [T, H, SPLITS, 2]
    slot = (t * num_heads + heads) * SPLITS + split  # [BH]
    tl.store(acc_ptr + slot[:, None] * BLOCK_R + r[None, :], acc, mask=hmask[:, None])
    tl.store(ml_ptr + slot * 2, m, mask=hmask)
    tl.store(ml_ptr + slot * 2 + 1, denom, mask=hmask)


@triton.jit
def _split_weights(ml_ptr, base, SPLITS: tl.constexpr, BLOCK_S: tl.constexpr):
    """-> (slices, their mask, each slice's weight, the softmax denominator) of one (token, head)."""
    sp = tl.arange(0, BLOCK_S)
    smask = sp < SPLITS
    m = tl.load(ml_ptr + (base + sp) * 2, mask=smask, other=float("-inf"))
    denom = tl.load(ml_ptr + (base + sp) * 2 + 1, mask=smask, other=0.0)
    m_max = tl.max(m, 0)
    w = tl.where(m > float("-inf"), tl.exp(m - m_max), 0.0)  # an empty slice weighs nothing
    return sp, smask, w, tl.sum(denom * w, 0)


@triton.jit
def _mla_merge_kernel(acc_ptr, ml_ptr, out_ptr, num_heads, stride_ot, stride_oh,
                      RANK: tl.constexpr, SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_R: tl.constexpr,
                      BLOCK_RM: tl.constexpr, USE_PDL: tl.constexpr = False, EARLY: tl.constexpr = False):
    # program (token, head, block of BLOCK_RM rank columns). EARLY: the kernel after this one (W_UV's
    # GEMV, which loads its weights before its own wait) is scheduled before this one waits
    pdl.release(USE_PDL, EARLY)
    pdl.enter_released(USE_PDL, EARLY)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    base = (t * num_heads + h) * SPLITS
    sp, smask, w, den = _split_weights(ml_ptr, base, SPLITS, BLOCK_S)
    r = tl.program_id(2) * BLOCK_RM + tl.arange(0, BLOCK_RM)
    acc = tl.load(acc_ptr + (base + sp)[:, None] * BLOCK_R + r[None, :], mask=smask[:, None], other=0.0)
    out = tl.sum(acc * w[:, None], 0) / den
    tl.store(out_ptr + t * stride_ot + h * stride_oh + r, out.to(out_ptr.dtype.element_ty), mask=r < RANK)


@triton.jit
def _mla_merge_uv_kernel(acc_ptr, ml_ptr, w_ptr, out_ptr, num_heads, stride_wh, stride_wv, stride_ot, stride_oh,
                         RANK: tl.constexpr, V: tl.constexpr, SPLITS: tl.constexpr, BLOCK_S: tl.constexpr,
                         BLOCK_R: tl.constexpr, CHUNK_R: tl.constexpr, BLOCK_V: tl.constexpr,
                         USE_PDL: tl.constexpr = False):
    """The merge, then W_UV: program (token, head, block of BLOCK_V outputs) walks the rank in
    chunks, merging the slices' partial sums of each chunk (o_lat's chunk, rounded to the model
    dtype as the plain merge stores it) and adding W_UV[h][block, chunk] @ o_lat[chunk] in fp32."""
    pdl.release(USE_PDL, True)
    pdl.enter_released(USE_PDL, True)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    v = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    vm = v < V
    base = (t * num_heads + h) * SPLITS
    sp, smask, w, den = _split_weights(ml_ptr, base, SPLITS, BLOCK_S)
    dtype = out_ptr.dtype.element_ty
    w_row = w_ptr + h * stride_wh + v[:, None] * stride_wv  # [BV, 1]
    o = tl.zeros([BLOCK_V], tl.float32)
    for r0 in range(0, BLOCK_R, CHUNK_R):
        r = r0 + tl.arange(0, CHUNK_R)
        rm = r < RANK
        acc = tl.load(acc_ptr + (base + sp)[:, None] * BLOCK_R + r[None, :], mask=smask[:, None] & rm[None, :],
                      other=0.0)
        lat = (tl.sum(acc * w[:, None], 0) / den).to(dtype).to(tl.float32)  # [CHUNK_R]
        w_uv = tl.load(w_row + r[None, :], mask=vm[:, None] & rm[None, :], other=0.0).to(tl.float32)
        o += tl.sum(w_uv * lat[None, :], 1)
    tl.store(out_ptr + t * stride_ot + h * stride_oh + v, o.to(dtype), mask=vm)


@triton.jit
def _uv_kernel(o_ptr, w_ptr, out_ptr, stride_ot, stride_oh, stride_wh, stride_wv, stride_out_t, stride_out_h,
               RANK: tl.constexpr, V: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_R: tl.constexpr,
               USE_PDL: tl.constexpr = False):
    """W_UV's product alone: program (token, head, block of BLOCK_V outputs) takes the rows
    W_UV[h][block] (before the PDL wait: no kernel writes weights), then o_lat[t, h] from the merge:
    out[t, h, block] = W_UV[h][block] @ o_lat[t, h], summed in fp32 and rounded once (as torch.bmm)."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    v = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    vm = v < V
    r = tl.arange(0, BLOCK_R)
    rm = r < RANK
    w = tl.load(w_ptr + h * stride_wh + v[:, None] * stride_wv + r[None, :], mask=vm[:, None] & rm[None, :], other=0.0)
    pdl.enter(USE_PDL)
    o = tl.load(o_ptr + t * stride_ot + h * stride_oh + r, mask=rm, other=0.0).to(tl.float32)
    out = tl.sum(w.to(tl.float32) * o[None, :], 1)
    tl.store(out_ptr + t * stride_out_t + h * stride_out_h + v, out.to(out_ptr.dtype.element_ty), mask=vm)


def apply_uv(o_lat: torch.Tensor, w_uv: torch.Tensor) -> torch.Tensor:
    """o_lat [T, H, rank] (any strides with the rank contiguous: the merge's [H, T, rank] layout)
    and w_uv [H, v, rank] -> [T, H, v] contiguous, o_lat[t, h] @ w_uv[h].T in o_lat's dtype: the
    absorbed form's torch.bmm as a Triton launch (a PDL launch where the forward asks for them)."""
    require_tensor("o_lat", o_lat, ndim=3, dtypes=FLOAT_DTYPES)
    require_tensor("w_uv", w_uv, ndim=3, dtypes=FLOAT_DTYPES)
    require_same("w_uv", w_uv, "o_lat", o_lat)
    require_runnable(o_lat, _uv_kernel)
    T, H, rank = o_lat.shape
    if w_uv.shape[0] != H or w_uv.shape[2] != rank:
        raise ValueError(f"w_uv {tuple(w_uv.shape)} must be [heads ({H}), v, rank ({rank})] for o_lat {tuple(o_lat.shape)}")
    v = w_uv.shape[1]
    out = torch.empty(T, H, v, dtype=o_lat.dtype, device=o_lat.device)
    if T == 0:
        return out
    block_v = min(UV_GEMV_ROWS, next_power_of_2(v))
    _uv_kernel[(T, H, triton.cdiv(v, block_v))](
        o_lat, w_uv, out, o_lat.stride(0), o_lat.stride(1), w_uv.stride(0), w_uv.stride(1), out.stride(0),
        out.stride(1), RANK=rank, V=v, BLOCK_V=block_v, BLOCK_R=next_power_of_2(rank), **_launch(o_lat.device))
    return out


def choose_splits(num_tokens: int, num_heads: int, num_sms: int) -> int:
    """Context slices per token: enough programs to fill the GPU once (a power of two, at most
    MAX_SPLITS). Measured on an H200 (bench/mla_gpu.py --sweep): at 64 tokens x 1k, 4 slices 46.6 us
    against 51.6 with 8 (twice over); at 64 x 8k 239 against 241; one token gets MAX_SPLITS either way."""
    programs = num_tokens * triton.cdiv(num_heads, BLOCK_H)
    return min(MAX_SPLITS, next_power_of_2(triton.cdiv(num_sms, programs)))


def token_positions(meta: AttentionMetadata, num_tokens: int, reuse: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (sequence of each query token [T] int32, KV positions it sees [T] int32), on the device.
    Rows past the batch's tokens (graph padding) are clamped into the last sequence. `reuse`: the
    last call's, if it had this metadata object (a forward's later layers: the first works them out;
    a step whose buffers were refilled in place starts with reuse False)."""
    if reuse and _last_positions[0] is meta and _last_positions[1] == num_tokens:
        return _last_positions[2]
    starts = meta.query_start_loc.long()
    tok = torch.arange(num_tokens, device=starts.device)
    seq = torch.searchsorted(starts[1:], tok, right=True).clamp_(max=starts.shape[0] - 2)
    kv_len = meta.seq_lens.long()[seq] - (starts[seq + 1] - tok) + 1
    out = seq.to(torch.int32), kv_len.clamp_(min=1).to(torch.int32)
    _last_positions[:] = [meta, num_tokens, out]
    return out


_last_positions: list = [None, 0, None]  # [metadata, num_tokens, (seq, kv_len)]


def mla_decode(q: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata, rank: int, scale: float,
               splits: int | None = None, reuse_positions: bool = False, q_pe: torch.Tensor | None = None,
               w_uv: torch.Tensor | None = None, uv_in_merge: bool = True) -> torch.Tensor:
    """q [T, H, rank + rope] against one layer's latent cache [num_blocks, block_size, 1, rank + rope]
    (the new tokens' latents already written) -> [T, H, rank] in q's dtype, laid out as [H, T, rank]
    (so W_UV's batched GEMM over the heads reads it without a copy). With `q_pe` [T, H, rope], q is
    the latent part alone, [T, H, rank] (views allowed: the W_UK product's [H, T, rank] transposed).
    With `w_uv` [H, v, rank] (kv_b_proj's V rows per head, a view: rows contiguous) the merge applies
    it too: -> [T, H, v] contiguous, o_lat[t, h] @ w_uv[h].T; with `uv_in_merge` False a launch of
    its own does (apply_uv, scheduled before the merge waits).
    `splits`: None chooses. `reuse_positions`: see token_positions (the model sets it past its first layer)."""
    q, q_pe = _check(q, cache, meta, rank, q_pe, w_uv)
    T, H = q.shape[:2]
    D = cache.shape[3]
    if splits is None:
        sms = torch.cuda.get_device_properties(q.device).multi_processor_count if q.is_cuda else 4
        splits = choose_splits(T, H, sms)
    tok_seq, kv_len = token_positions(meta, T, reuse_positions)
    block_r, block_p = max(16, next_power_of_2(rank)), max(16, next_power_of_2(D - rank))  # tl.dot: K >= 16
    acc = torch.empty(T, H, splits, block_r, dtype=torch.float32, device=q.device)
    ml = torch.empty(T, H, splits, 2, dtype=torch.float32, device=q.device)
    _mla_partial_kernel[(T, triton.cdiv(H, BLOCK_H), splits)](
        q, q_pe, cache, meta.block_tables, tok_seq, kv_len, acc, ml, scale, cache.shape[1], H,
        q.stride(0), q.stride(1), q_pe.stride(0), q_pe.stride(1), cache.stride(0), cache.stride(1),
        meta.block_tables.stride(0),
        RANK=rank, ROPE=D - rank, SPLITS=splits, IEEE=q.dtype == torch.float32,
        BLOCK_HEADS=BLOCK_H, BLOCK_N=LAUNCH["block_n"], BLOCK_R=block_r, BLOCK_P=block_p,
        **({"num_warps": LAUNCH["num_warps"], "num_stages": LAUNCH["num_stages"], **pdl.launch_options(q.device, PDL)}
           if q.is_cuda else {}))
    if w_uv is not None and not uv_in_merge:
        return apply_uv(merge_partials(acc, ml, rank, q.dtype, release=True), w_uv)
    return merge_partials(acc, ml, rank, q.dtype, w_uv)


def merge_partials(acc: torch.Tensor, ml: torch.Tensor, rank: int, dtype: torch.dtype,
                   w_uv: torch.Tensor | None = None, release: bool = False) -> torch.Tensor:
    """The context slices' partial sums acc [T, H, splits, block_r] fp32 and (max, sum) ml [T, H,
    splits, 2] -> o_lat [T, H, rank] in `dtype` laid out as [H, T, rank]; or with w_uv [H, v, rank],
    o_lat @ w_uv.T per head, [T, H, v] contiguous. mla_decode's second launch, a function of its own
    so tests can feed it partial sums. `release`: the plain merge lets the next kernel be scheduled
    before it waits (apply_uv's launch follows)."""
    T, H, splits, block_r = acc.shape
    block_s = max(2, next_power_of_2(splits))
    if w_uv is None:
        out = torch.empty(H, T, rank, dtype=dtype, device=acc.device).transpose(0, 1)
        block_rm = min(block_r, MERGE_RANK_BLOCK or block_r)
        _mla_merge_kernel[(T, H, block_r // block_rm)](acc, ml, out, H, out.stride(0), out.stride(1), RANK=rank,
                                                       SPLITS=splits, BLOCK_S=block_s, BLOCK_R=block_r,
                                                       BLOCK_RM=block_rm, **_launch(acc.device),
                                                       **({"EARLY": True} if release and acc.is_cuda else {}))
        return out
    v = w_uv.shape[1]
    out = torch.empty(T, H, v, dtype=dtype, device=acc.device)
    block_v, chunk_r = min(UV_LAUNCH["block_v"], next_power_of_2(v)), min(UV_LAUNCH["chunk_r"], block_r)
    _mla_merge_uv_kernel[(T, H, triton.cdiv(v, block_v))](
        acc, ml, w_uv, out, H, w_uv.stride(0), w_uv.stride(1), out.stride(0), out.stride(1), RANK=rank, V=v,
        SPLITS=splits, BLOCK_S=block_s, BLOCK_R=block_r, CHUNK_R=chunk_r, BLOCK_V=block_v, **_launch(acc.device))
    return out


def _launch(device: torch.device) -> dict:
    """A merge kernel's launch keywords: 4 warps and the PDL options on a GPU (the interpreter: none)."""
    return {"num_warps": 4, **pdl.launch_options(device, PDL)} if device.type == "cuda" else {}


def _check(q, cache, meta, rank, q_pe, w_uv) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (q's latent part, q_pe), or ValueError naming the argument."""
    require_tensor("q", q, ndim=3, dtypes=FLOAT_DTYPES)
    require_tensor("cache", cache, ndim=4, dtypes=FLOAT_DTYPES)
    require_same("cache", cache, "q", q)
    require_tensor("meta.block_tables", meta.block_tables, ndim=2, dtypes=INDEX_DTYPES, last_dim_contiguous=False)
    require_runnable(q, _mla_partial_kernel)
    T, H = q.shape[:2]
    D = cache.shape[3]
    if q_pe is None:
        q, q_pe = q[..., :rank], q[..., rank:]
    else:
        require_tensor("q_pe", q_pe, ndim=3, dtypes=FLOAT_DTYPES)
        require_same("q_pe", q_pe, "q", q)
    if cache.shape[2] != 1 or not 0 < rank < D or q.shape[2] != rank or q_pe.shape != (T, H, D - rank):
        raise ValueError(f"cache {tuple(cache.shape)} must be [num_blocks, block_size, 1, rank + rope] with 0 < "
                         f"rank ({rank}) < rank + rope, for q [T, H, rank] {tuple(q.shape)} and q_pe [T, H, rope] "
                         f"{tuple(q_pe.shape)} (or q [T, H, rank + rope] alone)")
    if cache.stride(3) != 1 or cache.stride(2) != D:
        raise ValueError(f"cache rows must be contiguous, got strides {cache.stride()}")
    if w_uv is not None:
        require_tensor("w_uv", w_uv, ndim=3, dtypes=FLOAT_DTYPES, last_dim_contiguous=True)
        require_same("w_uv", w_uv, "q", q)
        if w_uv.shape[0] != H or w_uv.shape[2] != rank:
            raise ValueError(f"w_uv {tuple(w_uv.shape)} must be [heads ({H}), v, rank ({rank})]")
    return q, q_pe
