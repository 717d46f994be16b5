"""The cost model's placement (tandem.placement: prefill options, role plans) and the role policy's
hysteresis (cluster.roles), as pure functions with a fake clock."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from tandem.cluster.roles import RoleConfig, RoleState, decide_roles
from tandem.perf_model import PerfModel
from tandem.router.placing import CostPlacement, Placer
from tandem.router.sessions import SessionState
from tandem.wire.errors import WorkersOverloaded
from tandem.placement import (LOCAL, REMOTE, BatchGuard, Demand, EngineLoad, WorkerView, chunk_choices, choose_prefill,
                              choose_worker,
                              chunked_prefill_s, plan_roles, prefill_options)

H200 = PerfModel(prefill_base_s=0.0028, prefill_per_token_s=2e-5, prefill_attn_s=8.4e-10, decode_base_s=0.0056,
                 decode_per_seq_s=1.2e-5, decode_per_ctx_token_s=3.4e-8, transfer_base_s=0.003,
                 transfer_per_token_s=4e-7, request_overhead_s=0.005, remote_overhead_s=0.015,
                 max_batch=256, max_step_tokens=8192)


def test_chunk_choices_double_up_to_the_budget_left_beside_the_batch():
    assert chunk_choices(H200, 0) == [256, 512, 1024, 2048, 4096, 8192]
    assert chunk_choices(H200, 192)[-1] == 8000


def test_chunked_prefill_adds_up_to_the_one_shot_prefill_without_a_batch():
    one_chunk, during = chunked_prefill_s(H200, EngineLoad(), 4096, 0, 8192)
    # one step: prefill base + tokens + attention over the chunk's own context (n * n/2 on average)
    assert one_chunk == pytest.approx(H200.prefill_base_s + 4096 * H200.prefill_per_token_s
                                      + H200.prefill_attn_s * 4096 * (4096 + 8192) / 2)
    assert during == 0.0                                  # no batch to slow down
    small, _ = chunked_prefill_s(H200, EngineLoad(), 4096, 0, 256)
    assert small > one_chunk                               # 16 steps pay 16 bases


def test_an_overlapped_engine_charges_a_busy_worker_the_step_it_already_scheduled():
    busy, over = EngineLoad(8, 8 * 4000), replace(H200, overlap=True)
    plain_s, _ = chunked_prefill_s(H200, busy, 300, 0, 8192)
    over_s, _ = chunked_prefill_s(over, busy, 300, 0, 8192)
    assert over_s == pytest.approx(plain_s + H200.step_s(8, 8 * 4000))
    assert chunked_prefill_s(over, EngineLoad(), 300, 0, 8192) == chunked_prefill_s(H200, EngineLoad(), 300, 0, 8192)


def test_a_local_prefill_pays_the_decode_workers_admission_a_remote_one_does_not():
    load = EngineLoad(8, 8 * 4000)
    plain = prefill_options(H200, 3000, "d0", load, 0, {"p0": (EngineLoad(), 0)})
    admit = prefill_options(replace(H200, admit_host_s=0.004), 3000, "d0", load, 0, {"p0": (EngineLoad(), 0)})
    for a, b in zip(plain, admit):
        assert (a.where, a.worker_id, a.chunk_tokens) == (b.where, b.worker_id, b.chunk_tokens)
        assert b.ttft_s == pytest.approx(a.ttft_s + (0.004 if a.where == LOCAL else 0.0))


def test_a_short_prompt_stays_local_when_both_slos_hold():
    opts = prefill_options(H200, 300, "d0", EngineLoad(8, 8 * 4000), 0, {"p0": (EngineLoad(), 0)})
    best = choose_prefill(opts, 1.0, 0.040)
    assert best.where == LOCAL and best.worker_id == "d0"


def test_a_tight_tpot_slo_sends_a_long_prompt_to_the_prefill_worker():
    # 16 sequences at 8k context each (10 ms steps): chunks small enough to keep 15 ms take
    # the chunks that keep 15 ms take 60+ steps for a 16k prompt
    busy = EngineLoad(16, 16 * 8000)
    opts = prefill_options(H200, 16_000, "d0", busy, 0, {"p0": (EngineLoad(), 0)})
    best = choose_prefill(opts, 1.0, 0.015)
    assert best.where == REMOTE and best.worker_id == "p0"
    local = [o for o in opts if o.where == LOCAL]
    assert all(o.headroom(1.0, 0.015) < best.headroom(1.0, 0.015) for o in local)
    assert best.tpot_s <= 0.015 and best.ttft_s <= 1.0


def test_a_backlogged_prefill_worker_loses_to_local_chunks():
    backlog = EngineLoad(queued_prefill_tokens=400_000)
    opts = prefill_options(H200, 8000, "d0", EngineLoad(4, 4 * 2000), 0, {"p0": (backlog, 0)})
    best = choose_prefill(opts, 1.0, 0.040)
    assert best.where == LOCAL


def test_a_queue_of_local_prefills_raises_the_predicted_tpot_and_ttft():
    load = EngineLoad(16, 16 * 8000)
    alone = choose_prefill(prefill_options(H200, 6000, "d0", load, 0, {}), 2.0, 0.040)
    queued = choose_prefill(prefill_options(H200, 6000, "d0", EngineLoad(16, 16 * 8000, 60_000), 0, {}),
                            2.0, 0.040)
    assert queued.tpot_s > alone.tpot_s and queued.ttft_s > alone.ttft_s + 0.5


def test_when_tpot_binds_alike_the_shorter_ttft_breaks_the_tie():
    """Every option joins the same decode batch, so when TPOT is the binding SLO they share its
    headroom; a prefill-only worker that cuts the TTFT by more than a headroom step then takes the
    prompt (before: local won every such tie, and a worker lent to prefill stayed idle)."""
    cpu = PerfModel(prefill_base_s=0.002, prefill_per_token_s=1e-4, prefill_attn_s=0.0, decode_base_s=0.04,
                    decode_per_seq_s=0.004, decode_per_ctx_token_s=0.0, transfer_base_s=0.001,
                    transfer_per_token_s=0.0, request_overhead_s=0.01, remote_overhead_s=0.01, max_step_tokens=2048)
    opts = prefill_options(cpu, 600, "d0", EngineLoad(2, 400), 0, {"p0": (EngineLoad(), 0)})
    local = min((o for o in opts if o.where == LOCAL), key=lambda o: o.ttft_s)
    remote = next(o for o in opts if o.where == REMOTE)
    assert local.headroom(0.5, 0.06) == pytest.approx(remote.headroom(0.5, 0.06))    # TPOT binds, alike
    assert remote.ttft_s < local.ttft_s - 0.02 * 0.5
    assert choose_prefill(opts, 0.5, 0.06).worker_id == "p0"
    # a TTFT gain within a headroom step (a generous TTFT SLO) still leaves the prompt local
    assert choose_prefill(opts, 30.0, 0.06).where == LOCAL


def test_a_remote_worker_pulls_the_decode_workers_longer_prefix():
    opts = prefill_options(H200, 20_000, "d0", EngineLoad(), 19_000, {"p0": (EngineLoad(), 0)})
    remote = [o for o in opts if o.where == REMOTE][0]
    cold = [o for o in prefill_options(H200, 20_000, "d0", EngineLoad(), 0, {"p0": (EngineLoad(), 0)})
            if o.where == REMOTE][0]
    assert remote.ttft_s < cold.ttft_s / 5


# 70k prompt tokens/s of 2k-token prompts at 4k context beside 64 sequences of 4k on 4 workers
PREFILL_HEAVY = Demand(prompt_tokens_per_s=70_000, mean_new_tokens=2000, mean_prompt_tokens=4000,
                       decode_seqs=64, context_tokens=64 * 4000)


def test_role_plan_lends_workers_to_prefill_only_when_it_pays():
    decode_heavy = Demand(prompt_tokens_per_s=2000, mean_new_tokens=500, mean_prompt_tokens=20_000,
                          decode_seqs=120, context_tokens=120 * 20_000)
    assert plan_roles(H200, decode_heavy, 4, 1.0, 0.040)[0].prefill_workers == 0
    # colocated, the chunks take 40% of each worker's time: 8 ms steps stretch to 13 ms
    plans = {o.prefill_workers: o for o in plan_roles(H200, PREFILL_HEAVY, 4, 1.0, 0.012)}
    assert plans[0].headroom < 0 < plans[2].headroom
    assert plans[1].headroom == -math.inf                  # one worker cannot prefill 70k tokens/s
    assert plan_roles(H200, PREFILL_HEAVY, 4, 1.0, 0.012)[0].prefill_workers == 2


def test_a_split_past_the_prefill_capacity_is_infeasible():
    flood = Demand(prompt_tokens_per_s=10_000_000, mean_new_tokens=4000, mean_prompt_tokens=4000)
    for o in plan_roles(H200, flood, 2, 1.0, 0.040):
        assert o.headroom == -math.inf


def test_roles_move_one_worker_at_a_time_and_hold():
    cfg = RoleConfig(min_hold_s=10.0, margin=0.05)
    d, st = decide_roles(H200, PREFILL_HEAVY, 4, RoleState(0), 100.0, 1.0, 0.012, cfg)
    assert d.changed and d.prefill_workers == 1 and "lend" in d.reason     # one step toward 2
    assert st.changed_at_s == 100.0
    d2, st2 = decide_roles(H200, PREFILL_HEAVY, 4, st, 105.0, 1.0, 0.012, cfg)
    assert not d2.changed and d2.reason.startswith("held")
    d3, st3 = decide_roles(H200, PREFILL_HEAVY, 4, st2, 110.0, 1.0, 0.012, cfg)
    assert d3.prefill_workers == 2 and st3.changed_at_s == 110.0
    # the demand vanishes: back to decode, but only once the hold has passed
    idle = Demand(decode_seqs=400, context_tokens=400 * 8000)
    d5, _ = decide_roles(H200, idle, 4, RoleState(1, 100.0), 104.0, 2.0, 0.040, cfg)
    assert not d5.changed and d5.reason.startswith("held")
    d4, st4 = decide_roles(H200, idle, 4, RoleState(1, 100.0), 111.0, 2.0, 0.040, cfg)
    assert d4.changed and d4.prefill_workers == 0 and st4.changed_at_s == 111.0


def test_a_small_gain_does_not_flip_a_role():
    cfg = RoleConfig(min_hold_s=0.0, margin=10.0)          # no finite gain is ever enough ...
    d, _ = decide_roles(H200, PREFILL_HEAVY, 4, RoleState(0), 0.0, 1.0, 0.016, cfg)
    assert d.best.prefill_workers > 0 and d.current.headroom > 0
    assert not d.changed and "below margin" in d.reason
    # ... not even one that crosses the SLO (the model's error, the cost of moving a batch) ...
    d, _ = decide_roles(H200, PREFILL_HEAVY, 4, RoleState(0), 0.0, 1.0, 0.012, cfg)
    assert d.current.headroom < 0 <= d.best.headroom and not d.changed
    # ... but leaving a split that cannot keep up at all is
    d, _ = decide_roles(H200, PREFILL_HEAVY, 4, RoleState(1), 0.0, 1.0, 0.012, cfg)
    assert d.current.headroom == -math.inf and d.changed


class _Views:
    """A router's cluster view: d0 decodes a big batch, d1 a small one, p0 only prefills."""
    router_id = "r"

    def __init__(self, p0_state="ready", d1_running=2):
        self.decode = [WorkerView("d0", "decode", running=40, kv_blocks_used=40 * 8000 // 16),
                       WorkerView("d1", "decode", running=d1_running, kv_blocks_used=d1_running * 500 // 16),
                       WorkerView("p0", "decode", state="draining")]
        self.prefill = [WorkerView("p0", "prefill", state=p0_state),
                        WorkerView("d0", "prefill", running=40), WorkerView("d1", "prefill", running=d1_running)]
        self.inflight, self.queues = {}, {}

    def views(self, pool):
        return list(self.decode if pool == "decode" else self.prefill)


def test_the_router_places_by_the_cost_model_when_configured():
    # d0's batch already steps past 15 ms, so the batch guard would refuse its sessions' requests
    # (test_the_batch_guard_...); here the question is only where prompts are prefilled
    cost = CostPlacement(H200, 1.0, 0.015, batch_guard=False)
    placer = Placer(_Views(), 16, 2, {}, local_prefill_threshold=0, cost=cost)
    busy = SessionState(decode_worker="d0", prefill_worker=None, num_tokens=0)
    # a long prompt for the busy d0: the prefill-only p0 computes it
    assert placer.prefill_plan(busy, 16_000, []) == ("p0", None)
    # a short one stays on its decode worker, in one chunk
    hint, chunk = placer.prefill_plan(busy, 200, [])
    assert hint is None and chunk >= 200
    # p0 gone from the prefill choice: d1 decodes, so it prefills for nobody; d0 prefills itself
    placer = Placer(_Views("draining"), 16, 2, {}, local_prefill_threshold=0, cost=cost)
    assert placer.prefill_plan(busy, 16_000, [])[0] is None
    # an idle d1 has slack
    placer = Placer(_Views("draining", d1_running=0), 16, 2, {}, local_prefill_threshold=0, cost=cost)
    assert placer.prefill_plan(busy, 16_000, [])[0] == "d1"
    assert placer.counters["cost_remote"] == 1


def test_the_batch_guard_refuses_a_request_that_would_slow_its_batch_past_the_tpot_slo():
    placer = Placer(_Views(), 16, 2, {}, local_prefill_threshold=0, cost=CostPlacement(H200, 1.0, 0.015))
    on_d0 = SessionState(decode_worker="d0", prefill_worker=None, num_tokens=0)
    # d0's 40 sequences of 8k step past 15 ms: a turn of its session is refused, not moved to d1
    # (its KV stays where it is cached)
    assert placer.prefill_plan(on_d0, 16_000, []) == (None, None)
    with pytest.raises(WorkersOverloaded):
        placer.pick("decode", "d0", [], new_tokens=16_000)
    # a new session goes to d1, whose two short sequences have room
    assert placer.pick("decode", None, [], new_tokens=16_000) == "d1"
    # a request moved off a failed worker is placed wherever it can run, full or not
    assert placer.pick("decode", "d0", [], new_tokens=None) == "d0"
    assert placer.prefill_plan(on_d0, 16_000, [], moved=True)[0] == "p0"
    # with the TPOT SLO at 40 ms d0 has room
    placer = Placer(_Views(), 16, 2, {}, local_prefill_threshold=0, cost=CostPlacement(H200, 1.0, 0.040))
    assert placer.pick("decode", "d0", [], new_tokens=16_000) == "d0"


def test_the_batch_guard_never_holds_an_idle_worker_or_a_request_too_long_for_the_slo_alone():
    guard = BatchGuard(H200, 0.015)
    ctx_per_seq = 8000
    busy = WorkerView("d0", "decode", running=30, kv_blocks_used=30 * ctx_per_seq // 16)
    idle = WorkerView("d1", "decode")
    full = guard.full_for(2000, 16)
    assert H200.tpot_s(31, 30 * ctx_per_seq + 2000) <= 0.015 and not full(busy)
    # queued requests count as batch: 41 sequences, and the KV the worker reserved for them
    crowded = replace(busy, waiting=10, kv_blocks_used=40 * ctx_per_seq // 16)
    assert H200.tpot_s(41, 40 * ctx_per_seq + 2000) > 0.015 and full(crowded)
    assert not full(idle)
    # 300k tokens alone step past 15 ms: such a request is never refused by the guard
    too_long = 300_000
    assert H200.tpot_s(1, too_long) > 0.015 and not guard.full_for(too_long, 16)(crowded)


def test_choose_worker_keeps_a_session_on_its_full_worker_and_skips_full_ones_for_others():
    ws = [WorkerView("d0", "decode", running=5), WorkerView("d1", "decode", running=9),
          WorkerView("d2", "decode", running=1)]
    full = lambda w: w.running > 4    # noqa: E731
    assert choose_worker(ws, "d0", full=full) is None        # the session waits for its own worker
    assert choose_worker(ws, None, full=full) == "d2"
    assert choose_worker(ws, "d2", full=full) == "d2"
    assert choose_worker(ws, None) == "d2" and choose_worker(ws, "d0") == "d0"
    assert choose_worker(ws[:2], None, full=full) is None


def test_the_router_without_a_cost_model_keeps_the_rules():
    placer = Placer(_Views(), 16, 2, {}, local_prefill_threshold=256)
    hint, chunk = placer.prefill_plan(None, 16_000, [])
    assert placer.cost is None and hint in {"p0", "d0", "d1"} and chunk is None
    assert "cost_remote" not in placer.counters and "cost_local" not in placer.counters
