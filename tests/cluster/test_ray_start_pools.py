"""The KubeRay shape on one machine: start Ray the way deploy/kuberay's pods do (a head with no CPUs,
one node advertising `tandem_prefill`, one advertising `tandem_decode`), run `tandem up` on the head
with RAY_ADDRESS set, and serve one request through the gRPC API.

Each `ray start` runs with --block in its own process group and is stopped by signalling that group,
not by `ray stop`, which would also stop every other Ray instance on the machine (other tests,
other checkouts). Every wait has a deadline; cleanup runs in `finally`.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from contextlib import closing
from pathlib import Path

import pytest
import yaml

grpc = pytest.importorskip("grpc")
health_pb2 = pytest.importorskip("grpc_health.v1.health_pb2")
health_pb2_grpc = pytest.importorskip("grpc_health.v1.health_pb2_grpc")
generation_pb2 = pytest.importorskip("tandem.protos.tandem.v1.generation_pb2")
generation_pb2_grpc = pytest.importorskip("tandem.protos.tandem.v1.generation_pb2_grpc")

pytestmark = pytest.mark.timeout(600)

BIN = Path(sys.executable).parent
RAY = str(BIN / "ray") if (BIN / "ray").exists() else shutil.which("ray")
# `tandem` without relying on the console script being on PATH.
TANDEM = [sys.executable, "-c", "import sys; from tandem.cluster.cli import main; sys.exit(main())"]
ROOT = Path(__file__).resolve().parents[2]

NODE_START_S = 60     # a `ray start` until its node shows in the cluster's resources
NODE_START_ATTEMPTS = 2  # a worker `ray start` that exits during startup is started once more
SERVING_S = 240       # `tandem up` until grpc.health.v1 says SERVING (tiny-random, CPU actors)
REQUEST_S = 120       # one Generate call
STOP_S = 30           # each process after SIGTERM, before SIGKILL


def _free_port() -> int:
    with closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tail(path: Path, n: int = 60) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no log)"


class _Processes:
    """Children started in their own process groups, with logs, stopped in reverse order."""

    def __init__(self, log_dir: Path, env: dict[str, str]):
        self.log_dir, self.env, self.procs = log_dir, env, []
        self.exited: set[int] = set()  # pids of children that exited and were replaced

    def start(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
        log = self.log_dir / f"{name}.log"
        with open(log, "wb") as out:
            p = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                 env=env or self.env, cwd=ROOT, start_new_session=True)
        self.procs.append((name, p, log))
        return p

    def forget(self, p: subprocess.Popen) -> None:
        """Stop watching a child that exited (its log stays in the report)."""
        self.exited.add(p.pid)

    def logs(self) -> str:
        return "\n".join(f"----- {name} (exit {p.poll()}) -----\n{_tail(log)}" for name, p, log in self.procs)

    def check_alive(self) -> None:
        for name, p, _ in self.procs:
            if p.poll() is not None and p.pid not in self.exited:
                raise AssertionError(f"{name} exited with {p.returncode}\n{self.logs()}")

    def stop_all(self) -> None:
        for name, p, _ in reversed(self.procs):
            _stop_group(p)


def _stop_group(p: subprocess.Popen) -> None:
    """SIGTERM the process (a `ray start --block` then stops what it started), then SIGKILL its
    whole group if anything is left after STOP_S."""
    if p.poll() is None:
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(STOP_S)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        p.wait(5)
    except subprocess.TimeoutExpired:
        pass


def _ray_resources(address: str, env: dict[str, str]) -> tuple[dict, dict]:
    """(total, available) resources of the cluster, from a short-lived driver process."""
    code = ("import json, ray; ray.init(address=%r, logging_level='ERROR', log_to_driver=False); "
            "print(json.dumps([ray.cluster_resources(), ray.available_resources()])); ray.shutdown()" % address)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    if out.returncode:
        raise RuntimeError(out.stderr[-2000:])
    total, available = json.loads(out.stdout.strip().splitlines()[-1])
    return total, available


def _wait_for(what: str, check, deadline_s: float, procs: _Processes, every_s: float = 1.0):
    deadline = time.monotonic() + deadline_s
    last_error = None
    while time.monotonic() < deadline:
        procs.check_alive()
        try:
            result = check()
            if result:
                return result
        except Exception as e:  # not up yet
            last_error = e
        time.sleep(every_s)
    raise AssertionError(f"timed out after {deadline_s}s waiting for {what} (last error: {last_error})\n{procs.logs()}")


def _node_ports() -> list[str]:
    # Ports that default to fixed numbers, which several nodes (or other tests) on one host would share.
    return [f"--dashboard-agent-listen-port={_free_port()}", f"--metrics-export-port={_free_port()}"]


@pytest.fixture
def no_local_ray():
    """This test starts its own Ray nodes; a Ray instance other tests left in this process would
    compete with them for the machine (and once made a node time out at start)."""
    import ray

    ray.shutdown()
    deadline = time.monotonic() + 60  # let a Ray an earlier process ran finish exiting
    while time.monotonic() < deadline and subprocess.run(["pgrep", "-f", "gcs_server|raylet"],
                                                         capture_output=True).returncode == 0:
        time.sleep(1)
    yield


def _start_with_restarts(procs: _Processes, name: str, argv: list[str], wait_until_up) -> None:
    """Start a `ray start`; one that exits during startup is started once more (with the same
    argv), as the kubelet restarts a pod whose container exited."""
    for attempt in range(NODE_START_ATTEMPTS):
        node = procs.start(name + (f"-retry{attempt}" if attempt else ""), argv())
        try:
            wait_until_up()
            return
        except AssertionError:
            if node.poll() is None or attempt + 1 == NODE_START_ATTEMPTS:
                raise
            procs.forget(node)


def _start_nodes(procs: _Processes, gcs_port: int, temp_dir: str, env: dict[str, str]) -> str:
    """The head and the two worker groups, as deploy/kuberay's pods start them; -> the GCS address."""
    address = f"127.0.0.1:{gcs_port}"
    # The head pod: rayStartParams {num-cpus: "0"}, so no pool actor can land here. Restarted with
    # fresh ports: Ray picks some component ports at random and refuses to start when one collides
    # with a port it was given ("... is trying to use a port number ... used by other components").
    _start_with_restarts(procs, "ray-head", lambda: [
        RAY, "start", "--head", "--block", "--num-cpus=0", "--node-ip-address=127.0.0.1", f"--port={gcs_port}",
        f"--temp-dir={temp_dir}", "--disable-usage-stats",
        f"--dashboard-port={_free_port()}", f"--ray-client-server-port={_free_port()}", *_node_ports()],
        lambda: _wait_for("the head's GCS", lambda: subprocess.run(
            [RAY, "health-check", f"--address={address}"], capture_output=True, env=env,
            timeout=30).returncode == 0, NODE_START_S, procs))
    # The worker groups: rayStartParams.resources '"{\"tandem_prefill\": 1}"' and the decode one.
    # One node at a time: two raylets registering at once on a 2-core machine once made one of
    # them time out asking the GCS for its node info.
    for pool in ("prefill", "decode"):
        argv = [RAY, "start", "--block", f"--address={address}", "--num-cpus=1", "--node-ip-address=127.0.0.1",
                f"--resources={json.dumps({f'tandem_{pool}': 1})}",
                f"--temp-dir={temp_dir}", "--disable-usage-stats", *_node_ports()]
        _start_with_restarts(procs, f"ray-{pool}", lambda argv=argv: argv, lambda pool=pool: _wait_for(
            f"the {pool} node", lambda: f"tandem_{pool}" in _ray_resources(address, env)[0],
            NODE_START_S, procs, every_s=2.0))
    return address


