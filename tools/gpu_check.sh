#!/usr/bin/env bash
# One prepared GPU check for a session that is lent a CUDA machine (see DEVELOPERS.md, "the device").
# Runs chapter 09's GPU tests (pytest -m gpu: the op-by-op CupyBackend and the resident engine, Engine.open(..., resident=True)) and the CUDA benchmarks; everything it writes lands in $OUT
# (default: ./gpu_out): gpu_check.log, gpu_tests.log, cuda_bench.json, engine_bench_gpu.json,
# engine_bench_gpu_wide.json (the resident engine on the wide model: prefill and decode tok/s, and the
# decode's fraction of the copy bandwidth that cuda_bench.json measured).
# Budget: the four steps are capped at 200 + 80 + 80 + 200 s, so a run never outlasts a device call of
# timeout_s 600 (the first NVRTC compiles and writing the 4 GB wide model take most of it).
#
#   device run:  bash tools/gpu_check.sh            (timeout_s 600)
#   then here:   copy $OUT/*.json to book/results/ as cuda_*.json and rebuild chapter 09.
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
timeout 200 $PY -m pytest -q -o addopts="" -p no:cacheprovider -m gpu tests/test_backends.py tests/test_cupy_resident.py -rA 2>&1 \
    | tee "$OUT/gpu_tests.log"
tests_rc=${PIPESTATUS[0]}

log "CUDA kernel benchmark"
timeout 80 $PY -m ds4ref.dev.bench_engine --cuda-kernels --out "$OUT/cuda_bench.json" 2>&1 | tee -a "$LOG"

log "engine benchmark, resident and op-by-op CuPy, the oracle model"
timeout 80 $PY -m ds4ref.dev.bench_engine --backends cupy-resident,cupy --models oracle --steps 8 \
    --out "$OUT/engine_bench_gpu.json" 2>&1 | tee -a "$LOG"

log "engine benchmark, resident CuPy, the wide model (written on first use)"
timeout 200 $PY -m ds4ref.dev.bench_engine --backends cupy-resident --models wide --steps 16 \
    --prompt-len 128 --out "$OUT/engine_bench_gpu_wide.json" 2>&1 | tee -a "$LOG"
$PY - "$OUT" <<'PY' 2>&1 | tee -a "$LOG"
import json, sys, pathlib
out = pathlib.Path(sys.argv[1])
try:
    copy = json.loads((out / "cuda_bench.json").read_text())["copy_read_gbps"]
    wide = json.loads((out / "engine_bench_gpu_wide.json").read_text())["models"]["wide"]
except (OSError, KeyError) as e:
    sys.exit(f"no HBM fraction: {e}")
for r in wide["runs"]:
    gbps = wide["weight_bytes_per_token"] * r["decode_tok_s"] / 1e9
    print(f"{r['backend']}: decode {r['decode_tok_s']:.1f} tok/s reads {gbps:.0f} GB/s of weights, "
          f"{gbps / copy:.0%} of the {copy:.0f} GB/s copy bandwidth")
PY

log "done: tests rc=$tests_rc"
exit "$tests_rc"
