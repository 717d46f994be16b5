"""Host time of the steps on a direct KV copy's critical path, each alone in a loop (one GPU), and the
wake-up latencies between threads and processes on this machine: the yardstick for the traced
transfer of bench/kv_transfer_gpu.py, whose steps take longer in place (a thread that just woke,
the GIL handed back and forth at each torch call).

    python3 bench/kv_host_costs.py          # CUDA rows need a GPU; the wake-up rows run anywhere
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import statistics
import sys
import threading
import time
from array import array
from queue import SimpleQueue

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tandem.kv_transfer.base import PinnedIndexRing, StagingRing  # noqa: E402
from tandem.kv_transfer.link import frame_bytes  # noqa: E402

IDS = 512                       # an 8k-token prompt in 16-token blocks


def per_call_us(fn, n: int = 2000, sync: bool = False) -> float:
    """Mean host time of fn(), synchronizing the device between calls (not timed) when `sync`."""
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    total = 0.0
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        total += time.perf_counter() - t0
        if sync:
            torch.cuda.synchronize()
    return total / n * 1e6


def cuda_rows() -> list[tuple[str, float]]:
    # Triton, which block_copy imports, is there only with CUDA
    from tandem.engine.kernels.block_copy import copy_cache_blocks  # noqa: PLC0415

    dev = torch.device("cuda:0")
    blocks = 640
    src = torch.randn((32, 2, blocks, 16, 8, 128), device=dev).to(torch.bfloat16)   # 1.25 GiB
    dst = torch.zeros_like(src)
    ids = torch.randperm(blocks)[:IDS].tolist()
    src_ids, dst_ids = torch.tensor(ids, device=dev), torch.tensor(ids[::-1], device=dev)
    stream = torch.cuda.Stream()
    torch.cuda.set_stream(stream)
    acks = torch.zeros(64, dtype=torch.long, device=dev)
    cell = acks[3]
    pinned = PinnedIndexRing()
    raw = array("i", ids).tobytes()
    arena = StagingRing(4 << 20, dev)
    arena.memory()
    event = torch.cuda.Event()
    event.record()

    def frame_ids_to_device() -> None:       # the receiver, an all-ready send's ids from its frame
        a = np.frombuffer(raw, dtype=np.int32)
        a.min(), a.max()
        host = pinned.take(a, stream)
        host.to(dev, non_blocking=True)
        pinned.copied(stream)

    def arena_upload() -> None:              # the sender, a streamed transfer's ids at begin()
        buf, lease = arena.take((IDS,), torch.long)
        host = pinned.take(ids, stream)
        buf.copy_(host, non_blocking=True)
        pinned.copied(stream)
        done = torch.cuda.Event()
        done.record(stream)
        done.synchronize()
        arena.give(lease)

    def stream_context() -> None:
        with torch.cuda.stream(stream):
            pass

    layers = range(0, 32)
    return [
        ("torch.cuda.Event() + record", per_call_us(lambda: torch.cuda.Event().record())),
        ("event.query() of a done event", per_call_us(event.query)),
        ("with torch.cuda.stream(s): pass", per_call_us(stream_context)),
        ("acks[cell].fill_(seq)", per_call_us(lambda: acks[3].fill_(7))),
        ("kept view .fill_(seq)", per_call_us(lambda: cell.fill_(7))),
        ("a small torch op (x.add_(1))", per_call_us(lambda: dst_ids.add_(0))),
        (f"frame's {IDS} ids -> pinned -> device (receiver)", per_call_us(frame_ids_to_device)),
        (f"{IDS} ids into the arena, waited for (sender)", per_call_us(arena_upload)),
        ("copy_cache_blocks launch, 1 GiB, check=False", per_call_us(
            lambda: copy_cache_blocks(src, dst, layers, src_ids, dst_ids, check=False), n=50, sync=True)),
        ("copy_cache_blocks launch, 1 GiB, checked", per_call_us(
            lambda: copy_cache_blocks(src, dst, layers, src_ids, dst_ids), n=50, sync=True)),
    ]


def _echo_times(sock: socket.socket, n: int) -> None:
    for _ in range(n):
        buf, got = bytearray(1024), 0
        view = memoryview(buf)
        while got < 1024:
            got += sock.recv_into(view[got:])
        sock.sendall(repr(time.time()).encode().ljust(64))


def _thread_wakes(receive, send, n: int) -> list[float]:
    """us from send(time) to a thread blocked in receive() (which returns that time) running again,
    n times, 2 ms apart."""
    lat: list[float] = []

    def receiver() -> None:
        for _ in range(n):
            t0 = receive()
            lat.append((time.time() - t0) * 1e6)
    t = threading.Thread(target=receiver)
    t.start()
    for _ in range(n):
        time.sleep(0.002)
        send(time.time())
    t.join()
    return lat


def wake_rows(n: int = 200) -> list[tuple[str, float, float]]:
    """(what, median us, p90 us) for a 1 KiB frame to a reader blocked in another process, and a
    put / notify to a thread blocked on a queue / condition, each 2 ms after the last."""
    out = []
    a, b = socket.socketpair()
    child = mp.get_context("fork").Process(target=_echo_times, args=(b, n))
    child.start()
    lat = []
    for _ in range(n):
        time.sleep(0.002)
        t0 = time.time()
        a.sendall(bytes(1024))
        lat.append((float(a.recv(64).decode()) - t0) * 1e6)
    child.join()
    out.append(("Unix socket frame -> reader in another process", lat))

    q: SimpleQueue = SimpleQueue()
    out.append(("SimpleQueue.put -> thread blocked in get", _thread_wakes(q.get, q.put, n)))

    cond, box = threading.Condition(), []

    def wait_for_one() -> float:
        with cond:
            while not box:
                cond.wait(1.0)
            return box.pop()

    def notify(t0: float) -> None:
        with cond:
            box.append(t0)
            cond.notify_all()
    out.append(("Condition.notify -> thread in wait(timeout)", _thread_wakes(wait_for_one, notify, n)))
    return [(what, statistics.median(x), sorted(x)[int(0.9 * len(x))]) for what, x in out]


def main() -> None:
    frame = {"op": "ready", "rid": "r" * 32, "idx": 0, "layers": list(range(32)), "seq": 1,
             "src": array("i", range(IDS)).tobytes()}
    ints = list(range(IDS))
    rows = [("min()+max() of 512 ints in a list (Python's speed)",
             per_call_us(lambda: (min(ints), max(ints)))),
            ("a 3 KiB ready frame encoded (msgpack)", per_call_us(lambda: frame_bytes(frame)))]
    if torch.cuda.is_available():
        rows += cuda_rows()
    print(f"host time per call, us (mean of a loop){'' if torch.cuda.is_available() else '; no GPU: CPU rows only'}")
    for what, us in rows:
        print(f"  {what:<55} {us:>8.1f}")
    print("wake-up latency, us (median, p90)")
    for what, med, p90 in wake_rows():
        print(f"  {what:<55} {med:>8.1f} {p90:>8.1f}")


if __name__ == "__main__":
    main()
