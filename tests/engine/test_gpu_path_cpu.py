"""The GPU path's host-side logic on the CPU: which steps a CUDA graph serves and how they are
padded (pure functions), and the padded static-buffer step itself, run eagerly through the Triton
kernels under the interpreter (`capture=False`): greedy tokens must equal the plain CPU path's
for staggered arrivals, chunked prefill and speculative verification (1 + k query tokens)."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tandem.engine.config import CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig
from tandem.engine.cuda_graphs import (DecodeGraphs, GraphKey, StaticInputs, capture_query_lens, graph_key, round_up,
                                token_buckets)
from tandem.engine.engine import LLMEngine

SIZES = (1, 2, 4, 8, 16, 24, 32)
TOKENS = token_buckets(SIZES, 128)


def key(query_lens, max_seq_len, splits=lambda b, c: False, max_context=4096):
    return graph_key(query_lens, max_seq_len, batch_sizes=SIZES, token_sizes=TOKENS,
                     max_context=max_context, splits=splits)


def test_token_buckets_extend_the_batch_sizes():
    assert TOKENS == (1, 2, 4, 8, 16, 24, 32, 64, 96, 128)
    assert round_up(17, SIZES) == 24 and round_up(33, SIZES) is None


def test_decode_pads_batch_and_tokens_together():
    assert key([1] * 3, 100) == GraphKey(4, 4, 1, 0)
    assert key([1] * 17, 3000) == GraphKey(24, 24, 1, 0)
    assert key([1] * 33, 10) is None  # larger than the largest batch size: eager


def test_verify_steps_pad_tokens_to_a_bucket_and_query_len_to_a_power_of_two():
    # 3 sequences verifying 1 + k = 5, 2, 1 tokens: 8 tokens, longest query 5 -> tile of 8
    assert key([5, 2, 1], 700) == GraphKey(4, 8, 8, 0)
    # token bucket capped at batch * query_len
    assert key([2, 2], 50) == GraphKey(2, 4, 2, 0)
    assert key([17], 100) is None  # past the decode kernel's query length: prefill kernel, eager
    assert key([16] * 16, 100) is None  # 256 tokens > the largest token bucket


def test_context_is_part_of_the_key_only_when_the_kernel_splits():
    splits = lambda b, c: b * 8 < 264 and c > 256  # noqa: E731 - 8 KV heads, 132 SMs
    assert key([1], 1025, splits) == GraphKey(1, 1, 1, 2048)
    assert key([1], 100, splits) == GraphKey(1, 1, 1, 0)
    assert key([1] * 32, 8000, splits, max_context=8192) == GraphKey(32, 32, 1, 8192)
    assert key([1], 5000, splits, max_context=4096) is None
    big = graph_key([1] * 40, 8000, batch_sizes=SIZES + (48,), token_sizes=TOKENS, max_context=8192,
                    splits=splits)
    assert big == GraphKey(48, 48, 1, 0)


def test_capture_query_lens_match_the_key():
    for k in (GraphKey(4, 8, 8, 0), GraphKey(8, 8, 1, 0), GraphKey(24, 64, 4, 0), GraphKey(2, 3, 2, 0)):
        lens = capture_query_lens(k)
        assert len(lens) == k.batch and sum(lens) == k.tokens and max(lens) == k.query_len


def test_static_pack_pads_with_no_op_rows():
    s = StaticInputs(max_batch=8, max_tokens=16, max_blocks=4, device=torch.device("cpu"))
    table = np.array([[3, 4], [5, 0]], dtype=np.int32)
    host = s.pack(ids=[7, 8, 9], positions=[20, 21, 5], slots=[52, 53, 80], logits_rows=[1, 2],
                  query_start_loc=[0, 2, 3], seq_lens=[22, 6], table=table)
    s.upload(host, 2, 2)
    assert s.input_ids[:4].tolist() == [7, 8, 9, 0]
    assert s.slots[:5].tolist() == [52, 53, 80, -1, -1]  # padded tokens write nothing
    assert s.query_start_loc[:5].tolist() == [0, 2, 3, 3, 3]  # padded sequences own no tokens
    assert s.seq_lens[:4].tolist() == [22, 6, 0, 0]  # ... and read nothing
    assert s.logits_rows[:3].tolist() == [1, 2, 0]
    assert s.block_tables[:2, :2].tolist() == table.tolist()


# ---- the padded static-buffer step through the Triton kernels (interpreter) ---------------------
PROMPTS = [list(range(5, 40)), [9, 8, 7, 6, 5, 4, 3] * 3, list(range(100, 117)), [11, 12, 13, 11, 12, 13, 11, 12]]


def _engine(model, tok, spec=False, graphs=False, piecewise=None):
    from tandem.engine.model import TritonOps
    from tandem.engine.model_runner import ModelRunner

    cfg = EngineConfig(model="test", cache=CacheConfig(block_size=8, num_blocks=64),
                       scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=24),
                       speculative=SpeculativeConfig(method="ngram", num_tokens=3, min_n=2, max_n=3)
                       if spec else SpeculativeConfig())
    if graphs:
        model = copy.deepcopy(model)
        model.ops = TritonOps()
    e = LLMEngine(cfg, model=model, tokenizer=tok)
    if graphs:
        e.runner = ModelRunner(model, e.kv_cache, "cpu", cuda_graphs=True, capture=False,
                               graph_batch_sizes=(1, 2, 4, 8), max_graph_tokens=32, piecewise=piecewise)
    return e


def _generate(e):
    reqs = [{"prompt_token_ids": p, "max_tokens": 6 + i, "ignore_eos": True} for i, p in enumerate(PROMPTS)]
    return [r["token_ids"] for r in e.generate(reqs, arrivals=[0, 0, 2, 3])]


@pytest.mark.parametrize("spec,overlap", [(False, False), (True, False), (False, True)],
                         ids=["decode", "speculative", "overlapped"])
def test_static_buffer_steps_match_the_cpu_path(tiny, spec, overlap):
    """overlapped: each step's input ids come from the previous step's tokens on the device
    (engine.inflight.feed_pending), written into the graphs' static buffers."""
    pytest.importorskip("triton")
    model, tok, _ = tiny
    ref = _generate(_engine(model, tok))
    e = _engine(model, tok, spec=spec, graphs=True)
    e.overlap = overlap
    assert _generate(e) == ref
    stats = e.runner.graph_stats
    assert stats["replays"] > 0, "no step went through the static buffers"
    if spec:
        assert e.stats.draft_tokens > 0, "the prompts were meant to give n-gram drafts"


