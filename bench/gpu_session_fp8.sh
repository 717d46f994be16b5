#!/usr/bin/env bash
# FP8 on one H200 (issue 24), one device call each; logs and JSON in $OUT. Carry .devbundle.
#   SWEEP=1 bash bench/gpu_session_fp8.sh   # ~3 min: the one-token GEMV sweep over every projection
#        shape (bench/fp8_sweep.py), then 8B bf16 vs FP8 at batch 1 with the sweep's best configs
#        and the step's breakdown
#   bash bench/gpu_session_fp8.sh           # ~5 min: the FP8 GPU tests, the committed GEMV configs per
#        shape, then bench/fp8_gpu.py (8B bf16 vs FP8 at batch 1/64/256, quality, 70B FP8, 32B)
#   ATTN=1 bash bench/gpu_session_fp8.sh    # ~5 min: the decode attention that writes the new K/V
#        itself (IN_ATTENTION) and merges in its launch (fused_merge): their GPU tests, then the 8B
#        steps with each on and off, bf16 and FP8, batch 1/64/256 (docs/benchmarks.md, issue 24);
#        TESTS and VARIANTS (bench/gemv_gpu.py --variants) replace the tests and the variants
set -u
source bench/gpu_session_common.sh
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
if [ -n "${ATTN:-}" ]; then
  TAIL=8 step attn_tests ${TEST_LIMIT:-200} bash bench/gpu_tests.sh ${TESTS:-tests/gpu/test_rope_kv_gpu.py \
    tests/gpu/test_attention_split_gpu.py tests/gpu/test_gemv_gpu.py}
  cd bench && timeout ${BENCH_LIMIT:-330} python3 gemv_gpu.py --out "$OUT" --models 8b --skip kernels --repeats 3 \
    --batches ${BATCHES:-1,64,256} --variants "${VARIANTS:-bf16:table/auto//a,bf16:table/auto/inattn/a,\
bf16:table/auto/inattn+fmerge/a,fp8:table/auto//a,fp8:table/auto/inattn/a,fp8:table/auto/inattn+fmerge/a}" 2>&1 \
    | tee "$OUT/gemv_gpu.log" | tail -${TAIL_ROWS:-12}
  exit
fi
if [ -n "${SWEEP:-}" ]; then
  (cd bench && timeout ${SWEEP_LIMIT:-200} python3 fp8_sweep.py --out "$OUT" 2>&1 | tee "$OUT/fp8_sweep.log" | grep -v "failed:")
  cd bench && timeout ${BENCH_LIMIT:-200} python3 fp8_gpu.py --out "$OUT" --quick --skip kernels,quality,70b,32b \
    --tuned "$OUT/fp8_sweep.json" 2>&1 | tee "$OUT/fp8_gpu.log" | grep -v "^# config"
  exit
fi
TAIL=15 step gpu_tests ${TEST_LIMIT:-150} bash bench/gpu_tests.sh tests/gpu/test_fp8_gpu.py
(cd bench && timeout 60 python3 fp8_sweep.py --committed --out "$OUT" 2>&1 | tee "$OUT/fp8_sweep.log" | tail -17)
cd bench && timeout ${BENCH_LIMIT:-330} python3 fp8_gpu.py --out "$OUT" --skip kernels${SKIP:+,$SKIP} 2>&1 \
  | tee "$OUT/fp8_gpu.log" | grep -v "^# config"
