#!/usr/bin/env python3
"""The portable Q8_0 matvec kernel against the AVX-512 VNNI ones, side by side, in one process.

Every row is one (threads, shape, tokens) case; each round times every variant of the row once, in
turn, so that a noisy moment of the machine touches them all. Variants (all through
`numba_matvec_q8_0_prequant`, so the VNNI rows include the activation repack and sums):

  portable  q8_0_kernel (Q8_0_SIMD forced to None)
  vnni      the matvec's own choice (Q8_0_LANES_MIN_T decides few-token vs lanes kernel)
  one-tok   the few-token path for every T: D.7's q8_0_rows_vnni_kernel   (with --all-variants;
            tools/q8_0_rows_ab.py compares it with q8_0_vnni_kernel, one row at a time)
  lanes     q8_0_vnni_lanes_kernel for every T       (with --all-variants)

Each timing cycles through copies of the weight (--stream-mb) so that they stream from memory.
Prints min time per variant and the median over rounds of the paired ratio variant / portable.
Not a test and writes no file.

    python tools/q8_0_ab.py                       # T = 1, 128; 2 and 1 threads; 5 rounds
    python tools/q8_0_ab.py --tokens 1,2,3,4,8,128 --all-variants
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
SHAPES = ((4096, 4096), (1024, 4096), (4096, 1024))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_ab_args(ap, threads="2,1", tokens="1,128")
    ap.add_argument("--all-variants", action="store_true")
    args = ap.parse_args(argv)

    import ds4ref.backends.numba.q8_0 as nm

    if nm.Q8_0_SIMD is None:
        sys.exit("this CPU (or NUMBA_CPU_NAME) has no AVX-512 VNNI: nothing to compare")
    own_min_t = nm.Q8_0_LANES_MIN_T
    variants = {"portable": (None, own_min_t), "vnni": (nm.Q8_0_SIMD, own_min_t)}
    if args.all_variants:
        variants.update({"one-tok": (nm.Q8_0_SIMD, 1 << 30), "lanes": (nm.Q8_0_SIMD, 1)})

    def call(variant, w, a):
        nm.Q8_0_SIMD, nm.Q8_0_LANES_MIN_T = variants[variant]
        return nm.numba_matvec_q8_0_prequant(w, a)

    try:
        q8_0_against_portable(args, np.random.default_rng(0), SHAPES, call, variants, low=-128)
    finally:
        nm.Q8_0_SIMD, nm.Q8_0_LANES_MIN_T = variants["vnni"]


if __name__ == "__main__":
    main()
