#!/usr/bin/env python3
"""The portable Q8_0 matvec kernel against the AVX2 ones (appendix D.6), side by side, in one process.

Every row is one (threads, shape, tokens) case; each round times every variant of the row once, in
turn, so that a noisy moment of the machine touches them all. Variants (all through
`numba_matvec_q8_0_prequant`, so the AVX2 rows include the -128 check and the activation repack):

  portable  q8_0_kernel (Q8_0_AVX2 forced to None)
  one-tok   the few-token path for every T: D.7's q8_0_rows_avx2_kernel (8 rows per register;
            tools/q8_0_rows_ab.py compares it with q8_0_avx2_kernel, one row at a time)
  lanes     q8_0_avx2_lanes_kernel for every T

Each timing cycles through copies of the weight (--stream-mb) so that they stream from memory.
Prints min time per variant and the median over rounds of the paired ratio variant / portable.
Not a test and writes no file.

    python tools/q8_0_avx2_ab.py                          # T = 1, 4, 8, 16, 128; 1 and 2 threads
    python tools/q8_0_avx2_ab.py --tokens 1,2,3 --threads 2 --rounds 7
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernel_ab import add_ab_args, q8_0_against_portable  # noqa: E402

# wide-model Q8_0 shapes [rows x n]
SHAPES = ((4096, 4096), (1024, 4096))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_ab_args(ap, threads="1,2", tokens="1,4,8,16,128")
    args = ap.parse_args(argv)

    import ds4ref.backends.numba.q8_0 as nm
    import ds4ref.backends.numba.q8_0.avx2 as qa

    kernels = qa.simd_kernels(qa.Q8_0_AVX2_BYTE_DOT)
    if not kernels:
        sys.exit("this CPU (or NUMBA_CPU_NAME) has no AVX2: nothing to compare")
    if nm.Q8_0_SIMD is not None:
        print("note: this CPU has AVX-512 VNNI; the VNNI kernels are switched off here")
    nm.Q8_0_SIMD = None
    own = (nm.Q8_0_AVX2, nm.Q8_0_AVX2_LANES_MIN_T)
    variants = {"portable": (None, 1), "one-tok": (kernels[0], 1 << 30), "lanes": (kernels[0], 1)}

    def call(variant, w, a):
        nm.Q8_0_AVX2, nm.Q8_0_AVX2_LANES_MIN_T = variants[variant]
        return nm.numba_matvec_q8_0_prequant(w, a)

    try:
        q8_0_against_portable(args, np.random.default_rng(0), SHAPES, call, variants, low=-127)
    finally:
        nm.Q8_0_AVX2, nm.Q8_0_AVX2_LANES_MIN_T = own


if __name__ == "__main__":
    main()
