"""Speculative decoding benchmark: what drafts buy, and what verifying them costs.

CPU (default): `smollm2-135m`, greedy, float32, one torch thread. Two workloads, (a) 24 code edits
whose answer copies the code in the prompt (renames, docstrings, bug fixes, type hints ...) and
(b) 16 open chat prompts, each at 1, 8 and 64 concurrent requests, without speculation and with each
method asked for, interleaved, best of `--repeat` runs. Per row: output tokens per second and the
speedup over no speculation; tokens per verify step (1 + accepted drafts, over the sequence-steps
that verified drafts); tokens per decode step (over all sequence-steps, drafts or not: the real
gain); the draft acceptance rate; and whether the tokens equal the plain run's.

    python -m bench.speculative [--methods off,ngram,draft] [--max-tokens 128] [--num-tokens 5]

GPU (`--gpu`): the cost of one target forward with 1 + k query tokens per sequence against a plain
decode step (k = 0), for k = 1..8 at batch 1, 8, 32, 64, `llama3-8b-random` in bf16 with ~1k tokens
of context per sequence (synthetic: blocks are reserved, the KV is not computed, which changes no
timing), timing `runner.execute` as the engine calls it (CUDA graphs where it captures the shape;
`--eager` adds a runner without graphs) with CUDA events. From those costs and per-token acceptance rates
(`--acceptance`, e.g. the CPU run's), the expected speedup per batch size: at the best fixed k, and
at the k the length policy picks with its default GPU budget. Drafting cost is not counted (n-gram
lookup is a few microseconds of CPU).

    python -m bench.speculative --gpu --acceptance 0.5,0.7,0.9
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from tandem.engine.config import CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig
from tandem.engine.engine import LLMEngine
from tandem.engine.model_runner import ModelRunner
from tandem.engine.request import Request
from tandem.engine.scheduler import ScheduledRequest, SchedulerOutput
from tandem.engine.speculative.policy import SpeculationLengthPolicy
from tandem.engine.speculative.speculator import resolve_max_verify_tokens
from tandem.engine.weights import load_model

CODE = {
    "total_price": '''def total_price(items, tax_rate):
    total = 0
    for item in items:
        total += item.price * item.quantity
    return total * (1 + tax_rate)
''',
    "find_user": '''def find_user(users, name):
    for u in users:
        if u["name"] == name:
            return u
    return None
''',
    "Counter": '''class Counter:
    def __init__(self):
        self.count = 0

    def increment(self, step=1):
        self.count += step
        return self.count

    def reset(self):
        self.count = 0
''',
    "read_lines": '''def read_lines(path):
    f = open(path)
    lines = f.readlines()
    result = []
    for line in lines:
        result.append(line.strip())
    return result
''',
    "average": '''def average(values):
    total = 0
    for v in values:
        total += v
    return total / len(values)
''',
    "fizzbuzz": '''def fizzbuzz(n):
    out = []
    for i in range(1, n + 1):
        if i % 15 == 0:
            out.append("FizzBuzz")
        elif i % 3 == 0:
            out.append("Fizz")
        elif i % 5 == 0:
            out.append("Buzz")
        else:
            out.append(str(i))
    return out
''',
    "merge_dicts": '''def merge_dicts(a, b):
    result = {}
    for key in a:
        result[key] = a[key]
    for key in b:
        result[key] = b[key]
    return result
''',
    "is_prime": '''def is_prime(n):
    if n < 2:
        return False
    for d in range(2, n):
        if n % d == 0:
            return False
    return True
''',
    "Stack": '''class Stack:
    def __init__(self):
        self.items = []

    def push(self, item):
        self.items.append(item)

    def pop(self):
        return self.items.pop()

    def is_empty(self):
        return len(self.items) == 0
''',
    "word_count": '''def word_count(text):
    counts = {}
    for word in text.split():
        word = word.lower()
        if word in counts:
            counts[word] += 1
        else:
            counts[word] = 1
    return counts
''',
    "clamp": '''function clamp(value, low, high) {
  if (value < low) {
    return low;
  }
  if (value > high) {
    return high;
  }
  return value;
}
''',
    "parse_config": '''def parse_config(text):
    config = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        key, value = line.split("=", 1)
        config[key.strip()] = value.strip()
    return config
''',
}

EDITS = [
    ("total_price", "Rename the variable `total` to `subtotal` in this function. Reply with the full updated function."),
    ("total_price", "Add a docstring to this function. Reply with the full updated function."),
    ("find_user", "Rename the parameter `users` to `people` everywhere in this function. Show the whole function."),
    ("find_user", "Add type hints to this function. Reply with the complete code."),
    ("Counter", "Rename the class `Counter` to `Tally`. Reply with the complete class."),
    ("Counter", "Add a `decrement` method to this class. Reply with the complete class."),
    ("read_lines", "This function never closes the file. Fix it with a `with` statement and show the full function."),
    ("read_lines", "Rename `result` to `stripped` in this function. Reply with the full updated function."),
    ("average", "Fix the bug: this function fails on an empty list; return 0.0 then. Show the full function."),
    ("average", "Rename the variable `v` to `value` in this function. Reply with the full updated function."),
    ("fizzbuzz", "Rename the list `out` to `words` in this function. Reply with the full updated function."),
    ("fizzbuzz", "Add a docstring to this function. Reply with the complete code."),
    ("merge_dicts", "Rename the parameters `a` and `b` to `base` and `override`. Show the whole function."),
    ("merge_dicts", "Add a docstring to this function. Reply with the complete function."),
    ("is_prime", "Make this function faster by only checking divisors up to the square root. Show the whole function."),
    ("is_prime", "Rename the variable `d` to `divisor`. Reply with the full updated function."),
    ("Stack", "Add a `peek` method that returns the top item without removing it. Reply with the complete class."),
    ("Stack", "Rename the attribute `items` to `elements` everywhere in this class. Reply with the complete class."),
    ("word_count", "Rename `counts` to `frequencies` in this function. Reply with the full updated function."),
    ("word_count", "Add a docstring to this function. Reply with the complete function."),
    ("clamp", "Rename the function `clamp` to `limit`. Reply with the complete code."),
    ("clamp", "Add a JSDoc comment to this function. Reply with the complete code."),
    ("parse_config", "Rename the variable `config` to `settings` in this function. Reply with the full function."),
    ("parse_config", "Add a docstring to this function. Reply with the complete function."),
]

CHAT = [
    "What are three tips for staying focused while working from home?",
    "Explain what a hash table is to a beginner.",
    "Write a short poem about autumn leaves.",
    "What is the difference between a list and a tuple in Python?",
    "Give me a simple recipe for pancakes.",
    "Why is the sky blue?",
    "Suggest a name for a coffee shop and explain why.",
    "What should I pack for a weekend hiking trip?",
    "How do I make my houseplants grow better?",
    "Explain recursion with a simple example.",
    "What are the benefits of learning a second language?",
    "Write a friendly email inviting a colleague to lunch.",
    "How does a bicycle stay upright?",
    "Describe the water cycle in a few sentences.",
    "What is a good morning routine for a student?",
    "Tell me a fun fact about octopuses.",
]


def code_edit_requests(max_tokens: int) -> list[dict]:
    lang = lambda name: "javascript" if name == "clamp" else "python"  # noqa: E731
    return [{"messages": [{"role": "user", "content": f"{task}\n```{lang(name)}\n{CODE[name]}```"}],
             "max_tokens": max_tokens, "request_id": f"edit-{i}"} for i, (name, task) in enumerate(EDITS)]


def chat_requests(max_tokens: int) -> list[dict]:
    return [{"messages": [{"role": "user", "content": c}], "max_tokens": max_tokens, "request_id": f"chat-{i}"}
            for i, c in enumerate(CHAT)]


# ---- CPU: end to end ----------------------------------------------------------------------------
def build_engines(args, methods: list[str]) -> dict[tuple[str, int], LLMEngine]:
    """One warmed-up engine per (method, concurrency), all sharing one loaded model."""
    model, tok, _ = load_model(args.model)
    engines = {}
    for method in methods:
        spec = SpeculativeConfig(method=method, num_tokens=args.num_tokens,
                                 draft_num_layers=args.draft_layers if method == "draft" else None)
        for conc in args.concurrency:
            cfg = EngineConfig(model=args.model, cache=CacheConfig(num_blocks=args.num_blocks),
                               scheduler=SchedulerConfig(max_num_seqs=conc), speculative=spec)
            engines[method, conc] = LLMEngine(cfg, model=model, tokenizer=tok)
            engines[method, conc].generate([{"prompt": "Hello", "max_tokens": 4}])  # warm up
    return engines


def timed_run(engine: LLMEngine, reqs: list[dict], rep: int) -> dict:
    """One pass of `reqs` through `engine`, from an empty prefix cache and fresh stats."""
    engine.allocator.reset_prefix_cache()  # every run computes its prompts
    engine.stats = type(engine.stats)()
    t0 = time.perf_counter()
    res = engine.generate([dict(r, request_id=f"{r['request_id']}-{rep}") for r in reqs])
    wall = time.perf_counter() - t0
    st = engine.stats
    out_tokens = sum(len(r["token_ids"]) for r in res)
    # each sequence-step that samples outputs exactly one token that was not a draft
    seq_steps = out_tokens - st.accepted_draft_tokens
    return {"tokens": out_tokens, "wall": wall, "tps": out_tokens / wall, "ids": [r["token_ids"] for r in res],
            "per_verify": 1 + st.accepted_draft_tokens / st.draft_seq_steps if st.draft_seq_steps else None,
            "per_step": out_tokens / seq_steps if seq_steps else None,
            "acceptance": st.accepted_draft_tokens / st.draft_tokens if st.draft_tokens else None,
            "steps": st.steps}


def best_rows(engines, methods: list[str], wname: str, conc: int, reqs: list[dict], repeat: int) -> list[dict]:
    """Each method's fastest of `repeat` runs (methods interleaved: a shared machine's load hits
    all alike), with its speedup over the first method and whether its tokens equal that one's."""
    best: dict[str, dict] = {}
    for rep in range(repeat):
        for method in methods:
            row = {"workload": wname, "conc": conc, "method": method, **timed_run(engines[method, conc], reqs, rep)}
            print(f"# {wname:10s} conc={conc} {method:5s} run {rep}: {row['tokens']} tokens in {row['wall']:.1f}s "
                  f"({row['tps']:.1f} tok/s), {row['steps']} steps, load {os.getloadavg()[0]:.1f}", flush=True)
            if method not in best or row["wall"] < best[method]["wall"]:
                best[method] = row
    base = best[methods[0]]
    for row in best.values():
        row["speedup"] = row["tps"] / base["tps"]
        row["same"] = row["ids"] == base["ids"]
    return [best[m] for m in methods]


