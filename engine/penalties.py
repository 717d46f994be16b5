"""Penalties on what a request has already said, applied to its logits before sampling.

- presence_penalty and frequency_penalty (OpenAI's): the logit of every token already in the
  output is lowered by `presence + frequency * count`; negative values raise it.
- repetition_penalty (vLLM's and transformers' `RepetitionPenaltyLogitsProcessor`): the logit of
  every token in the prompt or the output is divided by it when positive, multiplied when negative.

Repetition first, then presence and frequency, as vLLM orders them. The penalized logits are what
the request samples from, what speculative verification compares against and what its logprobs
report ("the distribution it was drawn from"). They need every output token on the host, so the
engine settles an overlapped step before a step that samples a penalized request
(`LLMEngine.step`), and the speculator drafts nothing for one.
"""

from __future__ import annotations

import torch

from tandem.wire.messages import SamplingParams


class Penalties:
    """Per-request state of the penalized requests in flight, and the two ways of applying it.

    On a GPU (`dense`), one table row (slot) per request on the device holds its output tokens'
    counts and which tokens its prompt holds, over the vocabulary (5 bytes a token: 0.6 MiB a
    request at a 128k vocabulary). A step adds only the tokens output since the last one (one
    scatter for the batch) and penalizes every penalized row with a few dense ops over [rows,
    vocab]: its host work does not grow with the outputs' lengths (at 64 rows of a 128k vocabulary
    the ops move ~300 MB: tens of microseconds at HBM rates, by the bytes; bench/penalties.py times
    it). On a CPU those dense ops cost ~1 ms a row (docs/benchmarks.md), so each row is penalized
    sparsely instead, over its distinct tokens."""

    def __init__(self, initial_slots: int = 8, dense: bool | None = None):
        self.dense = dense  # None: on CUDA devices
        self._prompt_seen: dict[str, torch.Tensor] = {}  # sparse: the distinct prompt tokens
        self._slot: dict[str, int] = {}
        self._counted: dict[str, int] = {}  # output tokens already in the counts
        self._free: list[int] = []
        self._initial = initial_slots
        self._counts: torch.Tensor | None = None     # [slots, V] float32
        self._in_prompt: torch.Tensor | None = None  # [slots, V] bool

    def release(self, request_id: str) -> None:
        self._prompt_seen.pop(request_id, None)
        slot = self._slot.pop(request_id, None)
        if slot is not None:
            self._free.append(slot)
            del self._counted[request_id]

    def apply_to_step(self, logits: torch.Tensor, owners: list[tuple[str, int]], requests: dict) -> torch.Tensor:
        """Penalize a step's logits [N, V] in place for its penalized requests and return them.
        `owners`: (request id, logits rows) in order; each penalized request has one row (the
        speculator drafts nothing for it) and its whole output on the host (the engine settled the
        step before)."""
        rows, row = [], 0
        for rid, n in owners:
            req = requests[rid]
            if req.sampling.penalized:
                if n != 1 or req.num_pending:
                    raise RuntimeError(f"request {rid}: a penalty needs one logits row and its output on "
                                       f"the host, got {n} rows and {req.num_pending} pending tokens")
                rows.append((row, rid, req.sampling, req.prompt_token_ids, req.output_token_ids))
            row += n
        if rows:
            with torch.inference_mode():  # the runner's logits are an inference tensor
                self.apply(logits, rows)
        return logits

    def apply(self, logits: torch.Tensor, rows: list[tuple[int, str, SamplingParams, list[int], list[int]]]) -> None:
        """Penalize `logits` [N, V] in place: for each (row, request id, sampling, prompt token ids,
        output token ids so far). Rows of requests without a penalty are left alone."""
        rows = [r for r in rows if r[2].penalized]
        if not rows:
            return
        if not (self.dense if self.dense is not None else logits.device.type == "cuda"):
            for row in rows:
                self._apply_sparse(logits, *row)
            return
        vocab, dev = logits.shape[-1], logits.device
        slots, new_slots, new_tokens = [], [], []
        for _, rid, sp, prompt, output in rows:
            slot = self._slot_for(rid, sp, prompt, vocab, dev)
            done = self._counted[rid]
            if len(output) > done:
                new_slots += [slot] * (len(output) - done)
                new_tokens += output[done:]
                self._counted[rid] = len(output)
            slots.append(slot)
        if new_tokens:
            self._counts.index_put_((_on(new_slots, dev), _on(new_tokens, dev)),
                                    torch.ones(len(new_tokens), device=dev), accumulate=True)
        index, slot_index = _on([r[0] for r in rows], dev), _on(slots, dev)
        per_row = torch.tensor([[sp.repetition_penalty, sp.frequency_penalty, sp.presence_penalty]
                                for _, _, sp, _, _ in rows], dtype=torch.float32).to(dev, non_blocking=True)
        rep, freq, pres = (per_row[:, i:i + 1] for i in range(3))
        x = logits[index].float()
        counts = self._counts[slot_index]
        said = counts > 0
        seen = (self._in_prompt[slot_index] | said) & (rep != 1.0)
        x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
        logits[index] = (x - freq * counts - pres * said).to(logits.dtype)

    def _apply_sparse(self, logits: torch.Tensor, row: int, rid: str, sp: SamplingParams, prompt: list[int],
                      output: list[int]) -> None:
        x = logits[row]
        if output:
            out_ids, counts = torch.unique(torch.tensor(output, dtype=torch.long), return_counts=True)
            out_ids, counts = out_ids.to(x.device), counts.to(x.device)
        if sp.repetition_penalty != 1.0:
            seen = self._prompt_seen.get(rid)
            if seen is None:
                seen = self._prompt_seen[rid] = torch.unique(torch.tensor(prompt, dtype=torch.long)).to(x.device)
            seen = torch.unique(torch.cat([seen, out_ids])) if output else seen
            vals = x[seen].float()
            x[seen] = torch.where(vals > 0, vals / sp.repetition_penalty, vals * sp.repetition_penalty).to(x.dtype)
        if output and (sp.presence_penalty or sp.frequency_penalty):
            x[out_ids] = (x[out_ids].float() - sp.presence_penalty - sp.frequency_penalty * counts).to(x.dtype)

    def _slot_for(self, rid: str, sp: SamplingParams, prompt: list[int], vocab: int, dev: torch.device) -> int:
        slot = self._slot.get(rid)
        if slot is not None:
            return slot
        if not self._free:
            self._grow(vocab, dev)
        slot = self._slot[rid] = self._free.pop()
        self._counted[rid] = 0
        self._counts[slot].zero_()
        self._in_prompt[slot].zero_()
        if sp.repetition_penalty != 1.0 and prompt:
            self._in_prompt[slot, _on(prompt, dev)] = True
        return slot

    def _grow(self, vocab: int, dev: torch.device) -> None:
        old = 0 if self._counts is None else self._counts.shape[0]
        size = max(self._initial, 2 * old)
        counts = torch.zeros(size, vocab, device=dev)
        in_prompt = torch.zeros(size, vocab, dtype=torch.bool, device=dev)
        if old:
            counts[:old], in_prompt[:old] = self._counts, self._in_prompt
        self._counts, self._in_prompt = counts, in_prompt
        self._free.extend(range(size - 1, old - 1, -1))


def _on(values: list[int], dev: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long).to(dev, non_blocking=True)
