"""Record a run for the simulator's validation: start one layout with `tandem up`, calibrate the
served step and the control path on it while idle (cluster.calibration, on top of the engine's perf
model from `tandem profile`),
run `tandem bench` at every rate, stop it, and write bench/results/<name>/:
run.json (the requests as sent and measured, the cluster config), perf.json (the perf model
with speculation's drafts and tokens per step from the run's usage) and steps/ (every engine's
steps, engine.step_trace). The full bench report stays in
--work.

    tandem profile --threads 1 -o /tmp/cpu-profile.json          # once per machine and model
    python bench/record_run.py --profile /tmp/cpu-profile.json --device cpu --model smollm2-135m \
        --layout 0:1 --workload agent-small --rates 0.1,0.2,0.4 --duration 40 --name cpu-colocated
    python -m bench.validate_simulator bench/results/cpu-colocated

`--layout adaptive --workers N` records the adaptive layout (its router planning with
`--router-perf`, else the profile; the replay runs the adaptive simulation with the same role
policy and batch guard).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import random
import shutil
import subprocess
from pathlib import Path

import grpc

from disagg_vs_colocated import run_mode
from tandem.cluster.calibration import calibrate_on_cluster
from tandem.cluster.layouts import UNGUARDED, mode_configs
from tandem.cluster.loadgen import load_sessions, parse_workload, sessions_needed
from tandem.cluster.profiling import speculation_from_requests
from tandem.cluster.workloads import RequestSpec
from tandem.engine.config import PRESETS
from tandem.engine.step_trace import TRACE_ENV
from tandem.perf_model import PerfModel
from tandem.protos.tandem.v1 import generation_pb2_grpc

RESULTS = Path(__file__).resolve().parent / "results"

# one row per request, in this order (run.json's "columns")
COLUMNS = ("session_id", "turn", "arrival_s", "prompt_tokens", "max_tokens", "shared_prefix_tokens", "status",
           "cached_prompt_tokens", "completion_tokens", "draft_tokens", "accepted_draft_tokens", "ttft_s",
           "tpot_s", "e2e_s", "draft_steps", "retries")


def _no_inf(x):
    """JSON has no infinity: "inf" instead (layout_perf and load_config read it back)."""
    if isinstance(x, dict):
        return {k: _no_inf(v) for k, v in x.items()}
    return "inf" if isinstance(x, float) and math.isinf(x) else x


def workload_specs(config: dict) -> dict[str, list[RequestSpec]]:
    """The session workload the bench generated (the same seed, count and context cap), by session id."""
    kind, path = parse_workload(config["workload"])
    n = config.get("max_sessions") or 0
    if kind.startswith("agent"):
        n = min(n or 10**9, sessions_needed(max(config["rates"]), config["duration_s"]))
    sessions = load_sessions(kind, path, random.Random(config["seed"]), num_sessions=n,
                             max_context=config["max_context"])
    return {ss[0].session_id: ss for ss in sessions}


def build_id() -> str | None:
    """The code that served the run: $TANDEM_BUILD, else the checkout's commit (+ "-dirty" with
    uncommitted changes), else None (a copy of the tree without its .git). Load terms fitted on
    runs of one build carry over to runs of the same build (bench/validate_simulator.py)."""
    if os.environ.get("TANDEM_BUILD"):
        return os.environ["TANDEM_BUILD"]
    root = Path(__file__).resolve().parents[1]
    try:
        head = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=root, capture_output=True,
                              text=True, timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return head + ("-dirty" if dirty else "") if head else None


def trim(report: dict, cluster: dict, machine: str) -> dict:
    """`tandem bench`'s report -> run.json: per request its send time (from its rate's start),
    session and turn, prompt and output lengths, the prompt's prefix shared with the session's
    previous turn (prompt + the answer it got: what the bench spliced in), usage and latencies."""
    cfg = report["config"]
    specs = workload_specs(cfg) if parse_workload(cfg["workload"])[0].startswith("agent") else {}
    runs = []
    for run in report["runs"]:
        rows, prev = [], {}
        for r in sorted(run["requests"], key=lambda r: (r["session_id"], r["turn"])):
            spec = specs.get(r["session_id"], [])
            shared = spec[r["turn"]].shared_prefix_tokens if r["turn"] < len(spec) else 0
            p = prev.get(r["session_id"])
            shared = min(shared, p["prompt_tokens"] + p["completion_tokens"]) if p else 0
            prev[r["session_id"]] = r
            rows.append([r["session_id"], r["turn"], round(r["arrival_s"], 4), r["prompt_tokens"], r["max_tokens"],
                         shared, *(r[c] for c in COLUMNS[6:11]),
                         *(None if r[c] is None else round(r[c], 5) for c in COLUMNS[11:14]), r.get("draft_steps", 0),
                         r.get("retries", 0)])
        rows.sort(key=lambda x: x[2])
        runs.append({"rate": run["rate"], "elapsed_s": run["summary"]["elapsed_s"],
                     "started_unix": run.get("started_unix"), "requests": rows})
    keep = ("workload", "seed", "rates", "duration_s", "drain_timeout_s", "max_sessions", "max_context", "slo",
            "vocab_size", "retries")
    return {"label": report.get("label"), "machine": machine, "created_unix": report.get("created_unix"),
            "build": build_id(), "bench": {k: cfg.get(k) for k in keep}, "cluster": _no_inf(cluster), "columns": list(COLUMNS),
            "runs": runs}


def host_words(model: str, device: str) -> str:
    """What ran a run, when --machine does not say: this host's cores and memory, its GPU's name on
    cuda, and the model (a run's figures mean little without the machine)."""
    words = f"{os.cpu_count()} cores"
    try:
        words += f", {os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f} GiB"
    except (ValueError, OSError, AttributeError):
        pass
    if device == "cuda":
        import torch  # noqa: PLC0415 (only on GPU hosts)

        words = f"{torch.cuda.get_device_name()}, {words}"
    return f"{words}; {model} on {device}"


def _args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", required=True, help="`tandem profile -o` JSON of this machine and model")
    ap.add_argument("--name", required=True, help="the run's directory under bench/results/")
    ap.add_argument("--machine", help="what ran it, in words (kept in run.json; default: this host's cores, "
                                      "memory and the model, from `host_words`)")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--layout", default="0:1", help="P:D (0:N: N colocated replicas), or adaptive / "
                                                    "adaptive-unguarded on --workers workers")
    ap.add_argument("--workers", type=int, default=1, help="the adaptive layout's workers")
    ap.add_argument("--router-perf", help="the adaptive layout's router plans with this perf model (default: "
                                          "--profile); the run's calibrated model is written after")
    ap.add_argument("--workload", default="agent-small")
    ap.add_argument("--rates", default="0.1,0.2,0.4")
    ap.add_argument("--duration", type=float, default=40)
    ap.add_argument("--drain", type=float, default=60)
    ap.add_argument("--retries", type=int, default=0, help="tandem bench --retries: refused turns sent again")
    ap.add_argument("--max-context", type=int, default=0)
    ap.add_argument("--ttft-slo-ms", type=float, default=1000)
    ap.add_argument("--tpot-slo-ms", type=float, default=40)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threshold", type=float, default=256, help="decode's local-prefill threshold (P > 0)")
    ap.add_argument("--speculative", default="ngram")
    ap.add_argument("--chunk", type=int, default=8192, help="scheduler.max_num_batched_tokens")
    ap.add_argument("--max-num-seqs", type=int, default=64, help="decode slots per GPU (see disagg_vs_colocated)")
    ap.add_argument("--num-blocks", type=int, default=0, help="KV blocks per actor (0: from free memory)")
    ap.add_argument("--start-timeout", type=float, default=300)
    ap.add_argument("--probe-batches", default="1,8,32", help="batch sizes of the served-step probe")
    ap.add_argument("--probe-tokens", type=int, default=128, help="output tokens of each served-step probe")
    ap.add_argument("--control-prompt", type=int, default=256, help="prompt tokens of the control-path probes")
    ap.add_argument("--probe-prompt", type=int, default=16, help="prompt tokens of each served-step probe "
                                                                 "(about the workload's contexts)")
    ap.add_argument("--work", default="/tmp/record-run", help="tandem up's config, logs and the full bench JSON")
    ap.add_argument("--results", default=str(RESULTS))
    a = ap.parse_args()
    if a.layout in ("adaptive", UNGUARDED):
        p, d = 0, a.workers
        a.perf = str(Path(a.router_perf or a.profile).resolve())    # tandem up runs elsewhere
    else:
        p, d = (int(x) for x in a.layout.split(":"))
    a.layouts, a.gpus, a.prefill = a.layout, p + d, p
    a.probe_batches = tuple(int(x) for x in a.probe_batches.split(","))
    return a


