"""Bad input raises one typed error with an actionable message before any KV is allocated, and
leaves the engine serving others."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tandem.wire.errors import InvalidRequestError
from tandem.wire.messages import SamplingParams

CASES = [
    (dict(prompt=""), "prompt must not be empty"),
    (dict(prompt_token_ids=[]), "no tokens"),
    (dict(prompt_token_ids=[5, 10**6]), "outside the vocabulary"),
    (dict(prompt_token_ids=[-1]), "outside the vocabulary"),
    (dict(prompt_token_ids=[5] * 3000), "context"),
    (dict(prompt="hi", sampling=dict(max_tokens=5000)), "exceeds the model's context"),
    (dict(messages=[{"role": "wizard", "content": "hi"}]), "not a known role"),
    (dict(messages=[]), "messages must not be empty"),
    (dict(prompt="a", prompt_token_ids=[1]), "exactly one"),
]
SAMPLING_CASES = [
    (dict(max_tokens=0), "max_tokens"),
    (dict(temperature=-0.5), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-1), "top_k"),
]


@pytest.mark.parametrize("kwargs,msg", CASES)
def test_bad_request_rejected_before_kv(tiny, make_engine, kwargs, msg):
    model, tok, _ = tiny
    e = make_engine(model, tok, num_blocks=64)
    kwargs = dict(kwargs)
    sp = kwargs.pop("sampling", None)
    with pytest.raises(InvalidRequestError, match=msg):
        e.add_request(**kwargs, sampling=SamplingParams(**sp) if sp else None)
    assert e.allocator.num_free_blocks == e.allocator.num_blocks
    assert not e.has_unfinished()
    ok = e.generate([{"prompt": "still serving", "max_tokens": 3}])[0]
    assert len(ok["token_ids"]) == 3


@pytest.mark.parametrize("kwargs,msg", SAMPLING_CASES)
def test_bad_sampling_params(kwargs, msg):
    with pytest.raises(InvalidRequestError, match=msg):
        SamplingParams(**kwargs)


def test_too_large_for_the_cache(tiny, make_engine):
    model, tok, _ = tiny
    e = make_engine(model, tok, num_blocks=4, block_size=16)
    with pytest.raises(InvalidRequestError, match="KV blocks"):
        e.add_request(prompt_token_ids=[5] * 60, sampling=SamplingParams(max_tokens=20))


def test_cli_reports_bad_input_and_exits_nonzero(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps({"prompt": "ok", "max_tokens": 2}) + "\n" + json.dumps({"prompt": "x", "top_p": 3}) + "\n")
    r = subprocess.run([sys.executable, "-m", "tandem.cluster.cli", "generate", "--model", "tiny-random",
                        "--prompt-file", str(f), "--json"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert f"{f}:2: top_p must be in (0, 1]" in r.stderr  # the line is named
    assert r.stdout == ""  # nothing ran


def test_cli_json_output_in_input_order(tmp_path):
    f = tmp_path / "p.jsonl"
    lines = [{"prompt": "first", "max_tokens": 5}, {"prompt_token_ids": [10, 11, 12], "max_tokens": 3},
             {"messages": [{"role": "user", "content": "hey"}], "max_tokens": 4, "temperature": 0.8, "seed": 1}]
    f.write_text("".join(json.dumps(x) + "\n" for x in lines))
    r = subprocess.run([sys.executable, "-m", "tandem.cluster.cli", "generate", "--model", "tiny-random",
                        "--prompt-file", str(f), "--json"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    outs = [json.loads(x) for x in r.stdout.splitlines()]
    assert [len(o["token_ids"]) <= lines[i]["max_tokens"] for i, o in enumerate(outs)] == [True] * 3
    assert outs[1]["prompt_token_ids"] == [10, 11, 12]
    assert all(o["finish_reason"] in ("stop", "length") for o in outs)
    assert all(set(o) >= {"prompt_token_ids", "token_ids", "text", "finish_reason"} for o in outs)
