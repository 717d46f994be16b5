#!/usr/bin/env bash
# Run the GPU tests on the device machine (whose image does not pip-install Tandem): tandem.* comes
# from the symlinked layout (bench/layout.py), pytest runs from outside the repository and appends
# its rootdir, so the repository's own tandem/ folder (the leaf packages only) does not shadow it.
#   bash bench/gpu_tests.sh                 # tests/gpu
#   bash bench/gpu_tests.sh tests/gpu/test_kernels_gpu.py -k window
set -euo pipefail
R=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p ~/site && tar -xJf "$R/.devbundle/site.tar.xz" -C ~/site && python3 "$R/bench/layout.py" ~/layout
export PYTHONPATH=~/site:~/layout:$R NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \
       RAY_USAGE_STATS_ENABLED=0
[ $# -gt 0 ] || set -- tests/gpu
args=(); for a in "$@"; do if [ -e "$R/$a" ] || [[ "$a" == tests/* ]]; then args+=("$R/$a"); else args+=("$a"); fi; done
cd ~/layout
exec python3 -m pytest -q -p no:cacheprovider -c "$R/pyproject.toml" --rootdir "$R" -o pythonpath= \
     --import-mode=append -rs "${args[@]}"
