"""Where a decode step's time goes, per shape and with the overlap on and off (issue 23).

For each (batch, context) row, llama3-8b-random bf16 on one GPU (tiny-random fp32 on CPU with
--dry-run), requests join as after a KV transfer (`Bench.admit`: KV "already there") and decode
steps run through `LLMEngine.step`. Per row and mode it prints:
- step ms: wall time per step over `--steps` steps (steady state; overlapped, one step's wall is
  the launch of the next and the resolve of the one before);
- GPU busy ms per step: the union of the kernels' and copies' intervals (CUPTI, torch.profiler)
  over `--prof-steps` steps, and the idle ms (the span minus busy); the kernels a CUDA graph
  replays are recorded one by one;
- the GPU time by class (attention, GEMM, copies, other) and the top kernels;
- the host's phases (`last_step_summary()`: schedule, prepare, execute, sample, output; medians);
- fwd ms: the forward alone (the step's graph replayed back to back, CUDA events).

`--generate BxC` then breaks engine_floor's measurement (two `generate` calls, 8 and 72 output
tokens, step = the difference / 64) into its steps: how many were decode-only graph replays, how
many mixed or prefill steps, captures, and the wall time of each kind, in both calls.
`--captures BxC,...` times a decode shape met at runtime: its eager step, the step that captures
it and the replays after (medians of 3 runs, each on fresh graphs).
`--attn` times the decode attention kernel alone (replayed from a CUDA graph) at each split-K
partition size, to tune `choose_partition_size`.

    cd bench && python3 step_profile.py [--rows 1x1024,64x1024,256x1024,32x8192] [--dry-run]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
from engine_floor import _prompts, floor_engine  # sibling files: bench scripts run as files
from engine_gpu import Bench
from torch.profiler import ProfilerActivity, profile

from tandem.engine.cuda_graphs import DecodeGraphs
from tandem.engine.model import TritonOps
from tandem.engine.model_runner import ModelRunner
from tandem.engine.weights import load_model

PHASES = ("schedule", "prepare", "execute", "sample", "output")
ATTN = ("_decode_kernel", "_reduce_partitions", "_merge_partitions", "_prefill_kernel")
GEMM = ("gemm", "nvjet", "cutlass", "xmma", "cublas", "matmul", "splitk")


def kernel_class(name: str) -> str:
    n = name.lower()
    if any(a.lower() in n for a in ATTN):
        return "attention"
    if any(g in n for g in GEMM):
        return "gemm"
    if "memcpy" in n or "memset" in n:
        return "copy"
    return "other"


def device_events(prof) -> list[tuple[float, float, str]]:
    """(start us, end us, name) of every device-side event (kernels, copies) the profiler saw."""
    out = []
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            out.append((ev.time_range.start, ev.time_range.end, ev.name))
    return sorted(out)


def busy_us(events: list[tuple[float, float, str]]) -> tuple[float, float]:
    """(union of the intervals, first start to last end) in us."""
    busy, cur_s, cur_e = 0.0, None, None
    for s, e, _ in events:
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                busy += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        busy += cur_e - cur_s
    return busy, (max(e for _, e, _ in events) - events[0][0]) if events else 0.0


def kernel_table(events, steps: int, top: int) -> tuple[dict[str, float], list[tuple[float, int, str]]]:
    by_class: dict[str, float] = {}
    by_name: dict[str, list] = {}
    for s, e, name in events:
        by_class[kernel_class(name)] = by_class.get(kernel_class(name), 0.0) + (e - s) / steps
        acc = by_name.setdefault(name[:80], [0.0, 0])
        acc[0] += (e - s) / steps
        acc[1] += 1
    rows = sorted(((t, n // steps, k) for k, (t, n) in by_name.items()), reverse=True)
    return by_class, rows[:top]


def run_mode(bench: Bench, e, b: int, ctx: int, overlap: bool, args) -> dict:
    e.settle()
    e.overlap = overlap
    tag = f"{b}x{ctx}-{'on' if overlap else 'off'}"
    reqs = bench.admit(e, b, ctx, args.warmup + args.steps + args.prof_steps + 16, tag)
    e.runner.capture_graphs((b,), ctx + 64)
    for _ in range(args.warmup):
        e.step()
    seen = {p: [] for p in PHASES}
    bench.sync()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        e.step()
        for p, ms in e.last_step_summary()["ms"].items():
            seen[p].append(ms)
    bench.sync()
    step_ms = (time.perf_counter() - t0) / args.steps * 1e3
    graph = e.last_step_summary()["graph"]
    acts = [ProfilerActivity.CUDA] if bench.dev.type == "cuda" else [ProfilerActivity.CPU]
    with profile(activities=acts) as prof:
        for _ in range(args.prof_steps):
            e.step()
        bench.sync()
    events = device_events(prof)
    busy, span = busy_us(events)
    by_class, top = kernel_table(events, args.prof_steps, args.top)
    e.settle()
    batch_inputs = e.runner.prepare(e.scheduler.schedule())
    fwd = bench.gpu_ms(lambda: e.runner.execute(batch_inputs), reps=10, warmup=2)
    for r in reqs:
        e.abort(r.request_id)
    e.step()  # the aborted requests leave the scheduler
    e.settle()
    n = args.prof_steps
    return {"batch": b, "ctx": ctx, "overlap": overlap, "graph": graph, "step_ms": step_ms, "fwd_ms": fwd,
            "busy_ms": busy / n / 1e3, "idle_ms": (span - busy) / n / 1e3, "kernels_per_step": len(events) / n,
            "class_ms": {k: v / 1e3 for k, v in by_class.items()},
            "phases_ms": {p: statistics.median(v) for p, v in seen.items() if v},
            "top": [{"us": t, "count": c, "name": k} for t, c, k in top]}


def print_row(r: dict) -> None:
    ph, cls = r["phases_ms"], r["class_ms"]
    host = sum(v for p, v in ph.items() if p != "execute")
    print(f"| {r['batch']} x {r['ctx']} | {'on' if r['overlap'] else 'off'} | {r['step_ms']:.2f} | "
          f"{r['fwd_ms']:.2f} | {r['busy_ms']:.2f} | {r['idle_ms']:.2f} | "
          f"{cls.get('attention', 0):.2f} | {cls.get('gemm', 0):.2f} | {cls.get('copy', 0):.2f} | "
          f"{cls.get('other', 0):.2f} | " + " | ".join(f"{ph.get(p, 0):.2f}" for p in PHASES) +
          f" | {host:.2f} |", flush=True)


def generate_steps(bench: Bench, e, b: int, ctx: int, max_tokens: int) -> dict:
    """One `generate` as engine_floor times it, with every step's wall time and kind recorded."""
    kinds: dict[str, list[float]] = {}
    step = e.step

    def timed_step(*a, **k):
        t0 = time.perf_counter()
        out = step(*a, **k)
        s = e.last_step_summary()
        kind = ("empty" if not s else "capture" if s["captured"] else
                "decode graph" if s["graph"] is not None and not s["prefill_tokens"] else
                "graph, with prompt tokens" if s["graph"] is not None else
                "eager, prompt tokens" if s["prefill_tokens"] else "eager decode")
        kinds.setdefault(kind, []).append(time.perf_counter() - t0)
        return out

    e.step = timed_step
    try:
        bench.sync()
        t0 = time.perf_counter()
        e.generate(_prompts(bench, b, ctx, e.model_config.vocab_size, max_tokens))
        bench.sync()
        wall = time.perf_counter() - t0
    finally:
        del e.step
    return {"tokens": max_tokens, "s": wall,
            "kinds": {k: {"steps": len(v), "s": sum(v)} for k, v in kinds.items()}}


