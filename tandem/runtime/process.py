"""Process setup every serving process shares: a pool actor pins its torch threads to the CPUs Ray
gave it and logs as the rest of Tandem does (one JSON object per line at TANDEM_LOG_LEVEL, default
INFO, into the actor's Ray log); once started, a process (pool actor or router) keeps Python's
garbage collector out of the serving path and hands the GIL between threads within a fraction of a
millisecond. `gc_stats()` reports both for the worker's stats."""

from __future__ import annotations

import gc
import logging
import os
import sys
import time

from tandem.runtime.logging_setup import setup_logging

log = logging.getLogger(__name__)


def setup_process(num_cpus: float) -> None:
    # Load every CUDA kernel when the context is made, not on first launch. A lazy load waits for
    # the GPU's queue to drain, and on a pool actor that queue usually holds an NCCL receive or
    # send spinning until the peer reaches it: a step that first touches a new GEMM kernel then
    # stalls for as long as the peer's prefill (1-2.5 s per stall on H200s under the agent
    # workload, docs/benchmarks.md). Takes effect only if CUDA has not started in this process yet
    # (it has not in a fresh actor); TANDEM_CUDA_MODULE_LOADING=LAZY restores the default.
    os.environ["CUDA_MODULE_LOADING"] = os.environ.get("TANDEM_CUDA_MODULE_LOADING", "EAGER")
    import torch  # noqa: PLC0415 - after CUDA_MODULE_LOADING is set, and only in serving processes

    torch.set_num_threads(max(1, int(num_cpus)))
    setup_logging()
    gil_switch_interval()     # a bad $TANDEM_GIL_SWITCH_INTERVAL_S fails the actor now, not after warmup


class GCMonitor:
    """Times Python's garbage collections in this process (gc.callbacks). A full collection walks
    every tracked object (torch, Ray, the engine: ~360k objects and ~180 ms on a 2-core CPU, more
    on a GPU actor) with the GIL held, so the engine loop stops for as long: pauses over
    `log_over_s` are logged, and the count and worst one are in the worker's stats."""

    def __init__(self, log_over_s: float = 0.1):
        self.log_over_s = log_over_s
        self.collections = [0, 0, 0]
        self.pause_max_s = 0.0
        self.pause_total_s = 0.0
        self.long_pauses = 0
        self._t0 = 0.0
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
            return
        dt = time.perf_counter() - self._t0
        self.collections[info["generation"]] += 1
        self.pause_total_s += dt
        self.pause_max_s = max(self.pause_max_s, dt)
        if dt > self.log_over_s:
            self.long_pauses += 1
            log.warning("garbage collection paused the process %.0f ms (generation %d, %d collected)",
                        1e3 * dt, info["generation"], info.get("collected", 0))

    def stats(self) -> dict:
        return {"gc_collections": list(self.collections), "gc_pause_max_s": round(self.pause_max_s, 4),
                "gc_pause_total_s": round(self.pause_total_s, 4), "gc_long_pauses": self.long_pauses,
                "gc_frozen_objects": gc.get_freeze_count()}

    def close(self) -> None:
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)


_gc_monitor: GCMonitor | None = None

# How long a thread may hold the GIL while another waits for it. Python's default is 5 ms: a
# thread that wakes (a KV transfer's frame arrived, a Ray call came in, an output is ready to
# stream) waits up to that long while the engine loop runs Python (scheduling, sampling, output
# bookkeeping), and a transfer or a call that wakes several times pays it each time. 200 us hands
# the GIL over ~20x sooner; the cost is a switch per 200 us only while two threads both want to run
# (docs/benchmarks.md, issue 5, measures both).
GIL_SWITCH_INTERVAL_ENV = "TANDEM_GIL_SWITCH_INTERVAL_S"
DEFAULT_GIL_SWITCH_INTERVAL_S = 200e-6


def gil_switch_interval() -> float:
    """The interval this process serves with: $TANDEM_GIL_SWITCH_INTERVAL_S, else 200 us."""
    raw = os.environ.get(GIL_SWITCH_INTERVAL_ENV, "").strip()
    if not raw:
        return DEFAULT_GIL_SWITCH_INTERVAL_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not 1e-6 <= value <= 1.0:
        raise ValueError(f"{GIL_SWITCH_INTERVAL_ENV}={raw!r}: give seconds between 1e-6 and 1 "
                         f"(Python's default is 0.005; Tandem serves with {DEFAULT_GIL_SWITCH_INTERVAL_S})")
    return value


def after_startup() -> None:
    """Once a process is ready to serve (a pool actor's worker built and warmed up, `tandem up`'s
    router listening): move every object alive now into the permanent generation (gc.freeze), so
    later collections walk only what serving allocates, and start timing collections (SGLang and
    vLLM freeze after start-up too); then shorten the GIL's switch interval (above)."""
    global _gc_monitor
    gc.collect()
    gc.freeze()
    if _gc_monitor is None:
        _gc_monitor = GCMonitor()
    sys.setswitchinterval(gil_switch_interval())
    log.info("startup objects frozen: %d; later collections skip them; GIL switch interval %.0f us",
             gc.get_freeze_count(), sys.getswitchinterval() * 1e6)


def gc_stats() -> dict:
    out = _gc_monitor.stats() if _gc_monitor is not None else {}
    return {**out, "gil_switch_interval_s": sys.getswitchinterval()}
