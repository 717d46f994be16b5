"""Speculation length: how many draft tokens each decoding sequence gets this step. Pure Python.

Two things decide it:
- acceptance: each sequence keeps an exponentially weighted estimate of the chance that one draft
  token is accepted (accepted drafts over draft positions tried, a rejection counting as one try).
  Draft position j of a sequence with acceptance a is worth a**j expected tokens; positions worth
  less than `min_draft_gain` are not proposed, so a sequence whose drafts keep failing drops to 0.
  A sequence that is off gets a full-length probe every `probe_interval` steps to re-measure.
- the batch: one step verifies at most `max_verify_tokens` tokens (1 + k per sequence, plus any
  prefill chunks in the same step). Past that the forward is compute-bound and each draft costs
  about what a decode step does, so the draft positions left in the budget go to the most
  valuable ones first (highest a**j); a batch of `max_verify_tokens` sequences gets none.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class _Acceptance:
    accepted: float  # decayed sum of accepted drafts
    tried: float  # decayed sum of draft positions tried (accepted + the first rejected)
    off_steps: int = 0  # consecutive steps the estimate alone gave this sequence no drafts

    @property
    def rate(self) -> float:
        return self.accepted / self.tried if self.tried > 0 else 0.0


class SpeculationLengthPolicy:
    def __init__(self, max_verify_tokens: int, initial_acceptance: float = 0.7, ema_decay: float = 0.8,
                 min_draft_gain: float = 0.3, probe_interval: int = 16):
        if max_verify_tokens < 1:
            raise ValueError(f"max_verify_tokens must be >= 1, got {max_verify_tokens}")
        self.max_verify_tokens = max_verify_tokens
        self.initial_acceptance = initial_acceptance
        self.ema_decay = ema_decay
        self.min_draft_gain = min_draft_gain
        self.probe_interval = probe_interval
        self.state: dict[str, _Acceptance] = {}

    @classmethod
    def from_config(cls, cfg, max_verify_tokens: int) -> "SpeculationLengthPolicy":
        """From an `engine.config.SpeculativeConfig` (its `max_verify_tokens` already resolved)."""
        return cls(max_verify_tokens, cfg.initial_acceptance, cfg.ema_decay, cfg.min_draft_gain,
                   cfg.probe_interval)

    def _acceptance(self, rid: str) -> _Acceptance:
        st = self.state.get(rid)
        if st is None:
            # the prior counts as one observation: the first few verify steps override it quickly
            st = self.state[rid] = _Acceptance(self.initial_acceptance, 1.0)
        return st

    def acceptance(self, rid: str) -> float:
        return self._acceptance(rid).rate

    def length_for(self, acceptance: float, cap: int) -> int:
        """The most draft positions worth proposing at this acceptance: j with acceptance**j >= gain."""
        if cap <= 0 or acceptance < self.min_draft_gain:
            return 0
        if acceptance >= 1.0:
            return cap
        k = int(math.log(self.min_draft_gain) / math.log(acceptance) + 1e-9)
        return max(0, min(cap, k))

    def choose(self, caps: dict[str, int], num_other_tokens: int = 0) -> dict[str, int]:
        """caps: request id -> the most drafts that sequence may take this step (its own setting,
        its remaining tokens), one entry per sequence decoding this step; `num_other_tokens`:
        prefill tokens sharing the step. -> request id -> k (sequences given 0 are left out)."""
        spare = self.max_verify_tokens - len(caps) - num_other_tokens
        ranked: list[tuple[float, int, str]] = []  # (-gain, position, rid)
        probes: list[str] = []
        for rid, cap in caps.items():
            if cap <= 0:
                continue
            st = self._acceptance(rid)
            a = st.rate
            k = self.length_for(a, cap)
            if k == 0:
                st.off_steps += 1
                if st.off_steps >= self.probe_interval:
                    probes.append(rid)
                continue
            st.off_steps = 0
            ranked.extend((-(a ** j), j, rid) for j in range(1, k + 1))
        # a**j falls with j, so each sequence's chosen positions stay contiguous (1..k); ties at
        # a == 1 are broken by position for the same reason
        ranked.sort()
        out: dict[str, int] = {}
        for _gain, _j, rid in ranked[:max(0, spare)]:
            out[rid] = out.get(rid, 0) + 1
            spare -= 1
        for rid in probes:  # probes come last: only spare budget pays for them
            k = min(caps[rid], spare)
            if k <= 0:
                break
            out[rid] = k
            spare -= k
            self.state[rid].off_steps = 0
        return out

    def observe(self, rid: str, proposed: int, accepted: int) -> None:
        """One verify step of `rid`: `accepted` of its `proposed` drafts were kept."""
        if proposed <= 0:
            return
        st = self._acceptance(rid)
        tried = accepted + (1 if accepted < proposed else 0)
        st.accepted = self.ema_decay * st.accepted + accepted
        st.tried = self.ema_decay * st.tried + tried

    def forget(self, rid: str) -> None:
        self.state.pop(rid, None)
