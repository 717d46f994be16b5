#!/usr/bin/env bash
# One device call (nvidia-h200-x2): KV transfer figures, the disaggregated-vs-colocated run, then
# the GPU tests. STEPS picks a subset (default: "transfer ttft tests e2e"). Each
# step has its own time limit; logs and JSON go to $OUT (the e2e run's files, with every Ray log,
# packed into $OUT/e2e.tgz). All four steps do not fit one call's 600 s: run
# STEPS="transfer ttft tests" (about 8 min) and STEPS=e2e RATES=2,4,8 (about 6 min) as two calls.
# TRANSFER_ARGS replaces the transfer step's "--profile /tmp/prof". TTFT_ARGS replaces the TTFT step's "--reps 3" (e.g. "--reps 8 --prompts 8192"). E2E_ARGS passes flags to bench/disagg_vs_colocated.py, e.g. E2E_ARGS="--prefill-queue-limit 16384";
# MODES=disaggregated runs one mode; SLOW_SHOWN=N prints the first N slow-step logs; every Triton
# compile after warmup is printed (there should be none).
set -u
source bench/gpu_session_common.sh
STEPS=" ${STEPS:-transfer ttft tests e2e} "
has() { [[ "$STEPS" == *" $1 "* ]]; }
has transfer && TAIL=${TRANSFER_TAIL:-30} step bench_transfer ${TRANSFER_LIMIT:-240} python3 bench/kv_transfer_gpu.py --out "$OUT/kv_transfer.json" ${TRANSFER_ARGS:---profile /tmp/prof}
has transfer && tar -czf "$OUT/kv_profile.tgz" -C /tmp prof 2>/dev/null
has ttft && TAIL=6 step bench_ttft ${TTFT_LIMIT:-160} python3 bench/kv_transfer_gpu.py --ttft --no-transfer ${TTFT_ARGS:---reps 3} --out "$OUT/kv_transfer_ttft.json"
# PYSPY=SECONDS: py-spy (carried as .devbundle/py-spy) records every thread of the first two pool
# actors for that long, from PYSPY_AT seconds after they start, into $OUT/pyspy-*.txt
if has e2e && [ -n "${PYSPY:-}" ] && [ -x .devbundle/py-spy ]; then
  for a in 1 2; do (   # every pool actor is a WorkerActor: the first two started
    until pid=$(pgrep -f "ray::WorkerActor" | sed -n "${a}p") && [ -n "$pid" ]; do sleep 1; done; sleep "${PYSPY_AT:-40}"
    .devbundle/py-spy record -d "$PYSPY" -r 50 --idle --threads --nonblocking --native -f raw -o "$OUT/pyspy-$a.txt" -p "$pid" \
      > "$OUT/pyspy-$a.log" 2>&1 || .devbundle/py-spy record -d "$PYSPY" -r 50 --idle --threads --nonblocking -f raw \
      -o "$OUT/pyspy-$a.txt" -p "$pid" >> "$OUT/pyspy-$a.log" 2>&1 ) & done; fi
has e2e && TAIL=16 step e2e ${E2E_LIMIT:-320} python3 bench/disagg_vs_colocated.py --model llama3-8b-random --device cuda --gpus 2 \
  --workload agent --rates ${RATES:-0.5,1,2} --duration ${DURATION:-30} --drain ${DRAIN:-45} --out /tmp/e2e ${MODES:+--modes $MODES} ${E2E_ARGS:-}
# one file for everything (a call brings back only a few files): bench JSONs, tandem up logs, Ray's logs
if has e2e; then A=$(ls /tmp/ray/session_*/logs/worker-*.err 2>/dev/null)   # each actor: warmup, slow steps
  grep -ho '[a-z]*-[0-9]* warmed up in [0-9.]* s (CUDA_MODULE_LOADING=[A-Z]*)' $A
  for f in $A; do n=$(grep -c 'slow engine step' $f); [ "$n" -gt 0 ] && echo "$(sed -n 2p $f) $f: $n slow steps"; done
  grep -ho 'slow engine step.*' $A | cut -c1-700 | head -${SLOW_SHOWN:-0}
  grep -ho 'Triton compiled a kernel while serving.*' $A | cut -c1-1200 | sort | uniq -c | sort -rn | head -20; fi
has e2e && tar -czf "$OUT/e2e.tgz" -C / tmp/e2e $(ls -d /tmp/ray/session_*/logs 2>/dev/null | sed 's|^/||') 2>/dev/null
has tests && TAIL=3 step tests_gpu ${TESTS_LIMIT:-260} bash bench/gpu_tests.sh ${GPU_TESTS:-tests/gpu}
ls -la "$OUT"
