"""What `tandem bench` reports, apart from how it drives load: per-request records, percentiles,
TPOT, SLO checks, per-rate summaries, the printed table, and the output files (JSON, and with
matplotlib the latency CDFs and goodput against rate). No clock, no gRPC.

    python -m tandem.cluster.loadgen_report bench-LABEL.json [--out DIR]   # plots again from a JSON
(for runs made where matplotlib is not installed, e.g. the GPU machine).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterable

PERCENTILES = (50, 90, 99)

# ---- pure: records and summaries ----------------------------------------------------------------
@dataclass(frozen=True)
class SLO:
    ttft_s: float = 1.0
    tpot_s: float = 0.040


@dataclass
class RequestRecord:
    """One request as the client saw it. Times are seconds; `arrival_s` counts from the start of its
    rate's run, every other time from `arrival_s` (so client lag counts against the server)."""
    session_id: str  # the workload's; sent with the run's prefix (`session_prefix` in the report)
    turn: int
    arrival_s: float
    prompt_tokens: int  # sent
    max_tokens: int  # the spec's output length (ignore_eos: what a full answer has)
    status: str = "PENDING"  # "OK", a gRPC status code name, "ABORTED", "CLIENT_CANCELLED", "CLIENT_ERROR"
    error: str = ""
    token_times_s: list[float] = field(default_factory=list)  # one per output token, as received
    e2e_s: float | None = None
    finish_reason: str = ""
    # from the final message's usage
    usage_prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    completion_tokens: int = 0
    draft_tokens: int = 0
    accepted_draft_tokens: int = 0
    draft_steps: int = 0  # decode steps that verified at least one of its drafts
    retries: int = 0  # times it was sent again after a refusal (BenchConfig.retries)

    @property
    def ok(self) -> bool:
        return self.status == "OK"

    @property
    def ttft_s(self) -> float | None:
        return self.token_times_s[0] if self.token_times_s else None

    @property
    def tpot_s(self) -> float | None:
        return tpot_s(self.token_times_s)

    def to_json(self) -> dict:
        d = asdict(self)
        times = d["token_times_s"] = [round(t, 6) for t in self.token_times_s]  # microseconds
        d["ttft_s"], d["tpot_s"] = (times[0] if times else None), tpot_s(times)
        return d


