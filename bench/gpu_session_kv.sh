#!/usr/bin/env bash
# One device call for the KV-transfer work (nvidia-h200-x2): environment, NCCL self-check, the
# two-GPU tests, bench/kv_transfer_gpu.py with TTFT. Each step has its own time limit; logs and
# JSON go to $OUT.
set -u
mkdir -p ~/site && tar -xJf .devbundle/site.tar.xz -C ~/site && export PYTHONPATH=~/site:$PWD
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 RAY_USAGE_STATS_ENABLED=0
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
step() { local name=$1 limit=$2; shift 2; echo "=== $name"; local t=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; local rc=$?
  echo "--- $name rc=$rc $((SECONDS - t))s"; tail -n "${TAIL:-25}" "$OUT/$name.log"; }
python3 -c "import torch, grpc, google.protobuf as pb, ray; print(torch.__version__, grpc.__version__, pb.__version__, ray.__version__, torch.cuda.device_count())"
TAIL=30 step bench_transfer 150 python3 bench/kv_transfer_gpu.py --out "$OUT/kv_transfer.json"
TAIL=15 step tests_two_gpu 170 python3 -m pytest -q -x -p no:cacheprovider tests/gpu/test_two_gpus.py
TAIL=30 step bench_ttft ${TTFT_LIMIT:-250} python3 bench/kv_transfer_gpu.py --ttft --no-transfer --reps 3 --out "$OUT/kv_transfer_ttft.json"
