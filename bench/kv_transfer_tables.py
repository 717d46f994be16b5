"""The driver's side of bench/kv_transfer_gpu.py: the prompt shapes, the transfer specs, and the
tables measured through the two Endpoint actors it starts (each function takes their handles) plus
TTFT through a cluster. Imported by that script (run from the repository root as
`python3 bench/kv_transfer_gpu.py`, which puts bench/ on the path); not a script itself.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import ray
import torch

from tandem.runtime.process import DEFAULT_GIL_SWITCH_INTERVAL_S
from tandem.cluster.local import RunningCluster
from tandem.engine.weights import load_tokenizer
from tandem.kv_transfer.spec import TransferSpec
from tandem.kv_transfer.config import KVTransferConfig
from tandem.protos.tandem.v1 import generation_pb2 as pb

MiB = 1 << 20
LAYERS, BLOCK, HEADS, HEAD_DIM = 32, 16, 8, 128          # Llama-3-8B KV, bf16
TOKEN_BYTES = LAYERS * 2 * HEADS * HEAD_DIM * 2          # 128 KiB per token, all layers
CONFIG = KVTransferConfig(timeout_s=60.0, start_timeout_s=120.0, connect_timeout_s=120.0)
# The transfer table is measured under each of these (KVTransferConfig fields), in one run: Tandem's
# defaults (the decode actor copies the blocks straight out of the prefill actor's cache, CUDA IPC
# over NVLink), then every byte through the link over NCCL (staging, gather, send, scatter: the path
# between hosts, and the default before), the ratios' baseline; and two NCCL settings measured before.
VARIANTS = {"default": {}, "nccl": {"direct_copy": False},
            "nccl-normal-priority": {"direct_copy": False, "nccl_high_priority": False},
            "nccl-window-2GiB": {"direct_copy": False, "max_inflight_messages": 8}}


def transfer_spec(rid: str, tokens: int, num_blocks: int, seed: int) -> TransferSpec:
    n = tokens // BLOCK
    g = torch.Generator().manual_seed(seed)
    src = torch.randperm(num_blocks, generator=g)[:n].tolist()
    dst = torch.randperm(num_blocks, generator=g)[:n].tolist()
    return TransferSpec(rid, "prefill-0", "decode-0", tuple(range(LAYERS)), src, dst, tokens)


def transfer_rows(args, prefill, decode, num_blocks: int, raw_by_size: dict[int, float], tag: str) -> list[dict]:
    """Tandem's transfer of each prompt size: all layers ready (median of reps, after a warm-up),
    and streamed as a prefill computes them (the tail after the last layer)."""
    rows = []
    for tokens in args.prompts:
        nbytes = tokens * TOKEN_BYTES
        times, tails = [], []
        for rep in range(args.reps + 1):
            spec = transfer_spec(f"{tag}-t{tokens}-{rep}", tokens, num_blocks, rep)
            ray.get(decode.expect.remote(spec.to_msg()))
            sent, done = ray.get([prefill.send.remote(spec.to_msg()), decode.wait_done.remote(spec.request_id)])
            if rep:                                   # the first is warm-up
                times.append(done - sent["start"])
        exact = (ray.get(prefill.checksums.remote(list(spec.src_block_ids)))
                 == ray.get(decode.checksums.remote(list(spec.dst_block_ids))))
        gap = args.prefill_s_per_token * tokens / LAYERS  # one layer's share of the prefill
        for rep in range(args.reps):
            spec = transfer_spec(f"{tag}-s{tokens}-{rep}", tokens, num_blocks, 100 + rep)
            ray.get(decode.expect.remote(spec.to_msg()))
            sent, done = ray.get([prefill.send.remote(spec.to_msg(), gap), decode.wait_done.remote(spec.request_id)])
            tails.append(done - sent["last_queued"])
        t = statistics.median(times)
        raw_same = _raw_at(raw_by_size, nbytes)
        rows.append({"tokens": tokens, "mib": nbytes / MiB, "seconds": t, "gbps": nbytes / t / 1e9,
                     "samples_ms": [x * 1e3 for x in times],
                     "raw_gbps": raw_same, "ratio": nbytes / t / 1e9 / raw_same, "bit_exact": exact,
                     "layer_gap_ms": gap * 1e3, "tail_ms": statistics.median(tails) * 1e3,
                     "one_layer_wire_ms": nbytes / LAYERS / (raw_same * 1e9) * 1e3})
    return rows


def back_to_back(args, prefill, decode, num_blocks: int, raw_by_size: dict[int, float]) -> list[dict]:
    """Tandem's transfer rate with transfers queued back to back, measured as the raw rate is
    (several messages posted, then all waited for): a prefill actor handing a peer the KV of many
    prompts. Each transfer's control path then overlaps the previous one's data on the wire."""
    rows = []
    for tokens in args.prompts:
        nbytes = tokens * TOKEN_BYTES
        k = max(4, min(16, (8 << 30) // nbytes))
        times = []
        for rep in range(args.reps + 1):
            specs = [transfer_spec(f"bb{tokens}-{rep}-{i}-{time.monotonic_ns()}", tokens, num_blocks, 1000 * rep + i) for i in range(k)]
            ray.get([decode.expect.remote(sp.to_msg()) for sp in specs])
            start, done = ray.get([prefill.send_many.remote([sp.to_msg() for sp in specs]),
                                   decode.wait_all.remote([sp.request_id for sp in specs])])
            if rep:
                times.append(done - start)
        t = statistics.median(times)
        raw_same = _raw_at(raw_by_size, nbytes)
        rows.append({"tokens": tokens, "transfers": k, "seconds": t, "gbps": k * nbytes / t / 1e9,
                     "raw_gbps": raw_same, "ratio": k * nbytes / t / 1e9 / raw_same})
    return rows


def busy_owner(args, prefill, decode, tokens: int, num_blocks: int) -> list[dict]:
    """The transfer while both actors' Python is busy, as a prefill or decode loop keeps it (a
    thread running Python 4 ms of every 5): the transport's threads must take the GIL from it at
    every step (frame, receive posts, landings). Python's default switch interval (5 ms) against
    the 200 us the pool actors serve with (cluster/actor_common.py) (or --busy-intervals-us), and
    idle actors as the base."""
    nbytes, gap = tokens * TOKEN_BYTES, args.prefill_s_per_token * tokens / LAYERS
    rows = []
    intervals = args.busy_intervals_us or [5000.0, DEFAULT_GIL_SWITCH_INTERVAL_S * 1e6]
    for label, switch in [("idle actors", None)] + [(f"busy, {us:g} us switch", us / 1e6) for us in intervals]:
        ray.get([a.set_busy.remote(switch) for a in (prefill, decode)])
        times, tails = [], []
        for rep in range(args.busy_reps + 1):
            for streamed in (False, True):
                spec = transfer_spec(f"b{label[:4]}{switch}-{rep}-{streamed}", tokens, num_blocks, 300 + rep)
                ray.get(decode.expect.remote(spec.to_msg()))
                sent, done = ray.get([prefill.send.remote(spec.to_msg(), gap if streamed else 0.0),
                                      decode.wait_done.remote(spec.request_id)])
                if rep:
                    (tails if streamed else times).append(done - (sent["last_queued"] if streamed else sent["start"]))
        t = statistics.median(times)
        rows.append({"owner": label, "switch_s": switch, "tokens": tokens, "seconds": t, "gbps": nbytes / t / 1e9,
                     "tail_ms": statistics.median(tails) * 1e3, "samples_ms": [x * 1e3 for x in times],
                     "tail_samples_ms": [x * 1e3 for x in tails]})
    ray.get([a.set_busy.remote(None) for a in (prefill, decode)])
    print(f"\nbusy actors, {tokens}-token prompt, median of {args.busy_reps}: all layers ready (ms, GB/s) and "
          f"streamed (tail after the last layer)")
    print(f"{'actors':>22} {'ms':>8} {'GB/s':>7} {'tail ms':>8}")
    for r in rows:
        print(f"{r['owner']:>22} {r['seconds'] * 1e3:>8.2f} {r['gbps']:>7.1f} {r['tail_ms']:>8.2f}")
    return rows


def profile_transfer(prefill, decode, tokens: int, num_blocks: int, out_dir: str) -> dict:
    """One transfer of `tokens` under torch.profiler on both actors: prints one timeline (ms from the
    sender's first call) of the transport's host ops (gloo frames, NCCL posts, gathers, scatters,
    allocations, CUDA syncs) and the GPU kernels on both sides; writes both Chrome traces."""
    ray.get([prefill.profile_start.remote(), decode.profile_start.remote()])
    marks = ray.get([prefill.profile_mark.remote(), decode.profile_mark.remote()])
    for warm in (True, False):       # the first ops of a thread under the profiler are slow
        spec = transfer_spec(f"p{tokens}-{warm}", tokens, num_blocks, 999)
        ray.get(decode.expect.remote(spec.to_msg()))
        sent, done = ray.get([prefill.send.remote(spec.to_msg()), decode.wait_done.remote(spec.request_id)])
    paths = ray.get([prefill.profile_stop.remote(f"{out_dir}/trace-prefill.json"),
                     decode.profile_stop.remote(f"{out_dir}/trace-decode.json")])
    t0 = sent["start"]
    events = []
    for side, path, mark in zip(("send", "recv"), paths, marks):
        events += _trace_events(side, path, mark, t0)
    events.sort()
    total = (done - t0) * 1e3
    print(f"\nprofiled transfer, {tokens} tokens ({tokens * TOKEN_BYTES / MiB:.0f} MiB): {total:.2f} ms "
          f"from the sender's first call to the receiver's DONE (profiler on: slower than the table)")
    print(f"{'start ms':>9} {'dur ms':>7} {'side':>4} {'where':>12}  what")
    for start, dur, side, where, name in events:
        print(f"{start:>9.3f} {dur:>7.3f} {side:>4} {where:>12}  {name[:90]}")
    return {"tokens": tokens, "ms": total, "traces": paths,
            "events": [dict(zip(("start_ms", "dur_ms", "side", "where", "name"), e)) for e in events]}


_HOST_OPS = ("nccl:", "gloo:", "c10d::", "aten::index_select", "aten::index_copy", "aten::empty",
             "aten::to", "aten::copy_", "cudaStreamSynchronize", "cudaEventSynchronize",
             "cudaDeviceSynchronize", "cudaMalloc", "cudaFree", "cudaMemcpy", "cudaStreamWaitEvent",
             "record_param_comms", "bench.")


def _trace_events(side: str, path: str, mark_wall: float, t0: float) -> list[tuple]:
    """(start ms from t0, duration ms, side, thread or stream, name) of the interesting events of
    one Chrome trace, placed on the wall clock through the bench.mark op."""
    trace = json.loads(Path(path).read_text())
    evs = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    marks = [e for e in evs if e.get("name") == "bench.mark"]
    if not marks:
        return []
    shift = mark_wall * 1e3 - marks[0]["ts"] / 1e3           # trace ms -> wall ms
    out = []
    for e in evs:
        name, cat = e.get("name", ""), e.get("cat", "")
        gpu = cat in ("kernel", "gpu_memcpy", "gpu_memset")
        if not gpu and not name.startswith(_HOST_OPS):
            continue
        start = e["ts"] / 1e3 + shift - t0 * 1e3
        if start < -1.0 or name == "bench.mark":
            continue
        where = f"stream {e.get('args', {}).get('stream', e.get('tid'))}" if gpu else f"tid {e.get('tid')}"
        out.append((round(start, 3), round(e.get("dur", 0) / 1e3, 3), side, str(where)[-12:], name))
    return out


def trace_transfer(prefill, decode, tokens: int, num_blocks: int) -> dict:
    """One transfer with the transport's own step trace on (no profiler): when each message was
    picked, posted and done on the sender, announced, posted and landed on the receiver."""
    ray.get([prefill.set_trace.remote(True), decode.set_trace.remote(True)])
    spec = transfer_spec(f"trace{tokens}", tokens, num_blocks, 777)
    ray.get(decode.expect.remote(spec.to_msg()))
    sent, done = ray.get([prefill.send.remote(spec.to_msg()), decode.wait_done.remote(spec.request_id)])
    steps = sorted(ray.get(prefill.set_trace.remote(False)) + ray.get(decode.set_trace.remote(False)))
    t0 = sent["start"]
    print(f"\ntraced transfer, {tokens} tokens: {(done - t0) * 1e3:.2f} ms from the sender's first call "
          f"to the receiver's DONE; its steps (ms from the first call):")
    for t, what, _rid in steps:
        print(f"{(t - t0) * 1e3:>9.3f}  {what}")
    print(f"{(sent['last_queued'] - t0) * 1e3:>9.3f}  (last layer queued)\n{(done - t0) * 1e3:>9.3f}  (DONE seen by the owner)")
    return {"tokens": tokens, "ms": (done - t0) * 1e3,
            "steps": [((t - t0) * 1e3, what) for t, what, _rid in steps]}


def _raw_at(raw_by_size: dict[int, float], nbytes: int) -> float:
    """Raw GB/s at the measured size nearest `nbytes` from below (the wire's best at that size)."""
    sizes = sorted(raw_by_size)
    below = [s for s in sizes if s * MiB <= nbytes] or sizes[:1]
    return raw_by_size[below[-1]]


def bench_ttft(args) -> list[dict]:
    """TTFT through the gRPC API, the KV streamed from a prefill actor against a local prefill."""
    gpu = 1 if args.device == "cuda" else 0
    base = {"model.name": args.model, "model.device": args.device,
            "model.dtype": "bfloat16" if gpu else "float32",
            "scheduler.max_num_batched_tokens": args.chunk, "scheduler.max_num_seqs": 8,
            "prefill.num_gpus": gpu, "decode.num_gpus": gpu, "router.metrics_port": None,
            "speculative.method": "off",
            "router.slow_ttft_log_s": 0.0}    # the router logs where each first token's time went
    modes = {"remote": {**base, "prefill.replicas": 1, "decode.replicas": 1, "decode.local_prefill_threshold": 0},
             "local": {**base, "prefill.replicas": 0, "decode.replicas": 1,
                       "decode.local_prefill_threshold": float("inf")}}
    results: dict[str, dict[int, list[float]]] = {}
    vocab = min(100000, load_tokenizer(args.model)[1].vocab_size)   # fresh random prompts, any model
    for mode, overrides in modes.items():
        t = time.perf_counter()
        cluster = RunningCluster(overrides)
        print(f"\n{mode}: cluster up in {time.perf_counter() - t:.0f}s", flush=True)
        try:
            results[mode] = {}
            for tokens in args.prompts:
                samples = []
                for rep in range(args.reps + 1):
                    g = torch.Generator().manual_seed(tokens * 100 + rep)   # fresh: no cache hits
                    ids = torch.randint(1000, vocab, (tokens,), generator=g).tolist()
                    req = pb.GenerateRequest(prompt_token_ids=ids, sampling=pb.SamplingParams(
                        max_tokens=2, temperature=0, ignore_eos=True))
                    t0 = time.perf_counter()
                    first = None
                    for r in cluster.stub.Generate(req, timeout=300):
                        if r.token_ids and first is None:
                            first = time.perf_counter() - t0
                    if rep:
                        samples.append(first)
                results[mode][tokens] = samples
                print(f"  {tokens:>6} tokens: TTFT median {statistics.median(samples) * 1e3:.1f} ms", flush=True)
        finally:
            cluster.close()
    rows = []
    for tokens in args.prompts:
        remote, local = (statistics.median(results[m][tokens]) for m in ("remote", "local"))
        rows.append({"tokens": tokens, "remote_ms": remote * 1e3, "local_ms": local * 1e3, "ratio": remote / local,
                     "remote_samples_ms": [x * 1e3 for x in results["remote"][tokens]],
                     "local_samples_ms": [x * 1e3 for x in results["local"][tokens]]})
    print(f"\nTTFT through the API, {args.model}, prefill chunk {args.chunk} tokens, median of {args.reps}")
    print(f"{'tokens':>7} {'remote ms':>10} {'local ms':>9} {'remote/local':>13}")
    for r in rows:
        print(f"{r['tokens']:>7} {r['remote_ms']:>10.1f} {r['local_ms']:>9.1f} {r['ratio']:>13.3f}")
    return rows