def _generate_one(channel) -> None:
    """One Generate call of 8 tokens; it must end with LENGTH and report its usage."""
    stub = generation_pb2_grpc.GenerationStub(channel)
    request = generation_pb2.GenerateRequest(
        prompt="def add(a, b):",
        sampling=generation_pb2.SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    responses = list(stub.Generate(request, timeout=REQUEST_S))
    token_ids = [t for r in responses for t in r.token_ids]
    assert len(token_ids) == 8, responses
    last = responses[-1]
    reason = last.DESCRIPTOR.fields_by_name["finish_reason"].enum_type.values_by_number[last.finish_reason].name
    assert reason.endswith("LENGTH"), reason
    assert last.usage.completion_tokens == 8 and last.usage.prompt_tokens > 0, last.usage


def _cluster_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "TANDEM_AUTH_TOKEN")}
    # Ray's token authentication, as a KubeRay cluster with authOptions.mode=token runs it: every
    # node and client shares one token
    env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=uuid.uuid4().hex + uuid.uuid4().hex)
    env.update(RAY_USAGE_STATS_ENABLED="0", PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")])))
    return env


@pytest.mark.isolated  # make test runs it in a pytest process of its own: no other Ray on the machine
@pytest.mark.skipif(RAY is None, reason="the ray CLI is not installed")
def test_kuberay_shaped_cluster_serves_a_request(no_local_ray, tmp_path):
    gcs_port, grpc_port = _free_port(), _free_port()
    # Short: Ray's unix socket paths under it must stay below 108 bytes.
    temp_dir = tempfile.mkdtemp(prefix="tdm-ray-", dir="/tmp")
    env = _cluster_env()
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({
        "model": {"name": "tiny-random", "device": "cpu", "dtype": "float32"},
        "cache": {"num_blocks": 256},
        "prefill": {"replicas": 1, "resource_name": "tandem_prefill", "num_gpus": 0},
        "decode": {"replicas": 1, "resource_name": "tandem_decode", "num_gpus": 0},
        "router": {"host": "127.0.0.1", "port": grpc_port},
    }))
    procs = _Processes(tmp_path, env)
    channel = None
    try:
        address = _start_nodes(procs, gcs_port, temp_dir, env)
        # The head container's command: `tandem up` joins the cluster through RAY_ADDRESS.
        procs.start("tandem-up", [*TANDEM, "up", "--config", str(config), "--model", "tiny-random",
                                  "--prefill", "1", "--decode", "1", "--host", "127.0.0.1",
                                  "--port", str(grpc_port)], env={**env, "RAY_ADDRESS": address})
        channel = grpc.insecure_channel(f"127.0.0.1:{grpc_port}")
        health = health_pb2_grpc.HealthStub(channel)
        serving = health_pb2.HealthCheckResponse.SERVING
        _wait_for("grpc.health.v1 SERVING", lambda: health.Check(
            health_pb2.HealthCheckRequest(service=""), timeout=5).status == serving, SERVING_S, procs)
        # The pool actors asked for their pools' resources (a fraction each), so they sit on the
        # nodes that advertise them, as on KubeRay.
        total, available = _ray_resources(address, env)
        for pool in ("tandem_prefill", "tandem_decode"):
            assert available.get(pool, 0) < total[pool], f"no actor holds {pool}: {available}"
        _generate_one(channel)
    finally:
        if channel is not None:
            channel.close()
        procs.stop_all()
        shutil.rmtree(temp_dir, ignore_errors=True)

    up = next(p for name, p, _ in procs.procs if name == "tandem-up")
    # SIGTERM is the pod's termination signal: `tandem up` must exit on it, and cleanly.
    assert up.returncode in (0, -signal.SIGTERM, 128 + signal.SIGTERM), \
        f"tandem up did not exit within {STOP_S}s of SIGTERM (exit {up.returncode})\n{procs.logs()}"
