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
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import ray  # noqa: E402

from tandem.kv_transfer.base import KVTransferConfig, TransferSpec  # noqa: E402

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


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


@ray.remote(num_cpus=1)
class Endpoint:
    def __init__(self, actor_id: str, rendezvous: str, num_blocks: int, seed: int | None, device: str = "cuda"):
        from tandem.kv_transfer.receiver import LayerStreamReceiver
        from tandem.kv_transfer.sender import LayerStreamSender
        from tandem.kv_transfer.testing import TensorBlockStore
        from tandem.kv_transfer.torch_dist import DistConnector

        from tandem.runtime.process import gil_switch_interval

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
        import threading

        stop = getattr(self, "_busy_stop", None)
        if stop is not None:
            stop.set()
            self._busy_thread.join()
            self._busy_stop = None
        from tandem.runtime.process import gil_switch_interval

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
        from torch.profiler import ProfilerActivity, profile

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
        from dataclasses import replace

        self.sender.config = replace(self.sender.config, max_message_bytes=nbytes)

    def messages_sent(self) -> int:
        return sum(w.messages_sent for w in self.sender._workers.values())

    def configure(self, **overrides) -> None:
        """New sender, receiver and connector with these KVTransferConfig fields changed (the
        message size kept); the pair rendezvous afresh."""
        from dataclasses import replace

        from tandem.kv_transfer.receiver import LayerStreamReceiver
        from tandem.kv_transfer.sender import LayerStreamSender
        from tandem.kv_transfer.torch_dist import DistConnector

        cfg = replace(CONFIG, max_message_bytes=self.sender.config.max_message_bytes, **overrides)
        self.sender.close()
        self.receiver.close()
        self.conn = DistConnector(self.actor_id, self.rendezvous, self.device, cfg)
        self.sender = LayerStreamSender(self.store, self.conn, cfg)
        self.receiver = LayerStreamReceiver(self.store, self.conn, cfg)


def _spec(rid: str, tokens: int, num_blocks: int, seed: int) -> TransferSpec:
    n = tokens // BLOCK
    g = torch.Generator().manual_seed(seed)
    src = torch.randperm(num_blocks, generator=g)[:n].tolist()
    dst = torch.randperm(num_blocks, generator=g)[:n].tolist()
    return TransferSpec(rid, "prefill-0", "decode-0", tuple(range(LAYERS)), src, dst, tokens)


