"""CUDA graphs for decode-shaped steps: which steps qualify, how they are padded to a captured
shape, the static input buffers the graphs read, and capture / replay.

A step qualifies when every sequence has at most MAX_GRAPH_QUERY_LEN new tokens (decode, the
speculative verifier's 1 + k, a short prefill tail), the batch and its token count fit the largest
bucket, its contexts fit the static block table, and the model runs the Triton ops (the torch path
reads host-side lengths every step). It is padded to a `GraphKey`:

- batch: the next size in `batch_sizes`. Padded sequences have no new tokens and seq_len 0: the
  attention kernels return at once for them.
- tokens: T padded to the next bucket (a decode step: tokens == batch). Padded tokens have id 0,
  position 0 and slot -1 (write_kv skips them) and belong to no sequence: their hidden rows are
  computed and never read.
- query_len: the next power of two of the longest query (the decode kernel's tile of query rows).
- context: 0 when the decode kernel reads each context in one pass (batch x KV heads already fill
  the GPU); else the context bucket (next power of two), because the split-K launch grid has one
  program per partition. Such a graph serves every step whose contexts fit its bucket.
- tree: the step verifies draft trees (AttentionMetadata.tree_mask): its graph was captured with
  the kernels' tree-mask variant reading the static tree-mask buffer.

Static buffers (`StaticInputs`): one int32 device buffer holding the header [ids | positions |
slots | logits rows | query_start_loc | seq_lens | tree mask (int64: two words a token)], sized for the largest bucket, then a staging
area for the compact block table; and the block table itself [max batch, max blocks per sequence].
Graphs read prefixes of these. A step fills one pinned host buffer with the same layout and uploads
it with one copy, then scatters the table with one device copy: no host synchronisation.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

log = logging.getLogger(__name__)

DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)
MAX_GRAPH_QUERY_LEN = 16  # engine.kernels.paged_attention.MAX_DECODE_QUERY_LEN
MIN_CONTEXT_BUCKET = 256


@dataclass(frozen=True)
class GraphKey:
    batch: int  # sequences, padded
    tokens: int  # new tokens, padded
    query_len: int  # power of two >= the longest query
    context: int  # 0: any context (one pass per sequence); else the split-K context bucket
    tree: bool = False  # tree drafts: the attention reads the static tree mask


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Python's garbage collector off while a graph is captured: a collection then may free an
    unreachable CUDAGraph (of an engine or runner dropped earlier, in a reference cycle), and
    destroying a graph during a capture invalidates the capture (seen on an H100: eight captures
    in a row failed that way after benchmark engines were dropped, 2026-12-05)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def batch_buckets(max_num_seqs: int) -> tuple[int, ...]:
    """Graph batch sizes for a scheduler that runs up to max_num_seqs sequences: the defaults up
    to it, continued in steps of 32 past 256, and max_num_seqs itself, so every batch it can form
    replays a graph (padded by at most 32 sequences past 128)."""
    sizes = [s for s in DEFAULT_BATCH_SIZES if s < max_num_seqs]
    if sizes and sizes[-1] == DEFAULT_BATCH_SIZES[-1]:
        sizes += range(288, max_num_seqs, 32)
    return tuple(sizes) + (max_num_seqs,)


def next_power_of_2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def round_up(n: int, sizes: tuple[int, ...]) -> int | None:
    """The smallest size >= n, or None when n is larger than all of them."""
    for s in sizes:
        if s >= n:
            return s
    return None


def token_buckets(batch_sizes: tuple[int, ...], max_tokens: int) -> tuple[int, ...]:
    """The batch sizes, continued by the largest batch size's steps up to max_tokens."""
    sizes = [s for s in batch_sizes if s <= max_tokens]
    step = max(batch_sizes)
    while sizes[-1] + step <= max_tokens:
        sizes.append(sizes[-1] + step)
    if sizes[-1] < max_tokens:
        sizes.append(max_tokens)
    return tuple(sizes)


