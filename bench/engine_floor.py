"""Issue 23's table: decode steps of llama3-8b-random against their floor at every batch size, and
the 512 x (1k in, 256 out) offline run, all through the public offline API (`LLMEngine.generate`).

A row's step time is (t(long) - t(short)) / (long - short) for one `generate` of `batch` prompts
of `ctx` tokens each, so the prefill cancels out (after an untimed short run of the same shape; the
least of two timings of each). Its floor is max(memory, compute): the weights
(without the embedding table) plus the batch's K/V at the mean context of the timed steps, over the
copy rate measured in the same run; or the step's FLOPs over the measured bf16 matmul rate.
"Decode-only" times `LLMEngine.step` with every sequence decoding (KV admitted "already there"),
no prefill step among them: the difference of two `generate` calls also carries what the long
call's extra decode rows add to the prefill steps they ride in.
`bench/engine_gpu.py` runs it as its `floor` section; `--dry-run` runs it on CPU with a tiny model.
"""

from __future__ import annotations

import time

import torch

from tandem.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from tandem.engine.engine import LLMEngine
from tandem.engine.model import TritonOps
from tandem.engine.model_runner import ModelRunner
from tandem.engine.weights import load_model

ROWS = ((1, 1024), (16, 1024), (64, 1024), (128, 1024), (256, 1024), (1, 8192), (32, 8192))
DRY_ROWS = ((1, 64), (4, 64), (1, 128))
PLAIN_ROWS = ((256, 1024),)  # also timed with LLMEngine.overlap off


def floor_engine(bench, model, tok, num_blocks: int, max_seqs: int = 256, max_batched: int = 8192) -> LLMEngine:
    cfg = EngineConfig(model="bench", cache=CacheConfig(block_size=16, num_blocks=num_blocks,
                                                      enable_prefix_caching=False),
                       scheduler=SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=max_batched))
    e = LLMEngine(cfg, model=model, tokenizer=tok)
    if bench.dry:  # the graph path's static buffers, run eagerly (no CUDA here), overlapped as on CUDA
        e.runner = ModelRunner(model, e.kv_cache, bench.dev, cuda_graphs=True, capture=False)
        e.overlap = True
    return e


def _prompts(bench, n: int, ctx: int, vocab: int, max_tokens: int) -> list[dict]:
    return [{"prompt_token_ids": torch.randint(3, vocab, (ctx,), generator=bench.gen).tolist(),
             "max_tokens": max_tokens, "ignore_eos": True} for _ in range(n)]


def _timed_generate(bench, e: LLMEngine, reqs: list[dict]) -> float:
    bench.sync()
    t0 = time.perf_counter()
    out = e.generate(reqs)
    bench.sync()
    assert all(len(o["token_ids"]) == reqs[0]["max_tokens"] for o in out)
    return time.perf_counter() - t0


def _decode_only_ms(bench, e: LLMEngine, b: int, ctx: int, steps: int = 24) -> float:
    """ms per `LLMEngine.step` with all b sequences decoding: requests admitted with their first
    ctx - 1 positions of K/V "in the cache" (as after a KV transfer), so no step is a prefill."""
    reqs = bench.admit(e, b, ctx, steps + 8, f"dec-{b}x{ctx}")
    for _ in range(4):
        e.step()
    bench.sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        e.step()
    bench.sync()
    ms = (time.perf_counter() - t0) / steps * 1e3
    for r in reqs:
        e.abort(r.request_id)
    e.step()
    e.take_outputs()
    return ms


