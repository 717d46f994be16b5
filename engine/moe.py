"""The MLP of each decoder layer: the dense SiLU MLP, or a mixture of experts (Qwen3-MoE, DeepSeek).

`build_mlp(cfg, layer)` picks one (`cfg.moe.is_sparse(layer)`); both take x [T, H] -> [T, H] and
name their weights as Hugging Face checkpoints do under `model.layers.{i}.mlp.` (`hf_tensors`).

`SparseMoE`: a router (`gate.weight`, DeepSeek-V3's `gate.e_score_correction_bias`) picks each
token's top-k experts by `route`, a pure function of the router logits and `MoEConfig`; the
experts' gate/up and down weights are held stacked ([E, 2I, H] and [E, H, I]) so one grouped GEMM
runs them all, and are loaded from the per-expert tensors `experts.{j}.{gate,up,down}_proj.weight`
through views. DeepSeek's shared experts are one dense MLP added to every token. Two expert paths:
`experts_torch` (the reference: tokens sorted by expert, one matmul pair per expert hit; the CPU)
and engine.kernels.moe's Triton kernels (`forward_fused`, the CUDA path: the router's choice in one
launch, the experts in two or four; no host sync, so the step can be captured in a CUDA graph; a
decode step of up to engine.kernels.moe_decode.MAX_TOKENS tokens under its FUSED_DECODE: the whole
layer, router and shared experts included, in three launches). The router's logits and choice are
fp32 on every path.
"""

from __future__ import annotations

import torch
from torch import nn
import torch.nn.functional as F

from tandem.engine.config import ModelConfig, MoEConfig
from tandem.engine.linear import Linear


_MM_OUT_DTYPE = True  # until torch.mm(..., out_dtype=) fails once (it needs CUDA and torch >= 2.8)


def no_reduce(x: torch.Tensor) -> torch.Tensor:
    """A row-parallel output's sum over tensor-parallel ranks, on one rank (engine.parallel sets
    the all-reduce in its place)."""
    return x


