"""A background thread that owns an engine: every engine mutation (add, abort, reserve blocks ...)
runs on it, between steps, so the engine needs no locks. Callers submit functions and get
futures back; outputs of each step go to `on_step(outputs)`. Calls that cannot disturb the
running step (making, admitting and queueing new requests) may be submitted with
`call_mid_step`: they also run inside a step, once its kernels are queued and before the host
waits for them, so on a GPU they wait for a step's launches, not for the whole step (a prefill
actor's reserve and start used to wait up to one long prefill step each).

A step that raises (a kernel error, an out-of-memory, a bug) costs the requests the engine holds,
not the actor: `on_step_error(exc)` fails them (their routers retry them elsewhere) and frees their
KV, and the loop goes on serving. Only `max_consecutive_errors` failures in a row stop it, because
then the engine itself is broken; the controller sees `error` in the worker's stats and replaces
the actor. Calls on a stopped loop raise WorkerUnavailable, so routers move on to another actor.

Used by both worker kinds (prefill and decode actors); the loop itself holds no policy.
"""

from __future__ import annotations

import collections
import logging
import queue
import sys
import threading
import time
from concurrent.futures import Future
from typing import Any, Callable

import torch

from tandem.wire.errors import WorkerUnavailable

log = logging.getLogger(__name__)


def _noop() -> None:
    pass


_DEVICE_DONE = object()    # the device waiter's wake-up, through the mid-step call queue


def _run_call(item: tuple) -> None:
    fn, args, kwargs, fut = item
    if fut.set_running_or_notify_cancel():
        try:
            fut.set_result(fn(*args, **kwargs))
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            fut.set_exception(e)


class InjectedStepFailure(RuntimeError):
    pass


class _StepSampler:
    """Where a long step's thread is: once a step has run for `after_s`, a daemon thread samples
    the loop thread's Python stack every `every_s` until the step ends. A slow-step log then
    names the lines it sat on (a device wait in sampling, a launch blocked in the allocator, a
    compile) instead of only its length. Costs nothing while steps are short."""

    def __init__(self, after_s: float, every_s: float = 0.05):
        self.after_s, self.every_s = after_s, every_s
        self._started: float | None = None
        self._ident: int | None = None
        self._seen: collections.Counter = collections.Counter()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def begin(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="step-sampler", daemon=True)
            self._thread.start()
        self._ident = threading.get_ident()
        self._started = time.perf_counter()

    def end(self) -> list[tuple[str, int]]:
        """The step ended: the stacks seen (innermost frames first) and how often, commonest first."""
        with self._lock:
            self._started = None
            seen, self._seen = self._seen, collections.Counter()
        return seen.most_common(3)

    def _run(self) -> None:
        while True:
            time.sleep(self.every_s)
            started, ident = self._started, self._ident
            if started is None or time.perf_counter() - started < self.after_s:
                continue
            frame = sys._current_frames().get(ident)
            where = []
            while frame is not None and len(where) < 6:
                code = frame.f_code
                where.append(f"{code.co_filename.rsplit('/', 2)[-1]}:{frame.f_lineno} {code.co_name}")
                frame = frame.f_back
            with self._lock:
                if self._started is started:
                    self._seen[" < ".join(where)] += 1


