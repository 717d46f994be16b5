"""Piecewise CUDA graphs for the steps a decode graph cannot hold: prefill chunks and steps that
mix them with decodes, up to `max_tokens` new tokens.

Such a step ran eagerly, and an eager forward of an 8B model is host-bound until its chunk is
large: ~700 kernel launches from Python. On one H200 `tandem profile` timed a 128-token prefill at
25 ms and a 512-token one at 24 (2048: 47 ms), and in the served runs (bench/results/h200-*) the
prefills under 512 new tokens, a coding agent's every later turn, took 40-52 ms while the GPU needs
a few. A mixed step stalls every sequence decoding in it for as long.

What depends on the step's shape is the attention: its sequences, their query lengths, contexts
and block tables. Everything between two attentions (o projection, residual and norms, the MLP,
the next q/k/v projection) depends only on the token count. So the forward is captured as one
graph per stretch between attentions, for each token bucket: layer i's attention runs eagerly
between graph i and graph i + 1 with the step's own metadata (paged attention: one launch, two
for a mixed step), reading q from graph i's output and writing the heads' output into one fixed
buffer that graph i + 1 reads. Rotary and the KV write depend only on each token's position and
slot: they stay inside graph i, reading static position and slot buffers. A step of T tokens pads
to the next bucket: the padded rows carry stale tokens through the projections, have slot -1 (no
KV written) and are never attended or read; attention sees only the T real rows. This is vLLM's
piecewise scheme, with the split taken where the model calls its attention op (`_Splitter`).

Models it takes: grouped-query attention with dense MLPs on one GPU in 16- or 32-bit weights
(Llama, Qwen2/3, Mistral). A mixture of experts routes on the device with shapes that depend on the
routing, latent attention has its own kernels, tensor parallelism all-reduces inside the stretches,
and FP8 GEMMs have not been run under these graphs on the GPU: those steps stay eager
(`unsupported`). A capture that fails turns the scheme off for the engine (logged).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from tandem.engine.cuda_graphs import collector_paused

log = logging.getLogger(__name__)

# "0" turns the scheme off in every engine of a process (and of a cluster: `tandem up` passes
# TANDEM_* variables to Ray's workers), for A/B runs against the eager steps
PIECEWISE_ENV = "TANDEM_PIECEWISE_GRAPHS"

# token buckets: a step of more than 32 tokens pads by less than half its tokens (past 128, by a
# quarter at most)
TOKEN_BUCKETS = (32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)


def unsupported(model) -> str | None:
    """Why the model's forward cannot be split at its attentions, or None when it can."""
    from tandem.engine.model import Attention  # noqa: PLC0415 (engine.model imports kernels lazily too)
    from tandem.engine.moe import MLP, no_reduce  # noqa: PLC0415 (as above)

    layers = getattr(model, "layers", None)
    if not layers:
        return "the model has no decoder layers to split"
    if getattr(model, "fp8_weights", False):
        # its GEMMs quantize activations per step; no GPU test has run them under these graphs
        return "FP8 weights: not checked under piecewise graphs on the GPU yet"
    for layer in layers:
        if not isinstance(layer.self_attn, Attention):
            return "latent attention runs kernels of its own"
        if not isinstance(layer.mlp, MLP):
            return "a mixture of experts sizes its launches from the routing"
        if layer.self_attn.reduce_output is not no_reduce or layer.mlp.reduce_output is not no_reduce:
            return "tensor-parallel layers all-reduce inside the stretches"
    return None


@dataclass
class _Attention:
    """One layer's attention call as captured: q is a graph output (a fixed address), rotated and
    its K/V written inside that graph."""
    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    scale: float
    sliding_window: int | None

    def run(self, ops, n: int, meta, out: torch.Tensor) -> None:
        ops.attention(self.q[:n], self.k_cache, self.v_cache, meta, self.scale, out,
                      sliding_window=self.sliding_window)


@dataclass
class _Bucket:
    tokens: int
    graphs: list = field(default_factory=list)          # len(attentions) + 1 stretches
    attentions: list[_Attention] = field(default_factory=list)
    hidden: torch.Tensor | None = None                  # the last stretch's output [tokens, hidden]


