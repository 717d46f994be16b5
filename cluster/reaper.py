"""Nothing of a local Ray outlives the process that started it. Ray's local start leaves
`ray::DashboardAgent` and `ray::RuntimeEnvAgent` running (reparented to init, ~220 MB, listening)
when its launcher is killed with SIGKILL: only a normal `ray.shutdown()` stops them.

`start_reaper(pid)` starts a small watcher in its own session (so a signal to the launcher's
process group does not reach it). While the launcher lives, the watcher records the launcher's
descendants every `period_s` (pid and start time, so a reused pid is never hit); once the launcher
is gone it SIGKILLs those still alive, and exits. After a normal shutdown there is nothing left to
kill. Linux only (/proc); elsewhere it does nothing.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

PROC = Path("/proc")


def _stat(pid: int) -> tuple[int, int] | None:
    """(parent pid, start time in clock ticks) of `pid`; None when it is gone."""
    try:
        text = (PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()   # after "pid (comm) "
    return int(fields[1]), int(fields[19])


def descendants(root: int) -> dict[int, int]:
    """Every process below `root`: pid -> start time."""
    children: dict[int, list[int]] = {}
    starts: dict[int, int] = {}
    for entry in PROC.iterdir():
        if entry.name.isdigit():
            st = _stat(int(entry.name))
            if st is not None:
                children.setdefault(st[0], []).append(int(entry.name))
                starts[int(entry.name)] = st[1]
    out, todo = {}, list(children.get(root, []))
    while todo:
        pid = todo.pop()
        if pid in starts and pid not in out:
            out[pid] = starts[pid]
            todo.extend(children.get(pid, []))
    return out


def watch(launcher: int, period_s: float = 1.0) -> int:
    """Record `launcher`'s descendants until it is gone, then kill the survivors; -> how many."""
    launched = _stat(launcher)
    seen: dict[int, int] = {}
    while launched is not None and _stat(launcher) == launched:
        seen.update(descendants(launcher))
        seen.pop(os.getpid(), None)     # the watcher is one of them (started by the launcher)
        time.sleep(period_s)
    killed = 0
    for pid, started in seen.items():
        st = _stat(pid)
        if st is not None and st[1] == started:
            try:
                os.kill(pid, signal.SIGKILL)
                killed += 1
            except OSError:
                pass
    return killed


def start_reaper(launcher: int | None = None) -> subprocess.Popen | None:
    """Watch `launcher` (default: this process) from a detached watcher; None off Linux."""
    if not PROC.is_dir():
        return None
    launcher = launcher or os.getpid()
    return subprocess.Popen([sys.executable, "-m", "tandem.cluster.reaper", str(launcher)], start_new_session=True,
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            close_fds=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("pid", type=int)
    watch(p.parse_args().pid)


if __name__ == "__main__":
    main()
