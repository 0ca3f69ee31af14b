#!/usr/bin/env bash
# Build llama.cpp's llama-bench from a pinned source, for the engine benchmark's
# `--llama-cpp DIR` rows (python -m ds4ref.dev.bench engine --llama-cpp DIR).
#
#   tools/llama_cpp/build.sh OUTDIR            # -> OUTDIR/bin/llama-bench
#   LLAMA_CPU=avx2 tools/llama_cpp/build.sh OUTDIR   # x86 AVX2 kernels only (FMA, F16C, BMI2), as on a
#                                              # CPU without AVX-512; beside DS4REF_SIMD=avx2 for ds4ref
#
# The source: the sdist of llama-cpp-python 0.3.36 from PyPI, which vendors llama.cpp at commit
# 0c1e57098bba (pinned by the sdist's sha256 below). One change is applied before building, and the
# script fails if it no longer applies:
#   src/llama-kv-cache.cpp, build_input_k_rot: skip the K rotation input when the cache holds no
#   K rows (n_embd_head_k_all == 0). Without it the stock build divides by zero (SIGFPE) on a
#   DeepSeek V4 model with no ratio-4 layer, such as ds4ref's 2-layer wide model.
# The model needs one metadata key that ds4's GGUFs do not carry; tools/llama_cpp/gguf_for_llama.py
# writes a copy with it.
# On a CPU with AMX (Intel Sapphire Rapids and later) -march=native also builds ggml's AMX buffer type,
# and llama-bench then dies in the scheduler on this model (ggml-backend.cpp:1294,
# GGML_ASSERT(*cur_backend_id != -1)); AMX is switched off (-mno-amx-*), which keeps the AVX-512 VNNI
# kernels and the CPU repack buffers. Where the CPU has no AMX the flags change nothing.
set -euo pipefail
OUT=${1:?usage: build.sh OUTDIR}
SDIST=llama_cpp_python-0.3.36.tar.gz
SHA=832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e
PY=${PY:-python3}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
cd "$OUT"
if [ ! -f "$SDIST" ]; then
  "$PY" -m pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36 -d . >/dev/null
fi
echo "$SHA  $SDIST" | sha256sum -c --quiet -
rm -rf src && mkdir src && tar xzf "$SDIST" -C src --strip-components=1
LC=src/vendor/llama.cpp
F=$LC/src/llama-kv-cache.cpp
OLD='    if (attn_rot_k) {'
NEW='    if (attn_rot_k \&\& n_embd_head_k_all > 0) {  // ds4ref: no K rows, no rotation (else SIGFPE)'
n=$(grep -c -F "$OLD" "$F" || true)
[ "$n" -ge 1 ] || { echo "build.sh: the build_input_k_rot guard no longer applies to $F" >&2; exit 1; }
# only the first occurrence, inside build_input_k_rot
line=$(grep -n "llama_kv_cache::build_input_k_rot" "$F" | head -1 | cut -d: -f1)
sed -i "$((line + 3))s|^    if (attn_rot_k) {|$NEW|" "$F"
grep -q "ds4ref: no K rows" "$F" || { echo "build.sh: guard not applied" >&2; exit 1; }
NO_AMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
case ${LLAMA_CPU:-native} in
  native) CPU_FLAGS=(-DGGML_NATIVE=ON) ;;
  avx2)   CPU_FLAGS=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON
                     -DGGML_BMI2=ON) ;;
  *) echo "build.sh: LLAMA_CPU=$LLAMA_CPU: expected native or avx2" >&2; exit 2 ;;
esac
cmake -S "$LC" -B build -DCMAKE_BUILD_TYPE=Release "${CPU_FLAGS[@]}" -DLLAMA_CURL=OFF \
  "-DCMAKE_C_FLAGS=$NO_AMX" "-DCMAKE_CXX_FLAGS=$NO_AMX" \
  -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
  -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_TOOLS=ON >build.log 2>&1
cmake --build build --target llama-bench -j "$(nproc)" >>build.log 2>&1 \
  || { tail -30 build.log >&2; exit 1; }
mkdir -p bin && cp build/bin/llama-bench bin/
echo "built $OUT/bin/llama-bench (llama.cpp 0c1e570 from llama-cpp-python 0.3.36, guard applied)"
