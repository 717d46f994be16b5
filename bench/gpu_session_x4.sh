#!/usr/bin/env bash
# Device calls for the four-GPU pool-ratio sweep (nvidia-h200-x4, issue 11). STEPS picks what runs
# (default "sweep"; a 10-minute call holds about one of them):
#   sweep     static layouts 1P:3D, 2P:2D, 3P:1D and 4 colocated at RATES, llama3-8b-random, agent
#   ramp      `tandem up --autoscale` (pools 1..3 each, 4 GPUs) under a rate ramp up and back down,
#             pool sizes sampled every second: bench-ramp-timeline.png
#   simulate  the simulator's prediction for each static layout at the same rates, and the simulated
#             ramp (sim-ramp-sim-timeline.png); CPU only
# RATES (default 4,8,12: the simulator predicts 1, 2 and 4 sessions/s do not separate the layouts);
# SWEEP_ARGS passes flags to the sweep, e.g. SWEEP_ARGS="--prefill-queue-limit 16384" for a second pass.
# Everything lands in /tmp/x4, packed into $OUT/x4.tgz with the Ray logs.
set -u
source bench/gpu_session_common.sh
STEPS=" ${STEPS:-sweep} "
has() { [[ "$STEPS" == *" $1 "* ]]; }
W=/tmp/x4; mkdir -p $W
RATES=${RATES:-4,8,12}
has sweep && TAIL=12 step sweep ${SWEEP_LIMIT:-560} python3 bench/disagg_vs_colocated.py --model llama3-8b-random \
  --device cuda --layouts ${LAYOUTS:-1:3,2:2,3:1,0:4} --workload agent --rates $RATES --duration ${DURATION:-25} \
  --drain ${DRAIN:-20} --simulate ${PERF:+--perf $PERF} ${SWEEP_ARGS:-} --out $W/sweep
cat > $W/ramp.yaml <<YAML
model: {name: llama3-8b-random, device: cuda, dtype: bfloat16}
speculative: {method: ngram}
scheduler: {max_num_batched_tokens: 8192, max_num_seqs: 128}
prefill: {replicas: 1, num_gpus: 1}
decode: {replicas: 1, num_gpus: 1, local_prefill_threshold: 256}
router: {host: 127.0.0.1, port: 50190, metrics_port: null}
autoscaler: {enabled: true, prefill_min: 1, prefill_max: 3, decode_min: 1, decode_max: 3, max_workers: 4,
             period_s: 2, upscale_delay_s: 6, downscale_delay_s: 30, ttft_target_s: 1.0, tpot_target_s: 0.04}
YAML
if has ramp; then
  python3 -c "import sys; from cluster.cli import main; sys.exit(main())" up --config $W/ramp.yaml --no-auth > $W/up-ramp.log 2>&1 &
  UP=$!
  for i in $(seq 1 120); do grep -q "serving on" $W/up-ramp.log && break; sleep 2; done
  TAIL=12 step ramp ${RAMP_LIMIT:-420} python3 -c "import sys; from cluster.cli import main; sys.exit(main())" bench \
    --target 127.0.0.1:50190 --workload agent --rates ${RAMP_RATES:-0.5,2,4,6,4,2,0.5} --duration ${RAMP_STEP_S:-40} \
    --drain-timeout 30 --watch-pools 1 --out $W/ramp --label ramp --no-progress
  kill $UP; wait $UP
fi
# the requests the sweep sends, each layout with the sweep's decode slots; the simulated ramp beside the real one
has simulate && { python3 bench/disagg_vs_colocated.py --layouts ${LAYOUTS:-1:3,2:2,3:1,0:4} --workload agent \
    --rates $RATES --duration ${DURATION:-25} --predict ${PERF:+--perf $PERF} --out $W/predict
  python3 -c "import sys; from cluster.cli import main; sys.exit(main())" simulate --workload coding-agent \
    --config $W/ramp.yaml --max-workers 4 --worker-startup-s 30 --ramp ${RAMP_RATES:-0.5,2,4,6,4,2,0.5} \
    --step-s ${RAMP_STEP_S:-40} --ttft-slo 1 --tpot-slo 0.04 ${PERF:+--perf $PERF} --out $W/ramp --label ramp-sim
} > $W/simulate.txt 2>&1; cat $W/simulate.txt
tar -czf "$OUT/x4.tgz" -C / tmp/x4 $(ls -d /tmp/ray/session_*/logs 2>/dev/null | sed 's|^/||') 2>/dev/null
ls -la "$OUT"
