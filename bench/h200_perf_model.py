"""The simulator's perf model for llama3-8b-random (bf16) on one H200, fitted (`PerfModel.fit`,
least squares) to the figures measured on `nvidia-h200-x2` and recorded in docs/benchmarks.md:
prefill of one prompt (2k, 8k, 32k tokens), decode steps (batch 1-64 at contexts 1k and 8k, CUDA
graphs), and Tandem's KV transfer (2k, 8k, 32k tokens, median of 3). The control-path terms and the
limits are the run's settings (chunk 8192, 64 sequences) and the measured remote-prefill TTFT gap.
Until `tandem profile` runs on the GPU, this is the closest thing to a measured model.

    python bench/h200_perf_model.py > bench/perf/h200-llama3-8b.json
"""

from __future__ import annotations

import json

from tandem.perf_model import PerfModel

PREFILL = [(2048, 0.047), (8192, 0.222), (32768, 1.556)]  # (prompt tokens, s), one prompt whole
DECODE = [(1, 1024, 5.10), (8, 1024, 5.60), (32, 1024, 7.15), (64, 1024, 8.25), (128, 1024, 11.94),
          (1, 8192, 5.83), (8, 8192, 8.90), (32, 8192, 16.09), (64, 8192, 23.79)]  # (batch, context, step ms)
TRANSFER = [(2048, 3.73), (8192, 5.99), (32768, 15.76)]  # (tokens, ms): gather, wire, scatter


def model() -> PerfModel:
    samples = ([("prefill", (n, n), s) for n, s in PREFILL]
               + [("decode", (b, b * c), ms / 1e3) for b, c, ms in DECODE]
               + [("transfer", (t,), ms / 1e3) for t, ms in TRANSFER])
    return PerfModel.fit(samples, request_overhead_s=0.005, remote_overhead_s=0.015,
                         max_batch=64, max_step_tokens=8192, kv_capacity_tokens=800_000)


if __name__ == "__main__":
    print(json.dumps(model().to_dict(), indent=1))
