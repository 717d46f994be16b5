"""Speculative decoding benchmark: what drafts buy, and what verifying them costs.

CPU (default): `smollm2-135m`, greedy, float32, one torch thread. Three workloads, (a) 24 code edits
whose answer copies the code in the prompt (renames, docstrings, bug fixes, type hints ...),
(b) 16 open chat prompts, and (c) `agent`: 8 three-turn coding-agent sessions (two per module of
two functions): the file as a read_file tool result and a task; a failing test run quoting the
answer and a second task; the answer re-read as a tool result and a third task. Each turn sees the
whole conversation, ends at its code block's closing fence (the edit tool's input), and is sent
when the session's previous turn finished; `--concurrency` sessions run at once. Each workload at
each concurrency, without speculation and with each method asked for (off, ngram, suffix),
interleaved, best of `--repeat` runs (the suffix proposer forgets other requests' outputs between
runs). Per row: output tokens per second and the speedup over no speculation, and the same per
CPU-second of the process (one torch thread: on a shared machine its CPU time is the work done,
where the wall clock also counts others' load); tokens per verify step (1 + accepted drafts, over
the sequence-steps that verified drafts); tokens per decode step (over all sequence-steps, drafts
or not: the real gain); the draft acceptance rate; and whether the tokens equal the plain run's.

    python -m bench.speculative [--methods off,ngram,suffix,suffix-tree,draft] [--workloads agent] [--num-tokens 5]

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
import json
import os
import time
from pathlib import Path

import torch

from tandem.engine.config import CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig
from tandem.engine.engine import LLMEngine
from tandem.engine.model_runner import ModelRunner
from tandem.engine.request import Request
from tandem.engine.scheduler import ScheduledRequest, SchedulerOutput
from tandem.engine.speculative.policy import SpeculationLengthPolicy
from tandem.engine.speculative.speculator import resolve_max_verify_tokens
from tandem.engine.weights import load_model
from tandem.wire.messages import SamplingParams

# the code-edit and chat prompts (24 edits of 12 small functions, 16 open questions)
PROMPTS = json.loads((Path(__file__).parent / "speculative_prompts.json").read_text())
CODE: dict[str, str] = PROMPTS["code"]
EDITS: list[tuple[str, str]] = [tuple(e) for e in PROMPTS["edits"]]
CHAT: list[str] = PROMPTS["chat"]
AGENT_SYSTEM = ("You are a coding agent. You read files and run tests with tools. To change a file, reply "
                "with only the complete updated file in one code block: the edit tool writes it as is.")
# (module: the functions in it, first task, follow-up task): two sessions per module, so outputs
# repeat across sessions too
AGENT_SESSIONS = [
    (("total_price", "average"), "Rename the variable `total` to `subtotal` in `total_price`.",
     "Rename the parameter `items` to `lines`."),
    (("total_price", "average"), "Make `average` return 0.0 for an empty list.", "Rename `v` to `value`."),
    (("find_user", "merge_dicts"), "Rename the parameter `users` to `people`.",
     "Rename `a` and `b` to `base` and `override`."),
    (("find_user", "merge_dicts"), "Add type hints to `find_user`.", "Add a docstring to `merge_dicts`."),
    (("Counter", "Stack"), "Rename the class `Counter` to `Tally`.", "Add a `peek` method to `Stack`."),
    (("Counter", "Stack"), "Add a `decrement` method to `Counter`.", "Rename `items` to `elements` in `Stack`."),
    (("read_lines", "word_count"), "Close the file in `read_lines` with a `with` statement.",
     "Rename `counts` to `frequencies`."),
    (("read_lines", "word_count"), "Rename `result` to `stripped`.", "Add a docstring to `word_count`."),
]
AGENT_STOP = "\n```"  # the turn ends with its code block (the edit tool's input)


def _code_of(answer: str) -> str:
    """The code of an answer: after its opening fence when it has one (the stop string cut the close)."""
    return answer.split("```", 1)[1].split("\n", 1)[-1] + "\n" if "```" in answer else answer


def agent_turn(session: int, turn: int, previous: str) -> str | None:
    """The user message of a session's turn (tool output + task), given the previous answer; None
    after the last turn. Turn 2 quotes a failing test, turn 3 re-reads the file the agent wrote."""
    names, first, second = AGENT_SESSIONS[session]
    module, code = f"{names[0].lower()}_utils.py", "\n\n".join(CODE[n] for n in names)
    done = " Reply with the complete updated file."
    if turn == 0:
        return f'Tool read_file("{module}") returned:\n```python\n{code}```\n{first}{done}'
    if turn == 1:
        head = "".join(f">   {line}\n" for line in _code_of(previous).splitlines()[:3])
        return (f"Tool run_tests returned:\n```\nFAILED tests/test_{module}::test_{names[1]} - AssertionError\n"
                f"{head}E   AssertionError\n1 failed, 3 passed in 0.12s\n```\n{second}{done}")
    if turn == 2:
        return (f'Tool read_file("{module}") returned:\n```python\n{_code_of(previous)}```\n'
                f"Add a short comment above each loop.{done}")
    return None


def run_sessions(engine: LLMEngine, max_tokens: int, conc: int, rep: int) -> list[list[int]]:
    """The agent sessions, `conc` at a time, each turn sent when the previous one finished (its
    answer joins the conversation). -> every turn's output token ids, by session then turn."""
    pending = list(range(len(AGENT_SESSIONS)))
    convo: dict[int, list[dict]] = {}
    outputs: dict[int, list[list[int]]] = {i: [] for i in pending}
    live: dict[str, tuple[int, list[int], list[str]]] = {}  # request id -> (session, tokens, text)

    def send(i: int, previous: str) -> bool:
        content = agent_turn(i, len(outputs[i]), previous)
        if content is None:
            return False
        convo[i].append({"role": "user", "content": content})
        rid = f"agent-{i}-{len(outputs[i])}-{rep}"
        engine.add_request(rid, messages=list(convo[i]),
                           sampling=SamplingParams(max_tokens=max_tokens, stop=(AGENT_STOP,)))
        live[rid] = (i, [], [])
        return True

    while pending or live:
        while pending and len(live) < conc:
            i = pending.pop(0)
            convo[i] = [{"role": "system", "content": AGENT_SYSTEM}]
            send(i, "")
        for out in engine.step():
            i, ids, text = live[out.request_id]
            ids.extend(out.new_token_ids)
            text.append(out.new_text)
            if out.finished:
                del live[out.request_id]
                outputs[i].append(ids)
                convo[i].append({"role": "assistant", "content": "".join(text) + AGENT_STOP})
                send(i, "".join(text))
    return [ids for i in sorted(outputs) for ids in outputs[i]]


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
        tree = method == "suffix-tree"  # suffix drafts as trees of up to --tree-nodes nodes
        spec = SpeculativeConfig(method="suffix" if tree else method, num_tokens=args.num_tokens,
                                 draft_num_layers=args.draft_layers if method == "draft" else None,
                                 suffix_tree_nodes=args.tree_nodes if tree else 0)
        for conc in args.concurrency:
            cfg = EngineConfig(model=args.model, cache=CacheConfig(num_blocks=args.num_blocks),
                               scheduler=SchedulerConfig(max_num_seqs=conc), speculative=spec)
            engines[method, conc] = LLMEngine(cfg, model=model, tokenizer=tok)
            engines[method, conc].generate([{"prompt": "Hello", "max_tokens": 4}])  # warm up
    return engines


