#!/usr/bin/env bash
# One prepared GPU check for a session that is lent a CUDA machine (see DEVELOPERS.md, "the device").
# Runs chapter 09's GPU tests (pytest -m gpu: the op-by-op CupyBackend and the resident engine, Engine.open(..., resident=True)) and the CUDA benchmarks; everything it writes lands in $OUT
# (default: ./gpu_out): gpu_check.log, gpu_tests.log, cuda_bench.json, engine_bench_gpu.json.
# Budget: about 3-5 minutes on an H200 (the first NVRTC and numba compiles take most of it); the three steps
# are capped at 240 + 120 + 150 s, so a run never outlasts a device call of timeout_s 540.
#
#   device run:  bash tools/gpu_check.sh            (timeout_s 540)
#   then here:   copy $OUT/cuda_bench.json to book/results/ and rebuild chapter 09.
#
# Works from a bare copy of the repository (no venv): it needs python3 with numpy, numba and pytest (pinned in
# requirements.txt) and CuPy (requirements-cuda.txt), and installs whichever of them is missing at the version
# those files pin. Where the machine cannot reach a package index (the lent H200 cannot; its image already has
# numpy, numba, pytest and cupy-cuda13x), carry wheels in .whl/: they are installed first, into /tmp/site.
set -u -o pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/gpu_out}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY="${PYTHON:-python3}"
LOG="$OUT/gpu_check.log"
log() { echo "== $*" | tee -a "$LOG"; }

# -- 1. Python packages --------------------------------------------------------------------------------------------
if ls .whl/*.whl >/dev/null 2>&1; then
    log "installing carried wheels into /tmp/site: $(ls .whl | tr '\n' ' ')"
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 \
        | tee -a "$LOG"
    export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
pinned() {   # the requirement line of package $1 in requirements*.txt, without its comment
    grep -hiE "^$1([[<>=!~; ]|$)" requirements.txt requirements-cuda.txt | head -1 | sed 's/[[:space:]]*#.*//'
}
missing=()
for mod_pkg in numpy:numpy numba:numba pytest:pytest "cupy:cupy-cuda[0-9]+x"; do
    $PY -c "import ${mod_pkg%%:*}" 2>/dev/null || missing+=("$(pinned "${mod_pkg#*:}")")
done
if [ ${#missing[@]} -gt 0 ]; then
    log "installing what is missing: ${missing[*]}"
    if ! $PY -m pip install -q "${missing[@]}" 2>&1 | tee -a "$LOG"; then
        # a system Python that refuses pip (PEP 668): a venv that still sees the system's packages
        log "pip refused; installing into the venv /tmp/ds4ref-gpu-venv instead"
        $PY -m venv --system-site-packages /tmp/ds4ref-gpu-venv 2>&1 | tee -a "$LOG"
        PY=/tmp/ds4ref-gpu-venv/bin/python
        $PY -m pip install -q "${missing[@]}" 2>&1 | tee -a "$LOG"
    fi
fi
if ! $PY -c "import numpy, numba, pytest, cupy" 2>&1 | tee -a "$LOG"; then
    log "FAILED: numpy, numba, pytest and cupy must import (carry wheels in .whl/ on an offline machine)"
    exit 2
fi

# -- 2. ds4ref from this checkout, with kernels/ as ds4ref.kernels -------------------------------------------------
# pyproject maps kernels/ to the package ds4ref.kernels; an editable install gives that mapping. Where the install
# is not possible, a link ds4ref/kernels -> ../kernels does the same for this run (and is removed at exit).
$PY -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -3 | tee -a "$LOG"
if ! $PY -c "import ds4ref.kernels, ds4ref.backends.cupy_backend" 2>/dev/null; then
    log "editable install unavailable: linking ds4ref/kernels -> ../kernels for this run"
    ln -sfn ../kernels ds4ref/kernels
    trap 'rm -f ds4ref/kernels' EXIT
fi

{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
  $PY -c "import cupy, numpy, numba; print('cupy', cupy.__version__, 'numpy', numpy.__version__, 'numba', numba.__version__, 'devices', cupy.cuda.runtime.getDeviceCount())"
} 2>&1 | tee -a "$LOG"
if ! $PY -c "import cupy, sys; sys.exit(cupy.cuda.runtime.getDeviceCount() == 0)" 2>/dev/null; then
    log "FAILED: CuPy sees no CUDA device, so every GPU test would be skipped"
    exit 2
fi

# -- 3. the GPU tests and the benchmarks ---------------------------------------------------------------------------
log "GPU tests (pytest -m gpu)"
timeout 240 $PY -m pytest -q -o addopts="" -p no:cacheprovider -m gpu tests/test_backends.py tests/test_cupy_resident.py -rA 2>&1 \
    | tee "$OUT/gpu_tests.log"
tests_rc=${PIPESTATUS[0]}

log "CUDA kernel benchmark"
timeout 120 $PY -m ds4ref.dev.bench_engine --cuda-kernels --out "$OUT/cuda_bench.json" 2>&1 | tee -a "$LOG"

log "engine benchmark, cupy and numba, the oracle model"
timeout 150 $PY -m ds4ref.dev.bench_engine --backends cupy,numba --models oracle --steps 8 \
    --out "$OUT/engine_bench_gpu.json" 2>&1 | tee -a "$LOG"

log "done: tests rc=$tests_rc"
exit "$tests_rc"
