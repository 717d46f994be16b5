#!/usr/bin/env bash
# Short device call (nvidia-h200-x2): the transfer table again, then the disaggregated cluster under
# the agent workload at one rate, with every log packed into one file under $OUT.
set -u
source bench/gpu_session_common.sh
W=/tmp/diag; mkdir -p $W
timeout 45 python3 bench/kv_transfer_gpu.py --reps 3 --prompts 2048,8192,32768 --message-mib 32,256 --raw-total-mib 2048 --out "$W/kv_transfer.json" > $W/transfer.log 2>&1
grep -A20 "message size sweep" $W/transfer.log | grep -v "^$"
timeout 110 python3 bench/disagg_vs_colocated.py --model llama3-8b-random --device cuda --gpus 2 --modes disaggregated \
  --workload agent --rates 0.5 --duration 25 --drain 20 --out $W/e2e > $W/e2e.log 2>&1
grep -v "^$" $W/e2e.log | tail -8
grep -rh -B2 -A12 "Traceback\|Error\|error" /tmp/ray/session_latest/logs/*.err 2>/dev/null | head -80
tar -czf "$OUT/diag.tgz" -C /tmp diag /tmp/ray/session_latest/logs 2>/dev/null; ls -la "$OUT"
