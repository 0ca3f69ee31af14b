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
#   SETTINGS=zen4 tools/check_portability.sh tests book   # ... as on an AVX-512 AMD (AVX-512 host)
#
# zen3: the float paths of an AVX2-only AMD Zen 3. numba compiles for LLVM's znver3 with its
# features (no AVX-512: the kernels and their probe take the AVX2 paths), numpy runs its AVX2
# (X86_V3) loops, OpenBLAS its Zen kernels (numpy's OpenBLAS 0.3.31 names them Haswell). IEEE
# arithmetic is the same on every x86 core and the kernels use no approximate instructions
# (fastmath only reassociates and contracts), so the same instructions give the same bits: on an
# AVX-512 Intel this setting reproduced, bit for bit, a failure first seen on an AVX2-only AMD EPYC.
# On a Zen 3 itself it is the machine's own configuration.
# zen4: an AMD Zen 4 (AVX-512 with VNNI, BW, VL, IFMA, VBMI, BF16; no AMX, no AVX512-FP16, no
# AVX-VNNI). numba compiles for LLVM's znver4 with those features (the kernels take the AVX-512 VNNI
# paths), numpy keeps its AVX-512 loops up to Ice Lake's (X86_V4, AVX512_ICL; not AVX512_SPR),
# OpenBLAS runs the kernels it picks for a Zen 4 (Cooperlake where built; numpy's OpenBLAS 0.3.31
# resolves that name to its SkylakeX kernels, as it does on a real Zen 4).
# An emulation can only take away instructions: zen4 needs an AVX-512 host (an Intel Ice Lake or
# later, or a Zen 4) and zen3 an AVX2 one. A setting whose code this CPU cannot execute is refused
# with a message (exit status 2 when named in SETTINGS, skipped from the default list) instead of
# dying with SIGILL half way.
#
# Never set these variables in the tests or in CI: on some processors they are set for a reason.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
NB=("$@")
[ ${#NB[@]} -eq 0 ] && NB=(book/[0-9][0-9]_*.ipynb book/[A-Z]_*.ipynb)
DEFAULT="unset haswell one-thread no-avx512"
[ "$(uname -m)" = x86_64 ] && DEFAULT="$DEFAULT zen3 zen4"
NAMED=${SETTINGS:+yes}
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
# this machine's LLVM features as a Zen 4's: its AVX-512 set kept (the host must have it, see
# missing_for), Intel-only extensions off, AMD's own on
zen4_features() {
  "$PY" - <<'PY'
from llvmlite import binding as llvm
f = llvm.get_host_cpu_features()
for k in list(f):
    if k.startswith(("amx", "avxvnni", "avx10", "avxifma", "avxneconvert", "avx512fp16",
                     "avx512vp2intersect", "avx512er", "avx512pf", "cldemote", "movdir",
                     "serialize", "tsxldtrk", "sha512", "sm3", "sm4", "waitpkg", "uintr",
                     "enqcmd", "hreset", "kl", "widekl", "ptwrite", "pconfig", "sgx")):
        f[k] = False
    if k in ("sse4a", "clzero", "mwaitx", "rdpru", "wbnoinvd"):
        f[k] = True
print(f.flatten())
PY
}
# what a setting's code needs that this CPU lacks (LLVM feature names); empty: it can run here
missing_for() {
  local need=""
  case $1 in
    haswell|zen3) need="avx2 fma" ;;
    no-avx512)    need="avx" ;;
    zen4)         need="avx2 fma avx512f avx512cd avx512dq avx512bw avx512vl avx512vnni avx512ifma
                        avx512vbmi avx512vbmi2 avx512bitalg avx512vpopcntdq gfni vaes vpclmulqdq" ;;
  esac
  [ -z "$need" ] && return 0
  "$PY" - $need <<'PY'
import sys
from llvmlite import binding as llvm
try:
    f = llvm.get_host_cpu_features()
except RuntimeError:
    f = {}
print(" ".join(k for k in sys.argv[1:] if not f.get(k, False)))
PY
}
# the OpenBLAS kernels a setting's environment gives numpy (OpenBLAS may alias a core's name)
openblas_core() {
  env "$@" "$PY" - <<'PY' 2>/dev/null
import ctypes, glob, os
import numpy as np
libs = glob.glob(os.path.join(os.path.dirname(np.__file__), os.pardir, "numpy.libs", "*openblas*.so*"))
fn = [getattr(ctypes.CDLL(l), n, None) for l in libs
      for n in ("scipy_openblas_get_corename64_", "scipy_openblas_get_corename", "openblas_get_corename")]
fn = [f for f in fn if f is not None]
if fn:
    fn[0].restype = ctypes.c_char_p
    print(fn[0]().decode())
PY
}
CPU=$(grep -m1 "model name" /proc/cpuinfo 2>/dev/null | cut -d: -f2- | sed 's/^ *//')
echo "host: ${CPU:-$(uname -m)}; LLVM CPU $("$PY" -c 'from llvmlite import binding as b; print(b.get_host_cpu_name())')"
fail=0
for s in $SETTINGS; do
  lacks=$(missing_for "$s")
  if [ -n "$lacks" ]; then
    echo "== $s: refused: this CPU lacks ${lacks// /, }; the code this setting compiles or selects"
    echo "   (numba's target, OpenBLAS's kernel) would stop with SIGILL here. Run it on a host that has them."
    if [ "$NAMED" = yes ]; then fail=2; fi
    continue
  fi
  case $s in
    unset)      envs=(-u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE) ;;
    haswell)    envs=(OPENBLAS_CORETYPE=Haswell) ;;
    one-thread) envs=(OPENBLAS_NUM_THREADS=1 NUMBA_NUM_THREADS=1) ;;
    no-avx512)  envs=(-u OPENBLAS_L2_SIZE OPENBLAS_CORETYPE=Sandybridge
                      "NPY_DISABLE_CPU_FEATURES=AVX512_ICL AVX512_SPR X86_V4") ;;
    zen3)       envs=(NUMBA_CPU_NAME=znver3 "NUMBA_CPU_FEATURES=$(zen3_features)"
                      "NPY_DISABLE_CPU_FEATURES=X86_V4 AVX512_ICL AVX512_SPR"
                      OPENBLAS_CORETYPE=Zen) ;;
    zen4)       envs=(NUMBA_CPU_NAME=znver4 "NUMBA_CPU_FEATURES=$(zen4_features)"
                      "NPY_DISABLE_CPU_FEATURES=AVX512_SPR" OPENBLAS_CORETYPE=Cooperlake) ;;
    *) echo "unknown setting $s"; exit 2 ;;
  esac
  echo "== $s: $(printf "%s " "${envs[@]}" | cut -c1-200) (OpenBLAS core: $(openblas_core "${envs[@]}"))"
  if env "${envs[@]}" "$PY" -m pytest -q -p no:randomly "${NB[@]}" >"$LOGS/$s.log" 2>&1; then
    tail -1 "$LOGS/$s.log"
  else
    fail=1; grep -E "^(FAILED|ERROR)|passed|failed" "$LOGS/$s.log" | tail -20
    echo "   (full log: $LOGS/$s.log)"
  fi
done
exit $fail
