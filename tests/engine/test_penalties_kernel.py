"""engine.kernels.penalties (the dense state's penalties in one launch) under Triton's interpreter
against the torch ops it replaces (engine.penalties.Penalties with fused=False), step after step
with counts carried, in fp32 and bf16 logits, rows in any order with unpenalized rows between
them and a vocabulary that is not a multiple of the block; and bad arguments refused by name."""

import pytest
import torch

from tests.engine.test_kernels import DEVICE  # sets TRITON_INTERPRET first
from tandem.engine.kernels import penalties as kernel_mod  # noqa: I001 (after the interpreter is set)
from tandem.engine.penalties import Penalties
from tandem.wire.messages import SamplingParams


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_one_launch_matches_the_torch_ops(dtype, monkeypatch):
    monkeypatch.setattr(kernel_mod, "BLOCK", 64)  # several blocks per row, the last one partial
    gen = torch.Generator().manual_seed(4)
    vocab = 300
    sps = [SamplingParams(presence_penalty=0.4, frequency_penalty=0.3), SamplingParams(),
           SamplingParams(repetition_penalty=1.3), SamplingParams(presence_penalty=-1.0, repetition_penalty=0.8,
                                                                  frequency_penalty=-0.5)]
    prompts = [torch.randint(0, vocab, (40,), generator=gen).tolist() for _ in sps]
    outputs = [[] for _ in sps]
    fused, plain = Penalties(dense=True, fused=True), Penalties(dense=True, fused=False)
    for step in range(5):
        logits = (torch.randn(6, vocab, generator=gen) * 4).to(dtype)
        order = [3, 0, 5, 1]  # logits rows of the four requests: out of order, rows 2 and 4 unowned
        rows = [(order[i], f"r{i}", sp, prompts[i], list(outputs[i])) for i, sp in enumerate(sps)]
        got, want = logits.clone().to(DEVICE), logits.clone().to(DEVICE)
        fused.apply(got, rows)
        plain.apply(want, rows)
        assert torch.equal(got[[2, 4]], logits[[2, 4]].to(DEVICE))      # rows of no request: untouched
        assert torch.equal(got[order[1]], logits[order[1]].to(DEVICE))  # an unpenalized request's row
        if dtype == torch.float32:
            assert torch.allclose(got, want, rtol=1e-6, atol=1e-6), step
        else:  # rounded once from the same fp32 values: at most a bf16 ulp where an fp32 product differed
            assert torch.allclose(got.float(), want.float(), rtol=2 ** -7, atol=1e-6), step
        assert not torch.equal(got, logits.to(DEVICE)) or step == 0
        for i, out in enumerate(outputs):
            out += [int(torch.randint(0, 30, (), generator=gen)), prompts[i][step]]


def test_bad_arguments_are_refused_by_name():
    logits = torch.zeros(2, 10)
    counts, prompt = torch.zeros(1, 10), torch.zeros(1, 10, dtype=torch.bool)
    index, slots, params = torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long), torch.ones(1, 3)
    with pytest.raises(ValueError, match="counts must have dtype"):
        kernel_mod.penalize(logits, index, slots, params, counts.double(), prompt)
    with pytest.raises(ValueError, match="in_prompt"):
        kernel_mod.penalize(logits, index, slots, params, counts, prompt[:, :5])
    with pytest.raises(ValueError, match="index must have dtype"):
        kernel_mod.penalize(logits, index.int(), slots, params, counts, prompt)
    with pytest.raises(ValueError, match="params"):
        kernel_mod.penalize(logits, index, slots, torch.ones(1, 2), counts, prompt)
