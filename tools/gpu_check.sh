#!/usr/bin/env bash
# One prepared GPU check for a session that is lent a CUDA machine (see DEVELOPERS.md, "the device").
# Runs the GPU tests of chapter 09 and the CUDA benchmark; everything it writes lands in $OUT
# (default: ./gpu_out). Budget: about 3-5 minutes on an H200, most of it the first NVRTC compiles.
#
#   device run:  bash tools/gpu_check.sh            (timeout_s 540 leaves room for one rerun)
#   then here:   copy $OUT/cuda_bench.json to book/results/ and rebuild chapter 09.
#
# Needs python3 with numpy and pytest, and CuPy: the lent machine's image has cupy-cuda13x; elsewhere
# `pip install -r requirements-cuda.txt`. Where nothing can be downloaded, carry wheels in .whl/
# (gguf==0.19.0 is only needed to write the wide model for the engine benchmark).
set -u -o pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/gpu_out}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY="${PYTHON:-python3}"
log() { echo "== $*" | tee -a "$OUT/gpu_check.log"; }

if ls .whl/*.whl >/dev/null 2>&1; then
    log "installing carried wheels: $(ls .whl)"
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH="/tmp/site:${PYTHONPATH:-}"
fi
if ! $PY -c "import cupy" 2>/dev/null; then
    log "CuPy missing: pip install -r requirements-cuda.txt"
    $PY -m pip install -q -r requirements-cuda.txt 2>&1 | tail -3 | tee -a "$OUT/gpu_check.log"
fi
# ds4ref from this checkout, with kernels/ installed as ds4ref.kernels (pyproject package-dir); where an
# offline editable install is not possible, a link ds4ref/kernels -> ../kernels in this (disposable) copy
$PY -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -3 | tee -a "$OUT/gpu_check.log"
if ! $PY -c "import ds4ref.kernels, ds4ref.backends.cupy_backend" 2>/dev/null; then
    log "editable install unavailable: linking ds4ref/kernels -> ../kernels"
    ln -sfn ../kernels ds4ref/kernels
fi

{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
  $PY -c "import cupy, numpy; print('cupy', cupy.__version__, 'numpy', numpy.__version__, 'devices', cupy.cuda.runtime.getDeviceCount())"
} 2>&1 | tee -a "$OUT/gpu_check.log"

log "GPU tests (pytest -m gpu)"
timeout 300 $PY -m pytest -q -o addopts="" -p no:cacheprovider -m gpu tests/test_backends.py -rA 2>&1 \
    | tee "$OUT/gpu_tests.log"
tests_rc=${PIPESTATUS[0]}

log "CUDA kernel benchmark"
timeout 180 $PY -m ds4ref.bench_engine --cuda-kernels --out "$OUT/cuda_bench.json" 2>&1 | tee -a "$OUT/gpu_check.log"

log "engine benchmark, cupy and numba, the oracle model (writing models needs the gguf package)"
timeout 120 $PY -m ds4ref.bench_engine --backends cupy,numba --models oracle --steps 8 \
    --out "$OUT/engine_bench_gpu.json" 2>&1 | tee -a "$OUT/gpu_check.log"

log "done: tests rc=$tests_rc"
exit "$tests_rc"