def timed_run(engine: LLMEngine, reqs, rep: int) -> dict:
    """One pass of `reqs` (a request list, or a function running its own: `run(engine, rep) ->
    token ids per request`) through `engine`, from an empty prefix cache, fresh stats and, for
    the suffix proposer, no outputs of earlier runs."""
    engine.allocator.reset_prefix_cache()  # every run computes its prompts
    engine.stats = type(engine.stats)()
    clear = getattr(engine.speculator.proposer, "clear", None) if engine.speculator else None
    if clear is not None:
        clear()
    t0, c0 = time.perf_counter(), time.process_time()
    if callable(reqs):
        ids = reqs(engine, rep)
    else:
        ids = [r["token_ids"] for r in engine.generate([dict(r, request_id=f"{r['request_id']}-{rep}") for r in reqs])]
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    st = engine.stats
    out_tokens = sum(map(len, ids))
    # each sequence-step that samples outputs exactly one token that was not a draft
    seq_steps = out_tokens - st.accepted_draft_tokens
    return {"tokens": out_tokens, "wall": wall, "tps": out_tokens / wall, "cpu_tps": out_tokens / cpu, "ids": ids,
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
                  f"({row['tps']:.1f} tok/s, {row['cpu_tps']:.1f} per CPU-s), {row['steps']} steps, "
                  f"load {os.getloadavg()[0]:.1f}", flush=True)
            if method not in best or row["wall"] < best[method]["wall"]:
                best[method] = row
    base = best[methods[0]]
    for row in best.values():
        row["speedup"] = row["tps"] / base["tps"]
        row["cpu_speedup"] = row["cpu_tps"] / base["cpu_tps"]
        row["same"] = row["ids"] == base["ids"]
    return [best[m] for m in methods]


