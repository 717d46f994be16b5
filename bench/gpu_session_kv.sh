#!/usr/bin/env bash
# One device call for the KV-transfer work (nvidia-h200-x2): versions, bench/kv_transfer_gpu.py, the
# two-GPU tests, bench/kv_transfer_gpu.py with TTFT. Each step has its own time limit; logs and
# JSON go to $OUT.
set -u
source bench/gpu_session_common.sh
python3 -c "import torch, grpc, google.protobuf as pb, ray; print(torch.__version__, grpc.__version__, pb.__version__, ray.__version__, torch.cuda.device_count())"
TAIL=30 step bench_transfer 150 python3 bench/kv_transfer_gpu.py --out "$OUT/kv_transfer.json"
TAIL=15 step tests_two_gpu 170 bash bench/gpu_tests.sh -x tests/gpu/test_two_gpus.py
TAIL=30 step bench_ttft ${TTFT_LIMIT:-250} python3 bench/kv_transfer_gpu.py --ttft --no-transfer --reps 3 --out "$OUT/kv_transfer_ttft.json"
