"""Host time of one decode step by phase at batch 64-256, on CPU with a tiny model: the per-request
Python a step pays besides the forward (what the GPU waits for unless it is overlapped).

Requests join as on a decode actor after a KV transfer (their prompt's KV "already there"), then
`--steps` decode steps run through `LLMEngine.step`; each step's `last_step_summary()` phases are
averaged: schedule, prepare, execute (the forward, excluded from "host"), sample (sampling and,
overlapped, the previous step's resolve and post-processing), output.

    python bench/step_host.py [--batches 64,128,256] [--ctx 1024] [--steps 6]
"""

from __future__ import annotations

import argparse
import statistics

import torch

from tandem.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from tandem.engine.engine import LLMEngine
from tandem.engine.weights import load_model
from tandem.wire.messages import SamplingParams

PHASES = ("schedule", "prepare", "execute", "sample", "output")


def run(model, tok, batch: int, ctx: int, steps: int, overlap: bool) -> dict[str, float]:
    cfg = EngineConfig(model="bench", cache=CacheConfig(block_size=16, num_blocks=batch * (ctx + 64) // 16 + 64,
                                                      enable_prefix_caching=False),
                       scheduler=SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=4096))
    e = LLMEngine(cfg, model=model, tokenizer=tok)
    e.overlap = overlap
    g = torch.Generator().manual_seed(0)
    for b in range(batch):
        ids = torch.randint(3, model.config.vocab_size, (ctx,), generator=g).tolist()
        req = e.make_request(f"r{b}", prompt_token_ids=ids, sampling=SamplingParams(max_tokens=steps + 4, ignore_eos=True))
        assert e.allocator.admit(req, ctx)
        req.num_computed_tokens = ctx - 1
        e.scheduler.add_ready(req)
    e.step()                              # the first step (and, overlapped, the pipeline's fill)
    seen = {p: [] for p in PHASES}
    for _ in range(steps):
        e.step()
        for p, ms in e.last_step_summary()["ms"].items():
            seen[p].append(ms)
    for r in list(e.scheduler.requests):
        e.abort(r)
    e.step()
    out = {p: statistics.median(v) for p, v in seen.items()}
    out["host"] = sum(v for p, v in out.items() if p != "execute")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="64,128,256")
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=6)
    args = ap.parse_args()
    torch.set_num_threads(1)
    model, tok, _ = load_model("tiny-random", "float32", "cpu", seed=0)
    print("| batch | ctx | mode | schedule ms | prepare ms | sample ms | output ms | host ms | forward ms |")
    print("|---:|---:|---|---:|---:|---:|---:|---:|---:|")
    for b in (int(x) for x in args.batches.split(",")):
        for overlap in (False, True):
            r = run(model, tok, b, args.ctx, args.steps, overlap)
            mode = "overlapped" if overlap else "plain"
            print(f"| {b} | {args.ctx} | {mode} | {r['schedule']:.1f} | {r['prepare']:.1f} | {r['sample']:.1f} | "
                  f"{r['output']:.1f} | {r['host']:.1f} | {r['execute']:.1f} |", flush=True)


if __name__ == "__main__":
    main()
