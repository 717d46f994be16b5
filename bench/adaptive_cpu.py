"""The adaptive layout live on CPU (issue 22): a load that shifts from prompt-heavy (long prompts at a
fixed arrival rate, few output tokens, a few sequences decoding beside them) to decode-heavy (short
prompts, long outputs, closed loop) through a real local cluster of `smollm2-135m` workers (Ray
actors, gRPC router, KV over gloo), in the adaptive layout (every worker mixed, prompts placed by the
cost model, the controller's role policy lending workers to prefill) and colocated (the same number
of workers, each prefilling its own prompts). Prints, per layout and phase: requests, OK, TTFT and
TPOT p50/p90 and goodput (requests/s inside both SLOs), the router's placements, the role-change log
with times and reasons, and the policy's view every few seconds (the demand the controller measures
and the split it plans, recomputed here from the same stats and perf model).

The policy plans with this machine's numbers: the engine is profiled first (`tandem profile`'s
`profile_engine` + `PerfModel.fit`, one torch thread as a pool actor has), then the served step and
the per-request control path are fitted on an idle one-worker cluster (cluster/calibration.py). The
SLOs and the prompt-heavy rate default to figures derived from that model (see
`choose_slos_and_rate`); `--perf` reuses a fitted model (`--json X.json` writes it to X.perf.json).
Results and how to read them: docs/benchmarks.md, "Adaptive layout on CPU (issue 22)".

    .venv/bin/python bench/adaptive_cpu.py [--workers 2] [--prompt-heavy-s 90] [--decode-heavy-s 60]
        [--rate R] [--slo-ttft-ms T] [--slo-tpot-ms P] [--perf model.json] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
import threading
import time
from dataclasses import dataclass, field, replace

import ray
import torch

from tandem.cluster.calibration import calibrate_on_cluster
from tandem.cluster.config import ADAPTIVE
from tandem.cluster.local import RunningCluster
from tandem.cluster.profiling import profile_engine
from tandem.cluster.roles import demand_over, prompt_counters
from tandem.engine.weights import load_tokenizer
from tandem.perf_model import PerfModel
from tandem.placement import Demand, plan_roles
from tandem.protos.tandem.v1 import generation_pb2 as pb

MODEL = "smollm2-135m"


@dataclass(frozen=True)
class Load:
    """The two phases. Prompt-heavy: `long_tokens`-token prompts at `rate` per second (fixed spacing,
    the same schedule for every layout) with `long_out` tokens out, beside `background` closed-loop
    streams of short prompts; decode-heavy: `streams` closed-loop streams of `short_tokens`-token
    prompts with `short_out` tokens out."""

    prompt_heavy_s: float
    decode_heavy_s: float
    rate: float
    long_tokens: int
    long_out: int
    background: int
    streams: int
    short_tokens: int
    short_out: int


@dataclass
class Run:
    """One layout's records."""

    layout: str
    records: list = field(default_factory=list)     # one dict per request
    view: list = field(default_factory=list)        # the policy's view, every few seconds
    roles: list = field(default_factory=list)       # (s since start, worker, from, to, reason)
    counters: dict = field(default_factory=dict)
    phase_s: dict = field(default_factory=dict)     # phase -> its seconds
    load_avg: list = field(default_factory=list)    # the machine's 1-min load average, at start and end


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


