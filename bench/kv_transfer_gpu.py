"""KV transfer between two GPUs, one Ray actor on each, as the cluster runs it. Three tables:

1. raw: NCCL send/recv between the two actors (a plain torch.distributed pair group, messages
   posted back to back) at 1 MiB .. 1 GiB: the wire's rate, the baseline for the rest.
2. transfer: Tandem's layer-streaming sender and receiver (kv_transfer/) moving the KV of a 2k, 8k
   and 32k-token prompt of a Llama-3-8B-shaped cache (32 layers x 8 KV heads x 128, bf16, 16-token
   blocks: 128 KiB per token) from shuffled source blocks into shuffled destination blocks, timed
   from the sender's first call until the receiver reports DONE (gather, wire, scatter), against
   raw at the same total bytes; plus a streamed run where the layers are queued one at a time, a
   prefill's per-layer compute apart, reporting the tail the transfer adds after the last layer.
   The last repetition of each size is checked bit-exact (per-layer checksums on both sides).
   Then the middle prompt again while both actors' Python is busy (as an engine loop keeps it),
   at Python's default GIL switch interval and at the one the pool actors serve with.
3. ttft (with --ttft): time to first token through the gRPC API for the same prompt lengths, with
   prefill on a prefill actor (GPU 0) and the KV streamed to the decode actor (GPU 1), against the
   decode actor prefilling locally on one GPU, same engine, same model (llama3-8b-random).

    python bench/kv_transfer_gpu.py [--ttft] [--out results.json]

Needs two CUDA GPUs and Ray; run on the device machine (see docs/benchmarks.md for the command).
This file holds the two actors and the transfer tables' run; the other tables, the shapes and specs
are in kv_transfer_tables.py next to it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import ray  # noqa: E402
from kv_transfer_tables import (BLOCK, CONFIG, HEAD_DIM, HEADS, LAYERS, MiB, TOKEN_BYTES,  # noqa: E402
                                VARIANTS, transfer_spec, transfer_rows, back_to_back, bench_ttft,
                                busy_owner, profile_transfer, trace_transfer)

from tandem.cluster.bootstrap import init_ray  # noqa: E402
from tandem.cluster.config import load_config  # noqa: E402
from tandem.kv_transfer.spec import TransferSpec  # noqa: E402
from tandem.kv_transfer.receiver import LayerStreamReceiver  # noqa: E402
from tandem.kv_transfer.sender import LayerStreamSender  # noqa: E402
from tandem.kv_transfer.testing import TensorBlockStore  # noqa: E402
from tandem.kv_transfer.torch_dist import DistConnector, start_rendezvous_store  # noqa: E402
from tandem.runtime.process import gil_switch_interval  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


@ray.remote(num_cpus=1)
class Endpoint:
    def __init__(self, actor_id: str, rendezvous: str, num_blocks: int, seed: int | None, device: str = "cuda"):
        sys.setswitchinterval(gil_switch_interval())    # as the pool actors serve
        self.actor_id, self.rendezvous = actor_id, rendezvous
        self.device = device
        if device == "cuda":
            torch.cuda.set_device(0)
        self.store = TensorBlockStore(LAYERS, num_blocks, BLOCK, HEADS, HEAD_DIM, dtype=torch.bfloat16,
                                      device=device)
        if seed is not None:
            self.store.tensor.normal_(generator=torch.Generator(device).manual_seed(seed))
        self.conn = DistConnector(actor_id, rendezvous, device, CONFIG)
        self.sender = LayerStreamSender(self.store, self.conn, CONFIG)
        self.receiver = LayerStreamReceiver(self.store, self.conn, CONFIG)

    def where(self) -> str:
        if self.device != "cuda":
            return "cpu"
        return f"{torch.cuda.get_device_name()} (CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')})"

    # ---- raw NCCL -------------------------------------------------------------------------------
    def raw(self, peer: str, send: bool, sizes_mib: list[int], total_mib: int) -> list[dict]:
        link = self.conn.connect(peer, as_sender=send)
        out = []
        try:
            for size in sizes_mib:
                n = max(5, min(200, total_mib // size))
                buf = torch.ones(size * MiB // 2, dtype=torch.bfloat16, device=self.device)
                op = link.data.send if send else link.data.recv
                for _ in range(3):                       # warm up, and line the two sides up
                    op([buf], link.peer_rank, 7).wait()
                _sync(self.device)
                t0 = time.perf_counter()
                works = [op([buf], link.peer_rank, 7) for _ in range(n)]
                for w in works:
                    w.wait()
                _sync(self.device)
                dt = time.perf_counter() - t0
                out.append({"size_mib": size, "n": n, "seconds": dt, "gbps": size * MiB * n / dt / 1e9})
        finally:
            link.close(broken=False)
        return out

    def raw_single(self, peer: str, send: bool, sizes_mib: list[int], reps: int) -> list[list[float]]:
        """One raw message at a time, timed as a Tandem transfer is: the sender's wall clock as it
        posts the send, the receiver's once its host sees the data in place (a receive posted
        before, then a device sync). Per size, the list of those instants (one per rep, the first
        a warm-up); the driver pairs the two sides' lists."""
        link = self.conn.connect(peer, as_sender=send)
        out = []
        try:
            for size in sizes_mib:
                buf = torch.ones(size * MiB // 2, dtype=torch.bfloat16, device=self.device)
                stamps = []
                for _ in range(reps + 1):
                    _sync(self.device)
                    if send:
                        time.sleep(0.02)            # the receive is posted and waited on by now
                        stamps.append(time.time())
                        link.data.send([buf], link.peer_rank, 7).wait()
                    else:
                        link.data.recv([buf], link.peer_rank, 7).wait()
                        _sync(self.device)
                        stamps.append(time.time())
                out.append(stamps[1:])
                del buf
        finally:
            link.close(broken=False)
        return out

    # ---- Tandem transfer ------------------------------------------------------------------------
    def expect(self, spec_msg: dict) -> None:
        self.receiver.expect(TransferSpec.from_msg(spec_msg))

    def send(self, spec_msg: dict, layer_gap_s: float = 0.0) -> dict:
        """Queue every layer (gap 0: all at once, `KVSender.send` as a prefix pull does; else one
        per gap, like a prefill computing them). -> wall-clock start and when the last layer was
        queued."""
        spec = TransferSpec.from_msg(spec_msg)
        _sync(self.device)
        start = time.time()
        if not layer_gap_s:              # all ready: the call a prefix pull makes
            self.sender.send(spec)
        else:
            self.sender.begin(spec)
            for layer in spec.layers:    # the prefill's thread is free while the GPU computes
                time.sleep(layer_gap_s)
                self.sender.send_layer(spec.request_id, layer)
        last_queued = time.time()
        self.sender.wait(spec.request_id, CONFIG.timeout_s)
        return {"start": start, "last_queued": last_queued}

    def set_busy(self, switch_s: float | None, on_ms: float = 4.0, off_ms: float = 1.0) -> None:
        """switch_s: start a thread that runs pure Python `on_ms` then sleeps `off_ms`, as an engine
        loop does between its kernel launches and waits, and serve with that GIL switch interval;
        None: stop it (the pool actors' interval again)."""
        stop = getattr(self, "_busy_stop", None)
        if stop is not None:
            stop.set()
            self._busy_thread.join()
            self._busy_stop = None

        sys.setswitchinterval(switch_s or gil_switch_interval())
        if switch_s is None:
            return

        def busy(stop: threading.Event) -> None:
            x = 0
            while not stop.is_set():
                end = time.perf_counter() + on_ms / 1e3
                while time.perf_counter() < end:
                    for i in range(100):
                        x += i
                time.sleep(off_ms / 1e3)

        self._busy_stop = threading.Event()
        self._busy_thread = threading.Thread(target=busy, args=(self._busy_stop,), daemon=True)
        self._busy_thread.start()

    def wait_done(self, rid: str) -> float:
        self.receiver.wait(rid, CONFIG.timeout_s)
        return time.time()

    def send_many(self, spec_msgs: list[dict]) -> float:
        """Queue several all-ready transfers back to back (as a prefill actor that finished a batch
        of prompts for this peer does) -> wall-clock start; waits until the sender is done."""
        specs = [TransferSpec.from_msg(m) for m in spec_msgs]
        _sync(self.device)
        start = time.time()
        for spec in specs:
            self.sender.send(spec)
        for spec in specs:
            self.sender.wait(spec.request_id, CONFIG.timeout_s)
        return start

    def wait_all(self, rids: list[str]) -> float:
        for rid in rids:
            self.receiver.wait(rid, CONFIG.timeout_s)
        return time.time()

    def checksums(self, block_ids: list[int]) -> list[list[float]]:
        """Per layer: sum and position-weighted sum of the blocks' bits (as int16), in order."""
        out = []
        for layer in range(LAYERS):
            data = self.store.gather_blocks(layer, block_ids).view(torch.int16).to(torch.float64).flatten()
            w = torch.arange(1, data.numel() + 1, device=data.device, dtype=torch.float64) % 9973
            out.append([float(data.sum()), float((data * w).sum())])
        return out

    # ---- one transfer under torch.profiler ------------------------------------------------------
    def profile_start(self) -> None:
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device == "cuda" else [])
        try:                          # record the transport's threads too, and CUDA syncs
            cfg = torch._C._profiler._ExperimentalConfig(profile_all_threads=True,
                                                         enable_cuda_sync_events=True)
            self._prof = profile(activities=acts, experimental_config=cfg)
        except TypeError:
            self._prof = profile(activities=acts)
        self._prof.__enter__()

    def profile_mark(self) -> float:
        """A marker op in the trace and the wall clock at it: maps trace time to wall time."""
        with torch.profiler.record_function("bench.mark"):
            return time.time()

    def profile_stop(self, path: str) -> str:
        _sync(self.device)
        self._prof.__exit__(None, None, None)
        self._prof.export_chrome_trace(path)
        return path

    def set_trace(self, on: bool) -> list:
        """Turn the transport's step trace on or off; returns what it recorded."""
        recorded = (self.sender.trace or []) + (self.receiver.trace or [])
        self.sender.trace = [] if on else None
        self.receiver.trace = [] if on else None
        return recorded

    def copy_speed(self, tokens: int, layers: int, reps: int = 20) -> dict:
        """GB/s (bytes read + written) of gathering `layers` layers of a `tokens`-token prompt's
        shuffled blocks into one message buffer and scattering them back, the engine's path
        (Triton on CUDA) against torch's index_select / index_copy_."""
        n = tokens // BLOCK
        ids = self.store.block_index(torch.randperm(self.store.num_blocks)[:n].tolist())
        run = range(0, layers)
        buf = self.store.gather_layers(run, ids)
        flat = self.store.tensor[:layers].flatten(0, 1)
        ways = {"engine gather": lambda: self.store.gather_layers(run, ids, out=buf),
                "engine scatter": lambda: self.store.scatter_layers(run, ids, buf),
                "torch gather": lambda: torch.index_select(flat, 1, ids, out=buf.view(-1, *buf.shape[2:])),
                "torch scatter": lambda: flat.index_copy_(1, ids, buf.flatten(0, 1))}
        out = {}
        for name, fn in ways.items():
            fn()
            _sync(self.device)
            times = []
            for _ in range(reps):
                t0 = time.perf_counter()
                fn()
                _sync(self.device)
                times.append(time.perf_counter() - t0)
            out[name] = 2 * buf.numel() * buf.element_size() / statistics.median(times) / 1e9
        return {"tokens": tokens, "layers": layers, "mib": buf.numel() * buf.element_size() / MiB, **out}

    def set_message_bytes(self, nbytes: int) -> None:
        self.sender.config = replace(self.sender.config, max_message_bytes=nbytes)

    def messages_sent(self) -> int:
        return sum(w.messages_sent for w in self.sender._workers.values())

    def configure(self, **overrides) -> None:
        """New sender, receiver and connector with these KVTransferConfig fields changed (the
        message size kept); the pair rendezvous afresh."""
        cfg = replace(CONFIG, max_message_bytes=self.sender.config.max_message_bytes, **overrides)
        self.sender.close()
        self.receiver.close()
        self.conn = DistConnector(self.actor_id, self.rendezvous, self.device, cfg)
        self.sender = LayerStreamSender(self.store, self.conn, cfg)
        self.receiver = LayerStreamReceiver(self.store, self.conn, cfg)