class _Splitter:
    """The model's ops, except that each attention call ends the stretch being captured, is
    recorded, and begins the next; it returns the heads' output buffer (what the next stretch
    reads). With no bucket to record into nothing is captured: each attention runs at once on
    `meta` (the step run eagerly through the split, as the CPU tests run it)."""

    def __init__(self, ops, runner: "PiecewiseGraphs", bucket: _Bucket | None, meta=None):
        self._ops, self._runner, self._bucket, self._meta = ops, runner, bucket, meta

    def __getattr__(self, name):
        return getattr(self._ops, name)

    def rotary_kv_attention(self, q, k, v, positions, cos_sin, k_cache, v_cache, meta, scale,
                            sliding_window=None, in_attention=None):
        runner = self._runner
        T = q.shape[0]
        out = runner.heads_out(T, q.shape[1], q.shape[2])
        # every row: rotary by its static position, K/V to its static slot (-1 for padded rows)
        self._ops.rotary_write_kv(q, k, v, positions, cos_sin, k_cache, v_cache, runner.slots[:T])
        attention = _Attention(q, k_cache, v_cache, scale, sliding_window)
        if self._bucket is None:       # eager through the split: the step's own attention now
            n = runner.real_tokens
            attention.run(self._ops, n, self._meta, out[:n])
            return out
        self._bucket.attentions.append(attention)
        runner._next_stretch(self._bucket)
        return out


