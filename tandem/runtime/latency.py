"""A rolling window of recent latencies with percentiles, for the workers' health reports (the
autoscaler's TTFT and TPOT signals). Pure; time comes in as arguments."""

from __future__ import annotations

from collections import deque


# how far back a worker's TTFT and TPOT percentiles look, unless autoscaler.latency_window_s says
DEFAULT_WINDOW_S = 30.0


class LatencyWindow:
    def __init__(self, window_s: float = DEFAULT_WINDOW_S, max_samples: int = 4096):
        self.window_s = window_s
        self.samples: deque[tuple[float, float]] = deque(maxlen=max_samples)  # (at, seconds)

    def add(self, now: float, seconds: float) -> None:
        self.samples.append((now, seconds))

    def percentiles(self, now: float) -> dict[str, float | None]:
        while self.samples and self.samples[0][0] < now - self.window_s:
            self.samples.popleft()
        vals = sorted(s for _, s in self.samples)
        if not vals:
            return {"p50": None, "p90": None, "p99": None}
        pick = lambda q: vals[min(len(vals) - 1, int(q * len(vals)))]  # noqa: E731
        return {"p50": pick(0.5), "p90": pick(0.9), "p99": pick(0.99)}
