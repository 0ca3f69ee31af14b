#!/usr/bin/env bash
# Re-run the chapters against their stored outputs (nbval), or any tests, under settings that
# change float arithmetic without changing the maths: OpenBLAS's CPU kernel, numpy's SIMD dispatch,
# the BLAS / numba thread counts, and the code numba compiles. A stored output or a test that
# differs under any of them depends on the machine, which the book does not allow (DEVELOPERS.md,
# "Stored outputs hold on every machine").
#
#   tools/check_portability.sh                       # every chapter, every setting
#   tools/check_portability.sh book/05_attention.ipynb book/06_kvcache.ipynb
#   SETTINGS="haswell one-thread" tools/check_portability.sh
#   SETTINGS=zen3 tools/check_portability.sh tests book   # the whole suite as on an AVX2-only AMD
#
# zen3: the float paths of an AVX2-only AMD Zen 3 on an AVX-512 x86 machine. numba compiles for
# LLVM's znver3 with its features (no AVX-512: the kernels and their probe take the AVX2 paths),
# numpy runs its AVX2 (X86_V3) loops, OpenBLAS its Zen kernels. IEEE arithmetic is the same on
# every x86 core, so the same instructions give the same bits: on an AVX-512 Intel this setting
# reproduced, bit for bit, a failure first seen on an AVX2-only AMD EPYC.
#
# Never set these variables in the tests or in CI: on some processors they are set for a reason.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
NB=("$@")
[ ${#NB[@]} -eq 0 ] && NB=(book/[0-9][0-9]_*.ipynb)
DEFAULT="unset haswell one-thread no-avx512"
[ "$(uname -m)" = x86_64 ] && DEFAULT="$DEFAULT zen3"
SETTINGS=${SETTINGS:-$DEFAULT}
LOGS=$(mktemp -d "${TMPDIR:-/tmp}/portability.XXXXXX")
# this machine's LLVM features with those a Zen 3 lacks turned off and its own turned on
zen3_features() {
  "$PY" - <<'PY'
from llvmlite import binding as llvm
f = llvm.get_host_cpu_features()
for k in list(f):
    if k.startswith(("avx512", "amx", "avxvnni", "avx10", "avxifma", "avxneconvert",
                     "cldemote", "movdir", "serialize", "tsxldtrk", "gfni", "sha512")):
        f[k] = False
    if k in ("sse4a", "clzero", "mwaitx", "rdpru", "wbnoinvd"):
        f[k] = True
print(f.flatten())
PY
}
fail=0
for s in $SETTINGS; do
  case $s in
    unset)      envs=(-u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE) ;;
    haswell)    envs=(OPENBLAS_CORETYPE=Haswell) ;;
    one-thread) envs=(OPENBLAS_NUM_THREADS=1 NUMBA_NUM_THREADS=1) ;;
    no-avx512)  envs=(-u OPENBLAS_L2_SIZE OPENBLAS_CORETYPE=Sandybridge
                      "NPY_DISABLE_CPU_FEATURES=AVX512_ICL AVX512_SPR X86_V4") ;;
    zen3)       envs=(NUMBA_CPU_NAME=znver3 "NUMBA_CPU_FEATURES=$(zen3_features)"
                      "NPY_DISABLE_CPU_FEATURES=X86_V4 AVX512_ICL AVX512_SPR"
                      OPENBLAS_CORETYPE=Zen) ;;
    *) echo "unknown setting $s"; exit 2 ;;
  esac
  echo "== $s: $(printf "%s " "${envs[@]}" | cut -c1-200)"
  if env "${envs[@]}" "$PY" -m pytest -q -p no:randomly "${NB[@]}" >"$LOGS/$s.log" 2>&1; then
    tail -1 "$LOGS/$s.log"
  else
    fail=1; grep -E "^(FAILED|ERROR)|passed|failed" "$LOGS/$s.log" | tail -20
    echo "   (full log: $LOGS/$s.log)"
  fi
done
exit $fail