class EngineLoop:
    def __init__(self, engine, on_step: Callable[[list], None], before_step: Callable[[], None] | None = None,
                 layer_done: Callable | None = None, idle_wait_s: float = 0.005, name: str = "engine-loop",
                 on_step_error: Callable[[BaseException], None] | None = None, max_consecutive_errors: int = 3,
                 slow_step_s: float = 0.5, serve_mid_step: bool = True):
        """`serve_mid_step`: while a step's kernels run on the device, serve `call_mid_step` calls
        as they come (a thread waits for the device and wakes the loop when the step is done);
        False: only right after the launches and between steps."""
        self.engine = engine
        self.on_step = on_step
        self.on_step_error = on_step_error
        self.max_consecutive_errors = max_consecutive_errors
        self.slow_step_s = slow_step_s  # a step longer than this is logged with what it ran
        self.slow_steps = 0
        self.step_errors = 0          # steps that raised, in all
        self._inject: Callable[[Any], bool] | None = None
        self._inject_left = [0]       # injected failures still to come
        self.last_step_error: str | None = None
        self.before_step = before_step or (lambda: None)
        self.layer_done = layer_done
        self.idle_wait_s = idle_wait_s
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._mid_calls: queue.SimpleQueue = queue.SimpleQueue()   # also run inside a step
        self.mid_step_calls = 0       # how many of them ran inside a step (the rest between steps)
        self.serve_mid_step = serve_mid_step
        self._device_waits: queue.SimpleQueue | None = None    # the device waiter's work
        self._stop = threading.Event()
        self.busy_s = 0.0  # time spent in engine steps (utilisation metric)
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._sampler = _StepSampler(slow_step_s / 2)
        self._allocator_seen: dict[str, int] | None = None

    def start(self) -> "EngineLoop":
        """Start the thread. Separate from __init__: the hooks usually read the owner's
        `loop` attribute, which is only set once the constructor has returned."""
        self._thread.start()
        return self

    def call(self, fn: Callable[..., Any], *args, **kwargs) -> Future:
        """Run `fn(*args, **kwargs)` on the loop thread; the future carries its result or error."""
        fut: Future = Future()
        if self._stop.is_set():
            fut.set_exception(self._stopped_error())
            return fut
        self._calls.put((fn, args, kwargs, fut))
        return fut

    def call_mid_step(self, fn: Callable[..., Any], *args, **kwargs) -> Future:
        """As `call`, and `fn` may also run inside a step, after its kernels are queued. Only for
        functions that leave the running step's requests, blocks and batch alone: making a
        request, admitting it to free blocks, queueing it for a later step. Never an abort or a
        free: the device may still be reading the blocks."""
        fut: Future = Future()
        if self._stop.is_set():
            fut.set_exception(self._stopped_error())
            return fut
        self._mid_calls.put((fn, args, kwargs, fut))
        self._calls.put((_noop, (), {}, Future()))    # an idle loop wakes for it
        return fut

    def run_mid_step(self, fn: Callable[..., Any], *args, timeout: float | None = 60.0, **kwargs) -> Any:
        return self.call_mid_step(fn, *args, **kwargs).result(timeout)

    def inject_step_failure(self, token_id: int | None = None, times: int = 1) -> None:
        """Loop thread (via call/run): make the next `times` steps whose requests include a prompt
        with `token_id` (any step if None) raise InjectedStepFailure (`max_consecutive_errors`
        of them in a row stop the loop). For chaos tests."""
        if times < 1:
            raise ValueError(f"times must be >= 1, got {times}")
        left = [times]

        def hit(engine) -> bool:
            if token_id is not None and not any(token_id in r.prompt_token_ids
                                                for r in engine.scheduler.requests.values()):
                return False
            left[0] -= 1
            return True
        self._inject, self._inject_left = hit, left

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
        self._drain_mid_calls(in_step=False)
        try:
            item = self._calls.get(timeout=self.idle_wait_s) if block else self._calls.get_nowait()
        except queue.Empty:
            return
        while item is not None:
            _run_call(item)
            try:
                item = self._calls.get_nowait()
            except queue.Empty:
                break
        self._drain_mid_calls(in_step=False)

    def _serve_while_device_runs(self, wait_device: Callable[[], None] | None) -> None:
        """Inside a step, its kernels queued: run mid-step calls until the device is done (a
        daemon thread blocks in `wait_device`, which releases the GIL, then wakes this one)."""
        self._drain_mid_calls()
        if wait_device is None or not self.serve_mid_step:
            return
        if self._device_waits is None:
            self._device_waits = queue.SimpleQueue()
            threading.Thread(target=self._wait_devices, name=f"{self._thread.name}-device-wait",
                             daemon=True).start()
        self._device_waits.put(wait_device)
        while True:
            item = self._mid_calls.get()
            if item is _DEVICE_DONE:
                return
            _run_call(item)
            self.mid_step_calls += 1

    def _wait_devices(self) -> None:
        while True:
            wait_device = self._device_waits.get()
            try:
                wait_device()
            except BaseException:  # noqa: BLE001 - the step's own sync raises it again, on the loop
                pass
            finally:
                self._mid_calls.put(_DEVICE_DONE)

    def _drain_mid_calls(self, in_step: bool = True) -> None:
        while True:
            try:
                item = self._mid_calls.get_nowait()
            except queue.Empty:
                return
            if item is not _DEVICE_DONE:       # (cannot be pending here; never run it as a call)
                _run_call(item)
                self.mid_step_calls += in_step

    def _run(self) -> None:
        consecutive = 0
        while not self._stop.is_set():
            try:
                self._drain_calls(block=not self.engine.has_unfinished())
                self.before_step()
                if not self.engine.has_unfinished():
                    continue
                if self._inject is not None and self._inject(self.engine):
                    if self._inject_left[0] <= 0:
                        self._inject = None
                    raise InjectedStepFailure("injected step failure (chaos test)")
                t0 = time.perf_counter()
                self._sampler.begin()
                try:
                    outputs = self.engine.step(self.layer_done, after_launch=self._serve_while_device_runs)
                finally:
                    where = self._sampler.end()
                dt = time.perf_counter() - t0
                self.busy_s += dt
                if dt > self.slow_step_s:
                    self.slow_steps += 1
                    summary = getattr(self.engine, "last_step_summary", dict)()
                    log.warning("slow engine step: %.0f ms, %s; allocator since the last slow step: %s; "
                                "sampled at: %s", 1e3 * dt, summary, self._allocator_delta(),
                                "; ".join(f"{n}x {stack}" for stack, n in where) or "-")
                consecutive = 0
                if outputs:
                    self.on_step(outputs)
            except BaseException as e:  # noqa: BLE001 - fail the requests, keep the actor
                consecutive += 1
                self.step_errors += 1
                self.last_step_error = f"{type(e).__name__}: {e}"[:500]
                log.exception("engine step failed (%d in a row)", consecutive)
                fatal = (consecutive >= self.max_consecutive_errors or self.on_step_error is None
                         or not isinstance(e, Exception))
                try:
                    if self.on_step_error is not None:
                        self.on_step_error(e)
                except BaseException:  # noqa: BLE001 - cannot even fail the requests: stop
                    log.exception("failing the requests after a step error failed too")
                    fatal = True
                if fatal:
                    self.error = e
                    self._stop.set()
        # fail whatever is still queued
        for calls in (self._calls, self._mid_calls):
            while True:
                try:
                    item = calls.get_nowait()
                except queue.Empty:
                    break
                if item is not None and item is not _DEVICE_DONE:
                    item[3].set_exception(self._stopped_error())

    def _allocator_delta(self) -> dict[str, int]:
        """cudaMallocs, frees and out-of-memory retries by torch's caching allocator since the
        previous call (any of them stalls the device's other streams, NCCL's included)."""
        cache = getattr(self.engine, "kv_cache", None)
        if cache is None or getattr(cache.device, "type", "cpu") != "cuda":
            return {}
        stats = torch.cuda.memory_stats(cache.device)
        now = {"mallocs": stats.get("segment.all.allocated", 0), "frees": stats.get("segment.all.freed", 0),
               "retries": stats.get("num_alloc_retries", 0)}
        before, self._allocator_seen = self._allocator_seen, now
        return {k: v - before[k] for k, v in now.items()} if before else now

    def _stopped_error(self) -> WorkerUnavailable:
        why = f": {self.error!r}"[:300] if self.error is not None else ""
        return WorkerUnavailable(f"engine loop is stopped{why}")
