#!/usr/bin/env bash
# Build ds4.c's CPU engine for a GGUF's shape, plus ds4c_run, into OUTDIR.
#   tools/ds4c/build.sh DS4_CHECKOUT MODEL.gguf OUTDIR [compiler flags...]
# Default flags are ds4.c's Makefile CPU flags at commit 8d57664:
#   -O3 -ffast-math -march=native -fno-finite-math-only -D_GNU_SOURCE -std=c99 -DDS4_NO_GPU
# The build logs its biased top-k expert choices when $DS4C_EXPERT_LOG names a file (shape_patch.py).
# Extra arguments replace the optimisation flags (e.g. "-O2 -march=native" for a no-fast-math build).
# DS4C_PATCH="--dump-steering" adds shape_patch.py's steering dump (record.py --steering needs it).
set -euo pipefail
src=$1; model=$2; out=$3; shift 3
flags=${*:-"-O3 -ffast-math -march=native -fno-finite-math-only"}
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
py=${PYTHON:-$root/.venv/bin/python}
mkdir -p "$out"
cp "$src/ds4.h" "$src/ds4_gpu.h" "$out/"
PYTHONPATH="$root" "$py" "$here/shape_patch.py" --log-experts ${DS4C_PATCH:-} "$src/ds4.c" "$model" "$out/ds4.c"
${CC:-gcc} $flags -D_GNU_SOURCE -std=c99 -DDS4_NO_GPU -w -c -o "$out/ds4.o" "$out/ds4.c"
${CC:-gcc} $flags -std=c99 -Wall -I"$out" -o "$out/ds4c_run" "$here/ds4c_run.c" "$out/ds4.o" -lm -pthread
echo "built $out/ds4c_run with: $flags"
