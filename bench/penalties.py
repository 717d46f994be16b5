"""What penalties (presence, frequency, repetition: engine/penalties.py) cost.

1. `Penalties.apply` alone, per step, for R penalized rows of a vocabulary V whose requests have
   each output T tokens and hold a P-token prompt: the dense path (device-side counts, the GPU's
   default) and the sparse one (per row over its distinct tokens, the CPU's), each step adding one
   token per row as decoding does. Timed with a device sync after each step.
2. With `--engine`: llama3-8b-random (bf16 on a GPU; smollm2-135m-random fp32 on the CPU) decode
   steps through `LLMEngine` at batch B and context C, with no request penalized, one, and all of
   them: a penalized request makes the engine settle the overlapped step first (its host work no
   longer overlaps the GPU's) and speculation skip it, so its whole batch pays.

    python3 bench/penalties.py [--engine]            # on the GPU (or the CPU when there is none)
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from tandem.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from tandem.engine.engine import LLMEngine
from tandem.engine.penalties import Penalties
from tandem.engine.weights import load_model
from tandem.wire.messages import SamplingParams

PENALIZED = SamplingParams(presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.1)


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


def apply_ms(dev, dense: bool, rows: int, vocab: int, prompt: int, output: int, steps: int = 20) -> float:
    rng = random.Random(0)
    logits = torch.randn(rows, vocab, device=dev)
    reqs = [(i, f"r{i}", PENALIZED, [rng.randrange(vocab) for _ in range(prompt)],
             [rng.randrange(vocab) for _ in range(output)]) for i in range(rows)]
    state = Penalties(dense=dense)
    state.apply(logits, reqs)  # the first step builds each request's state
    times = []
    for _ in range(steps):
        for r in reqs:
            r[4].append(rng.randrange(vocab))
        sync(dev)
        t0 = time.perf_counter()
        state.apply(logits, reqs)
        sync(dev)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def engine_steps(dev, model, tok, batch: int, ctx: int, penalized: int, steps: int = 12) -> float:
    blocks = batch * (ctx + steps + 32) // 16 + 64
    e = LLMEngine(EngineConfig(model="bench", device=dev.type, cache=CacheConfig(num_blocks=blocks),
                               scheduler=SchedulerConfig(max_num_seqs=max(batch, 8))), model=model, tokenizer=tok)
    gen = torch.Generator().manual_seed(0)
    vocab = e.model_config.vocab_size
    for b in range(batch):  # KV "already there", as after a transfer: the next step decodes
        ids = torch.randint(3, vocab, (ctx,), generator=gen).tolist()
        sp = PENALIZED if b < penalized else SamplingParams()
        req = e.make_request(f"r{b}", prompt_token_ids=ids,
                             sampling=SamplingParams(**{**vars(sp), "max_tokens": steps + 8, "ignore_eos": True}))
        assert e.allocator.admit(req, ctx), "KV cache too small for the benchmark"
        req.num_computed_tokens = ctx - 1
        e.scheduler.add_ready(req)
    for _ in range(4):
        e.step()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        e.step()
        times.append((time.perf_counter() - t0) * 1e3)
    for b in range(batch):
        e.abort(f"r{b}")
    e.settle()
    del e
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", action="store_true", help="also time LLMEngine decode steps")
    ap.add_argument("--vocab", type=int, default=128256)
    args = ap.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    name = torch.cuda.get_device_name() if dev.type == "cuda" else "CPU"
    print(f"Penalties.apply per step on {name}, vocabulary {args.vocab}, 2000-token prompts (median ms)")
    print(f"{'rows':>5} {'output tokens':>14} {'dense ms':>9} {'sparse ms':>10}")
    for rows in (1, 16, 64, 256):
        for output in (100, 2000):
            dense = apply_ms(dev, True, rows, args.vocab, 2000, output)
            sparse = apply_ms(dev, False, rows, args.vocab, 2000, output) if rows <= 64 else float("nan")
            print(f"{rows:>5} {output:>14} {dense:>9.3f} {sparse:>10.3f}", flush=True)
    if args.engine:
        name, dtype = ("llama3-8b-random", "bfloat16") if dev.type == "cuda" else ("smollm2-135m-random", "float32")
        model, tok, _ = load_model(name, dtype, dev.type, seed=0)
        print(f"\n{name} decode step ms through LLMEngine (median of 12), context 1024")
        print(f"{'batch':>5} {'none penalized':>15} {'one':>8} {'all':>8}")
        for batch in ((1, 64) if dev.type == "cuda" else (1, 8)):
            ms = [engine_steps(dev, model, tok, batch, 1024, k) for k in (0, 1, batch)]
            print(f"{batch:>5} {ms[0]:>15.3f} {ms[1]:>8.3f} {ms[2]:>8.3f}", flush=True)


if __name__ == "__main__":
    main()
