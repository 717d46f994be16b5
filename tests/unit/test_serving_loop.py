"""The engine loop's failure policy, on a stand-in engine (pure control flow): a step that raises
fails its requests through the hook and the loop serves on; a run of failures stops it, and calls
on a stopped loop raise WorkerUnavailable (routers then try another actor). And which calls may
run inside a step."""

import threading
import time

import pytest

from tandem.engine.serving_loop import EngineLoop
from tandem.wire.errors import WorkerUnavailable


class FlakyEngine:
    """Has work while `pending` > 0; each step consumes one unit, or raises while `fail` > 0."""

    def __init__(self, pending: int, fail: int):
        self.pending, self.fail, self.steps = pending, fail, 0

    def has_unfinished(self) -> bool:
        return self.pending > 0

    def step(self, _layer_done=None, after_launch=None):
        if self.fail:
            self.fail -= 1
            raise RuntimeError("kernel exploded")
        self.pending -= 1
        self.steps += 1
        return ["out"]


def until(cond, timeout=5.0):
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end
        time.sleep(0.005)


def test_a_failing_step_calls_the_hook_and_the_loop_goes_on():
    engine, failed, outputs = FlakyEngine(pending=5, fail=2), [], []
    loop = EngineLoop(engine, on_step=outputs.extend, on_step_error=failed.append).start()
    try:
        until(lambda: engine.pending == 0)
        assert [str(e) for e in failed] == ["kernel exploded"] * 2
        assert loop.step_errors == 2 and loop.error is None
        assert loop.last_step_error == "RuntimeError: kernel exploded"
        assert loop.run(lambda: 42) == 42          # still serving calls
        assert outputs == ["out"] * 5
    finally:
        loop.stop()


class LongStepEngine:
    """One step: queues its "kernels" (after_launch), then waits `device_s` for the "device"."""

    def __init__(self, device_s: float):
        self.device_s, self.pending, self.launched, self.finished_at = device_s, 1, threading.Event(), None

    def has_unfinished(self) -> bool:
        return self.pending > 0

    def step(self, _layer_done=None, after_launch=None):
        done_at = time.monotonic() + self.device_s
        wait_device = lambda: time.sleep(max(0.0, done_at - time.monotonic()))  # noqa: E731
        self.launched.set()
        if after_launch is not None:      # the loop may serve mid-step calls until the "device" is done
            after_launch(wait_device)
        wait_device()                     # the step's own sync (sampling): at once if waited already
        self.pending -= 1
        self.finished_at = time.monotonic()
        return []


def test_mid_step_calls_run_while_the_step_waits_for_the_device_and_others_after_it():
    engine = LongStepEngine(device_s=0.6)
    loop = EngineLoop(engine, on_step=lambda _: None).start()
    try:
        assert engine.launched.wait(5)
        time.sleep(0.05)                       # inside the step, its launches done
        ran = {}
        mid = loop.call_mid_step(lambda: ran.setdefault("mid", time.monotonic()))
        between = loop.call(lambda: ran.setdefault("between", time.monotonic()))
        mid.result(5), between.result(5)
        assert ran["mid"] < engine.finished_at <= ran["between"]
        assert loop.mid_step_calls == 1
        with pytest.raises(ZeroDivisionError):     # an error goes to the caller, the step goes on
            loop.run_mid_step(lambda: 1 / 0)
        assert loop.run_mid_step(lambda: 7) == 7   # idle loop: runs between steps
        assert loop.error is None and loop.step_errors == 0
    finally:
        loop.stop()
    with pytest.raises(WorkerUnavailable):
        loop.run_mid_step(lambda: 1)


def test_without_mid_step_serving_a_call_made_during_the_device_wait_waits_for_the_step():
    engine = LongStepEngine(device_s=0.3)
    loop = EngineLoop(engine, on_step=lambda _: None, serve_mid_step=False).start()
    try:
        assert engine.launched.wait(5)
        time.sleep(0.05)
        ran = loop.run_mid_step(time.monotonic)
        assert ran >= engine.finished_at and loop.mid_step_calls == 0
    finally:
        loop.stop()


def test_consecutive_failures_stop_the_loop_and_calls_say_unavailable():
    engine, failed = FlakyEngine(pending=1, fail=10), []
    loop = EngineLoop(engine, on_step=lambda _: None, on_step_error=failed.append, max_consecutive_errors=3).start()
    until(lambda: loop.error is not None)
    assert len(failed) == 3 and engine.fail == 7
    with pytest.raises(WorkerUnavailable, match="engine loop is stopped"):
        loop.run(lambda: 1)
    loop.stop()


def test_without_a_hook_the_first_failure_stops_the_loop():
    loop = EngineLoop(FlakyEngine(pending=1, fail=1), on_step=lambda _: None).start()
    until(lambda: loop.error is not None)
    assert loop.step_errors == 1
    loop.stop()


def test_a_hook_that_raises_stops_the_loop():
    def bad_hook(_exc):
        raise ValueError("cannot clean up")

    loop = EngineLoop(FlakyEngine(pending=3, fail=1), on_step=lambda _: None, on_step_error=bad_hook).start()
    until(lambda: loop.error is not None)
    assert isinstance(loop.error, RuntimeError)
    loop.stop()


def test_an_injected_failure_fires_once():
    engine, failed = FlakyEngine(pending=0, fail=0), []
    loop = EngineLoop(engine, on_step=lambda _: None, on_step_error=failed.append).start()
    try:
        engine.scheduler = type("S", (), {"requests": {}})()
        loop.run(loop.inject_step_failure, None)
        engine.pending = 3
        loop.wake()
        until(lambda: engine.pending == 0)
        assert len(failed) == 1 and type(failed[0]).__name__ == "InjectedStepFailure"
        assert engine.steps == 3
    finally:
        loop.stop()


def run_logging_slow_steps(engine, slow_step_s: float, caplog) -> tuple[EngineLoop, list[str]]:
    """Serve `engine` until it has no work; the loop and its slow-step log messages."""
    with caplog.at_level("WARNING", logger="tandem.engine.serving_loop"):
        loop = EngineLoop(engine, on_step=lambda outs: None, slow_step_s=slow_step_s).start()
        try:
            until(lambda: engine.pending == 0)
        finally:
            loop.stop()
    return loop, [r.getMessage() for r in caplog.records if "slow engine step" in r.getMessage()]


def test_a_slow_step_is_logged_with_what_it_ran(caplog):
    class SlowEngine(FlakyEngine):
        def step(self, _layer_done=None, after_launch=None):
            time.sleep(0.03 if self.pending == 2 else 0.0)
            return super().step()

        def last_step_summary(self):
            return {"seqs": 3, "tokens": 4100, "graph": None}

    loop, slow = run_logging_slow_steps(SlowEngine(pending=3, fail=0), 0.02, caplog)
    assert loop.slow_steps == 1 and len(slow) == 1, slow
    assert "'tokens': 4100" in slow[0]


def test_a_slow_step_log_names_where_the_step_sat(caplog):
    """The loop samples a long step's stack, so the log says which line the time went to."""
    def waits_on_the_device():
        time.sleep(0.4)

    class SlowEngine(FlakyEngine):
        def step(self, _layer_done=None, after_launch=None):
            if self.pending == 2:
                waits_on_the_device()
            return super().step()

    _, slow = run_logging_slow_steps(SlowEngine(pending=3, fail=0), 0.1, caplog)
    assert len(slow) == 1, slow
    where = slow[0].split("sampled at: ")[1]
    assert where.split("x ", 1)[0].isdigit() and "waits_on_the_device" in where.split(" < ")[0], where
