"""What a served engine's steps really carried and when each began, for checking the perf model
(tandem/perf_model.py) on the very steps a run made: `bench.validate_simulator` prices each traced
step with `PerfModel.step_s` and sets it beside the time the step took.

Off unless `$TANDEM_STEP_TRACE_DIR` names a directory (a diagnostic, like a profiler): each engine
then appends one JSON line per step to `steps-<pid>.jsonl` there, flushed about once a second. A
line is `[start_unix, end_unix, decoding sequences, their context tokens, their draft tokens, the
widest draft, [[prompt tokens computed, context once in], ...], overlapped, more, captured,
uncaptured, split]`: when the
`LLMEngine.step` call began and returned, the step's decode part and prefill chunks as the
scheduler gave them, whether its tokens stayed on the device while the next step launched
(engine.inflight: the next call waits for it), whether the scheduler had more work then (the
serving loop steps again at once), whether the step captured a CUDA graph (a one-off stall the
perf model does not price; traces written before it have 9 fields), and whether it ran eagerly
because its graph shape was not captured yet (`DecodeGraphs.capture_after`: what a capture policy
trades against the stall; traces before it have 10 fields), and whether such a step ran on the
piecewise graphs instead (`DecodeGraphs.capture_split_after`; traces before it have 11 fields).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

TRACE_ENV = "TANDEM_STEP_TRACE_DIR"


class StepTrace:
    def __init__(self, path: str | os.PathLike, flush_s: float = 1.0):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.flush_s = flush_s
        self._pending: list[list] = []
        self._open: list | None = None      # the step begun and not yet ended
        self._flushed = time.monotonic()

    @classmethod
    def from_env(cls) -> "StepTrace | None":
        d = os.environ.get(TRACE_ENV)
        return cls(Path(d) / f"steps-{os.getpid()}.jsonl") if d else None

    def begin(self, start_unix: float, scheduled) -> None:
        """A step is scheduled (`ScheduledRequest`s, before the scheduler advances them)."""
        decode = context = drafts = widest = 0
        chunks = []
        for x in scheduled:
            r = x.request
            done = r.num_computed_tokens + x.num_new_tokens
            if r.num_computed_tokens < r.num_prompt_tokens:
                chunks.append([x.num_new_tokens, done])
            else:
                decode, context = decode + 1, context + done
                drafts, widest = drafts + x.num_draft_tokens, max(widest, x.num_draft_tokens)
        self._open = [round(start_unix, 6), 0.0, decode, context, drafts, widest, chunks]

    def end(self, overlapped: bool, more: bool, captured: bool = False, uncaptured: bool = False,
            split: bool = False) -> None:
        if self._open is not None:
            self._open[1] = round(time.time(), 6)
            self._pending.append(self._open + [bool(overlapped), bool(more), bool(captured), bool(uncaptured),
                                               bool(split)])
            self._open = None
        if time.monotonic() - self._flushed >= self.flush_s:
            self.flush()

    def flush(self) -> None:
        self._flushed = time.monotonic()
        if not self._pending:
            return
        with self.path.open("a") as f:
            f.write("".join(json.dumps(x, separators=(",", ":")) + "\n" for x in self._pending))
        self._pending.clear()


def read_traces(directory: str | os.PathLike) -> list[list[list]]:
    """Every engine's steps in `directory` (one list per `steps-*.jsonl`), in the order they ran."""
    out = []
    for p in sorted(Path(directory).glob("steps-*.jsonl")):
        out.append([json.loads(line) for line in p.read_text().splitlines() if line.strip()])
    return out


def step_times(steps: list[list]) -> list[tuple[list, float]]:
    """(step, seconds it took) for the steps of one engine whose time the trace shows. A step
    resolved within its call took from that call's start to the next call's when the engine had more
    work (the serving loop's work between steps is part of a served step), else the call itself. An
    overlapped step ran on the device from its call's end (the one before it was read then) to the
    next call's end (which read it), counted only where that next call came straight after."""
    out = []
    for i, s in enumerate(steps):
        start, end, overlapped, more = s[0], s[1], s[7], s[8]
        nxt = steps[i + 1] if i + 1 < len(steps) else None
        if not overlapped:
            if more and nxt is None:
                continue            # the trace ends before the next call
            dt = nxt[0] - start if more else end - start
        elif nxt is not None and more and nxt[0] - end <= 0.002 + 0.25 * (end - start):
            dt = nxt[1] - end
        else:
            continue
        if dt > 0:
            out.append((s, dt))
    return out
