#!/usr/bin/env bash
# One device call (nvidia-h200, ~7 min): the FP8 GPU tests (tests/gpu/test_fp8_gpu.py), then
# bench/fp8_gpu.py (kernels, 8B bf16 vs FP8 decode, quality, 70B FP8 decode). Logs and JSON in $OUT.
#   bash bench/gpu_session_fp8.sh            # carry .devbundle
#   QUICK=1 SKIP=quality,70b bash bench/gpu_session_fp8.sh   # batch 1 only (~2 min)
set -u
source bench/gpu_session_common.sh
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
TAIL=40 step gpu_tests ${TEST_LIMIT:-240} bash bench/gpu_tests.sh tests/gpu/test_fp8_gpu.py tests/gpu/test_engine_gpu.py -k "fp8 or capture_while"
cd bench && timeout ${BENCH_LIMIT:-420} python3 fp8_gpu.py --out "$OUT" ${SKIP:+--skip $SKIP} ${QUICK:+--quick} 2>&1 | tee "$OUT/fp8_gpu.log" | grep -v "^# config"
