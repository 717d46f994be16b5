"""The simulator beside a layout comparison: its prediction for every measured layout and rate
(`simulate_beside`), or for layouts nobody started (`print_predictions`), printed as tables and
written as JSON (and a plot, when matplotlib is installed)."""

from __future__ import annotations

from tandem.perf_model import PerfModel

import json
import re
from pathlib import Path

import yaml

from tandem.cluster.layouts import predict
from tandem.engine.config import PRESETS


def _pair(values, fmt: str) -> str:
    return "/".join("-" if x is None else fmt.format(x) for x in values)


def _ms(seconds: float | None) -> float | None:
    return 1e3 * seconds if seconds is not None else None


def simulate_beside(reports: dict[str, dict], out: Path, perf_path: str | None) -> list[dict]:
    """The simulator's prediction (`predict`) for every measured layout and rate, on the very
    requests the bench sent (each layout's config is `out/config-<layout>.yaml`). The perf model is
    `tandem profile`'s JSON (`perf_path`) or the simulator's assumed 8B-on-H200 default. Prints and
    returns rows of measured / predicted goodput, TTFT p90 and TPOT p90 (simulated.json too)."""
    perf = PerfModel.load(perf_path)
    print(f"\nsimulator beside measurement (perf model: {perf_path or 'assumed 8B on H200'}): "
          "measured / predicted")
    print(f"{'layout':>14} {'rate':>5} {'goodput':>13} {'TTFT p90 ms':>15} {'TPOT p90 ms':>15}")
    rows = []
    for name, report in reports.items():
        slug = re.sub(r"[^A-Za-z0-9._-]", "_", name)
        cluster = yaml.safe_load((out / f"config-{slug}.yaml").read_text())
        predicted = predict(cluster, report["config"], perf, [run["rate"] for run in report["runs"]])
        for run in report["runs"]:
            sim, m = predicted[run["rate"]], run["summary"]
            row = {"layout": name, "rate": run["rate"],
                   "goodput": (m["goodput_rps"], sim.goodput_rps),
                   "ttft_p90_ms": (m["ttft_ms"]["p90"], _ms(sim.ttft_p90)),
                   "tpot_p90_ms": (m["tpot_ms"]["p90"], _ms(sim.tpot_p90)),
                   "requests": (m["requests"], sim.requests)}
            rows.append(row)
            print(f"{name:>14} {run['rate']:>5g} {_pair(row['goodput'], '{:.2f}'):>13} "
                  f"{_pair(row['ttft_p90_ms'], '{:.0f}'):>15} {_pair(row['tpot_p90_ms'], '{:.1f}'):>15}")
    (out / "simulated.json").write_text(json.dumps({"perf": perf.to_dict(), "rows": rows}, indent=1))
    return rows


def bench_config(args) -> dict:
    """The `tandem bench` config the comparison would send (workload, seed, duration cut-off,
    --max-context or the preset model's context, rates, SLOs), as `predict` reads it."""
    context = args.max_context or (PRESETS[args.model].max_position_embeddings if args.model in PRESETS else 0)
    if not context:
        raise SystemExit(f"--predict: give --max-context for {args.model!r} (not a preset)")
    return {"workload": args.workload, "seed": args.seed, "max_sessions": None, "duration_s": args.duration,
            "rates": [float(r) for r in args.rates.split(",")], "max_context": context,
            "slo": {"ttft_ms": args.ttft_slo_ms, "tpot_ms": args.tpot_slo_ms},
            "retries": getattr(args, "retries", 0)}


def print_predictions(configs: dict[str, dict], args) -> list[dict]:
    """--predict: the simulator's prediction for every layout and rate, on the requests the bench
    would send, with no cluster started. Prints goodput and TTFT / TPOT p50, p90, p99
    (predicted.json and, with matplotlib, predicted.png under args.out too)."""
    bench = bench_config(args)
    perf = PerfModel.load(args.perf)
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
        import matplotlib  # noqa: PLC0415 - optional (the `bench` extra); without it, no plot
    except ImportError:
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415 - after choosing the Agg backend

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