class MLP(nn.Module):
    """Llama's SiLU MLP: down(silu(gate(x)) * up(x)), gate and up fused into one projection."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.intermediate = intermediate_size
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=False)
        self.reduce_output = no_reduce  # down_proj is row-parallel under tensor parallelism

    def forward(self, x):
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
        return self.reduce_output(self.down_proj(F.silu(gate) * up))

    def forward_fused(self, x, ops):
        return self.down_fused(ops.linear(x, self.gate_up_proj), ops)

    def down_fused(self, gate_up, ops):
        """The MLP from its gate/up projection [T, 2I] on (ops.silu_linear: one launch for one token)."""
        return self.reduce_output(ops.silu_linear(gate_up, self.down_proj))

    def norm_residual(self, x, residual, norm, next_norm, ops):
        """The MLP of RMSNorm(x + residual) into the residual stream (DecoderLayer.forward_fused):
        gate/up with the norm (ops.norm_linear), SiLU-and-mul in that GEMV's epilogue where one
        token's weight takes it (ops.activates), else with the down projection (down_residual).
        -> (output, residual)."""
        if ops.activates(x, self.gate_up_proj):
            act, residual = ops.norm_linear(x, residual, norm, self.gate_up_proj, silu_out=True)
            return ops.residual_linear(act, self.down_proj, residual, next_norm, self.reduce_output)
        gate_up, residual = ops.norm_linear(x, residual, norm, self.gate_up_proj)
        return self.down_residual(gate_up, residual, next_norm, ops)

    def down_residual(self, gate_up, residual, next_norm, ops):
        """As down_fused, into the residual stream (ops.residual_linear: the next norm begun inside
        the down GEMV for one token where it folds). -> (output, residual)."""
        return ops.residual_linear(gate_up, self.down_proj, residual, next_norm, self.reduce_output, silu=True)

    def hf_tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        gate, up = self.gate_up_proj.weight.detach().split(self.intermediate, 0)
        return {prefix + "gate_proj.weight": gate, prefix + "up_proj.weight": up,
                prefix + "down_proj.weight": self.down_proj.weight.detach()}


def route(logits: torch.Tensor, moe: MoEConfig,
          score_bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] (fp32) -> (weights [T, top_k] fp32, expert ids [T, top_k] int64).

    Scores are softmax or sigmoid of the logits. The choice is made on the scores plus
    `score_bias` (V3's balancing bias; it never enters the weights), restricted, for the grouped
    methods, to the `topk_group` best of `n_group` equal groups of experts (a group's rank: its
    best score, group_limited_greedy; the sum of its two best, noaux_tc). The weights are the
    chosen experts' scores, renormalised to sum to one under `norm_topk_prob`, times
    `routed_scaling_factor`."""
    scores = logits.softmax(-1) if moe.scoring == "softmax" else logits.sigmoid()
    choice = scores if score_bias is None else scores + score_bias
    if moe.topk_method != "greedy":
        tokens, experts = choice.shape
        groups = choice.view(tokens, moe.n_group, experts // moe.n_group)
        if moe.topk_method == "group_limited_greedy":
            group_scores = groups.max(-1).values
        else:
            group_scores = groups.topk(min(2, groups.shape[-1]), dim=-1).values.sum(-1)
        kept = group_scores.topk(moe.topk_group, dim=-1).indices
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept, True)
        choice = choice.masked_fill(~keep.repeat_interleave(experts // moe.n_group, dim=1), float("-inf"))
    ids = choice.topk(moe.top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if moe.norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return weights * moe.routed_scaling_factor, ids


def experts_torch(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                  ids: torch.Tensor) -> torch.Tensor:
    """The routed experts in plain torch (the reference for engine.kernels.moe).
    x [T, H]; w13 [E, 2I, H] (each expert's gate rows, then its up rows); w2 [E, H, I];
    weights, ids [T, k]. -> sum over each token's k experts of weight * down(silu(gate) * up),
    [T, H] in x's dtype; experts in ascending order, each over the tokens that chose it."""
    k = ids.shape[1]
    flat = ids.reshape(-1)
    order = flat.argsort(stable=True)  # (token, slot) pairs grouped by expert
    counts = torch.bincount(flat, minlength=w13.shape[0]).tolist()
    out = torch.zeros_like(x)
    start = 0
    for expert, n in enumerate(counts):
        if n == 0:
            continue
        pairs = order[start:start + n]
        start += n
        tokens = pairs // k
        gate, up = F.linear(x[tokens], w13[expert]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, w2[expert])
        out.index_add_(0, tokens, (y * weights.reshape(-1)[pairs, None]).to(x.dtype))
    return out


class Router(nn.Module):
    """`weight` [E, H] (and `e_score_correction_bias` [E] for noaux_tc): x -> route(x @ weight.T)."""

    def __init__(self, moe: MoEConfig, hidden_size: int):
        super().__init__()
        self.moe = moe
        self.weight = nn.Parameter(torch.empty(moe.num_experts, hidden_size))
        self.e_score_correction_bias = nn.Parameter(torch.empty(moe.num_experts)) if moe.uses_score_bias else None

    def _apply(self, fn, recurse=True):
        # the bias stays fp32 whatever the model dtype, as DeepSeek-V3's checkpoints hold it: in bf16
        # it would round by up to 0.4% and could flip the choice between near-tied experts
        # (the fp32 values from before the call, not the rounded ones, moved to where fn put them;
        # a copy, since _apply may convert the parameter's data in place)
        before = self.e_score_correction_bias
        if before is not None:
            before = before.detach().clone() if before.dtype == torch.float32 else None
        super()._apply(fn, recurse)
        bias = self.e_score_correction_bias
        if bias is not None and bias.dtype != torch.float32:
            keep = bias if before is None or before.is_meta != bias.is_meta else before
            self.e_score_correction_bias = nn.Parameter(keep.detach().to(bias.device, torch.float32), requires_grad=False)
        return self

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """x @ weight.T in fp32 [T, E]; on CUDA one cuBLAS launch on the model-dtype operands with an
        fp32 output (their products are exact in fp32), not two upcast copies and a fp32 GEMM."""
        global _MM_OUT_DTYPE
        if _MM_OUT_DTYPE and x.is_cuda and x.dtype != torch.float32 and x.dtype == self.weight.dtype:
            try:
                return torch.mm(x, self.weight.t(), out_dtype=torch.float32)
            except (TypeError, RuntimeError, NotImplementedError):  # a torch without mm's out_dtype
                _MM_OUT_DTYPE = False
        return F.linear(x.float(), self.weight.float())

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return route(self.logits(x), self.moe, self.e_score_correction_bias)


class SparseMoE(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        moe, h = cfg.moe, cfg.hidden_size
        self.num_experts, self.intermediate = moe.num_experts, moe.intermediate_size
        self.gate = Router(moe, h)
        # expert e: w13[e] = [gate_proj; up_proj] [2I, H], w2[e] = down_proj [H, I]
        self.w13 = nn.Parameter(torch.empty(moe.num_experts, 2 * moe.intermediate_size, h))
        self.w2 = nn.Parameter(torch.empty(moe.num_experts, h, moe.intermediate_size))
        shared = moe.num_shared_experts * moe.intermediate_size
        self.shared_experts = MLP(h, shared) if shared else None
        self.reduce_output = no_reduce

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        out = experts_torch(x, self.w13, self.w2, weights, ids)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return self.reduce_output(out)

    def forward_fused(self, x: torch.Tensor, ops) -> torch.Tensor:
        from tandem.engine.kernels import moe_decode  # noqa: PLC0415 (triton loads only where kernels run)
        from tandem.engine.kernels.moe import fused_experts  # noqa: PLC0415 (as above)
        from tandem.engine.kernels.moe_route import route_fused  # noqa: PLC0415 (as above)

        if moe_decode.takes(x.shape[0]) and self._plain_shared():  # a decode step: the layer in 3 launches
            return self.reduce_output(self._decode(x).out)
        # router: one GEMM + one routing launch; experts: 2 launches (few tokens) or 4; the shared
        # experts' output is added inside the experts' last launch
        weights, ids = route_fused(self.gate.logits(x), self.gate.moe, self.gate.e_score_correction_bias)
        shared = None if self.shared_experts is None else self.shared_experts.forward_fused(x, ops)
        return self.reduce_output(fused_experts(x, self.w13, self.w2, weights, ids, add=shared))

    def norm_forward_fused(self, x: torch.Tensor, residual: torch.Tensor | None, norm, ops) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer on RMSNorm(x + residual) (DecoderLayer.forward_fused's post-attention norm) ->
        (output, new residual stream). A decode step's three launches take the norm into the first
        (engine.kernels.moe_decode.NORM_FOLD); otherwise ops.rms_norm runs first."""
        from tandem.engine.kernels import moe_decode  # noqa: PLC0415 (triton loads only where kernels run)

        if (moe_decode.NORM_FOLD and residual is not None and moe_decode.takes(x.shape[0]) and self._plain_shared()
                and x.is_contiguous() and residual.is_contiguous()):
            got = self._decode(x, (residual, norm.weight, norm.eps))
            return self.reduce_output(got.out), got.residual
        h, residual = ops.rms_norm(x, norm.weight, norm.eps, residual)
        return self.forward_fused(h, ops), residual

    def _decode(self, x: torch.Tensor, norm=None):
        """engine.kernels.moe_decode.moe_decode on this layer's weights (-> its DecodedMoE)."""
        from tandem.engine.kernels import moe_decode  # noqa: PLC0415 (triton loads only where kernels run)

        s = self.shared_experts
        return moe_decode.moe_decode(
            x, self.gate.weight, self.gate.moe, self.gate.e_score_correction_bias, self.w13, self.w2,
            s.gate_up_proj.weight if s is not None else None, s.down_proj.weight if s is not None else None,
            norm=norm)

    def _plain_shared(self) -> bool:
        """Whether the shared experts (if any) are two bias-free model-dtype projections with no
        reduction of their own, as engine.kernels.moe_decode reads them."""
        s = self.shared_experts
        return s is None or (s.reduce_output is no_reduce and not s.gate_up_proj.is_fp8 and not s.down_proj.is_fp8
                             and s.gate_up_proj.bias is None and s.down_proj.bias is None)

    def hf_tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        out = {prefix + "gate.weight": self.gate.weight.detach()}
        if self.gate.e_score_correction_bias is not None:
            out[prefix + "gate.e_score_correction_bias"] = self.gate.e_score_correction_bias.detach()
        w13, w2 = self.w13.detach(), self.w2.detach()
        for e in range(self.num_experts):
            p = f"{prefix}experts.{e}."
            out[p + "gate_proj.weight"], out[p + "up_proj.weight"] = w13[e].split(self.intermediate, 0)
            out[p + "down_proj.weight"] = w2[e]
        if self.shared_experts is not None:
            out.update(self.shared_experts.hf_tensors(prefix + "shared_experts."))
        return out


def build_mlp(cfg: ModelConfig, layer: int) -> nn.Module:
    """Layer `layer`'s MLP: a SparseMoE where the config makes it sparse, else the dense MLP."""
    if cfg.moe is not None and cfg.moe.is_sparse(layer):
        return SparseMoE(cfg)
    return MLP(cfg.hidden_size, cfg.intermediate_size)
