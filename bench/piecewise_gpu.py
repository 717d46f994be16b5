"""Prefill chunks and mixed steps: eager against piecewise CUDA graphs (engine.piecewise_graphs).

A coding agent's later turn prefills a few hundred new tokens over a cached prefix of thousands,
often in the same step as other sessions' decodes. For each (new tokens, decoding sequences) row,
llama3-8b-random bf16 on one GPU (tiny-random fp32 on the CPU with --dry-run), through
`LLMEngine.step` with the overlap off: `--decodes` sequences decode, then a request whose first
`--prefix` tokens are cached arrives and its chunk runs in the next step. That step's wall time
(synchronized before and after) is timed `--reps` times with a fresh chunk each time, with the
piecewise graphs off (every such step eager, as before) and on, interleaved; the table prints the
medians and their ratio, and the same-run floor: the step's weights and KV read at the device
copy rate, and its FLOPs at the bf16 matmul rate (both measured here), whichever is longer.

    cd bench && python3 piecewise_gpu.py [--new 32,128,256,512] [--decodes 0,16] [--prefill-split on] [--dry-run]

`--uncaptured 1,8,32,64,128`: decode-only steps of a shape whose CUDA graph is not captured, at
each batch (1k-token prompts), timed four ways: eagerly (the policy before), on the piecewise
graphs (`DecodeGraphs.split`, the default now), the step that captures the shape, and the replay
of its own graph; medians, and how many steps on the piecewise graphs cost one capture's stall
beyond a replay (what `model_runner.SPLIT_CAPTURE_AFTER` trades). `--decode-check`: whether holding every
piecewise bucket slows the decode steps.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time

import torch
from engine_gpu import Bench  # sibling files: bench scripts run as files

from tandem.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from tandem.engine.engine import LLMEngine
from tandem.engine.model import TritonOps
from tandem.engine.model_runner import ModelRunner
from tandem.engine.weights import load_model
from tandem.wire.messages import SamplingParams


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize()


def chunk_step(e, rng, vocab, prefix, new: int) -> float:
    """Seconds of the step that computes `new` tokens over the cached `prefix` (the decoding
    sequences ride along)."""
    ids = prefix + [rng.randrange(3, vocab) for _ in range(new)]
    req = e.add_request(prompt_token_ids=ids, sampling=SamplingParams(max_tokens=1, ignore_eos=True))
    sync(e.kv_cache.device)
    t0 = time.perf_counter()
    e.step()
    sync(e.kv_cache.device)
    dt = time.perf_counter() - t0
    if req.num_computed_tokens < len(ids):
        raise RuntimeError(f"the chunk of {new} tokens did not fit one step ({req.num_computed_tokens} computed)")
    while req.request_id in e.scheduler.requests:
        e.step()
    return dt


def build(args):
    """-> (engine, its piecewise graphs, the model name and dtype)."""
    dry = args.dry_run
    dev = torch.device("cpu" if dry else "cuda")
    name, dtype = ("tiny-random", "float32") if dry else (args.model, "bfloat16")
    model, tok, _ = load_model(name, dtype, str(dev), seed=0)
    if dry:
        model.ops = TritonOps()
    cfg = EngineConfig(model="bench", device=str(dev), cache=CacheConfig(num_blocks=6144 if not dry else 128),
                       scheduler=SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=2048))
    e = LLMEngine(cfg, model=model, tokenizer=tok)
    e.overlap = False
    if dry:
        e.runner = ModelRunner(model, e.kv_cache, "cpu", cuda_graphs=True, capture=False,
                               graph_batch_sizes=(1, 2, 4, 8, 16), max_graph_tokens=64)
    pw = e.runner.piecewise
    if pw is None or pw.why_not:
        raise SystemExit(f"no piecewise graphs for {name}: {pw and pw.why_not}")
    return e, pw, name, dtype


def decode_alongside(e, rng, d: int, prompt: int) -> None:
    """Start d sequences decoding (prompt tokens each) and step until all of them decode."""
    vocab = e.model_config.vocab_size
    for _ in range(d):
        e.add_request(prompt_token_ids=[rng.randrange(3, vocab) for _ in range(prompt)],
                      sampling=SamplingParams(max_tokens=min(1000, e.max_model_len - prompt), ignore_eos=True))
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in e.scheduler.running) or e.scheduler.waiting:
        e.step()


def timed(e, pw, rng, prefix, new: int, reps: int) -> tuple[float, float]:
    """Median seconds of the chunk's step, eager and piecewise, interleaved (a first untimed run
    of each compiles and captures)."""
    times = {"eager": [], "piecewise": []}
    for rep in range(reps + 1):
        for mode in times:
            e.runner.piecewise = pw if mode == "piecewise" else None
            dt = chunk_step(e, rng, e.model_config.vocab_size, prefix, new)
            if rep:
                times[mode].append(dt)
    e.runner.piecewise = pw
    return statistics.median(times["eager"]), statistics.median(times["piecewise"])


def decode_steps(e, rng, batch: int, steps: int = 40) -> float:
    """Median seconds of a decode-only step (a decode graph replay) at `batch` sequences."""
    decode_alongside(e, rng, batch, 1024 if e.kv_cache.device.type == "cuda" else 20)
    times = []
    for _ in range(steps):
        sync(e.kv_cache.device)
        t0 = time.perf_counter()
        e.step()
        sync(e.kv_cache.device)
        times.append(time.perf_counter() - t0)
    for r in list(e.scheduler.requests):
        e.abort(r)
    while e.has_unfinished():
        e.step()
    return statistics.median(times[5:])


def decode_check(e, pw, batches=(1, 16, 64), rounds: int = 3) -> None:
    """Whether holding the piecewise graphs slows decode steps: two engines on the same weights
    in one process, one with every bucket captured and one with none, their decode-only steps
    timed in turn."""
    other = LLMEngine(e.config, model=e.model, tokenizer=e.tokenizer)
    other.overlap = False
    other.runner.piecewise = None
    if e.kv_cache.device.type != "cuda":
        other.runner = ModelRunner(e.model, other.kv_cache, "cpu", cuda_graphs=True, capture=False,
                                   graph_batch_sizes=(1, 2, 4, 8, 16), max_graph_tokens=64, piecewise=False)
    captured = pw.capture_all()
    rng = random.Random(1)
    rows = {b: {"without": [], "with": []} for b in batches}
    for _ in range(rounds):
        for mode, engine in (("without", other), ("with", e)):
            for b in batches:
                rows[b][mode].append(decode_steps(engine, rng, b))
    print(f"piecewise buckets captured: {captured}; {pw.stats}")
    print("| decoding | step ms, no piecewise graphs held | every bucket captured | ratio |")
    print("|---:|---:|---:|---:|")
    for b, r in rows.items():
        a, w = statistics.median(r["without"]), statistics.median(r["with"])
        print(f"| {b} | {a * 1e3:.3f} | {w * 1e3:.3f} | {w / a:.3f} |")


def uncaptured(e, batches, steps: int = 9, captures: int = 3) -> None:
    """Decode-only steps at each batch while their shape has no graph: eager, split (on the
    piecewise graphs), capturing, and replaying the graph, each timed in its own run of steps."""
    from tandem.engine.model_runner import SPLIT_CAPTURE_AFTER  # noqa: PLC0415

    g, runner, dev = e.runner.graphs, e.runner, e.kv_cache.device
    rng = random.Random(3)
    kept = []   # graphs set aside, never freed: freeing one and capturing again trips PyTorch's allocator

    def fresh(split, capture_after, capture_split_after):
        kept.append(dict(g.graphs))
        g.graphs.clear()
        g._seen.clear()
        g._covers_of = -1
        g.split, g.capture_after, g.capture_split_after = split, capture_after, capture_split_after

    def run(n: int) -> list[float]:
        out = []
        for _ in range(n):
            sync(dev)
            t0 = time.perf_counter()
            e.step()
            sync(dev)
            out.append(time.perf_counter() - t0)
        return out

    never = 1 << 30
    rows = []
    for b in batches:
        decode_alongside(e, rng, b, 1024 if dev.type == "cuda" else 20)
        before = dict(runner.graph_stats)
        fresh(None, never, never)
        eager = run(steps)
        fresh(runner._split_step, never, never)
        run(1)                                  # the attention's first launch at this shape compiles
        split = run(steps)
        capture = []
        for _ in range(captures):
            fresh(None, 1, 1)
            capture += run(1)
        replay = run(steps)
        after = runner.graph_stats
        ran = {k: after[k] - before[k] for k in ("eager_runs", "split_runs", "captures", "replays")}
        rows.append((b, *(statistics.median(x) for x in (eager, split, capture, replay)), ran))
        print(f"batch {b}: {ran}", flush=True)
        for r in list(e.scheduler.requests):
            e.abort(r)
        while e.has_unfinished():
            e.step()
    fresh(runner._split_step, 2, SPLIT_CAPTURE_AFTER)
    if g.failed or g.capture_failures:
        print(f"captures failed ({g.capture_failures}): {g.last_failure}; the capture and replay columns are not")
    print(f"\n{e.config.model} decode-only steps of an uncaptured shape, 1k prompts, medians "
          f"({steps} steps; {captures} captures)")
    _uncaptured_table(rows)


def _uncaptured_table(rows) -> None:
    print("| batch | eager ms | piecewise ms | piecewise / eager | capturing step ms | replay ms | "
          "piecewise steps costing one capture |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for b, ea, sp, ca, re, _ in rows:
        extra = sp - re
        print(f"| {b} | {ea * 1e3:.2f} | {sp * 1e3:.2f} | {sp / ea:.2f} | {ca * 1e3:.1f} | {re * 1e3:.2f} | "
              f"{(ca - re) / extra if extra > 0 else float('inf'):.1f} |")


def _args():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="llama3-8b-random")
    ap.add_argument("--new", default="32,128,256,512")
    ap.add_argument("--decodes", default="0,16")
    ap.add_argument("--prefix", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--decode-check", action="store_true", help="only: decode steps with and without the graphs held")
    ap.add_argument("--uncaptured", default="", help="only: decode steps of uncaptured shapes at these batches")
    ap.add_argument("--prefill-split", choices=("on", "off"), default="off",
                    help="split the prefill attention's keys (SplitPolicy.prefill_split)")
    return ap.parse_args()


def main():
    args = _args()
    if args.dry_run:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from tandem.engine.kernels.attention_split import set_split_policy  # noqa: PLC0415 (after TRITON_INTERPRET)

    set_split_policy(prefill_split=args.prefill_split == "on")
    e, pw, name, dtype = build(args)
    if args.decode_check:
        return decode_check(e, pw, (1, 4) if args.dry_run else (1, 16, 64), 1 if args.dry_run else 3)
    if args.uncaptured:
        batches = [int(x) for x in args.uncaptured.split(",")]
        return uncaptured(e, [min(b, 4) for b in batches[:2]] if args.dry_run else batches,
                          *((2, 1) if args.dry_run else (9, 3)))
    model = e.model
    prefix_len, decode_prompt = (48, 20) if args.dry_run else (args.prefix, 1024)
    news = [int(x) for x in args.new.split(",")]
    news = [min(n, 40) for n in news[:2]] if args.dry_run else news
    rng = random.Random(0)
    prefix = [rng.randrange(3, model.config.vocab_size) for _ in range(prefix_len)]
    e.generate([{"prompt_token_ids": prefix, "max_tokens": 2, "ignore_eos": True}])   # cached from here on
    bench = Bench(args.dry_run, "/tmp")     # the copy and matmul rates, as the engine benchmarks measure them
    bench.ceilings()
    ceil = bench.results["ceilings"]
    copy_bps, mm = ceil["copy_gbs"] * 1e9, ceil["matmul_tflops"] * 1e12
    weights = [p for n_, p in model.named_parameters() if "embed" not in n_]
    weight_bytes, params = sum(p.numel() * p.element_size() for p in weights), sum(p.numel() for p in weights)
    c = model.config
    kv_per_token = 2 * c.num_layers * c.num_kv_heads * c.head_dim * model.embed_tokens.weight.element_size()
    rows = []
    for d in [int(x) for x in args.decodes.split(",")]:
        decode_alongside(e, rng, d, decode_prompt)
        for new in news:
            eager, piece = timed(e, pw, rng, prefix, new, args.reps)
            kv = ((prefix_len + new) + d * (decode_prompt + 64)) * kv_per_token
            floor = max((weight_bytes + kv) / copy_bps, 2 * (new + d) * params / mm)
            rows.append((new, d, eager, piece, floor))
            print(f"new {new:4d} decodes {d:3d}: eager {eager * 1e3:7.2f} ms  piecewise {piece * 1e3:7.2f} ms",
                  flush=True)
        for r in list(e.scheduler.requests):
            e.abort(r)
        while e.has_unfinished():
            e.step()
    print(f"\n{name} {dtype}, prefix {prefix_len} cached, medians of {args.reps}; copy {copy_bps / 1e9:.0f} GB/s "
          f"(read + write), matmul {mm / 1e12:.0f} TFLOP/s; stats {e.runner.graph_stats}")
    print("| new tokens | decoding | eager ms | piecewise ms | piecewise / eager | floor ms | piecewise / floor |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for new, d, eager, piece, floor in rows:
        print(f"| {new} | {d} | {eager * 1e3:.2f} | {piece * 1e3:.2f} | {piece / eager:.2f} | {floor * 1e3:.2f} | "
              f"{piece / floor:.2f} |")


if __name__ == "__main__":
    main()