class PiecewiseGraphs:
    """The piecewise graphs of one model runner (`run`), by token bucket, captured on a bucket's
    first step or ahead (`capture_all`). `capture=False` (CPU tests) runs the same split forward
    eagerly on the padded static inputs."""

    def __init__(self, model, kv_cache: torch.Tensor, device: torch.device, *, capture: bool,
                 max_tokens: int = TOKEN_BUCKETS[-1]):
        """kv_cache: the model's whole cache tensor (KVCache.tensor)."""
        self.model, self.kv_cache, self.device, self.capture = model, kv_cache, device, capture
        self.buckets = tuple(b for b in TOKEN_BUCKETS if b <= max_tokens)
        self.max_tokens = self.buckets[-1] if self.buckets else 0
        self.why_not = unsupported(model) or (None if self.buckets else "no token bucket")
        if self.why_not is not None:    # its steps stay eager: no buffers, no pool
            self.max_tokens = 0
        cfg = model.config
        self.input_ids = torch.zeros(self.max_tokens, dtype=torch.int32, device=device)
        self.positions = torch.zeros(self.max_tokens, dtype=torch.int32, device=device)
        self.slots = torch.full((self.max_tokens,), -1, dtype=torch.int32, device=device)
        self._heads = torch.zeros(self.max_tokens * cfg.num_heads * cfg.head_dim,
                                  dtype=model.embed_tokens.weight.dtype, device=device)
        self._captured: dict[int, _Bucket] = {}
        self._graph: torch.cuda.CUDAGraph | None = None       # the stretch being captured
        self.pool = torch.cuda.graph_pool_handle() if capture and self.why_not is None else None
        self._stream: torch.cuda.Stream | None = None
        self.real_tokens = 0
        self.replays = 0
        self.captures = 0
        self.capture_s = 0.0
        self.failed: str | None = None

    # ---- which steps ---------------------------------------------------------------------------
    def bucket(self, tokens: int) -> int | None:
        """The bucket a step of `tokens` new tokens pads to, or None: it runs eagerly."""
        if self.why_not is not None or self.failed is not None or tokens < 1:
            return None
        return next((b for b in self.buckets if b >= tokens), None)

    def heads_out(self, tokens: int, heads: int, head_dim: int) -> torch.Tensor:
        return self._heads[:tokens * heads * head_dim].view(tokens, heads, head_dim)

    # ---- run -----------------------------------------------------------------------------------
    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta) -> torch.Tensor:
        """The final hidden states [T, hidden] of a step of T = len(input_ids) tokens (its bucket
        from `bucket`), as the model's forward gives them."""
        n = input_ids.shape[0]
        size = self.bucket(n)
        if size is None:
            raise ValueError(f"a step of {n} tokens has no piecewise bucket (largest {self.max_tokens})")
        b = self._captured.get(size) if self.capture else None
        if self.capture and b is None:
            b = self._capture(size)         # before the step's slots are in (its warm run writes none)
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slots[:n].copy_(meta.slot_mapping)
        self.slots[n:size].fill_(-1)
        self.real_tokens = n
        ops = self.model.ops_for(self.device)
        if b is None:   # capture=False (as DecodeGraphs runs its static buffers), or capturing failed
            self.replays += self.failed is None
            return self._forward(size, _Splitter(ops, self, None, meta))[:n]
        self.replays += 1
        with self.model._kernel_launches(size):
            for graph, a in zip(b.graphs, b.attentions):
                graph.replay()
                a.run(ops, n, meta, self.heads_out(n, a.q.shape[1], a.q.shape[2]))
            b.graphs[-1].replay()
        return b.hidden[:n]

    def _forward(self, size: int, ops) -> torch.Tensor:
        """The model's forward on the first `size` static inputs, `ops` in place of its own."""
        model, before = self.model, self.model.ops
        model.ops = ops
        try:
            return model(self.input_ids[:size], self.positions[:size], self.kv_cache, None)
        finally:
            model.ops = before

    # ---- capture -------------------------------------------------------------------------------
    def capture_all(self) -> int:
        """Capture every bucket not captured yet (warmup); returns how many were."""
        if not self.capture or self.why_not is not None:
            return 0
        before = self.captures
        for size in self.buckets:
            if self.failed is None and size not in self._captured:
                self._capture(size)
        return self.captures - before

    def _capture(self, size: int) -> _Bucket | None:
        """Capture the stretches of a `size`-token forward: one eager run first (it compiles the
        kernels of that shape; its attentions are skipped: they run per step), then the capture on
        a side stream, as engine.cuda_graphs captures decode steps."""
        t0 = time.perf_counter()
        self.slots.fill_(-1)    # the warm run rotates and writes K/V like a step: to no slot
        current = torch.cuda.current_stream(self.device)
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        bucket = _Bucket(size)
        try:
            self._forward(size, _Splitter(self.model.ops_for(self.device), self, _Bucket(size)))
            self._graph = None
            self._stream.wait_stream(current)
            with torch.cuda.stream(self._stream), collector_paused():
                self._begin()
                try:
                    hidden = self._forward(size, _Splitter(self.model.ops_for(self.device), self, bucket))
                finally:
                    self._end(bucket)
            current.wait_stream(self._stream)
        except Exception as e:  # noqa: BLE001 - steps of this model run eagerly from now on
            current.wait_stream(self._stream)
            self.failed = f"{size} tokens: {type(e).__name__}: {e}"[:500]
            log.warning("piecewise CUDA graph capture failed; prefill and mixed steps run eagerly: %s", self.failed)
            self.capture_s += time.perf_counter() - t0
            return None
        bucket.hidden = hidden
        self._captured[size] = bucket
        self.captures += 1
        self.capture_s += time.perf_counter() - t0
        return bucket

    def _begin(self) -> None:
        self._graph = torch.cuda.CUDAGraph()
        self._graph.capture_begin(pool=self.pool, capture_error_mode="thread_local")

    def _end(self, bucket: _Bucket) -> None:
        if self._graph is not None:
            graph, self._graph = self._graph, None
            graph.capture_end()
            bucket.graphs.append(graph)

    def _next_stretch(self, bucket: _Bucket) -> None:
        """At an attention call: end the stretch being captured (in the eager warm run there is
        none), begin the next."""
        if self._graph is None:
            return
        self._end(bucket)
        self._begin()

    @property
    def stats(self) -> dict:
        return {"piecewise_buckets": len(self._captured), "piecewise_replays": self.replays,
                "piecewise_capture_s": round(self.capture_s, 3), "piecewise_off": self.why_not or self.failed}
