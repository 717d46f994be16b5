"""A local cluster leaves nothing behind when its launcher is killed with SIGKILL (issue 27 item 6:
`ray::DashboardAgent` and `ray::RuntimeEnvAgent` kept running, ~220 MB, listening). A real local
Ray started by `init_ray` (as `tandem up` starts it) in a child process, which is then killed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from tandem.cluster.reaper import descendants

LAUNCHER = """
import time
from tandem.cluster.bootstrap import init_ray
from tandem.cluster.config import load_config
init_ray(load_config(None, {"prefill.replicas": 1, "decode.replicas": 1}), "reaper-test")
print("READY", flush=True)
time.sleep(600)
"""


def test_kill_9_of_the_launcher_leaves_no_ray_process():
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.Popen([sys.executable, "-c", LAUNCHER], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout.readline().strip() == "READY"
        time.sleep(3)      # the agents start after ray.init returns
        below = descendants(proc.pid)
        names = {(open(f"/proc/{p}/cmdline").read().split("\0")[0] or "?").rsplit("/", 1)[-1]
                 for p in below if os.path.exists(f"/proc/{p}")}
        assert any("raylet" in n for n in names) and any("DashboardAgent" in n for n in names), names
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        deadline = time.monotonic() + 20
        alive = below
        while alive and time.monotonic() < deadline:
            time.sleep(0.5)
            alive = {p: s for p, s in below.items() if _same(p, s)}
        assert not alive, {p: open(f"/proc/{p}/cmdline").read().replace("\0", " ")[:60] for p in alive}
    finally:
        if proc.poll() is None:
            proc.kill()


def _same(pid: int, started: int) -> bool:
    from tandem.cluster.reaper import _stat

    st = _stat(pid)
    return st is not None and st[1] == started
