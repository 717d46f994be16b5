"""`tandem profile`: time the real engine (prefill at several lengths and cached prefixes, decode
steps at several batch sizes and contexts, and the KV gather/scatter a transfer does) and fit the
simulator's performance model to it. `tandem simulate` replays a workload against that model.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
import statistics
import time
from pathlib import Path
from typing import Any

import grpc

from tandem.cluster.autoscaler import AutoscalerConfig
from tandem.cluster.calibration import calibrate_on_cluster
from tandem.cluster.config import RouterConfig, load_config
from tandem.cluster.layouts import router_limits
from tandem.cluster.simulate_compare import add_compare_args, run_compare
from tandem.cluster.simulate_ramp import print_ramp, ramp_plan, ramp_report, run_ramp, write_ramp
from tandem.cluster.sim_model import SLO
from tandem.cluster.step_check import LoadTerms, load_terms_from, model_key
from tandem.perf_model import PerfModel
from tandem.cluster.simulator import format_table, simulate, sweep
from tandem.cluster.workloads import load_workload
from tandem.engine.config import CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig
from tandem.protos.tandem.v1 import generation_pb2_grpc
from tandem.wire.messages import SamplingParams


def _timed(fn, repeats: int = 2) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


# what `profile` times: a CPU model at CPU scale, a GPU model at the contexts and batches it serves
SIZES = {
    # (a CPU shared with other work: more repeats, the fastest kept; the lengths CPU workloads prefill)
    "small": {"prefill_lengths": (32, 128, 512), "contexts": (0, 512), "batches": (1, 4, 16),
              "decode_contexts": (128, 512), "step_batches": (1, 4, 16), "mixed_lengths": (32, 64, 128),
              "repeats": 4},
    "large": {"prefill_lengths": (128, 512, 2048, 8192), "contexts": (0, 8192), "batches": (1, 8, 32, 64),
              "decode_contexts": (1024, 8192), "step_batches": (1, 8, 32, 64), "mixed_lengths": (128, 512, 2048)},
}


def _make_engine(model: str, device: str, dtype: str, speculative: str, num_blocks: int = 4096):
    # torch and the engine load only to profile, never for the rest of the CLI
    from tandem.engine.engine import LLMEngine  # noqa: PLC0415

    return LLMEngine(EngineConfig(model=model, device=device, dtype=dtype, cache=CacheConfig(num_blocks=num_blocks),
                                  scheduler=SchedulerConfig(max_num_batched_tokens=1 << 16),
                                  speculative=SpeculativeConfig(method=speculative)))


def profile_engine(model: str = "smollm2-135m", device: str = "cpu", dtype: str = "float32",
                   prefill_lengths=(64, 256, 1024), contexts=(0, 512), batches=(1, 4, 16),
                   decode_contexts=(128, 512), quick: bool = False, draft_tokens=(2, 5)
                   ) -> list[tuple[str, tuple, float]]:
    """Samples in `PerfModel.fit`'s format, measured on this machine (`profile` also times whole
    engine steps)."""
    return profile(model, device, dtype, prefill_lengths, contexts, batches, decode_contexts, quick,
                   draft_tokens, step_batches=())[0]


def profile(model: str = "smollm2-135m", device: str = "cpu", dtype: str = "float32",
            prefill_lengths=(64, 256, 1024), contexts=(0, 512), batches=(1, 4, 16),
            decode_contexts=(128, 512), quick: bool = False, draft_tokens=(2, 5), step_batches=(1, 4, 16),
            speculative: str = "ngram", threads: int | None = None, mixed_lengths=(128, 512, 2048),
            repeats: int = 2):
    """-> (samples in `PerfModel.fit`'s format: the model's forward passes alone, decode steps
    that verify `draft_tokens` drafts per sequence among them, and steps in which one sequence of
    the batch drafts (what a served step pays for the widest draft: "padded"); whole engine steps of
    `step_batches` sequences decoding, with `speculative` proposing (scheduling, drafting,
    sampling and outputs included), for `fit_step_host`; and whole steps that also prefill a
    session's next turn (`mixed_lengths` new tokens: what the workload's turns add), for
    `fit_mixed_step`: see `_time_steps`). `threads`: torch's CPU threads (a pool actor has its
    `num_cpus`)."""
    if threads:
        import torch  # noqa: PLC0415 - only to profile

        torch.set_num_threads(threads)
    if quick:
        prefill_lengths, contexts, batches, decode_contexts = (64, 256), (0, 256), (1, 8), (128,)
        draft_tokens, step_batches = draft_tokens[-1:], step_batches[:1] + step_batches[-1:]
    longest = max(max(batches) * (max(decode_contexts) + 8), max(contexts, default=0) + max(prefill_lengths, default=0),
                  max(step_batches, default=0) * (max(decode_contexts) + 160))
    e = _make_engine(model, device, dtype, speculative, num_blocks=max(4096, longest // 16 + 256))
    if e.wants_warmup:     # on CUDA: every kernel compiled and decode graphs captured, as an actor's are
        e.warmup()
    rng = random.Random(0)
    vocab = e.model_config.vocab_size

    def tokens(n):
        return [rng.randrange(3, vocab) for _ in range(n)]

    samples = _time_forwards(e, tokens, prefill_lengths, contexts, batches, decode_contexts, draft_tokens, repeats)
    steps, mixed = [], []
    for b in step_batches:
        st, mx = _time_steps(e, tokens, b, decode_contexts[-1], new_lengths=mixed_lengths)
        steps, mixed = steps + st, mixed + mx
    return samples, steps, mixed


def _time_forwards(e, tokens, prefill_lengths, contexts, batches, decode_contexts, draft_tokens, repeats=2):
    import torch  # noqa: PLC0415 - only to profile

    from tandem.engine.scheduler import SchedulerOutput, ScheduledRequest  # noqa: PLC0415

    cuda = e.kv_cache.device.type == "cuda"
    samples: list[tuple[str, tuple, float]] = []

    def run(reqs_and_new, drafts=None):
        out = SchedulerOutput([ScheduledRequest(r, n, k) for r, n, k in reqs_and_new])
        batch = e.runner.prepare(out, drafts)
        e.runner.execute(batch)
        if cuda:
            torch.cuda.synchronize()

    def request(ids, computed, extra=0):
        req = e.make_request(prompt_token_ids=ids, sampling=SamplingParams(max_tokens=1))
        assert e.allocator.grow(req, len(ids) + extra)
        req.num_computed_tokens = computed
        return req

    warm = request(tokens(64), 0)          # first calls pay one-time costs: untimed
    run([(warm, 64, 0)])
    e.allocator.free(warm)
    for ctx in contexts:
        for n in prefill_lengths:
            req = request(tokens(ctx + n), ctx)
            samples.append(("prefill", (n, ctx + n), _timed(lambda: run([(req, n, 0)]), repeats)))
            e.allocator.free(req)
    for ctx in decode_contexts:
        for b in batches:
            for k in (0, *draft_tokens):   # k drafts: the verify forward speculation runs
                reqs = [request(tokens(ctx), ctx - 1, k) for _ in range(b)]
                drafts = {r.request_id: tokens(k) for r in reqs}
                t = _timed(lambda: run([(r, 1 + k, k) for r in reqs], drafts), repeats + 1)
                samples.append(("verify", (b, b * ctx, k), t) if k else ("decode", (b, b * ctx), t))
                if k and b > 1:   # one sequence drafts, the step is padded to its width (a served step)
                    one = drafts[reqs[0].request_id]
                    t = _timed(lambda: run([(r, 1 + k, k) if i == 0 else (r, 1, 0) for i, r in enumerate(reqs)],
                                           {reqs[0].request_id: one}), repeats + 1)
                    samples.append(("padded", (b, b * ctx, k), t))
                for r in reqs:
                    e.allocator.free(r)
    # a transfer's local cost: gather a layer's blocks and scatter them elsewhere (the wire adds to it)
    bs = e.allocator.block_size
    for n in (256, 2048):
        blocks = list(range(n // bs))
        dst = list(range(n // bs, 2 * n // bs))

        def move():
            for layer in range(e.kv_cache.num_layers):
                e.kv_cache.scatter_blocks(layer, dst, e.kv_cache.gather_blocks(layer, blocks))
        samples.append(("transfer", (n,), _timed(move, repeats)))
    return samples


def _time_steps(e, tokens, batch: int, ctx: int, steps: int = 16, new_lengths=(128, 512, 2048)):
    """Whole `LLMEngine.step`s of `batch` sequences decoding at about `ctx` tokens of context each
    -> (decode steps [(batch, total context, drafts verified per sequence, wall s)], mixed steps
    [(batch, total context, new tokens, prompt tokens, wall s)]: a step that also prefills a
    prompt whose first `ctx` tokens are cached, as a session's next turn is, with the engine's
    per-request work in it: prefix lookup, blocks, drafting index, first token). Prompts repeat a
    32-token phrase, so n-gram speculation finds drafts to propose."""
    phrase = tokens(32)
    reqs = [e.add_request(prompt_token_ids=(phrase * (ctx // 32 + 1))[:ctx - 8] + tokens(8),
                          sampling=SamplingParams(max_tokens=steps * 8 + 512, ignore_eos=True)) for _ in range(batch)]
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in reqs):
        e.step()
    e.step()                      # the first decode step of the batch (a new graph shape) untimed
    out, mixed = [], []
    for _ in range(steps):
        running = [r for r in reqs if r.request_id in e.scheduler.requests]
        if len(running) < batch:
            break
        drafts0, captures0 = e.stats.draft_tokens, _captures(e)
        context = sum(r.num_tokens for r in running)
        t0 = time.perf_counter()
        e.step()
        dt = time.perf_counter() - t0
        if _captures(e) == captures0:    # a CUDA graph's capture is a one-time cost, like a compile
            out.append((batch, context, (e.stats.draft_tokens - drafts0) / batch, dt))
    for n in (new_lengths[0], *new_lengths):          # the first one untimed (first use)
        n = min(n, e.max_model_len - ctx - 2)
        prefix = tokens(ctx)
        for prompt in (prefix, prefix + tokens(n)):   # the prefix, cached; then the next turn
            running = [r for r in reqs if r.request_id in e.scheduler.requests]
            context = sum(r.num_tokens for r in running)
            # 2 tokens: a request that ends in its prefill step leaves nothing in the prefix cache
            req = e.add_request(prompt_token_ids=prompt, sampling=SamplingParams(max_tokens=2, ignore_eos=True))
            t0 = time.perf_counter()
            e.step()
            dt = time.perf_counter() - t0
            while req.request_id in e.scheduler.requests:
                e.step()
        if len(running) == batch and len(mixed) < len(new_lengths) + 1:   # (first: untimed, below)
            mixed.append((batch, context, len(prompt) - req.num_cached_prompt_tokens, len(prompt), dt))
    for r in reqs:
        e.abort(r.request_id)
    return out, mixed[1:]


def fit_mixed_step(perf: PerfModel, mixed) -> PerfModel:
    """`perf` fitted to what engine steps that decode and prefill a session's next turn
    (`_time_steps`' mixed steps) took beyond `perf.step_s`'s charge (the median): more, and
    `prefill_base_s` is raised by it (the fixed cost of a step that prefills, the engine's
    per-request work included); less, and `mixed_step_s` is set to it, down to minus the smaller
    base: one forward pass pays the fixed cost that the decode base and the prefill base both
    charge (on CPU a 16-token chunk added 70 ms to a 97 ms decode step and cost 126 ms alone)."""
    if not mixed:
        return perf
    extra = statistics.median(wall - perf.step_s(b, ctx, [(n, prompt)]) for b, ctx, n, prompt, wall in mixed)
    if extra >= 0:
        return dataclasses.replace(perf, prefill_base_s=perf.prefill_base_s + extra)
    return dataclasses.replace(perf, mixed_step_s=max(perf.mixed_step_s + extra, -perf.mixed_step_floor_s))


def _captures(e) -> int:
    graphs = e.runner.graphs
    return graphs.captures if graphs is not None else 0


def fit_step_host(perf: PerfModel, steps) -> PerfModel:
    """`perf` with `step_host_s` set: the median of what whole engine steps `(batch, total
    context, drafts per sequence, wall s)` took beyond the forward passes `perf` was fitted to
    (scheduling, drafting, sampling, outputs; on a GPU the host's part the device does not hide)."""
    if not steps:
        return perf
    bare = dataclasses.replace(perf, step_host_s=0.0)
    extra = [wall - bare.verifying(k).decode_step_s(b, ctx) for b, ctx, k, wall in steps]
    return dataclasses.replace(perf, step_host_s=max(0.0, statistics.median(extra)))


def speculation_from_requests(requests) -> dict[str, float]:
    """`spec_verify_tokens` and `spec_tokens_per_step` as a `tandem bench` run measured them, from
    each OK request's usage (`completion_tokens`, `draft_tokens`, `accepted_draft_tokens`): the
    tokens after the first come from decode steps that emit 1 + the drafts accepted, so a request
    took (completion - 1 - accepted) steps. Where the usage has `draft_steps` (the steps that
    verified a draft), also `spec_draft_prob` (draft_steps / steps) and `spec_draft_len` (drafts
    per such step): what the padded verify width is modelled from (PerfModel.verify_tokens). {}
    when nothing was drafted."""
    ok = [r for r in requests if r.get("status", "OK") == "OK" and r["completion_tokens"] > 1]
    steps = sum(r["completion_tokens"] - 1 - r["accepted_draft_tokens"] for r in ok)
    drafts = sum(r["draft_tokens"] for r in ok)
    if not steps or not drafts:
        return {}
    out = {"spec_verify_tokens": drafts / steps, "spec_tokens_per_step": sum(r["completion_tokens"] - 1 for r in ok) / steps}
    draft_steps = sum(r.get("draft_steps") or 0 for r in ok)
    if draft_steps:
        out.update(spec_draft_prob=min(1.0, draft_steps / steps), spec_draft_len=drafts / draft_steps)
    return out


def with_counted_drafts(perf: PerfModel, requests) -> PerfModel:
    """`perf` with speculation as `requests` measured it, where their usage counted draft steps
    (the padded verify width needs them); else `perf` as it is (runs recorded before `draft_steps`
    keep their whole run's figures)."""
    if not any(r.get("draft_steps") for r in requests):
        return perf
    return dataclasses.replace(perf, **speculation_from_requests(requests))


def cmd_profile(args) -> int:
    if args.from_profile:     # refit from an earlier profile's timings (and measure the rest)
        prev = json.loads(open(args.from_profile).read())
        samples = [(k, tuple(f), t) for k, f, t in prev["samples"]]
        steps, mixed = [tuple(x) for x in prev.get("steps", [])], [tuple(x) for x in prev.get("mixed_steps", [])]
    else:
        sizes = SIZES[args.sizes or ("large" if args.device.startswith("cuda") else "small")]
        samples, steps, mixed = profile(args.model, args.device, args.dtype, quick=args.quick,
                                        speculative=args.speculative, threads=args.threads, **sizes)
    perf = fit_mixed_step(fit_step_host(PerfModel.fit(samples, block_tokens=16), steps), mixed)
    if args.bench_json:   # speculation as a `tandem bench` run measured it
        runs = json.loads(open(args.bench_json).read())["runs"]
        perf = dataclasses.replace(perf, **speculation_from_requests([r for run in runs for r in run["requests"]]))
    load = None
    if args.load_from:
        for d in args.load_from:    # another model's or device's loaded worker is not this one's
            run = json.loads((Path(d) / "run.json").read_text()) if (Path(d) / "run.json").is_file() else {}
            got = model_key(run) if run else None
            if got != (args.model, args.device, args.dtype):
                raise ValueError(f"--load-from {d}: recorded {got or 'no run.json'}, not {args.model} on "
                                 f"{args.device} in {args.dtype}")
        load = traced_load_terms(args.load_from)
    served: list = []
    if args.target:       # the served step and the control path, measured on the running cluster
        with grpc.insecure_channel(args.target) as channel:
            perf, measured = calibrate_on_cluster(generation_pb2_grpc.GenerationStub(channel), perf,
                                                  vocab_size=args.vocab_size, threshold=args.local_prefill_threshold)
            served = measured["served_steps"]
    if load is not None:  # on top of the served step, which it is measured against
        perf = load.apply(perf)
    out = {"model": args.model, "device": args.device, "dtype": args.dtype, "perf_model": perf.to_dict(),
           "samples": [[k, list(f), s] for k, f, s in samples], "steps": [list(x) for x in steps],
           "mixed_steps": [list(x) for x in mixed],
           "served_steps": [list(x) for x in served],
           "load_terms": dataclasses.asdict(load) if load is not None else None}
    text = json.dumps(out, indent=2)
    if args.output:
        with open(args.output, "w") as f:
            f.write(text)
        print(f"wrote {args.output}")
    for k, f, s in samples:
        print(f"{k:8} {str(f):16} {s * 1000:9.2f} ms")
    print(json.dumps(perf.to_dict()))
    return 0


def perf_for_cluster(perf, cluster):
    """`perf` with what a cluster config sets rather than the hardware: the decode actors'
    local-prefill threshold, sequence slots and step token budget, the prefill queue cap, and the
    KV per worker when the config fixes its blocks."""
    e = cluster.engine
    kv = {"kv_capacity_tokens": e.cache.num_blocks * e.cache.block_size} if e.cache.num_blocks else {}
    return dataclasses.replace(perf, local_prefill_threshold=cluster.decode.local_prefill_threshold,
                               prefill_queue_limit=cluster.prefill.max_queued_tokens,
                               max_batch=e.scheduler.max_num_seqs,
                               max_step_tokens=e.scheduler.max_num_batched_tokens, **kv)


def traced_load_terms(run_dirs) -> LoadTerms:
    """The load terms fitted on `run_dirs`' step traces (cluster/step_check.py `fit_load`); refused
    by name when none of them traced its steps."""
    load = load_terms_from(run_dirs)
    if load is None:
        raise ValueError(f"--load-from: none of {', '.join(map(str, run_dirs))} holds a step trace (steps/): "
                         "record runs with bench/record_run.py, which traces the engines' steps")
    return load


def with_load_terms(perf: PerfModel, run_dirs) -> PerfModel:
    """`perf` plus what a loaded worker pays beyond its idle figures (`traced_load_terms`); `perf`
    as it is when `run_dirs` is empty."""
    return traced_load_terms(run_dirs).apply(perf) if run_dirs else perf


def cmd_simulate(args) -> int:
    perf, sizes, autoscaler = with_load_terms(PerfModel.load(args.perf), args.load_from), (1, 1), None
    cluster = load_config(args.config) if args.config else None
    # what the router sheds (its admission limiter, its worker overload limits), as --config sets them
    limits = {} if args.no_admission else router_limits(cluster.router if cluster else RouterConfig())
    if args.retries < 0:
        raise ValueError("--retries must be >= 0")
    if args.retries:    # the clients send refused turns again, as `tandem bench --retries` does
        limits["retries"] = args.retries
    if args.compare:
        return run_compare(args, perf, limits)
    if cluster:       # the cluster `tandem up --config` would start: its pools and autoscaler
        perf, sizes = perf_for_cluster(perf, cluster), (cluster.prefill.replicas, cluster.decode.replicas)
        autoscaler = cluster.autoscaler if args.autoscale or cluster.autoscale else None
    elif args.autoscale:
        autoscaler = AutoscalerConfig()
    prefill = sizes[0] if args.prefill is None else args.prefill
    decode = sizes[1] if args.decode is None else args.decode
    if args.prefill_queue_limit is not None:
        perf = dataclasses.replace(perf, prefill_queue_limit=args.prefill_queue_limit)
    if (args.out or args.step_s) and not args.ramp:
        raise ValueError("--out and --step-s go with --ramp")
    if args.sweep and (autoscaler or args.ramp):
        raise ValueError("--sweep runs static layouts; drop --autoscale and --ramp, or give --prefill/--decode")
    slo = SLO(args.ttft_slo, args.tpot_slo)
    opts: dict[str, Any] = {"pull_prefix": not args.no_pull_prefix, "seed": args.seed, **limits}
    one = {"colocated": args.config is not None and math.isinf(perf.local_prefill_threshold),
           "max_workers": args.max_workers, "worker_startup_s": args.worker_startup_s}
    if args.ramp:
        return _simulate_ramp(args, prefill, decode, perf, slo, autoscaler, {**opts, **one})
    specs = load_workload(args.workload, random.Random(args.seed), num_sessions=args.sessions,
                          session_rate_per_s=args.session_rate)
    opts["closed_loop"] = args.closed_loop
    if args.sweep:
        results = sweep(specs, args.sweep, perf, slo, **opts)
    else:
        results = [simulate(specs, prefill, decode, perf, slo, autoscaler, **opts, **one)]
    print(f"workload {args.workload}: {len(specs)} requests; SLO TTFT <= {slo.ttft_s} s, TPOT <= {slo.tpot_s} s")
    print(format_table(results))
    return 0


def _simulate_ramp(args, prefill, decode, perf, slo, autoscaler, opts) -> int:
    rates = [float(r) for r in args.ramp.split(",") if r.strip()]
    step_s = args.step_s or 60.0
    plan = ramp_plan(args.workload, rates, step_s, args.seed)
    result = run_ramp(plan, prefill, decode, perf, slo, autoscaler, **opts)
    print(f"workload {args.workload}: ramp {args.ramp} new sessions/s, {step_s:g} s each, "
          f"{len(result.requests)} requests sent (closed loop); start {result.summary.label}; "
          f"SLO TTFT <= {slo.ttft_s} s, TPOT <= {slo.tpot_s} s")
    print_ramp(result, plan, rates, slo)
    if args.out:
        label = args.label or f"ramp-{prefill}p{decode}d" + ("-autoscaled" if autoscaler else "")
        config = {"workload": args.workload, "seed": args.seed, "perf": perf.to_dict(), "start": [prefill, decode],
                  "autoscaler": autoscaler.to_dict() if autoscaler else None, "max_workers": args.max_workers,
                  "worker_startup_s": args.worker_startup_s, "cluster_config": args.config,
                  "router_limits": ({**{k: dataclasses.asdict(opts[k]) for k in ("admission", "overload")},
                                     "batch_guard": opts["batch_guard"]} if "admission" in opts else None)}
        for p in write_ramp(ramp_report(result, plan, rates, step_s, slo, label, config), args.out, label):
            print(f"wrote {p}")
    return 0


LOAD_FROM_HELP = ("add what a loaded worker pays beyond an idle cluster's figures (each arriving request's host "
                  "time, steps mixing decodes with prefill chunks, per-sequence and per-step host time), fitted "
                  "on these recorded runs' step traces (bench/record_run.py directories of this model on this "
                  "device)")


def register(sub) -> None:
    pr = sub.add_parser("profile", help="time the engine and fit the simulator's performance model")
    pr.add_argument("--model", default="smollm2-135m")
    pr.add_argument("--device", default="cpu")
    pr.add_argument("--dtype", default="float32")
    pr.add_argument("--output", "-o", help="write the samples and fitted model as JSON")
    pr.add_argument("--quick", action="store_true", help="fewer samples")
    pr.add_argument("--speculative", default="ngram", help="the proposer of the timed engine steps "
                    "(off, ngram): what the served engine runs")
    pr.add_argument("--sizes", choices=sorted(SIZES), help="prompt lengths, contexts and batches timed "
                    "(default: large on cuda, small on cpu)")
    pr.add_argument("--threads", type=int, help="torch CPU threads while timing (a CPU pool actor has its "
                                                "pool's num_cpus, 1 by default)")
    pr.add_argument("--from", dest="from_profile", metavar="FILE",
                    help="refit an earlier profile's timings (its JSON) instead of timing the engine again")
    pr.add_argument("--bench-json", help="set the speculation terms (drafts verified and tokens emitted per "
                                         "step) from this `tandem bench` run's usage")
    pr.add_argument("--target", help="also fit the served step's host time and the control path on this "
                                     "running, idle cluster (HOST:PORT)")
    pr.add_argument("--load-from", nargs="+", metavar="RUN_DIR", help=LOAD_FROM_HELP)
    pr.add_argument("--vocab-size", type=int, default=49152, help="the served model's (for --target probes)")
    pr.add_argument("--local-prefill-threshold", type=float, default=256,
                    help="the cluster's decode.local_prefill_threshold (for --target probes)")
    pr.set_defaults(func=cmd_profile)
    _register_simulate(sub)


def _register_simulate(sub) -> None:
    sm = sub.add_parser("simulate", help="what-if: replay a workload against N prefill and M decode workers")
    sm.add_argument("--workload", default="coding-agent", help="coding-agent, coding-agent-small, or a "
                                                                "Mooncake .jsonl / Azure .csv trace")
    sm.add_argument("--prefill", type=int, help="prefill workers (default: --config's replicas, else 1)")
    sm.add_argument("--decode", type=int, help="decode workers (default: --config's replicas, else 1)")
    sm.add_argument("--sweep", type=int, metavar="GPUS", help="every prefill:decode split of GPUS workers, "
                                                             "and all of them colocated")
    sm.add_argument("--perf", help="perf model JSON from `tandem profile` (default: assumed 8B on H200)")
    sm.add_argument("--load-from", nargs="+", metavar="RUN_DIR", help=LOAD_FROM_HELP)
    sm.add_argument("--prefill-queue-limit", type=float,
                    help="the cluster's prefill.max_queued_tokens (default: the perf model's, inf)")
    sm.add_argument("--sessions", type=int, default=50)
    sm.add_argument("--session-rate", type=float, default=1.0, help="new sessions per second")
    sm.add_argument("--ttft-slo", type=float, default=2.0)
    sm.add_argument("--tpot-slo", type=float, default=0.05)
    sm.add_argument("--closed-loop", action="store_true", help="next turn after the answer + think time")
    sm.add_argument("--no-pull-prefix", action="store_true",
                    help="prefill workers recompute prefixes the decode worker holds (Tandem pulls them)")
    sm.add_argument("--seed", type=int, default=0)
    sm.add_argument("--config", help="a cluster YAML as for `tandem up`: pool sizes, decode.local_prefill_threshold, "
                                     "prefill.max_queued_tokens, scheduler slots and step tokens, the autoscaler")
    sm.add_argument("--autoscale", action="store_true",
                    help="run the autoscaler policy in the loop (settings: --config's autoscaler section)")
    sm.add_argument("--max-workers", type=int, metavar="GPUS",
                    help="workers in all: a scale-up past it waits for a drained worker's slot")
    sm.add_argument("--worker-startup-s", type=float, default=60.0, help="a new worker's start-up time (default 60)")
    sm.add_argument("--ramp", metavar="RATES", help="e.g. 0.5,2,4,2,0.5: new sessions/s per step, as `tandem bench "
                                                    "--rates RATES --duration STEP_S` sends them (closed loop)")
    sm.add_argument("--step-s", type=float, help="seconds of arrivals per --ramp step (default 60)")
    sm.add_argument("--out", help="with --ramp: write sim-LABEL.json (tandem bench's shape) and, autoscaled, "
                                  "sim-LABEL-timeline.png here")
    sm.add_argument("--label", help="names the --out files (default: ramp-<P>p<D>d[-autoscaled])")
    sm.add_argument("--no-admission", action="store_true",
                    help="shed nothing at the router: no admission limiter (max_expected_wait_s) and no worker "
                         "overload limits (worker_max_*); by default they run as --config (else a default "
                         "router) sets them, as the live router does")
    sm.add_argument("--retries", type=int, default=0, metavar="N",
                    help="clients send a refused turn again after the router's retry hint, up to N times, "
                         "as `tandem bench --retries N` does (default 0: the session goes on)")
    add_compare_args(sm)
    sm.set_defaults(func=cmd_simulate)