def _step_ms(bench, e: LLMEngine, b: int, ctx: int, short: int, long_: int, repeats: int = 2) -> float:
    """(t(long) - t(short)) / (long - short), the least of `repeats` timings of each, after an untimed
    short run of this very shape: how `batch x ctx` prompt tokens pack into the step budget's chunks
    decides the prefill kernels' shapes, so a shape warmed at another batch leaves compiles (and
    autotuning) inside the first timed run, which once gave -15 ms at 16 x 1k and 3-6 ms at 256 x 1k."""
    vocab = e.model_config.vocab_size
    # every bucket up to b, as serving's warmup captures them: the steps after the first requests
    # finish run smaller batches, and a capture inside a timed run costs ~0.17 s (2026-12-01's
    # run: 23 captures, 3.9 s), 2.6 ms over the 64 steps of the difference for each
    e.runner.capture_graphs(tuple(s for s in e.runner.batch_sizes if s <= b), ctx + long_)
    _timed_generate(bench, e, _prompts(bench, b, ctx, vocab, short))
    before = e.runner.graph_stats["captures"]
    t_short = t_long = float("inf")
    for _ in range(repeats):
        t_short = min(t_short, _timed_generate(bench, e, _prompts(bench, b, ctx, vocab, short)))
        t_long = min(t_long, _timed_generate(bench, e, _prompts(bench, b, ctx, vocab, long_)))
    if e.runner.graph_stats["captures"] > before:
        print(f"# WARNING {b} x {ctx}: {e.runner.graph_stats['captures'] - before} graphs captured "
              "inside the timed runs", flush=True)
    return (t_long - t_short) / (long_ - short) * 1e3


def floor_ms(bench, model, batch: int, context: float) -> float:
    c, ceil = model.config, bench.results["ceilings"]
    mem = (bench.model_bytes(model) + batch * context * bench.kv_bytes_per_token(model)) / (ceil["copy_gbs"] * 1e9)
    params = bench.model_bytes(model) / model.embed_tokens.weight.element_size()
    attn = 4 * c.num_layers * c.num_heads * c.head_dim * context
    flops = batch * (2 * params + attn)
    return 1e3 * max(mem, flops / (ceil["matmul_tflops"] * 1e12))


def offline_bound(bench, model, n: int, ctx: int, out: int) -> dict:
    """The least time the offline run's work allows: its FLOPs (every prompt's prefill, causal
    attention included, and n x (out - 1) decode tokens with the LM head) over the measured matmul
    rate, and the K/V bytes its decode steps must read over the copy rate (each decode token reads
    its context's K/V once)."""
    c, ceil = model.config, bench.results["ceilings"]
    params = bench.model_bytes(model) / model.embed_tokens.weight.element_size()  # with the head
    head = c.hidden_size * c.vocab_size
    attn = 4 * c.num_layers * c.num_heads * c.head_dim  # FLOPs per (query, key) pair
    prefill = n * (ctx * 2 * (params - head) + 2 * head + attn * ctx * (ctx + 1) / 2)
    decode_tokens = n * (out - 1)
    mean_ctx = ctx + out / 2
    decode = decode_tokens * (2 * params + attn * mean_ctx)
    kv = decode_tokens * mean_ctx * bench.kv_bytes_per_token(model)
    r = {"prefill_pflop": prefill / 1e15, "decode_pflop": decode / 1e15,
         "flops_s": (prefill + decode) / (ceil["matmul_tflops"] * 1e12), "kv_tb": kv / 1e12,
         "kv_s": kv / (ceil["copy_gbs"] * 1e9)}
    r["max_tok_s"] = n * out / max(r["flops_s"], r["kv_s"])
    return r


