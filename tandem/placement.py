"""The one placement policy: which worker of a pool serves a request, and whether its prompt is
prefilled by a prefill worker or by its decode worker. Pure: callers pass in what they know of the
workers. The router, the decode worker and the simulator all decide through these functions, so
the simulator predicts what the cluster does.

Worker choice (`choose_worker`), for the decode pool and the prefill pool alike:
1. the session's own worker, unless it is gone, not ready (draining, dead) or overloaded; with
   cost placement, a new request to the decode pool is refused while its session's worker is full
   (`BatchGuard`: one more sequence would step its batch past the TPOT SLO), and full workers are
   skipped below;
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

import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any
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

    @classmethod
    def of(cls, router) -> "OverloadLimits":
        """The limits a router config sets (cluster.config.RouterConfig's worker_max_* fields):
        what the router enforces and the simulator replays."""
        return cls(router.worker_max_waiting, router.worker_max_load, router.worker_max_kv_usage)

    def __call__(self, w: WorkerView) -> bool:
        return ((self.max_waiting is not None and w.waiting > self.max_waiting)
                or (self.max_load is not None and w.load > self.max_load)
                or (self.max_kv_usage is not None and w.kv_usage > self.max_kv_usage))


@dataclass(frozen=True)
class BatchGuard:
    """The cost model's guard on decode batches, past capacity: a worker with sequences to decode
    is full for a request when the PerfModel predicts that taking it (one more sequence, its
    prompt's KV more) would make the batch's steps slower than the TPOT SLO. The request is then
    refused (RESOURCE_EXHAUSTED, retried after the router's hint) rather than slowing every
    sequence of the batch past its SLO. A worker with nothing to decode is never full, and a
    request that would miss the SLO alone (its context alone too long) is never refused by it.

    Simulated on the calibrated H200 model's coding-agent grid: past capacity at TPOT 15 ms it
    serves up to 12% more within both SLOs than admitting everything; at TPOT 40 ms and at low
    rates it changes nothing (docs/benchmarks.md, "Adaptive placement on the coding-agent grid")."""

    perf: Any
    slo_tpot_s: float

    def full_for(self, prompt_tokens: int, block_tokens: int) -> OverloadFn:
        """`choose_worker`'s `full` for a request of `prompt_tokens`; `block_tokens`: the size of the
        views' KV blocks."""
        perf, slo = self.perf, self.slo_tpot_s
        if perf.tpot_s(1, prompt_tokens) > slo:
            return lambda w: False

        def full(w: WorkerView) -> bool:
            return w.load > 0 and perf.tpot_s(w.load + 1, w.kv_blocks_used * block_tokens + prompt_tokens) > slo
        return full


def any_ready(workers: Iterable[WorkerView]) -> bool:
    return any(w.state == READY for w in workers)


def choose_worker(workers: Iterable[WorkerView], session_worker_id: str | None,
                  prefix_hits: Mapping[str, int] | None = None, *,
                  overload_fn: OverloadFn = OverloadLimits(), full: OverloadFn | None = None) -> str | None:
    """The worker to send the request to, or None if none can take it (see module docstring).

    `prefix_hits` (worker id -> cached prefix length, e.g. from `PrefixIndex.match`) adds to each
    view's `cached_prefix_tokens`: the larger of the two counts. `full` (`BatchGuard.full_for`):
    a worker it holds full is skipped, but when that is the session's own worker the answer is
    None: the session keeps its worker, and the KV cached there, until its batch has room.
    """
    hits = prefix_hits or {}
    candidates = [w for w in workers if w.state == READY and not overload_fn(w)]
    for w in candidates:
        if w.worker_id == session_worker_id:
            return None if full is not None and full(w) else w.worker_id
    if full is not None:
        candidates = [w for w in candidates if not full(w)]
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


# ---- the cost model's choice: where a prompt is prefilled, and how many workers prefill -----------
# Every option is "compute the prompt's uncached tokens on worker X, in chunks of c tokens per step,
# beside X's own decode batch; if X is not the decode worker, ship the KV". Its predicted TTFT and
# the TPOT it causes (the batch X decodes while it computes, and the batch the request joins) come
# from the one PerfModel, and the option that meets both SLOs with the most headroom wins. The
# router asks per request; the controller (and the simulator, which runs the same controller) asks
# `plan_roles` how many workers should only prefill.

@dataclass(frozen=True)
class EngineLoad:
    """A worker's engine as the cost model sees it."""

    decode_seqs: int = 0        # sequences in its decode batch
    context_tokens: int = 0     # KV they hold
    queued_prefill_tokens: int = 0   # prompt tokens it has still to compute, ahead of a new one


@dataclass(frozen=True)
class PrefillOption:
    where: str          # LOCAL: the decode worker computes it; REMOTE: `worker_id` does, ships the KV
    worker_id: str      # who computes the prompt
    chunk_tokens: int   # prompt tokens per step
    ttft_s: float       # predicted
    tpot_s: float       # predicted: the worse of the batch it computes in and the batch it joins

    def headroom(self, slo_ttft_s: float, slo_tpot_s: float) -> float:
        """How far inside both SLOs (fractions of each; negative: outside)."""
        return min(self.headrooms(slo_ttft_s, slo_tpot_s))

    def headrooms(self, slo_ttft_s: float, slo_tpot_s: float) -> tuple[float, float]:
        """(TTFT headroom, TPOT headroom), each a fraction of its SLO."""
        return 1.0 - self.ttft_s / slo_ttft_s, 1.0 - self.tpot_s / slo_tpot_s


LOCAL, REMOTE = "local", "remote"
HORIZON_TOKENS = 128    # output tokens a request of a batch decodes, over which a prefill's harm spreads
HEADROOM_STEP = 0.02    # headrooms this close are equal: then local first (no transfer, no second GPU)


def chunk_choices(perf, decode_seqs: int, smallest: int = 256) -> list[int]:
    """Chunk sizes to weigh: powers of two from `smallest` up to the step's token budget left
    beside the batch, and that budget itself."""
    top = max(perf.max_step_tokens - decode_seqs, perf.block_tokens)
    out, c = [], min(smallest, top)
    while c < top:
        out.append(c)
        c *= 2
    return out + [top]


def chunked_prefill_s(perf, load: EngineLoad, new_tokens: int, cached: int, chunk: int,
                      horizon_tokens: int = HORIZON_TOKENS) -> tuple[float, float]:
    """(seconds until `new_tokens` more prompt tokens after `cached` ones are computed on a worker
    with `load`, in steps of `chunk` prompt tokens beside its decode batch, behind its queue; the
    TPOT its batch sees). The queue ahead is taken as prompts like this one. The TPOT is the
    mean over the chunked steps (the queue's and this prompt's) and `horizon_tokens` plain steps
    after them: what a request of the batch, which decodes that many tokens, sees on average."""
    b, ctx = load.decode_seqs, load.context_tokens
    q = load.queued_prefill_tokens

    def steps_s(n: int, start: int, span: int) -> float:
        if n <= 0:
            return 0.0
        k = math.ceil(n / chunk)
        empty = perf.step_s(b, ctx)          # the step's decode part (0 with no batch)
        base = perf.prefill_overhead_s(b)
        # sum over chunks of n_i * (per_token + attn * context after chunk i), over prompts of
        # `span` new tokens each
        attn = perf.prefill_attn_s * (n * start + n * (min(n, span) + chunk) / 2)
        return k * (empty + base) + n * perf.prefill_per_token_s + attn

    during = 0.0
    if b:
        k = math.ceil((q + new_tokens) / chunk)
        chunked = perf.tpot_s(b, ctx, [(min(chunk, q + new_tokens), cached + new_tokens)])
        during = (k * chunked + horizon_tokens * perf.tpot_s(b, ctx)) / (k + horizon_tokens)
    # an overlapped engine (perf_model: overlap) has scheduled its next step already: new work on
    # a busy worker waits that step out first
    wait = perf.step_s(b, ctx) if perf.overlap and b else 0.0
    # the queue: prompts like this one (their own cached prefixes unknown, taken as this one's)
    return wait + steps_s(q, cached, new_tokens) + steps_s(new_tokens, cached, new_tokens), during


def prefill_option(perf, where: str, worker_id: str, load: EngineLoad, decode_load: EngineLoad,
                   prompt_tokens: int, cached: int, chunk: int) -> PrefillOption:
    """One option's prediction. `load`: the computing worker's; `decode_load`: the decode worker
    the request then decodes on (the same worker when LOCAL); `cached`: prompt tokens the
    computing worker need not compute (its own cache, or the decode worker's prefix it pulls)."""
    n = max(prompt_tokens - cached, 1)      # the last prompt token is always computed
    compute_s, during = chunked_prefill_s(perf, load, n, prompt_tokens - n, chunk)
    ttft = compute_s + perf.request_overhead_s
    if where == LOCAL:
        # the decode worker's serving loop takes the request in before the step that prefills it
        # (a remote prefill's worker receives only the prefill, as the simulator charges them)
        ttft += perf.admit_host_s
    if where == REMOTE:
        # the KV streams layer by layer as the last chunk computes: only a slower link shows
        ttft += max(0.0, perf.transfer_s(prompt_tokens) - compute_s) + perf.remote_overhead_s
    after = perf.tpot_s(decode_load.decode_seqs + 1, decode_load.context_tokens + prompt_tokens)
    return PrefillOption(where, worker_id, chunk, ttft, max(during, after))


def choose_prefill(options: Iterable[PrefillOption], slo_ttft_s: float, slo_tpot_s: float) -> PrefillOption:
    """The option that meets both SLOs with the most headroom (when none meets both: the one that
    misses by least), in steps of HEADROOM_STEP; among those, the most headroom on the other SLO.
    Ties: local first, then the shorter TTFT, the larger chunk, the smaller id.

    The second rule matters whenever TPOT binds: every option joins the same decode batch, so
    they share their TPOT headroom, and without it a remote prefill that cuts the TTFT lost the tie
    to local; a worker lent to prefill then got no prompts at all (live, tests/cluster/test_adaptive.py)."""
    def rank(o: PrefillOption) -> tuple:
        worse, better = sorted(o.headrooms(slo_ttft_s, slo_tpot_s))
        return (-math.floor(worse / HEADROOM_STEP), -math.floor(better / HEADROOM_STEP), o.where != LOCAL,
                o.ttft_s, -o.chunk_tokens, o.worker_id)

    return min(options, key=rank)


def has_slack(candidate: EngineLoad, prefill_only: bool, decode: EngineLoad) -> bool:
    """A worker may prefill for another worker's request when it only prefills, or is idle (no
    batch, no queue) while the request's decode worker is not. A decoding worker's steps, KV and
    prefix cache are not spent on other workers' prompts: on the simulated agent grid, letting
    workers with half the batch prefill for others cost up to 3.5% goodput (TTFT 0.5 s)."""
    idle = not candidate.decode_seqs and not candidate.queued_prefill_tokens
    return prefill_only or (idle and decode.decode_seqs > 0)


def prefill_options(perf, prompt_tokens: int, decode_id: str, decode_load: EngineLoad, decode_cached: int,
                    prefillers: Mapping[str, tuple[EngineLoad, int]]) -> list[PrefillOption]:
    """Every option for one request: LOCAL on `decode_id` at each chunk size; REMOTE on each of
    `prefillers` (worker id -> (its load, its cached prefix of this prompt)): a worker without a
    decode batch at its whole step budget, one with a batch at each chunk size. A remote worker
    pulls the decode worker's prefix when that is longer than its own."""
    out = [prefill_option(perf, LOCAL, decode_id, decode_load, decode_load, prompt_tokens, decode_cached, c)
           for c in chunk_choices(perf, decode_load.decode_seqs)]
    for wid, (load, cached) in prefillers.items():
        if wid == decode_id:
            continue
        chunks = chunk_choices(perf, load.decode_seqs) if load.decode_seqs else [perf.max_step_tokens]
        out += [prefill_option(perf, REMOTE, wid, load, decode_load, prompt_tokens, max(cached, decode_cached), c)
                for c in chunks]
    return out


@dataclass(frozen=True)
class Demand:
    """What the cluster is asked for, as the controller measures it over its window."""

    prompt_tokens_per_s: float = 0.0   # uncached prompt tokens to compute per second
    mean_new_tokens: float = 0.0       # uncached tokens per prompt
    mean_prompt_tokens: float = 0.0    # prompt length (its context once in)
    decode_seqs: float = 0.0           # sequences decoding, cluster-wide
    context_tokens: float = 0.0        # KV they hold, cluster-wide


@dataclass(frozen=True)
class RoleOption:
    prefill_workers: int    # workers that only prefill (for the others); the rest decode and prefill
    chunk_tokens: int       # the decoding workers' prefill chunk (when they prefill themselves)
    ttft_s: float
    tpot_s: float
    headroom: float


def role_option(perf, d: Demand, workers: int, k: int, slo_ttft_s: float, slo_tpot_s: float) -> RoleOption:
    """The predicted steady state with `k` of `workers` prefill-only. k = 0: every worker decodes
    and prefills its own prompts in chunks, which stretch its steps by the share of time spent on
    chunks (rho); k > 0: the prefill-only workers take every prompt, a queue at utilization rho."""
    decoders = workers - k
    b, ctx = d.decode_seqs / decoders, d.context_tokens / decoders
    n, prompt = max(d.mean_new_tokens, 1.0), max(d.mean_prompt_tokens, d.mean_new_tokens, 1.0)
    if b > perf.max_batch:
        return RoleOption(k, perf.max_step_tokens, math.inf, math.inf, -math.inf)
    load = EngineLoad(round(b), round(ctx))
    best = None
    if k == 0:
        for c in chunk_choices(perf, round(b)):
            per_chunk = perf.prefill_base_s + c * (perf.prefill_per_token_s + perf.prefill_attn_s * prompt)
            rho = d.prompt_tokens_per_s / decoders / c * per_chunk
            if rho >= 1:
                continue
            compute, during = chunked_prefill_s(perf, load, round(n), round(prompt - n), c)
            mean_step = perf.step_s(round(b), round(ctx)) / (1 - rho) if b else 0.0
            tpot = max(mean_step / perf.spec_tokens_per_step, perf.tpot_s(round(b) + 1, round(ctx + prompt)))
            ttft = compute / (1 - rho) + perf.request_overhead_s
            o = RoleOption(0, c, ttft, tpot, min(1 - ttft / slo_ttft_s, 1 - tpot / slo_tpot_s))
            if best is None or o.headroom > best.headroom:
                best = o
        return best or RoleOption(0, perf.max_step_tokens, math.inf, math.inf, -math.inf)
    service = perf.prefill_s(round(n), round(prompt))
    rho = d.prompt_tokens_per_s / k * service / n
    if rho >= 1:
        return RoleOption(k, perf.max_step_tokens, math.inf, math.inf, -math.inf)
    ttft = (service + max(0.0, perf.transfer_s(round(prompt)) - service) + perf.remote_overhead_s) / (1 - rho) \
        + perf.request_overhead_s
    tpot = perf.tpot_s(round(b) + 1, round(ctx + prompt))
    return RoleOption(k, perf.max_step_tokens, ttft, tpot, min(1 - ttft / slo_ttft_s, 1 - tpot / slo_tpot_s))


def plan_roles(perf, demand: Demand, workers: int, slo_ttft_s: float, slo_tpot_s: float) -> list[RoleOption]:
    """Every split of `workers` into prefill-only and decoding workers (at least one decodes), best
    first: the most headroom inside both SLOs, ties to fewer prefill-only workers."""
    opts = [role_option(perf, demand, workers, k, slo_ttft_s, slo_tpot_s) for k in range(workers)]
    return sorted(opts, key=lambda o: (-round(o.headroom, 6), o.prefill_workers))
