"""Cluster layouts for the same GPUs: disaggregated P:D splits and colocated replicas, as the
`tandem up` configs a comparison starts, and the simulator's prediction of one layout on the very
requests `tandem bench` sends it (`predict`). Pure but for the simulator's seeded randomness."""

from __future__ import annotations

import math
import random
from dataclasses import fields, replace

from tandem.cluster.loadgen import load_sessions, parse_workload, plan_sessions, sessions_needed
from tandem.cluster.config import ADAPTIVE, RouterConfig
from tandem.cluster.roles import RoleConfig
from tandem.cluster.sim_model import SLO, SimSummary
from tandem.perf_model import PerfModel
from tandem.placement import OverloadLimits
from tandem.router.admission import AdmissionConfig
from tandem.cluster.simulator import simulate


def layout_name(n_prefill: int, n_decode: int) -> str:
    return f"{n_prefill}P:{n_decode}D" if n_prefill else f"colocated x{n_decode}"


def mode_configs(args) -> dict[str, dict]:
    """Both modes use every GPU: disaggregated splits them between the pools (prefill first), the
    colocated mode runs one replica per GPU. With `args.layouts` ("1:3,0:4"), one config per
    listed P:D split instead (0:N is N colocated replicas), named like `tandem simulate` names them.
    `args`: the comparison's options (model, device, chunk, max_num_seqs, speculative, num_blocks,
    gpus, prefill, threshold, layouts; prefill_queue_limit optional)."""
    gpu = 1 if args.device == "cuda" else 0
    common = {"model": {"name": args.model, "device": args.device,
                        "dtype": "bfloat16" if args.device == "cuda" else "float32"},
              "scheduler": {"max_num_batched_tokens": args.chunk, "max_num_seqs": args.max_num_seqs},
              "speculative": {"method": args.speculative},
              "router": {"host": "127.0.0.1", "metrics_port": None}}
    if args.num_blocks:
        common["cache"] = {"num_blocks": args.num_blocks}

    def layout(n_prefill: int, n_decode: int) -> dict:
        queue = getattr(args, "prefill_queue_limit", 0) or float("inf")
        # The same decode slots in every layout: --max-num-seqs per GPU, all held by the decode
        # actors (a 1P:1D decode actor holds 2 colocated replicas' sequences). With 64 per actor in
        # both modes the 1P:1D decode actor ran out of slots at 8 sessions/s, and local prefills
        # waited behind KV-delivered requests for 10-13 s (docs/benchmarks.md, issue 10).
        seqs = math.ceil(args.max_num_seqs * (n_prefill + n_decode) / n_decode)
        return {**common, "scheduler": {**common["scheduler"], "max_num_seqs": seqs},
                "prefill": {"replicas": n_prefill, "num_gpus": gpu, "max_queued_tokens": queue},
                "decode": {"replicas": n_decode, "num_gpus": gpu,
                           "local_prefill_threshold": args.threshold if n_prefill else float("inf")}}

    def adaptive(guard: bool) -> dict:
        # every GPU decodes and prefills (what `tandem up --layout adaptive` sets, config.ADAPTIVE);
        # the router's cost model plans on the comparison's SLOs and perf model
        cfg = {**common, "prefill": {"replicas": 0, "num_gpus": gpu}, "decode": {"replicas": args.gpus, "num_gpus": gpu},
               "router": {**common["router"], "perf_model": getattr(args, "perf", None),
                          "slo_ttft_ms": getattr(args, "ttft_slo_ms", 1000.0),
                          "slo_tpot_ms": getattr(args, "tpot_slo_ms", 40.0), "batch_guard": guard}}
        for dotted, value in ADAPTIVE.items():
            section, _, key = dotted.partition(".")
            cfg[section] = {**cfg.get(section, {}), key: value}
        return cfg

    if getattr(args, "layouts", None):
        return {(layout_name(*split) if isinstance(split, tuple) else
                 f"adaptive x{args.gpus}" + ("" if split == ADAPTIVE_NAME else " unguarded")):
                (layout(*split) if isinstance(split, tuple) else adaptive(split == ADAPTIVE_NAME))
                for split in parse_layouts(args.layouts)}
    n_prefill = args.prefill or max(1, args.gpus // 2)
    return {"disaggregated": layout(n_prefill, args.gpus - n_prefill), "colocated": layout(0, args.gpus)}


ADAPTIVE_NAME, UNGUARDED = "adaptive", "adaptive-unguarded"   # the second: router.batch_guard off


def parse_layouts(text: str) -> list[tuple[int, int] | str]:
    """"1:3,0:4,adaptive" -> [(1, 3), (0, 4), "adaptive"] (the adaptive layout on every GPU;
    UNGUARDED: the same without the router's batch guard); exits with a message on an item that is
    neither P:D nor one of those."""
    out: list[tuple[int, int] | str] = []
    for item in text.split(","):
        if item.strip() in (ADAPTIVE_NAME, UNGUARDED):
            out.append(item.strip())
            continue
        if item.strip() == "colocated":
            raise SystemExit("--layouts: name the colocated layout 0:N (N replicas)")
        p, _, d = item.partition(":")
        n_prefill, n_decode = int(p), int(d)
        if n_prefill < 0 or n_decode < 1:
            raise SystemExit(f"--layouts: {item!r} is not P:D with P >= 0 and D >= 1")
        out.append((n_prefill, n_decode))
    return out


def layout_perf(cluster: dict, perf: PerfModel) -> tuple[PerfModel, bool]:
    """The perf model as one layout (`cluster`: its `tandem up` config) runs it, and whether the
    layout is colocated (no prefill pool, or decode prefills everything itself)."""
    threshold = float(cluster["decode"]["local_prefill_threshold"])
    colocated = cluster["prefill"]["replicas"] == 0 or math.isinf(threshold)
    model = perf if colocated else replace(
        perf, local_prefill_threshold=threshold,
        prefill_queue_limit=float(cluster["prefill"].get("max_queued_tokens", math.inf)))
    seqs = (cluster.get("scheduler") or {}).get("max_num_seqs")
    if seqs:                         # the layout's decode slots per actor, as the bench set them
        model = replace(model, max_batch=int(seqs))
    return replace(model, overlap=engine_overlaps(cluster)), colocated


def recorded_perf(cluster: dict, perf: PerfModel) -> tuple[PerfModel, bool, int, int]:
    """The perf model as a recorded run's layout ran it (threshold, queue cap, decode slots, step
    token budget, KV per worker) -> (model, colocated, prefill workers, decode workers)."""
    model, colocated = layout_perf(cluster, perf)
    sched, cache = cluster.get("scheduler") or {}, cluster.get("cache") or {}
    over = {}
    if sched.get("max_num_batched_tokens"):
        over["max_step_tokens"] = int(sched["max_num_batched_tokens"])
    if cache.get("num_blocks"):
        over["kv_capacity_tokens"] = int(cache["num_blocks"]) * int(cache.get("block_size", 16))
    n_prefill = 0 if colocated else int(cluster["prefill"]["replicas"])
    return replace(model, **over), colocated, n_prefill, int(cluster["decode"]["replicas"])


def recorded_mode(cluster: dict, colocated: bool) -> dict:
    """`simulate`'s mode for a recorded or planned layout: the adaptive layout with its role
    policy (the `roles` section enabled), else colocated or not as `layout_perf` says."""
    roles = cluster.get("roles") or {}
    if roles.get("enabled"):
        return {"adaptive": RoleConfig(**{k: v for k, v in roles.items() if k != "enabled"})}
    return {"colocated": colocated}


def recorded_router(cluster: dict) -> RouterConfig:
    """The router config of a recorded or planned layout (its `router` section; RouterConfig's
    defaults for what it leaves out or no longer names)."""
    section = cluster.get("router") or {}
    return replace(RouterConfig(), **{f.name: section[f.name] for f in fields(RouterConfig) if f.name in section})


def router_limits(router: RouterConfig) -> dict:
    """`simulate`'s keyword arguments for the limits `router` enforces: its admission limiter
    (AdmissionConfig.of), its worker overload limits (OverloadLimits.of) and, where it places by
    cost (the adaptive layout), its batch guard. One place, so the replays, `tandem simulate` and
    the layout grid shed what the live router sheds."""
    return {"admission": AdmissionConfig.of(router), "overload": OverloadLimits.of(router),
            "batch_guard": router.batch_guard}


def bench_deadline(bench: dict) -> float | None:
    """Seconds from a rate's start at which `tandem bench` (its report's config) ends every call
    still running, DEADLINE_EXCEEDED: duration + drain timeout (None where it is not recorded)."""
    drain = bench.get("drain_timeout_s")
    return None if drain is None else float(bench["duration_s"]) + float(drain)


def bench_retries(bench: dict) -> dict:
    """simulate()'s retry options for a `tandem bench` report's config: the refused turns it sent
    again (`--retries`, 0 where not recorded), up to the end of its duration."""
    n = int(bench.get("retries") or 0)
    return {"retries": n, "retry_until_s": float(bench["duration_s"])} if n else {}


def engine_overlaps(cluster: dict) -> bool:
    """Whether the layout's decode engines overlap steps (`LLMEngine.overlap`: on CUDA, one rank,
    and no speculation, whose drafts read every token before the next step is scheduled)."""
    model = cluster.get("model") or {}
    method = (cluster.get("speculative") or {}).get("method", "off")
    ranks = int((cluster.get("decode") or {}).get("tensor_parallel_size") or model.get("tensor_parallel_size") or 1)
    return str(model.get("device", "cpu")).startswith("cuda") and method in (None, "off") and ranks == 1


def predict(cluster: dict, bench: dict, perf: PerfModel, rates=None) -> dict[float, SimSummary]:
    """The simulator's summary of one layout (`cluster`: its `tandem up` config) at `rates` (default:
    all) of `bench` (a `tandem bench` report's config: workload, seed, rates, duration_s,
    max_sessions, max_context, slo), on the very requests the bench sends: the same sessions, the
    same start times per rate, turns sent closed-loop and none due past the duration."""
    n_prefill, n_decode = cluster["prefill"]["replicas"], cluster["decode"]["replicas"]
    model, colocated = layout_perf(cluster, perf)
    c = bench
    kind, _ = parse_workload(c["workload"])
    n = min(c.get("max_sessions") or 10**9, sessions_needed(max(c["rates"]), c["duration_s"]))
    sessions = load_sessions(kind, None, random.Random(c["seed"]), num_sessions=n, max_context=c["max_context"])
    slo = SLO(c["slo"]["ttft_ms"] / 1e3, c["slo"]["tpot_ms"] / 1e3)
    out = {}
    for rate in c["rates"] if rates is None else rates:
        plan = plan_sessions(sessions, session_workload=True, rate=rate, duration_s=c["duration_s"],
                             max_sessions=c.get("max_sessions"))
        specs = [replace(t, arrival_s=sess.start_s) if i == 0 else t
                 for sess in plan for i, t in enumerate(sess.specs)]
        out[rate] = simulate(specs, n_prefill, n_decode, model, slo, closed_loop=True,
                             send_until_s=c["duration_s"], **router_limits(recorded_router(cluster)),
                             cancel_at_s=bench_deadline(c), **recorded_mode(cluster, colocated),
                             **bench_retries(c)).summary
    return out
