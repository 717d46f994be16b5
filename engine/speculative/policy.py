"""Speculation length: how many draft tokens each decoding sequence gets this step. Pure Python.

Each sequence keeps an exponentially weighted estimate `a` of the chance that one of its draft
tokens is accepted (accepted drafts over draft positions tried, the first rejection counting as a
try). Draft position j of a sequence is then worth a**j expected tokens. The step's cost follows a
roofline: a forward of T tokens costs about one decode step while T <= `max_verify_tokens` (it is
bound by reading the weights), and T / max_verify_tokens steps past it (bound by compute). So:

- below the knee, positions are free: every position worth at least `min_draft_gain` is taken,
  most valuable first (highest a**j), until the knee;
- past the knee, a draft position costs what a decode position does (1 / max_verify_tokens of a
  step) and yields a**j < 1 token, so none is taken: a batch of `max_verify_tokens` sequences or
  more decodes plainly;
- with `token_cost` r > 0 (an affine step cost, as on a CPU, where every token costs about r of
  a step's fixed part on top of it): a position of worth w is taken only while it raises the
  step's tokens per cost, w > r * tokens / cost, tokens = decoding sequences + worth taken so far,
  cost = 1 + r * (tokens in the step);
- a sequence whose estimate falls below `min_acceptance` (its drafts keep failing) gets none, but
  every `probe_interval` steps it gets a full-length probe from what the knee leaves free, to
  re-measure;
- tree drafts (`choose_nodes`): `choose` bounds each tree's depth, then every node of every
  sequence's tree competes under the same knee and cost rule, worth a**depth x the proposer's
  probability for it (the share of earlier continuations through it): a second branch is
  verified only where it pays as a position would;
- with `padded_rows` (GPUs): the forward pads every sequence's query to the step's longest,
  rounded up to a power of two (the CUDA graphs' and kernels' query tile), so the knee bounds
  padded rows too: no sequence drafts k where batch x next_pow2(1 + k) would pass it. Measured on
  an H200 (llama3-8b-random, bench/verify_padding.py): one sequence of 64 drafting 5 (a tile of
  8) costs the whole step 1.18x at 1k context and 1.45x at 8k; drafting 3 (a tile of 4), 1.03x
  and 1.00x.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class _Acceptance:
    accepted: float  # decayed sum of accepted drafts
    tried: float  # decayed sum of draft positions tried (accepted + the first rejected)
    off_steps: int = 0  # consecutive steps the sequence was off for low acceptance

    @property
    def rate(self) -> float:
        return self.accepted / self.tried if self.tried > 0 else 0.0


class SpeculationLengthPolicy:
    def __init__(self, max_verify_tokens: int, *, min_acceptance: float = 0.3, min_draft_gain: float = 0.1,
                 initial_acceptance: float = 0.7, ema_decay: float = 0.8, probe_interval: int = 16,
                 token_cost: float = 0.0, padded_rows: bool = False):
        if max_verify_tokens < 1:
            raise ValueError(f"max_verify_tokens must be >= 1, got {max_verify_tokens}")
        self.max_verify_tokens = max_verify_tokens
        self.min_acceptance = min_acceptance
        self.min_draft_gain = min_draft_gain
        self.initial_acceptance = initial_acceptance
        self.ema_decay = ema_decay
        self.probe_interval = probe_interval
        self.token_cost = token_cost
        self.padded_rows = padded_rows
        self.state: dict[str, _Acceptance] = {}

    @classmethod
    def from_config(cls, cfg, max_verify_tokens: int, token_cost: float = 0.0,
                    padded_rows: bool = False) -> "SpeculationLengthPolicy":
        """From an `engine.config.SpeculativeConfig`, its device-dependent knee, token cost and
        padding resolved."""
        return cls(max_verify_tokens, min_acceptance=cfg.min_acceptance, min_draft_gain=cfg.min_draft_gain,
                   initial_acceptance=cfg.initial_acceptance, ema_decay=cfg.ema_decay,
                   probe_interval=cfg.probe_interval, token_cost=token_cost, padded_rows=padded_rows)

    def row_cap(self, num_seqs: int, num_other_tokens: int = 0) -> int | None:
        """With `padded_rows`, the most drafts (or tree nodes) one sequence may verify in a step of
        `num_seqs` decoding sequences: the largest k with num_seqs x next_pow2(1 + k) within the knee
        (what the other tokens leave of it); None without padding."""
        if not self.padded_rows or num_seqs <= 0:
            return None
        rows = (self.max_verify_tokens - num_other_tokens) // num_seqs   # query rows per sequence
        return max(0, (1 << (rows.bit_length() - 1)) - 1) if rows >= 1 else 0

    def _acceptance(self, rid: str) -> _Acceptance:
        st = self.state.get(rid)
        if st is None:
            # the prior counts as one observation: the first few verify steps override it quickly
            st = self.state[rid] = _Acceptance(self.initial_acceptance, 1.0)
        return st

    def acceptance(self, rid: str) -> float:
        return self._acceptance(rid).rate

    def length_for(self, acceptance: float, cap: int) -> int:
        """Positions worth proposing when they are free: j <= cap with acceptance**j >= min_draft_gain;
        0 below `min_acceptance`."""
        if cap <= 0 or acceptance < self.min_acceptance:
            return 0
        if acceptance >= 1.0:
            return cap
        k = int(math.log(self.min_draft_gain) / math.log(acceptance) + 1e-9)
        return max(0, min(cap, k))

    def choose(self, caps: dict[str, int], num_other_tokens: int = 0) -> dict[str, int]:
        """caps: request id -> the most drafts that sequence may take this step (its own setting,
        its remaining tokens), one entry per sequence decoding this step; `num_other_tokens`:
        prefill tokens sharing the step. -> request id -> k (sequences given 0 are left out)."""
        spare = self.max_verify_tokens - len(caps) - num_other_tokens  # free positions below the knee
        row_cap = self.row_cap(len(caps), num_other_tokens)
        if row_cap is not None:
            caps = {rid: min(cap, row_cap) for rid, cap in caps.items()}
        ranked: list[tuple[float, int, str]] = []  # (-worth, position, rid)
        probes: list[str] = []
        for rid, cap in caps.items():
            st = self._acceptance(rid)
            a = st.rate
            if a < self.min_acceptance:
                st.off_steps += 1
                if cap > 0 and st.off_steps >= self.probe_interval:
                    probes.append(rid)
                continue
            st.off_steps = 0
            ranked.extend((-(a ** j), j, rid) for j in range(1, self.length_for(a, cap) + 1))
        # a**j falls with j, so each sequence's chosen positions stay contiguous (1..k); ties at
        # a == 1 are broken by position for the same reason
        ranked.sort()
        out: dict[str, int] = {}
        for _worth, _j, rid in self._take(ranked, spare, len(caps), num_other_tokens):
            out[rid] = out.get(rid, 0) + 1
            spare -= 1
        for rid in probes:  # probes come last: only what the knee leaves free pays for them
            k = min(caps[rid], spare)
            if k <= 0:
                break
            out[rid] = k
            spare -= k
            self.state[rid].off_steps = 0
        return out

    def _take(self, ranked: list[tuple], spare: int, num_seqs: int, num_other_tokens: int) -> list[tuple]:
        """The leading entries of `ranked` ((-worth, ...), most valuable first) that fit below the
        knee and, with a token cost, raise the step's tokens per cost."""
        r = self.token_cost
        tokens, cost = float(num_seqs), 1.0 + r * (num_seqs + num_other_tokens)
        taken = []
        for entry in ranked[:max(0, spare)]:
            worth = -entry[0]
            if worth < self.min_draft_gain or (r > 0 and worth * cost <= r * tokens):
                break  # this position would lower tokens per cost
            taken.append(entry)
            tokens, cost = tokens + worth, cost + r
        return taken

    def choose_nodes(self, trees: dict[str, tuple[list[float], list[int]]], num_seqs: int,
                     num_other_tokens: int = 0) -> dict[str, list[int]]:
        """Tree drafts (after `choose` and the proposer): trees[rid] = (each node's probability by
        the proposer, its depth), parents first. Node worth: a**depth x its probability, a the
        sequence's acceptance; nodes are taken most valuable first under `choose`'s budget and
        cost rule, across the step's `num_seqs` decoding sequences. A worth never exceeds its
        parent's, so what is kept is a tree. Probes (a below min_acceptance) keep every node.
        -> rid -> the nodes kept."""
        spare = self.max_verify_tokens - num_seqs - num_other_tokens
        row_cap = self.row_cap(num_seqs, num_other_tokens)
        most = math.inf if row_cap is None else row_cap     # nodes one sequence may keep
        ranked: list[tuple[float, int, str, int]] = []  # (-worth, depth, rid, node)
        out: dict[str, list[int]] = {}
        for rid, (probs, depth) in trees.items():
            a = self._acceptance(rid).rate
            if a < self.min_acceptance:
                out[rid] = list(range(min(len(probs), most)))   # parents first: a prefix is a tree
                spare -= len(out[rid])
                continue
            ranked.extend((-(a ** d) * p, d, rid, i) for i, (p, d) in enumerate(zip(probs, depth)))
        ranked.sort()
        for _worth, _d, rid, node in self._take(ranked, spare, num_seqs, num_other_tokens):
            if len(out.get(rid, ())) < most:      # a node's parent is worth more: it came first
                out.setdefault(rid, []).append(node)
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
