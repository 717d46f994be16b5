"""Multi-head latent attention (DeepSeek-V2/V3) over a paged cache of one vector per token per layer.

The cache of a layer is `[num_blocks, block_size, 1, kv_lora_rank + qk_rope_head_dim]`: the
normalised latent c (kv_lora_rank) and the rotated rope key k_pe shared by every head. K and V are
never stored per head. Two forms read it, with the same result (up to rounding):

- expanded (prefill, chunked prefill, prefix hits: any step with a query longer than
  BATCHED_MAX_QUERY_LEN): each sequence's latents are gathered and expanded by kv_b_proj into
  per-head K_nope and V; ordinary attention with head dim qk_nope + qk_rope.
- absorbed (decode and speculative verify steps): W_UK (kv_b_proj's K rows) is folded into the
  query, so each head scores [q_nope W_UK, q_pe] against the cached [c, k_pe] directly and its
  output is a weighted sum of latents, to which W_UV (kv_b_proj's V rows) is applied afterwards.
  The CPU reads the cache with `latent_attention_torch`; CUDA with the Triton kernel of
  engine.kernels.mla_decode (no host read of a device value: CUDA graphs capture it), and for small
  steps with W_UK and W_UV inside the prepare and merge kernels (LatentAttention.fused_absorb).

Rope is DeepSeek's: applied to the rope part only, with pairs (x0, x1), (x2, x3), ... rotated by one
frequency (`rope_interleave`, the default; rotate-half otherwise), and YaRN scaling (the frequency
ramp, cos/sin times the attention factor, and the softmax scale times mscale(mscale_all_dim)^2, as
transformers' deepseek_v2/v3). Rotated q_pe and k_pe come out de-interleaved; only their dot
product is ever used, which the permutation does not change.
"""

from __future__ import annotations

import math

import torch
from torch import nn
import torch.nn.functional as F

from tandem.engine.attention import BATCHED_MAX_QUERY_LEN, AttentionMetadata
from tandem.engine.config import EngineConfig, ModelConfig
from tandem.engine.linear import Linear
from tandem.engine.model import RMSNorm, no_reduce
from tandem.wire.errors import ConfigError

ROPE_TYPES = ("default", "yarn")


def check_engine_config(cfg: ModelConfig, engine: EngineConfig) -> None:
    """Refuse, by name, what latent attention does not serve (tensor parallelism and FP8 are refused
    where those are built: engine.parallel.sharding, engine.build)."""
    if cfg.mla is not None and engine.speculative.suffix_tree_nodes:
        raise ConfigError("engine: tree drafts (speculative suffix_tree_nodes) with latent attention are not "
                          "implemented (the absorbed kernel has no tree mask); chain drafts are")


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def latent_rope(cfg: ModelConfig) -> tuple[torch.Tensor, float]:
    """-> (inverse frequencies [qk_rope_head_dim / 2], attention factor on cos and sin)."""
    dim, base = cfg.mla.qk_rope_head_dim, cfg.rope_theta
    pos = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    rs = cfg.rope_scaling or {}
    kind = rs.get("rope_type", rs.get("type", "default"))
    if kind == "default":
        return 1.0 / pos, 1.0
    if kind != "yarn":
        raise ValueError(f"unsupported rope_scaling type {kind!r} for latent attention (supported: {ROPE_TYPES})")
    factor, old = rs["factor"], rs["original_max_position_embeddings"]
    mscale, mscale_all = rs.get("mscale"), rs.get("mscale_all_dim")
    factor_attn = rs.get("attention_factor")
    if factor_attn is None:
        factor_attn = (_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all)
                       if mscale and mscale_all else _yarn_mscale(factor))
    beta_fast, beta_slow = rs.get("beta_fast") or 32, rs.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return dim * math.log(old / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rs.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolate = 1 - ramp
    inv = (1.0 / (factor * pos)) * (1 - extrapolate) + (1.0 / pos) * extrapolate
    return inv, float(factor_attn)


def softmax_scale(cfg: ModelConfig) -> float:
    """(qk_nope + qk_rope)^-0.5, times mscale(factor, mscale_all_dim)^2 under YaRN."""
    scale = (cfg.mla.qk_nope_head_dim + cfg.mla.qk_rope_head_dim) ** -0.5
    rs = cfg.rope_scaling or {}
    if rs.get("rope_type", rs.get("type", "default")) != "default" and rs.get("mscale_all_dim"):
        scale *= _yarn_mscale(rs["factor"], rs["mscale_all_dim"]) ** 2
    return scale


class LatentRotary(nn.Module):
    """cos_sin [P, R]: cos (times the attention factor) in the first half, sin in the second."""

    def __init__(self, cfg: ModelConfig, max_positions: int):
        super().__init__()
        inv, factor = latent_rope(cfg)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv)  # [P, R/2]
        cos_sin = torch.cat([freqs.cos() * factor, freqs.sin() * factor], dim=-1)
        self.register_buffer("cos_sin", cos_sin, persistent=False)
        self.interleave = cfg.mla.rope_interleave

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return (apply_latent_rope(q, positions, self.cos_sin, self.interleave),
                apply_latent_rope(k, positions, self.cos_sin, self.interleave))


