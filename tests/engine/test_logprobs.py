"""Log-probabilities (engine/logprobs.py): against plain torch, against transformers' forward on
the generated sequence, unchanged by speculative decoding, and absent (not computed) unless asked."""

from __future__ import annotations

import math

import pytest
import torch

from tandem.engine.logprobs import step_logprobs, token_logprobs
from tandem.wire.errors import InvalidRequestError
from tandem.wire.messages import SamplingParams
from tests.engine.test_speculative import TINY_PROMPTS, OracleProposer, run_checked, spec_engine  # noqa: F401


def _reference(logits: torch.Tensor, temperature: float, top_k: int) -> torch.Tensor:
    """log-softmax of the distribution sampled from, written out with plain torch ops."""
    if temperature == 0:
        return torch.log_softmax(logits.double(), -1)
    x = logits.double() / temperature
    kth = x.sort(-1, descending=True).values[:, top_k - 1:top_k]
    x = torch.where(x >= kth, x, torch.tensor(-math.inf, dtype=x.dtype))
    return x - torch.logsumexp(x, -1, keepdim=True)


@pytest.mark.parametrize("temperature,top_k", [(0.0, 0), (0.7, 5)])
def test_token_logprobs_match_plain_torch(temperature, top_k):
    logits = torch.randn(6, 300, generator=torch.Generator().manual_seed(3)) * 4
    tokens = [int(t) for t in logits.argmax(-1)]
    tokens[2] = int(logits[2].argsort()[-3])        # a sampled, non-argmax token
    sp = SamplingParams(temperature=temperature, top_k=top_k, logprobs=4)
    got = token_logprobs(logits, sp, tokens)
    ref = _reference(logits, temperature, top_k or 300)
    for i, lp in enumerate(got):
        assert lp.logprob == pytest.approx(ref[i, tokens[i]].item(), abs=1e-5)
        ref_top = ref[i].topk(4)
        assert [t for t, _ in lp.top] == ref_top.indices.tolist()
        for (_, v), r in zip(lp.top, ref_top.values.tolist()):
            assert v == pytest.approx(r, abs=1e-5)
    if top_k:   # a token outside top-k cannot be drawn: -inf, and below every kept one
        far = int(logits[0].argsort()[0])
        assert token_logprobs(logits[:1], sp, [far])[0].logprob == -math.inf


def test_logprobs_zero_gives_no_alternatives_and_bounds_are_checked():
    lp = token_logprobs(torch.zeros(1, 4), SamplingParams(logprobs=0), [1])[0]
    assert lp.top == () and lp.logprob == pytest.approx(math.log(0.25))
    for bad in (-1, 21):
        with pytest.raises(InvalidRequestError):
            SamplingParams(logprobs=bad)


def test_a_step_where_none_asked_computes_nothing():
    class Req:
        request_id, sampling = "a", SamplingParams()
    # logits=None: any use of them would raise
    assert step_logprobs([(Req(), [5])], None, [("a", 1)]) == {}


@torch.inference_mode()
def test_greedy_logprobs_match_transformers_on_the_output(tiny, make_engine):
    model, tok, hf = tiny
    e = make_engine(model, tok)
    res = e.generate([{"prompt": p, "max_tokens": 12, "logprobs": 3} for p in TINY_PROMPTS[:3]]
                     + [{"prompt": "no logprobs", "max_tokens": 4}])
    assert "logprobs" not in res[-1]
    for r in res[:3]:
        ids = r["prompt_token_ids"] + r["token_ids"]
        ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0].double(), -1)
        n = len(r["prompt_token_ids"])
        assert len(r["logprobs"]) == len(r["token_ids"]) == 12
        for j, (tok_id, lp) in enumerate(zip(r["token_ids"], r["logprobs"])):
            row = ref[n + j - 1]
            assert lp.logprob == pytest.approx(row[tok_id].item(), abs=2e-3)
            assert lp.top[0][0] == tok_id and len(lp.top) == 3   # greedy: the chosen one is the top


def test_speculative_drafts_get_the_logprobs_plain_decoding_gives(tiny, make_engine, spec_engine):  # noqa: F811
    model, tok, _ = tiny
    reqs = [{"prompt": p, "max_tokens": 16, "request_id": f"r{i}", "logprobs": 2}
            for i, p in enumerate(TINY_PROMPTS[:4])]
    plain = make_engine(model, tok).generate(reqs)
    e = spec_engine(model, tok, "ngram", num_tokens=4, max_verify_tokens=4096,
                    proposer=OracleProposer({p["request_id"]: p["token_ids"] for p in plain}))
    spec = run_checked(e, reqs)
    assert e.stats.accepted_draft_tokens > 20      # most tokens came as accepted drafts
    for p, s in zip(plain, spec):
        assert s["token_ids"] == p["token_ids"] and len(s["logprobs"]) == len(p["logprobs"])
        for a, b in zip(s["logprobs"], p["logprobs"]):
            assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
            assert [t for t, _ in a.top] == [t for t, _ in b.top]


def test_sampled_logprobs_are_of_the_filtered_distribution(tiny, make_engine):
    model, tok, _ = tiny
    e = make_engine(model, tok)
    r = e.generate([{"prompt": "hello", "max_tokens": 8, "temperature": 0.8, "top_k": 3, "seed": 1,
                     "logprobs": 5}])[0]
    for tok_id, lp in zip(r["token_ids"], r["logprobs"]):
        assert math.isfinite(lp.logprob) and tok_id in [t for t, _ in lp.top[:3]]
        probs = [math.exp(v) for _, v in lp.top]
        assert sum(probs[:3]) == pytest.approx(1.0, abs=1e-5) and probs[3:] == [0.0, 0.0]
