"""The scheduler's admission order between requests whose KV was delivered (`ready`) and requests
waiting for a local prefill: free batch slots go in arrival order. Pure logic: a real block
allocator and scheduler, no model."""

from __future__ import annotations

from tandem.engine.block_manager import BlockAllocator
from tandem.engine.config import SchedulerConfig
from tandem.engine.request import Request
from tandem.engine.scheduler import Scheduler
from tandem.wire.messages import FinishReason, SamplingParams

BLOCK = 4


def make(num_blocks: int = 64, max_num_seqs: int = 2, budget: int = 64) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget),
                     BlockAllocator(num_blocks, BLOCK, enable_prefix_caching=False), max_model_len=4096)


def request(rid: str, n: int = 8) -> Request:
    return Request(rid, list(range(1, n + 1)), SamplingParams(max_tokens=16))


def delivered(s: Scheduler, req: Request) -> None:
    """As the decode actor does for a remote prefill: blocks reserved, the prompt's KV in place."""
    assert s.allocator.admit(req, req.num_tokens)
    req.num_computed_tokens = req.num_tokens
    s.add_ready(req)


def running_ids(s: Scheduler) -> list[str]:
    return [r.request_id for r in s.running]


def test_a_waiting_request_that_came_first_gets_the_free_slot_before_later_deliveries():
    s = make()
    a, b = request("a"), request("b")
    s.add(a)
    s.add(b)
    s.schedule()                                    # the batch is full: a and b
    local = request("local")
    s.add(local)                                    # a local prefill arrives...
    late1, late2 = request("late1"), request("late2")
    delivered(s, late1)                             # ...then two remote ones whose KV landed
    delivered(s, late2)
    s.finish(a, FinishReason.STOP)
    out = s.schedule()                              # one slot free
    assert running_ids(s) == ["b", "local"]
    assert "local" in [x.request.request_id for x in out.scheduled]
    assert [r.request_id for r in s.ready] == ["late1", "late2"]


def test_deliveries_that_came_first_still_go_first():
    s = make()
    early = request("early")
    delivered(s, early)
    local = request("local")
    s.add(local)
    s.schedule()
    assert running_ids(s) == ["early", "local"]      # ready by arrival, then the waiting one


def test_ready_requests_take_the_slots_a_blocked_waiting_head_cannot_use():
    """The waiting head came first but its blocks are not there: the slots do not stay empty."""
    s = make(num_blocks=6, max_num_seqs=4)
    big = request("big", n=40)                      # needs 10 blocks, only 6 exist
    s.add(big)
    small = request("small", n=8)
    delivered(s, small)                             # holds 2 blocks
    s.schedule()
    assert running_ids(s) == ["small"] and [r.request_id for r in s.waiting] == ["big"]


def test_ready_requests_keep_arrival_order_whatever_order_their_kv_lands_in():
    s = make(max_num_seqs=1)
    first, second = request("first"), request("second")
    delivered(s, second)                            # the later request's KV lands first
    delivered(s, first)
    s.schedule()
    assert running_ids(s) == ["first"]


def test_a_request_with_its_own_chunk_limit_prefills_that_many_tokens_per_step():
    """The cost model's pick for a local prefill beside a batch (Request.max_chunk_tokens): the
    prompt goes in steps of at most that many tokens, even under a larger step budget; decoding
    is not capped."""
    s = make(budget=64)
    capped, free = request("capped", 40), request("free", 40)
    capped.max_chunk_tokens = 16
    s.add(capped)
    s.add(free)
    steps = []
    for _ in range(3):
        out = s.schedule()
        steps.append({x.request.request_id: x.num_new_tokens for x in out.scheduled})
        for x in out.scheduled:
            x.request.num_computed_tokens += x.num_new_tokens
    assert steps[0] == {"capped": 16, "free": 40}   # the other one takes the budget's rest at once
    assert [st["capped"] for st in steps] == [16, 16, 8]   # 8: the rest of its prompt
