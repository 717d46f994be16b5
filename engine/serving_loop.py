"""A background thread that owns an engine: every engine mutation (add, abort, reserve blocks ...)
runs on it, between steps, so the engine needs no locks. Callers submit functions and get
futures back; outputs of each step go to `on_step(outputs)`.

Used by both worker kinds (prefill and decode actors); the loop itself holds no policy.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import Future
from typing import Any, Callable

log = logging.getLogger(__name__)


def _noop() -> None:
    pass


class EngineLoop:
    def __init__(self, engine, on_step: Callable[[list], None], before_step: Callable[[], None] | None = None,
                 layer_done: Callable | None = None, idle_wait_s: float = 0.005, name: str = "engine-loop"):
        self.engine = engine
        self.on_step = on_step
        self.before_step = before_step or (lambda: None)
        self.layer_done = layer_done
        self.idle_wait_s = idle_wait_s
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._stop = threading.Event()
        self.busy_s = 0.0  # time spent in engine steps (utilisation metric)
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> "EngineLoop":
        """Start the thread. Separate from __init__: the hooks usually read the owner's
        `loop` attribute, which is only set once the constructor has returned."""
        self._thread.start()
        return self

    def call(self, fn: Callable[..., Any], *args, **kwargs) -> Future:
        """Run `fn(*args, **kwargs)` on the loop thread; the future carries its result or error."""
        fut: Future = Future()
        if self._stop.is_set():
            fut.set_exception(RuntimeError("engine loop is stopped"))
            return fut
        self._calls.put((fn, args, kwargs, fut))
        return fut

    def wake(self) -> None:
        """Make an idle loop run before_step now (e.g. a KV transfer just finished); any thread."""
        if not self._stop.is_set():
            self._calls.put((_noop, (), {}, Future()))

    def run(self, fn: Callable[..., Any], *args, timeout: float | None = 60.0, **kwargs) -> Any:
        return self.call(fn, *args, **kwargs).result(timeout)

    def stop(self) -> None:
        self._stop.set()
        self._calls.put(None)
        if self._thread.is_alive():
            self._thread.join(timeout=10)

    def _drain_calls(self, block: bool) -> None:
        try:
            item = self._calls.get(timeout=self.idle_wait_s) if block else self._calls.get_nowait()
        except queue.Empty:
            return
        while item is not None:
            fn, args, kwargs, fut = item
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn(*args, **kwargs))
                except BaseException as e:  # noqa: BLE001 - handed to the caller
                    fut.set_exception(e)
            try:
                item = self._calls.get_nowait()
            except queue.Empty:
                return

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._drain_calls(block=not self.engine.has_unfinished())
                self.before_step()
                if not self.engine.has_unfinished():
                    continue
                t0 = time.perf_counter()
                outputs = self.engine.step(self.layer_done)
                self.busy_s += time.perf_counter() - t0
                if outputs:
                    self.on_step(outputs)
            except BaseException as e:  # noqa: BLE001 - a dead loop must be visible, not silent
                log.exception("engine loop failed")
                self.error = e
                self._stop.set()
        # fail whatever is still queued
        while True:
            try:
                item = self._calls.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                item[3].set_exception(RuntimeError("engine loop stopped"))
