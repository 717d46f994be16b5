"""The grid that matters to coding agents, simulated: adaptive against colocated and every static
split of N GPUs, over sessions whose contexts grow to 32k / 64k / 128k tokens and SLOs TPOT p90 in
{15, 25, 40} ms x TTFT p90 in {0.5, 1, 2} s, at several session rates. Prints one row per grid
point: each layout's goodput (requests/s meeting both SLOs), adaptive / best other layout, and
adaptive / colocated; then the worst ratio and the 15 ms points. Every layout sheds what a default
`tandem up` router sheds (its admission limiter: a request predicted to wait past 15 s for its first
token is refused; `--no-admission`: nothing is shed).

    python bench/adaptive_grid.py --perf bench/perf/h200-llama3-8b-calibrated.json --gpus 2 4 \
        --rates 0.25,0.5,1 --seeds 3
"""

from __future__ import annotations

from tandem.perf_model import PerfModel

import argparse
import itertools
import json

from tandem.cluster.config import RouterConfig
from tandem.cluster.layouts import router_limits
from tandem.cluster.profiling import with_load_terms
from tandem.cluster.sim_model import SLO
from tandem.cluster.simulate_compare import compare


def layouts_for(gpus: int) -> list[str]:
    return ["adaptive", "colocated"] + [f"{p}:{gpus - p}" for p in range(1, gpus)]


def mean_rows(points: list[dict]) -> dict:
    """One grid point's rows (layout -> row) averaged over seeds: goodput and role changes."""
    out = {}
    for name in points[0]:
        rows = [p[name] for p in points]
        out[name] = {**rows[0], "goodput": sum(r["goodput"] for r in rows) / len(rows)}
        if "role_changes" in rows[0]:
            out[name]["role_changes"] = sum(r["role_changes"] for r in rows)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--perf", default="bench/perf/h200-llama3-8b.json")
    ap.add_argument("--gpus", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--rates", default="0.5,1,2", help="new sessions per second per 2 GPUs (scaled by gpus/2)")
    ap.add_argument("--contexts", default="32768,65536,131072")
    ap.add_argument("--tpot-ms", default="15,25,40")
    ap.add_argument("--ttft-ms", default="500,1000,2000")
    ap.add_argument("--duration", type=float, default=120.0)
    ap.add_argument("--seeds", type=int, default=1, help="average each goodput over this many workload seeds "
                                                         "(one seed's closed loop moves a few percent either way)")
    ap.add_argument("--json", help="also write every row here")
    ap.add_argument("--no-admission", action="store_true",
                    help="shed nothing at the router (by default a default router's admission limiter runs, "
                         "as `tandem up` serves)")
    ap.add_argument("--retries", type=int, default=0, metavar="N",
                    help="clients send a refused turn again after the router's hint, up to N times "
                         "(tandem bench --retries); default 0: the session goes on")
    ap.add_argument("--load-from", nargs="+", metavar="RUN_DIR", default=[],
                    help="add the loaded-worker terms fitted on these recorded runs' step traces")
    args = ap.parse_args(argv)
    perf = with_load_terms(PerfModel.load(args.perf), args.load_from)
    limits = _limits(args)
    rows, worst, at15 = [], [], []
    head = f"{'gpus':>4} {'ctx':>6} {'tpot':>4} {'ttft':>5} {'rate':>5}  goodput per layout (r/s)"
    print(head)
    for gpus, ctx, tpot, ttft in itertools.product(args.gpus, [int(x) for x in args.contexts.split(",")],
                                                   [float(x) for x in args.tpot_ms.split(",")],
                                                   [float(x) for x in args.ttft_ms.split(",")]):
        rates = [float(r) * gpus / 2 for r in args.rates.split(",")]
        runs = [compare(perf, layouts_for(gpus), gpus, rates, SLO(ttft / 1e3, tpot / 1e3), duration_s=args.duration,
                        max_context=ctx, seed=seed, limits=limits)
                for seed in range(args.seeds)]
        for rate in rates:
            point = mean_rows([{r["layout"]: r for r, _ in res if r["rate"] == rate} for res in runs])
            ada = point["adaptive"]["goodput"]
            best_other = max(v["goodput"] for k, v in point.items() if k != "adaptive")
            colo = point["colocated"]["goodput"]
            ratio = ada / best_other if best_other else float("inf")
            vs_colo = ada / colo if colo else float("inf")
            rows.append({"gpus": gpus, "context": ctx, "tpot_ms": tpot, "ttft_ms": ttft, "rate": rate,
                         "goodput": {k: v["goodput"] for k, v in point.items()},
                         "role_changes": point["adaptive"]["role_changes"],
                         "vs_best": ratio, "vs_colocated": vs_colo})
            worst.append((ratio, rows[-1]))
            if tpot == 15:
                at15.append((vs_colo, rows[-1]))
            cells = "  ".join(f"{k}={v['goodput']:.2f}" for k, v in point.items())
            print(f"{gpus:>4} {ctx // 1024:>5}k {tpot:>4.0f} {ttft:>5.0f} {rate:>5g}  {cells}  "
                  f"ada/best={ratio:.2f} ada/colo={vs_colo:.2f} roles={point['adaptive']['role_changes']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    r, at = min(worst, key=lambda x: x[0])
    print(f"worst adaptive / best other: {r:.3f} at {at['gpus']} GPUs, {at['context'] // 1024}k, "
          f"TPOT {at['tpot_ms']:g} ms, TTFT {at['ttft_ms']:g} ms, rate {at['rate']:g}")
    if at15:
        lo = min(at15, key=lambda x: x[0])
        print(f"TPOT 15 ms: adaptive / colocated from {lo[0]:.2f} (min) to {max(x[0] for x in at15):.2f}")
    return 0


def _limits(args) -> dict:
    """What the router sheds (a default router's limits, or none) and how often clients retry."""
    limits = {} if args.no_admission else router_limits(RouterConfig())
    return {**limits, "retries": args.retries} if args.retries else limits


if __name__ == "__main__":
    raise SystemExit(main())
