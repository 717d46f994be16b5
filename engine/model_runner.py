"""Runs one scheduled batch through the model: builds the flattened inputs and attention metadata
from the scheduler's decision, runs the forward pass, and returns logits for the positions that
need them (the last position of every sequence that samples; 1 + k positions when verifying k
drafts). Owns the model and its KV cache on one device.

`prepare` builds the metadata on the host with numpy in one pass over the batch. On the CPU the
inputs are int64/int32 tensors as the torch path expects. On CUDA every input is int32, packed into
one pinned host buffer and uploaded with one non-blocking copy; decode-shaped steps (see
engine.cuda_graphs) are packed straight into the static buffers of the CUDA graphs and `execute`
replays the graph captured for their padded shape. A step runs eagerly when it is not
decode-shaped, when `layer_done` is given (a graph cannot call back per layer), or while the caller
is itself capturing a graph.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from tandem.engine.attention import AttentionMetadata
from tandem.engine.block_tables import BlockTables
from tandem.engine.cuda_graphs import (DEFAULT_BATCH_SIZES, DecodeGraphs, GraphKey, StaticInputs, packed_starts,
                                capture_query_lens, graph_key, next_power_of_2, token_buckets)
from tandem.engine.kv_cache import KVCache
from tandem.engine.piecewise_graphs import PIECEWISE_ENV, PiecewiseGraphs
from tandem.engine.scheduler import SchedulerOutput
from tandem.engine.speculative.tree import ancestor_masks, check_tree, depths


@dataclass
class BatchInputs:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    meta: AttentionMetadata
    logits_index: torch.Tensor  # [N] rows of the hidden states that need logits
    logits_owner: list[tuple[str, int]]  # (request id, number of rows) in order
    graph_key: GraphKey | None = None  # the captured shape this step pads to (None: eager)
    host: torch.Tensor | None = field(default=None, repr=False)  # packed inputs (graph steps)
    source: _HostBatch | None = field(default=None, repr=False)  # what prepare_host built it from
    # input ids the host does not know yet (tokens a step still on the device sampled, fed in by
    # engine.inflight.feed_pending): their positions in the step's tokens and their sequences
    pending: tuple[np.ndarray, np.ndarray] = field(default_factory=lambda: (_NONE, _NONE), repr=False)


@dataclass
class _HostBatch:
    ids: np.ndarray  # [T] int64
    positions: np.ndarray  # [T]
    slots: np.ndarray  # [T]
    logits_index: np.ndarray  # [N]
    query_start_loc: np.ndarray  # [B + 1]
    query_lens: list[int]
    seq_lens: list[int]
    table: np.ndarray  # [B, max blocks] int32, rows padded with 0
    owners: list[tuple[str, int]]
    pending: tuple[np.ndarray, np.ndarray] | None = None  # BatchInputs.pending
    tree_mask: np.ndarray | None = None  # [T] int64: AttentionMetadata.tree_mask (tree drafts only)


_NONE = np.zeros(0, dtype=np.int64)


def _token_slice(r, start: int, end: int) -> list[int]:
    """r.all_token_ids[start:end] without building the whole list."""
    prompt, out = r.prompt_token_ids, r.output_token_ids
    n = len(prompt)
    if end <= n:
        return prompt[start:end]
    if start >= n:
        return out[start - n:end - n]
    return prompt[start:] + out[:end - n]


def _tree_rows(out: SchedulerOutput, trees: dict[str, list[int]], qsl: np.ndarray,
               positions: np.ndarray) -> np.ndarray:
    """Tree-draft sequences' rows: rotary positions root + depth (set in `positions`) and the
    ancestor bitmasks; every other row -1 (causal). -> [T] int64 tree mask."""
    mask = np.full(len(positions), -1, dtype=np.int64)
    for i, s in enumerate(out.scheduled):
        parents = trees.get(s.request.request_id)
        if parents is None:
            continue
        parents = parents[:s.num_draft_tokens]
        check_tree(parents)
        if s.num_new_tokens != 1 + len(parents):
            raise ValueError(f"request {s.request.request_id}: a tree of {len(parents)} drafts needs "
                             f"{1 + len(parents)} new tokens, {s.num_new_tokens} scheduled")
        a = int(qsl[i])
        positions[a + 1:a + 1 + len(parents)] = positions[a] + np.asarray(depths(parents), dtype=np.int64)
        bits = ancestor_masks(parents)
        mask[a:a + len(bits)] = [b - (1 << 64) if b >= 1 << 63 else b for b in bits]  # bit 63: the sign
    return mask


# A decode-shaped step whose shape has no CUDA graph yet runs on the piecewise graphs (where the
# model takes them) instead of eagerly, and its shape is captured on its SPLIT_CAPTURE_AFTER-th
# step (DecodeGraphs.capture_split_after). llama3-8b bf16 on one H200, served (docs/benchmarks.md):
# a piecewise decode step took 12-15 ms where the eager one took 28-40 and a replay 7.5-8, a
# capturing step 56-90 (medians). At 2 the policy is the one before with each eager step made
# piecewise: the same captures, the same steps off their graphs. Later captures trade each
# capture's stall for piecewise steps ~3 ms slower than replays: at 32-64, two same-machine A/B
# pairs at 1-3 sessions/s kept goodput and TPOT p90 (p99 lower in 5 of 6 rates) and raised TPOT p50
# 6-7% (19% once). $TANDEM_SPLIT_CAPTURE_AFTER sets it for new runners (0: eager, as before).
SPLIT_CAPTURE_AFTER = 2
SPLIT_ENV = "TANDEM_SPLIT_CAPTURE_AFTER"


def _split_policy() -> int:
    raw = os.environ.get(SPLIT_ENV, "")
    if not raw.strip():
        return SPLIT_CAPTURE_AFTER
    try:
        n = int(raw)
    except ValueError:
        raise ValueError(f"${SPLIT_ENV} must be a whole number of steps (0 turns it off), got {raw!r}") from None
    if n < 0:
        raise ValueError(f"${SPLIT_ENV} must be 0 or more, got {n}")
    return n


class ModelRunner:
    def __init__(self, model, kv_cache: KVCache, device: torch.device | str, *,
                 cuda_graphs: bool | None = None, graph_batch_sizes: tuple[int, ...] = DEFAULT_BATCH_SIZES,
                 max_graph_tokens: int = 512, capture: bool | None = None, piecewise: bool | None = None):
        """cuda_graphs: None = on for CUDA. capture: None = capture on CUDA; False runs the graph
        path's static buffers eagerly (how CPU tests check the padding). Graphs are captured lazily,
        on a shape's first step; `capture_graphs` captures decode shapes up front. `piecewise`:
        steps that are not decode-shaped, up to max_graph_tokens new tokens, replay
        engine.piecewise_graphs' stretches around an eager attention (where the model allows);
        None: on unless $TANDEM_PIECEWISE_GRAPHS is 0 (an A/B switch, passed to Ray's workers)."""
        self.model = model
        self.kv_cache = kv_cache
        self.device = torch.device(device)
        self.block_size = kv_cache.block_size
        max_blocks = min(kv_cache.num_blocks, -(-model.config.max_position_embeddings // self.block_size))
        self.block_tables = BlockTables(max_blocks)  # the host's, kept across steps
        # rank 0 of a tensor-parallel worker: sends each step's inputs to the other ranks, which
        # run the same forward on their shards (engine.parallel.shard)
        self.before_execute: Callable[[BatchInputs], None] | None = None
        cuda = self.device.type == "cuda"
        self.graphs: DecodeGraphs | None = None
        self.piecewise: PiecewiseGraphs | None = None
        self.static: StaticInputs | None = None
        self._static_batch: BatchInputs | None = None  # the step the static buffers hold
        if cuda_graphs if cuda_graphs is not None else cuda:
            self.batch_sizes = tuple(sorted(graph_batch_sizes))
            self.token_sizes = token_buckets(self.batch_sizes, max(max_graph_tokens, self.batch_sizes[-1]))
            cfg = model.config
            max_blocks = min(kv_cache.num_blocks, -(-cfg.max_position_embeddings // self.block_size))
            self.static = StaticInputs(self.batch_sizes[-1], self.token_sizes[-1], max_blocks, self.device)
            split_after = _split_policy()
            self.graphs = DecodeGraphs(self._static_step, capture=cuda if capture is None else capture,
                                       split=self._split_step if split_after != 0 else None,
                                       capture_split_after=split_after)
            self._split_plans: dict[tuple[int, int], bool] = {}
            if piecewise is None:
                piecewise = os.environ.get(PIECEWISE_ENV, "1") != "0"
            if piecewise and self._fused():
                self.piecewise = PiecewiseGraphs(model, kv_cache.tensor, self.device, capture=self.graphs.capture,
                                                 max_tokens=max_graph_tokens)

    # ---- inputs -----------------------------------------------------------------------------
    def _host_batch(self, out: SchedulerOutput, drafts: dict[str, list[int]],
                    trees: dict[str, list[int]]) -> _HostBatch:
        bs = self.block_size
        num_seqs = len(out.scheduled)
        pieces: list[list[int]] = []
        starts, qlens, slens, rows, owners = [], [], [], [], []
        num_tokens = 0
        for s in out.scheduled:
            r = s.request
            start, n = r.num_computed_tokens, s.num_new_tokens
            known = r.num_tokens
            pieces.append(_token_slice(r, start, min(start + n, known)))
            if start + n > known:
                d = drafts.get(r.request_id, [])[: s.num_draft_tokens][max(start, known) - known:start + n - known]
                if len(d) != start + n - max(start, known):
                    raise IndexError(f"request {r.request_id}: {len(d)} draft tokens for "
                                     f"{start + n - max(start, known)} draft positions")
                pieces.append(d)
            starts.append(start)
            qlens.append(n)
            slens.append(start + n)
            num_tokens += n
            if s.samples:
                k = 1 + s.num_draft_tokens
                rows.append((num_tokens - k, k))
                owners.append((r.request_id, k))
        ids = np.fromiter(itertools.chain.from_iterable(pieces), dtype=np.int64, count=num_tokens)
        table = self.block_tables.gather([s.request for s in out.scheduled])
        qlens_np = np.asarray(qlens, dtype=np.int64)
        qsl = np.zeros(num_seqs + 1, dtype=np.int64)
        np.cumsum(qlens_np, out=qsl[1:])
        seq_of = np.repeat(np.arange(num_seqs), qlens_np)  # [T] sequence of each token
        positions = np.arange(num_tokens, dtype=np.int64) + np.repeat(np.asarray(starts, dtype=np.int64) - qsl[:-1], qlens_np)
        slots = table[seq_of, positions // bs].astype(np.int64) * bs + positions % bs
        logits_index = (np.concatenate([np.arange(a, a + k) for a, k in rows]) if rows
                        else np.zeros(0, dtype=np.int64))
        at = np.flatnonzero(ids < 0)  # placeholders (request.PENDING): the engine feeds them
        pending = (at, seq_of[at]) if len(at) else None
        tree_mask = _tree_rows(out, trees, qsl, positions) if trees else None
        return _HostBatch(ids, positions, slots, logits_index, qsl, qlens, slens, table, owners, pending, tree_mask)

    def prepare(self, out: SchedulerOutput, drafts: dict[str, list[int]] | None = None,
                trees: dict[str, list[int]] | None = None) -> BatchInputs:
        """`trees`: request id -> parents of its drafts, where they form a tree
        (engine.speculative.tree); other drafts are chains."""
        return self.prepare_host(self._host_batch(out, drafts or {}, trees or {}))

    def prepare_host(self, h: _HostBatch) -> BatchInputs:
        """The step's device inputs from its host arrays (a tensor-parallel shard rank gets these
        from rank 0 and prepares its own)."""
        batch = self._device_batch(h)
        batch.source = h
        if h.pending is not None:
            batch.pending = h.pending
        return batch

    def _device_batch(self, h: _HostBatch) -> BatchInputs:
        dev = self.device
        if dev.type != "cuda" and self.graphs is None:
            # the CPU path: the dtypes the torch reference takes
            meta = AttentionMetadata(
                slot_mapping=torch.from_numpy(h.slots), query_start_loc=torch.from_numpy(h.query_start_loc.astype(np.int32)),
                seq_lens=torch.tensor(h.seq_lens, dtype=torch.int32), block_tables=torch.from_numpy(h.table),
                query_lens_cpu=h.query_lens, seq_lens_cpu=h.seq_lens,
                max_query_len=max(h.query_lens), max_seq_len=max(h.seq_lens),
                tree_mask=None if h.tree_mask is None else torch.from_numpy(h.tree_mask))
            return BatchInputs(input_ids=torch.from_numpy(h.ids), positions=torch.from_numpy(h.positions), meta=meta,
                               logits_index=torch.from_numpy(h.logits_index), logits_owner=h.owners)
        key = self._graph_key(h)
        if key is not None:
            return self._prepare_static(h, key)
        # eager on CUDA: one pinned buffer [ids | positions | slots | logits rows | qsl | seq_lens | table]
        T, N, B = len(h.ids), len(h.logits_index), len(h.seq_lens)
        parts = (h.ids, h.positions, h.slots, h.logits_index, h.query_start_loc, np.asarray(h.seq_lens), h.table.reshape(-1))
        starts = packed_starts([len(p) for p in parts])
        host = torch.empty(int(starts[-1]), dtype=torch.int32, pin_memory=dev.type == "cuda")
        hn = host.numpy()
        for p, a in zip(parts, starts):
            hn[a:a + len(p)] = p
        buf = host.to(dev, non_blocking=True)
        v = [buf[a:a + len(p)] for p, a in zip(parts, starts)]
        meta = AttentionMetadata(
            slot_mapping=v[2], query_start_loc=v[4], seq_lens=v[5], block_tables=v[6].view(B, -1),
            query_lens_cpu=h.query_lens, seq_lens_cpu=h.seq_lens,
            max_query_len=max(h.query_lens), max_seq_len=max(h.seq_lens),
            tree_mask=None if h.tree_mask is None else torch.from_numpy(h.tree_mask).to(dev))
        assert len(v[0]) == T and len(v[3]) == N
        return BatchInputs(input_ids=v[0], positions=v[1], meta=meta, logits_index=v[3], logits_owner=h.owners)

    def _graph_key(self, h: _HostBatch) -> GraphKey | None:
        if self.graphs is None or not self._fused():
            return None
        key = graph_key(h.query_lens, max(h.seq_lens), batch_sizes=self.batch_sizes,
                        token_sizes=self.token_sizes,
                        max_context=self.static.max_blocks * self.block_size, splits=self._splits,
                        tree=h.tree_mask is not None)
        if key is None or h.table.shape[1] > self.static.max_blocks or not self.graphs.can_run(key):
            return None
        return key

    def _fused(self) -> bool:
        """Whether the model runs the Triton ops here (graphs need them)."""
        ops_for = getattr(self.model, "ops_for", None)
        return ops_for is not None and getattr(ops_for(self.device), "fused", False)

    def _splits(self, batch: int, context: int) -> bool:
        """Whether the decode kernel splits contexts of this length at this batch size."""
        plan = self._split_plans.get((batch, context))
        if plan is None:
            from tandem.engine.kernels.paged_attention import _num_sms, choose_partition_size  # noqa: PLC0415 (triton loads only where kernels run)

            size = choose_partition_size(batch, self.model.config.num_kv_heads, context, _num_sms(self.device))
            plan = self._split_plans[(batch, context)] = size is not None and size < context
        return plan

    def _prepare_static(self, h: _HostBatch, key: GraphKey) -> BatchInputs:
        s = self.static
        host = s.pack(h.ids, h.positions, h.slots, h.logits_index, h.query_start_loc, h.seq_lens, h.table,
                      h.tree_mask)
        T, N, B = len(h.ids), len(h.logits_index), len(h.seq_lens)
        meta = AttentionMetadata(
            slot_mapping=s.slots[:T], query_start_loc=s.query_start_loc[:B + 1], seq_lens=s.seq_lens[:B],
            block_tables=s.block_tables[:B, :h.table.shape[1]], query_lens_cpu=h.query_lens,
            seq_lens_cpu=h.seq_lens, max_query_len=max(h.query_lens), max_seq_len=max(h.seq_lens),
            tree_mask=s.tree_mask[:T] if key.tree else None)
        batch = BatchInputs(input_ids=s.input_ids[:T], positions=s.positions[:T], meta=meta,
                            logits_index=s.logits_rows[:N], logits_owner=h.owners, graph_key=key, host=host)
        self._upload(batch)
        return batch

    def _upload(self, batch: BatchInputs) -> None:
        self.static.upload(batch.host, batch.meta.num_seqs, batch.meta.block_tables.shape[1])
        self._static_batch = batch

    def _static_step(self, key: GraphKey) -> torch.Tensor:
        """The forward + logits of a padded step on the static buffers: what a graph captures."""
        s, T, B = self.static, key.tokens, key.batch
        seq_lens_cpu = [key.context or 1] * B  # sizes the split-K plan as the key says
        meta = AttentionMetadata(
            slot_mapping=s.slots[:T], query_start_loc=s.query_start_loc[:B + 1], seq_lens=s.seq_lens[:B],
            block_tables=s.block_tables[:B], query_lens_cpu=capture_query_lens(key),
            seq_lens_cpu=seq_lens_cpu, max_query_len=key.query_len, max_seq_len=max(seq_lens_cpu),
            tree_mask=s.tree_mask[:T] if key.tree else None)
        hidden = self.model(s.input_ids[:T], s.positions[:T], self.kv_cache.tensor, meta)
        return self.model.compute_logits(hidden.index_select(0, s.logits_rows[:T]))

    @torch.inference_mode()
    def capture_graphs(self, batch_sizes: tuple[int, ...] | None = None, context_len: int = 2048,
                       all_contexts: bool = False) -> int:
        """Capture the decode graphs (one new token per sequence) of these batch sizes for
        contexts up to context_len now, instead of on their first steps; with `all_contexts`, for
        every context bucket up to the longest context the graphs serve too (a batch small enough
        that the decode kernel splits contexts has one graph per bucket: agents' contexts of 8k to
        128k would otherwise capture theirs mid-serving). Returns graphs captured."""
        if self.graphs is None or not self._fused():
            return 0
        before = self.graphs.captures
        s = self.static
        s.buffer[:s.header_len].copy_(torch.from_numpy(s.empty_header))
        self._static_batch = None
        max_context = s.max_blocks * self.block_size
        contexts = [min(context_len, max_context)]
        while all_contexts and contexts[-1] < max_context:
            contexts.append(min(2 * next_power_of_2(contexts[-1]), max_context))
        keys = dict.fromkeys(graph_key([1] * b, c, batch_sizes=self.batch_sizes, token_sizes=self.token_sizes,
                                       max_context=max_context, splits=self._splits)
                             for b in batch_sizes or self.batch_sizes for c in contexts)
        for key in keys:
            if key is not None:
                self.graphs.capture_empty(key)
        return self.graphs.captures - before

    # ---- run --------------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, batch: BatchInputs, layer_done=None) -> torch.Tensor:
        """-> logits [N, vocab] (float32) for `batch.logits_index` rows (N may be 0)."""
        if self.before_execute is not None:
            self.before_execute(batch)
        if batch.graph_key is not None:
            if self._static_batch is not batch:  # another step was prepared since: put this one back
                self._upload(batch)
            if layer_done is None and self.graphs.can_run(batch.graph_key) and not self._capturing():
                logits = self.graphs.run(batch.graph_key)
                return logits[:batch.logits_index.shape[0]].clone()
        if self._piecewise(batch, layer_done):
            hidden = self.piecewise.run(batch.input_ids, batch.positions, batch.meta)
        else:
            hidden = self.model(batch.input_ids, batch.positions, self.kv_cache.tensor, batch.meta, layer_done)
        return self._logits(batch, hidden)

    def _logits(self, batch: BatchInputs, hidden: torch.Tensor) -> torch.Tensor:
        if not batch.logits_owner:
            return hidden.new_empty((0, self.model.config.vocab_size), dtype=torch.float32)
        return self.model.compute_logits(hidden.index_select(0, batch.logits_index))

    def _piecewise(self, batch: BatchInputs, layer_done) -> bool:
        """Whether this eager step replays the piecewise graphs: no decode graph runs it, within
        their largest bucket, no per-layer callback (a prefill actor streaming KV layer by layer),
        not inside another capture."""
        pw = self.piecewise
        return (pw is not None and layer_done is None and pw.bucket(batch.input_ids.shape[0]) is not None
                and not self._capturing())

    def _split_step(self, key: GraphKey) -> torch.Tensor | None:
        """DecodeGraphs' `split`: the decode-shaped step the static buffers hold, whose shape `key`
        has no graph yet, on the piecewise graphs (its real tokens and metadata; the attention
        eager between the stretches) -> its logits rows, or None where they cannot take it."""
        batch = self._static_batch
        if batch is None or batch.graph_key != key or not self._piecewise(batch, None):
            return None
        return self._logits(batch, self.piecewise.run(batch.input_ids, batch.positions, batch.meta))

    def _capturing(self) -> bool:
        """Whether the caller is itself capturing a CUDA graph (then no graph runs inside it)."""
        return self.device.type == "cuda" and torch.cuda.is_current_stream_capturing()

    @torch.inference_mode()
    def capture_piecewise(self) -> int:
        """Capture every piecewise bucket now (warmup) rather than on its first step."""
        return self.piecewise.capture_all() if self.piecewise is not None else 0

    @property
    def graph_stats(self) -> dict[str, int | str | None]:
        g = self.graphs
        if g is None:
            return {"graphs": 0, "captures": 0, "replays": 0, "eager_runs": 0, "covered_runs": 0, "split_runs": 0,
                    "capture_failures": 0, "capture_s": 0.0, "last_capture_failure": None, "failed": None}
        pw = self.piecewise.stats if self.piecewise is not None else {}
        return {"graphs": len(g.graphs), "captures": g.captures, "replays": g.replays, "eager_runs": g.eager_runs,
                "covered_runs": g.covered_runs, "split_runs": g.split_runs, "capture_failures": g.capture_failures, "capture_s": round(g.capture_s, 3),
                "last_capture_failure": g.last_failure, "failed": g.failed, **pw}
