"""Shared fixtures. Redis: real `redis-server` processes on 127.0.0.1, no persistence.

- `redis_server` (session scope): one server for the whole run; yields its URL. Tests sharing it
  use their own key prefixes.
- `redis_server_factory`: starts extra servers a test may kill and restart (`RedisServer.stop()`,
  `start_redis_server(port=same)`); all are stopped when the test ends.

`hf_smollm2` (session scope): transformers' SmolLM2-135M on the GGUF the engine serves, in fp32, the
reference of tests/engine and tests/cluster (loading it takes ~15 s: once per run).

Every test: Triton's interpreter, once a test module has loaded it, skips re-patching
`triton.language` on each nested helper call (tests/interpreter_patching.py).
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests import interpreter_patching


@dataclass
class RedisServer:
    port: int
    proc: subprocess.Popen
    log_path: Path

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()  # abrupt on purpose: tests use this to simulate Redis dying
            self.proc.wait(timeout=10)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _redis_binary() -> str:
    path = shutil.which("redis-server") or ("/usr/bin/redis-server"
                                            if Path("/usr/bin/redis-server").exists() else None)
    if path is None:
        pytest.fail("redis-server is not installed; `make setup` installs it "
                    "(or: apt-get install -y redis-server)", pytrace=False)
    return path


def _pings(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


def start_redis_server(port: int | None = None, timeout_s: float = 15.0) -> RedisServer:
    """Start redis-server on 127.0.0.1 (a free port unless given) and wait until it answers PING."""
    port = port or free_port()
    workdir = Path(tempfile.mkdtemp(prefix=f"tandem-redis-{port}-"))
    log_path = workdir / "redis.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [_redis_binary(), "--port", str(port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(workdir), "--daemonize", "no"],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    server = RedisServer(port, proc, log_path)
    deadline = time.monotonic() + timeout_s
    while not _pings(port):
        if proc.poll() is not None or time.monotonic() > deadline:
            server.stop()
            pytest.fail(f"redis-server on port {port} did not start:\n{log_path.read_text()}",
                        pytrace=False)
        time.sleep(0.05)
    return server


@pytest.fixture(autouse=True)
def _interpreter_patches_once_a_launch():
    interpreter_patching.install()


@pytest.fixture(scope="session")
def redis_server():
    server = start_redis_server()
    yield server.url
    server.stop()


@pytest.fixture
def redis_server_factory():
    servers: list[RedisServer] = []

    def start(port: int | None = None) -> RedisServer:
        servers.append(start_redis_server(port))
        return servers[-1]

    yield start
    for server in servers:
        server.stop()


@pytest.fixture(scope="session")
def hf_smollm2():
    import torch
    from transformers import AutoModelForCausalLM

    from tandem.engine.weights import smollm2_gguf_path

    p = smollm2_gguf_path()
    return AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name, dtype=torch.float32).eval()
