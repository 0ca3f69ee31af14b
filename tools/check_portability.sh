#!/usr/bin/env bash
# Re-run the chapters against their stored outputs (nbval) under settings that change float
# arithmetic without changing the maths: OpenBLAS's CPU kernel, numpy's SIMD dispatch, and the
# BLAS / numba thread counts. A stored output that differs under any of them depends on the
# machine, which the book does not allow (DEVELOPERS.md, "Stored outputs hold on every machine").
#
#   tools/check_portability.sh                       # every chapter, every setting
#   tools/check_portability.sh book/05_attention.ipynb book/06_kvcache.ipynb
#   SETTINGS="haswell one-thread" tools/check_portability.sh
#
# Never set these variables in the tests or in CI: on some processors they are set for a reason.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
NB=("$@")
[ ${#NB[@]} -eq 0 ] && NB=(book/[0-9][0-9]_*.ipynb)
SETTINGS=${SETTINGS:-"unset haswell one-thread no-avx512"}
LOGS=$(mktemp -d "${TMPDIR:-/tmp}/portability.XXXXXX")
fail=0
for s in $SETTINGS; do
  case $s in
    unset)      envs=(-u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE) ;;
    haswell)    envs=(OPENBLAS_CORETYPE=Haswell) ;;
    one-thread) envs=(OPENBLAS_NUM_THREADS=1 NUMBA_NUM_THREADS=1) ;;
    no-avx512)  envs=(-u OPENBLAS_L2_SIZE OPENBLAS_CORETYPE=Sandybridge
                      "NPY_DISABLE_CPU_FEATURES=AVX512_ICL AVX512_SPR X86_V4") ;;
    *) echo "unknown setting $s"; exit 2 ;;
  esac
  echo "== $s: ${envs[*]}"
  if env "${envs[@]}" "$PY" -m pytest -q -p no:randomly "${NB[@]}" >"$LOGS/$s.log" 2>&1; then
    tail -1 "$LOGS/$s.log"
  else
    fail=1; grep -E "^(FAILED|ERROR)|passed|failed" "$LOGS/$s.log" | tail -20
    echo "   (full log: $LOGS/$s.log)"
  fi
done
exit $fail