def bench_transfer(args, raw_by_size: dict[int, float], raw_single_s: dict[int, float]) -> list[dict]:
    from tandem.kv_transfer.torch_dist import start_rendezvous_store

    store, port = start_rendezvous_store("127.0.0.1")
    rendezvous = f"127.0.0.1:{port}"
    num_blocks = max(args.prompts) // BLOCK + 64
    gpus = 1 if args.device == "cuda" else 0
    prefill = Endpoint.options(num_gpus=gpus).remote("prefill-0", rendezvous, num_blocks, 1234, args.device)
    decode = Endpoint.options(num_gpus=gpus).remote("decode-0", rendezvous, num_blocks, None, args.device)
    print("prefill actor:", ray.get(prefill.where.remote()), "| decode actor:", ray.get(decode.where.remote()))
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

    sweep = []
    mid = args.prompts[len(args.prompts) // 2]
    for mib in args.message_mib:
        ray.get(prefill.set_message_bytes.remote(mib * MiB))
        times = []
        for rep in range(args.reps + 1):
            spec = _spec(f"m{mib}-{rep}", mid, num_blocks, 50 + rep)
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

    by_variant = {}
    for name in args.variants:
        overrides = VARIANTS[name]
        ray.get([prefill.configure.remote(**overrides), decode.configure.remote(**overrides)])
        rows = _transfer_rows(args, prefill, decode, num_blocks, raw_by_size, name)
        by_variant[name] = {"config": overrides, "rows": rows,
                            "sustained": back_to_back(args, prefill, decode, num_blocks, raw_by_size)}
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
        for r in by_variant[name]["sustained"]:
            print(f"{r['tokens']:>7} {r['transfers']:>3} {r['seconds'] * 1e3:>8.2f} {r['gbps']:>7.1f} "
                  f"{r['raw_gbps']:>9.1f} {r['ratio']:>6.0%}")
    if len(by_variant) > 1:
        base = args.variants[-1]
        print(f"\nall layers ready, ms (ratio to {base}, the same run)")
        print(f"{'tokens':>7} " + " ".join(f"{v:>22}" for v in args.variants))
        for i, tokens in enumerate(args.prompts):
            ref = by_variant[base]["rows"][i]["seconds"]
            print(f"{tokens:>7} " + " ".join(
                f"{by_variant[v]['rows'][i]['seconds'] * 1e3:>13.2f} ({by_variant[v]['rows'][i]['seconds'] / ref:.2f}x)"
                for v in args.variants))
    first = args.variants[0]
    if first != args.variants[-1]:      # the tables below run with the first setting, warmed up
        ray.get([prefill.configure.remote(**VARIANTS[first]), decode.configure.remote(**VARIANTS[first])])
        spec = _spec(f"rewarm-{first}", mid, num_blocks, 5)
        ray.get(decode.expect.remote(spec.to_msg()))
        ray.get([prefill.send.remote(spec.to_msg()), decode.wait_done.remote(spec.request_id)])
    rows, sustained = by_variant[first]["rows"], by_variant[first]["sustained"]
    busy = busy_owner(args, prefill, decode, mid, num_blocks) if args.busy_reps else []
    traced = trace_transfer(prefill, decode, mid, num_blocks)
    copies = [ray.get(prefill.copy_speed.remote(tokens, layers)) for tokens in args.prompts for layers in (1, 8)]
    print("\nblock gather/scatter of one message, GB/s read + written (H200 HBM: ~4100 GB/s copy, "
          "docs/benchmarks.md)")
    print(f"{'tokens':>7} {'layers':>6} {'MiB':>6} " + " ".join(f"{k:>15}" for k in list(copies[0])[3:]))
    for c in copies:
        print(f"{c['tokens']:>7} {c['layers']:>6} {c['mib']:>6.0f} " + " ".join(f"{v:>15.0f}" for v in list(c.values())[3:]))
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


def _transfer_rows(args, prefill, decode, num_blocks: int, raw_by_size: dict[int, float], tag: str) -> list[dict]:
    """Tandem's transfer of each prompt size: all layers ready (median of reps, after a warm-up),
    and streamed as a prefill computes them (the tail after the last layer)."""
    rows = []
    for tokens in args.prompts:
        nbytes = tokens * TOKEN_BYTES
        times, tails = [], []
        for rep in range(args.reps + 1):
            spec = _spec(f"{tag}-t{tokens}-{rep}", tokens, num_blocks, rep)
            ray.get(decode.expect.remote(spec.to_msg()))
            sent, done = ray.get([prefill.send.remote(spec.to_msg()), decode.wait_done.remote(spec.request_id)])
            if rep:                                   # the first is warm-up
                times.append(done - sent["start"])
        exact = (ray.get(prefill.checksums.remote(list(spec.src_block_ids)))
                 == ray.get(decode.checksums.remote(list(spec.dst_block_ids))))
        gap = args.prefill_s_per_token * tokens / LAYERS  # one layer's share of the prefill
        for rep in range(args.reps):
            spec = _spec(f"{tag}-s{tokens}-{rep}", tokens, num_blocks, 100 + rep)
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
            specs = [_spec(f"bb{tokens}-{rep}-{i}-{time.monotonic_ns()}", tokens, num_blocks, 1000 * rep + i) for i in range(k)]
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
    from tandem.runtime.process import DEFAULT_GIL_SWITCH_INTERVAL_S

    nbytes, gap = tokens * TOKEN_BYTES, args.prefill_s_per_token * tokens / LAYERS
    rows = []
    intervals = args.busy_intervals_us or [5000.0, DEFAULT_GIL_SWITCH_INTERVAL_S * 1e6]
    for label, switch in [("idle actors", None)] + [(f"busy, {us:g} us switch", us / 1e6) for us in intervals]:
        ray.get([a.set_busy.remote(switch) for a in (prefill, decode)])
        times, tails = [], []
        for rep in range(args.busy_reps + 1):
            for streamed in (False, True):
                spec = _spec(f"b{label[:4]}{switch}-{rep}-{streamed}", tokens, num_blocks, 300 + rep)
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
        spec = _spec(f"p{tokens}-{warm}", tokens, num_blocks, 999)
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
    spec = _spec(f"trace{tokens}", tokens, num_blocks, 777)
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
    from tandem.cluster.local import RunningCluster
    from tandem.protos.tandem.v1 import generation_pb2 as pb

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
    from tandem.engine.weights import load_tokenizer

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
    from tandem.cluster.bootstrap import init_ray
    from tandem.cluster.config import load_config

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
