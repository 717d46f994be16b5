"""What verifying a draft tree costs on a GPU, against a plain decode step measured in the same run.

`llama3-8b-random` in bf16 (default), ~1k tokens of synthetic context per sequence (blocks
reserved, KV not computed: no timing changes), timing `runner.execute` as the engine calls it
(CUDA graphs where it captures the shape: up to 16 query rows per sequence and 512 tokens a step;
eager past that) with CUDA events. Per batch size: the decode step (1 query row per sequence),
then per tree size N (query rows per sequence: the root + N - 1 draft nodes, a binary tree under
the root's first child) the tree-verify step, and a chain of the same N rows (the causal kernels,
no tree mask) for the mask's own cost.

The projected speedup of tree speculation at (batch, N): tokens per verify step measured on the
CPU with tree drafts (`--tokens-per-step`, bench/speculative.py's suffix-tree row) x decode step /
tree-verify step, i.e. as if every sequence verified a tree of N rows each step with that yield.
Drafting (suffix lookup, a few tens of microseconds of host time a step) is not counted.

    python -m bench.spec_tree_gpu [--device cpu --model tiny-random]   # cpu: a smoke test
"""

from __future__ import annotations

import argparse
import time

import torch

from tandem.engine.config import CacheConfig, EngineConfig
from tandem.engine.engine import LLMEngine
from tandem.engine.request import Request
from tandem.engine.scheduler import ScheduledRequest, SchedulerOutput


def binary_tree(n: int) -> list[int]:
    """Parents of n nodes: node 0 the root's child, node i under node (i - 1) // 2."""
    return [-1] + [(i - 1) // 2 for i in range(1, n)]


def time_ms(fn, iters: int, warmup: int, cuda: bool) -> float:
    for _ in range(warmup):
        fn()
    if not cuda:
        t = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - t) * 1000 / iters
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def step_costs(engine: LLMEngine, args) -> dict[tuple[int, str, int], tuple[float, bool]]:
    """(batch, "decode" | "tree" | "chain", rows) -> (ms per step, whether a CUDA graph ran it)."""
    runner, alloc = engine.runner, engine.allocator
    vocab, ctx, cuda = engine.model_config.vocab_size, args.context, args.device.startswith("cuda")
    gen = torch.Generator().manual_seed(0)
    out: dict[tuple[int, str, int], tuple[float, bool]] = {}
    for B in args.batch_sizes:
        reqs = []
        for b in range(B):
            r = Request(f"b{B}-{b}", torch.randint(0, vocab, (ctx,), generator=gen).tolist())
            r.num_computed_tokens = ctx - 1  # the prompt's KV "is there": only the last token runs
            assert alloc.grow(r, max(args.tree_sizes)), "KV cache too small"
            reqs.append(r)
        shapes = [("decode", 1)] + [(kind, n) for n in args.tree_sizes for kind in ("tree", "chain")]
        for kind, n in shapes:
            sched = SchedulerOutput([ScheduledRequest(r, n, n - 1) for r in reqs])
            drafts = {r.request_id: torch.randint(0, vocab, (n - 1,), generator=gen).tolist() for r in reqs}
            trees = {r.request_id: binary_tree(n - 1) for r in reqs} if kind == "tree" else None
            batch = runner.prepare(sched, drafts, trees)
            ms = time_ms(lambda: runner.execute(batch), args.iters, args.warmup, cuda)
            out[B, kind, n] = (ms, batch.graph_key is not None)
            print(f"# batch {B} {kind} {n} rows: {ms:.2f} ms{' (graph)' if batch.graph_key else ''}", flush=True)
        for r in reqs:
            alloc.free(r)
    return out


def print_tables(costs, args) -> None:
    sizes = args.tree_sizes
    print("Tree-verify step / decode step (x), and a chain of the same rows (x); g = CUDA graph, e = eager:\n")
    print("| batch | decode ms | " + " | ".join(f"tree {n} | chain {n}" for n in sizes) + " |")
    print("|---|---|" + "---|---|" * len(sizes))
    for B in args.batch_sizes:
        dec, g = costs[B, "decode", 1]
        cells = []
        for n in sizes:
            for kind in ("tree", "chain"):
                ms, graph = costs[B, kind, n]
                cells.append(f"{ms / dec:.2f} ({'g' if graph else 'e'})")
        print(f"| {B} | {dec:.2f} ({'g' if g else 'e'}) | " + " | ".join(cells) + " |")
    print()
    for t in args.tokens_per_step:
        print(f"Projected speedup over plain decoding at {t:.2f} tokens per tree-verify step (CPU acceptance):\n")
        print("| batch | " + " | ".join(f"tree {n}" for n in sizes) + " |")
        print("|---|" + "---|" * len(sizes))
        for B in args.batch_sizes:
            dec = costs[B, "decode", 1][0]
            print(f"| {B} | " + " | ".join(f"{t * dec / costs[B, 'tree', n][0]:.2f}x" for n in sizes) + " |")
        print()


def main() -> None:
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama3-8b-random")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--batch-sizes", type=ints, default=[1, 8, 32, 64])
    p.add_argument("--tree-sizes", type=ints, default=[8, 16, 32, 64], help="query rows per sequence (<= 64)")
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--tokens-per-step", type=lambda s: [float(x) for x in s.split(",")], default=[3.0, 5.0])
    args = p.parse_args()
    if max(args.tree_sizes) > 64 or min(args.tree_sizes) < 2:
        p.error("--tree-sizes: 2..64 query rows per sequence (the root + up to 63 draft nodes)")
    bs = 16
    num_blocks = max(args.batch_sizes) * -(-(args.context + max(args.tree_sizes)) // bs) + 8
    t0 = time.perf_counter()
    engine = LLMEngine(EngineConfig(model=args.model, dtype=args.dtype, device=args.device,
                                    cache=CacheConfig(block_size=bs, num_blocks=num_blocks)))
    cuda = args.device.startswith("cuda")
    print(f"# {args.model} loaded in {time.perf_counter() - t0:.0f}s, {num_blocks} KV blocks", flush=True)
    with torch.inference_mode():
        costs = step_costs(engine, args)
    where = torch.cuda.get_device_name() if cuda else args.device
    print(f"\n{args.model}, {args.dtype}, {where}, context {args.context}, mean of {args.iters} after "
          f"{args.warmup} warm-up, runner.execute as the engine calls it\n")
    print_tables(costs, args)


if __name__ == "__main__":
    main()
