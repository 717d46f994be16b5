#!/usr/bin/env bash
# Tree speculation on one H200 (issue 25), one device call: the tree GPU tests (Triton tree mask vs
# a float64 reference in bf16; tree verify through CUDA graphs token-exact with the CPU), then
# bench/spec_tree_gpu.py (tree-verify step vs decode step, llama3-8b-random bf16). Carry .devbundle.
#   TPS=3.3,4.0 bash bench/gpu_session_trees.sh    # TPS: CPU tokens per tree-verify step to project from
set -u
source bench/gpu_session_common.sh
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
TAIL=12 step gpu_tests ${TEST_LIMIT:-100} bash bench/gpu_tests.sh tests/gpu/test_tree_gpu.py
(cd bench && timeout ${BENCH_LIMIT:-150} python3 spec_tree_gpu.py --tokens-per-step ${TPS:-3.0,5.0} 2>&1 \
  | tee "$OUT/spec_tree_gpu.log")
