"""Engine throughput on this CPU: smollm2-135m with 1, 4 and 16 concurrent requests (~128 prompt
and 64 new tokens each, greedy, EOS ignored) against transformers' `generate` on the same weights,
one request at a time and as one padded batch of 16, measured in the same run.

    .venv/bin/python bench/engine_cpu.py [--new-tokens 64] [--repeats 1]

Prints a markdown table: output tokens/s, and each figure as a ratio to transformers one-at-a-time.
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from tandem.engine.config import CacheConfig, EngineConfig
from tandem.engine.engine import LLMEngine
from tandem.engine.weights import load_model, smollm2_gguf_path


def make_prompts(tok, n: int, length: int, seed: int = 0) -> list[list[int]]:
    """n prompts of exactly `length` tokens, different from each other."""
    rng = random.Random(seed)
    words = ("the function returns a list of values sorted by key and filters out every None entry "
             "while the test checks that errors raise ValueError with a clear message for users").split()
    out = []
    for _ in range(n):
        ids: list[int] = []
        while len(ids) < length:
            ids += tok.encode(" ".join(rng.choice(words) for _ in range(32)))
        out.append(ids[:length])
    return out


def bench_tandem(model, tok, prompts, new_tokens: int) -> float:
    e = LLMEngine(EngineConfig(cache=CacheConfig(num_blocks=2048)), model=model, tokenizer=tok)
    reqs = [{"prompt_token_ids": p, "max_tokens": new_tokens, "ignore_eos": True} for p in prompts]
    e.generate(reqs[:1])  # warm-up
    e.allocator.reset_prefix_cache()  # measure full prefill, not a cache hit
    t0 = time.perf_counter()
    res = e.generate(reqs)
    dt = time.perf_counter() - t0
    assert all(len(r["token_ids"]) == new_tokens for r in res)
    return len(prompts) * new_tokens / dt


def bench_hf(hf, prompts, new_tokens: int, batch: int) -> float:
    hf.generate(torch.tensor([prompts[0]]), max_new_tokens=4, do_sample=False, pad_token_id=0)  # warm-up
    t0 = time.perf_counter()
    done = 0
    with torch.inference_mode():
        for i in range(0, len(prompts), batch):
            chunk = prompts[i:i + batch]
            x = torch.tensor(chunk)  # equal lengths: padding-free, so the batch is the best case for HF
            out = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=new_tokens,
                              min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
            done += (out.shape[1] - x.shape[1]) * len(chunk)
    return done / (time.perf_counter() - t0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=64)
    a = p.parse_args()
    from transformers import AutoModelForCausalLM  # noqa: PLC0415 - the reference: a test extra, loaded only here

    model, tok, _ = load_model("smollm2-135m")
    path = smollm2_gguf_path()
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    prompts = make_prompts(tok, 16, a.prompt_tokens)
    rows = []
    base = bench_hf(hf, prompts[:4], a.new_tokens, batch=1)
    rows.append(("transformers generate, one at a time", 1, base))
    rows.append(("transformers generate, padded batch of 16", 16, bench_hf(hf, prompts, a.new_tokens, batch=16)))
    for n in (1, 4, 16):
        rows.append((f"tandem engine, {n} concurrent", n, bench_tandem(model, tok, prompts[:n], a.new_tokens)))
    print(f"\nsmollm2-135m fp32, {a.prompt_tokens} prompt + {a.new_tokens} new tokens per request, "
          f"torch threads {torch.get_num_threads()}\n")
    print("| run | concurrent | output tokens/s | vs HF one at a time |")
    print("|---|---:|---:|---:|")
    for name, n, tps in rows:
        print(f"| {name} | {n} | {tps:.1f} | {tps / base:.2f}x |")
    hf16 = rows[1][2]
    print(f"\ntandem at 16 vs HF padded batch of 16: {rows[-1][2] / hf16:.2f}x; "
          f"tandem at 1 vs HF one at a time: {rows[2][2] / base:.2f}x")


if __name__ == "__main__":
    main()
