"""What `tandem profile --target` measures on a running, idle cluster, through the gRPC API, on top
of the engine's perf model: the served decode step (`fit_serving_step`: an engine step as a pool
actor runs it, its serving loop, output streaming and the GIL shared with Ray's threads included,
against what the engine alone took) and the control path (`fit_control_path`: router, actor RPCs,
streaming, on every request's first token and on a remote prefill). Probe loads only: nothing here
reads a workload's run."""

from __future__ import annotations

import dataclasses
import math
import random
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

from tandem.perf_model import PerfModel, padded_verify_tokens
from tandem.protos.tandem.v1 import generation_pb2 as pb


def _stream(stub, prompt: list[int], max_tokens: int, metadata=()) -> tuple[list[float], object]:
    """One greedy request streamed to its end -> (arrival time of each token, its usage)."""
    req = pb.GenerateRequest(prompt_token_ids=prompt, sampling=pb.SamplingParams(
        max_tokens=max_tokens, temperature=0, ignore_eos=True))
    times, usage = [], None
    for r in stub.Generate(req, timeout=600, metadata=metadata):
        if r.token_ids:
            times += [time.perf_counter()] * len(r.token_ids)
        if r.finish_reason:
            usage = r.usage
    return times, usage


def served_steps(stub, *, vocab_size: int, batches=(1, 8, 32), prompt_tokens: int = 16,
                 output_tokens: int = 128, metadata=(), seed: int = 0) -> list[tuple[int, int, float, float]]:
    """For each batch size b: b fresh requests at once (`prompt_tokens` each, `output_tokens` out).
    -> (b, mean total context, drafts verified per sequence per step (the padded width where the
    usage counts draft steps: PerfModel.verify_tokens), seconds per served step) per
    batch: over the time all b decode (after the last one's first token, before the first one's
    last), each request's time between its tokens per decode step (a step emits 1 + the drafts
    accepted: its usage says how many), the median over the b requests. The outputs must outlast
    the prefills of the b prompts."""
    rng = random.Random(seed)
    out = []
    _stream(stub, [rng.randrange(3, vocab_size) for _ in range(prompt_tokens)], 8, metadata)   # warm-up
    for b in batches:
        prompts = [[rng.randrange(3, vocab_size) for _ in range(prompt_tokens)] for _ in range(b)]
        with ThreadPoolExecutor(b) as pool:
            results = list(pool.map(lambda p: _stream(stub, p, output_tokens, metadata), prompts))
        # only while all b decode: from the last first token (the prefills are over) to the first end
        t0, t1 = max(t[0] for t, _ in results), min(t[-1] for t, _ in results)
        per_step, drafts, steps_all, draft_steps = [], 0, 0, 0
        for times, usage in results:
            steps = len(times) - 1 - usage.accepted_draft_tokens
            w = [t for t in times if t0 <= t <= t1]
            if steps > 0 and len(w) > 2:
                per_step.append((w[-1] - w[0]) / ((len(w) - 1) * steps / (len(times) - 1)))
                drafts, steps_all = drafts + usage.draft_tokens, steps_all + steps
                draft_steps += usage.draft_steps
        if per_step:
            # the verify width these steps were padded to (the mean where the usage has no draft_steps)
            k = (padded_verify_tokens(min(1.0, draft_steps / steps_all), drafts / draft_steps, b) if draft_steps
                 else drafts / max(steps_all, 1))
            out.append((b, b * (prompt_tokens + output_tokens // 2), k, statistics.median(per_step)))
    return out


def fit_serving_step(perf: PerfModel, steps) -> PerfModel:
    """`perf` with its decode step as served (`served_steps`' figures): what a served step takes
    beyond the forward passes `perf` was fitted to, as a line in the batch size. Its intercept is
    `step_host_s` (it replaces the engine-only figure: the served step is the more direct
    measurement; when it is cheaper than the profile's forwards, as a profile taken on a loaded
    machine can make them, `decode_base_s` gives way); its slope (host work per sequence:
    sampling, outputs, block tables, drafting) goes into `decode_per_seq_s`, while a verified draft
    keeps the forward pass's per-token cost (`verify_token_s`). Every term stays
    >= 0; at the probed batches the model then gives the served step."""
    if not steps:
        return perf
    bare = dataclasses.replace(perf, step_host_s=0.0)
    xs = [b for b, _, _, _ in steps]
    extra = [s - bare.verifying(k).decode_step_s(b, ctx) for b, ctx, k, s in steps]
    slope = 0.0
    if len(set(xs)) > 1:
        mx, my = statistics.fmean(xs), statistics.fmean(extra)
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, extra)) / sum((x - mx) ** 2 for x in xs)
    slope = max(slope, -perf.decode_per_seq_s)
    intercept = statistics.median(y - slope * x for x, y in zip(xs, extra))
    verify = perf.decode_per_seq_s if perf.verify_token_s is None else perf.verify_token_s
    return dataclasses.replace(perf, step_host_s=max(0.0, intercept), decode_per_seq_s=perf.decode_per_seq_s + slope,
                               verify_token_s=verify,
                               decode_base_s=max(0.0, perf.decode_base_s + min(0.0, intercept)))


def fit_control_path(stub, perf: PerfModel, *, vocab_size: int, threshold: float, probes: int = 5,
                     remote_tokens: int = 0, metadata=(), seed: int = 0, local_tokens: int = 256,
                     notes: dict | None = None) -> PerfModel:
    """The simulator's control-path terms, from a running, idle cluster, through the gRPC API:
    `request_overhead_s` is the TTFT of a prompt sent a second time (its KV cached but for its
    last token, so the engine's part is one step computing one token: `perf.decode_step_s(1, n)`,
    the best-known cost there is; a prefill's cost varies with its kernels' shapes) minus that
    step; `remote_overhead_s` (with a prefill pool) the TTFT of fresh longer prompts, prefilled
    remotely, minus their prefill or transfer and the request's overhead. Medians of `probes`
    each, both >= 0; the raw medians go to `notes` when given."""
    rng = random.Random(seed)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(3, vocab_size) for _ in range(n)]

    def ttft(ids: list[int], max_tokens: int = 1) -> float:
        t0 = time.perf_counter()
        times, _ = _stream(stub, ids, max_tokens, metadata)
        if not times:
            raise RuntimeError("probe request returned no token")
        return times[0] - t0

    def cached_ttft(n: int) -> float:
        ids = prompt(n)
        ttft(ids, 2)                         # computes it; 2 tokens, so its KV stays in the prefix cache
        return ttft(ids)

    # whole blocks and one token: the prefix cache holds all but that token, which the step computes
    n_local = max(1, local_tokens // perf.block_tokens) * perf.block_tokens + 1
    cached_ttft(n_local)                                                 # warm-up
    measured = statistics.median(cached_ttft(n_local) for _ in range(probes))
    request = max(0.0, measured - perf.decode_step_s(1, n_local))
    remote, measured_remote = 0.0, None
    if math.isfinite(threshold):
        n = remote_tokens or max(4 * int(threshold), 128)
        engine = max(perf.prefill_s(n, n), perf.transfer_s(n))
        ttft(prompt(n))
        measured_remote = statistics.median(ttft(prompt(n)) for _ in range(probes))
        remote = max(0.0, measured_remote - engine - request)
    if notes is not None:
        notes.update(cached_prompt_tokens=n_local, cached_ttft_s=measured, remote_prompt_tokens=remote_tokens or None,
                     remote_ttft_s=measured_remote)
    return dataclasses.replace(perf, request_overhead_s=request, remote_overhead_s=remote)


def calibrate_on_cluster(stub, perf: PerfModel, *, vocab_size: int, threshold: float, metadata=(),
                         batches=(1, 8, 32), prompt_tokens: int = 16, output_tokens: int = 128,
                         control_tokens: int = 256) -> tuple[PerfModel, dict]:
    """Both, in order (the control path is what is left once the served step is known) ->
    (perf, what was measured: the served steps and the control probes' medians). `prompt_tokens`:
    the served steps' contexts (host work per sequence may grow with them: use the workload's)."""
    steps = served_steps(stub, vocab_size=vocab_size, batches=batches, prompt_tokens=prompt_tokens,
                         output_tokens=output_tokens, metadata=metadata)
    perf = fit_serving_step(perf, steps)
    control: dict = {}
    perf = fit_control_path(stub, perf, vocab_size=vocab_size, threshold=threshold, metadata=metadata,
                            local_tokens=control_tokens, notes=control)
    return perf, {"served_steps": steps, "control_path": control}