def main() -> None:
    a = _args()
    profile = json.loads(Path(a.profile).read_text())
    perf = PerfModel.from_dict(profile.get("perf_model", profile))    # a profile's JSON or a bare model
    (name, config), = mode_configs(a).items()
    vocab = PRESETS[a.model].vocab_size if a.model in PRESETS else 49152
    fitted = {}

    def probe(target: str) -> None:
        # the adaptive layout's prompts go where the cost model puts them, not by a threshold: its
        # control path is probed on the local path only (remote_overhead_s 0)
        threshold = math.inf if a.prefill == 0 else float(config["decode"]["local_prefill_threshold"])
        with grpc.insecure_channel(target) as channel:
            fitted["perf"], fitted["served"] = calibrate_on_cluster(
                generation_pb2_grpc.GenerationStub(channel), perf, vocab_size=vocab, threshold=threshold,
                batches=a.probe_batches, prompt_tokens=a.probe_prompt, output_tokens=a.probe_tokens,
                control_tokens=a.control_prompt)
        f = fitted["perf"]
        print(f"served steps (batch, context, drafts/seq, s): {fitted['served']['served_steps']}\n"
              f"step host {perf.step_host_s * 1e3:.2f} -> {f.step_host_s * 1e3:.2f} ms; control path "
              f"{f.request_overhead_s * 1e3:.1f} ms per request, +{f.remote_overhead_s * 1e3:.1f} ms per "
              "remote prefill", flush=True)

    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    out = Path(a.results) / a.name
    # every engine of the cluster traces its steps (engine.step_trace) into the run's directory:
    # validate_simulator prices the steps the run made; the calibration probes' steps come first
    traces = out / "steps"
    shutil.rmtree(traces, ignore_errors=True)
    os.environ[TRACE_ENV] = str(traces)        # tandem up and its Ray workers inherit it
    report = run_mode(a.name, config, a, work, before_bench=probe)
    spec = speculation_from_requests([r for run in report["runs"] for r in run["requests"]])
    final = dataclasses.replace(fitted["perf"], **spec)
    out.mkdir(parents=True, exist_ok=True)
    machine = a.machine or host_words(a.model, a.device)
    (out / "run.json").write_text(json.dumps(trim(report, config, machine), separators=(",", ":")))
    perf_doc = {"perf_model": final.to_dict(),
                "notes": {"engine": f"tandem profile of {profile.get('model', '?')} on {profile.get('device', '?')} ({a.profile})",
                          "cluster": "calibrate_on_cluster on the running cluster before the bench: the "
                                     "served step's host time and the control path",
                          **fitted["served"],
                          "speculation": spec or "none drafted", "layout": name}}
    (out / "perf.json").write_text(json.dumps(perf_doc, indent=1, default=lambda x: "inf" if math.isinf(x) else x))
    print(f"wrote {out}/run.json and perf.json")


if __name__ == "__main__":
    main()