def bench_transfer(args, raw_by_size: dict[int, float], raw_single_s: dict[int, float]) -> list[dict]:
    store, port = start_rendezvous_store("127.0.0.1")
    rendezvous = f"127.0.0.1:{port}"
    num_blocks = max(args.prompts) // BLOCK + 64
    gpus = 1 if args.device == "cuda" else 0
    prefill = Endpoint.options(num_gpus=gpus).remote("prefill-0", rendezvous, num_blocks, 1234, args.device)
    decode = Endpoint.options(num_gpus=gpus).remote("decode-0", rendezvous, num_blocks, None, args.device)
    print("prefill actor:", ray.get(prefill.where.remote()), "| decode actor:", ray.get(decode.where.remote()))
    raw = _raw_tables(args, prefill, decode, raw_by_size, raw_single_s)
    mid = args.prompts[len(args.prompts) // 2]
    sweep = _message_sweep(args, prefill, decode, num_blocks, mid)
    by_variant = _variant_tables(args, prefill, decode, num_blocks, raw_by_size, raw_single_s)
    first = args.variants[0]
    if first != args.variants[-1]:      # the tables below run with the first setting, warmed up
        ray.get([prefill.configure.remote(**VARIANTS[first]), decode.configure.remote(**VARIANTS[first])])
        spec = transfer_spec(f"rewarm-{first}", mid, num_blocks, 5)
        ray.get(decode.expect.remote(spec.to_msg()))
        ray.get([prefill.send.remote(spec.to_msg()), decode.wait_done.remote(spec.request_id)])
    rows, sustained = by_variant[first]["rows"], by_variant[first]["sustained"]
    busy = busy_owner(args, prefill, decode, mid, num_blocks) if args.busy_reps else []
    traced = trace_transfer(prefill, decode, mid, num_blocks)
    copies = _copy_table(args, prefill)
    profiled = None
    if args.profile:
        os.makedirs(args.profile, exist_ok=True)
        profiled = profile_transfer(prefill, decode, mid, num_blocks, args.profile)
    for a in (prefill, decode):
        ray.kill(a)
    del store
    return {"rows": rows, "variants": by_variant, "sustained": sustained, "message_sweep": sweep,
            "traced": traced, "block_copy": copies,
            "profiled": profiled, "busy_owner": busy}, raw


def _raw_tables(args, prefill, decode, raw_by_size: dict[int, float], raw_single_s: dict[int, float]) -> list[dict]:
    """Raw NCCL between the two actors: back to back per size (into `raw_by_size`, GB/s), and one
    message at a time per prompt size (into `raw_single_s`, seconds)."""
    raw = ray.get([prefill.raw.remote("decode-0", True, args.sizes, args.raw_total_mib),
                   decode.raw.remote("prefill-0", False, args.sizes, args.raw_total_mib)])[1]
    raw_by_size.update({r["size_mib"]: r["gbps"] for r in raw})
    print("\nraw NCCL send/recv between the two actors")
    print(f"{'MiB':>6} {'msgs':>5} {'GB/s':>8}")
    for r in raw:
        print(f"{r['size_mib']:>6} {r['n']:>5} {r['gbps']:>8.1f}")
    single_mib = [tokens * TOKEN_BYTES // MiB for tokens in args.prompts]
    sent_at, seen_at = ray.get([prefill.raw_single.remote("decode-0", True, single_mib, args.reps),
                                decode.raw_single.remote("prefill-0", False, single_mib, args.reps)])
    single = {mib: statistics.median(b - a for a, b in zip(s, r)) for mib, s, r in zip(single_mib, sent_at, seen_at)}
    print(f"raw NCCL, one message at a time, timed as a transfer is (the send's call to the receiver's "
          f"host seeing the data), median of {args.reps}")
    print(f"{'MiB':>6} {'ms':>8} {'GB/s':>8}")
    for mib, t in single.items():
        print(f"{mib:>6} {t * 1e3:>8.2f} {mib * MiB / t / 1e9:>8.1f}")
    raw_single_s.update(single)
    return raw


def _message_sweep(args, prefill, decode, num_blocks: int, mid: int) -> list[dict]:
    """The middle prompt, all layers ready, at each max_message_bytes of --message-mib; leaves the
    sender at --message-bytes or the best of them."""
    sweep = []
    for mib in args.message_mib:
        ray.get(prefill.set_message_bytes.remote(mib * MiB))
        times = []
        for rep in range(args.reps + 1):
            spec = transfer_spec(f"m{mib}-{rep}", mid, num_blocks, 50 + rep)
            ray.get(decode.expect.remote(spec.to_msg()))
            sent, done = ray.get([prefill.send.remote(spec.to_msg()), decode.wait_done.remote(spec.request_id)])
            if rep:
                times.append(done - sent["start"])
        t = statistics.median(times)
        sweep.append({"message_mib": mib, "tokens": mid, "seconds": t, "gbps": mid * TOKEN_BYTES / t / 1e9})
    best = max(sweep, key=lambda r: r["gbps"])
    print(f"\nmessage size sweep, {mid}-token prompt (all layers ready), median of {args.reps}")
    print(f"{'max MiB/msg':>12} {'ms':>8} {'GB/s':>7}")
    for r in sweep:
        print(f"{r['message_mib']:>12} {r['seconds'] * 1e3:>8.2f} {r['gbps']:>7.1f}")
    ray.get(prefill.set_message_bytes.remote(args.message_bytes or best["message_mib"] * MiB))
    print(f"using {(args.message_bytes or best['message_mib'] * MiB) / MiB:.0f} MiB messages below")
    return sweep


def _variant_tables(args, prefill, decode, num_blocks: int, raw_by_size: dict[int, float],
                    raw_single_s: dict[int, float]) -> dict[str, dict]:
    """The transfer table and the back-to-back rate under each --variants setting, then their
    ratios to the last one."""
    by_variant = {}
    for name in args.variants:
        overrides = VARIANTS[name]
        ray.get([prefill.configure.remote(**overrides), decode.configure.remote(**overrides)])
        rows = transfer_rows(args, prefill, decode, num_blocks, raw_by_size, name)
        by_variant[name] = {"config": overrides, "rows": rows,
                            "sustained": back_to_back(args, prefill, decode, num_blocks, raw_by_size)}
        _print_variant(args, name, overrides, rows, by_variant[name]["sustained"], raw_single_s)
    if len(by_variant) > 1:
        base = args.variants[-1]
        print(f"\nall layers ready, ms (ratio to {base}, the same run)")
        print(f"{'tokens':>7} " + " ".join(f"{v:>22}" for v in args.variants))
        for i, tokens in enumerate(args.prompts):
            ref = by_variant[base]["rows"][i]["seconds"]
            print(f"{tokens:>7} " + " ".join(
                f"{by_variant[v]['rows'][i]['seconds'] * 1e3:>13.2f} ({by_variant[v]['rows'][i]['seconds'] / ref:.2f}x)"
                for v in args.variants))
    return by_variant


def _print_variant(args, name: str, overrides: dict, rows: list[dict], sustained: list[dict],
                   raw_single_s: dict[int, float]) -> None:
    print(f"\nTandem transfer ({name}: {overrides or 'defaults'}), Llama-3-8B KV "
          f"({TOKEN_BYTES // 1024} KiB/token), median of {args.reps}")
    print(f"{'tokens':>7} {'MiB':>7} {'ms':>8} {'GB/s':>7} {'raw GB/s':>9} {'of raw':>7} {'1 raw msg ms':>13} "
          f"{'of it':>6} {'exact':>6} {'streamed: gap/layer ms':>23} {'tail ms':>8} {'1 layer on wire ms':>19}")
    for r in rows:
        one = raw_single_s.get(round(r["mib"]))
        r["raw_single_seconds"] = one
        print(f"{r['tokens']:>7} {r['mib']:>7.0f} {r['seconds'] * 1e3:>8.2f} {r['gbps']:>7.1f} "
              f"{r['raw_gbps']:>9.1f} {r['ratio']:>6.0%} {one * 1e3 if one else float('nan'):>13.2f} "
              f"{one / r['seconds'] if one else float('nan'):>6.0%} {str(r['bit_exact']):>6} "
              f"{r['layer_gap_ms']:>23.2f} {r['tail_ms']:>8.2f} {r['one_layer_wire_ms']:>19.2f}")
    print(f"back to back: k all-ready transfers queued at once, from the first call to the last DONE "
          f"(median of {args.reps})")
    print(f"{'tokens':>7} {'k':>3} {'ms':>8} {'GB/s':>7} {'raw GB/s':>9} {'of raw':>7}")
    for r in sustained:
        print(f"{r['tokens']:>7} {r['transfers']:>3} {r['seconds'] * 1e3:>8.2f} {r['gbps']:>7.1f} "
              f"{r['raw_gbps']:>9.1f} {r['ratio']:>6.0%}")


def _copy_table(args, prefill) -> list[dict]:
    copies = [ray.get(prefill.copy_speed.remote(tokens, layers)) for tokens in args.prompts for layers in (1, 8)]
    print("\nblock gather/scatter of one message, GB/s read + written (H200 HBM: ~4100 GB/s copy, "
          "docs/benchmarks.md)")
    print(f"{'tokens':>7} {'layers':>6} {'MiB':>6} " + " ".join(f"{k:>15}" for k in list(copies[0])[3:]))
    for c in copies:
        print(f"{c['tokens']:>7} {c['layers']:>6} {c['mib']:>6.0f} " + " ".join(f"{v:>15.0f}" for v in list(c.values())[3:]))
    return copies


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4, 16, 64, 256, 1024],
                    help="raw message sizes, MiB")
    ap.add_argument("--raw-total-mib", type=int, default=8192, help="bytes per raw size (5..200 messages)")
    ap.add_argument("--prompts", type=lambda s: [int(x) for x in s.split(",")], default=[2048, 8192, 32768])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--message-mib", type=lambda s: [int(x) for x in s.split(",")], default=[256],
                    help="max_message_bytes values to sweep (MiB) on the middle prompt, under the "
                         "first variant (NCCL: 256 was best of 16..512 in earlier runs)")
    ap.add_argument("--message-bytes", type=int, default=0,
                    help="max_message_bytes for the main table (0: the sweep's best)")
    ap.add_argument("--prefill-s-per-token", type=float, default=30e-6,
                    help="streamed run: prefill time per prompt token (H200, Llama-3-8B: ~30 us)")
    ap.add_argument("--busy-reps", type=int, default=5,
                    help="repetitions of the busy-actor table (GIL switch interval); 0: skip it")
    ap.add_argument("--busy-intervals-us", type=lambda s: [float(x) for x in s.split(",")], default=None,
                    help="GIL switch intervals (us) of the busy-actor table (default: Python's 5000 and Tandem's)")
    ap.add_argument("--variants", type=lambda s: s.split(","), default=["default", "nccl"],
                    help="transport settings to measure the transfer table with, in the same run, the "
                         f"first also for the tables after it (of {', '.join(VARIANTS)}; the last is "
                         "the ratios' baseline)")
    ap.add_argument("--ttft", action="store_true", help="also measure TTFT remote vs local (loads the model)")
    ap.add_argument("--no-transfer", action="store_true", help="skip tables 1 and 2")
    ap.add_argument("--model", default="llama3-8b-random")
    ap.add_argument("--chunk", type=int, default=8192, help="prefill chunk (scheduler.max_num_batched_tokens)")
    ap.add_argument("--profile", default=None, metavar="DIR",
                    help="also run one transfer of the middle prompt under torch.profiler on both "
                         "actors: print its timeline, write the Chrome traces to DIR")
    ap.add_argument("--out", default=None, help="write all results as JSON here")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                    help="cpu: the same transfer code over gloo, small sizes, to try the script out")
    args = ap.parse_args()
    if args.device == "cuda" and torch.cuda.device_count() < 2:
        sys.exit("needs two CUDA GPUs")

    init_ray(load_config(None, {"prefill.num_gpus": 1, "decode.num_gpus": 1}), "kv-bench")
    results = {"argv": sys.argv, "gpu": torch.cuda.get_device_name() if args.device == "cuda" else "cpu"}
    raw_by_size: dict[int, float] = {}
    if not args.no_transfer:
        raw_single_s: dict[int, float] = {}
        results["transfer"], results["raw"] = bench_transfer(args, raw_by_size, raw_single_s)
        results["raw_single_seconds"] = raw_single_s
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    if args.ttft:
        results["ttft"] = bench_ttft(args)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
