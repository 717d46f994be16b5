"""Multi-turn coding-agent sessions through a real local CPU cluster (Ray actors, gRPC router,
KV over gloo), closed loop: each session sends its next turn (previous prompt + the model's actual
answer + new tool output) a think time after the answer ends. Prints TTFT / TPOT p50/p90/p99 and
the cached prompt token ratio; then fits the simulator's performance model to the engine on this
machine (`tandem profile`) and prints the simulator's prediction for the same workload beside the
measurement. The simulator's control-path terms (per request, per remote prefill) are fitted on
the idle cluster with a few probe requests before the workload starts.

    .venv/bin/python bench/cluster_cpu.py [--sessions 4] [--max-turns 6] [--prefill 1 --decode 1]
"""

from __future__ import annotations

import argparse
import random
import statistics
import threading
import time

import ray
import torch

from tandem.cluster.local import RunningCluster
from tandem.cluster.calibration import fit_control_path
from tandem.cluster.profiling import profile_engine
from tandem.cluster.sim_model import SLO
from tandem.perf_model import PerfModel
from tandem.cluster.simulator import simulate
from tandem.cluster.workloads import PROFILES, coding_agent_sessions
from tandem.protos.tandem.v1 import generation_pb2 as pb


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def run_sessions(cluster, specs_by_session, vocab, seed):
    """Replay sessions against the cluster; -> list of per-request records."""
    records, lock = [], threading.Lock()

    def session(sid, specs):
        rng = random.Random(f"{seed}-{sid}")
        prompt: list[int] = []
        for spec in specs:
            new = spec.input_tokens - len(prompt)
            if new <= 0 or spec.shared_prefix_tokens == 0:  # compaction: start over
                prompt = []
                new = spec.input_tokens
            prompt = prompt + [rng.randrange(3, vocab) for _ in range(new)]
            time.sleep(spec.think_s)
            req = pb.GenerateRequest(session_id=sid, prompt_token_ids=prompt, sampling=pb.SamplingParams(
                max_tokens=spec.output_tokens, ignore_eos=True))
            t0 = time.perf_counter()
            times, out = [], []
            for r in cluster.stub.Generate(req, timeout=600):
                if r.token_ids:
                    times.append(time.perf_counter())
                    out.extend(r.token_ids)
                last = r
            rec = {"session": sid, "turn": spec.turn, "prompt": len(prompt), "output": len(out),
                   "ttft": times[0] - t0, "tpot": (times[-1] - times[0]) / max(1, len(out) - 1),
                   "cached": last.usage.cached_prompt_tokens}
            with lock:
                records.append(rec)
            prompt = prompt + out

    threads = [threading.Thread(target=session, args=(sid, specs)) for sid, specs in specs_by_session.items()]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return records, time.perf_counter() - t0


def fit_perf(threshold: float):
    """The engine's performance model, fitted on this idle machine with the threads one pool actor gets."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    samples = profile_engine("smollm2-135m", quick=True)
    torch.set_num_threads(threads)
    return PerfModel.fit(samples, local_prefill_threshold=threshold, block_tokens=16, max_step_tokens=2048)


def measure(a, perf, by_session):
    """Run the sessions on a local CPU cluster; -> (records, wall s, perf with the control path
    fitted on the idle cluster: router, Ray round trips, streaming)."""
    ray.init(num_cpus=4, resources={"tandem_prefill": 8, "tandem_decode": 8}, include_dashboard=False,
             object_store_memory=256 << 20, log_to_driver=False, logging_level="ERROR")
    c = RunningCluster({"model.name": "smollm2-135m", "cache.num_blocks": 2048, "prefill.replicas": a.prefill,
                        "decode.replicas": a.decode, "decode.local_prefill_threshold": a.threshold})
    try:
        perf = fit_control_path(c.stub, perf, vocab_size=49152, threshold=a.threshold)
        recs, wall = run_sessions(c, by_session, 49152, a.seed)
    finally:
        c.close()
        ray.shutdown()
    return recs, wall, perf


def print_comparison(a, recs, wall, n_sessions, perf, sim) -> None:
    ttft = [r["ttft"] for r in recs]
    tpot = [r["tpot"] for r in recs if r["output"] > 1]
    cached = sum(r["cached"] for r in recs) / sum(r["prompt"] for r in recs)
    print(f"\n{len(recs)} requests in {n_sessions} sessions over {wall:.1f} s; smollm2-135m on CPU, "
          f"{a.prefill} prefill + {a.decode} decode actors, local-prefill threshold {a.threshold:g}\n")
    print("| | TTFT p50 | TTFT p90 | TTFT p99 | TPOT p50 | TPOT p90 | TPOT p99 | cached prompt tokens |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    print(f"| measured | {pct(ttft, .5) * 1e3:.0f} ms | {pct(ttft, .9) * 1e3:.0f} ms | {pct(ttft, .99) * 1e3:.0f} ms "
          f"| {pct(tpot, .5) * 1e3:.1f} ms | {pct(tpot, .9) * 1e3:.1f} ms | {pct(tpot, .99) * 1e3:.1f} ms | {cached:.1%} |")
    print(f"| simulator | {sim.ttft_p50 * 1e3:.0f} ms | {sim.ttft_p90 * 1e3:.0f} ms | {sim.ttft_p99 * 1e3:.0f} ms "
          f"| {sim.tpot_p50 * 1e3:.1f} ms | {sim.tpot_p90 * 1e3:.1f} ms | {sim.tpot_p99 * 1e3:.1f} ms "
          f"| {sim.cached_token_ratio:.1%} |")
    print(f"\ncontrol path fitted on the idle cluster: {perf.request_overhead_s * 1e3:.1f} ms per request, "
          f"+{perf.remote_overhead_s * 1e3:.1f} ms per remote prefill")
    print(f"simulator / measured medians: TTFT {sim.ttft_p50 / statistics.median(ttft):.2f}, "
          f"TPOT {sim.tpot_p50 / statistics.median(tpot):.2f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sessions", type=int, default=4)
    p.add_argument("--max-turns", type=int, default=6)
    p.add_argument("--prefill", type=int, default=1)
    p.add_argument("--decode", type=int, default=1)
    p.add_argument("--threshold", type=float, default=32, help="decode actors' local prefill threshold")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    rng = random.Random(a.seed)
    specs = [s for s in coding_agent_sessions(rng, a.sessions, 10.0, PROFILES["coding-agent-small"])
             if s.turn < a.max_turns]
    by_session: dict = {}
    for s in specs:
        by_session.setdefault(s.session_id, []).append(s)
    recs, wall, perf = measure(a, fit_perf(a.threshold), by_session)
    sim = simulate(specs, a.prefill, a.decode, perf, SLO(), closed_loop=True, pull_prefix=True).summary
    print_comparison(a, recs, wall, len(by_session), perf, sim)


if __name__ == "__main__":
    main()
