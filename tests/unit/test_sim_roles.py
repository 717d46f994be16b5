"""The simulator's role policy is the live controller's (cluster.pools `maybe_roles`): the prompt
counters each simulated worker reports (counted as engine/stats.py counts them), sampled every
period into a window, `demand_over` that window, `decide_roles`, and the worker `role_move` picks.
Pure, time passed in."""

from __future__ import annotations

from types import SimpleNamespace

from tandem.cluster import roles
from tandem.cluster.roles import RoleConfig, RoleDecision, RoleState, demand_over
from tandem.cluster.sim_engine import Simulation
from tandem.cluster.sim_model import SLO
from tandem.cluster.sim_workers import SimDecodeWorker, SimSeq
from tandem.cluster.workloads import RequestSpec
from tandem.engine.stats import EngineStats
from tandem.perf_model import PerfModel
from tandem.placement import RoleOption

PERF = PerfModel(prefill_base_s=0.0028, prefill_per_token_s=2e-5, prefill_attn_s=8.4e-10, decode_base_s=0.0056,
                 decode_per_seq_s=1.2e-5, decode_per_ctx_token_s=3.4e-8, transfer_base_s=0.003,
                 transfer_per_token_s=4e-7, request_overhead_s=0.005, remote_overhead_s=0.015,
                 max_batch=256, max_step_tokens=8192, kv_capacity_tokens=800_000)


def adaptive_sim(requests=(), workers: int = 3, cfg: RoleConfig = RoleConfig(period_s=1.0, window_s=3.0)):
    return Simulation(list(requests), 0, workers, PERF, SLO(1.0, 0.012), None, 0, False, 60.0, False, False,
                      adaptive=cfg)


def prompt(tokens: int, left: int) -> SimSeq:
    s = SimSeq(RequestSpec("p", 0, 0.0, tokens, 4), 0)
    s.prefill_left = left
    return s


def test_a_worker_counts_prompt_chunks_as_the_engine_does():
    w = SimDecodeWorker(0, 0.0, PERF.block_tokens)
    steps = [[(prompt(1000, 700), 300), (prompt(1000, 200), 200)], [(prompt(4000, 4000), 4000)]]
    engine = EngineStats()
    for chunks in steps:
        w.count_prompts(chunks)
        # the engine's view of the same step: each request's computed and prompt positions
        engine.count_prompts([SimpleNamespace(num_new_tokens=n, request=SimpleNamespace(
            num_computed_tokens=s.spec.input_tokens - s.prefill_left, num_prompt_tokens=s.spec.input_tokens))
            for s, n in chunks])
    st = w.stats(0.0, PERF)
    assert (st.prompt_tokens_computed, st.prompts_completed, st.prompt_tokens_completed) == (4500, 2, 5000)
    assert engine.prompt_counters() == {"prompt_tokens_computed": 4500, "prompts_completed": 2,
                                        "prompt_tokens_completed": 5000}


def prompt_flood_then_decodes() -> list[RequestSpec]:
    """Long decodes beside a flood of long prompts (a prefill-heavy phase), on 4 workers."""
    decodes = [RequestSpec(f"d{i}", 0, 0.01 * i, 2000, 6000) for i in range(64)]
    prompts = [RequestSpec(f"p{i}", 0, 1.0 + 0.03 * i, 2000, 4) for i in range(1000)]
    return decodes + prompts


def test_a_run_counts_every_prompt_once_on_the_worker_that_computed_it():
    sim = adaptive_sim(prompt_flood_then_decodes(), 4, RoleConfig(min_hold_s=2.0, period_s=0.5, window_s=2.0))
    sim.run()
    res = sim.result("adaptive", 0, 4)
    assert sum(w.prompts_completed for w in sim.decodes) == len(res.requests)
    assert sum(w.prompt_tokens_completed for w in sim.decodes) == sum(r.input_tokens for r in res.requests)
    assert sum(w.prompt_tokens_computed for w in sim.decodes) == sum(r.input_tokens - r.cached_tokens
                                                                    for r in res.requests)
    assert any(r.prefill == "remote" for r in res.requests)     # counted where prefilled, not where decoded


