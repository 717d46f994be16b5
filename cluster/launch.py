"""A cluster that outlives its launcher: `tandem up --detached` on a Ray cluster (RAY_ADDRESS)
starts the controller as a named, detached actor (it owns the pools) and the router as its own
process (`tandem router --cluster ADDRESS`), then waits. A SIGKILL of `tandem up` loses nothing:
the controller, the pools and the router's streams are in other processes. SIGTERM or Ctrl-C of
`tandem up` drains the router and stops the cluster, as without --detached; `tandem down` does the
same from anywhere. Any number of `tandem router --cluster ADDRESS` processes may serve one cluster
(sharing sessions through Redis); each reads the cluster's config from its controller.

The launcher records what it started in a state file (`state_path(namespace)`): the routers' pids,
for `tandem down`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

from tandem.wire.cluster import WORKER_NAME

DEFAULT_NAMESPACE = "tandem"
# `tandem up` flags a router process needs as well (the cluster's config comes from its controller)
FORWARDED = ("auth_token_file", "admin_token_file", "tls_cert_file", "tls_key_file", "tls_client_ca_file",
             "log_level")
FORWARDED_SWITCHES = ("no_auth", "insecure_no_auth", "tls_require_client_cert")


def controller_name(namespace: str) -> str:
    return f"{namespace}:controller"


def state_path(namespace: str) -> Path:
    return Path(tempfile.gettempdir()) / f"tandem-{namespace}.json"


def register(sub, security_flags) -> None:
    r = sub.add_parser("router", help="serve gRPC for a running cluster (its own process; N of them may run)")
    r.add_argument("--cluster", required=True, help="the Ray cluster's address (RAY_ADDRESS of `tandem up`)")
    r.add_argument("--namespace", default=DEFAULT_NAMESPACE)
    r.add_argument("--host")
    r.add_argument("--port", type=int)
    r.add_argument("--http-port", type=int)
    r.add_argument("--metrics-port", type=int)
    r.add_argument("--log-level")
    security_flags(r)
    r.set_defaults(func=cmd_router)
    d = sub.add_parser("down", help="drain the routers and stop a cluster started with `tandem up --detached`")
    d.add_argument("--cluster", default=os.environ.get("RAY_ADDRESS"), help="Ray address (default $RAY_ADDRESS)")
    d.add_argument("--namespace", default=DEFAULT_NAMESPACE)
    d.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for the routers to drain")
    d.set_defaults(func=cmd_down)


# ---- up --detached ------------------------------------------------------------------------------
def up_detached(args, config) -> int:
    """Start (or find) the detached controller on RAY_ADDRESS's cluster, run one router process
    beside it, and wait; SIGTERM/SIGINT stop the lot, SIGKILL leaves it serving."""
    import ray  # noqa: PLC0415 - Ray only when a cluster starts

    from tandem.cluster.bootstrap import check_tensor_parallel, init_ray  # noqa: PLC0415
    from tandem.cluster.controller import Controller  # noqa: PLC0415

    check_tensor_parallel(config)   # before anything starts, as a local `tandem up` does
    address = os.environ.get("RAY_ADDRESS")
    if not address:
        raise ValueError("--detached needs a Ray cluster that outlives this process: `ray start --head` (or "
                         "KubeRay), then RAY_ADDRESS=... tandem up --detached")
    ns = args.namespace or DEFAULT_NAMESPACE
    init_ray(config, ns)
    # restarted by Ray if it dies (same name and handle: routers keep it); its pools are detached
    # too and the restarted one adopts them: the streams on them go on, the routers serve meanwhile
    controller = Controller.options(name=controller_name(ns), namespace=ns, lifetime="detached",
                                    max_restarts=-1, get_if_exists=True).remote(config, ns, detached_pools=True)
    ray.get(controller.wait_ready.remote(600))
    router = subprocess.Popen(router_argv(args, address, ns), start_new_session=True)
    state_path(ns).write_text(json.dumps({"address": address, "routers": [router.pid]}))
    print(f"tandem: cluster {ns!r} up (controller detached; router pid {router.pid}); "
          f"`tandem down --namespace {ns}` stops it", flush=True)
    stop = {"signal": None}
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda s, _f: stop.__setitem__("signal", s))
    while router.poll() is None and stop["signal"] is None:
        time.sleep(0.2)
    if stop["signal"] is not None:
        shut_down(ns, timeout_s=config.router.drain_timeout_s + 30)
    return 0


def router_argv(args, address: str, namespace: str) -> list[str]:
    argv = [sys.executable, "-m", "tandem.cluster.cli", "router", "--cluster", address, "--namespace", namespace]
    for name in FORWARDED:
        if getattr(args, name, None):
            argv += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    argv += [f"--{n.replace('_', '-')}" for n in FORWARDED_SWITCHES if getattr(args, n, False)]
    return argv


# ---- router -------------------------------------------------------------------------------------
def cmd_router(args) -> int:
    import ray  # noqa: PLC0415

    from tandem.cluster.commands import security_for, serve_until_stopped  # noqa: PLC0415
    from tandem.runtime.logging_setup import setup_logging  # noqa: PLC0415

    setup_logging(level=args.log_level)
    ray.init(address=args.cluster, namespace=args.namespace, log_to_driver=False)
    controller = ray.get_actor(controller_name(args.namespace), namespace=args.namespace)
    config = ray.get(controller.__ray_call__.remote(lambda c: c.config))
    over = {k: v for k, v in {"host": args.host, "port": args.port, "http_port": args.http_port,
                              "metrics_port": args.metrics_port}.items() if v is not None}
    config = dataclasses.replace(config, router=dataclasses.replace(config.router, **over))
    security = security_for(args, config.router.host)
    asyncio.run(serve_until_stopped(SimpleNamespace(controller=controller, namespace=args.namespace), config,
                                    security))
    return 0


# ---- down ---------------------------------------------------------------------------------------
def cmd_down(args) -> int:
    import ray  # noqa: PLC0415

    if not args.cluster:
        raise ValueError("tandem down: give --cluster ADDRESS or set RAY_ADDRESS")
    ray.init(address=args.cluster, namespace=args.namespace, log_to_driver=False)
    shut_down(args.namespace, args.timeout)
    print(f"tandem: cluster {args.namespace!r} stopped", flush=True)
    return 0


def shut_down(namespace: str, timeout_s: float) -> None:
    """SIGTERM the recorded routers (they drain) and wait for them, then stop the controller and
    its pools."""
    import ray  # noqa: PLC0415

    path = state_path(namespace)
    routers = json.loads(path.read_text()).get("routers", []) if path.exists() else []
    for pid in routers:
        _signal(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while any(_alive(p) for p in routers) and time.monotonic() < deadline:
        time.sleep(0.2)
    for pid in routers:
        _signal(pid, signal.SIGKILL)
    try:
        controller = ray.get_actor(controller_name(namespace), namespace=namespace)
    except ValueError:
        controller = None
    try:
        if controller is not None:
            ray.get(controller.shutdown.remote(), timeout=60)
    finally:
        if controller is not None:
            ray.kill(controller)
        for entry in ray.util.list_named_actors(all_namespaces=True):   # detached workers it left
            if entry.get("namespace") == namespace and WORKER_NAME.fullmatch(entry["name"]):
                ray.kill(ray.get_actor(entry["name"], namespace=namespace))
        path.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    try:   # a zombie child of this process counts as gone
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][0] != "Z"
    except OSError:
        return True


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except OSError:
        pass
