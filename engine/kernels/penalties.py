"""Penalties on a step's logits in one launch (the Triton twin of engine.penalties' dense torch ops).

For each penalized row i: logits[index[i]] is penalized with its request's state, slot slots[i] of
the device tables: counts [slots, V] (fp32, how often each token was output) and in_prompt
[slots, V] (bool), and params[i] = (repetition, frequency, presence). Repetition first (a logit of
a token seen in the prompt or the output divided by it when positive, multiplied when negative),
then presence and frequency (minus presence * said - frequency * count), in fp32, rounded once to
the logits' dtype. The torch form is a dozen launches over [rows, V] and their temporaries
(gathers, masks, wheres, a scatter back); here a program reads a block of one row's logits, counts
and prompt flags and writes the block back.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem.engine.kernels.validate import FLOAT_DTYPES, require_runnable, require_same, require_tensor

BLOCK = 2048  # vocabulary columns per program (4 warps)


@triton.jit
def _penalize_kernel(logits_ptr, index_ptr, slots_ptr, params_ptr, counts_ptr, prompt_ptr, V,
                     stride_l, stride_c, stride_p, BLOCK: tl.constexpr):
    i = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < V
    row = tl.load(index_ptr + i)
    slot = tl.load(slots_ptr + i)
    rep = tl.load(params_ptr + i * 3)
    freq = tl.load(params_ptr + i * 3 + 1)
    pres = tl.load(params_ptr + i * 3 + 2)
    x = tl.load(logits_ptr + row * stride_l + cols, mask=mask, other=0.0).to(tl.float32)
    count = tl.load(counts_ptr + slot * stride_c + cols, mask=mask, other=0.0)
    in_prompt = tl.load(prompt_ptr + slot * stride_p + cols, mask=mask, other=0) != 0
    said = count > 0
    seen = (in_prompt | said) & ((count * 0.0 + rep) != 1.0)  # rep as a block: & of two blocks
    x = tl.where(seen, tl.where(x > 0, tl.math.div_rn(x, rep), x * rep), x)
    x = (x - freq * count) - pres * said.to(tl.float32)
    tl.store(logits_ptr + row * stride_l + cols, x.to(logits_ptr.dtype.element_ty), mask=mask)


def penalize(logits: torch.Tensor, index: torch.Tensor, slots: torch.Tensor, params: torch.Tensor,
             counts: torch.Tensor, in_prompt: torch.Tensor) -> None:
    """Penalize logits [N, V] in place: rows `index` [R] (int64) with the states `slots` [R] of
    counts [S, V] fp32 and in_prompt [S, V] bool, params [R, 3] fp32 (repetition, frequency,
    presence). Rows not in `index` are left alone; no row may appear twice."""
    require_tensor("logits", logits, ndim=2, dtypes=FLOAT_DTYPES, last_dim_contiguous=True)
    require_tensor("counts", counts, ndim=2, dtypes=(torch.float32,), last_dim_contiguous=True)
    require_tensor("in_prompt", in_prompt, ndim=2, dtypes=(torch.bool,), last_dim_contiguous=True)
    require_tensor("params", params, ndim=2, dtypes=(torch.float32,))
    for name, t in (("index", index), ("slots", slots)):
        require_tensor(name, t, ndim=1, dtypes=(torch.int64,))
        require_same(name, t, "logits", logits, dtype=False)
    for name, t in (("counts", counts), ("in_prompt", in_prompt), ("params", params)):
        require_same(name, t, "logits", logits, dtype=False)
    require_runnable(logits, _penalize_kernel)
    rows, vocab = index.shape[0], logits.shape[1]
    if counts.shape != in_prompt.shape or counts.shape[1] != vocab or slots.shape[0] != rows \
            or params.shape != (rows, 3) or not params.is_contiguous():
        raise ValueError(f"penalize: logits {tuple(logits.shape)}, index [{rows}], slots {tuple(slots.shape)}, "
                         f"params {tuple(params.shape)} (contiguous [R, 3]), counts {tuple(counts.shape)} and "
                         f"in_prompt {tuple(in_prompt.shape)} do not fit")
    if rows == 0:
        return
    _penalize_kernel[(rows, triton.cdiv(vocab, BLOCK))](
        logits, index, slots, params, counts, in_prompt.view(torch.uint8), vocab,
        logits.stride(0), counts.stride(0), in_prompt.stride(0), BLOCK=BLOCK,
        **({"num_warps": 4} if logits.is_cuda else {}))
