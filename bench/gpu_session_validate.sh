#!/usr/bin/env bash
# One device call (nvidia-h200, ~8 min): `tandem profile` of llama3-8b-random on the GPU (forward
# passes, verify steps, whole engine steps), then one colocated worker recorded under `tandem bench`
# at RATES for the simulator's validation (bench/record_run.py): the run's files go to
# bench/results/NAME (below), $OUT/profile.json to bench/perf/, the full bench JSON and logs in rec.tgz.
#   bash bench/gpu_session_validate.sh                  # RATES=0.5,1,2,3 DURATION=30 DRAIN=20 SPEC=ngram SEED=0
#   PROFILE_FROM=bench/perf/h200-llama3-8b-profile.json bash bench/gpu_session_validate.sh
#       (a shorter call: that profile's prefill and whole-step timings, this GPU's decode, verify and
#       padded steps from bench/verify_padding.py)
#   PROFILE_READY=bench/perf/h200-llama3-8b-profile-7.json bash bench/gpu_session_validate.sh
#       (the record only, with a profile an earlier call made)
# The run comes back as $OUT/steps-NAME.tgz (run.json, perf.json, steps/): unpack it into
# bench/results/NAME/ for validate_simulator (and its step table).
set -u
source bench/gpu_session_common.sh
export PYTHONUNBUFFERED=1
# The repository's own tandem/ (the leaf packages) comes first on sys.path wherever the cwd is the
# repository (python -c, Ray's workers): link the other packages into it too, on this copy only.
python3 -c "import tomllib, os; m = tomllib.load(open('pyproject.toml', 'rb'))['tool']['setuptools']['package-dir']
[os.path.lexists(f'tandem/{p[7:]}') or os.symlink(f'../{d}', f'tandem/{p[7:]}') for p, d in m.items() if p != 'tandem']"
NAME=${NAME:-h200-colocated}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
TANDEM="python3 -c 'import sys; from tandem.cluster.cli import main; sys.exit(main())'"
if [ -n "${PROFILE_READY:-}" ]; then   # a profile this GPU kind made already: record only
  cp "$PROFILE_READY" "$OUT/profile.json"
elif [ -n "${PROFILE_FROM:-}" ]; then   # keep PROFILE_FROM's prefill and whole-step timings, time the decode steps again
  TAIL=40 step padding ${PROFILE_LIMIT:-150} python3 bench/verify_padding.py --model llama3-8b-random --device cuda \
    --dtype bfloat16 --merge "$PROFILE_FROM" -o "$OUT/profile-merged.json"
  TAIL=3 step refit 60 bash -c "$TANDEM profile --from $OUT/profile-merged.json -o $OUT/profile.json"
else
  TAIL=12 step profile ${PROFILE_LIMIT:-220} bash -c "$TANDEM profile --model llama3-8b-random --device cuda \
    --dtype bfloat16 --speculative ${SPEC:-ngram} -o $OUT/profile.json"
fi
PROFILE=$OUT/profile.json; [ -s "$PROFILE" ] || PROFILE=bench/perf/h200-llama3-8b.json   # a failed profile: the old model
TAIL=30 step record ${RECORD_LIMIT:-330} python3 bench/record_run.py --profile "$PROFILE" --device cuda \
  --model llama3-8b-random --layout 0:1 --workload agent --rates ${RATES:-0.5,1,2,3} --duration ${DURATION:-30} \
  --speculative ${SPEC:-ngram} --seed ${SEED:-0} \
  --drain ${DRAIN:-20} --num-blocks ${NUM_BLOCKS:-40000} --name "$NAME" --results "$OUT/results" --work /tmp/rec \
  --probe-batches 1,8,32 --probe-prompt 4096 --probe-tokens 384 --control-prompt 1024 \
  --machine "nvidia-h200 (one H200), llama3-8b-random bf16, speculation ${SPEC:-ngram}"
A=$(ls /tmp/ray/session_*/logs/worker-*.err 2>/dev/null)
grep -ho '[a-z]*-[0-9]* warmed up in [0-9.]* s (CUDA_MODULE_LOADING=[A-Z]*)' $A
for f in $A; do n=$(grep -c 'slow engine step' $f); [ "$n" -gt 0 ] && echo "$f: $n slow steps"; done
# the device tool leaves results/NAME/steps out ("depth") and returns at most 8 files a call
# ("count": h200-colocated-10 lost its run.json and perf.json that way): the run's directory comes
# back as one archive, unpacked with `tar -xzf steps-NAME.tgz -C bench/results/NAME`
[ -d "$OUT/results/$NAME" ] && tar -czf "$OUT/steps-$NAME.tgz" -C "$OUT/results/$NAME" . \
  && rm -rf "$OUT/results"
tar -czf "$OUT/rec.tgz" -C / tmp/rec $(ls -d /tmp/ray/session_*/logs 2>/dev/null | sed 's|^/||') 2>/dev/null
ls -la "$OUT"
