"""KV resharding by head on CPU: what a worker-level transfer costs when the sender and receiver
have different tensor-parallel sizes, against the same sizes.

Every rank of both workers runs in this process (rank 0's `ReshardingSender` / `ReshardingReceiver`,
ranks 1..N-1 as `RankTransport`s called directly instead of over Ray), over the in-process fake
network (queues, no sockets), so the figures are the transport's own host work: the split into
rank-level transfers, the gathers and scatters (a head slice is a strided view: its gather and
scatter copy strided memory), the settle. One transfer of `--tokens` tokens of an 8B-shaped KV
(`--layers` layers, 8 KV heads of 128, fp32) from begin to both ends reaped; the median of
`--repeats`, wall clock and the process's CPU time (all threads; on a shared machine the wall
clock counts other work too, the CPU time does not). Nothing else is on the path a gloo or NCCL link adds (the wire), so compare rows of
one run: the same bytes move in every row.

    python -m bench.reshard_cpu [--tokens 1024] [--layers 8] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from tandem.kv_transfer.config import KVTransferConfig
from tandem.kv_transfer.fake import FakeNetwork
from tandem.kv_transfer.rank_ends import RankTransport
from tandem.kv_transfer.reshard import head_routes, rank_actor_id
from tandem.kv_transfer.spec import TransferSpec
from tandem.kv_transfer.testing import InProcessRanks, TensorBlockStore
from tandem.kv_transfer.tp_ends import ReshardingReceiver, ReshardingSender, TPLayout

HEADS, HEAD_DIM, BLOCK = 8, 128, 16
CONFIG = KVTransferConfig(start_timeout_s=60.0, timeout_s=60.0, connect_timeout_s=60.0)
PAIRS = [(1, 1), (2, 2), (2, 1), (1, 2), (4, 2), (2, 4)]


def _worker(net, wid, tp, sending, layers, blocks, tps):
    caches = [TensorBlockStore(layers, blocks, BLOCK, HEADS // tp, HEAD_DIM) for _ in range(tp)]
    ranks = {r: RankTransport(caches[r], net.connector(rank_actor_id(wid, r)), CONFIG,
                              TPLayout(wid, r, tp, HEADS, tps.__getitem__)) for r in range(1, tp)}
    cls = ReshardingSender if sending else ReshardingReceiver
    end = cls(caches[0], net.connector(wid), CONFIG, TPLayout(wid, 0, tp, HEADS, tps.__getitem__),
              InProcessRanks(ranks) if ranks else None)
    return end, ranks


def _reap(end, rid):
    while True:
        for got, state in end.reap():
            if got == rid:
                return state
        time.sleep(0.0005)


def measure(src_tp: int, dst_tp: int, tokens: int, layers: int, repeats: int) -> tuple[list[float], list[float]]:
    """-> (wall seconds, CPU seconds of the process: every thread) per transfer."""
    blocks = -(-tokens // BLOCK)
    net, tps = FakeNetwork(), {"p": src_tp, "d": dst_tp}
    sender, send_ranks = _worker(net, "p", src_tp, True, layers, blocks, tps)
    receiver, recv_ranks = _worker(net, "d", dst_tp, False, layers, blocks, tps)
    times, cpu = [], []
    for i in range(repeats + 1):        # the first makes the links
        spec = TransferSpec(f"r{i}", "p", "d", tuple(range(layers)), tuple(range(blocks)),
                            tuple(reversed(range(blocks))), tokens)
        t0, c0 = time.perf_counter(), time.process_time()
        receiver.expect(spec)
        sender.begin(spec)
        for layer in range(layers):
            sender.send_layer(spec.request_id, layer)
        for t in send_ranks.values():
            t.stepped(1)
        assert _reap(receiver, spec.request_id).value == "done"
        assert _reap(sender, spec.request_id).value == "done"
        if i:
            times.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
    for t in [*send_ranks.values(), *recv_ranks.values()]:
        t.close()
    sender.close()
    receiver.close()
    return times, cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    mib = args.tokens * args.layers * 2 * HEADS * HEAD_DIM * 4 / 2**20
    print(f"{args.tokens} tokens x {args.layers} layers, {HEADS} KV heads x {HEAD_DIM}, fp32: {mib:.0f} MiB per transfer")
    print(f"{'sender TP':>9} {'receiver TP':>11} {'rank transfers':>14} {'wall ms (median)':>16} {'min':>6} "
          f"{'CPU ms (median)':>15} {'GB/s':>6}")
    for s, d in PAIRS:
        t, c = measure(s, d, args.tokens, args.layers, args.repeats)
        med = statistics.median(t)
        print(f"{s:>9} {d:>11} {len(head_routes(HEADS, s, d)):>14} {1e3 * med:>16.1f} {1e3 * min(t):>6.1f} "
              f"{1e3 * statistics.median(c):>15.1f} {mib * 2**20 / med / 1e9:>6.2f}")


if __name__ == "__main__":
    main()
