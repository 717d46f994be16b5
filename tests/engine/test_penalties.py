"""Penalties (engine/penalties.py): the math against plain torch; greedy decoding with each
penalty token for token against transformers' generate on the same weights (its own
`repetition_penalty`, and a logits processor written from OpenAI's definition of presence and
frequency); the same tokens with the step overlapped and with speculative decoding on; bounds."""

from __future__ import annotations

import pytest
import torch

from tandem.engine.penalties import Penalties
from tandem.wire.errors import InvalidRequestError
from tandem.wire.messages import SamplingParams
from tests.engine.test_speculative import TINY_PROMPTS, spec_engine  # noqa: F401


def _openai_penalties(logits: torch.Tensor, output: list[int], presence: float, frequency: float) -> torch.Tensor:
    """OpenAI's definition: mu[j] - c[j] * frequency - float(c[j] > 0) * presence, c = counts in the output."""
    counts = torch.bincount(torch.tensor(output, dtype=torch.long), minlength=logits.shape[-1]).to(logits.dtype) \
        if output else torch.zeros_like(logits)
    return logits - counts * frequency - (counts > 0).to(logits.dtype) * presence


@pytest.mark.parametrize("dense", [False, True], ids=["sparse", "dense"])
def test_penalties_match_plain_torch(dense):
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 50, generator=gen) * 3
    prompt, output = [1, 2, 2, 7], [7, 9, 9, 9, 30]
    rows = [(0, "a", SamplingParams(presence_penalty=0.5, frequency_penalty=0.25), prompt, output),
            (1, "b", SamplingParams(), prompt, output),                          # no penalty: untouched
            (2, "c", SamplingParams(repetition_penalty=1.3, frequency_penalty=-0.5), prompt, output)]
    got = logits.clone()
    Penalties(dense=dense).apply(got, rows)
    assert torch.allclose(got[0], _openai_penalties(logits[0], output, 0.5, 0.25))
    assert torch.equal(got[1], logits[1])
    seen = sorted(set(prompt + output))
    rep = logits[2].clone()
    rep[seen] = torch.where(rep[seen] > 0, rep[seen] / 1.3, rep[seen] * 1.3)
    assert torch.allclose(got[2], _openai_penalties(rep, output, 0.0, -0.5))
    assert not torch.equal(got[2], logits[2])


def test_counts_carry_across_steps_and_freed_slots_start_clean():
    """The GPU's dense state is incremental (each step adds the tokens output since the last) and
    grows past its first table; step after step it gives what the CPU's sparse path computes
    from the whole output; a released request's slot is reused with nothing of it left."""
    gen = torch.Generator().manual_seed(1)
    sp = SamplingParams(presence_penalty=0.3, frequency_penalty=0.7, repetition_penalty=1.2)
    state = Penalties(initial_slots=2, dense=True)
    outputs = {f"r{i}": [] for i in range(5)}
    for step in range(6):
        logits = torch.randn(5, 40, generator=gen)
        rows = [(i, rid, sp, [i, i + 1], list(out)) for i, (rid, out) in enumerate(outputs.items())]
        got = logits.clone()
        state.apply(got, rows)
        fresh = logits.clone()
        Penalties(dense=False).apply(fresh, rows)
        assert torch.allclose(got, fresh), step
        for i, out in enumerate(outputs.values()):
            out.append(int(torch.randint(0, 8, (), generator=gen)) + i)
    state.release("r0")
    logits = torch.randn(1, 40, generator=gen)
    got = logits.clone()
    state.apply(got, [(0, "new", sp, [], [])])  # takes r0's slot: no counts, no prompt
    assert torch.equal(got, logits)


def test_bounds_are_refused_by_name():
    for kw in ({"presence_penalty": 2.5}, {"frequency_penalty": -2.01}, {"presence_penalty": float("nan")},
               {"repetition_penalty": 0.0}, {"repetition_penalty": 11.0}):
        with pytest.raises(InvalidRequestError, match=next(iter(kw))):
            SamplingParams(**kw)
    assert not SamplingParams().penalized and SamplingParams(repetition_penalty=1.1).penalized


def _hf_greedy(hf, ids: list[int], n: int, *, presence=0.0, frequency=0.0, repetition=1.0) -> list[int]:
    from transformers import LogitsProcessor, LogitsProcessorList

    class OpenAIPenalties(LogitsProcessor):
        def __call__(self, input_ids, scores):
            out = input_ids[0, len(ids):].tolist()
            return _openai_penalties(scores[0], out, presence, frequency).unsqueeze(0)

    procs = LogitsProcessorList([OpenAIPenalties()]) if presence or frequency else None
    with torch.inference_mode():
        got = hf.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, logits_processor=procs,
                          repetition_penalty=repetition if repetition != 1.0 else None,
                          eos_token_id=None, pad_token_id=0)
    return got[0, len(ids):].tolist()


