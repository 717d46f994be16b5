#!/usr/bin/env bash
# Short device call (nvidia-h200-x2): the transfer table, the GPU engine tests of graph capture and
# warmup, then both modes under the agent workload at one rate (RATE, default 0.5), printing where
# slow first tokens spent their time, with every log packed into $OUT/diag.tgz.
set -u
source bench/gpu_session_common.sh
W=/tmp/diag; mkdir -p $W
[ -n "${SKIP_TRANSFER:-}" ] || timeout 45 python3 bench/kv_transfer_gpu.py --reps 3 --prompts 2048,8192,32768 --message-mib 32,256 --raw-total-mib 2048 --out "$W/kv_transfer.json" > $W/transfer.log 2>&1
[ -n "${SKIP_TRANSFER:-}" ] || grep -A20 "message size sweep" $W/transfer.log | grep -v "^$"
TAIL=4 step tests_graphs 90 bash bench/gpu_tests.sh -x tests/gpu/test_engine_gpu.py -k "capture or warmup"
timeout ${E2E_LIMIT:-260} python3 bench/disagg_vs_colocated.py --model llama3-8b-random --device cuda --gpus 2 --modes ${MODES:-disaggregated,colocated} \
  --workload agent --rates ${RATE:-0.5} --duration ${DURATION:-25} --drain 20 --out $W/e2e > $W/e2e.log 2>&1
grep -v "^$" $W/e2e.log | grep -v "socket.cpp\|ProcessGroupNCCL" | tail -14
for f in $W/e2e/up-*.log; do echo "== $f: $(grep -c "slow first token" $f) slow first tokens"
  grep -o 'slow first token for [^"]*' $f | head -6 | cut -c1-420; done
echo "== actor logs"; A=$(ls /tmp/ray/session_*/logs/worker-*.err)
grep -ho '"msg": "[^"]*warmed up in [0-9.]* s' $A | head -6
echo "slow engine steps: $(grep -ho 'slow engine step' $A | wc -l); triton cache entries: $(ls ~/.triton/cache 2>/dev/null | wc -l)"
grep -ho '"msg": "slow engine step[^"]*' $A | head -12 | cut -c1-300
grep -ho '"msg": "[^"]*\(capture failed\|transfer [^"]*failed\|step failed\)[^"]*' $A | sort | uniq -c | sort -rn | head -8 | cut -c1-300
tar -czf "$OUT/diag.tgz" -C / tmp/diag $(ls -d /tmp/ray/session_*/logs 2>/dev/null | sed 's|^/||') 2>/dev/null; ls -la "$OUT"