def run_cpu(args) -> None:
    torch.manual_seed(0)
    if args.threads:
        torch.set_num_threads(args.threads)
    workloads = {"code edits": code_edit_requests(args.max_tokens)[:args.limit],
                 "open chat": chat_requests(args.chat_max_tokens)[:args.limit],
                 "agent": lambda engine, rep: run_sessions(engine, args.agent_max_tokens, engine.config.scheduler.max_num_seqs, rep)}
    workloads = {w: workloads[w] for w in args.workloads.split(",")}
    methods = args.methods.split(",")
    engines = build_engines(args, methods)
    rows = [row for wname, reqs in workloads.items() for conc in args.concurrency
            for row in best_rows(engines, methods, wname, conc, reqs, args.repeat)]
    fmt = lambda v, f: "-" if v is None else format(v, f)  # noqa: E731
    print(f"\n{args.model}, CPU ({torch.get_num_threads()} threads), greedy, k <= {args.num_tokens}, "
          f"max_tokens {args.max_tokens} (code) / {args.chat_max_tokens} (chat) / {args.agent_max_tokens} "
          f"(agent, per turn), best of {args.repeat}\n")
    print("| workload | concurrent | method | output tokens | tok/s | speedup | tok/CPU-s | CPU speedup "
          "| tokens / verify step | tokens / decode step | draft acceptance | same tokens as off |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['workload']} | {r['conc']} | {r['method']} | {r['tokens']} | {r['tps']:.1f} | "
              f"{r['speedup']:.2f}x | {r['cpu_tps']:.1f} | {r['cpu_speedup']:.2f}x | "
              f"{fmt(r['per_verify'], '.2f')} | {fmt(r['per_step'], '.2f')} | "
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
    p.add_argument("--methods", default="off,ngram,suffix",
                   help="comma-separated: off, ngram, suffix, suffix-tree (suffix drafts as trees), draft (off first)")
    p.add_argument("--num-tokens", type=int, default=5, help="k: most drafts per sequence per step")
    p.add_argument("--tree-nodes", type=int, default=24, help="method suffix-tree: most nodes per draft tree")
    p.add_argument("--draft-layers", type=int, default=24, help="draft method: the target's first N layers")
    p.add_argument("--max-tokens", type=int, default=128, help="code edits")
    p.add_argument("--chat-max-tokens", type=int, default=64)
    p.add_argument("--agent-max-tokens", type=int, default=128, help="per turn of an agent session")
    p.add_argument("--workloads", default="code edits,open chat,agent",
                   help="comma-separated: code edits, open chat, agent")
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