def graph_key(query_lens: list[int], max_seq_len: int, *, batch_sizes: tuple[int, ...],
              token_sizes: tuple[int, ...], max_context: int,
              splits: Callable[[int, int], bool], tree: bool = False) -> GraphKey | None:
    """The captured shape a step pads to, or None if it runs eagerly. `splits(batch, context)`:
    whether the decode kernel would split contexts of that length into partitions at that batch."""
    num_seqs, num_tokens = len(query_lens), sum(query_lens)
    max_q = max(query_lens, default=0)
    if not num_seqs or max_q < 1 or max_q > MAX_GRAPH_QUERY_LEN or max_seq_len > max_context:
        return None
    batch = round_up(num_seqs, batch_sizes)
    if batch is None:
        return None
    q = next_power_of_2(max_q)
    if q == 1:
        tokens = batch
    else:
        tokens = round_up(num_tokens, token_sizes)
        if tokens is None:
            return None
        tokens = min(tokens, batch * q)
    context = min(max(MIN_CONTEXT_BUCKET, next_power_of_2(max_seq_len)), max_context)
    return GraphKey(batch, tokens, q, context if splits(batch, context) else 0, tree)


def capture_query_lens(key: GraphKey) -> list[int]:
    """Host-side query lengths with the key's batch, token count and longest query: what the
    kernels' launch grids are sized from at capture (the device tensors hold the real ones)."""
    full, rest = divmod(key.tokens, key.query_len)
    lens = [key.query_len] * full + ([rest] if rest else [])
    return lens + [0] * (key.batch - len(lens))


_PART_ALIGN = 4   # int32 elements: 16 bytes