# ---- the perf model the policy plans with ---------------------------------------------------------
def fit_perf(remote_overhead_s: float) -> PerfModel:
    """The engine's forward passes on this machine with one torch thread (a pool actor's), then the
    served step and the per-request control path on an idle one-worker cluster. The remote prefill's
    extra control path is given (`--remote-overhead-ms`): its probe on a 1 prefill + 1 decode cluster
    hung on the loaded machine (a gloo rendezvous timed out after 60 s), and the benchmark must not."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    samples = profile_engine(MODEL, quick=True)
    torch.set_num_threads(threads)
    perf = PerfModel.fit(samples, local_prefill_threshold=0, block_tokens=16, max_step_tokens=2048)
    c = RunningCluster({"model.name": MODEL, "cache.num_blocks": 1024, "prefill.replicas": 0, "decode.replicas": 1,
                        "decode.local_prefill_threshold": float("inf")})
    try:
        perf, steps = calibrate_on_cluster(c.stub, perf, vocab_size=load_tokenizer(MODEL)[1].vocab_size,
                                           threshold=float("inf"), batches=(1, 4), prompt_tokens=32, output_tokens=48)
    finally:
        c.close()
    print(f"served steps: {steps}")
    return replace(perf, remote_overhead_s=remote_overhead_s)


def phase_demands(load: Load, rate: float) -> dict[str, Demand]:
    """Each phase's nominal demand (prompt tokens/s, prompt sizes, sequences decoding, their KV)."""
    ctx = load.short_tokens + load.short_out // 2
    return {"prompt-heavy": Demand(rate * load.long_tokens, load.long_tokens, load.long_tokens, load.background,
                                   load.background * ctx),
            "decode-heavy": Demand(0.0, load.short_tokens, load.short_tokens, load.streams, load.streams * ctx)}


def lend_gain(perf, d: Demand, workers: int, slo: tuple[float, float]) -> tuple[bool, float]:
    """(whether the best split with prefill-only workers keeps 0.1 of both SLOs in hand, how much
    more headroom it predicts than none)."""
    plans = plan_roles(perf, d, workers, *slo)
    h0 = next(o.headroom for o in plans if o.prefill_workers == 0)
    lent = max(o.headroom for o in plans if o.prefill_workers > 0)
    return lent >= 0.1, lent - h0


