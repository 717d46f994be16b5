"""The decoder every served family runs on (Llama 2/3, SmolLM2, Mistral, Qwen2/2.5, Qwen3), over a
paged cache. The family's switches come from ModelConfig (engine.architectures sets them): q/k/v
biases (Qwen2), per-head q/k RMSNorm before rotary (Qwen3), a sliding attention window (Mistral).
Each layer's MLP comes from engine.moe (`build_mlp`: dense, or a mixture of experts).

Every projection is an engine.linear.Linear (the model dtype, or FP8 weights with scales); the
embeddings stay in the model dtype, and so does the LM head when it is tied to them or
tensor-parallel (an untied head is FP8 under `--quantization fp8`). Latent attention (DeepSeek)
comes from engine.mla.

Single-device and batch-flattened: `forward(input_ids [T], positions [T], kv_cache, meta)` runs
every scheduled token of every sequence in one pass; attention reads through the block table
(engine.attention). Weights use Hugging Face names, with q/k/v and gate/up fused at load time.

Two paths, picked by `model.ops` (None: from the device of the inputs). `TorchOps` (the CPU, and
the reference): plain torch everywhere. `TritonOps` (CUDA): Triton paged attention and KV writes,
and the fused kernels of engine.kernels.fused for add + RMSNorm (the residual stream is carried
beside the hidden states, so each sum is computed once, inside the next norm), rotary embedding
(in place on the fused qkv output) and SiLU-and-mul. Both round the residual sums and the
normalised activations to the model dtype at the same points. No Triton-path op reads a host-side
value of a device tensor, so a forward on it can be captured in a CUDA graph.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from tandem.engine.attention import AttentionMetadata, paged_attention_torch, write_kv_torch
from tandem.engine.config import ModelConfig
from tandem.engine.kernels import triton_available
from tandem.engine.linear import Linear
from tandem.engine.moe import MLP, build_mlp, no_reduce


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Inverse frequencies [head_dim / 2], with Llama-3 style frequency-dependent scaling."""
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    rs = cfg.rope_scaling or {}
    kind = rs.get("rope_type", rs.get("type"))
    if kind == "llama3":
        factor, lo, hi = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
        old = rs["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        low_wl, high_wl = old / lo, old / hi
        smooth = (old / wavelen - lo) / (hi - lo)
        scaled = torch.where(wavelen > low_wl, inv / factor, inv)
        mid = (wavelen <= low_wl) & (wavelen >= high_wl)
        inv = torch.where(mid, (1 - smooth) * inv / factor + smooth * inv, scaled)
    elif kind == "linear":
        inv = inv / rs["factor"]
    elif kind not in (None, "default"):
        raise ValueError(f"unsupported rope_scaling type {kind!r} (supported: llama3, linear)")
    return inv.float()


class Rotary(nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: int):
        super().__init__()
        inv = rope_inv_freq(cfg)
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv)  # [P, D/2]
        # [P, D]: cos in the first half, sin in the second (the layout the Triton kernel reads too)
        self.register_buffer("cos_sin", torch.cat([freqs.cos(), freqs.sin()], dim=-1), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # q: [T, H, D], k: [T, Hkv, D]; rotate-half (NeoX) layout as in Hugging Face Llama
        cs = self.cos_sin[positions]
        half = cs.shape[-1] // 2
        cos = torch.cat([cs[:, :half], cs[:, :half]], -1)[:, None, :]
        sin = torch.cat([cs[:, half:], cs[:, half:]], -1)[:, None, :]

        def rot(x):
            xf = x.float()
            x1, x2 = xf[..., :half], xf[..., half:]
            return (xf * cos + torch.cat([-x2, x1], -1) * sin).to(x.dtype)

        return rot(q), rot(k)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        # Qwen3: each head's q and k normalised over head_dim (one weight shared by all heads)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.sliding_window = cfg.sliding_window
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=False)
        self.reduce_output = no_reduce  # o_proj is row-parallel under tensor parallelism
        self.scale = self.head_dim ** -0.5

    def forward(self, x, positions, rotary, kv_cache, meta, ops) -> torch.Tensor:
        T = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(T, self.num_heads, self.head_dim)
        k = k.view(T, self.num_kv_heads, self.head_dim)
        v = v.view(T, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rotary(positions, q, k)
        k_cache, v_cache = kv_cache[self.layer, 0], kv_cache[self.layer, 1]
        ops.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        o = ops.attention(q, k_cache, v_cache, meta, self.scale, sliding_window=self.sliding_window)
        return self.reduce_output(self.o_proj(o.reshape(T, self.q_size)))

    def forward_fused(self, x, positions, cos_sin, kv_cache, meta, ops) -> torch.Tensor:
        return self.attend_fused(self.qkv_proj(x), positions, cos_sin, kv_cache, meta, ops)

    def attend_fused(self, qkv, positions, cos_sin, kv_cache, meta, ops) -> torch.Tensor:
        """The layer from its fused q/k/v projection [T, q_size + 2 * kv_size] on."""
        o = self.attention_fused(qkv, positions, cos_sin, kv_cache, meta, ops)
        return self.reduce_output(ops.linear(o, self.o_proj))

    def attention_fused(self, qkv, positions, cos_sin, kv_cache, meta, ops) -> torch.Tensor:
        """Rotary, the KV write and attention from the fused q/k/v projection: the heads' output
        [T, q_size], before o_proj."""
        T = qkv.shape[0]
        q = qkv[:, :self.q_size].view(T, self.num_heads, self.head_dim)
        k = qkv[:, self.q_size:self.q_size + self.kv_size].view(T, self.num_kv_heads, self.head_dim)
        v = qkv[:, self.q_size + self.kv_size:].view(T, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:  # in place: rotary_kv_attention reads these views
            q.copy_(self.q_norm(q))
            k.copy_(self.k_norm(k))
        k_cache, v_cache = kv_cache[self.layer, 0], kv_cache[self.layer, 1]
        o = ops.rotary_kv_attention(q, k, v, positions, cos_sin, k_cache, v_cache, meta, self.scale,
                                    sliding_window=self.sliding_window)
        return o.view(T, self.q_size)


def latent_attention(cfg: ModelConfig, layer: int) -> nn.Module:
    """DeepSeek's multi-head latent attention (engine.mla, which builds on this module's RMSNorm)."""
    from tandem.engine.mla import LatentAttention  # noqa: PLC0415 (engine.mla imports this module)

    return LatentAttention(cfg, layer)


def latent_rotary(cfg: ModelConfig, max_positions: int) -> nn.Module:
    from tandem.engine.mla import LatentRotary  # noqa: PLC0415 (engine.mla imports this module)

    return LatentRotary(cfg, max_positions)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.self_attn = latent_attention(cfg, layer) if cfg.mla is not None else Attention(cfg, layer)
        self.mlp = build_mlp(cfg, layer)  # engine.moe: the dense MLP or a mixture of experts
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, positions, rotary, kv_cache, meta, ops):
        x = x + self.self_attn(self.input_layernorm(x), positions, rotary, kv_cache, meta, ops)
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward_fused(self, x, residual, positions, cos_sin, kv_cache, meta, ops, next_norm=None):
        """x: this layer's input before the pending residual add (residual None: x is the
        residual stream itself), or an engine.kernels.gemv.NormedRow (the add done, the norm
        begun). -> (MLP output, residual stream): the sum is left to the next norm.
        Each norm goes to `ops.norm_linear` with the projection that reads it (q/k/v, gate/up),
        SiLU-and-mul to the gate/up GEMV's epilogue or the down projection's prologue (MLP.norm_residual),
        and each projection into the
        residual stream (o, down) to `ops.residual_linear` with the norm after it (`next_norm`:
        the next layer's, where that layer's attention takes it); they fold into the GEMVs where
        they can (a one-token step); latent attention's first projection (q/kv_a) takes its norm
        the same way. A mixture of experts reads the normalised activations itself."""
        attn, mlp = self.self_attn, self.mlp
        dense = isinstance(mlp, MLP)
        if isinstance(attn, Attention):
            qkv, residual = ops.norm_linear(x, residual, self.input_layernorm, attn.qkv_proj)
            o = attn.attention_fused(qkv, positions, cos_sin, kv_cache, meta, ops)
            h, residual = ops.residual_linear(o, attn.o_proj, residual, self.post_attention_layernorm if dense else None,
                                              attn.reduce_output)
        else:  # latent attention: its first projection with the norm
            a, residual = ops.norm_linear(x, residual, self.input_layernorm, attn.qkv_a_proj)
            h = attn.forward_fused(a, positions, cos_sin, kv_cache, meta, ops, projected=True)
        if dense:
            return mlp.norm_residual(h, residual, self.post_attention_layernorm, next_norm, ops)
        return mlp.norm_forward_fused(h, residual, self.post_attention_layernorm, ops)

    def takes_folded_norm(self) -> bool:
        """Whether this layer's first projection reads a norm folded into the layer before
        (forward_fused's `next_norm`): q/k/v of grouped-query attention, not latent attention."""
        return isinstance(self.self_attn, Attention)


class TorchOps:
    """The plain-torch attention path (CPU, and the reference for the GPU kernels)."""
    fused = False
    write_kv = staticmethod(write_kv_torch)
    attention = staticmethod(paged_attention_torch)


class TritonOps:
    """The GPU path: Triton paged attention and KV writes, and (`fused`) the fused elementwise
    kernels the model switches to when these ops are selected."""
    fused = True

    def __init__(self):
        from tandem.engine.kernels.attention_rope_kv import rotary_kv_attention, rotary_write_kv  # noqa: PLC0415 (triton loads only where kernels run)
        from tandem.engine.kernels.fused import rms_norm, rotary_embedding, silu_and_mul  # noqa: PLC0415 (as above)
        from tandem.engine.kernels.kv_write import write_kv  # noqa: PLC0415 (as above)
        from tandem.engine.kernels.paged_attention import paged_attention  # noqa: PLC0415 (as above)

        self.write_kv, self.attention, self.rotary_write_kv = write_kv, paged_attention, rotary_write_kv
        self.rotary_kv_attention = rotary_kv_attention
        self.rms_norm, self.rotary_embedding, self.silu_and_mul = rms_norm, rotary_embedding, silu_and_mul

    def norm_linear(self, x, residual, norm: RMSNorm, linear: Linear,
                    silu_out: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """linear(RMSNorm(x + residual)) and the new residual stream: one launch for one token
        where engine.kernels.gemv takes the weight with the norm (`gemv.takes`), else rms_norm,
        then linear. x a gemv.NormedRow (the GEMV before began this norm): the GEMV finishes it.
        `silu_out` (where `activates` says so): a gate/up projection whose GEMV returns
        SiLU(gate) * up."""
        from tandem.engine.kernels import gemv  # noqa: PLC0415 (as __init__'s)

        w, s, b, gk = linear.weight, linear.weight_scale, linear.bias, linear.group_k
        if isinstance(x, gemv.NormedRow):
            if x.norm_weight is not norm.weight:
                raise RuntimeError("a folded norm reached a projection after another norm")
            return gemv.scaled_gemv(x, w, s, b, group_k=gk, silu_out=silu_out), residual
        if x.shape[0] == 1 and gemv.takes(w, "norm"):
            return gemv.norm_gemv(x, residual, norm.weight, norm.eps, w, s, b, group_k=gk, silu_out=silu_out)
        h, residual = self.rms_norm(x, norm.weight, norm.eps, residual)
        return (gemv.gemv(h, w, s, b, group_k=gk, silu_out=True) if silu_out else self.linear(h, linear)), residual

    def activates(self, x, linear: Linear) -> bool:
        """Whether a gate/up projection of x takes norm_linear's `silu_out`: one token (x a
        tensor or a gemv.NormedRow) and a weight engine.kernels.gemv activates."""
        from tandem.engine.kernels import gemv  # noqa: PLC0415 (as __init__'s)

        return x.shape[0] == 1 and gemv.activates(linear.weight)

    def silu_linear(self, gate_up: torch.Tensor, linear: Linear) -> torch.Tensor:
        """linear(SiLU(gate) * up): one launch for one token where engine.kernels.gemv takes the
        weight, else silu_and_mul, then linear."""
        from tandem.engine.kernels import gemv  # noqa: PLC0415 (as __init__'s)

        if gate_up.shape[0] == 1 and gemv.takes(linear.weight, "silu"):
            return gemv.silu_gemv(gate_up, linear.weight, linear.weight_scale, linear.bias, group_k=linear.group_k)
        return self.linear(self.silu_and_mul(gate_up), linear)

    def residual_linear(self, x, linear: Linear, residual, next_norm: RMSNorm | None, reduce,
                        silu: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """A projection into the residual stream (`silu`: of SiLU(gate) * up, inside the GEMV where
        `gemv.takes` it), reduced over tensor-parallel ranks by `reduce`. -> (its output,
        residual), the sum left to the next norm; or, for one token where engine.kernels.gemv
        folds the weight (`gemv.folds`) and there is no reduction, (gemv.NormedRow begun with
        `next_norm`, the new residual stream)."""
        from tandem.engine.kernels import gemv  # noqa: PLC0415 (as __init__'s)

        if (next_norm is not None and residual is not None and reduce is no_reduce and x.shape[0] == 1
                and gemv.folds(linear.weight)):
            if silu and not gemv.takes(linear.weight, "silu"):  # the SiLU stays a launch of its own
                x, silu = self.silu_and_mul(x), False
            return gemv.residual_gemv(x, linear.weight, linear.weight_scale, linear.bias, residual=residual,
                                      norm_weight=next_norm.weight, eps=next_norm.eps, silu=silu,
                                      group_k=linear.group_k)
        out = self.silu_linear(x, linear) if silu else self.linear(x, linear)
        return reduce(out), residual

    def linear(self, x: torch.Tensor, linear: Linear) -> torch.Tensor:
        """linear(x), by engine.kernels.gemv for one token where it takes the weight, and by
        engine.kernels.gemv_rows for a few rows where it takes them (an FP8 Linear called directly
        reaches it through engine.kernels.fp8_gemm too)."""
        from tandem.engine.kernels import gemv, gemv_rows  # noqa: PLC0415 (as __init__'s)

        w, s, b, gk = linear.weight, linear.weight_scale, linear.bias, linear.group_k
        if x.shape[0] == 1 and gemv.takes(w):
            return gemv.gemv(x, w, s, b, group_k=gk)
        if x.dim() == 2 and x.stride(-1) == 1 and gemv_rows.takes(w, x.shape[0]):
            return gemv_rows.gemv_rows(x, w, s, b, group_k=gk)
        return linear(x)


def default_ops(device: torch.device) -> TorchOps | TritonOps:
    """TritonOps on a CUDA device where Triton imports, else TorchOps."""
    if device.type == "cuda":
        if triton_available():
            return TritonOps()
    return TorchOps()


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: int | None = None):
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        rotary = latent_rotary if cfg.mla is not None else Rotary
        self.rotary = rotary(cfg, max_positions or cfg.max_position_embeddings)
        # None: TorchOps on the CPU, TritonOps on CUDA (default_ops); set it to force one
        self.ops: TorchOps | TritonOps | None = None
        self._auto_ops: dict[torch.device, TorchOps | TritonOps] = {}
        self._fp8: bool | None = None  # fp8_weights, found on first use

    def ops_for(self, device: torch.device) -> TorchOps | TritonOps:
        """The ops a forward on `device` uses."""
        if self.ops is not None:
            return self.ops
        ops = self._auto_ops.get(device)
        if ops is None:
            ops = self._auto_ops[device] = default_ops(device)
        return ops

    # The cache layout is the model's: Llama keeps K and V per layer. [L, 2, blocks, block_size, Hkv, D];
    # latent attention one vector per token: [L, 1, blocks, block_size, 1, kv_lora_rank + qk_rope]
    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        c = self.config
        if c.mla is not None:
            return (c.num_layers, 1, num_blocks, block_size, 1, c.mla.latent_dim)
        return (c.num_layers, 2, num_blocks, block_size, c.num_kv_heads, c.head_dim)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, layer_done=None) -> torch.Tensor:
        """-> final hidden states [T, hidden]. `layer_done(layer)` is called after each layer's KV
        is written (the prefill actor starts sending that layer then)."""
        ops = self.ops_for(input_ids.device)
        if getattr(ops, "fused", False):
            return self._forward_fused(input_ids, positions, kv_cache, meta, ops, layer_done)
        x = self.embed_tokens(input_ids)
        for i, layer in enumerate(self.layers):
            x = layer(x, positions, self.rotary, kv_cache, meta, ops)
            if layer_done is not None:
                layer_done(i)
        return self.norm(x)

    def _forward_fused(self, input_ids, positions, kv_cache, meta, ops, layer_done) -> torch.Tensor:
        with self._kernel_launches(input_ids.shape[0]):
            return self._layers_fused(input_ids, positions, kv_cache, meta, ops, layer_done)

    def _kernel_launches(self, tokens: int):
        """The scope the GPU path's kernels launch in (engine.kernels.pdl.auto): PDL for an FP8
        model, and for any model's one-token step (a chain of GEMVs and small kernels). On the H200
        the bf16 8B batch-1 step took 4.02 ms with it against 4.08-4.09 without; bf16 steps of 8-256
        tokens were 0.3-0.5% slower with it, so they keep plain launches (docs/benchmarks.md, issue 24)."""
        from tandem.engine.kernels import pdl  # noqa: PLC0415 (triton loads only where kernels run)

        return pdl.auto(self.fp8_weights or tokens == 1)

    @property
    def fp8_weights(self) -> bool:
        """Whether the projections hold FP8 weights (set at load; read once). The GPU path runs
        such a model's small kernels as programmatic dependent launches (engine.kernels.pdl) at
        every step, a 16-bit model's at one-token steps only."""
        if self._fp8 is None:
            self._fp8 = any(getattr(m, "is_fp8", False) for m in self.layers[0].modules())
        return self._fp8

    def _layers_fused(self, input_ids, positions, kv_cache, meta, ops, layer_done) -> torch.Tensor:
        x = self.embed_tokens(input_ids)  # [T, hidden]
        residual = None
        cos_sin = self.rotary.cos_sin
        layers = self.layers
        for i, layer in enumerate(layers):
            after = layers[i + 1] if i + 1 < len(layers) else None
            next_norm = after.input_layernorm if after is not None and after.takes_folded_norm() else None
            x, residual = layer.forward_fused(x, residual, positions, cos_sin, kv_cache, meta, ops, next_norm)
            if layer_done is not None:
                layer_done(i)
        return ops.rms_norm(x, self.norm.weight, self.norm.eps, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if not getattr(self.ops_for(hidden.device), "fused", False):
            return self.lm_head(hidden).float()
        with self._kernel_launches(hidden.shape[0]):
            return self.lm_head(hidden).float()

    # ---- weights ----------------------------------------------------------------------------
    def hf_tensors(self) -> dict[str, torch.Tensor]:
        """Every weight under its Hugging Face name (engine.architectures.expected_tensors lists the
        same names), as a view of this model's own storage: q/k/v (weights and biases) and gate/up
        are row slices of the fused projections. Loading copies into these views; saving reads them."""
        cfg = self.config
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        out = {"model.embed_tokens.weight": self.embed_tokens.weight.detach(),
               "model.norm.weight": self.norm.weight.detach()}
        if not cfg.tie_word_embeddings:
            out["lm_head.weight"] = self.lm_head.weight.detach()
        for i, layer in enumerate(self.layers):
            p, attn, mlp = f"model.layers.{i}.", layer.self_attn, layer.mlp
            qkv = {} if cfg.mla is not None else {"weight": attn.qkv_proj.weight, "bias": attn.qkv_proj.bias}
            if cfg.mla is not None:
                out.update(attn.hf_tensors(p + "self_attn."))
            for kind, fused in qkv.items():
                if fused is not None:
                    for n, part in zip("qkv", fused.detach().split([q, kv, kv], 0)):
                        out[f"{p}self_attn.{n}_proj.{kind}"] = part
            if getattr(attn, "q_norm", None) is not None:
                out[p + "self_attn.q_norm.weight"] = attn.q_norm.weight.detach()
                out[p + "self_attn.k_norm.weight"] = attn.k_norm.weight.detach()
            out.update(mlp.hf_tensors(p + "mlp."))
            out.update({p + "self_attn.o_proj.weight": attn.o_proj.weight.detach(),
                        p + "input_layernorm.weight": layer.input_layernorm.weight.detach(),
                        p + "post_attention_layernorm.weight": layer.post_attention_layernorm.weight.detach()})
        return out

    def load_hf_state_dict(self, tensors) -> None:
        """Copy `tensors` (Hugging Face names; engine.architectures.check_tensors has checked the
        set and the shapes) into the model."""
        with torch.no_grad():
            for name, dst in self.hf_tensors().items():
                dst.copy_(tensors[name])
