"""The overlapped step (engine.inflight) on CPU: a step's tokens are resolved only after the next
step is launched, and a request that finishes, is aborted or is preempted in between emits no token
after that, leaks no KV block, and greedy outputs equal the plain engine's."""

from __future__ import annotations

import pytest
import torch

from tandem.engine.sampler import Sampler, sample_rows
from tandem.engine.weights import load_model
from tandem.wire.messages import SamplingParams


@pytest.fixture(scope="module")
def tiny_model():
    model, tok, _ = load_model("tiny-random", seed=7)
    return model, tok


def _requests(n=5, max_tokens=(3, 9, 1, 6, 12), stop=None):
    g = torch.Generator().manual_seed(3)
    reqs = []
    for i in range(n):
        ids = torch.randint(3, 500, (5 + 7 * i,), generator=g).tolist()
        r = {"prompt_token_ids": ids, "max_tokens": max_tokens[i % len(max_tokens)], "ignore_eos": True}
        if stop:
            r["stop"] = stop
        reqs.append(r)
    return reqs


def _run(make_engine, tiny_model, overlap, reqs, arrivals=None, **kw):
    e = make_engine(*tiny_model, **kw)
    e.overlap = overlap
    return e, e.generate(reqs, arrivals)


def test_overlapped_greedy_equals_plain_with_arrivals_and_chunking(make_engine, tiny_model):
    reqs = _requests(6)
    arrivals = [0, 0, 2, 3, 3, 7]
    _, plain = _run(make_engine, tiny_model, False, reqs, arrivals, max_num_batched_tokens=16)
    e, over = _run(make_engine, tiny_model, True, reqs, arrivals, max_num_batched_tokens=16)
    assert [r["token_ids"] for r in over] == [r["token_ids"] for r in plain]
    assert [r["text"] for r in over] == [r["text"] for r in plain]
    assert [r["usage"] for r in over] == [r["usage"] for r in plain]
    assert e.stats.tokens_computed >= sum(len(r["prompt_token_ids"]) for r in reqs)


def test_a_step_resolves_after_the_next_is_launched(make_engine, tiny_model):
    e = make_engine(*tiny_model)
    e.overlap = True
    e.add_request("a", prompt_token_ids=[5, 6, 7, 8], sampling=SamplingParams(max_tokens=4, ignore_eos=True))
    assert e.step() == []                   # the prefill's token is still "on the device"
    req = e.scheduler.requests["a"]
    assert req.num_pending == 1 and req.output_token_ids == [-1]
    outs = e.step()                         # launches the second token, resolves the first
    assert [o.new_token_ids for o in outs] == [[req.output_token_ids[0]]] and req.num_pending == 1
    while e.has_unfinished():
        outs += e.step()
    assert outs[-1].finished and outs[-1].usage.completion_tokens == 4
    assert sum(len(o.new_token_ids) for o in outs) == 4


def test_eos_in_flight_stops_the_request_with_no_token_after_it(make_engine, tiny_model):
    reqs = _requests(3, max_tokens=(10,))
    _, plain = _run(make_engine, tiny_model, False, reqs)
    eos = plain[1]["token_ids"][2]              # request 1 samples this as its third token
    e = make_engine(*tiny_model)
    e.overlap = True
    for i, r in enumerate(reqs):
        req = e.add_request(f"r{i}", prompt_token_ids=r["prompt_token_ids"], sampling=SamplingParams(max_tokens=10))
        req.eos_token_ids = (eos,)
    got: dict[str, list[int]] = {}
    finished = {}
    while e.has_unfinished():
        for o in e.step():
            assert o.request_id not in finished, "a token after the request finished"
            got.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finished:
                finished[o.request_id] = o
    for i in range(3):
        toks = plain[i]["token_ids"]
        cut = toks[:toks.index(eos) + 1] if eos in toks else toks
        assert got[f"r{i}"] == cut
        assert finished[f"r{i}"].usage.completion_tokens == len(cut)
    assert finished["r1"].finish_reason.value == "stop"


def test_abort_while_a_step_is_in_flight(make_engine, tiny_model):
    e = make_engine(*tiny_model)
    e.overlap = True
    for i, r in enumerate(_requests(3, max_tokens=(8,))):
        e.add_request(f"r{i}", prompt_token_ids=r["prompt_token_ids"], sampling=SamplingParams(max_tokens=8, ignore_eos=True))
    e.step()
    e.step()
    assert e.scheduler.requests["r1"].num_pending == 1
    assert e.abort("r1")                    # its token is still on the device
    seen = [o for _ in range(40) if e.has_unfinished() for o in e.step()]
    assert all(o.request_id != "r1" for o in seen)
    assert {o.request_id for o in seen if o.finished} == {"r0", "r2"}


def test_stop_string_in_flight_and_counts_end_exactly(make_engine, tiny_model):
    reqs = _requests(4, max_tokens=(7,))
    _, plain = _run(make_engine, tiny_model, False, reqs)
    stop = plain[2]["text"][3:5]
    reqs = [{**r, "stop": [stop]} for r in reqs]
    _, plain_stop = _run(make_engine, tiny_model, False, reqs)
    _, over_stop = _run(make_engine, tiny_model, True, reqs)
    assert plain_stop[2]["finish_reason"] == "stop"
    assert over_stop == plain_stop


