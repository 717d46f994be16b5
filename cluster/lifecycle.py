"""`tandem drain-worker`: what a pool pod's preStop hook runs on Kubernetes. It finds the workers on
this host (`--self`: the pod's name, which a worker reports as its host) or the ones named, drains
them through the Admin API's DrainWorker (no new requests; running sequences move to other decode
workers with their KV where those have room, the rest finish in place; then each worker exits),
and waits until they are gone or `--deadline` passes. A sequence still running at the deadline is
recomputed elsewhere when the pod dies (failover). `tandem move-sequences` moves running sequences
off a hot worker the same way, without draining it.

The waiting is pure (`wait_drained` over a `state()` callable and a clock), so it is tested without
a cluster; `cmd_drain_worker` only wires it to gRPC."""

from __future__ import annotations

import socket
import sys
import time
from collections.abc import Callable, Iterable

import grpc

from tandem.protos.tandem.v1 import admin_pb2, admin_pb2_grpc

DEFAULT_DEADLINE_S = 300.0
_GONE = (admin_pb2.WORKER_STATE_DEAD,)


def register(sub, client_flags, default_target: str) -> None:
    d = sub.add_parser("drain-worker", help="drain workers (this pod's with --self) and wait until they are "
                                            "gone: a pool pod's preStop hook")
    d.add_argument("workers", nargs="*", help="worker ids, as `tandem status` lists them")
    d.add_argument("--self", dest="self_host", action="store_true",
                   help="the workers whose host is this machine's hostname (a pod's name)")
    d.add_argument("--host", help="the workers on this host instead of the hostname")
    d.add_argument("--target", default=default_target, help="router address")
    d.add_argument("--deadline", type=float, default=DEFAULT_DEADLINE_S, metavar="S",
                   help="give up waiting after S seconds (keep it below the pod's terminationGracePeriodSeconds)")
    d.add_argument("--poll", type=float, default=1.0, metavar="S", help="seconds between checks")
    d.add_argument("--finish-in-place", action="store_true",
                   help="running sequences finish on the worker (default: they move to other decode workers "
                        "with their KV where those have room)")
    client_flags(d)
    d.set_defaults(func=cmd_drain_worker)
    m = sub.add_parser("move-sequences", help="move a worker's running sequences to other decode workers with "
                                              "their KV (cool a hot worker); no recompute")
    m.add_argument("worker", help="worker id, as `tandem status` lists it")
    m.add_argument("--count", type=int, default=0, help="at most this many (default 0: all)")
    m.add_argument("--target", default=default_target, help="router address")
    client_flags(m)
    m.set_defaults(func=cmd_move_sequences)


def select_workers(state: admin_pb2.ClusterState, ids: Iterable[str] = (), host: str = "") -> list[str]:
    """Ids of the live workers named in `ids` or running on `host`."""
    wanted = set(ids)
    return [w.id for p in state.pools for w in p.workers
            if w.state not in _GONE and (w.id in wanted or (host and w.host == host))]


def remaining(state: admin_pb2.ClusterState, ids: Iterable[str]) -> dict[str, int]:
    """Of `ids`, the workers still alive, each with its running + waiting requests."""
    wanted = set(ids)
    return {w.id: w.running_requests + w.waiting_requests for p in state.pools for w in p.workers
            if w.id in wanted and w.state not in _GONE}


def wait_drained(state: Callable[[], admin_pb2.ClusterState], ids: list[str], deadline_s: float, poll_s: float = 1.0,
                 clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep,
                 log: Callable[[str], None] = print) -> dict[str, int]:
    """Poll until none of `ids` is alive or `deadline_s` passed; returns what is left (empty: all
    drained). A failed poll (the router restarting) is retried until the deadline."""
    end, left = clock() + deadline_s, dict.fromkeys(ids, -1)
    while True:
        try:
            left = remaining(state(), ids)
        except grpc.RpcError as e:
            log(f"tandem: cluster state unavailable ({e.code().name}); retrying")
        if not left or clock() >= end:
            return left
        sleep(max(0.0, min(poll_s, end - clock())))


def cmd_drain_worker(args) -> int:
    from tandem.cluster.commands import _channel  # noqa: PLC0415 - commands imports this module

    if not (args.workers or args.self_host or args.host):
        print("tandem: name workers, or --self / --host", file=sys.stderr)
        return 2
    stub = admin_pb2_grpc.AdminStub(_channel(args.target, args, admin=True))
    host = args.host or (socket.gethostname() if args.self_host else "")
    state = lambda: stub.GetClusterState(admin_pb2.GetClusterStateRequest(), timeout=10)  # noqa: E731
    try:
        ids = select_workers(state(), args.workers, host)
        for wid in ids:
            stub.DrainWorker(admin_pb2.DrainWorkerRequest(worker_id=wid, finish_in_place=args.finish_in_place),
                             timeout=15)
    except grpc.RpcError as e:
        print(f"tandem: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1
    if not ids:
        print(f"tandem: no live worker {'on ' + host if host else 'of ' + ', '.join(args.workers)}")
        return 0
    print(f"tandem: draining {', '.join(ids)} (up to {args.deadline:g} s)", flush=True)
    left = wait_drained(state, ids, args.deadline, args.poll)
    if left:
        print(f"tandem: deadline passed; still running: {left}", file=sys.stderr)
        return 1
    print("tandem: drained", flush=True)
    return 0


def cmd_move_sequences(args) -> int:
    from tandem.cluster.commands import _channel  # noqa: PLC0415 - commands imports this module

    stub = admin_pb2_grpc.AdminStub(_channel(args.target, args, admin=True))
    try:
        n = stub.MoveSequences(admin_pb2.MoveSequencesRequest(worker_id=args.worker, count=max(0, args.count)),
                               timeout=40).paused
    except grpc.RpcError as e:
        print(f"tandem: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1
    print(f"tandem: {args.worker}: {n} running sequence(s) paused to move with their KV", flush=True)
    return 0
