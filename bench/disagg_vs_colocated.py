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
import os
import re
import signal
import socket
import subprocess
import sys
import time
from contextlib import closing
from pathlib import Path

import grpc
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tandem.cluster.layout_predictions import print_predictions, simulate_beside
from tandem.cluster.layouts import mode_configs

ROOT = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-c", "import sys; from tandem.cluster.cli import main; sys.exit(main())"]


def _free_port() -> int:
    with closing(socket.socket()) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_serving(target: str, proc: subprocess.Popen, timeout_s: float) -> None:
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


def run_mode(name: str, config: dict, args, out: Path, before_bench=None) -> dict:
    """`tandem up` with `config`, `tandem bench` against it, stop it; -> the bench's report.
    `before_bench(target)` runs once the cluster is SERVING (e.g. a control-path probe)."""
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
        if before_bench is not None:
            before_bench(f"127.0.0.1:{port}")
        bench = [*CLI, "bench", "--target", f"127.0.0.1:{port}", "--workload", args.workload,
                 "--rates", args.rates, "--duration", str(args.duration), "--drain-timeout", str(args.drain),
                 "--seed", str(args.seed), "--out", str(out), "--label", name, "--no-progress",
                 "--ttft-slo-ms", str(args.ttft_slo_ms), "--tpot-slo-ms", str(args.tpot_slo_ms)]
        if args.max_context:
            bench += ["--max-context", str(args.max_context)]
        if getattr(args, "retries", 0):
            bench += ["--retries", str(args.retries)]
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
        import matplotlib  # noqa: PLC0415 - optional (the `bench` extra); without it, no plot
    except ImportError:
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415 - after choosing the Agg backend

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


def _parser() -> argparse.ArgumentParser:
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
    ap.add_argument("--retries", type=int, default=0, help="tandem bench --retries: refused turns sent again")
    ap.add_argument("--max-context", type=int, default=0)
    ap.add_argument("--ttft-slo-ms", type=float, default=1000)
    ap.add_argument("--tpot-slo-ms", type=float, default=40)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--start-timeout", type=float, default=300)
    ap.add_argument("--modes", default="disaggregated,colocated")
    ap.add_argument("--layouts", default="", help="P:D splits to run instead of the two modes, e.g. "
                                                 "1:3,2:2,3:1,0:4 (0:N = N colocated replicas; adaptive = "
                                                 "tandem up --layout adaptive on all --gpus, planning with "
                                                 "--perf and the SLOs); prints every layout's goodput and "
                                                 "latencies per rate")
    ap.add_argument("--out", default="bench-results")
    ap.add_argument("--simulate", action="store_true",
                    help="also print the simulator's prediction beside each measured layout and rate")
    ap.add_argument("--perf", help="perf model JSON for --simulate (from `tandem profile`; default: assumed)")
    ap.add_argument("--predict", action="store_true",
                    help="start nothing: print the simulator's prediction for each layout (or mode) and rate, "
                         "on the requests the bench would send, with the decode slots it would give each")
    ap.add_argument("--compare", metavar="DIR", help="print the table and plot again from DIR's bench-*.json "
                                                      "(a finished run); runs nothing")
    return ap


def _replot(args) -> None:
    """--compare DIR: the table and plot again from a finished run's bench-*.json."""
    d = Path(args.compare)
    reports = {m: json.loads((d / f"bench-{m}.json").read_text()) for m in ("disaggregated", "colocated")}
    report_comparison(reports, d, f"{args.model}, workload {reports['colocated']['config'].get('workload', '')}",
                      None)
    if args.simulate:
        simulate_beside(reports, d, args.perf)


def main() -> None:
    args = _parser().parse_args()
    if args.compare:
        _replot(args)
        return
    configs = mode_configs(args)
    names = list(configs) if args.layouts else args.modes.split(",")
    if args.predict:
        print_predictions({n: configs[n] for n in names}, args)
        return
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    reports = {name: run_mode(name, configs[name], args, out) for name in names}
    if args.layouts:
        print_layouts(reports, out)
    if args.simulate:
        simulate_beside(reports, out, args.perf)
    if not args.layouts and len(reports) == 2:
        title = (f"{args.model}, {args.gpus} {'GPUs' if args.device == 'cuda' else 'CPU actors'}, workload "
                 f"{args.workload}")
        report_comparison(reports, out, title, vars(args))


if __name__ == "__main__":
    main()