def run_floors(bench) -> None:
    """Fills bench.results["floor"] with the decode rows and the offline run."""
    name = "tiny-random" if bench.dry else "llama3-8b-random"
    model, tok, cfg = load_model(name, "float32" if bench.dry else "bfloat16", str(bench.dev), seed=0)
    if bench.dry:
        model.ops = TritonOps()
    rows, (short, long_) = (DRY_ROWS, (2, 6)) if bench.dry else (getattr(bench, "floor_rows", None) or ROWS, (8, 72))
    n_off, ctx_off, out_off = (8, 64, 8) if bench.dry else (512, 1024, 256)
    tokens = max(max(b * (c + long_) for b, c in rows), n_off * (ctx_off + out_off))
    e = floor_engine(bench, model, tok, num_blocks=tokens // 16 + 2 * n_off + 64)
    vocab = cfg.vocab_size
    res = bench.results["floor"] = {"model": name, "short": short, "long": long_, "decode": []}
    overlap = e.overlap
    _timed_generate(bench, e, _prompts(bench, 1, rows[0][1], vocab, short))   # compiles the prefill kernels
    for b, ctx in rows:
        r = {"batch": b, "ctx": ctx, "step_ms": _step_ms(bench, e, b, ctx, short, long_)}
        fl = floor_ms(bench, model, b, ctx + (short + long_) / 2)
        r.update(floor_ms=fl, x_floor=r["step_ms"] / fl, tok_s=b / r["step_ms"] * 1e3)
        r["decode_only_ms"] = _decode_only_ms(bench, e, b, ctx + (short + long_) // 2)
        r["decode_only_x_floor"] = r["decode_only_ms"] / fl
        if getattr(bench, "floor_profile", False):  # the kernels of one eager decode step of this row
            r["profile"] = bench.profile(e, b, ctx + (short + long_) // 2)
        res["decode"].append(r)
        print(f"# floor decode {r}", flush=True)
        bench.save()
    e.overlap = False                 # the same steps with the host's work between them
    for r in res["decode"]:
        if (r["batch"], r["ctx"]) in PLAIN_ROWS or bench.dry:
            r["plain_step_ms"] = _step_ms(bench, e, r["batch"], r["ctx"], short, long_)
            print(f"# floor decode without overlap {r}", flush=True)
    e.overlap = overlap
    if not getattr(bench, "floor_offline", True):
        return
    t = _timed_generate(bench, e, _prompts(bench, n_off, ctx_off, vocab, out_off))
    res["offline"] = {"requests": n_off, "prompt": ctx_off, "output": out_off, "s": t,
                      "out_tok_s": n_off * out_off / t, "bound": offline_bound(bench, model, n_off, ctx_off, out_off)}
    res["graphs"] = e.runner.graph_stats
    print(f"# floor offline {res['offline']}", flush=True)


def print_floors(results: dict) -> None:
    f = results.get("floor")
    if not f or not f.get("decode"):
        return
    print(f"\n{f['model']} decode through LLMEngine.generate (step = (t({f['long']}) - t({f['short']}) tokens) "
          f"/ {f['long'] - f['short']})")
    print("| batch x context | step ms | floor ms | step / floor | output tok/s | step ms, overlap off | "
          "decode-only step ms | decode-only / floor |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in f["decode"]:
        ctx = f"{r['ctx'] // 1024}k" if r["ctx"] >= 1024 else str(r["ctx"])
        plain = f"{r['plain_step_ms']:.2f}" if "plain_step_ms" in r else ""
        print(f"| {r['batch']} x {ctx} | {r['step_ms']:.2f} | {r['floor_ms']:.2f} | {r['x_floor']:.2f} | "
              f"{r['tok_s']:,.0f} | {plain} | {r.get('decode_only_ms', 0):.2f} | {r.get('decode_only_x_floor', 0):.2f} |")
    o = f.get("offline")
    if o:
        print(f"offline: {o['requests']} requests x ({o['prompt']} in, {o['output']} out) submitted at once: "
              f"{o['s']:.1f} s, {o['out_tok_s']:,.0f} output tokens/s")
        b = o.get("bound")
        if b:
            print(f"offline bound: prefill {b['prefill_pflop']:.2f} + decode {b['decode_pflop']:.2f} PFLOP = "
                  f"{b['flops_s']:.1f} s at the matmul rate; decode K/V reads {b['kv_tb']:.1f} TB = {b['kv_s']:.1f} s "
                  f"at the copy rate; at most {b['max_tok_s']:,.0f} output tokens/s")
