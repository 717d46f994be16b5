"""A launched step whose sampled tokens are still on their way to the host.

The overlapped engine (`LLMEngine.overlap`) launches step N+1 before it reads step N's tokens: it
schedules N+1 with a placeholder for each token N sampled (`Scheduler.advance`), feeds N's tokens
to N+1's input ids on the device (`feed_pending`), launches N+1, and only then waits for N's
tokens (one synchronisation per step: the event recorded after their copy to pinned memory) and
post-processes them (`Scheduler.resolve`, detokenizing, stop strings) while the GPU runs N+1.
Everything runs on the device's current stream, so blocks freed while a step is in flight (an
abort, a finish) are written by a later step only after the in-flight one has read them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from tandem.engine.scheduler import SchedulerOutput


@dataclass
class InFlight:
    sched: SchedulerOutput
    owners: list[tuple[str, int]]  # (request id, logits rows) in logits order
    logits: torch.Tensor  # [N, vocab]
    tokens: torch.Tensor | None  # [N] sampled on the device; None when sampled on the host
    token_list: list[int] | None = None  # the host's tokens (sampled there, or read back)
    _host: torch.Tensor | None = field(default=None, repr=False)  # pinned copy of `tokens`
    _done: torch.cuda.Event | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        t = self.tokens
        if t is not None and t.device.type == "cuda":
            self._host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            self._host.copy_(t, non_blocking=True)
            self._done = torch.cuda.Event()
            self._done.record()

    @property
    def rows(self) -> dict[str, int]:
        """Request id -> its row of `tokens`."""
        return {rid: i for i, (rid, _) in enumerate(self.owners)}

    def waiter(self):
        """after_launch's `wait_device` for this step: blocks until its tokens are on the host
        (None where they already are)."""
        return self._done.synchronize if self._done is not None else None

    def token_ids(self) -> list[int]:
        if self.token_list is None:
            if self._done is not None:
                self._done.synchronize()
            self.token_list = (self._host if self._host is not None else self.tokens).tolist()
        return self.token_list


def feed_pending(batch, scheduled, prev: InFlight) -> None:
    """Write the tokens `prev` sampled (on the device) into this step's input ids where the host
    only has placeholders (`batch.pending`: positions in the step's tokens and their sequence)."""
    at, seq = batch.pending
    if not len(at):
        return
    rows = prev.rows
    src = np.fromiter((rows[scheduled[i].request.request_id] for i in seq.tolist()), dtype=np.int64, count=len(seq))
    idx = torch.from_numpy(np.stack([at.astype(np.int64), src]))
    ids = batch.input_ids
    if ids.device.type == "cuda":
        idx = idx.pin_memory().to(ids.device, non_blocking=True)
    ids.index_copy_(0, idx[0], prev.tokens.index_select(0, idx[1]).to(ids.dtype))
