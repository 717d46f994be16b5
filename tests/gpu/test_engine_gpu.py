"""The engine's GPU path (Triton kernels, fused norms/rotary/SwiGLU, CUDA graphs) end to end.

- fp32: greedy generation on the GPU (graphs, padding to captured batch sizes, chunked prefill
  mixed with decode, speculative verification with 1 + k query tokens) gives exactly the CPU
  reference path's tokens on smollm2-135m-random; so does the torch reference path on the GPU.
- bf16: a graph replay gives the eager Triton path's logits (rel. error < 2e-2: a padded batch
  may get other GEMM kernels, so bf16 rounding differs), and is within 5e-2 relative (||out - ref|| / ||ref||) of the torch reference path on the
  same bf16 weights and cache: bf16 rounding in 30 layers, at different points in each path.
"""

from __future__ import annotations

import copy

import pytest
import torch

from tandem.engine.config import CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig
from tandem.engine.engine import LLMEngine
from tandem.engine.model import TorchOps
from tandem.engine.weights import load_model
from tandem.wire.messages import SamplingParams

MODEL = "smollm2-135m-random"


@pytest.fixture(scope="module")
def cpu_model():
    model, tok, _ = load_model(MODEL, "float32", "cpu", seed=7)
    return model, tok


def prompts(vocab: int):
    gen = torch.Generator().manual_seed(3)
    out = [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in (5, 40, 300, 17, 129, 64, 3)]
    motif = torch.randint(3, vocab, (6,), generator=gen).tolist()
    out.append(motif * 12)  # repeats: n-gram drafts get accepted
    return out


def run(model, tok, device, spec=False, ops=None, setup=None):
    model = copy.deepcopy(model).to(device)
    model.ops = ops
    cfg = EngineConfig(model="test", device=device,
                       cache=CacheConfig(block_size=16, num_blocks=512),
                       scheduler=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=160),
                       speculative=SpeculativeConfig(method="ngram", num_tokens=4, min_n=2, max_n=4)
                       if spec else SpeculativeConfig())
    e = LLMEngine(cfg, model=model, tokenizer=tok)
    if setup is not None:
        setup(e)
    ps = prompts(model.config.vocab_size)
    reqs = [{"prompt_token_ids": p, "max_tokens": 20 + 3 * i, "ignore_eos": True} for i, p in enumerate(ps)]
    out = e.generate(reqs, arrivals=[0, 0, 1, 2, 2, 5, 9, 9])
    return [r["token_ids"] for r in out], e


@pytest.fixture(scope="module")
def cpu_tokens(cpu_model):
    tokens, _ = run(*cpu_model, "cpu")
    return tokens


def test_gpu_graph_path_greedy_matches_cpu_fp32(cpu_model, cpu_tokens):
    tokens, e = run(*cpu_model, "cuda")
    stats = e.runner.graph_stats
    assert stats["failed"] is None, stats
    assert stats["captures"] > 0 and stats["replays"] > 0, stats
    assert tokens == cpu_tokens


def test_gpu_speculative_graph_path_greedy_matches_cpu_fp32(cpu_model, cpu_tokens):
    # each verify shape recurs too few times here to be captured after the piecewise graphs ran it
    # (ModelRunner.SPLIT_CAPTURE_AFTER; tests/gpu/test_piecewise_gpu.py checks that path): the
    # eager-then-capture policy, so that replayed verify graphs are what this checks
    tokens, e = run(*cpu_model, "cuda", spec=True, setup=lambda e: setattr(e.runner.graphs, "split", None))
    assert e.stats.accepted_draft_tokens > 0
    assert e.runner.graph_stats["replays"] > 0
    assert tokens == cpu_tokens


def test_gpu_speculative_steps_replayed_on_covering_graphs_match_cpu_fp32(cpu_model, cpu_tokens):
    """Verify steps whose shape no graph was captured for replay a captured larger one, padded
    (DecodeGraphs.cover), instead of an eager step and a capture: the same greedy tokens."""
    from tandem.engine.cuda_graphs import graph_key

    def covering_graphs(e):
        r, g = e.runner, e.runner.graphs
        g.cover_waste, g.capture_covered_after = 64.0, 10 ** 6  # covered whenever a graph covers
        r.capture_graphs(all_contexts=True)  # the decode graphs warmup captures (empty header)
        for ctx in (256, 512, 1024):  # a verify graph of 8 sequences x 8 tokens per context plan
            g.capture_empty(graph_key([8] * 8, ctx, batch_sizes=r.batch_sizes, token_sizes=r.token_sizes,
                                      max_context=r.static.max_blocks * r.block_size, splits=r._splits))

    tokens, e = run(*cpu_model, "cuda", spec=True, setup=covering_graphs)
    stats = e.runner.graph_stats
    assert stats["failed"] is None and stats["covered_runs"] > 0, stats
    assert e.stats.accepted_draft_tokens > 0
    assert tokens == cpu_tokens


