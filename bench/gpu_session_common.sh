# Sourced by bench/gpu_session_*.sh on the device machine: unpack the Ray bundle (.devbundle, made by
# ../shared/device/make-ray-bundle.sh with EXTRA="grpcio-health-checking==1.66.2
# grpcio-reflection==1.66.2 gguf==0.19.0 tqdm==4.67.1": the engine imports gguf, the image lacks it), the NCCL settings two-GPU hosts need, $OUT, and `step NAME
# LIMIT CMD...`, which runs CMD under a time limit into $OUT/NAME.log and prints its tail.
mkdir -p ~/site && tar -xJf .devbundle/site.tar.xz -C ~/site && python3 bench/layout.py ~/layout
export PYTHONPATH=~/site:~/layout:$PWD   # tandem.* from ~/layout (bench/layout.py); tests from $PWD
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 RAY_USAGE_STATS_ENABLED=0
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
step() { local name=$1 limit=$2; shift 2; echo "=== $name"; local t=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; local rc=$?
  echo "--- $name rc=$rc $((SECONDS - t))s"; tail -n "${TAIL:-25}" "$OUT/$name.log"; }