def packed_starts(lengths: list[int]) -> list[int]:
    """Offsets (in int32 elements) of parts packed into one buffer, each 16-byte aligned, and the
    buffer's length last. Triton specializes a pointer argument on whether it is 16-byte aligned:
    parts packed end to end would start at offsets that change with the batch's sizes, and each
    new alignment pattern compiles another kernel variant in the middle of a step (a second or
    more; the two-GPU serving run logged 26 such compiles in 20 s)."""
    starts, at = [], 0
    for n in lengths:
        starts.append(at)
        at += -(-n // _PART_ALIGN) * _PART_ALIGN
    return starts + [at]


class StaticInputs:
    """The device buffers captured graphs read, and the packing of one step into them."""

    def __init__(self, max_batch: int, max_tokens: int, max_blocks: int, device: torch.device):
        self.max_batch, self.max_tokens, self.max_blocks = max_batch, max_tokens, max_blocks
        self.device = device
        T, B = max_tokens, max_batch
        # header offsets: ids, positions, slots, logits rows [T each]; query_start_loc [B + 1];
        # seq_lens [B]; tree mask [T] int64 as 2T int32 words (16-byte aligned, so an int64 view)
        self.offsets = tuple(packed_starts([T, T, T, T, B + 1, B, 2 * T]))
        self.header_len = self.offsets[-1]
        self.buffer = torch.zeros(self.header_len + B * max_blocks, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(B, max_blocks, dtype=torch.int32, device=device)
        o = self.offsets
        sizes = (T, T, T, T, B + 1, B)
        view = lambda i: self.buffer[o[i]:o[i] + sizes[i]]  # noqa: E731
        self.input_ids, self.positions, self.slots, self.logits_rows = (view(i) for i in range(4))
        self.query_start_loc, self.seq_lens = view(4), view(5)
        self.tree_mask = self.buffer[o[6]:o[6] + 2 * T].view(torch.int64)  # [T]
        # what the header holds with no step in it: no tokens, nothing written or read, masks causal
        self.empty_header = np.zeros(self.header_len, dtype=np.int32)
        self.empty_header[o[2]:o[3]] = -1
        self.empty_header[o[6]:o[7]] = -1
        self.pin = device.type == "cuda"

    def pack(self, ids, positions, slots, logits_rows, query_start_loc, seq_lens,
             table: np.ndarray, tree_mask: np.ndarray | None = None) -> torch.Tensor:
        """A host buffer (pinned on CUDA) holding one step in this layout: header, then the table
        [B, W] compact. Entries past the step are the empty values (padding)."""
        B, W = table.shape
        host = torch.empty(self.header_len + B * W, dtype=torch.int32, pin_memory=self.pin)
        h = host.numpy()
        h[:self.header_len] = self.empty_header
        o = self.offsets
        T, B_ = len(ids), len(seq_lens)
        h[o[0]:o[0] + T] = ids
        h[o[1]:o[1] + T] = positions
        h[o[2]:o[2] + T] = slots
        h[o[3]:o[3] + len(logits_rows)] = logits_rows
        h[o[4]:o[4] + B_ + 1] = query_start_loc
        h[o[4] + B_ + 1:o[5]] = T  # padded sequences start (and end) after the last real token
        h[o[5]:o[5] + B_] = seq_lens
        if tree_mask is not None:
            h[o[6]:o[6] + 2 * T] = np.ascontiguousarray(tree_mask, dtype=np.int64).view(np.int32)
        h[self.header_len:] = table.reshape(-1)
        return host

    def upload(self, host: torch.Tensor, num_seqs: int, width: int) -> None:
        n = host.numel()
        self.buffer[:n].copy_(host, non_blocking=True)
        staged = self.buffer[self.header_len:n].view(num_seqs, width)
        self.block_tables[:num_seqs, :width].copy_(staged)


class DecodeGraphs:
    """Captured steps by GraphKey. `step(key)` runs the forward on the static buffers and returns
    the logits of all key.tokens rows; a key is captured ahead (`capture_empty`, at warmup) or on
    its `capture_after`-th step, the ones before it eager (the run before the capture, which
    compiles kernels, is that step's result). A key that a captured one covers (`cover`) replays
    that one until its `capture_covered_after`-th step instead. `split(key)`, where given, runs a
    step of a key without its own graph another way than eagerly (the model runner's piecewise
    graphs: the step's logits, or None where it cannot take the key); a key it takes is captured
    only on its `capture_split_after`-th step, the ones before it split. With `capture=False` (CPU
    tests) every run is eager through the same static buffers.

    Capture shares the GPU with the KV transport's threads (NCCL sends and receives, gathers and
    scatters on their own streams), so it must neither wait for them nor be invalidated by them:
    it runs on a side stream ordered after the current one only (no device-wide synchronize, which
    would wait for a posted receive whose sender has not started), in "thread_local" mode (another
    thread's CUDA calls do not invalidate it), and without torch.cuda.graph's empty_cache. A
    capture that fails anyway leaves that step eager and is tried again on a later step of the
    shape; only `max_failures` failures in all turn capturing off."""

    def __init__(self, step: Callable[[GraphKey], torch.Tensor], *, capture: bool, max_graphs: int = 256,
                 max_failures: int = 8, capture_after: int = 2, cover_waste: float = 2.0,
                 capture_covered_after: int = 32,
                 split: Callable[[GraphKey], torch.Tensor | None] | None = None, capture_split_after: int = 2):
        self.step = step
        self.capture = capture
        # a key warmup did not capture is captured on its capture_after-th step; the steps before
        # run eagerly through the same static buffers (serving meets shapes once: verify widths x
        # context buckets x batch buckets)
        self.capture_after = max(1, capture_after)
        # a key without its graph that `split` takes runs there (a piecewise step costs a fraction
        # of an eager one) and is captured on its capture_split_after-th step (at least
        # capture_after): later captures trade each capture's stall for steps slower than replays
        self.split = split
        self.capture_split_after = max(self.capture_after, capture_split_after)
        self.split_runs = 0     # steps of keys not (yet) captured, run by `split`
        # a key not captured yet runs padded on a captured one that covers it (`cover`: the same
        # context plan and tree flag, at least its sequences, tokens and longest query, at most
        # cover_waste times its tokens) instead of eagerly, and is captured itself only on its
        # capture_covered_after-th step. llama3-8b on the H200 (bench/step_profile.py --captures):
        # a replay 5-8 ms, a shape's eager step 17-26 ms and the step that captures it 17-35 ms
        # (50-66 ms in the served runs); h200-colocated-10 met ~50 shapes after warmup per rate
        self.cover_waste = cover_waste
        self.capture_covered_after = max(1, capture_covered_after)
        self._covers: dict[GraphKey, GraphKey | None] = {}  # for _covers_of graphs (only ever added)
        self._covers_of = 0
        self._seen: dict[GraphKey, int] = {}
        self.eager_runs = 0     # steps of keys not (yet) captured, run eagerly
        self.covered_runs = 0   # steps of keys not (yet) captured, replayed on a covering graph
        self.max_graphs = max_graphs
        self.max_failures = max_failures
        self.graphs: dict[GraphKey, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        self._stream = None  # the side stream captures run on (made on first capture)
        self.replays = 0
        self.captures = 0
        self.capture_failures = 0
        self.capture_s = 0.0  # time spent capturing (the eager run before each included)
        self.last_failure: str | None = None
        self.failed: str | None = None  # why capturing stopped, if it did

    def can_run(self, key: GraphKey) -> bool:
        return self.failed is None and (key in self.graphs or len(self.graphs) < self.max_graphs
                                        or self.cover(key) is not None)

    def run(self, key: GraphKey) -> torch.Tensor:
        if not self.capture:
            self.replays += 1
            return self.step(key)
        entry = self.graphs.get(key)
        if entry is None:
            seen = self._seen[key] = self._seen.get(key, 0) + 1
            full = len(self.graphs) >= self.max_graphs
            cover = self.cover(key) if seen < self.capture_covered_after or full else None
            if cover is not None:
                self.covered_runs += 1
                entry = self.graphs[cover]
            else:
                if self.split is not None and seen < self.capture_split_after:
                    out = self.split(key)
                    if out is not None:
                        self.split_runs += 1
                        return out
                if seen < self.capture_after:
                    self.eager_runs += 1
                    return self.step(key)
                return self._capture(key)
        entry[0].replay()
        self.replays += 1
        return entry[1]

    def cover(self, key: GraphKey) -> GraphKey | None:
        """The captured key a step of `key` can replay padded on, or None: the same context plan
        and tree flag, at least its sequences, tokens and longest query (padding as a bucket pads:
        the extra sequences have no tokens, the extra tokens write no KV and their logits rows are
        not read), and at most cover_waste times its tokens; the fewest tokens, then sequences."""
        if self._covers_of != len(self.graphs):
            self._covers.clear()
            self._covers_of = len(self.graphs)
        if key in self._covers:
            return self._covers[key]
        fits = [k for k in self.graphs if k.context == key.context and k.tree == key.tree
                and k.batch >= key.batch and k.query_len >= key.query_len
                and key.tokens <= k.tokens <= self.cover_waste * key.tokens]
        self._covers[key] = min(fits, key=lambda k: (k.tokens, k.batch, k.query_len), default=None)
        return self._covers[key]

    def _capture(self, key: GraphKey) -> torch.Tensor:
        t0 = time.perf_counter()
        result = self.step(key)  # eager: compiles the Triton kernels, and is this step's output
        current = torch.cuda.current_stream()
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        self._stream.wait_stream(current)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.stream(self._stream), collector_paused():
                graph.capture_begin(pool=self.pool, capture_error_mode="thread_local")
                try:
                    out = self.step(key)
                finally:
                    graph.capture_end()
        except Exception as e:  # noqa: BLE001 - this step ran eagerly; try the shape again later
            current.wait_stream(self._stream)
            self.capture_failures += 1
            self.last_failure = f"{key}: {type(e).__name__}: {e}"[:500]
            if self.capture_failures >= self.max_failures:
                self.failed = self.last_failure
                log.warning("CUDA graph capture failed %d times; running eagerly from now on. Last: %s",
                            self.capture_failures, self.last_failure)
            else:
                log.warning("CUDA graph capture failed (%d of %d allowed); that step ran eagerly: %s",
                            self.capture_failures, self.max_failures, self.last_failure)
            self.capture_s += time.perf_counter() - t0
            return result
        current.wait_stream(self._stream)
        self.graphs[key] = (graph, out)
        self.captures += 1
        self.capture_s += time.perf_counter() - t0
        return result

    def capture_empty(self, key: GraphKey) -> None:
        """Capture `key` ahead of any step (the static buffers must hold the empty header)."""
        if self.capture and key not in self.graphs and self.can_run(key):
            self._capture(key)