def generate_breakdown(bench: Bench, model, tok, b: int, ctx: int, short: int = 8, long_: int = 72) -> dict:
    e = floor_engine(bench, model, tok, num_blocks=b * (ctx + long_) // 16 + 64)
    if bench.dry:
        short, long_ = 2, 6
    e.runner.capture_graphs((b,), ctx + long_)
    generate_steps(bench, e, b, ctx, short)  # compiles, untimed
    runs = [generate_steps(bench, e, b, ctx, n) for n in (short, long_)]
    print(f"\n# generate {b} x {ctx}: step by difference = "
          f"{(runs[1]['s'] - runs[0]['s']) / (long_ - short) * 1e3:.2f} ms")
    for r in runs:
        print(f"#   {r['tokens']} tokens: {r['s']:.3f} s; " +
              "; ".join(f"{k}: {v['steps']} steps {v['s'] * 1e3:.0f} ms" for k, v in sorted(r["kinds"].items())))
    return {"batch": b, "ctx": ctx, "runs": runs}


def offline_breakdown(bench: Bench, model, tok, n: int, ctx: int, out: int, budgets) -> list[dict]:
    """engine_floor's offline run (n requests x (ctx in, out out), all submitted at once) at each
    step token budget, its steps split by kind as in generate_breakdown."""
    res = []
    for budget in budgets:
        e = floor_engine(bench, model, tok, num_blocks=n * (ctx + out) // 16 + 2 * n + 64, max_batched=budget)
        e.runner.capture_graphs(context_len=ctx + out)  # every bucket, as serving's warmup does
        generate_steps(bench, e, 16, ctx, 8)  # compiles, untimed
        r = generate_steps(bench, e, n, ctx, out)
        r.update(budget=budget, out_tok_s=n * out / r["s"])
        res.append(r)
        print(f"\n# offline {n} x ({ctx} in, {out} out), budget {budget}: {r['s']:.2f} s, "
              f"{r['out_tok_s']:,.0f} output tok/s; " +
              "; ".join(f"{k}: {v['steps']} steps {v['s']:.2f} s" for k, v in sorted(r["kinds"].items())), flush=True)
        del e
    return res


def attention_sweep(bench: Bench, shapes, sizes) -> list[dict]:
    """The decode attention kernel alone at each partition size (None: one pass), llama3-8b's
    heads (32 query, 8 KV, head_dim 128), bf16, block 16, replayed from a CUDA graph."""
    from tandem.engine.attention import AttentionMetadata  # noqa: PLC0415
    from tandem.engine.kernels import attention_split  # noqa: PLC0415
    from tandem.engine.kernels.attention_split import set_split_policy  # noqa: PLC0415
    from tandem.engine.kernels.paged_attention import (_num_sms, choose_partition_size,  # noqa: PLC0415
                                                       paged_decode_attention)

    dev, dtype = bench.dev, (torch.float32 if bench.dry else torch.bfloat16)
    hq, hkv, d, bs = (4, 2, 16, 16) if bench.dry else (32, 8, 128, 16)
    rows, saved = [], attention_split.POLICY
    for b, ctx in shapes:
        nb = ctx // bs
        k = torch.randn(b * nb + 1, bs, hkv, d, dtype=dtype, device=dev)
        v = torch.randn_like(k)
        table = torch.randperm(b * nb, device=dev).view(b, nb).to(torch.int32)
        meta = AttentionMetadata(
            slot_mapping=torch.zeros(b, dtype=torch.int64, device=dev),
            query_start_loc=torch.arange(b + 1, dtype=torch.int32, device=dev),
            seq_lens=torch.full((b,), ctx, dtype=torch.int32, device=dev), block_tables=table,
            query_lens_cpu=[1] * b, seq_lens_cpu=[ctx] * b, max_query_len=1, max_seq_len=ctx)
        q = torch.randn(b, hq, d, dtype=dtype, device=dev)
        out = torch.empty_like(q)
        ref = paged_decode_attention(q, k, v, meta, 0.1, partition_size=None).float()
        kv_bytes = 2 * b * ctx * hkv * d * k.element_size()
        auto = choose_partition_size(b, hkv, ctx, _num_sms(dev))
        for size, merge in [(None, False)] + [(s, m) for s in sizes if s < ctx for m in (False, True)]:
            set_split_policy(vector_merge=merge)
            fn = lambda: paged_decode_attention(q, k, v, meta, 0.1, out, partition_size=size)  # noqa: E731
            fn()
            err = (out.float() - ref).abs().max().item()
            if bench.dev.type == "cuda":
                bench.sync()
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    for _ in range(10):
                        fn()
                us = bench.gpu_ms(g.replay, reps=10, warmup=2) * 100  # 10 launches: ms * 1000 / 10
            else:
                us = bench.gpu_ms(fn, reps=1, warmup=0) * 1e3
            parts = 1 if size is None else -(-ctx // size)
            r = {"batch": b, "ctx": ctx, "partition": size, "merge": "vector" if merge else "loop",
                 "programs": b * hkv * parts, "us": us, "gbs": kv_bytes / us / 1e3, "auto": size == auto,
                 "max_err": err}
            rows.append(r)
            print(f"| {b} x {ctx} | {size} | {r['merge'] if size else ''} | {r['programs']} | {us:.1f} | "
                  f"{r['gbs']:.0f} | {'auto' if r['auto'] else ''} | {err:.1e} |", flush=True)
    set_split_policy(vector_merge=saved.vector_merge)
    return rows


def capture_costs(bench: Bench, model, tok, shapes, repeats: int = 3) -> list[dict]:
    """What a decode shape met for the first time in serving costs (issue 22: runtime captures
    stall every running sequence): per (batch, context), with graphs captured as serving does
    (`DecodeGraphs.capture_after` = 2: the shape's first step runs eagerly, its second captures),
    the wall ms of the eager step, the capture step and the replays after it; `repeats` times,
    each on a fresh set of graphs, after one untimed pass that compiles the shape's kernels."""
    e = bench.engine(model, tok, num_blocks=max(b * (c + 64) for b, c in shapes) // 16 + 64)
    e.overlap = False  # each step's wall is its own
    print("\n| batch x ctx | eager step ms | capture step ms | replay ms | each run: eager/capture |"
          "\n|---|---:|---:|---:|---|")
    if bench.dry:  # the graph path's static buffers, run eagerly (no CUDA here: nothing captures)
        e.runner = ModelRunner(model, e.kv_cache, bench.dev, cuda_graphs=True, capture=False)
    rows = []
    for b, ctx in shapes:
        walls = []
        for rep in range(repeats + 1):
            # a fresh set of graphs (its own memory pool) each time, as a new engine would have
            e.runner.graphs = DecodeGraphs(e.runner._static_step, capture=e.runner.graphs.capture)
            reqs = bench.admit(e, b, ctx, 16, f"cap-{rep}-{b}x{ctx}")
            w = []
            for _ in range(5):
                bench.sync()
                t0 = time.perf_counter()
                e.step()
                bench.sync()
                w.append((time.perf_counter() - t0) * 1e3)
            for r in reqs:
                e.abort(r.request_id)
            e.step()
            e.settle()
            if rep:
                walls.append(w)
        r = {"batch": b, "ctx": ctx, "eager_ms": statistics.median(w[0] for w in walls),
             "capture_ms": statistics.median(w[1] for w in walls),
             "replay_ms": statistics.median(x for w in walls for x in w[2:])}
        rows.append(r)
        print(f"| {b} x {ctx} | {r['eager_ms']:.1f} | {r['capture_ms']:.1f} | {r['replay_ms']:.1f} | "
              f"{' '.join(f'{w[0]:.1f}/{w[1]:.1f}' for w in walls)} |", flush=True)
    return rows


def profile_rows(bench: Bench, model, tok, rows, args) -> None:
    e = bench.engine(model, tok, num_blocks=max(b * (c + 128) for b, c in rows) // 16 + 64)
    if bench.dry:  # the graph path's static buffers, run eagerly (no CUDA here), overlapped as on CUDA
        e.runner = ModelRunner(model, e.kv_cache, bench.dev, cuda_graphs=True, capture=False)
    res = bench.results["profile"] = []
    from tandem.engine.kernels import attention_split  # noqa: PLC0415 (triton loads only where kernels run)
    from tandem.engine.kernels import attention_rope_kv  # noqa: PLC0415 (as above)
    print(f"# split plan: {attention_split.POLICY}; fused rotary + KV write: {attention_rope_kv.ENABLED}", flush=True)
    bench.results["policy"] = str(attention_split.POLICY)
    print("| batch x ctx | overlap | step ms | fwd ms | GPU busy ms | GPU idle ms | attention ms | GEMM ms | "
          "copies ms | other ms | " + " | ".join(f"{p} ms" for p in PHASES) + " | host ms |")
    print("|---|---|" + "---:|" * 15)
    for b, ctx in rows:
        for overlap in (m == "on" for m in args.modes.split(",")):
            r = run_mode(bench, e, b, ctx, overlap, args)
            res.append(r)
            print_row(r)
            bench.save()
    for r in res:
        print(f"\n# {r['batch']} x {r['ctx']} overlap {'on' if r['overlap'] else 'off'} ({r['graph']}), "
              f"{r['kernels_per_step']:.0f} device events per step; top:")
        for k in r["top"]:
            print(f"#   {k['us']:8.1f} us {k['count']:4d}x  {k['name']}")


def apply_kernel_options(args) -> None:
    """--policy (the split plan) and --rope-kv, for every engine the script builds."""
    if args.policy:
        from tandem.engine.kernels.attention_split import set_split_policy  # noqa: PLC0415
        set_split_policy(**{k: v == "1" if k in ("vector_merge", "bucket_plan") else int(v)
                            for k, v in (p.split("=") for p in args.policy.split(","))})
    if args.rope_kv == "off":
        from tandem.engine.kernels import attention_rope_kv  # noqa: PLC0415
        attention_rope_kv.ENABLED = False


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny model (Triton interpreter)")
    ap.add_argument("--rows", default="1x1024,64x1024,256x1024,32x8192")
    ap.add_argument("--modes", default="on,off", help="the overlap modes of the engine rows")
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--prof-steps", type=int, default=4)
    ap.add_argument("--top", type=int, default=8)
    ap.add_argument("--generate", default="256x1024", help="shapes for the generate breakdown ('' to skip)")
    ap.add_argument("--offline", default="", help="token budgets for the 512 x (1k, 256) offline "
                    "run split by step kind, e.g. 8192,16384 ('' to skip)")
    ap.add_argument("--attn", default="1x1024,4x1024,16x1024,64x1024,1x8192,8x8192,32x8192",
                    help="shapes for the attention sweep ('' to skip)")
    ap.add_argument("--captures", default="1x1024,8x1024,32x1024,64x1024",
                    help="shapes for the runtime capture costs ('' to skip)")
    ap.add_argument("--policy", default="", help="split plan for the engine rows, e.g. "
                    "min_partition=64,programs_per_sm=2,vector_merge=1 (attention_split.SplitPolicy)")
    ap.add_argument("--rope-kv", default="on", choices=("on", "off"),
                    help="the fused rotary + KV write (engine.kernels.attention_rope_kv.ENABLED)")
    ap.add_argument("--out", default=os.environ.get("OUT") or "out")
    args = ap.parse_args()
    if args.dry_run:
        os.environ.setdefault("TRITON_INTERPRET", "1")
        torch.set_num_threads(1)
    apply_kernel_options(args)
    bench = Bench(args.dry_run, args.out)
    parse = lambda s: [tuple(int(x) for x in p.split("x")) for p in s.split(",") if p]  # noqa: E731
    small = [(1, 64), (4, 64)]
    rows, gens, caps = parse(args.rows), parse(args.generate), parse(args.captures)
    if bench.dry:  # the tiny model's shapes in place of any given
        rows, gens, caps = small[:len(rows) and 2], small[1:len(gens) and 2], small[:len(caps) and 2]
    bench.ceilings()
    if rows or gens or args.offline or caps:
        name = "tiny-random" if bench.dry else "llama3-8b-random"
        model, tok, _ = load_model(name, "float32" if bench.dry else "bfloat16", str(bench.dev), seed=0)
        if bench.dry:
            model.ops = TritonOps()
        if rows:
            profile_rows(bench, model, tok, rows, args)
        bench.results["generate"] = [generate_breakdown(bench, model, tok, b, c) for b, c in gens]
        if caps:
            bench.results["captures"] = capture_costs(bench, model, tok, caps)
        if args.offline:
            n, ctx, out = (8, 64, 8) if bench.dry else (512, 1024, 256)
            bench.results["offline"] = offline_breakdown(bench, model, tok, n, ctx, out,
                                                         [int(x) for x in args.offline.split(",")])
        bench.save()
        del model
    if args.attn:
        sizes = [64, 128, 256, 512, 1024, 2048]
        print("\n| batch x ctx | partition | merge | programs | us | K/V GB/s | | max err vs one pass |")
        print("|---|---:|---|---:|---:|---:|---|---:|")
        shapes = [(1, 256), (4, 128)] if bench.dry else parse(args.attn)
        bench.results["attention"] = attention_sweep(bench, shapes, sizes)
    bench.save()


if __name__ == "__main__":
    main()
