"""The one placement policy: which worker of a pool serves a request, and whether its prompt is
prefilled by a prefill worker or by its decode worker. Pure: callers pass in what they know of the
workers. The router, the decode worker and the simulator all decide through these functions, so
the simulator predicts what the cluster does.

Worker choice (`choose_worker`), for the decode pool and the prefill pool alike:
1. the session's own worker, unless it is gone, not ready (draining, dead) or overloaded;
2. otherwise, among ready workers that are not overloaded: the most of the prompt cached,
3. then the least loaded (running + waiting requests), then the lowest KV use,
4. then the smallest worker id, so the same inputs always give the same answer.
`None` means no worker can take the request now: `any_ready` tells the caller whether that is
because none is ready (UNAVAILABLE) or because all of them are overloaded (RESOURCE_EXHAUSTED).

Local or remote prefill, in the order a request meets the rules:
1. remote prefill is offered only when there is a prefill pool and the local-prefill threshold is
   finite (`remote_prefill_offered`; an infinite threshold is the colocated mode);
2. the prefill worker picked by rule 1-4 above takes the prompt unless it holds too many queued
   prompt tokens; past that, the least queued one with room; when none has room, the decode
   worker prefills it itself, but only while its own queue is the shorter (`prefill_placement`);
3. the decode worker prefills the prompt itself when the part its prefix cache lacks is at most
   the threshold (`wants_remote_prefill`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

READY, DRAINING, DEAD = "ready", "draining", "dead"


@dataclass(frozen=True)
class WorkerView:
    """What the caller knows of one worker when placing one request."""

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


@dataclass(frozen=True)
class OverloadLimits:
    """SRE limits past which a worker is overloaded (skipped, even as a session's own worker); a
    limit left as None is not checked. All None (the default): no worker is ever overloaded."""

    max_waiting: int | None = None
    max_load: int | None = None
    max_kv_usage: float | None = None

    def __call__(self, w: WorkerView) -> bool:
        return ((self.max_waiting is not None and w.waiting > self.max_waiting)
                or (self.max_load is not None and w.load > self.max_load)
                or (self.max_kv_usage is not None and w.kv_usage > self.max_kv_usage))


def any_ready(workers: Iterable[WorkerView]) -> bool:
    return any(w.state == READY for w in workers)


def choose_worker(workers: Iterable[WorkerView], session_worker_id: str | None,
                  prefix_hits: Mapping[str, int] | None = None, *,
                  overload_fn: OverloadFn = OverloadLimits()) -> str | None:
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


def remote_prefill_offered(threshold: float, prefill_workers: int) -> bool:
    """Remote prefill is on offer at all: a prefill pool exists and the threshold is finite."""
    return threshold != float("inf") and prefill_workers > 0


def wants_remote_prefill(prompt_tokens: int, cached_tokens: int, threshold: float) -> bool:
    """The decode worker's rule, once it knows its cache: prefill remotely only the prompts whose
    uncached part is longer than `threshold` (`decode.local_prefill_threshold`) tokens."""
    return prompt_tokens > cached_tokens and prompt_tokens - cached_tokens > threshold


def local_prefill_queue(session_decode_id: str | None, local_queued: Mapping[str, int],
                        decode_ids: Iterable[str]) -> int:
    """The local-prefill queue `prefill_placement` weighs, before the decode worker is picked: the
    session's decode worker's, else the shortest of all decode workers'."""
    ids = [session_decode_id] if session_decode_id else list(decode_ids)
    return min((local_queued.get(w, 0) for w in ids), default=0)


def prefill_placement(hint: str | None, prefill_ids: Iterable[str], prefill_queued: Mapping[str, int],
                      local_queued: int, tokens: int, cap: float) -> str | None:
    """Where a prompt of `tokens` new tokens is prefilled under `prefill.max_queued_tokens` (`cap`):
    the prefill worker `hint` (the pick by affinity and prefix) unless it holds too many queued
    prompt tokens to take these; then the least-queued prefill worker with room (ties: the smallest
    id); when none has room, the decode worker prefills it itself (None), but only while its own
    queue of local prefills (`local_queued` tokens) is shorter than the shortest prefill queue:
    past that, the prompt waits on the prefill worker instead. Without that last rule a prefill pool
    past its cap sent every prompt to the decode GPU, whose queue then grew without bound (two
    H200s at 8 sessions/s: TTFT p90 12.6 s, docs/benchmarks.md). Queues count prompt tokens from
    placement to first token (remote: to the KV's delivery); an idle prefill worker takes any
    prompt, however long."""
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
