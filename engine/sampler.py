"""Turning logits into tokens: greedy, temperature, top-k, top-p, with a per-request seeded
generator so a request's samples depend only on its own seed, never on its batch neighbours."""

from __future__ import annotations

import torch

from tandem.wire.messages import SamplingParams


def filter_logits(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """[V] or [N, V] float logits -> temperature-scaled logits with excluded tokens at -inf."""
    logits = logits / temperature
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        # drop a token when the mass before it already reaches top_p (the first token always stays)
        drop = probs.cumsum(-1) - probs >= top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    return logits


def probs_for(logits: torch.Tensor, sp: SamplingParams) -> torch.Tensor:
    """Target distribution [.., V] for a sampled request (speculative acceptance uses it too)."""
    return filter_logits(logits.float(), sp.temperature, sp.top_k, sp.top_p).softmax(-1)


class Sampler:
    def __init__(self):
        self.generators: dict[str, torch.Generator] = {}

    def generator(self, request_id: str, seed: int | None) -> torch.Generator:
        g = self.generators.get(request_id)
        if g is None:
            g = torch.Generator()
            g.manual_seed(seed if seed is not None else int(torch.randint(0, 2**62, ()).item()))
            self.generators[request_id] = g
        return g

    def release(self, request_id: str) -> None:
        self.generators.pop(request_id, None)

    def sample(self, logits: torch.Tensor, params: list[tuple[str, SamplingParams]]) -> list[int]:
        """logits [N, V] (one row per request) -> one token per row."""
        out = logits.argmax(-1).tolist()  # greedy rows, and a cheap default
        for i, (rid, sp) in enumerate(params):
            if sp.greedy:
                continue
            probs = probs_for(logits[i].cpu(), sp)
            if not torch.isfinite(probs).all() or not probs.sum() > 0:
                continue  # an extreme temperature (inf, or so small logits overflow): greedy
            out[i] = int(torch.multinomial(probs, 1, generator=self.generator(rid, sp.seed)).item())
        return out