def test_warmup_keys_cover_every_context_bucket_where_the_kernel_splits(tiny, monkeypatch):
    """Agents' contexts reach 8k-128k: a batch small enough that the decode kernel splits its
    contexts needs one graph per context bucket, and warmup captures them all, so serving does not
    stall a batch ~40 ms to capture one (the H200 run h200-colocated-8 traced ~200 such steps)."""
    pytest.importorskip("triton")
    model, tok, _ = tiny
    e = _engine(model, tok, graphs=True)
    keys = []
    monkeypatch.setattr(e.runner.graphs, "capture_empty", keys.append)
    monkeypatch.setattr(e.runner, "_splits", lambda b, c: b <= 4 and c > 128)   # an H200's rule, scaled down
    max_context = e.runner.static.max_blocks * e.runner.block_size
    e.runner.capture_graphs(context_len=64)
    only_64 = list(keys)
    keys.clear()
    e.runner.capture_graphs(context_len=64, all_contexts=True)
    assert set(only_64) <= set(keys) and len(keys) == len(set(keys))
    assert {k.batch for k in keys} == {1, 2, 4, 8} and all(k.query_len == 1 for k in keys)
    split = sorted({k.context for k in keys if k.context})
    assert split
    assert split[-1] == max_context and len(split) > len({k.context for k in only_64 if k.context})
    # every context a step can have maps to a key warmup captured
    for b in (1, 2, 3, 5, 8):
        for ctx in (1, 100, 257, max_context // 2 + 1, max_context):
            want = graph_key([1] * b, ctx, batch_sizes=e.runner.batch_sizes, token_sizes=e.runner.token_sizes,
                             max_context=max_context, splits=e.runner._splits)
            assert want in keys, (b, ctx, want)


class _Counting(DecodeGraphs):
    def _capture(self, key):
        self.captures += 1
        self.graphs[key] = (None, None)
        return self.step(key)


def test_a_shape_is_captured_on_its_second_step_and_runs_eagerly_before():
    ran = []
    g = _Counting(lambda key: ran.append(key) or torch.zeros(1), capture=False)
    g.capture = True                      # the policy, without a GPU: _capture only records
    a, b = GraphKey(4, 4, 1, 0), GraphKey(8, 8, 1, 0)
    g.run(a)
    assert (g.captures, g.eager_runs, ran) == (0, 1, [a])        # seen once: eager, no capture
    g.run(a)
    assert (g.captures, g.eager_runs) == (1, 1)                  # the second time: captured
    g.capture_empty(b)                                           # warmup: ahead of any step
    assert g.captures == 2 and b in g.graphs
    now = _Counting(lambda key: torch.zeros(1), capture=False, capture_after=1)
    now.capture = True
    now.run(a)
    assert (now.captures, now.eager_runs) == (1, 0)


def test_a_new_shape_replays_padded_on_a_captured_graph_that_covers_it():
    """A shape met for the first time after warmup is an eager step and then a capture, each a
    17-45 ms stall of every running sequence on the H200; one that a captured graph covers (same
    context plan and tree flag, at least its sequences, tokens and longest query, at most twice
    its tokens) replays that graph padded instead, and is captured only once it recurs often."""
    ran = []
    g = _Counting(lambda key: ran.append(key) or torch.zeros(1), capture=False, capture_covered_after=3)
    g.capture = True
    big = GraphKey(8, 16, 2, 0)
    g.graphs[big] = (SimpleNamespace(replay=lambda: ran.append(("replay", big))), torch.ones(1))
    small = GraphKey(4, 8, 2, 0)
    assert g.cover(small) == big and g.can_run(small)
    assert g.run(small).item() == 1 and ran == [("replay", big)]       # no eager step, no capture
    assert (g.covered_runs, g.eager_runs, g.captures) == (1, 0, 0)
    # not covered: too much padding (16 > 2 x 4 tokens), a longer query, another context plan or tree
    for other in (GraphKey(4, 4, 2, 0), GraphKey(4, 8, 4, 0), GraphKey(4, 8, 2, 2048), GraphKey(4, 8, 2, 0, True),
                  GraphKey(16, 16, 2, 0)):
        assert g.cover(other) is None
    ran.clear()
    g.run(GraphKey(4, 4, 2, 0))
    assert ran == [GraphKey(4, 4, 2, 0)] and g.eager_runs == 1        # the old policy: eager first
    g.run(small)
    g.run(small)                                                      # its third step: it recurs, capture it
    assert small in g.graphs and g.captures == 1 and g.covered_runs == 2
    tiny_key = GraphKey(2, 8, 2, 0)                                   # a new graph is a candidate at once
    assert g.cover(tiny_key) == small
    full = _Counting(lambda key: torch.zeros(1), capture=False, max_graphs=1, capture_covered_after=1)
    full.capture = True
    full.graphs[big] = g.graphs[big]
    assert full.can_run(small) and not full.can_run(GraphKey(16, 16, 2, 0))  # no room, no cover: eager
    full.run(small)
    assert (full.covered_runs, full.captures) == (1, 0)               # no room for its own: covered


def test_a_shape_the_split_step_takes_runs_there_and_is_captured_only_once_it_recurs():
    """With piecewise graphs a new shape's step costs a fraction of an eager one (and of the
    capture's stall), so its first capture_split_after - 1 steps run split and only a shape that
    recurs is captured; a shape the split step refuses (None) keeps the eager-then-capture policy."""
    ran, split = [], []
    takes = {GraphKey(4, 4, 1, 0)}
    g = _Counting(lambda key: ran.append(key) or torch.zeros(1), capture=False, capture_split_after=3,
                  split=lambda key: (split.append(key) or torch.ones(1)) if key in takes else None)
    g.capture = True
    a, b = GraphKey(4, 4, 1, 0), GraphKey(8, 8, 1, 0)
    assert g.run(a).item() == 1 and g.run(a).item() == 1
    assert (g.split_runs, g.eager_runs, g.captures, ran) == (2, 0, 0, [])   # split twice, nothing eager
    g.run(a)
    assert (g.split_runs, g.captures) == (2, 1) and a in g.graphs            # the third step: captured
    g.run(b)
    assert (g.eager_runs, g.captures, ran[-1]) == (1, 1, b) and split == [a, a]  # refused: eager first
    g.run(b)
    assert g.captures == 2 and b in g.graphs
    assert _Counting(lambda key: None, capture=False, capture_split_after=0).capture_split_after == 2


def test_uncaptured_shapes_on_the_piecewise_graphs_keep_the_tokens_and_are_traced(tiny, tmp_path, monkeypatch):
    """Decode and verify steps of shapes with no graph yet run on the piecewise graphs (their
    stretches around an eager attention, under the interpreter) until their capture, overlapped
    steps too: the greedy tokens stay the plain CPU path's, and the trace marks those steps as
    split, not eager."""
    pytest.importorskip("triton")
    from tandem.engine.step_trace import TRACE_ENV, read_traces

    model, tok, _ = tiny
    ref = _generate(_engine(model, tok))
    for spec, overlap in ((False, False), (True, False), (False, True)):
        trace = tmp_path / f"spec{spec}-overlap{overlap}"
        monkeypatch.setenv(TRACE_ENV, str(trace))
        e = _engine(model, tok, spec=spec, graphs=True, piecewise=True)
        e.overlap = overlap      # the input ids come from the step before's tokens on the device
        g = e.runner.graphs
        g.__class__, g.capture = _Replaying, True
        assert g.split is not None
        g.capture_split_after = 4                     # so that this short run captures some shapes too
        assert _generate(e) == ref
        assert g.split_runs > 0 and g.eager_runs == 0, (g.split_runs, g.eager_runs)
        assert e.runner.graph_stats["split_runs"] == g.split_runs
        e.trace.flush()
        steps = [s for steps in read_traces(trace) for s in steps]
        assert sum(s[11] for s in steps) == g.split_runs and not any(s[10] for s in steps)
        # no shape was captured before its capture_split_after-th step, and some recurred enough
        assert 0 < g.captures <= g.split_runs // 3


def test_the_environment_sets_or_turns_off_the_split_step(tiny, monkeypatch):
    pytest.importorskip("triton")
    from tandem.engine.model_runner import SPLIT_CAPTURE_AFTER, SPLIT_ENV

    model, tok, _ = tiny
    monkeypatch.delenv(SPLIT_ENV, raising=False)
    g = _engine(model, tok, graphs=True, piecewise=True).runner.graphs
    assert g.split is not None and g.capture_split_after == SPLIT_CAPTURE_AFTER
    monkeypatch.setenv(SPLIT_ENV, "0")
    assert _engine(model, tok, graphs=True, piecewise=True).runner.graphs.split is None   # eager, as before
    monkeypatch.setenv(SPLIT_ENV, "20")
    assert _engine(model, tok, graphs=True, piecewise=True).runner.graphs.capture_split_after == 20
    monkeypatch.setenv(SPLIT_ENV, "soon")
    with pytest.raises(ValueError, match="TANDEM_SPLIT_CAPTURE_AFTER must be a whole number"):
        _engine(model, tok, graphs=True, piecewise=True)


class _Replaying(DecodeGraphs):
    """A "graph" that replays by running the step eagerly into the captured output."""
    def _capture(self, key):
        self.captures += 1
        out = self.step(key)
        self.graphs[key] = (SimpleNamespace(replay=lambda: out.copy_(self.step(key))), out)
        return out


def test_the_step_trace_marks_the_eager_step_before_a_capture_and_the_capture(tiny, tmp_path, monkeypatch):
    """A served engine's trace says which steps ran eagerly because their graph shape was not
    captured yet, and which captured: one sequence decoding meets its shape once (eager), captures
    it on the second step, then replays it."""
    pytest.importorskip("triton")
    from tandem.engine.step_trace import TRACE_ENV, read_traces

    monkeypatch.setenv(TRACE_ENV, str(tmp_path))
    model, tok, _ = tiny
    e = _engine(model, tok, graphs=True, piecewise=False)
    g = e.runner.graphs
    g.__class__, g.capture = _Replaying, True    # the capture policy without a GPU
    e.generate([{"prompt_token_ids": list(range(5, 25)), "max_tokens": 6, "ignore_eos": True}])  # one prefill step
    e.trace.flush()
    ((*steps,),) = read_traces(tmp_path)
    decode = [s for s in steps if not s[6]]      # the prefill step is not graph-shaped
    assert [(s[9], s[10]) for s in decode] == [(False, True), (True, False)] + [(False, False)] * (len(decode) - 2)
    assert (g.eager_runs, g.captures) == (1, 1) and len(decode) >= 4


def test_speculative_steps_replayed_on_covering_graphs_match_the_cpu_path(tiny):
    """Verify steps of shapes no graph was captured for run on a larger captured shape, padded
    (emulated: the "graph" runs the covering key's padded step through the Triton kernels): the
    greedy tokens stay the plain CPU path's."""
    pytest.importorskip("triton")
    model, tok, _ = tiny
    ref = _generate(_engine(model, tok))
    e = _engine(model, tok, spec=True, graphs=True)
    g = e.runner.graphs
    g.__class__, g.capture = _Replaying, True
    g.cover_waste, g.capture_covered_after = 8.0, 1000  # every shape a covering graph serves stays covered
    e.runner.capture_graphs(context_len=64)             # decode graphs (query length 1), as warmup does
    big = GraphKey(8, 32, 4, 0)                         # and one verify graph covering smaller ones
    g.capture_empty(big)
    assert _generate(e) == ref
    assert g.covered_runs > 0, "no verify step ran on the covering graph"
