#!/usr/bin/env bash
# The CUDA checks in one run, for a machine with an NVIDIA GPU and an image that brings its own
# torch, triton and transformers: a preflight (every import's version, the GPU), the GPU tests
# (graphs, the sampler without a host sync and inside a captured graph, async scheduling, prefix
# caching, chunked prefill, d2h counts, kernels vs transformers, the Triton kernels compiled),
# then fusedserve.benchmarks.cuda_peers and fusedserve.benchmarks.cuda_profile, each writing its JSON as each case ends.
#
# Usage: bash benchmarks/gpu_check.sh [--quick | --dry-run] [--out DIR] [--wheels DIR] [--python PY]
#   --quick    a subset that fits 300 s (the whole check fits 480 s)
#   --dry-run  no GPU: preflight, collection of the GPU tests, import of the GPU benchmarks and the
#              ahead-of-time sm_90 compile of every Triton kernel (CI runs this, in a venv holding
#              only what the device image holds)
#   --out      where the logs and JSON go (default gpu_out); copy cuda_peers.json and
#              cuda_profile.json to benchmarks/results/ for fusedserve.benchmarks.report
#   --wheels   wheels of what the image lacks, installed into a scratch site dir first (checked)
# Ray, ZeroMQ and llguidance are not needed: the engine runs in-process (the same EngineCore the
# server drives). FUSEDSERVE_NATIVE=0: the CPU kernels are not what this checks.
set -euo pipefail
cd "$(dirname "$0")/.."
mode=full out=gpu_out wheels="" py=${PYTHON:-python3}
while [ $# -gt 0 ]; do
  case $1 in
    --dry-run) mode=dry ;;
    --quick) mode=quick ;;
    --out) out=${2:?--out DIR}; shift ;;
    --wheels) wheels=${2:?--wheels DIR}; shift ;;
    --python) py=${2:?--python PY}; shift ;;
    -h|--help) sed -n '2,18p' "$0"; exit 0 ;;
    *) echo "gpu_check.sh: unknown argument '$1' (--help)" >&2; exit 2 ;;
  esac
  shift
done
mkdir -p "$out"
export PYTHONUNBUFFERED=1 TORCH_DEVICE_BACKEND_AUTOLOAD=0 FUSEDSERVE_NATIVE=0 TRITON_DEFAULT_FP_FUSION=1
export FUSEDSERVE_CACHE=${FUSEDSERVE_CACHE:-/tmp/fusedserve-cache}
# The image does not install this project: fusedserve.* resolves through links to its folders.
shim=$(mktemp -d)
mkdir -p "$shim/fusedserve"
for d in coordinator worker shared_memory kernels deploy benchmarks; do ln -s "$PWD/$d" "$shim/fusedserve/$d"; done
export PYTHONPATH=$shim:$PWD${PYTHONPATH:+:$PYTHONPATH}
if [ -n "$wheels" ]; then
  if ! compgen -G "$wheels/*.whl" > /dev/null; then
    echo "gpu_check: no wheels in $wheels" >&2; exit 2
  fi
  if ! "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/fusedserve-site "$wheels"/*.whl; then
    echo "gpu_check: installing the carried wheels from $wheels failed" >&2; exit 2
  fi
  export PYTHONPATH=/tmp/fusedserve-site:$PYTHONPATH
fi

gpu_flag=""
[ "$mode" = dry ] && gpu_flag=--no-gpu
"$py" -m fusedserve.benchmarks.gpu_preflight $gpu_flag --json "$out/preflight.json" 2>&1 | tee "$out/preflight.log"

GPU_TESTS=(tests/kernels/test_cuda.py tests/kernels/test_graphs.py tests/model/test_quantization.py)
TRITON_TESTS=(tests/kernels/test_triton_kernels.py tests/kernels/test_triton_lora.py)
if [ "$mode" = dry ]; then
  "$py" -m pytest --collect-only -q -p no:cacheprovider "${GPU_TESTS[@]}" "${TRITON_TESTS[@]}" \
    2>&1 | tee "$out/collect.log"
  for f in "${GPU_TESTS[@]}" "${TRITON_TESTS[@]}"; do  # a module skipped at collection lists nothing
    grep -q "^$f::" "$out/collect.log" || { echo "gpu_check --dry-run: no test of $f was collected" >&2; exit 1; }
  done
  "$py" -c "import fusedserve.benchmarks.cuda_peers, fusedserve.benchmarks.cuda_profile"
  env -u TRITON_INTERPRET "$py" -m fusedserve.kernels.triton.aot_check --arch 90 2>&1 | tee "$out/aot.log"
  echo "gpu_check --dry-run: preflight, collection, imports and the sm_90 compile passed"
  exit 0
fi

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$out/gpu.txt"
failed=()
step() {  # step NAME SECONDS CMD...: its log in $out/NAME.log; a failure is listed, the rest still runs
  local name=$1 limit=$2
  shift 2
  echo "== $name (at most ${limit} s)"
  if ! timeout "$limit" "$@" 2>&1 | tee "$out/$name.log"; then
    failed+=("$name")
  fi
}
if [ "$mode" = quick ]; then  # 80 + 50 + 70 + 70 s
  step tests 80 "$py" -m pytest -q -p no:cacheprovider -rs tests/kernels/test_cuda.py -k "cuda or aten"
  step triton_tests 50 env FUSEDSERVE_TRITON_COMPILED=1 "$py" -m pytest -q -p no:cacheprovider -rs \
    "${TRITON_TESTS[@]}"
  step bench 70 "$py" -m fusedserve.benchmarks.cuda_peers --batches 1,16 --new-tokens 32 --json "$out/cuda_peers.json"
  step profile 70 "$py" -m fusedserve.benchmarks.cuda_profile --models 0.6b --calls 10 --json "$out/cuda_profile.json"
else  # 140 + 70 + 140 + 110 s
  step tests 140 "$py" -m pytest -q -p no:cacheprovider -rs "${GPU_TESTS[@]}" -k "cuda or aten"
  step triton_tests 70 env FUSEDSERVE_TRITON_COMPILED=1 "$py" -m pytest -q -p no:cacheprovider -rs \
    "${TRITON_TESTS[@]}"
  step bench 140 "$py" -m fusedserve.benchmarks.cuda_peers --json "$out/cuda_peers.json"
  step profile 110 "$py" -m fusedserve.benchmarks.cuda_profile --json "$out/cuda_profile.json"
fi
if [ ${#failed[@]} -gt 0 ]; then
  echo "gpu_check: failed or timed out: ${failed[*]} (logs in $out)" >&2
  exit 1
fi
echo "gpu_check: every step passed (logs and JSON in $out)"