def test_preemption_while_a_step_is_in_flight(make_engine, tiny_model):
    # 6 blocks of 4 tokens for 3 sequences growing to 5 + 20 tokens: preemptions happen
    reqs = _requests(3, max_tokens=(20,))
    _, plain = _run(make_engine, tiny_model, False, reqs, num_blocks=14, block_size=4)
    e, over = _run(make_engine, tiny_model, True, reqs, num_blocks=14, block_size=4)
    assert e.stats.preemptions > 0
    assert [r["token_ids"] for r in over] == [r["token_ids"] for r in plain]
    assert all(r["usage"]["completion_tokens"] == 20 for r in over)


def test_batched_sampling_never_emits_excluded_tokens():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 300, generator=g)
    params = [(f"r{i}", SamplingParams(temperature=1.3, top_k=5 if i % 3 == 0 else 0,
                                       top_p=0.5 if i % 3 == 1 else 1.0)) for i in range(63)]
    params.append(("greedy", SamplingParams(temperature=0.0)))
    allowed_k = torch.topk(logits, 5, dim=-1).indices
    seen = set()
    for trial in range(30):
        toks = sample_rows(logits, params, torch.Generator().manual_seed(trial)).tolist()
        assert toks[63] == int(logits[63].argmax())
        for i, t in enumerate(toks[:63]):
            if i % 3 == 0:
                assert t in allowed_k[i].tolist()
            elif i % 3 == 1:
                p = (logits[i] / 1.3).softmax(-1)
                order = p.argsort(descending=True)
                keep = order[:int((p[order].cumsum(0) - p[order] < 0.5).sum())].tolist()
                assert t in keep
            seen.add((i, t))
    assert len(seen) > 63 * 2                 # rows actually sample


def test_sampler_keeps_seeded_rows_on_their_own_generators():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(1))
    s = Sampler()
    params = [("a", SamplingParams(temperature=1.0, seed=5)), ("b", SamplingParams(temperature=1.0)),
              ("c", SamplingParams(temperature=0.0))]
    assert s.needs_host(params) and not s.needs_host(params[1:])
    first = s.sample(logits, params)
    again = Sampler().sample(logits, params[:1])
    assert first[0] == again[0] and first[2] == int(logits[2].argmax())


def test_block_tables_kept_across_steps_match_the_lists():
    from tandem.engine.block_tables import BlockTables
    from tandem.engine.request import Request, RequestStatus

    def check(reqs):
        t = bt.gather(reqs)
        for i, r in enumerate(reqs):
            assert t[i, :len(r.block_ids)].tolist() == r.block_ids
        assert t.shape == (len(reqs), max(len(r.block_ids) for r in reqs))

    bt = BlockTables(width=4, rows=2)
    reqs = [Request(f"r{i}", [1, 2]) for i in range(3)]
    for i, r in enumerate(reqs):
        r.status, r.block_ids = RequestStatus.RUNNING, [10 * i]
    check(reqs)                                   # 3 requests: the table grows its rows
    reqs[0].block_ids.extend([5, 6, 7, 8, 9])     # past the width: it grows too
    check(reqs)
    reqs[1].block_ids = [42]                      # preempted and admitted again: a new list
    check(reqs)
    reqs[0].block_ids = reqs[0].block_ids[:2]     # speculative rollback (a new list) ...
    reqs[0].block_ids.extend([77, 78])            # ... and regrowth before the next step
    check(reqs)
    reqs[2].status = RequestStatus.FINISHED       # its row is reclaimed for a newcomer
    new = Request("r2", [3])                      # (the same id, another request)
    new.status, new.block_ids = RequestStatus.RUNNING, [99, 98]
    check([reqs[0], new, reqs[1]])


def test_pause_after_settle_hands_off_the_token_already_returned(make_engine, tiny_model):
    """decode_workers/moves.py settles and publishes before pausing: the handoff token is then one
    the router already has, not one still on the device or buffered in the engine."""
    e = make_engine(*tiny_model)
    e.overlap = True
    e.add_request("a", prompt_token_ids=[5, 6, 7, 8], sampling=SamplingParams(max_tokens=10, ignore_eos=True))
    got = [t for _ in range(3) for o in e.step() for t in o.new_token_ids]
    assert e.scheduler.requests["a"].num_pending == 1
    e.settle()
    got += [t for o in e.take_outputs() for t in o.new_token_ids]
    req = e.pause("a")
    assert req is not None and req.num_pending == 0 and req.output_token_ids == got
    assert e.handoff(req).token_id == got[-1]
    e.drop_paused(req)


def test_seeded_rows_resolve_within_the_step_and_match_the_plain_engine(make_engine, tiny_model):
    """A step with a seeded sampled row samples on the host and resolves at once (its generator's
    state travels with the request), beside greedy rows fed from the device in the steps before."""
    reqs = _requests(3, max_tokens=(6, 9, 4))
    reqs[1] = {**reqs[1], "temperature": 0.8, "top_p": 0.9, "seed": 11}
    arrivals = [0, 3, 0]                          # the seeded request joins an overlapped batch
    _, plain = _run(make_engine, tiny_model, False, reqs, arrivals)
    _, over = _run(make_engine, tiny_model, True, reqs, arrivals)
    assert [r["token_ids"] for r in over] == [r["token_ids"] for r in plain]
