"""The one performance model: what a prefill, an engine step (decodes, verify tokens, prefill
chunks, host time) and a KV transfer cost on one worker, fitted by `tandem profile` and, for the
control path, on a running cluster. The simulator replays workloads with it, the placement policy
(tandem.placement) predicts each option's TTFT and TPOT harm with it: one source of service times.
Plain values; numpy only for the fit."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import numpy as np

from tandem.wire.errors import ConfigError


@dataclass(frozen=True)
class PerfModel:
    """Fitted service times. Defaults: an ASSUMED Llama-3-8B on one H200 (bf16), see docs/operations.md.

    prefill s     = prefill_base_s + prefill_per_token_s * n + prefill_attn_s * n * context
                    (n: tokens computed, context: prompt length once they are in)
    decode step s = decode_base_s + step_host_s
                    + decode_per_seq_s * batch + verify_token_s * batch * verify_tokens(batch)
                    + decode_per_ctx_token_s * sum(context)
                    (each running sequence computes its next token and the draft tokens it
                    verifies; a step emits `spec_tokens_per_step` tokens per sequence on average)
    verify_tokens = spec_verify_tokens, the drafts per sequence per step on average; or, where a
                    run measured how often a sequence drafts (`spec_draft_prob`, with
                    `spec_draft_len` drafts when it does), the step's widest draft, which every
                    sequence of the step is padded to (the kernels' query tile, a CUDA graph's
                    shape): spec_draft_len * (1 - (1 - spec_draft_prob) ** batch). Equal to the
                    mean at batch 1; past it, one sequence's drafts widen the whole step.
    verify_token_s = what a verified draft token costs the forward pass: fitted on steps in which one
                    sequence drafts and the rest are padded to it ("padded" samples), else the
                    engine's per-sequence decode cost as `tandem profile` fitted it, before the
                    served step adds the host's per-sequence work (sampling, outputs), which drafts
                    do not pay; None: decode_per_seq_s
    verify_step_s = the fixed cost of a step that verifies any draft (more logits, the acceptance
                    pass), paid with probability 1 - (1 - spec_draft_prob) ** batch
    mixed step s  = a decode step + prefill_base_s + each chunk's prefill time, without its base,
                    + mixed_step_s (what carrying both costs beyond the two: positive where the
                    step runs eagerly, its decodes too; negative, down to minus the smaller of the
                    two bases, where one forward pass pays the fixed cost both bases charge, as
                    on CPU) (`step_s`: what one engine step costs, whatever it carries)
    transfer s    = transfer_base_s + transfer_per_token_s * tokens
    overlap       = the engine launches step N+1 before it reads step N's tokens (CUDA, no
                    speculation, one rank: engine.inflight), so it schedules N+1 while N computes:
                    work that reaches the worker after N started joins N+2, not N+1 (the
                    simulator's steps; `layout_perf` sets it from the layout's engine)
    admit host s  = admit_host_s, host time a worker's serving loop loses to each request routed to
                    it (the actor RPC carrying its prompt, the prefix-cache lookup and block hashing,
                    its output stream): the worker's next step is that much longer. It and the part
                    of step_host_s that only a loaded worker pays (other requests' streams and ends,
                    graph captures of shapes first met while serving) are fitted on traced steps
                    (cluster/step_check.py `fit_load`), not on an idle cluster's probes, as is
                    mixed_step_s
    control path  = request_overhead_s on every request's client-visible times (router, actor
                    RPCs, streaming), + remote_overhead_s before a remote prefill's KV is usable
                    (RPCs to the prefill actor, the decode step after the KV lands); both fitted
                    on a running cluster by `tandem profile --target` (fit_control_path)
    """
    prefill_base_s: float = 0.005
    prefill_per_token_s: float = 1 / 12000
    prefill_attn_s: float = 1.3e-9
    decode_base_s: float = 0.012
    decode_per_seq_s: float = 1e-4
    decode_per_ctx_token_s: float = 3e-8
    transfer_base_s: float = 0.0005
    transfer_per_token_s: float = 2.6e-6
    request_overhead_s: float = 0.0
    remote_overhead_s: float = 0.0
    local_prefill_threshold: float = 256  # uncached tokens a decode worker prefills itself
    # prefill.max_queued_tokens: prompt tokens queued on a prefill worker past which requests are
    # prefilled by their decode worker instead (the router's rule); inf: always remote
    prefill_queue_limit: float = math.inf
    # speculative decoding: draft tokens verified per sequence per step, and tokens emitted per
    # sequence per step (1 + the mean accepted); host time per step the GPU does not hide
    spec_verify_tokens: float = 0.0
    spec_tokens_per_step: float = 1.0
    # how often a sequence verifies drafts in a step, and how many when it does (0: not measured;
    # the step then charges the mean, spec_verify_tokens): the padded width, see verify_tokens
    spec_draft_prob: float = 0.0
    spec_draft_len: float = 0.0
    verify_token_s: float | None = None
    verify_step_s: float = 0.0
    step_host_s: float = 0.0
    admit_host_s: float = 0.0
    mixed_step_s: float = 0.0
    overlap: bool = False
    max_batch: int = 256  # sequences per decode worker
    max_step_tokens: int = 2048  # tokens per decode step (decodes + local prefill chunks)
    kv_capacity_tokens: int = 700_000  # KV per worker (decode: running + prefix cache)
    block_tokens: int = 16  # prefix-cache granularity

    def __post_init__(self) -> None:
        coeffs = ("prefill_base_s", "prefill_per_token_s", "prefill_attn_s", "decode_base_s",
                  "decode_per_seq_s", "decode_per_ctx_token_s", "transfer_base_s", "transfer_per_token_s",
                  "request_overhead_s", "remote_overhead_s", "spec_verify_tokens", "step_host_s", "spec_draft_len",
                  "verify_step_s", "admit_host_s")
        if any(getattr(self, c) < 0 for c in coeffs) or self.local_prefill_threshold < 0:
            raise ConfigError("perf model: coefficients and local_prefill_threshold must be >= 0")
        if self.mixed_step_s < -self.mixed_step_floor_s:
            raise ConfigError(f"perf model: mixed_step_s must be >= {0.0 - self.mixed_step_floor_s:g} (minus the smaller "
                              "of decode_base_s and prefill_base_s: a mixed step pays at least one base)")
        if self.verify_token_s is not None and self.verify_token_s < 0:
            raise ConfigError("perf model: verify_token_s must be >= 0 (or null: decode_per_seq_s)")
        if not 0.0 <= self.spec_draft_prob <= 1.0:
            raise ConfigError(f"perf model: spec_draft_prob must be in [0, 1], got {self.spec_draft_prob}")
        if self.spec_tokens_per_step < 1:
            raise ConfigError("perf model: spec_tokens_per_step must be >= 1 (1: no speculation)")
        if not self.prefill_queue_limit > 0:
            raise ConfigError("perf model: prefill_queue_limit must be > 0 (inf: no limit)")
        if min(self.max_batch, self.max_step_tokens, self.kv_capacity_tokens, self.block_tokens) < 1:
            raise ConfigError("perf model: max_batch, max_step_tokens, kv_capacity_tokens and "
                              "block_tokens must be >= 1")

    @property
    def mixed_step_floor_s(self) -> float:
        """How far below zero `mixed_step_s` may go: one of the two fixed costs a mixed step charges."""
        return min(self.prefill_base_s, self.decode_base_s)

    def prefill_s(self, n: int, context: int) -> float:
        if not n:
            return 0.0
        return self.prefill_base_s + n * (self.prefill_per_token_s + self.prefill_attn_s * context)

    def verifying(self, drafts: float) -> "PerfModel":
        """This model for steps in which every sequence verifies `drafts` drafts (a profile's or a
        probe's steps, where no sequence is padded to another's), host time as it is."""
        return dataclasses.replace(self, spec_verify_tokens=drafts, spec_draft_prob=0.0)

    def verify_tokens(self, batch: int) -> float:
        """Draft tokens each sequence of a `batch`-sequence decode step is charged for verifying."""
        if self.spec_draft_prob > 0.0:
            return padded_verify_tokens(self.spec_draft_prob, self.spec_draft_len, batch)
        return self.spec_verify_tokens

    def decode_step_s(self, batch: int, context_tokens: int) -> float:
        """One step of `batch` decoding sequences holding `context_tokens` in all (0 if batch is 0)."""
        if not batch:
            return 0.0
        per_draft = self.decode_per_seq_s if self.verify_token_s is None else self.verify_token_s
        verifies = 1.0 - (1.0 - self.spec_draft_prob) ** batch    # a step with any draft in it
        return (self.decode_base_s + self.step_host_s + verifies * self.verify_step_s
                + batch * (self.decode_per_seq_s + per_draft * self.verify_tokens(batch))
                + self.decode_per_ctx_token_s * context_tokens)

    def chunk_s(self, n: int, context: int) -> float:
        """A prefill chunk of `n` tokens inside a step, `context` tokens in once it is: no base."""
        return n * (self.prefill_per_token_s + self.prefill_attn_s * context)

    def step_s(self, batch: int, context_tokens: int, chunks: Sequence[tuple[int, int]] = ()) -> float:
        """One engine step: `batch` decoding sequences (`context_tokens` in all) and prefill
        `chunks` of (tokens, context once in). The simulator's steps and the placement's cost
        predictions both come from here."""
        dt = self.decode_step_s(batch, context_tokens)
        if chunks:
            dt += self.prefill_overhead_s(batch) + sum(self.chunk_s(n, c) for n, c in chunks)
        return dt

    def prefill_overhead_s(self, batch: int) -> float:
        """What a step pays once for carrying prefill chunks, beside `batch` decoding sequences:
        the prefill's base, and the mixed step's extra cost (with a batch) or the step's host time
        (without one, which `decode_step_s` then does not charge)."""
        return self.prefill_base_s + (self.mixed_step_s if batch else self.step_host_s)

    def tpot_s(self, batch: int, context_tokens: int, chunks: Sequence[tuple[int, int]] = ()) -> float:
        """Time per output token of a sequence in such a step (speculation emits more than one)."""
        return self.step_s(batch, context_tokens, chunks) / self.spec_tokens_per_step

    def transfer_s(self, tokens: int) -> float:
        return self.transfer_base_s + self.transfer_per_token_s * tokens if tokens else 0.0

    @classmethod
    def fit(cls, samples: Iterable[tuple[str, Sequence[float] | dict[str, float], float]],
            base: "PerfModel | None" = None, **fixed: Any) -> "PerfModel":
        """Least squares from profiling samples `(kind, features, seconds)`:
        ("prefill", (new_tokens, context), s), ("decode", (batch_size, total_context_tokens), s),
        ("transfer", (tokens,), s), ("verify", (batch_size, total_context_tokens,
        draft_tokens_per_seq), s) (a decode step whose sequences also verify drafts: fitted with the
        decode samples, each draft costing what a sequence's token does), ("padded", (batch_size,
        total_context_tokens, draft_tokens), s) (one sequence of the batch drafts, the step is padded
        to it: `verify_step_s` and `verify_token_s`, on top of the decode fit); features may also be
        dicts with those names. Kinds without samples keep `base`'s coefficients; negative fits are
        clipped to 0; `fixed` sets the rest."""
        names = {"prefill": ("new_tokens", "context"), "decode": ("batch_size", "total_context_tokens"),
                 "transfer": ("tokens",),
                 "verify": ("batch_size", "total_context_tokens", "draft_tokens_per_seq"),
                 "padded": ("batch_size", "total_context_tokens", "draft_tokens")}
        rows: dict[str, list[tuple[list[float], float]]] = {k: [] for k in names}
        for kind, feats, seconds in samples:
            if kind not in names:
                raise ValueError(f"unknown sample kind {kind!r}; expected one of {sorted(names)}")
            f = [feats[n] for n in names[kind]] if isinstance(feats, dict) else list(feats)
            x = {"prefill": lambda: [1.0, f[0], f[0] * f[1]],
                 "decode": lambda: [1.0, f[0], f[1]],
                 "verify": lambda: [1.0, f[0] * (1.0 + f[2]), f[1]],
                 "padded": lambda: list(f),
                 "transfer": lambda: [1.0, f[0]]}[kind]()
            rows["decode" if kind == "verify" else kind].append((x, float(seconds)))
        padded = rows.pop("padded")
        fields = {"prefill": ("prefill_base_s", "prefill_per_token_s", "prefill_attn_s"),
                  "decode": ("decode_base_s", "decode_per_seq_s", "decode_per_ctx_token_s"),
                  "transfer": ("transfer_base_s", "transfer_per_token_s")}
        values: dict[str, Any] = {}
        for kind, data in rows.items():
            if not data:
                continue
            a = np.array([x for x, _ in data], dtype=np.float64)
            y = np.array([s for _, s in data], dtype=np.float64)
            scale = np.maximum(np.abs(a).max(axis=0), 1e-30)  # columns span 1 .. 1e9: normalize
            coef = np.linalg.lstsq(a / scale, y, rcond=None)[0] / scale
            values.update({name: max(0.0, float(c)) for name, c in zip(fields[kind], coef)})
        if padded:    # what a padded step takes beyond the plain decode step just fitted
            plain = dataclasses.replace(base or cls(), **values, step_host_s=0.0).verifying(0.0)
            a = np.array([[1.0, b * k] for (b, _, k), _ in padded])
            y = np.array([s - plain.decode_step_s(int(b), ctx) for (b, ctx, _), s in padded])
            step, token = np.linalg.lstsq(a, y, rcond=None)[0]
            if token < 0:
                step, token = float(np.median(y)), 0.0
            values.update(verify_step_s=max(0.0, float(step)), verify_token_s=max(0.0, float(token)))
        return dataclasses.replace(base or cls(), **values, **fixed)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        for key in _MAYBE_INF:
            if math.isinf(d[key]):
                d[key] = "inf"  # JSON has no infinity
        return d

    @classmethod
    def load(cls, path: str | None) -> "PerfModel":
        """`tandem profile`'s JSON (its "perf_model", or the model alone), or the assumed
        8B-on-H200 model when `path` is None."""
        if path is None:
            return cls()
        with open(path) as f:
            d = json.load(f)
        return cls.from_dict(d.get("perf_model", d))

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "PerfModel":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise ConfigError(f"perf model: unknown key(s) {sorted(unknown)}")
        d = dict(d)
        for key in _MAYBE_INF:
            if isinstance(d.get(key), str):
                d[key] = float(d[key])
        return cls(**d)


_MAYBE_INF = ("local_prefill_threshold", "prefill_queue_limit")


def padded_verify_tokens(draft_prob: float, draft_len: float, batch: int) -> float:
    """The verify width each of `batch` sequences is padded to when each drafts `draft_len` tokens
    in a step with probability `draft_prob`: the step's widest draft, if any sequence drafts."""
    return draft_len * (1.0 - (1.0 - draft_prob) ** batch)