def percentile(values: Iterable[float | None], pct: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default); None for no values."""
    xs = sorted(v for v in values if v is not None)
    if not xs:
        return None
    k = (len(xs) - 1) * pct / 100.0
    lo = math.floor(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def tpot_s(token_times: list[float]) -> float | None:
    """Time per output token after the first: (last - first) / (n - 1); None below 2 tokens."""
    if len(token_times) < 2:
        return None
    return (token_times[-1] - token_times[0]) / (len(token_times) - 1)


def meets_slo(rec: RequestRecord, slo: SLO) -> bool:
    """OK, first token within the TTFT SLO, and (with 2+ tokens) TPOT within the TPOT SLO."""
    if not rec.ok or rec.ttft_s is None or rec.ttft_s > slo.ttft_s:
        return False
    t = rec.tpot_s
    return t is None or t <= slo.tpot_s


def _ms(x: float | None) -> float | None:
    return None if x is None else x * 1e3


def summarize(records: list[RequestRecord], *, rate: float | None, elapsed_s: float, slo: SLO,
              not_started: int = 0) -> dict:
    """One rate's figures. Latencies are over OK requests; throughput and goodput over the wall
    time of the run (`elapsed_s`); SLO attainment over every request sent."""
    ok = [r for r in records if r.ok]
    errors = Counter(r.status for r in records if not r.ok)
    examples: dict[str, str] = {}          # the first message of each error code, to say why
    for r in records:
        if not r.ok and r.error and r.status not in examples:
            examples[r.status] = r.error[:300]
    good = sum(meets_slo(r, slo) for r in ok)
    prompt = sum(r.usage_prompt_tokens for r in ok)
    cached = sum(r.cached_prompt_tokens for r in ok)
    output = sum(r.completion_tokens for r in ok)
    draft = sum(r.draft_tokens for r in ok)
    accepted = sum(r.accepted_draft_tokens for r in ok)
    elapsed = max(elapsed_s, 1e-9)

    def pcts(xs: list[float | None]) -> dict:
        return {f"p{p}": _ms(percentile(xs, p)) for p in PERCENTILES}

    return {
        "rate": rate, "elapsed_s": elapsed_s, "requests": len(records), "ok": len(ok),
        "failed": len(records) - len(ok), "errors": dict(sorted(errors.items())), "error_examples": dict(sorted(examples.items())),
        "not_started": not_started, "retries": sum(r.retries for r in records),
        "retried_ok": sum(r.ok and r.retries > 0 for r in records),
        "ttft_ms": pcts([r.ttft_s for r in ok]), "tpot_ms": pcts([r.tpot_s for r in ok]),
        "e2e_ms": pcts([r.e2e_s for r in ok]),
        "throughput_rps": len(ok) / elapsed, "output_tok_s": output / elapsed,
        "goodput_rps": good / elapsed, "slo_attainment": good / len(records) if records else None,
        "cached_ratio": cached / prompt if prompt else None,
        "spec_acceptance": accepted / draft if draft else None,
        "prompt_tokens": prompt, "cached_prompt_tokens": cached, "output_tokens": output,
        "draft_tokens": draft, "accepted_draft_tokens": accepted,
    }


def _num(x: float | None, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def table_header(slo: SLO) -> str:
    return (f"SLOs: TTFT <= {slo.ttft_s * 1e3:g} ms and TPOT <= {slo.tpot_s * 1e3:g} ms (goodput: OK requests "
            f"meeting both, per second)\n\n"
            "| rate | ok | failed | TTFT ms p50/p90/p99 | TPOT ms p50/p90/p99 | E2E ms p50/p90/p99 "
            "| req/s | out tok/s | goodput req/s | cached | spec accept |\n"
            "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")


def table_row(s: dict) -> str:
    def trio(d, fmt):
        return " / ".join(_num(d[f"p{p}"], fmt) for p in PERCENTILES)

    pct = lambda x: "-" if x is None else f"{x:.1%}"  # noqa: E731
    return (f"| {_num(s['rate'], 'g')} | {s['ok']} | {s['failed']} | {trio(s['ttft_ms'], '.0f')} "
            f"| {trio(s['tpot_ms'], '.1f')} | {trio(s['e2e_ms'], '.0f')} | {s['throughput_rps']:.2f} "
            f"| {s['output_tok_s']:.1f} | {s['goodput_rps']:.2f} | {pct(s['cached_ratio'])} "
            f"| {pct(s['spec_acceptance'])} |")


def table_notes(s: dict) -> str:
    """Errors by code and requests never sent, one line, then the first message of each error
    code on a line of its own; empty when there are none."""
    parts = [f"{n} {code}" for code, n in s["errors"].items()]
    if s["not_started"]:
        parts.append(f"{s['not_started']} not sent (due past the duration)")
    if s.get("retries"):
        parts.append(f"{s['retries']} retries after refusals ({s['retried_ok']} requests OK after one or more)")
    if not parts:
        return ""
    lines = [f"rate {_num(s['rate'], 'g')}: " + ", ".join(parts)]
    lines += [f"  {code}: {msg}" for code, msg in s.get("error_examples", {}).items()]
    return "\n".join(lines)


# ---- pure: workloads and plans ------------------------------------------------------------------

def write_outputs(report: dict, out_dir: str | Path, label: str) -> list[Path]:
    """bench-<label>.json, and with matplotlib the latency CDFs and (2+ rates) goodput vs rate."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / f"bench-{label}.json"]
    paths[0].write_text(json.dumps(report, indent=1))
    try:
        import matplotlib  # noqa: PLC0415 - optional (the `bench` extra); without it, no plots
    except ImportError:
        print("tandem bench: matplotlib is not installed (pip install matplotlib); no plots", file=sys.stderr)
        return paths
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415 - after choosing the Agg backend

    slo = report["config"]["slo"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, key, limit in ((axes[0], "ttft_s", slo["ttft_ms"]), (axes[1], "tpot_s", slo["tpot_ms"])):
        for run in report["runs"]:
            # log axis (tails span decades); a TPOT of 0 (every token in one message) sits at 1 us
            xs = sorted(max(r[key] * 1e3, 1e-3) for r in run["requests"] if r["status"] == "OK" and r[key] is not None)
            if xs:
                ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post",
                        label="trace" if run["rate"] is None else f"rate {run['rate']:g}")
        ax.axvline(limit, color="grey", linestyle="--", label=f"SLO {limit:g} ms")
        ax.set(xlabel=f"{key[:-2].upper()} (ms, log scale)", ylabel="fraction of requests", ylim=(0, 1.02),
               xscale="log")
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    fig.suptitle(f"tandem bench {label}: latency CDFs")
    fig.tight_layout()
    paths.append(out / f"bench-{label}-cdf.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    if len(report["runs"]) > 1:
        rates = [r["rate"] for r in report["runs"]]
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.plot(rates, [r["summary"]["throughput_rps"] for r in report["runs"]], "o-", label="throughput")
        ax.plot(rates, [r["summary"]["goodput_rps"] for r in report["runs"]], "s-",
                label=f"goodput (TTFT <= {slo['ttft_ms']:g} ms, TPOT <= {slo['tpot_ms']:g} ms)")
        ax.set(xlabel=f"offered rate ({report['config']['rate_unit']})",
               ylabel="requests / s", title=f"tandem bench {label}: goodput vs rate")
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
        fig.tight_layout()
        paths.append(out / f"bench-{label}-goodput.png")
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)
    if report.get("pool_timeline"):
        paths.append(plot_timeline(report, out / f"bench-{label}-timeline.png", plt))
    return paths


