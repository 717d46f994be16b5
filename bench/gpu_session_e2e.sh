#!/usr/bin/env bash
# One device call (nvidia-h200-x2): KV transfer figures and two-GPU tests again, then the
# disaggregated-vs-colocated run. Each step has its own time limit; logs and JSON go to $OUT (the
# e2e run's files, with every Ray log, packed into $OUT/e2e.tgz).
set -u
source bench/gpu_session_common.sh
TAIL=24 step bench_transfer 50 python3 bench/kv_transfer_gpu.py --out "$OUT/kv_transfer.json"
TAIL=6 step bench_ttft 90 python3 bench/kv_transfer_gpu.py --ttft --no-transfer --reps 3 --out "$OUT/kv_transfer_ttft.json"
TAIL=3 step tests_two_gpu 110 python3 -m pytest -q -x -p no:cacheprovider tests/gpu/test_two_gpus.py
TAIL=16 step e2e ${E2E_LIMIT:-320} python3 bench/disagg_vs_colocated.py --model llama3-8b-random --device cuda --gpus 2 \
  --workload agent --rates ${RATES:-0.5,1,2} --duration ${DURATION:-30} --drain 45 --out /tmp/e2e
# one file for everything (a call brings back only a few files): bench JSONs, tandem up logs, Ray's logs
tar -czf "$OUT/e2e.tgz" -C / tmp/e2e $(ls -d /tmp/ray/session_*/logs 2>/dev/null | sed 's|^/||') 2>/dev/null
ls -la "$OUT"
