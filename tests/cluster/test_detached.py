"""A cluster that outlives its launcher (issue 27 item 1), on a real Ray head started with `ray
start --head` (its own processes, as on KubeRay): `tandem up --detached` runs the controller as a
detached actor and the router as its own process; a SIGKILL of `tandem up` mid-stream loses
nothing (the stream completes, token-exact); `tandem down` stops the routers and the pools."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tandem.protos.tandem.v1 import admin_pb2, admin_pb2_grpc, generation_pb2 as pb, generation_pb2_grpc
from tests.conftest import free_port

RAY = str(Path(sys.executable).with_name("ray"))


@pytest.fixture(scope="module")
def ray_head():
    """A Ray head of its own (port, temp dir); its processes are killed at the end (never `ray stop`,
    which would stop every Ray on the machine). One for the module: each test runs its cluster in
    a namespace of its own and ends it with `tandem down`."""
    tmp = tempfile.mkdtemp(prefix="tdet-", dir="/tmp")
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "TANDEM_AUTH_TOKEN")}
    # Ray's token auth, as KubeRay's authOptions.mode=token runs it: the head and every client share it
    env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=uuid.uuid4().hex + uuid.uuid4().hex)
    subprocess.run([RAY, "start", "--head", f"--port={port}", f"--temp-dir={tmp}", "--num-cpus=4",
                    '--resources={"tandem_prefill": 64, "tandem_decode": 64}', "--include-dashboard=false",
                    "--disable-usage-stats"], check=True, env=env, capture_output=True, timeout=120)
    import ray._private.services as services
    _HEAD["tmp"] = tmp
    yield f"{services.get_node_ip_address()}:{port}", env
    for pid in _pids_mentioning(tmp):
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    shutil.rmtree(tmp, ignore_errors=True)


def _pids_mentioning(text: str) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if text in (entry / "cmdline").read_text():
                    out.append(int(entry.name))
            except OSError:
                pass
    return out


def _serving(target: str, timeout_s: float, proc) -> None:
    stub = health_pb2_grpc.HealthStub(grpc.insecure_channel(target))
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, "tandem up exited"
        try:
            if stub.Check(health_pb2.HealthCheckRequest(service="tandem.v1.Generation"),
                          timeout=2).status == health_pb2.HealthCheckResponse.SERVING:
                return
        except grpc.RpcError:
            pass
        time.sleep(1)
    raise AssertionError("the router never became SERVING")


def test_kill_9_of_tandem_up_loses_no_stream_and_tandem_down_stops_the_lot(ray_head):
    from tests.chaos.test_faults import _reference

    address, env = ray_head
    env = {**env, "RAY_ADDRESS": address}
    port, ns = free_port(), f"det{os.getpid()}"
    up = subprocess.Popen([sys.executable, "-m", "tandem.cluster.cli", "up", "--detached", "--namespace", ns,
                           "--model", "tiny-random", "--prefill", "0", "--decode", "1", "--num-blocks", "512",
                           "--local-prefill-threshold", "inf", "--port", str(port), "--http-port", "0",
                           "--metrics-port", "0"], env=env)
    router_pid = None
    try:
        target = f"127.0.0.1:{port}"
        _serving(target, 240, up)
        req = {"prompt": "outlive the launcher", "max_tokens": 1500, "ignore_eos": True}
        ref = _reference("tiny-random", [req])[0]
        stub = generation_pb2_grpc.GenerationStub(grpc.insecure_channel(target))
        out: dict = {}
        first = threading.Event()

        def stream():
            ids = []
            try:
                for r in stub.Generate(pb.GenerateRequest(prompt=req["prompt"], sampling=pb.SamplingParams(
                        max_tokens=1500, ignore_eos=True)), timeout=240):
                    ids.extend(r.token_ids)
                    first.set()
                out["ids"] = ids
            except grpc.RpcError as e:
                out["ids"] = e
            finally:
                first.set()
        t = threading.Thread(target=stream)
        t.start()
        assert first.wait(60)
        os.kill(up.pid, signal.SIGKILL)
        up.wait(10)
        t.join(240)
        assert out["ids"] == ref, out["ids"]
        from tandem.cluster.launch import state_path
        import json
        router_pid = json.loads(state_path(ns).read_text())["routers"][0]
        # still serving after the launcher is gone
        assert len(stub.Generate(pb.GenerateRequest(prompt="again", sampling=pb.SamplingParams(
            max_tokens=3)), timeout=120).next().token_ids) >= 1
        down = subprocess.run([sys.executable, "-m", "tandem.cluster.cli", "down", "--namespace", ns],
                              env=env, capture_output=True, text=True, timeout=240)
        assert down.returncode == 0, down.stderr[-2000:]
        time.sleep(1)
        assert not Path(f"/proc/{router_pid}").exists() or \
            Path(f"/proc/{router_pid}/stat").read_text().split(") ", 1)[1][0] == "Z"
    finally:
        if up.poll() is None:
            up.kill()
        if router_pid is not None:
            try:
                os.kill(router_pid, signal.SIGKILL)
            except OSError:
                pass


def _controller_pid(timeout_s: float = 90) -> int:
    """The pid of the (only) `ray::Controller` process on this machine that belongs to this test's
    head (its raylet's descendant). The head is the module's: once one controller is there and no
    other (an earlier test's is gone with its `tandem down`)."""
    from tandem.cluster.reaper import descendants

    deadline = time.monotonic() + timeout_s
    found: set[int] = set()
    while time.monotonic() < deadline:
        found = set()
        for raylet in _pids_mentioning(_HEAD["tmp"]):
            for pid in descendants(raylet):
                try:
                    if Path(f"/proc/{pid}/cmdline").read_text().startswith("ray::Controller"):
                        found.add(pid)
                except OSError:
                    pass
        if len(found) == 1:
            return found.pop()
        time.sleep(0.5)
    raise AssertionError(f"not one ray::Controller process: {sorted(found)}")


_HEAD: dict = {}


def _until(cond, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.5)


def _ready_workers(target: str) -> dict[str, int]:
    """Ready worker id -> its pid, from Admin."""
    state = admin_pb2_grpc.AdminStub(grpc.insecure_channel(target)).GetClusterState(
        admin_pb2.GetClusterStateRequest(), timeout=10)
    return {w.id: w.pid for p in state.pools for w in p.workers if w.state == admin_pb2.WORKER_STATE_READY}


def test_a_controller_killed_under_traffic_fails_no_request(ray_head):
    """The detached controller is restarted by Ray and adopts its detached pools: the streams in
    flight never leave their decode worker (no migration, token-exact), the restarted controller
    reports the same workers, and after the restart a new request still gets its KV from a prefill
    worker (links meet through the new controller's rendezvous store)."""
    from tests.chaos.test_faults import _reference

    address, env = ray_head
    env = {**env, "RAY_ADDRESS": address}
    port, ns = free_port(), f"ctl{os.getpid()}"
    up = subprocess.Popen([sys.executable, "-m", "tandem.cluster.cli", "up", "--detached", "--namespace", ns,
                           "--model", "tiny-random", "--prefill", "1", "--decode", "1", "--num-blocks", "512",
                           "--local-prefill-threshold", "0", "--port", str(port), "--http-port", "0",
                           "--metrics-port", "0"], env=env)
    try:
        target = f"127.0.0.1:{port}"
        _serving(target, 240, up)
        workers = lambda: _ready_workers(target)  # noqa: E731
        before = workers()
        assert set(before) == {"prefill-0", "decode-0"}, before
        reqs = [{"prompt": f"controller crash {i}", "max_tokens": 1200, "ignore_eos": True} for i in range(3)]
        ref = _reference("tiny-random", reqs)
        stub = generation_pb2_grpc.GenerationStub(grpc.insecure_channel(target))
        out: dict = {}
        started = [threading.Event() for _ in reqs]

        def stream(i):
            ids = []
            try:
                for r in stub.Generate(pb.GenerateRequest(prompt=reqs[i]["prompt"], sampling=pb.SamplingParams(
                        max_tokens=1200, ignore_eos=True)), timeout=240):
                    ids.extend(r.token_ids)
                    if len(ids) >= 20:       # decoding: its KV has landed
                        started[i].set()
                out[i] = ids
            except grpc.RpcError as e:
                out[i] = e
            finally:
                started[i].set()
        threads = [threading.Thread(target=stream, args=(i,)) for i in range(len(reqs))]
        for t in threads:
            t.start()
        assert all(e.wait(60) for e in started)
        pid = _controller_pid()
        os.kill(pid, signal.SIGKILL)
        for t in threads:
            t.join(240)
        assert [out[i] for i in range(len(reqs))] == ref, out
        assert _controller_pid() != pid       # Ray restarted it
        _until(lambda: workers() == before, 60)       # ... which adopted the same worker processes
        after = stub.Generate(pb.GenerateRequest(prompt="after the restart", sampling=pb.SamplingParams(
            max_tokens=8, ignore_eos=True)), timeout=60)
        assert sum(len(r.token_ids) for r in after) == 8      # prefilled remotely, as before
        down = subprocess.run([sys.executable, "-m", "tandem.cluster.cli", "down", "--namespace", ns],
                              env=env, capture_output=True, text=True, timeout=240)
        assert down.returncode == 0, down.stderr[-2000:]
    finally:
        if up.poll() is None:
            up.kill()
