#!/usr/bin/env bash
# The CUDA checks in one run, for a machine with an NVIDIA GPU and an image that brings its
# own torch and transformers: the GPU tests (graphs, the sampler without a host sync and inside
# a captured graph, async scheduling, prefix caching, chunked prefill, d2h counts, kernels vs
# transformers), then benchmarks.cuda_peers (every figure the median of 3 runs) and
# benchmarks.cuda_profile (ATen and Triton paths, the 0.6B and 8B shapes: step, kernels per layer,
# % of read bandwidth).
# Usage: bash benchmarks/gpu_check.sh OUT_DIR [WHEEL_DIR]
#   WHEEL_DIR: wheels of what the image lacks (pyzmq), installed into a scratch site dir.
#   OUT_DIR/cuda_peers.json and cuda_profile.json go to benchmarks/results/ for benchmarks.report.
# Ray is not needed: the engine runs in-process (the same EngineCore the server drives).
# FUSEDSERVE_NATIVE=0: the CPU kernels are not what this checks.
set -uo pipefail
out=${1:?usage: gpu_check.sh OUT_DIR [WHEEL_DIR]}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 TORCH_DEVICE_BACKEND_AUTOLOAD=0 FUSEDSERVE_NATIVE=0 FUSEDSERVE_CACHE=${FUSEDSERVE_CACHE:-/tmp/fusedserve-cache}
if [ -n "${2:-}" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/fusedserve-site "$2"/*.whl && export PYTHONPATH=/tmp/fusedserve-site
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$out/gpu.txt"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" \
  | tee -a "$out/gpu.txt"
timeout 180 python3 -m pytest -q -p no:cacheprovider -rs tests/test_cuda.py tests/test_graphs.py \
  tests/test_quantization.py -k "cuda or aten" 2>&1 | tee "$out/tests.log"
FUSEDSERVE_TRITON_COMPILED=1 timeout 100 python3 -m pytest -q -p no:cacheprovider -rs tests/test_triton_kernels.py \
  2>&1 | tee "$out/triton_tests.log"
timeout 150 python3 -m benchmarks.cuda_peers --json "$out/cuda_peers.json" 2>&1 | tee "$out/bench.log"
timeout 150 python3 -m benchmarks.cuda_profile --json "$out/cuda_profile.json" 2>&1 | tee "$out/profile.log"