def run_cpu(args) -> None:
    torch.manual_seed(0)
    if args.threads:
        torch.set_num_threads(args.threads)
    workloads = {"code edits": code_edit_requests(args.max_tokens)[:args.limit],
                 "open chat": chat_requests(args.chat_max_tokens)[:args.limit]}
    methods = args.methods.split(",")
    engines = build_engines(args, methods)
    rows = [row for wname, reqs in workloads.items() for conc in args.concurrency
            for row in best_rows(engines, methods, wname, conc, reqs, args.repeat)]
    fmt = lambda v, f: "-" if v is None else format(v, f)  # noqa: E731
    print(f"\n{args.model}, CPU ({torch.get_num_threads()} threads), greedy, k <= {args.num_tokens}, "
          f"max_tokens {args.max_tokens} (code) / {args.chat_max_tokens} (chat), best of {args.repeat}\n")
    print("| workload | concurrent | method | output tokens | tok/s | speedup | tokens / verify step "
          "| tokens / decode step | draft acceptance | same tokens as off |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['workload']} | {r['conc']} | {r['method']} | {r['tokens']} | {r['tps']:.1f} | "
              f"{r['speedup']:.2f}x | {fmt(r['per_verify'], '.2f')} | {fmt(r['per_step'], '.2f')} | "
              f"{fmt(r['acceptance'], '.2f')} | {'yes' if r['same'] else 'NO'} |")


