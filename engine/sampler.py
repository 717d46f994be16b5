"""Turning logits into tokens: greedy, temperature, top-k, top-p.

A seeded request draws from its own generator (on the host), so its samples depend only on its seed,
never on its batch neighbours, and its generator's state can travel with it to another engine. All
other rows (greedy, unseeded) are sampled for the whole batch on the logits' device in a few ops
(`sample_batch`), with no host synchronisation: the overlapped step feeds those tokens to the next
step's inputs on the device.
"""

from __future__ import annotations

import torch

from tandem.engine.penalties import Penalties
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


def _row_params(params: list[tuple[str, SamplingParams]], device: torch.device) -> tuple[torch.Tensor, ...]:
    """[N] temperature (0 for greedy), top_k (0: off), top_p for each row, as device tensors."""
    temp = torch.tensor([0.0 if sp.greedy else sp.temperature for _, sp in params], dtype=torch.float32)
    top_k = torch.tensor([sp.top_k or 0 for _, sp in params], dtype=torch.int64)
    top_p = torch.tensor([sp.top_p for _, sp in params], dtype=torch.float32)
    pin = device.type == "cuda"
    return tuple((t.pin_memory() if pin else t).to(device, non_blocking=True) for t in (temp, top_k, top_p))


def sample_rows(logits: torch.Tensor, params: list[tuple[str, SamplingParams]],
                generator: torch.Generator | None = None) -> torch.Tensor:
    """logits [N, V] -> tokens [N] (int64, on the logits' device) for rows that need no generator
    of their own: greedy rows take the argmax; the others draw from their temperature / top-k /
    top-p distribution by the exponential race (argmax of p / E, E ~ Exp(1)), all rows at once.
    A row whose distribution is not finite (an extreme temperature) falls back to greedy."""
    greedy = logits.argmax(-1)
    if all(sp.greedy for _, sp in params):
        return greedy
    temp, top_k, top_p = _row_params(params, logits.device)
    x = logits.float() / torch.where(temp > 0, temp, 1.0).unsqueeze(1)
    vocab = x.shape[-1]
    if any(sp.top_k or sp.top_p < 1.0 for _, sp in params if not sp.greedy):
        x, order = torch.sort(x, dim=-1, descending=True)
        rank = torch.arange(vocab, device=x.device)
        x = x.masked_fill((top_k > 0).unsqueeze(1) & (rank >= top_k.unsqueeze(1)), float("-inf"))
        probs = x.softmax(-1)
        # drop a token when the mass before it already reaches top_p (the first always stays)
        x = x.masked_fill(probs.cumsum(-1) - probs >= top_p.unsqueeze(1), float("-inf"))
    else:
        order = None
    probs = x.softmax(-1)
    # Exp(1) can draw 0; clamped, an excluded token (p = 0) never wins by 0 / 0
    noise = torch.empty_like(probs).exponential_(generator=generator).clamp_(min=torch.finfo(probs.dtype).tiny)
    drawn = (probs / noise).argmax(-1)
    if order is not None:
        drawn = order.gather(1, drawn.unsqueeze(1)).squeeze(1)
    ok = (temp > 0) & torch.isfinite(probs).all(-1) & (probs.sum(-1) > 0)
    return torch.where(ok, drawn, greedy)


class Sampler:
    def __init__(self):
        self.generators: dict[str, torch.Generator] = {}
        self.device_generators: dict[torch.device, torch.Generator] = {}
        self.penalties = Penalties()  # per-request state of the penalized requests

    def generator(self, request_id: str, seed: int | None) -> torch.Generator:
        g = self.generators.get(request_id)
        if g is None:
            g = torch.Generator()
            g.manual_seed(seed if seed is not None else int(torch.randint(0, 2**62, ()).item()))
            self.generators[request_id] = g
        return g

    def release(self, request_id: str) -> None:
        self.generators.pop(request_id, None)
        self.penalties.release(request_id)

    @staticmethod
    def needs_host(params: list[tuple[str, SamplingParams]]) -> bool:
        """Whether some row draws from its own seeded generator (sampled on the host)."""
        return any(not sp.greedy and sp.seed is not None for _, sp in params)

    def sample_batch(self, logits: torch.Tensor, params: list[tuple[str, SamplingParams]]) -> torch.Tensor:
        """logits [N, V] -> tokens [N] on the logits' device, without a host synchronisation
        (penalized rows' tokens counted there too: Penalties.count_sampled). Only for batches with
        no seeded sampled row (`needs_host`)."""
        dev = logits.device
        g = self.device_generators.get(dev)
        if g is None:
            g = self.device_generators[dev] = torch.Generator(dev)
            g.manual_seed(int(torch.randint(0, 2**62, ()).item()))
        tokens = sample_rows(logits, params, g)
        self.penalties.count_sampled(params, tokens)
        return tokens

    def sample(self, logits: torch.Tensor, params: list[tuple[str, SamplingParams]]) -> list[int]:
        """logits [N, V] (one row per request) -> one token per row. Seeded rows draw from their
        own generator on the host; the rest are sampled as one batch."""
        if not self.needs_host(params):
            return self.sample_batch(logits, params).tolist()
        out = logits.argmax(-1).tolist()  # greedy rows, and a cheap default
        for i, (rid, sp) in enumerate(params):
            if sp.greedy:
                continue
            probs = probs_for(logits[i].cpu(), sp)
            if not torch.isfinite(probs).all() or not probs.sum() > 0:
                continue  # an extreme temperature (inf, or so small logits overflow): greedy
            out[i] = int(torch.multinomial(probs, 1, generator=self.generator(rid, sp.seed)).item())
        return out
