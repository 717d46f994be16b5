"""Which worker of a pool serves a request. Pure: the server passes in what it knows of the workers.

The policy (DESIGN.md, "One request", step 3), for the decode pool and the prefill pool alike:
1. the session's own worker, unless it is gone, not ready (draining, dead) or overloaded;
2. otherwise, among ready workers that are not overloaded: the most of the prompt cached,
3. then the least loaded (running + waiting requests), then the lowest KV use,
4. then the smallest worker id, so the same inputs always give the same answer.
`None` means no worker can take the request now: `any_ready` tells the server whether to answer
UNAVAILABLE (no ready worker at all) or RESOURCE_EXHAUSTED (all of them overloaded).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

READY, DRAINING, DEAD = "ready", "draining", "dead"


@dataclass(frozen=True)
class WorkerView:
    """What the router knows of one worker when routing one request."""

    worker_id: str
    pool: str  # "prefill" | "decode"
    state: str = READY  # READY | DRAINING | DEAD
    running: int = 0  # requests in its running batch
    waiting: int = 0  # requests queued for admission
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    # Prompt tokens (or blocks: one unit per call) it already caches, from a probe or a PrefixIndex.
    cached_prefix_tokens: int = 0

    @property
    def load(self) -> int:
        return self.running + self.waiting

    @property
    def kv_usage(self) -> float:
        return self.kv_blocks_used / self.kv_blocks_total if self.kv_blocks_total else 0.0


OverloadFn = Callable[[WorkerView], bool]


def overload_threshold(*, max_waiting: int | None = None, max_load: int | None = None,
                       max_kv_usage: float | None = None) -> OverloadFn:
    """An overload test from SRE limits; a limit left as None is not checked."""
    def overloaded(w: WorkerView) -> bool:
        return ((max_waiting is not None and w.waiting > max_waiting)
                or (max_load is not None and w.load > max_load)
                or (max_kv_usage is not None and w.kv_usage > max_kv_usage))
    return overloaded


def never_overloaded(w: WorkerView) -> bool:
    return False


def any_ready(workers: Iterable[WorkerView]) -> bool:
    return any(w.state == READY for w in workers)


def choose_worker(workers: Iterable[WorkerView], session_worker_id: str | None,
                  prefix_hits: Mapping[str, int] | None = None, *,
                  overload_fn: OverloadFn = never_overloaded) -> str | None:
    """The worker to send the request to, or None if none can take it (see module docstring).

    `prefix_hits` (worker id -> cached prefix length, e.g. from `PrefixIndex.match`) adds to each
    view's `cached_prefix_tokens`: the larger of the two counts.
    """
    hits = prefix_hits or {}
    candidates = [w for w in workers if w.state == READY and not overload_fn(w)]
    for w in candidates:
        if w.worker_id == session_worker_id:
            return w.worker_id
    if not candidates:
        return None

    def rank(w: WorkerView) -> tuple:
        cached = max(w.cached_prefix_tokens, hits.get(w.worker_id, 0))
        return (-cached, w.load, w.kv_usage, w.worker_id)

    return min(candidates, key=rank).worker_id


def prefill_placement(hint: str | None, prefill_ids: Iterable[str], prefill_queued: Mapping[str, int],
                      local_queued: int, tokens: int, cap: float) -> str | None:
    """Where a prompt of `tokens` new tokens is prefilled under `prefill.max_queued_tokens` (`cap`):
    the prefill actor `hint` (the pick by affinity and prefix) unless it holds too many queued prompt
    tokens to take these; then the least-queued prefill actor with room; when none has room, the
    decode actor prefills it itself (None), but only while its own queue of local prefills
    (`local_queued` tokens) is shorter than the shortest prefill queue: past that, the prompt waits
    on the prefill actor instead. Without that last rule a prefill pool past its cap sent every
    prompt to the decode GPU, whose queue then grew without bound (two H200s at 8 sessions/s: TTFT
    p90 12.6 s, docs/benchmarks.md). Queues count prompt tokens from placement to first token
    (remote: to the KV's delivery); an idle prefill actor takes any prompt, however long."""
    def room(w: str | None) -> bool:
        queued = prefill_queued.get(w, 0) if w is not None else 0
        return queued == 0 or queued + tokens <= cap

    if hint is None or room(hint):
        return hint
    ids = sorted(prefill_ids)
    roomy = [w for w in ids if room(w)]
    if roomy:
        return min(roomy, key=lambda w: prefill_queued.get(w, 0))
    shortest = min(ids, key=lambda w: prefill_queued.get(w, 0), default=None)
    if shortest is None or local_queued < prefill_queued.get(shortest, 0):
        return None
    return shortest