# ---- GPU: verify-step cost ----------------------------------------------------------------------
def expected_tokens(acceptance: float, k: int) -> float:
    """Tokens per verify step with k drafts when each is accepted with this probability."""
    if acceptance >= 1.0:
        return k + 1.0
    return (1 - acceptance ** (k + 1)) / (1 - acceptance)


def verify_costs(engine: LLMEngine, runners: dict, args) -> dict[str, dict[tuple[int, int], float]]:
    """Per runner, per (batch, k): ms per step with 1 + k query tokens per sequence, on `args.context`
    tokens of synthetic context (blocks reserved, KV not computed: no timing changes)."""
    kmax, ctx, cuda = args.max_k, args.context, args.device.startswith("cuda")
    alloc, vocab = engine.allocator, engine.model_config.vocab_size
    gen = torch.Generator().manual_seed(0)
    costs: dict[str, dict[tuple[int, int], float]] = {name: {} for name in runners}
    for B in args.batch_sizes:
        reqs = []
        for b in range(B):
            r = Request(f"b{B}-{b}", torch.randint(0, vocab, (ctx,), generator=gen).tolist())
            r.num_computed_tokens = ctx - 1  # the prompt's KV "is there": only the last token runs
            assert alloc.grow(r, 1 + kmax)
            reqs.append(r)
        for k in range(kmax + 1):
            sched = SchedulerOutput([ScheduledRequest(r, 1 + k, k) for r in reqs])
            drafts = {r.request_id: torch.randint(0, vocab, (k,), generator=gen).tolist() for r in reqs}
            for name, runner in runners.items():
                batch = runner.prepare(sched, drafts)
                costs[name][B, k] = _time_ms(lambda: runner.execute(batch), args.iters, args.warmup, cuda)
        for r in reqs:
            alloc.free(r)
        for mode, cost in costs.items():
            if cost:
                print(f"# batch {B} {mode}: " + " ".join(f"k={k}:{cost[B, k]:.2f}ms" for k in range(kmax + 1)),
                      flush=True)
    return costs