def choose_slos_and_rate(perf, load: Load, a) -> tuple[float, float, float]:
    """(TTFT SLO s, TPOT SLO s, long prompts/s) where not given: TPOT `a.tpot_x` times the model's
    step of a worker's share of the background batch, TTFT `a.ttft_x` times a long prompt's prefill;
    the rate (0.05 steps) at which the model predicts lending gains most, preferring rates at which the
    lent split keeps 0.1 of both SLOs in hand."""
    per_worker = -(-load.background // a.workers)
    ctx = per_worker * (load.short_tokens + load.short_out // 2)
    tpot = a.slo_tpot_ms / 1e3 if a.slo_tpot_ms else a.tpot_x * perf.tpot_s(per_worker + 1, ctx)
    ttft = a.slo_ttft_ms / 1e3 if a.slo_ttft_ms else a.ttft_x * perf.prefill_s(load.long_tokens, load.long_tokens)
    rate = a.rate
    if not rate:
        rates = [0.05 * i for i in range(1, 61)]
        rate = max(rates, key=lambda r: lend_gain(perf, phase_demands(load, r)["prompt-heavy"], a.workers,
                                                  (ttft, tpot)))
    return ttft, tpot, rate


def predicted(perf, load: Load, rate: float, workers: int, slo: tuple[float, float]) -> None:
    """The plan at each phase's nominal demand, before anything runs."""
    for name, d in phase_demands(load, rate).items():
        plans = plan_roles(perf, d, workers, *slo)
        print(f"plan at the {name} phase's nominal demand: " + ", ".join(
            f"{o.prefill_workers} prefill-only: headroom {o.headroom:+.2f} (TTFT {o.ttft_s * 1e3:.0f} ms, "
            f"TPOT {o.tpot_s * 1e3:.0f} ms)" for o in plans))


# ---- driving the load -----------------------------------------------------------------------------
class Driver:
    """Requests on threads against one cluster; one record per request."""

    def __init__(self, cluster, run: Run, t0: float, vocab: int):
        self.c, self.run, self.t0, self.vocab = cluster, run, t0, vocab
        self.threads: list[threading.Thread] = []
        self.lock = threading.Lock()

    def request(self, phase: str, kind: str, ids: list[int], out: int) -> None:
        rec = {"phase": phase, "kind": kind, "start_s": time.perf_counter() - self.t0, "prompt": len(ids), "ok": False}
        req = pb.GenerateRequest(prompt_token_ids=ids, sampling=pb.SamplingParams(max_tokens=out, ignore_eos=True))
        t0, times = time.perf_counter(), []
        try:
            for r in self.c.stub.Generate(req, timeout=600):
                times += [time.perf_counter()] * len(r.token_ids)
            rec.update(ok=len(times) == out, ttft=times[0] - t0,
                       tpot=(times[-1] - times[0]) / max(1, len(times) - 1) if len(times) > 1 else None)
        except Exception as e:  # noqa: BLE001 - recorded, counted as not OK
            rec["error"] = repr(e)[:200]
        with self.lock:
            self.run.records.append(rec)

    def spawn(self, fn, *args) -> None:
        t = threading.Thread(target=fn, args=args, daemon=True)
        t.start()
        self.threads.append(t)

    def streams(self, phase: str, n: int, tokens: int, out: int, until: float, seed: str) -> None:
        def stream(i: int) -> None:
            rng = random.Random(f"{seed}-{i}")
            while time.perf_counter() < until:
                self.request(phase, "stream", [rng.randrange(3, self.vocab) for _ in range(tokens)], out)
        for i in range(n):
            self.spawn(stream, i)

    def arrivals(self, phase: str, rate: float, tokens: int, out: int, until: float, seed: str) -> None:
        rng, t = random.Random(seed), time.perf_counter()
        while t < until:
            self.spawn(self.request, phase, "long", [rng.randrange(3, self.vocab) for _ in range(tokens)], out)
            t += 1.0 / rate
            time.sleep(max(0.0, t - time.perf_counter()))

    def join(self) -> None:
        for t in self.threads:
            t.join(900)


def watch(c, perf, workers: int, slo: tuple[float, float], window_s: float, run: Run, t0: float,
          stop: threading.Event, every_s: float = 4.0) -> None:
    """The policy's view from the controller's stats, as the controller takes it: the demand over
    the last `window_s` and the best split."""
    q: list = []
    while not stop.wait(every_s):
        state = ray.get(c.cluster.controller.cluster_state.remote())
        live = [w for w in state.workers if w.state == "ready" and w.stats is not None]
        q.append(prompt_counters(live, time.monotonic(), 16))
        while len(q) > 1 and q[1].at <= q[-1].at - window_s:
            q.pop(0)
        d = demand_over(q)
        best = plan_roles(perf, d, workers, *slo)
        run.view.append({"t_s": round(time.perf_counter() - t0, 1), "prompt_tok_s": round(d.prompt_tokens_per_s),
                         "decoding": round(d.decode_seqs), "roles": "".join(w.role[0] for w in live),
                         "best_k": best[0].prefill_workers,
                         "headroom": {o.prefill_workers: round(o.headroom, 2) for o in best}})


def run_layout(layout: str, perf_path: str, perf: PerfModel, a, load: Load) -> Run:
    common = {"model.name": a.model, "cache.num_blocks": 1024, "prefill.replicas": 0, "decode.replicas": a.workers,
              "router.perf_model": perf_path, "router.slo_ttft_ms": a.slo_ttft_ms, "router.slo_tpot_ms": a.slo_tpot_ms,
              # measure every request: no shedding by predicted wait, nor by the batch guard
              "router.max_expected_wait_s": 600.0, "router.batch_guard": False}
    layouts = {"adaptive": {**ADAPTIVE, "roles.period_s": a.period_s, "roles.min_hold_s": a.min_hold_s,
                            "roles.margin": a.margin, "roles.window_s": a.window_s},
               # the adaptive layout with its role policy off: cost placement (and its chunk sizes) alone
               "cost-only": {**ADAPTIVE, "roles.enabled": False},
               "colocated": {"decode.local_prefill_threshold": float("inf")}}
    c = RunningCluster({**common, **layouts[layout]})
    run, stop = Run(layout), threading.Event()
    try:
        run.load_avg.append(round(os.getloadavg()[0], 1))
        t0 = time.perf_counter()
        drv = Driver(c, run, t0, load_tokenizer(a.model)[1].vocab_size)
        slo = (a.slo_ttft_ms / 1e3, a.slo_tpot_ms / 1e3)
        watcher = threading.Thread(target=watch, args=(c, perf, a.workers, slo, a.window_s, run, t0, stop),
                                   daemon=True)
        watcher.start()
        end1 = t0 + load.prompt_heavy_s
        drv.streams("prompt-heavy", load.background, load.short_tokens, load.short_out, end1, "bg")
        drv.arrivals("prompt-heavy", load.rate, load.long_tokens, load.long_out, end1, "long")
        end2 = end1 + load.decode_heavy_s
        drv.streams("decode-heavy", load.streams, load.short_tokens, load.short_out, end2, "dh")
        time.sleep(max(0.0, end2 - time.perf_counter()))
        drv.join()
        stop.set()
        run.phase_s = {"prompt-heavy": load.prompt_heavy_s, "decode-heavy": load.decode_heavy_s}
        wall0 = time.time() - (time.perf_counter() - t0)
        run.roles = [(round(x.at_unix_s - wall0, 1), x.worker_id, x.from_role, x.to_role, x.reason)
                     for x in ray.get(c.cluster.controller.role_log.remote())]
        run.counters = dict(c.routers[0][1].counters)
        run.load_avg.append(round(os.getloadavg()[0], 1))
        run.counters["blocks_held_at_end"] = sum(c.wait_idle().values())
    finally:
        stop.set()
        c.close()
    return run


# ---- the report -----------------------------------------------------------------------------------
def phase_rows(run: Run, slo_ttft_s: float, slo_tpot_s: float) -> list[dict]:
    rows = []
    for phase, secs in run.phase_s.items():
        recs = [r for r in run.records if r["phase"] == phase]
        ok = [r for r in recs if r["ok"]]
        ttft = [r["ttft"] for r in ok]
        tpot = [r["tpot"] for r in ok if r["tpot"] is not None]
        def good(x: float) -> int:
            return sum(1 for r in ok if r["ttft"] <= x * slo_ttft_s and (r["tpot"] is None or r["tpot"] <= x * slo_tpot_s))
        rows.append({"layout": run.layout, "phase": phase, "requests": len(recs), "ok": len(ok),
                     "ttft_p50_ms": pct(ttft, .5) * 1e3, "ttft_p90_ms": pct(ttft, .9) * 1e3,
                     "tpot_p50_ms": pct(tpot, .5) * 1e3, "tpot_p90_ms": pct(tpot, .9) * 1e3,
                     "goodput": good(1) / secs, "good": good(1), "goodput_2x": good(2) / secs, "good_2x": good(2),
                     "long_ttft_p90_ms": pct([r["ttft"] for r in ok if r["kind"] == "long"], .9) * 1e3})
    return rows


def report(runs: list[Run], a) -> list[dict]:
    slo_ttft_s, slo_tpot_s = a.slo_ttft_ms / 1e3, a.slo_tpot_ms / 1e3
    rows = [row for run in runs for row in phase_rows(run, slo_ttft_s, slo_tpot_s)]
    print(f"\n{a.model} on CPU, {a.workers} workers; SLOs TTFT <= {a.slo_ttft_ms:g} ms, TPOT <= {a.slo_tpot_ms:g} ms "
          "(goodput: requests/s of the phase inside both)\n")
    print("| layout | phase | requests | OK | TTFT p50 | TTFT p90 | TPOT p50 | TPOT p90 | goodput (req/s) | "
          "at 2x the SLOs | long prompts' TTFT p90 |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['layout']} | {r['phase']} | {r['requests']} | {r['ok']} | {r['ttft_p50_ms']:.0f} ms | "
              f"{r['ttft_p90_ms']:.0f} ms | {r['tpot_p50_ms']:.0f} ms | {r['tpot_p90_ms']:.0f} ms | "
              f"{r['goodput']:.3f} ({r['good']}) | {r['goodput_2x']:.3f} ({r['good_2x']}) | "
              f"{r['long_ttft_p90_ms']:.0f} ms |")
    for run in runs:
        print(f"\n{run.layout}: router {run.counters}; 1-min load average at start, end: {run.load_avg}")
        for t, wid, old, new, why in run.roles:
            print(f"  t={t:6.1f} s  {wid}: {old} -> {new}  ({why})")
        if run.layout == "adaptive":
            print("  the policy's view (t s, prompt tokens/s, decoding, roles, best split, headroom by split):")
            for v in run.view:
                print(f"    {v['t_s']:6.1f} {v['prompt_tok_s']:6d} {v['decoding']:3d} {v['roles']:>4} "
                      f"k={v['best_k']} {v['headroom']}")
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--model", default=MODEL, help="another model only with --perf (the profile is of smollm2-135m)")
    p.add_argument("--layouts", default="adaptive,colocated", help="of adaptive, cost-only, colocated")
    p.add_argument("--prompt-heavy-s", type=float, default=60)
    p.add_argument("--decode-heavy-s", type=float, default=45)
    p.add_argument("--rate", type=float, help="long prompts per second in the prompt-heavy phase "
                   "(default: where the calibrated model predicts lending gains most)")
    p.add_argument("--long-tokens", type=int, default=512)
    p.add_argument("--long-out", type=int, default=8)
    p.add_argument("--background", type=int, default=2, help="decoding streams beside the long prompts")
    p.add_argument("--streams", type=int, default=6, help="decode-heavy streams")
    p.add_argument("--short-tokens", type=int, default=32)
    p.add_argument("--short-out", type=int, default=96)
    p.add_argument("--slo-ttft-ms", type=float, help="default: --ttft-x times a long prompt's predicted prefill")
    p.add_argument("--slo-tpot-ms", type=float, help="default: --tpot-x times the predicted step beside the "
                   "background streams")
    p.add_argument("--ttft-x", type=float, default=6.0)
    p.add_argument("--tpot-x", type=float, default=1.5)
    p.add_argument("--period-s", type=float, default=2.0)
    p.add_argument("--min-hold-s", type=float, default=10.0)
    p.add_argument("--margin", type=float, default=0.1)
    p.add_argument("--window-s", type=float, default=30.0, help="roles.window_s: the demand's window")
    p.add_argument("--remote-overhead-ms", type=float, default=80.0,
                   help="a remote prefill's extra control path (this machine: 77-101 ms, docs/benchmarks.md)")
    p.add_argument("--perf", help="a perf model JSON to plan with instead of profiling this machine")
    p.add_argument("--dry-run", action="store_true", help="only the perf model, the SLOs, the rate and the plans")
    p.add_argument("--json", help="write the rows, role logs and views here")
    a = p.parse_args()
    load = Load(a.prompt_heavy_s, a.decode_heavy_s, 0.0, a.long_tokens, a.long_out, a.background, a.streams,
                a.short_tokens, a.short_out)
    ray.init(num_cpus=4, resources={"tandem_prefill": 8, "tandem_decode": 8}, include_dashboard=False,
             object_store_memory=256 << 20, log_to_driver=False, logging_level="ERROR")
    try:
        perf = PerfModel.load(a.perf) if a.perf else fit_perf(a.remote_overhead_ms / 1e3)
        ttft, tpot, rate = choose_slos_and_rate(perf, load, a)
        a.slo_ttft_ms, a.slo_tpot_ms, a.rate, load = ttft * 1e3, tpot * 1e3, rate, replace(load, rate=rate)
        print("perf model:", json.dumps(perf.to_dict()))
        if a.json and not a.perf:      # to plan with the same model again: --perf
            with open(a.json.removesuffix(".json") + ".perf.json", "w") as f:
                json.dump({"perf_model": perf.to_dict()}, f)
        print(f"SLOs: TTFT {a.slo_ttft_ms:.0f} ms, TPOT {a.slo_tpot_ms:.0f} ms; prompt-heavy: {rate:.2f} prompts/s "
              f"of {load.long_tokens} tokens")
        predicted(perf, load, rate, a.workers, (ttft, tpot))
        if a.dry_run:
            return
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
            json.dump({"perf_model": perf.to_dict()}, f)
        runs = [run_layout(layout, f.name, perf, a, load) for layout in a.layouts.split(",")]
    finally:
        ray.shutdown()
    rows = report(runs, a)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "perf_model": perf.to_dict(), "rows": rows,
                       "runs": [{"layout": r.layout, "roles": r.roles, "view": r.view, "counters": r.counters,
                                 "load_avg": r.load_avg, "records": r.records}
                                for r in runs]}, f, indent=1)


if __name__ == "__main__":
    main()