def plot_timeline(report: dict, path: Path, plt, title: str | None = None) -> Path:
    """Pool sizes (and targets) over the whole bench, above each OK request's TTFT and TPOT at the
    time it was sent, with each rate's start marked: what an autoscaled load ramp did. `tandem
    simulate --ramp` writes its report in the same shape and draws it here too (its own title)."""
    tl = report["pool_timeline"]
    slo = report["config"]["slo"]
    fig, (ax0, ax1) = plt.subplots(2, 1, figsize=(10, 6), sharex=True)
    for pool, style in (("prefill", "tab:blue"), ("decode", "tab:orange")):
        ts = [p["t"] for p in tl if pool in p["pools"]]
        ax0.step(ts, [p["pools"][pool]["size"] for p in tl if pool in p["pools"]], where="post", color=style,
                 label=f"{pool} workers")
        ax0.step(ts, [p["pools"][pool]["target"] for p in tl if pool in p["pools"]], where="post", color=style,
                 linestyle=":", label=f"{pool} target")
    ax0.set(ylabel="workers")
    ax0.legend(fontsize="small", ncol=2)
    for run in report["runs"]:
        t0 = run.get("started_s", 0.0)
        for ax in (ax0, ax1):
            ax.axvline(t0, color="grey", alpha=0.3)
        ax0.annotate(f"rate {run['rate']:g}", (t0, ax0.get_ylim()[1]), fontsize="x-small", va="top")
    for key, unit, limit, color in (("ttft_s", "TTFT", slo["ttft_ms"], "tab:green"),
                                    ("tpot_s", "TPOT", slo["tpot_ms"], "tab:red")):
        xs, ys = [], []
        for run in report["runs"]:
            for r in run["requests"]:
                if r["status"] == "OK" and r.get(key) is not None:
                    xs.append(run.get("started_s", 0.0) + r["arrival_s"])
                    ys.append(r[key] * 1e3)
        ax1.scatter(xs, ys, s=6, color=color, label=f"{unit} (ms)")
        ax1.axhline(limit, color=color, linestyle="--", alpha=0.5)
    ax1.set(xlabel="seconds since the bench started", ylabel="ms (log)", yscale="log")
    ax1.legend(fontsize="small")
    fig.suptitle(title or f"tandem bench {report['label']}: pools and latency over time")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ---- the command --------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="plot a `tandem bench` JSON again")
    ap.add_argument("json", help="bench-LABEL.json")
    ap.add_argument("--out", default=None, help="folder for the PNGs (default: beside the JSON)")
    args = ap.parse_args(argv)
    path = Path(args.json)
    report = json.loads(path.read_text())
    label = path.stem.removeprefix("bench-")
    for p in write_outputs(report, args.out or path.parent, label):
        print(p)
    return 0


if __name__ == "__main__":
    sys.exit(main())