def print_verify_costs(costs, args) -> None:
    kmax = args.max_k
    for mode, cost in costs.items():
        if not cost:
            continue
        print(f"Verify step cost relative to a plain decode step (k = 0), {mode}:\n")
        print("| batch | decode ms | " + " | ".join(f"k={k}" for k in range(1, kmax + 1)) + " |")
        print("|---|---|" + "---|" * kmax)
        for B in args.batch_sizes:
            print(f"| {B} | {cost[B, 0]:.2f} | "
                  + " | ".join(f"{cost[B, k] / cost[B, 0]:.2f}" for k in range(1, kmax + 1)) + " |")
        print()


def print_speedups(costs, args, budget: int) -> None:
    """Expected speedup per acceptance rate and batch: at the best fixed k, and at the policy's k."""
    kmax = args.max_k

    def step_cost(cost, B: int, k: float) -> float:  # k may be fractional: sequences at k and k + 1
        lo = int(k)
        hi = min(lo + 1, kmax)
        return cost[B, lo] + (k - lo) * (cost[B, hi] - cost[B, lo])

    modes = [m for m in costs if costs[m]]
    print(f"Expected throughput over plain decoding, drafting cost not counted: at the best fixed k, "
          f"and at the k the length policy picks (max_verify_tokens={budget}, other knobs default):\n")
    print("| acceptance | batch | policy k (mean) | "
          + " | ".join(f"best k ({m}) | speedup at best k ({m}) | speedup at policy k ({m})" for m in modes) + " |")
    print("|---|---|---|" + "---|---|---|" * len(modes))
    for a in args.acceptance:
        for B in args.batch_sizes:
            # every sequence with this acceptance; a step's cost follows its total tokens
            policy = SpeculationLengthPolicy(budget, initial_acceptance=a)
            ks = policy.choose({f"s{b}": kmax for b in range(B)})
            k_mean = sum(ks.values()) / B
            toks = sum(expected_tokens(a, ks.get(f"s{b}", 0)) for b in range(B)) / B
            cells = []
            for m in modes:
                cost = costs[m]
                gains = {k: expected_tokens(a, k) * cost[B, 0] / cost[B, k] for k in range(kmax + 1)}
                best = max(gains, key=gains.get)
                cells.append(f"{best} | {gains[best]:.2f}x | {toks * cost[B, 0] / step_cost(cost, B, k_mean):.2f}x")
            print(f"| {a:.2f} | {B} | {k_mean:.2f} | " + " | ".join(cells) + " |")


