"""Continuous batching under a per-step token budget. Pure Python, no torch.

Each step: running requests first (in admission order), each asking for the tokens it still has
to compute (1 when decoding, the rest of its prompt when part-way through a chunked prefill, 1 + k
with speculative drafts); then waiting requests in FIFO order while the budget and the batch size
allow, their cached prefix taken from the block allocator. When blocks run out, the most recently
admitted running request is preempted: its blocks are freed and it goes back to the front of the
queue to be recomputed later (its computed prefix usually survives in the prefix cache).

`schedule()` decides; `update_from_output()` applies what the model produced. The overlapped
engine splits the latter in two: `advance()` when the step is launched (positions computed, one
placeholder output token per sampling request) and `resolve()` when its tokens reach the host, by
which time the next step is already scheduled. A request may be aborted, stopped or preempted in
between: `resolve` skips it, and finishing or preempting drops its placeholders.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from tandem.engine.block_manager import BlockAllocator
from tandem.engine.config import SchedulerConfig
from tandem.engine.request import PENDING, Request, RequestStatus
from tandem.wire.messages import FinishReason


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int  # positions computed this step, from request.num_computed_tokens on
    num_draft_tokens: int = 0  # trailing positions that are speculative drafts (not yet output)

    @property
    def completes(self) -> bool:
        """Whether this step reaches the end of the request's known tokens."""
        r = self.request
        return r.num_computed_tokens + self.num_new_tokens >= r.num_tokens + self.num_draft_tokens

    @property
    def samples(self) -> bool:
        """Whether logits are needed: completing a request (a prefill-only one samples the first
        output token, which travels to the decode actor with its KV)."""
        return self.completes


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, config: SchedulerConfig, allocator: BlockAllocator, max_model_len: int):
        self.config = config
        self.allocator = allocator
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.ready: deque[Request] = deque()  # KV already in place (received); join the batch next
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}

    # ---- admission --------------------------------------------------------------------------
    def add(self, req: Request) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"request id {req.request_id!r} is already in flight")
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def add_ready(self, req: Request) -> None:
        """A request whose blocks are held and whose first `num_computed_tokens` positions of KV are
        already in the cache (sent by a prefill actor). Free batch slots go to it and to waiting
        requests in arrival order (`schedule`); preempted later, it is recomputed like any other."""
        if req.request_id in self.requests:
            raise ValueError(f"request id {req.request_id!r} is already in flight")
        self.requests[req.request_id] = req
        at = len(self.ready)              # in arrival order (KV lands in any order)
        while at and self.ready[at - 1].arrival > req.arrival:
            at -= 1
        self.ready.insert(at, req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.ready)

    def finish(self, req: Request, reason: FinishReason) -> None:
        """Finish (or abort) a request wherever it is; its blocks go back to the allocator."""
        if req.finished:
            return
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        elif req in self.ready:
            self.ready.remove(req)
        else:
            self.waiting.remove(req)
        self.allocator.free(req)
        _drop_pending(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        del self.requests[req.request_id]

    def abort(self, request_id: str) -> Request | None:
        req = self.requests.get(request_id)
        if req is not None:
            self.finish(req, FinishReason.ABORT)
        return req

    def detach(self, request_id: str) -> Request | None:
        """Take a running request that is decoding (its KV covers every token but the last, as
        between steps) out of the batch, its blocks still held: it moves to another engine with
        its KV, or comes back with `add_ready`. None for any other request."""
        req = self.requests.get(request_id)
        if (req is None or req.status is not RequestStatus.RUNNING or not req.output_token_ids
                or req.num_computed_tokens != req.num_tokens - 1):
            return None
        self.running.remove(req)
        del self.requests[request_id]
        req.status = RequestStatus.WAITING
        return req

    # ---- one step ---------------------------------------------------------------------------
    def schedule(self, drafts: dict[str, int] | None = None) -> SchedulerOutput:
        """`drafts`: request id -> number of draft tokens appended to that running request's
        input this step (speculative decoding); they need KV slots like any other token."""
        out, budget, drafts = SchedulerOutput(), self.config.max_num_batched_tokens, drafts or {}
        # Free slots go in arrival order: a request whose KV was delivered joins now unless a
        # waiting one came before it (that one is admitted below, if its blocks and this step's
        # budget allow; ready ones behind it then take the slots left). Ready first always would
        # starve local prefills while a full batch frees slots one at a time.
        self._admit_ready(before=self.waiting[0].arrival if self.waiting else None)
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            if req.num_pending and self._ends_when_resolved(req):
                i += 1                # its last token is still on the device: nothing to compute
                continue
            k = drafts.get(req.request_id, 0)
            num_new = _chunk_cap(req, req.num_tokens + k - req.num_computed_tokens)
            if num_new > budget:  # chunk a long prefill; drafts are all-or-nothing
                if k:
                    k, num_new = 0, req.num_tokens - req.num_computed_tokens
                num_new = min(num_new, budget)
            if k and not self.allocator.grow(req, num_new):
                # out of blocks: drop this request's drafts before preempting anyone for them
                k, num_new = 0, min(req.num_tokens - req.num_computed_tokens, budget)
            while not self.allocator.grow(req, num_new):
                victim = self.running[-1]
                self._preempt(victim, out)
                if victim is req:
                    break
            else:
                out.scheduled.append(ScheduledRequest(req, num_new, k))
                budget -= num_new
                i += 1
                continue
            break  # req itself was preempted
        if out.preempted:
            return out
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            cached = self.allocator.num_admit_tokens(req)
            num_new = req.num_tokens - cached
            if req.max_chunk_tokens and cached < req.num_prompt_tokens:
                num_new = min(num_new, req.max_chunk_tokens)
            if num_new > budget:
                if not self.config.enable_chunked_prefill and self.running:
                    break
                num_new = budget
            if not self.allocator.admit(req, num_new):
                break
            if not req.admitted_once:
                req.num_cached_prompt_tokens = req.num_computed_tokens
                req.admitted_once = True
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.scheduled.append(ScheduledRequest(req, num_new))
            budget -= num_new
        self._admit_ready()           # slots the waiting queue could not use: next step's batch
        return out

    def _admit_ready(self, before: int | None = None) -> None:
        """Ready requests join the running batch while it has room (only those that arrived
        before `before`, when given)."""
        while (self.ready and len(self.running) < self.config.max_num_seqs
               and (before is None or self.ready[0].arrival < before)):
            req = self.ready.popleft()
            req.status = RequestStatus.RUNNING
            req.admitted_once = True
            self.running.append(req)

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        self.running.remove(req)
        self.allocator.free(req)
        _drop_pending(req)            # a token still on the device is recomputed with the rest
        req.num_computed_tokens = 0
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.waiting.appendleft(req)
        out.preempted.append(req)

    def update_from_output(self, out: SchedulerOutput, sampled: dict[str, list[int]],
                           num_rejected: dict[str, int] | None = None) -> list[tuple[Request, list[int]]]:
        """Advance computed counts, append sampled tokens, finish on EOS / max_tokens / context.

        `sampled[rid]`: new output tokens of a request that sampled this step (accepted drafts plus
        one); `num_rejected[rid]`: draft positions whose KV must be rolled back.
        Returns (request, new tokens) for every request that produced tokens, in batch order."""
        num_rejected = num_rejected or {}
        produced: list[tuple[Request, list[int]]] = []
        for s in out.scheduled:
            req = s.request
            if req.finished:
                continue
            req.num_computed_tokens += s.num_new_tokens - s.num_draft_tokens
            new = sampled.get(req.request_id)
            if new is None:
                self.allocator.register_full_blocks(req)
                if req.prefill_only and req.num_computed_tokens >= req.num_tokens:
                    self._complete_prefill(req)
                    produced.append((req, []))
                continue
            if req.prefill_only:  # the whole prompt's KV and the first output token: done here
                req.output_token_ids.append(new[0])
                self.allocator.register_full_blocks(req)
                self._complete_prefill(req)
                produced.append((req, new[:1]))
                continue
            # accepted drafts are now computed positions; their KV is valid
            accepted = len(new) - 1
            req.num_computed_tokens += accepted
            rejected = num_rejected.get(req.request_id, s.num_draft_tokens - accepted)
            kept = self._append(req, new)
            produced.append((req, kept))
            if rejected or accepted:
                self.allocator.truncate(req, max(req.num_computed_tokens, req.num_tokens))
            if not req.finished:
                self.allocator.register_full_blocks(req)
        return produced

    # ---- the overlapped step: launched, then resolved ---------------------------------------
    def advance(self, out: SchedulerOutput) -> None:
        """The step is launched: its positions count as computed, and each request that samples
        (but a prefill-only one) gets a placeholder output token until `resolve`. No drafts."""
        sampling = [s.samples and not s.request.prefill_only for s in out.scheduled]
        for s, samples in zip(out.scheduled, sampling):
            req = s.request
            req.num_computed_tokens += s.num_new_tokens
            if samples:
                req.output_token_ids.append(PENDING)
                req.num_pending += 1

    def resolve(self, out: SchedulerOutput, sampled: dict[str, int]) -> list[tuple[Request, list[int]]]:
        """The launched step's tokens (`sampled[rid]`, one per sampling request) are known: put
        them in place of the placeholders, finish on EOS / max_tokens / context. Requests that
        finished or were preempted since the launch are skipped. Returns (request, new tokens) as
        `update_from_output` does."""
        produced: list[tuple[Request, list[int]]] = []
        for s in out.scheduled:
            req = s.request
            if req.status is not RequestStatus.RUNNING:
                continue
            tok = sampled.get(req.request_id)
            if req.prefill_only:
                if tok is not None:
                    req.output_token_ids.append(tok)
                self.allocator.register_full_blocks(req)
                if req.num_computed_tokens >= req.num_prompt_tokens:
                    self._complete_prefill(req)
                    produced.append((req, [tok] if tok is not None else []))
                continue
            if tok is None:
                self.allocator.register_full_blocks(req)
                continue
            at = len(req.output_token_ids) - req.num_pending   # the oldest placeholder
            req.output_token_ids[at] = tok
            req.num_pending -= 1
            produced.append((req, [tok]))
            sp = req.sampling
            if not sp.ignore_eos and tok in req.eos_token_ids:
                self.finish(req, FinishReason.STOP)
            elif at + 1 >= sp.max_tokens or req.num_prompt_tokens + at + 1 >= self.max_model_len:
                self.finish(req, FinishReason.LENGTH)
            else:
                self.allocator.register_full_blocks(req)
        return produced

    def _ends_when_resolved(self, req: Request) -> bool:
        """Its output is complete by count once the tokens on the device arrive (max_tokens or
        the context), so it takes no further step."""
        return len(req.output_token_ids) >= req.sampling.max_tokens or req.num_tokens >= self.max_model_len

    def _complete_prefill(self, req: Request) -> None:
        """A prefill-only request is done: it leaves the batch but keeps its blocks for the transfer."""
        self.running.remove(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason = FinishReason.LENGTH
        del self.requests[req.request_id]

    def _append(self, req: Request, new: list[int]) -> list[int]:
        kept: list[int] = []
        sp = req.sampling
        for tok in new:
            req.output_token_ids.append(tok)
            kept.append(tok)
            if not sp.ignore_eos and tok in req.eos_token_ids:
                self.finish(req, FinishReason.STOP)
                break
            if len(req.output_token_ids) >= sp.max_tokens or req.num_tokens >= self.max_model_len:
                self.finish(req, FinishReason.LENGTH)
                break
        if req.finished and len(kept) < len(new):
            pass  # tokens past a stop are dropped; their KV is freed with the request
        return kept


def _drop_pending(req: Request) -> None:
    if req.num_pending:
        del req.output_token_ids[len(req.output_token_ids) - req.num_pending:]
        req.num_pending = 0


def _chunk_cap(req, num_new: int) -> int:
    """A prefilling request's share of a step, under its own chunk limit when it has one."""
    if req.max_chunk_tokens and req.num_computed_tokens < req.num_prompt_tokens:
        return min(num_new, req.max_chunk_tokens)
    return num_new
