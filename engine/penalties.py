"""Penalties on what a request has already said, applied to its logits before sampling.

- presence_penalty and frequency_penalty (OpenAI's): the logit of every token already in the
  output is lowered by `presence + frequency * count`; negative values raise it.
- repetition_penalty (vLLM's and transformers' `RepetitionPenaltyLogitsProcessor`): the logit of
  every token in the prompt or the output is divided by it when positive, multiplied when negative.

Repetition first, then presence and frequency, as vLLM orders them. The penalized logits are what
the request samples from, what speculative verification compares against and what its logprobs
report ("the distribution it was drawn from"). The speculator drafts nothing for a penalized request.

On a GPU (the dense state) a step's sampled tokens are counted on the device as they are drawn
(`count_sampled`, from Sampler.sample_batch): a penalized request needs none of its tokens on the
host, and the overlapped step keeps overlapping. On a CPU (sparse) each step reads the request's
output from the host, so the engine settles an overlapped step first (`needs_host`).
"""

from __future__ import annotations

import torch

from tandem.wire.messages import SamplingParams


class Penalties:
    """Per-request state of the penalized requests in flight, and the two ways of applying it.

    On a GPU (`dense`), one table row (slot) per request on the device holds its output tokens'
    counts and which tokens its prompt holds, over the vocabulary (5 bytes a token: 0.6 MiB a
    request at a 128k vocabulary). Each sampled token is added where it is drawn (one scatter for
    the batch, count_sampled) and every penalized row is penalized in one launch over [rows, vocab]
    (engine.kernels.penalties; `fused`, else the same math as torch ops): host work that does not
    grow with the outputs' lengths, and on an H100 a step 1-2% slower with one or all of 64
    requests penalized (docs/benchmarks.md, "Penalties"). On a CPU the dense ops cost ~1 ms a row,
    so each row is penalized sparsely instead, over its distinct tokens."""

    def __init__(self, initial_slots: int = 8, dense: bool | None = None, fused: bool | None = None):
        self.dense = dense  # None: on CUDA devices
        # the dense state's penalties in one Triton launch (engine.kernels.penalties) instead of the
        # torch ops; None: on CUDA devices (the CPU tests set it under Triton's interpreter)
        self.fused = fused
        self._prompt_seen: dict[str, torch.Tensor] = {}  # sparse: the distinct prompt tokens
        self._slot: dict[str, int] = {}
        self._counted: dict[str, int] = {}  # output tokens already in the counts
        # the request's preemption count when its slot was filled: a preemption drops the tokens still
        # on the device (counted already), so the slot is rebuilt from the host's output after one
        self._epoch: dict[str, int] = {}
        self._free: list[int] = []
        self._initial = initial_slots
        self._counts: torch.Tensor | None = None     # [slots, V] float32
        self._in_prompt: torch.Tensor | None = None  # [slots, V] bool

    def dense_on(self, device: torch.device) -> bool:
        """Whether penalties on `device` keep the dense state (the default on CUDA)."""
        return self.dense if self.dense is not None else device.type == "cuda"

    def fused_on(self, device: torch.device) -> bool:
        """Whether the dense state's penalties on `device` run as one Triton launch (the default on CUDA)."""
        return self.fused if self.fused is not None else device.type == "cuda"

    def needs_host(self, running, device: torch.device) -> bool:
        """Whether the next step's penalties read output tokens on the host (some running request
        is penalized and the state is sparse): LLMEngine.step settles an overlapped step first."""
        return not self.dense_on(device) and any(r.sampling.penalized for r in running)

    def count_sampled(self, params: list[tuple[str, SamplingParams]], tokens: torch.Tensor) -> None:
        """Add one step's sampled tokens [N] (on the device, row i is params[i]'s) to the counts of
        the penalized rows that have a slot, on the device and without a host synchronisation; the
        host's output lists then have those positions counted already (`apply` skips them)."""
        if not self._slot:  # no penalized request holds a slot: nothing to count (the usual step)
            return
        rows = [(i, self._slot[rid]) for i, (rid, sp) in enumerate(params) if sp.penalized and rid in self._slot]
        if not rows or self._counts is None:
            return
        dev = self._counts.device
        index = _on([r for r, _ in rows], dev)
        with torch.inference_mode():  # the counts were made under it (apply_to_step)
            self._add_counts(_on([slot for _, slot in rows], dev), tokens[index])
        for i, _ in rows:
            self._counted[params[i][0]] += 1

    def release(self, request_id: str) -> None:
        self._prompt_seen.pop(request_id, None)
        self._epoch.pop(request_id, None)
        slot = self._slot.pop(request_id, None)
        if slot is not None:
            self._free.append(slot)
            del self._counted[request_id]

    def apply_to_step(self, logits: torch.Tensor, owners: list[tuple[str, int]], requests: dict) -> torch.Tensor:
        """Penalize a step's logits [N, V] in place for its penalized requests and return them.
        `owners`: (request id, logits rows) in order; each penalized request has one row (the
        speculator drafts nothing for it). Its output tokens still on the device (placeholders on
        the host) are in the dense counts already (count_sampled); the sparse state needs none."""
        rows, row = [], 0
        dense = self.dense_on(logits.device)
        for rid, n in owners:
            req = requests[rid]
            if req.sampling.penalized:
                if n != 1 or (req.num_pending and not dense):
                    raise RuntimeError(f"request {rid}: a penalty needs one logits row and (on the sparse "
                                       f"path) its output on the host, got {n} rows and {req.num_pending} "
                                       f"pending tokens")
                if self._epoch.setdefault(rid, req.num_preemptions) != req.num_preemptions:
                    self.release(rid)
                    self._epoch[rid] = req.num_preemptions
                out = req.output_token_ids
                rows.append((row, rid, req.sampling, req.prompt_token_ids, out[:len(out) - req.num_pending]))
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
        if not self.dense_on(logits.device):
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
            self._add_counts(_on(new_slots, dev), _on(new_tokens, dev))
        index, slot_index = _on([r[0] for r in rows], dev), _on(slots, dev)
        per_row = _on([[sp.repetition_penalty, sp.frequency_penalty, sp.presence_penalty] for _, _, sp, _, _ in rows],
                      dev, torch.float32)
        if self.fused_on(dev):
            from tandem.engine.kernels.penalties import penalize  # noqa: PLC0415 (triton loads only where kernels run)

            penalize(logits, index, slot_index, per_row, self._counts, self._in_prompt)
            return
        rep, freq, pres = (per_row[:, i:i + 1] for i in range(3))
        x = logits[index].float()
        counts = self._counts[slot_index]
        said = counts > 0
        seen = (self._in_prompt[slot_index] | said) & (rep != 1.0)
        x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
        logits[index] = (x - freq * counts - pres * said).to(logits.dtype)

    def _add_counts(self, slots: torch.Tensor, tokens: torch.Tensor) -> None:
        """counts[slots[i], tokens[i]] += 1 for every i (a token twice in one slot counts twice)."""
        self._counts.index_put_((slots, tokens), torch.ones(len(tokens), device=self._counts.device),
                                accumulate=True)

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


def _on(values: list, dev: torch.device, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """values as a tensor on `dev`, copied from pinned memory on CUDA (no host wait)."""
    t = torch.tensor(values, dtype=dtype)
    return (t.pin_memory() if dev.type == "cuda" else t).to(dev, non_blocking=True)