def apply_latent_rope(x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
                      interleave: bool) -> torch.Tensor:
    """x: [T, H, R] (rope part) -> rotated, de-interleaved, in x's dtype, computed in fp32."""
    cs = cos_sin[positions][:, None, :]  # [T, 1, R]
    half = cs.shape[-1] // 2
    cos, sin = cs[..., :half], cs[..., half:]
    xf = x.float()
    x1, x2 = (xf[..., 0::2], xf[..., 1::2]) if interleave else (xf[..., :half], xf[..., half:])
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def write_latent_torch(latent: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """latent [T, D] -> its slots of one layer's cache [num_blocks, block_size, 1, D], in place."""
    num_blocks, block_size = cache.shape[:2]
    cache.view(num_blocks * block_size, cache.shape[-1])[slot_mapping] = latent


def _gather_latent(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """-> [length, D]: one sequence's cached latents, in position order."""
    n = (length + cache.shape[1] - 1) // cache.shape[1]
    return cache[block_table[:n].long()].flatten(0, 2)[:length]


def latent_attention_torch(q: torch.Tensor, cache: torch.Tensor, kv_lora_rank: int,
                           meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """The absorbed form's attention (the Triton kernel's reference). q: [T, H, D] (latent part
    already through W_UK, then the rotated rope part) against the cached [c, k_pe] of each
    sequence, causal with each sequence's offset -> [T, H, kv_lora_rank], weighted sums of c."""
    out = q.new_empty(q.shape[0], q.shape[1], kv_lora_rank)
    start = 0
    for b in range(meta.num_seqs):
        q_len, kv_len = meta.query_lens_cpu[b], meta.seq_lens_cpu[b]
        kv = _gather_latent(cache, meta.block_tables[b], kv_len).float()  # [L, D]
        s = torch.einsum("thd,ld->htl", q[start:start + q_len].float(), kv) * scale
        qpos = torch.arange(kv_len - q_len, kv_len, device=q.device)[:, None]
        s = s.masked_fill(torch.arange(kv_len, device=q.device)[None, :] > qpos, float("-inf"))
        o = torch.einsum("htl,lr->thr", s.softmax(-1), kv[:, :kv_lora_rank])
        out[start:start + q_len] = o.to(q.dtype)
        start += q_len
    return out


def _call(x: torch.Tensor, layer: nn.Module) -> torch.Tensor:
    """layer(x): the projection runner of the plain path (the GPU path passes ops.linear)."""
    return layer(x)


class LatentAttention(nn.Module):
    """DeepSeek's attention block under Hugging Face names (`self_attn.`: q_proj or q_a_proj +
    q_a_layernorm + q_b_proj, kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj)."""

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        m = cfg.mla
        self.layer, self.num_heads = layer, cfg.num_heads
        self.nope, self.rope, self.v_dim, self.rank = m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim, m.kv_lora_rank
        self.interleave = m.rope_interleave
        qk = self.nope + self.rope
        self.q_lora = m.q_lora_rank is not None
        # x feeds q_proj (or q_a_proj) and kv_a_proj_with_mqa: one GEMM, its rows the two weights
        self.q_a_out = m.q_lora_rank if self.q_lora else cfg.num_heads * qk
        self.qkv_a_proj = Linear(cfg.hidden_size, self.q_a_out + self.rank + self.rope)
        if self.q_lora:
            self.q_a_layernorm = RMSNorm(m.q_lora_rank, 1e-6)
            self.q_b_proj = Linear(m.q_lora_rank, cfg.num_heads * qk)
        self.kv_a_layernorm = RMSNorm(self.rank, 1e-6)
        self.kv_b_proj = Linear(self.rank, cfg.num_heads * (self.nope + self.v_dim))
        self.o_proj = Linear(cfg.num_heads * self.v_dim, cfg.hidden_size)
        self.reduce_output = no_reduce
        self.scale = softmax_scale(cfg)

    # the one-launch norm + rope + cache write (engine.kernels.mla_prepare) on the Triton path (False:
    # the torch steps, as on the CPU path); compiled and measured on an H200 (docs/benchmarks.md, run 3)
    fused_prepare = True
    # with fused_prepare, steps of at most fused_absorb_max_pairs (token, head) pairs fold W_UK into
    # the prepare kernel (engine.kernels.mla_prepare.mla_prepare_uk: one torch.bmm launch fewer). The
    # kernel reads a head's W_UK (128 KB in bf16 at V2-Lite) once per token, where bmm reads it once
    # per step, hence the limit: 64 pairs, 4 tokens at V2-Lite's 16 heads (decode up to batch 4, or a
    # batch-1 verify of 3 drafts). On the H200 the batch-1 step took 2.518 ms with it, 2.522 without
    # (docs/benchmarks.md, issue 29, 2026-12-04): one launch fewer at the same time.
    fused_absorb = True
    fused_absorb_max_pairs = 64
    # and W_UV in the decode kernel's merge (mla_decode's w_uv), the second bmm gone too: built and
    # checked, but its 64 programs at batch 1 (each re-merging its head's 32 slices per block of 32
    # outputs) made the step 2.76 ms against 2.52 on the H200, so it stays off
    fused_uv = False
    # otherwise W_UV as a Triton GEMV of its own after the merge (mla_decode's uv_in_merge False;
    # engine.kernels.mla_decode.apply_uv): a PDL launch that loads its weights while the merge runs,
    # where torch.bmm's cuBLAS launch could not overlap with the kernels around it. False: torch.bmm
    uv_gemv = True

    def hf_tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        q_a, kv_a = self.qkv_a_proj.weight.detach().split([self.q_a_out, self.rank + self.rope], 0)
        out = {f"{prefix}{'q_a_proj' if self.q_lora else 'q_proj'}.weight": q_a,
               f"{prefix}kv_a_proj_with_mqa.weight": kv_a}
        names = (["q_b_proj"] if self.q_lora else []) + ["kv_b_proj", "o_proj"]
        out.update({f"{prefix}{n}.weight": getattr(self, n).weight.detach() for n in names})
        for n in (["q_a_layernorm"] if self.q_lora else []) + ["kv_a_layernorm"]:
            out[f"{prefix}{n}.weight"] = getattr(self, n).weight.detach()
        return out

    def _w_uk_uv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """kv_b_proj's weight split per head: W_UK [H, nope, rank], W_UV [H, v, rank] (views)."""
        w = self.kv_b_proj.weight.view(self.num_heads, self.nope + self.v_dim, self.rank)
        return w[:, :self.nope], w[:, self.nope:]

    def forward(self, x, positions, rotary, kv_cache, meta, ops) -> torch.Tensor:
        return self._attend(x, positions, rotary.cos_sin, kv_cache, meta, kernel=None)

    def forward_fused(self, x, positions, cos_sin, kv_cache, meta, ops, projected: bool = False) -> torch.Tensor:
        """The GPU path: the Triton decode kernel, and the projections through `ops.linear` (the
        one-token GEMV where engine.kernels.gemv takes the weight). `projected`: x is already
        qkv_a_proj's output (DecoderLayer runs it with the norm before it, ops.norm_linear)."""
        from tandem.engine.kernels.mla_decode import mla_decode  # noqa: PLC0415 (triton loads only where kernels run)

        return self._attend(x, positions, cos_sin, kv_cache, meta, kernel=mla_decode, linear=ops.linear,
                            projected=projected)

    def _attend(self, x, positions, cos_sin, kv_cache, meta: AttentionMetadata, kernel,
                linear=_call, projected: bool = False) -> torch.Tensor:
        if getattr(meta, "tree_mask", None) is not None:
            raise NotImplementedError("tree speculation with latent attention is not implemented "
                                      "(chain drafts are: ngram, suffix and draft without trees)")
        T = x.shape[0]
        q, kv = self.project(x, linear, projected)
        cache = kv_cache[self.layer, 0]  # [num_blocks, block_size, 1, rank + rope]
        if kernel is not None and self.absorbs_in_kernels(T, meta):
            o = self._absorbed_fused(q, kv, positions, cos_sin, cache, meta, kernel)
        else:
            q_pe = self._prepare(q, kv, positions, cos_sin, cache, meta, kernel)
            q_nope = q[..., :self.nope]
            if meta.max_query_len <= BATCHED_MAX_QUERY_LEN:
                o = self._absorbed(q_nope, q_pe, cache, meta, kernel)
            else:
                o = self._expanded(q_nope, q_pe, cache, meta)
        return self.reduce_output(linear(o.reshape(T, self.num_heads * self.v_dim), self.o_proj))

    def absorbs_in_kernels(self, num_tokens: int, meta: AttentionMetadata) -> bool:
        """Whether a step on the Triton path takes the fused absorbed form (fused_absorb)."""
        return (self.fused_prepare and self.fused_absorb and meta.max_query_len <= BATCHED_MAX_QUERY_LEN
                and num_tokens * self.num_heads <= self.fused_absorb_max_pairs)

    def _prepare(self, q, kv, positions, cos_sin, cache, meta, kernel) -> torch.Tensor:
        """The latent's norm, the rope of k_pe and every head's q_pe, the cache write -> q_pe [T, H, rope]."""
        if kernel is not None and self.fused_prepare:
            from tandem.engine.kernels.mla_prepare import mla_prepare  # noqa: PLC0415 (as forward_fused's)

            return mla_prepare(q, kv, positions, cos_sin, self.kv_a_layernorm.weight, self.kv_a_layernorm.eps,
                               cache, meta.slot_mapping, self.nope, self.interleave)
        c, k_pe = kv.split([self.rank, self.rope], dim=-1)
        # q's heads and the shared rope key rotated in one pass: [T, H + 1, rope]
        pe = apply_latent_rope(torch.cat([q[..., self.nope:], k_pe[:, None]], dim=1), positions, cos_sin,
                               self.interleave)
        q_pe, k_pe = pe[:, :self.num_heads], pe[:, self.num_heads]
        write_latent_torch(torch.cat([self.kv_a_layernorm(c), k_pe], dim=-1), cache, meta.slot_mapping)
        return q_pe

    def project(self, x: torch.Tensor, linear=_call, projected: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> (q [T, H, nope + rope], kv [T, rank + rope]: the latent c, then k_pe), views.
        `linear(x, layer)` runs each projection (the GPU path's ops.linear); `projected`: x is
        qkv_a_proj's output already."""
        a = x if projected else linear(x, self.qkv_a_proj)
        q, kv = a.split([self.q_a_out, self.rank + self.rope], dim=-1)
        if self.q_lora:
            q = linear(self.q_a_layernorm(q).contiguous(), self.q_b_proj)
        return q.view(x.shape[0], self.num_heads, self.nope + self.rope), kv

    def _absorbed(self, q_nope, q_pe, cache, meta, kernel) -> torch.Tensor:
        """-> [T, H, v]: scores and values in latent space, W_UK and W_UV one batched GEMM each
        over the heads ([H, T, .] operands, so neither needs a copy)."""
        w_uk, w_uv = self._w_uk_uv()
        q_lat = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [T, H, rank]
        if kernel is None:
            o_lat = latent_attention_torch(torch.cat([q_lat, q_pe], dim=-1), cache, self.rank, meta, self.scale)
        else:  # [T, H, rank], laid out as [H, T, rank]
            o_lat = kernel(q_lat, cache, meta, self.rank, self.scale, reuse_positions=self.layer > 0, q_pe=q_pe)
        return torch.bmm(o_lat.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)

    def _absorbed_fused(self, q, kv, positions, cos_sin, cache, meta, kernel) -> torch.Tensor:
        """-> [T, H, v]: _prepare and _absorbed with W_UK folded into the prepare kernel
        (engine.kernels.mla_prepare.mla_prepare_uk; `kernel` is mla_decode) and W_UV as a GEMV of
        its own after the merge (uv_gemv), inside the merge (fused_uv) or torch.bmm (neither), each
        product rounded to the model dtype as torch.bmm's output."""
        from tandem.engine.kernels.mla_prepare import mla_prepare_uk  # noqa: PLC0415 (as forward_fused's)

        w_uk, w_uv = self._w_uk_uv()
        q_lat, q_pe = mla_prepare_uk(q, kv, positions, cos_sin, self.kv_a_layernorm.weight, self.kv_a_layernorm.eps,
                                     cache, meta.slot_mapping, self.nope, self.interleave, w_uk)
        if not (self.fused_uv or self.uv_gemv):
            o_lat = kernel(q_lat, cache, meta, self.rank, self.scale, reuse_positions=self.layer > 0, q_pe=q_pe)
            return torch.bmm(o_lat.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)
        return kernel(q_lat, cache, meta, self.rank, self.scale, reuse_positions=self.layer > 0, q_pe=q_pe,
                      w_uv=w_uv, uv_in_merge=self.fused_uv)

    def _expanded(self, q_nope, q_pe, cache, meta: AttentionMetadata) -> torch.Tensor:
        """-> [T, H, v]: each sequence's latents expanded to per-head K and V, causal with its offset."""
        H, out, start = self.num_heads, [], 0
        q = torch.cat([q_nope, q_pe], dim=-1).transpose(0, 1)  # [H, T, nope + rope]
        pad = self.nope + self.rope - self.v_dim  # V padded to the q/k head dim: SDPA's flash kernel needs it
        for b in range(meta.num_seqs):
            q_len, kv_len = meta.query_lens_cpu[b], meta.seq_lens_cpu[b]
            lat = _gather_latent(cache, meta.block_tables[b], kv_len)  # [L, rank + rope]
            kv = self.kv_b_proj(lat[:, :self.rank]).view(kv_len, H, self.nope + self.v_dim)
            k = torch.cat([kv[..., :self.nope], lat[:, None, self.rank:].expand(kv_len, H, self.rope)], dim=-1)
            v = F.pad(kv[..., self.nope:], (0, pad)) if pad > 0 else kv[..., self.nope:]
            # 4-D [1, H, L, D]: SDPA's fused (flash / memory-efficient) kernels take no 3-D input; given
            # one it runs the math form, an [H, L, L] fp32 score matrix (8k tokens: 4 GB per layer)
            qs, k, v = q[None, :, start:start + q_len], k.transpose(0, 1)[None], v.transpose(0, 1)[None]
            if q_len == kv_len:
                o = F.scaled_dot_product_attention(qs, k, v, is_causal=True, scale=self.scale)[0]
            else:
                qpos = torch.arange(kv_len - q_len, kv_len, device=q.device)[:, None]
                mask = torch.arange(kv_len, device=q.device)[None, :] <= qpos
                o = F.scaled_dot_product_attention(qs, k, v, attn_mask=mask, scale=self.scale)[0]
            out.append(o[..., :self.v_dim].transpose(0, 1))  # [q_len, H, v]
            start += q_len
        return torch.cat(out, dim=0)
