"""Tensor parallelism on CPU (gloo): what splitting a worker over 2 ranks costs and buys per engine
step, and what the per-step broadcast of rank 0's inputs costs.

A random Llama-shaped checkpoint (written with transformers into a temp dir: hidden 1024, 12
layers, 16 heads, 4 KV heads, MLP 2816, vocab 32000, fp32; ~0.25B parameters) runs through
`LLMEngine` at TP=1 and at TP=2 (rank 1 a spawned process, `engine.parallel.local`), one torch
thread per rank. Per batch size: B prompts of 64 tokens, then 32 greedy decode steps; the table
gives the median decode step (ms), the median prefill step, the time rank 0 spends broadcasting a
step's inputs (`StepBroadcaster.send_step`, median, us), and whether TP=2's tokens equal TP=1's.
On a machine whose cores other work shares, the wall clock counts that work too: compare rows of
one run.

    python -m bench.tp_cpu [--batches 1,8,32] [--steps 32]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from tandem.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from tandem.engine.engine import LLMEngine
from tandem.engine.parallel.group import destroy_tensor_parallel, init_tensor_parallel
from tandem.engine.parallel.local import free_init_method, spawn_shards
from tandem.wire.messages import SamplingParams
from tests.engine.families import write_tokenizer

SHAPE = dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=12,
             num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=4096)


def write_checkpoint(path: Path) -> Path:
    import transformers  # noqa: PLC0415 - only to write the checkpoint

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SHAPE, tie_word_embeddings=False)).float()
    model.save_pretrained(str(path), safe_serialization=True)
    write_tokenizer(path)  # a byte-level tokenizer: the prompts are token ids anyway
    return path


def run(engine: LLMEngine, batch: int, steps: int) -> tuple[list[float], list[float], list[list[int]]]:
    """-> (prefill step ms, decode step ms, tokens) for `batch` prompts of 64 tokens."""
    gen = torch.Generator().manual_seed(batch)
    for i in range(batch):
        ids = torch.randint(0, SHAPE["vocab_size"], (64,), generator=gen).tolist()
        engine.add_request(f"b{batch}-{i}", prompt_token_ids=ids,
                           sampling=SamplingParams(max_tokens=steps, ignore_eos=True))
    prefill, decode, tokens = [], [], {}
    while engine.has_unfinished():
        prompts = sum(1 for r in engine.scheduler.requests.values() if r.num_computed_tokens < r.num_prompt_tokens)
        t0 = time.perf_counter()
        outs = engine.step()
        (prefill if prompts else decode).append(1e3 * (time.perf_counter() - t0))
        for o in outs:
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
    return prefill, decode, [tokens[k] for k in sorted(tokens)]


def config(path: Path, tp: int) -> EngineConfig:
    return EngineConfig(model=str(path), tensor_parallel_size=tp, cache=CacheConfig(num_blocks=1024),
                        scheduler=SchedulerConfig(max_num_batched_tokens=4096))


def timed_broadcasts(engine: LLMEngine) -> list[float]:
    spent, send = [], engine.shards.send_step

    def timed(batch):
        t0 = time.perf_counter()
        send(batch)
        spent.append(1e6 * (time.perf_counter() - t0))
    engine.runner.before_execute = timed
    return spent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--steps", type=int, default=32)
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    os.environ["OMP_NUM_THREADS"] = "1"  # the spawned rank reads it when it imports torch
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        path = write_checkpoint(Path(tmp) / "llama-small")
        one = LLMEngine(config(path, 1))
        ref = {b: run(one, b, args.steps) for b in batches}
        del one
        init = free_init_method()
        procs = spawn_shards([config(path, 2)], init)
        init_tensor_parallel(0, 2, init)
        two = LLMEngine(config(path, 2))
        spent = timed_broadcasts(two)
        rows = []
        for b in batches:
            spent.clear()
            got = run(two, b, args.steps)
            rows.append((b, ref[b], got, statistics.median(spent)))
        two.shards.close()
        destroy_tensor_parallel()
        for p in procs:
            p.join(30)
    print(f"{'batch':>5} | {'TP1 decode ms':>13} | {'TP2 decode ms':>13} | {'TP1 prefill ms':>14} | "
          f"{'TP2 prefill ms':>14} | {'TP2 broadcast us':>16} | tokens equal")
    for b, (p1, d1, t1), (p2, d2, t2), bc in rows:
        print(f"{b:>5} | {statistics.median(d1):>13.1f} | {statistics.median(d2):>13.1f} | "
              f"{statistics.median(p1):>14.1f} | {statistics.median(p2):>14.1f} | {bc:>16.0f} | {t1 == t2}")


if __name__ == "__main__":
    main()
