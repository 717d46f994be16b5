"""The headline comparison: on the same GPUs, disaggregated (prefill actors and decode actors on
separate GPUs, KV streamed between them) against colocated (every replica prefills and decodes its
own requests: decode's local-prefill threshold at infinity, no prefill pool), same engine, same
speculation, same workload at the same rates, driven through the gRPC API by `tandem bench`.

For each mode this starts `tandem up` with that mode's config, waits until grpc.health.v1 says
SERVING, runs `tandem bench` at every rate, stops the cluster, and at the end prints goodput per
rate for both modes side by side (with their ratio) and TPOT p90 per rate. Every run's full
`tandem bench` JSON is kept under --out.

    python bench/disagg_vs_colocated.py --model llama3-8b-random --device cuda --gpus 2 \
        --workload agent --rates 0.25,0.5,1 --duration 40 --out results/
    python bench/disagg_vs_colocated.py --model tiny-random --device cpu --workload agent-small \
        --rates 1,2 --duration 10 --out /tmp/e2e        # the same, small, on a CPU machine
    python bench/disagg_vs_colocated.py --compare results/   # table and comparison.png again
    python bench/disagg_vs_colocated.py --layouts 1:3,2:2,3:1,0:4 --rates 1,2,4 --duration 25 \
        --predict --perf bench/perf/h200-llama3-8b.json   # the simulator only, on this machine
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
import time
from contextlib import closing
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-c", "import sys; from cluster.cli import main; sys.exit(main())"]


def _free_port() -> int:
    with closing(socket.socket()) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def layout_name(n_prefill: int, n_decode: int) -> str:
    return f"{n_prefill}P:{n_decode}D" if n_prefill else f"colocated x{n_decode}"


def mode_configs(args) -> dict[str, dict]:
    """Both modes use every GPU: disaggregated splits them between the pools (prefill first), the
    colocated mode runs one replica per GPU. With --layouts, one config per listed P:D split
    instead (0:N is N colocated replicas), named like `tandem simulate` names them."""
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

    if getattr(args, "layouts", None):
        out = {}
        for item in args.layouts.split(","):
            p, _, d = item.partition(":")
            n_prefill, n_decode = int(p), int(d)
            if n_prefill < 0 or n_decode < 1:
                raise SystemExit(f"--layouts: {item!r} is not P:D with P >= 0 and D >= 1")
            out[layout_name(n_prefill, n_decode)] = layout(n_prefill, n_decode)
        return out
    n_prefill = args.prefill or max(1, args.gpus // 2)
    return {"disaggregated": layout(n_prefill, args.gpus - n_prefill), "colocated": layout(0, args.gpus)}


def _wait_serving(target: str, proc: subprocess.Popen, timeout_s: float) -> None:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"tandem up exited with {proc.returncode}")
            try:
                if stub.Check(health_pb2.HealthCheckRequest(), timeout=5).status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(1)
    raise TimeoutError(f"cluster at {target} not SERVING after {timeout_s}s")


def run_mode(name: str, config: dict, args, out: Path) -> dict:
    name = re.sub(r"[^A-Za-z0-9._-]", "_", name)   # file names (tandem bench does the same to labels)
    port = _free_port()
    config = {**config, "router": {**config["router"], "port": port}}
    cfg_path = out / f"config-{name}.yaml"
    cfg_path.write_text(yaml.safe_dump(config))       # inf is written as .inf
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    env.pop("RAY_ADDRESS", None)
    log = open(out / f"up-{name}.log", "wb")
    up = subprocess.Popen([*CLI, "up", "--config", str(cfg_path), "--no-auth"], stdout=log, stderr=subprocess.STDOUT,
                          env=env, cwd=ROOT, start_new_session=True)
    try:
        t0 = time.monotonic()
        _wait_serving(f"127.0.0.1:{port}", up, args.start_timeout)
        print(f"{name}: SERVING after {time.monotonic() - t0:.0f}s", flush=True)
        bench = [*CLI, "bench", "--target", f"127.0.0.1:{port}", "--workload", args.workload,
                 "--rates", args.rates, "--duration", str(args.duration), "--drain-timeout", str(args.drain),
                 "--seed", str(args.seed), "--out", str(out), "--label", name, "--no-progress",
                 "--ttft-slo-ms", str(args.ttft_slo_ms), "--tpot-slo-ms", str(args.tpot_slo_ms)]
        if args.max_context:
            bench += ["--max-context", str(args.max_context)]
        subprocess.run(bench, env=env, cwd=ROOT, check=True)
        return json.loads((out / f"bench-{name}.json").read_text())
    finally:
        up.send_signal(signal.SIGTERM)
        try:
            up.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(up.pid, signal.SIGKILL)
        log.close()


def compare(reports: dict[str, dict]) -> list[dict]:
    rows = []
    by_mode = {m: {run["rate"]: run["summary"] for run in r["runs"]} for m, r in reports.items()}
    rates = sorted(set.intersection(*(set(v) for v in by_mode.values())))
    for rate in rates:
        d, c = by_mode["disaggregated"][rate], by_mode["colocated"][rate]
        rows.append({"rate": rate, "goodput_disagg": d["goodput_rps"], "goodput_coloc": c["goodput_rps"],
                     "ratio": d["goodput_rps"] / c["goodput_rps"] if c["goodput_rps"] else float("inf"),
                     "tpot_p90_disagg_ms": d["tpot_ms"]["p90"], "tpot_p90_coloc_ms": c["tpot_ms"]["p90"],
                     "ttft_p90_disagg_ms": d["ttft_ms"]["p90"], "ttft_p90_coloc_ms": c["ttft_ms"]["p90"]})
    return rows


def _load_perf(perf_path: str | None):
    from tandem.cluster.simulator import PerfModel

    return PerfModel.from_dict(json.loads(Path(perf_path).read_text())) if perf_path else PerfModel()


def predict(cluster: dict, bench: dict, perf, rates=None) -> dict:
    """The simulator's summary of one layout (`cluster`: its `tandem up` config) at `rates` (default:
    all) of `bench` (a `tandem bench` report's config: workload, seed, rates, duration_s,
    max_sessions, max_context, slo), on the very requests the bench sends: the same sessions, the
    same start times per rate, turns sent closed-loop and none due past the duration.
    -> {rate: SimSummary}"""
    import random
    from dataclasses import replace

    from tandem.cluster.loadgen import load_sessions, parse_workload, plan_sessions, sessions_needed
    from tandem.cluster.simulator import SLO, simulate

    n_prefill, n_decode = cluster["prefill"]["replicas"], cluster["decode"]["replicas"]
    threshold = float(cluster["decode"]["local_prefill_threshold"])
    colocated = n_prefill == 0 or math.isinf(threshold)
    c = bench
    kind, _ = parse_workload(c["workload"])
    n = min(c.get("max_sessions") or 10**9, sessions_needed(max(c["rates"]), c["duration_s"]))
    sessions = load_sessions(kind, None, random.Random(c["seed"]), num_sessions=n, max_context=c["max_context"])
    model = perf if colocated else replace(
        perf, local_prefill_threshold=threshold,
        prefill_queue_limit=float(cluster["prefill"].get("max_queued_tokens", math.inf)))
    seqs = (cluster.get("scheduler") or {}).get("max_num_seqs")
    if seqs:                         # the layout's decode slots per actor, as the bench set them
        model = replace(model, max_batch=int(seqs))
    slo = SLO(c["slo"]["ttft_ms"] / 1e3, c["slo"]["tpot_ms"] / 1e3)
    out = {}
    for rate in c["rates"] if rates is None else rates:
        plan = plan_sessions(sessions, session_workload=True, rate=rate, duration_s=c["duration_s"],
                             max_sessions=c.get("max_sessions"))
        specs = [replace(t, arrival_s=sess.start_s) if i == 0 else t
                 for sess in plan for i, t in enumerate(sess.specs)]
        out[rate] = simulate(specs, n_prefill, n_decode, model, slo, colocated=colocated, closed_loop=True,
                             send_until_s=c["duration_s"]).summary
    return out


def simulate_beside(reports: dict[str, dict], out: Path, perf_path: str | None) -> list[dict]:
    """The simulator's prediction (`predict`) for every measured layout and rate, on the very
    requests the bench sent. The perf model is `tandem profile`'s JSON (--perf) or the simulator's
    assumed 8B-on-H200 default. Prints and returns rows of measured / predicted goodput, TTFT p90
    and TPOT p90 (simulated.json too)."""
    perf = _load_perf(perf_path)
    print(f"\nsimulator beside measurement (perf model: {perf_path or 'assumed 8B on H200'}): "
          "measured / predicted")
    print(f"{'layout':>14} {'rate':>5} {'goodput':>13} {'TTFT p90 ms':>15} {'TPOT p90 ms':>15}")
    rows = []
    for name, report in reports.items():
        slug = re.sub(r"[^A-Za-z0-9._-]", "_", name)
        cluster = yaml.safe_load((out / f"config-{slug}.yaml").read_text())
        predicted = predict(cluster, report["config"], perf, [run["rate"] for run in report["runs"]])
        for run in report["runs"]:
            sim = predicted[run["rate"]]
            m = run["summary"]
            row = {"layout": name, "rate": run["rate"],
                   "goodput": (m["goodput_rps"], sim.goodput_rps),
                   "ttft_p90_ms": (m["ttft_ms"]["p90"], 1e3 * sim.ttft_p90 if sim.ttft_p90 is not None else None),
                   "tpot_p90_ms": (m["tpot_ms"]["p90"], 1e3 * sim.tpot_p90 if sim.tpot_p90 is not None else None),
                   "requests": (m["requests"], sim.requests)}
            rows.append(row)
            pair = lambda v, f: "/".join("-" if x is None else f.format(x) for x in v)  # noqa: E731
            print(f"{name:>14} {run['rate']:>5g} {pair(row['goodput'], '{:.2f}'):>13} "
                  f"{pair(row['ttft_p90_ms'], '{:.0f}'):>15} {pair(row['tpot_p90_ms'], '{:.1f}'):>15}")
    (out / "simulated.json").write_text(json.dumps({"perf": perf.to_dict(), "rows": rows}, indent=1))
    return rows


def print_predictions(configs: dict[str, dict], args) -> list[dict]:
    """--predict: the simulator's prediction for every layout and rate, on the requests the bench
    would send (workload, seed, duration cut-off, --max-context or the preset model's context),
    with no cluster started. Prints goodput and TTFT / TPOT p50, p90, p99 (predicted.json too)."""
    from tandem.engine.config import PRESETS

    context = args.max_context or (PRESETS[args.model].max_position_embeddings if args.model in PRESETS else 0)
    if not context:
        raise SystemExit(f"--predict: give --max-context for {args.model!r} (not a preset)")
    bench = {"workload": args.workload, "seed": args.seed, "max_sessions": None, "duration_s": args.duration,
             "rates": [float(r) for r in args.rates.split(",")], "max_context": context,
             "slo": {"ttft_ms": args.ttft_slo_ms, "tpot_ms": args.tpot_slo_ms}}
    perf = _load_perf(args.perf)
    print(f"predicted (perf model: {args.perf or 'assumed 8B on H200'}; {args.workload}, {args.duration:g} s per "
          f"rate, seed {args.seed}); SLOs TTFT <= {args.ttft_slo_ms:g} ms and TPOT <= {args.tpot_slo_ms:g} ms")
    print(f"{'layout':>14} {'rate':>5} {'sent':>5} {'goodput':>8} {'TTFT ms p50/p90/p99':>22} "
          f"{'TPOT ms p50/p90/p99':>22} {'SLO met':>8}")
    rows = []
    for name, cluster in configs.items():
        for rate, sim in predict(cluster, bench, perf).items():
            trio = lambda a, b, c, f: "/".join(f.format(x * 1e3) for x in (a, b, c))  # noqa: E731
            print(f"{name:>14} {rate:>5g} {sim.requests:>5} {sim.goodput_rps:>8.2f} "
                  f"{trio(sim.ttft_p50, sim.ttft_p90, sim.ttft_p99, '{:.0f}'):>22} "
                  f"{trio(sim.tpot_p50, sim.tpot_p90, sim.tpot_p99, '{:.1f}'):>22} {sim.slo_attainment:>8.1%}")
            rows.append({"layout": name, "rate": rate, "decode_slots": cluster["scheduler"]["max_num_seqs"],
                         **{k: v for k, v in vars(sim).items() if k != "label"}})
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "predicted.json").write_text(json.dumps({"perf": perf.to_dict(), "bench": bench, "rows": rows}, indent=1))
    print(f"wrote {out / 'predicted.json'}")
    plot_predictions(rows, bench["slo"], out / "predicted.png",
                     f"{args.model}, {args.workload}: simulated layouts ({args.perf or 'assumed perf model'})")
    return rows


def plot_predictions(rows: list[dict], slo: dict, path: Path, title: str) -> None:
    """Goodput, TTFT p90 and TPOT p90 against rate, one line per layout (with matplotlib)."""
    try:
        import matplotlib
    except ImportError:
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    panels = ((axes[0], "goodput_rps", 1, "goodput (requests/s within both SLOs)", None),
              (axes[1], "ttft_p90", 1e3, "TTFT p90 (ms, log)", slo["ttft_ms"]),
              (axes[2], "tpot_p90", 1e3, "TPOT p90 (ms)", slo["tpot_ms"]))
    layouts = list(dict.fromkeys(r["layout"] for r in rows))
    for ax, key, scale, ylabel, limit in panels:
        for name in layouts:
            mine = [r for r in rows if r["layout"] == name]
            ax.plot([r["rate"] for r in mine], [r[key] * scale for r in mine], "o-", label=name)
        if limit is not None:
            ax.axhline(limit, color="grey", linestyle="--", label="SLO")
        ax.set(xlabel="offered rate (new sessions / s)", ylabel=ylabel,
               yscale="log" if key == "ttft_p90" else "linear")
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}")


def print_layouts(reports: dict[str, dict], out: Path) -> None:
    """One row per layout and rate: goodput and TTFT / TPOT p50, p90, p99 (layouts.json too)."""
    slo = next(iter(reports.values()))["config"]["slo"]
    print(f"\nSLOs TTFT <= {slo['ttft_ms']:g} ms and TPOT <= {slo['tpot_ms']:g} ms per request")
    print(f"{'layout':>14} {'rate':>5} {'ok':>4} {'failed':>6} {'goodput':>8} {'TTFT ms p50/p90/p99':>22} "
          f"{'TPOT ms p50/p90/p99':>22}")
    rows = []
    for name, report in reports.items():
        for run in report["runs"]:
            sm = run["summary"]
            t, p = sm["ttft_ms"], sm["tpot_ms"]
            fmt = lambda d, f: "/".join("-" if d[k] is None else f.format(d[k]) for k in ("p50", "p90", "p99"))  # noqa: E731
            print(f"{name:>14} {run['rate']:>5g} {sm['ok']:>4} {sm['failed']:>6} {sm['goodput_rps']:>8.2f} "
                  f"{fmt(t, '{:.0f}'):>22} {fmt(p, '{:.1f}'):>22}")
            rows.append({"layout": name, "rate": run["rate"], **sm})
    (out / "layouts.json").write_text(json.dumps(rows, indent=1))


def report_comparison(reports: dict[str, dict], out: Path, title: str, args: dict | None) -> None:
    """Print goodput per rate for both modes with their ratio, write comparison.json, and with
    matplotlib comparison.png: goodput and TPOT p90 / TTFT p90 against rate, both modes."""
    rows = compare(reports)
    slo = reports["colocated"]["config"]["slo"]
    print(f"\n{title}, SLOs TTFT <= {slo['ttft_ms']:g} ms and TPOT <= {slo['tpot_ms']:g} ms per request")
    print(f"{'rate':>6} {'goodput disagg':>15} {'goodput coloc':>14} {'ratio':>6} "
          f"{'TPOT p90 d/c ms':>16} {'TTFT p90 d/c ms':>16}")
    for r in rows:
        print(f"{r['rate']:>6g} {r['goodput_disagg']:>15.2f} {r['goodput_coloc']:>14.2f} {r['ratio']:>6.2f} "
              f"{r['tpot_p90_disagg_ms']:>7.1f}/{r['tpot_p90_coloc_ms']:<8.1f} "
              f"{r['ttft_p90_disagg_ms']:>7.0f}/{r['ttft_p90_coloc_ms']:<8.0f}")
    (out / "comparison.json").write_text(json.dumps({"args": args, "rows": rows}, indent=1))
    try:
        import matplotlib
    except ImportError:
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = [r["rate"] for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    panels = ((axes[0], "goodput", "goodput (requests/s within both SLOs)", None),
              (axes[1], "tpot_p90", "TPOT p90 (ms)", slo["tpot_ms"]),
              (axes[2], "ttft_p90", "TTFT p90 (ms)", slo["ttft_ms"]))
    for ax, key, ylabel, limit in panels:
        for mode, short, marker in (("disaggregated", "disagg", "o-"), ("colocated", "coloc", "s-")):
            col = f"{key}_{short}" if key == "goodput" else f"{key}_{short}_ms"
            ax.plot(rates, [r[col] for r in rows], marker, label=mode)
        if limit is not None:
            ax.axhline(limit, color="grey", linestyle="--", label="SLO")
        ax.set(xlabel="offered rate (new sessions / s)", ylabel=ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out / "comparison.png", dpi=110)
    plt.close(fig)
    print(f"wrote {out / 'comparison.png'}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama3-8b-random")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--gpus", type=int, default=2, help="actors in all (one per GPU on cuda)")
    ap.add_argument("--prefill", type=int, default=0, help="prefill actors when disaggregated (default gpus/2)")
    ap.add_argument("--threshold", type=float, default=256,
                    help="disaggregated: decode prefills uncached suffixes up to this many tokens itself")
    ap.add_argument("--prefill-queue-limit", type=int, default=0,
                    help="disaggregated: prefill.max_queued_tokens, past which decode actors prefill "
                         "locally (0: no limit, always remote)")
    ap.add_argument("--speculative", default="ngram", help="both modes")
    ap.add_argument("--chunk", type=int, default=8192, help="scheduler.max_num_batched_tokens")
    ap.add_argument("--max-num-seqs", type=int, default=64,
                    help="decode sequence slots per GPU: the decode actors of a layout hold all of its GPUs' "
                         "(1P:1D: 128 on its one decode actor)")
    ap.add_argument("--num-blocks", type=int, default=0, help="KV blocks per actor (0: from free memory)")
    ap.add_argument("--workload", default="agent")
    ap.add_argument("--rates", default="0.25,0.5,1")
    ap.add_argument("--duration", type=float, default=40)
    ap.add_argument("--drain", type=float, default=60)
    ap.add_argument("--max-context", type=int, default=0)
    ap.add_argument("--ttft-slo-ms", type=float, default=1000)
    ap.add_argument("--tpot-slo-ms", type=float, default=40)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--start-timeout", type=float, default=300)
    ap.add_argument("--modes", default="disaggregated,colocated")
    ap.add_argument("--layouts", default="", help="P:D splits to run instead of the two modes, e.g. "
                                                 "1:3,2:2,3:1,0:4 (0:N = N colocated replicas); prints "
                                                 "every layout's goodput and latencies per rate")
    ap.add_argument("--out", default="bench-results")
    ap.add_argument("--simulate", action="store_true",
                    help="also print the simulator's prediction beside each measured layout and rate")
    ap.add_argument("--perf", help="perf model JSON for --simulate (from `tandem profile`; default: assumed)")
    ap.add_argument("--predict", action="store_true",
                    help="start nothing: print the simulator's prediction for each layout (or mode) and rate, "
                         "on the requests the bench would send, with the decode slots it would give each")
    ap.add_argument("--compare", metavar="DIR", help="print the table and plot again from DIR's bench-*.json "
                                                      "(a finished run); runs nothing")
    args = ap.parse_args()
    if args.compare:
        d = Path(args.compare)
        reports = {m: json.loads((d / f"bench-{m}.json").read_text()) for m in ("disaggregated", "colocated")}
        report_comparison(reports, d, f"{args.model}, workload {reports['colocated']['config'].get('workload', '')}",
                          None)
        if args.simulate:
            simulate_beside(reports, d, args.perf)
        return
    configs = mode_configs(args)
    if args.predict:
        names = list(configs) if args.layouts else args.modes.split(",")
        print_predictions({n: configs[n] for n in names}, args)
        return
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    reports = {}
    for name in (configs if args.layouts else args.modes.split(",")):
        reports[name] = run_mode(name, configs[name], args, out)
    if args.layouts:
        print_layouts(reports, out)
    if args.simulate:
        simulate_beside(reports, out, args.perf)
    if args.layouts:
        return
    if len(reports) == 2:
        title = (f"{args.model}, {args.gpus} {'GPUs' if args.device == 'cuda' else 'CPU actors'}, workload "
                 f"{args.workload}")
        report_comparison(reports, out, title, vars(args))


if __name__ == "__main__":
    main()
