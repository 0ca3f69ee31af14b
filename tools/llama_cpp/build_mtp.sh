#!/usr/bin/env bash
# Build llama-mtp-logits (tools/llama_cpp/mtp_logits.cpp): llama.cpp's DeepSeek V4 MTP block run
# step by step, for the MTP cross-check of chapter 10 (tools/llama_cpp/mtp_crosscheck.py).
#
#   tools/llama_cpp/build_mtp.sh OUTDIR        # -> OUTDIR/bin/llama-mtp-logits
#
# OUTDIR is build.sh's: the pinned llama.cpp 0c1e570 source (llama-cpp-python 0.3.36's sdist,
# sha256-checked, K-rotation guard applied) and its CPU build. build.sh runs first when OUTDIR
# has no libllama.a yet; then only the libraries are (re)built and the driver linked to them.
set -euo pipefail
OUT=${1:?usage: build_mtp.sh OUTDIR}
HERE=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
B=$OUT/build
[ -f "$B/src/libllama.a" ] || "$HERE/build.sh" "$OUT"
LC=$OUT/src/vendor/llama.cpp
grep -q "ds4ref: no K rows" "$LC/src/llama-kv-cache.cpp" \
  || { echo "build_mtp.sh: $OUT is not a build.sh tree (guard missing)" >&2; exit 1; }
JOBS=$(( $(nproc) < 2 ? $(nproc) : 2 ))
cmake --build "$B" --target llama -j "$JOBS" >>"$OUT/build.log" 2>&1 \
  || { tail -30 "$OUT/build.log" >&2; exit 1; }
mkdir -p "$OUT/bin"
c++ -O2 -std=c++17 "$HERE/mtp_logits.cpp" -I"$LC/include" -I"$LC/ggml/include" -I"$LC/src" \
  -o "$OUT/bin/llama-mtp-logits" -Wl,--start-group "$B/src/libllama.a" \
  "$B/ggml/src/libggml.a" "$B/ggml/src/libggml-cpu.a" "$B/ggml/src/libggml-base.a" \
  -Wl,--end-group -fopenmp -lpthread -ldl -lm
echo "built $OUT/bin/llama-mtp-logits (llama.cpp 0c1e570 from llama-cpp-python 0.3.36)"