def test_gpu_torch_reference_path_greedy_matches_cpu_fp32(cpu_model, cpu_tokens):
    tokens, e = run(*cpu_model, "cuda", ops=TorchOps())
    assert e.runner.graph_stats["replays"] == 0  # graphs need the Triton ops
    assert tokens == cpu_tokens


def rel_err(out, ref):
    assert torch.isfinite(out).all()
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


@torch.inference_mode()
def test_bf16_graph_logits_match_eager_and_reference():
    model, tok, _ = load_model(MODEL, "bfloat16", "cuda", seed=7)
    e = LLMEngine(EngineConfig(model="test", device="cuda", cache=CacheConfig(num_blocks=256)),
                  model=model, tokenizer=tok)
    gen = torch.Generator().manual_seed(5)
    for i in range(5):  # 5 sequences: padded to the batch-8 graph
        e.add_request(f"r{i}", prompt_token_ids=torch.randint(3, 4000, (50 + 37 * i,), generator=gen).tolist(),
                      sampling=SamplingParams(max_tokens=8, ignore_eos=True))
    e.step()  # prefill
    e.step()  # first decode step: captures
    e.settle()  # the overlapped step's tokens on the host: the next batch's inputs are all known
    sched = e.scheduler.schedule()
    batch = e.runner.prepare(sched)
    assert batch.graph_key is not None and batch.graph_key.batch == 8
    graph = e.runner.execute(batch)
    eager = e.runner.execute(batch, layer_done=lambda layer: None)  # a per-layer callback: eager
    model.ops = TorchOps()
    reference = e.runner.execute(batch, layer_done=lambda layer: None)
    model.ops = None
    assert graph.shape == (5, model.config.vocab_size)
    assert rel_err(graph, eager) < 2e-2  # cuBLAS may pick other kernels for 8 rows than for 5
    err = rel_err(graph, reference)
    print(f"bf16 graph vs torch reference: rel. error {err:.2e}")
    assert err < 5e-2
    for r in list(e.scheduler.requests):
        e.abort(r)


@torch.inference_mode()
def test_capture_up_front_then_replay():
    model, tok, _ = load_model(MODEL, "bfloat16", "cuda", seed=7)
    e = LLMEngine(EngineConfig(model="test", device="cuda", cache=CacheConfig(num_blocks=256)),
                  model=model, tokenizer=tok)
    assert e.runner.capture_graphs((1, 2, 4), context_len=256) == 3
    out = e.generate([{"prompt_token_ids": list(range(10, 60)), "max_tokens": 6, "ignore_eos": True},
                      {"prompt_token_ids": list(range(70, 90)), "max_tokens": 6, "ignore_eos": True}])
    assert all(len(r["token_ids"]) == 6 for r in out)
    assert e.runner.graph_stats["captures"] == 3  # batch 2 decode reused the graph captured up front


def test_capture_while_another_thread_uses_the_gpu():
    """The decode actor captures graphs lazily while its KV transport threads copy on their own
    streams and poll events (what NCCL receives and scatters do). Capture must not be invalidated
    by them (it was, with the default "global" capture mode, and the actor then ran eagerly at
    ~2-3x the step time), and the graphs must still give the eager path's tokens."""
    import threading

    model, tok, _ = load_model(MODEL, "float32", "cuda", seed=7)  # fp32: graph and eager tokens agree exactly
    e = LLMEngine(EngineConfig(model="test", device="cuda", cache=CacheConfig(num_blocks=512)),
                  model=model, tokenizer=tok)
    stop = threading.Event()
    copies = [0]

    def transport():
        s = torch.cuda.Stream()
        src = torch.randn(4 << 20, device="cuda")
        while not stop.is_set():
            with torch.cuda.stream(s):
                dst = torch.empty_like(src)   # allocations from this thread, too
                dst.copy_(src)
                ev = torch.cuda.Event()
                ev.record(s)
            while not ev.query():
                pass
            s.synchronize()
            copies[0] += 1

    t = threading.Thread(target=transport, daemon=True)
    t.start()
    try:
        reqs = [{"prompt_token_ids": list(range(10 + i, 200 + 37 * i)), "max_tokens": 24, "ignore_eos": True}
                for i in range(6)]
        got = e.generate(reqs)
        assert e.runner.capture_graphs((1, 2, 4, 8, 16), context_len=1024) >= 1
    finally:
        stop.set()
        t.join(10)
    stats = e.runner.graph_stats
    assert copies[0] > 0
    assert stats["capture_failures"] == 0 and stats["failed"] is None, stats
    assert stats["captures"] >= 3 and stats["replays"] > 0, stats
    eager = LLMEngine(EngineConfig(model="test", device="cuda", cache=CacheConfig(num_blocks=512)),
                      model=model, tokenizer=tok)
    eager.runner.graphs = None
    want = eager.generate(reqs)
    assert [r["token_ids"] for r in got] == [r["token_ids"] for r in want]


