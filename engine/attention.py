"""Paged attention: the plain-torch reference that the GPU kernels are tested against, and the CPU path.

The KV cache of one layer is two tensors `k_cache, v_cache: [num_blocks, block_size, num_kv_heads,
head_dim]`. A batch step is flattened ("varlen"): the new tokens of every sequence are concatenated,
`query_start_loc` marks where each sequence's tokens begin, and `seq_lens` is each sequence's whole
KV length after this step (cached prefix + new tokens). Token j of sequence b sits at position
`seq_lens[b] - query_lens[b] + j` and attends causally to KV positions [0, that position]. The same
call serves prefill with a cached prefix, decode (one query token per sequence) and the speculative
verifier (1 + k query tokens per sequence), in any mix. With a sliding window W (Mistral), the
token at position p sees only KV positions (p - W, p]: the W most recent, itself included, as
transformers' sliding-window mask.

Tree drafts (`meta.tree_mask`, engine.speculative.tree): a verify step's query tokens are the
nodes of a draft tree, not a run. Token j still writes and is read at KV index
seq_lens[b] - query_lens[b] + j, but it sees only the context and the query tokens whose bits its
mask sets (its ancestors and itself); its rotary position comes from `positions` as usual.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64: cache slot (block_id * block_size + offset) of each new token
    query_start_loc: torch.Tensor  # [B + 1] int32: cumulative new-token counts
    seq_lens: torch.Tensor  # [B] int32: KV length of each sequence after this step
    block_tables: torch.Tensor  # [B, max_blocks_per_seq] int32, rows padded with 0
    query_lens_cpu: list[int]  # host copies, so the torch path never synchronises
    seq_lens_cpu: list[int]
    max_query_len: int
    max_seq_len: int
    # tree drafts (engine.speculative.tree): [T] int64 per query token, bit s set where it may see
    # its sequence's query token s (all of the context it sees); None, or -1 for a row: causal
    tree_mask: torch.Tensor | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def decode_only(self) -> bool:
        return self.max_query_len == 1


# decode and speculative verify steps (every sequence has at most this many new tokens) run as one
# padded batched call instead of a loop over the sequences
BATCHED_MAX_QUERY_LEN = 64


def write_kv_torch(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
    """Scatter new K/V ([T, num_kv_heads, head_dim]) into their cache slots, in place."""
    num_blocks, block_size = k_cache.shape[:2]
    k_cache.view(num_blocks * block_size, *k_cache.shape[2:])[slot_mapping] = k
    v_cache.view(num_blocks * block_size, *v_cache.shape[2:])[slot_mapping] = v


def _gather_kv(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """[num_blocks, bs, H, D] + one block-table row -> [length, H, D] contiguous KV of one sequence."""
    block_size = cache.shape[1]
    n = (length + block_size - 1) // block_size
    return cache[block_table[:n].long()].flatten(0, 1)[:length]


def paged_attention_torch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          meta: AttentionMetadata, scale: float, sliding_window: int | None = None) -> torch.Tensor:
    """q: [T, num_heads, head_dim] -> [T, num_heads, head_dim]. K/V are read through the block table
    (the new tokens' K/V must already be written). Grouped-query heads share K/V. `sliding_window`:
    None, or W: each query sees only its W most recent positions."""
    num_heads, num_kv_heads = q.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.empty_like(q)
    tree = meta.tree_mask
    if tree is not None and sliding_window is not None:
        raise ValueError("tree drafts (meta.tree_mask) with a sliding window are not supported")
    if meta.num_seqs > 1 and meta.max_query_len <= BATCHED_MAX_QUERY_LEN:
        return _short_queries_batched(q, k_cache, v_cache, meta, scale, sliding_window)
    start = 0
    for b in range(meta.num_seqs):
        q_len, kv_len = meta.query_lens_cpu[b], meta.seq_lens_cpu[b]
        qs = q[start:start + q_len].transpose(0, 1)  # [H, q_len, D]
        k = _gather_kv(k_cache, meta.block_tables[b], kv_len).transpose(0, 1)
        v = _gather_kv(v_cache, meta.block_tables[b], kv_len).transpose(0, 1)
        gqa = group > 1
        if q_len == 1 and sliding_window is None and tree is None:
            o = F.scaled_dot_product_attention(qs, k, v, scale=scale, enable_gqa=gqa)
        else:
            # causal with an offset: query j may see keys [0, kv_len - q_len + j] (the window's last W)
            qpos = torch.arange(kv_len - q_len, kv_len, device=q.device)[:, None]
            kpos = torch.arange(kv_len, device=q.device)[None, :]
            mask = kpos <= qpos
            if sliding_window is not None:
                mask &= kpos > qpos - sliding_window
            if tree is not None:
                mask &= tree_visible(tree[start:start + q_len, None], kpos - (kv_len - q_len))
            o = F.scaled_dot_product_attention(qs, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
        out[start:start + q_len] = o.transpose(0, 1)
        start += q_len
    return out


def tree_visible(bits: torch.Tensor, rel: torch.Tensor) -> torch.Tensor:
    """Whether a key at `rel` = KV index - the sequence's first query index is visible under the
    query's ancestor bits (broadcast together): keys of the context always, query token s when bit
    s is set. A -1 mask sees every query token (the causal mask decides)."""
    return (rel < 0) | ((bits >> rel.clamp(0, 63)) & 1).bool()


def _short_queries_batched(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           meta: AttentionMetadata, scale: float, sliding_window: int | None) -> torch.Tensor:
    """Every sequence's queries padded to Q = max_query_len: [B, H, Q, D] against its KV
    [B, Hkv, L, D] under a causal mask with each sequence's offset; padded rows see key 0 only
    (their output is dropped)."""
    B, L, Q = meta.num_seqs, meta.max_seq_len, meta.max_query_len
    num_heads, group = q.shape[1], q.shape[1] // k_cache.shape[2]
    block_size = k_cache.shape[1]
    n = (L + block_size - 1) // block_size
    tables = meta.block_tables[:, :n].long()
    k = k_cache[tables].flatten(1, 2)[:, :L]  # [B, L, Hkv, D]
    v = v_cache[tables].flatten(1, 2)[:, :L]
    qlens = torch.tensor(meta.query_lens_cpu, device=q.device)
    lens = torch.tensor(meta.seq_lens_cpu, device=q.device)
    j = torch.arange(Q, device=q.device)
    real = j[None, :] < qlens[:, None]  # [B, Q]
    qpos = (lens - qlens)[:, None] + j[None, :]  # [B, Q] position of each (padded) query
    kpos = torch.arange(L, device=q.device)
    mask = kpos[None, None, :] <= qpos[:, :, None]  # [B, Q, L]
    if sliding_window is not None:
        mask &= kpos[None, None, :] > qpos[:, :, None] - sliding_window
    if meta.tree_mask is not None:
        bits = torch.full((B, Q), -1, dtype=torch.int64, device=q.device)
        bits[real] = meta.tree_mask
        mask &= tree_visible(bits[:, :, None], (kpos[None, :] - (lens - qlens)[:, None])[:, None, :])
    mask &= real[:, :, None]
    mask[:, :, 0] |= ~real  # a padded row attends to one key, so it stays finite
    if Q == 1:
        qb = q.view(B, 1, num_heads, -1)
    else:
        qb = q.new_zeros(B, Q, num_heads, q.shape[2])
        qb[real] = q
    o = F.scaled_dot_product_attention(qb.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                       attn_mask=mask[:, None], scale=scale, enable_gqa=group > 1)
    o = o.transpose(1, 2)  # [B, Q, H, D]
    return o.reshape(B, num_heads, -1) if Q == 1 else o[real]