def run_gpu(args) -> None:
    bs = 16
    num_blocks = max(args.batch_sizes) * (-(-(args.context + args.max_k + 1) // bs)) + 8
    t0 = time.perf_counter()
    cuda = args.device.startswith("cuda")
    engine = LLMEngine(EngineConfig(model=args.gpu_model, dtype="bfloat16", device=args.device,
                                    cache=CacheConfig(block_size=bs, num_blocks=num_blocks)))
    runners = {"engine": engine.runner}  # as the engine runs steps: CUDA graphs where it has them
    if args.eager and cuda:
        runners["eager"] = ModelRunner(engine.model, engine.kv_cache, engine.kv_cache.device, cuda_graphs=False)
    print(f"# {args.gpu_model} loaded in {time.perf_counter() - t0:.0f}s, {num_blocks} KV blocks, "
          f"ops {type(engine.model.ops_for(engine.kv_cache.device)).__name__}", flush=True)
    costs = verify_costs(engine, runners, args)
    where = torch.cuda.get_device_name() if cuda else args.device
    print(f"\n{args.gpu_model}, bf16, {where}, context {args.context}, mean of {args.iters} after {args.warmup} "
          f"warm-up; engine: runner.execute as the engine calls it (CUDA graphs for the shapes it "
          f"captures), eager: no graphs\n")
    budget = resolve_max_verify_tokens(SpeculativeConfig(), torch.device(args.device))
    print_verify_costs(costs, args)
    print_speedups(costs, args, budget)


def _time_ms(fn, iters: int, warmup: int, cuda: bool) -> float:
    for _ in range(warmup):
        fn()
    if not cuda:  # a smoke test of this mode off the GPU
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


def main() -> None:
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    floats = lambda s: [float(x) for x in s.split(",")]  # noqa: E731
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpu", action="store_true", help="time verify steps on a CUDA GPU instead")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--methods", default="off,ngram", help="comma-separated: off, ngram, draft (off first)")
    p.add_argument("--num-tokens", type=int, default=5, help="k: most drafts per sequence per step")
    p.add_argument("--draft-layers", type=int, default=24, help="draft method: the target's first N layers")
    p.add_argument("--max-tokens", type=int, default=128, help="code edits")
    p.add_argument("--chat-max-tokens", type=int, default=64)
    p.add_argument("--concurrency", type=ints, default=[1, 8, 64])
    p.add_argument("--num-blocks", type=int, default=2048)
    p.add_argument("--limit", type=int, help="only the first N requests of each workload (a quick look)")
    p.add_argument("--repeat", type=int, default=2, help="runs per method (interleaved); the fastest counts")
    p.add_argument("--threads", type=int, default=1,
                   help="torch CPU threads (default 1: a multi-threaded forward slows down badly when "
                        "other processes take a core; 0 = torch's default)")
    p.add_argument("--gpu-model", default="llama3-8b-random")
    p.add_argument("--batch-sizes", type=ints, default=[1, 8, 32, 64])
    p.add_argument("--max-k", type=int, default=8)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--eager", action="store_true", help="also time a runner without CUDA graphs")
    p.add_argument("--device", default="cuda", help="--gpu mode's device (cpu: a smoke test with a tiny model)")
    p.add_argument("--acceptance", type=floats, default=[0.5, 0.7, 0.9],
                   help="per-token draft acceptance rates to project speedups for")
    args = p.parse_args()
    if args.gpu:
        run_gpu(args)
    else:
        run_cpu(args)


if __name__ == "__main__":
    main()