def test_warmup_compiles_and_captures_before_serving():
    model, tok, _ = load_model(MODEL, "bfloat16", "cuda", seed=7)
    e = LLMEngine(EngineConfig(model="test", device="cuda", cache=CacheConfig(num_blocks=2048),
                               speculative=SpeculativeConfig(method="ngram", num_tokens=3)),
                  model=model, tokenizer=tok)
    assert e.wants_warmup
    report = e.warmup()
    assert report["captures"] >= 3 and report["capture_failures"] == 0, report
    captured = e.runner.graph_stats["captures"]
    e.generate([{"prompt_token_ids": list(range(10, 400)), "max_tokens": 8, "ignore_eos": True}])
    assert e.runner.graph_stats["captures"] - captured <= 2, e.runner.graph_stats  # few new shapes


def test_serving_after_warmup_compiles_no_kernel():
    """Mixed batches of any sizes (prefill chunks beside decode and verify rows, odd token and
    sequence counts, cached prefixes) run only kernel variants warmup compiled: a compile inside
    a step stalls every sequence in it for a second or more (the two-GPU serving run had 26 in
    20 s, from metadata packed at offsets that changed the pointers' alignment)."""
    from tandem.engine.kernels.compile_watch import watch

    model, tok, _ = load_model(MODEL, "bfloat16", "cuda", seed=7)
    e = LLMEngine(EngineConfig(model="test", device="cuda", cache=CacheConfig(num_blocks=2048),
                               speculative=SpeculativeConfig(method="ngram", num_tokens=3)),
                  model=model, tokenizer=tok)
    e.warmup()
    late = watch.late
    rng = torch.Generator().manual_seed(3)
    lengths = (37, 390, 1001, 5, 77, 263, 130, 19, 611, 2)
    prompts = [torch.randint(10, 1000, (n,), generator=rng).tolist() for n in lengths]
    prompts.append(prompts[1] + prompts[3] + prompts[0])          # extends a cached prefix
    reqs = [{"prompt_token_ids": p, "max_tokens": 9 + i % 5, "ignore_eos": True} for i, p in enumerate(prompts)]
    e.generate(reqs, arrivals=[0, 0, 1, 2, 3, 5, 6, 6, 8, 9, 11])
    assert watch.late == late, f"{watch.late - late} kernel compiles while serving; last: {watch.last_late}"


def test_a_capture_survives_a_collection_that_frees_an_old_graph():
    """With the collector run at every allocation (threshold 1), graphs dropped in reference cycles
    are freed as soon as it runs: inside collector_paused (as the engine captures) a capture after
    each drop succeeds and replays. Without the pause the collection ran inside the capture and
    invalidated it (an H100 benchmark, 2026-12-05: eight failed captures in a row)."""
    import gc

    from tandem.engine.cuda_graphs import collector_paused

    x = torch.ones(8, device="cuda")
    threshold = gc.get_threshold()
    gc.collect()
    gc.set_threshold(1)
    try:
        for i in range(3):
            old = torch.cuda.CUDAGraph()
            with torch.cuda.graph(old):
                x.mul(3)
            cycle = {"graph": old}
            cycle["self"] = cycle
            del old, cycle
            graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream), collector_paused():
                graph.capture_begin(capture_error_mode="thread_local")
                try:
                    y = x * (i + 2)
                    _ = [{"k": [j]} for j in range(100)]  # allocations that would run the collector
                finally:
                    graph.capture_end()
            torch.cuda.current_stream().wait_stream(stream)
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(y, torch.full((8,), float(i + 2), device="cuda"))
    finally:
        gc.set_threshold(*threshold)