PENALTIES = {"presence": {"presence_penalty": 1.5}, "frequency": {"frequency_penalty": 0.8},
             "repetition": {"repetition_penalty": 1.8}, "all": {"presence_penalty": -0.5, "frequency_penalty": 0.6,
                                                                "repetition_penalty": 1.3}}


@pytest.mark.parametrize("name", list(PENALTIES))
def test_greedy_with_penalties_matches_transformers(tiny, make_engine, name):
    """tiny-random repeats itself under greedy decoding, so each penalty changes its tokens; ours
    (in a batch beside an unpenalized request) against transformers', token for token."""
    model, tok, hf = tiny
    kw = PENALTIES[name]
    e = make_engine(model, tok)
    reqs = [{"prompt": p, "max_tokens": 24, "ignore_eos": True, **kw} for p in TINY_PROMPTS[:2]]
    res = e.generate(reqs + [{"prompt": TINY_PROMPTS[2], "max_tokens": 24, "ignore_eos": True}])
    for r in res[:2]:
        ref = _hf_greedy(hf, r["prompt_token_ids"], 24, presence=kw.get("presence_penalty", 0.0),
                         frequency=kw.get("frequency_penalty", 0.0), repetition=kw.get("repetition_penalty", 1.0))
        assert r["token_ids"] == ref
        assert r["token_ids"] != _hf_greedy(hf, r["prompt_token_ids"], 24)  # the penalty did something
    assert res[2]["token_ids"] == _hf_greedy(hf, res[2]["prompt_token_ids"], 24)


def test_overlapped_steps_and_speculation_give_the_same_tokens(tiny, make_engine, spec_engine):  # noqa: F811
    """The overlapped step keeps a step's tokens on the device; a penalized request makes the
    engine settle them first. The speculator drafts nothing for it, and its unpenalized neighbours
    still speculate."""
    model, tok, _ = tiny
    kw = PENALTIES["all"]
    reqs = [{"prompt": p, "max_tokens": 20, "ignore_eos": True, "request_id": f"r{i}", **(kw if i % 2 else {})}
            for i, p in enumerate(TINY_PROMPTS[:4])]
    plain = make_engine(model, tok).generate(reqs)
    e = make_engine(model, tok)
    e.overlap = True  # as on CUDA: on CPU the device tokens are CPU tensors
    assert [r["token_ids"] for r in e.generate(reqs)] == [r["token_ids"] for r in plain]
    s = spec_engine(model, tok, "ngram", num_tokens=4, max_verify_tokens=4096)
    spec = s.generate(reqs)
    assert [r["token_ids"] for r in spec] == [r["token_ids"] for r in plain]
    assert all(r["usage"]["draft_tokens"] == 0 for r in spec[1::2])
    assert sum(r["usage"]["draft_tokens"] for r in spec[0::2]) > 0


@pytest.mark.parametrize("num_blocks", [512, 6], ids=["roomy", "preempting"])
def test_the_dense_state_keeps_the_step_overlapped(tiny, make_engine, num_blocks):
    """With the dense state (a GPU's; set here on the CPU) a penalized request needs none of its
    tokens on the host: its sampled tokens are counted where they are drawn, so the overlapped step
    keeps a step in flight while it runs, with the plain engine's tokens. With few KV blocks
    requests are preempted with a token in flight (counted, then dropped): the state is rebuilt from
    the host's output, and the tokens stay the same."""
    model, tok, _ = tiny
    reqs = [{"prompt": p, "max_tokens": 20, "ignore_eos": True, "request_id": f"r{i}",
             **(PENALTIES["all"] if i % 2 else PENALTIES["frequency"])} for i, p in enumerate(TINY_PROMPTS[:4])]
    plain = make_engine(model, tok).generate(reqs)
    e = make_engine(model, tok, num_blocks=num_blocks)
    e.overlap = True
    e.sampler.penalties.dense = True
    in_flight, step = [], e.step

    def spy(*args, **kwargs):
        out = step(*args, **kwargs)
        in_flight.append(e._inflight is not None and any(r.sampling.penalized for r in e.scheduler.running))
        return out

    e.step = spy
    assert [r["token_ids"] for r in e.generate(reqs)] == [r["token_ids"] for r in plain]
    assert sum(in_flight) > 10, in_flight
    assert (e.stats.preemptions > 0) == (num_blocks < 100), e.stats.preemptions