def test_the_role_decision_is_the_live_functions_on_the_workers_reports(monkeypatch):
    sim = adaptive_sim()
    busy, idle, other = sim.decodes
    busy.running.extend(SimSeq(RequestSpec(f"b{i}", 0, 0.0, 100, 50), i) for i in range(3))
    other.running.append(SimSeq(RequestSpec("o", 0, 0.0, 100, 50), 9))
    other.count_prompts([(prompt(900, 900), 900)])
    calls = {"counters": [], "demand": [], "decide": [], "move": []}

    def spy(name, real, out=None):
        def f(*a):
            calls[name].append(a)
            return real(*a) if out is None else out(*a)
        monkeypatch.setattr(roles, real.__name__, f)     # the live functions, where role_period calls them
    spy("counters", roles.prompt_counters)
    spy("demand", roles.demand_over)
    spy("move", roles.role_move)
    option = RoleOption(0, 512, 0.1, 0.01, 0.5)
    # the policy says: lend one worker (its inputs are what is checked here)
    spy("decide", roles.decide_roles, lambda perf, demand, n, state, now, *_: (
        RoleDecision(now, state.prefill_workers + 1, state.prefill_workers, "lend", option, option),
        RoleState(state.prefill_workers + 1, now)))

    for t in (0.0, 1.0, 2.0):            # a window (3 s) not yet measured: samples only
        sim._on_roles(t, None)
    assert len(calls["counters"]) == 3 and not calls["demand"] and not calls["decide"]
    workers, now, block = calls["counters"][0]
    assert [(w.worker_id, w.role) for w in workers] == [("decode-0", "mixed"), ("decode-1", "mixed"),
                                                       ("decode-2", "mixed")]
    assert (now, block) == (0.0, PERF.block_tokens)

    sim._on_roles(3.0, None)
    (samples,), = calls["demand"]
    assert [x.at for x in samples] == [0.0, 1.0, 2.0, 3.0]
    assert samples[-1].decode_seqs == 4 and samples[-1].computed == 900
    _, demand, n, state, now, ttft, tpot, cfg = calls["decide"][0]
    assert demand == demand_over(samples) and (n, state.prefill_workers, now) == (3, 0, 3.0)
    (move_workers, decision), = calls["move"]
    assert [w.stats.running for w in move_workers] == [3, 0, 1]
    assert idle.role == "prefill" and busy.role == other.role == "mixed"   # role_move's pick
    assert sim.role_log == [decision]

    sim._on_roles(4.0, None)             # the oldest sample leaves the window
    assert [x.at for x in calls["demand"][1][0]] == [1.0, 2.0, 3.0, 4.0]
    assert calls["decide"][1][3].prefill_workers == 1       # the current split, from the workers' roles


def test_prompt_heavy_load_lends_a_worker_and_it_is_given_back_where_role_move_says(monkeypatch):
    sim = adaptive_sim(prompt_flood_then_decodes(), 4, RoleConfig(min_hold_s=2.0, period_s=0.5, window_s=2.0))
    moves = []
    real = roles.role_move

    def spy(workers, d):
        moves.append((d.time_s, real(workers, d)))
        return moves[-1][1]
    monkeypatch.setattr(roles, "role_move", spy)
    sim.run()
    assert [role for _, (_, role) in moves][:1] == ["prefill"]                 # lent under the flood
    assert any(role == "mixed" for _, (_, role) in moves)                      # and given back
    assert len(moves) == len(sim.role_log) and all(d.changed for d in sim.role_log)
    lent = [sum(r == "prefill" for _, (_, r) in moves[:i]) - sum(r == "mixed" for _, (_, r) in moves[:i])
            for i in range(len(moves) + 1)]
    assert lent[-1] < max(lent)                                                # the decodes alone at the end
    assert sum(w.role == "prefill" for w in sim.decodes) == lent[-1]
