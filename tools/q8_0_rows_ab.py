#!/usr/bin/env python3
"""The Q8_0 decode kernels side by side, in one process: one row at a time (D.5, D.6) against rows in
lanes (D.7), with VNNI and with AVX2, as far as this CPU has them.

Every row is one (threads, shape) case at one token, on the wide model's Q8_0 shapes; each round times every
variant once, in turn, so that a noisy moment of the machine touches them all. Variants (the kernels
themselves, on the same weights and activation):

  vnni-1    q8_0_vnni_kernel        (one row at a time, four blocks per VNNI call)
  vnni-16   q8_0_rows_vnni_kernel   (16 rows per register)
  avx2-1    q8_0_avx2_kernel        (one row at a time, AVX2 byte dots)
  avx2-8    q8_0_rows_avx2_kernel   (8 rows per register)
  tiles     with --tiles: avx2-8's block step on a copy of the weight laid out in tiles, block b of
            rows 8t..8t+7 side by side (34-byte blocks moved, none changed), read front to back;
            an experiment of this script, not a package kernel (the package reads the GGUF's layout)

Each timing cycles through copies of the weight (--stream-mb) so that they stream from memory, as in a
decode step. Prints the best GB/s per variant and the median over rounds of the paired ratio
variant / the first variant; with --out, writes them as JSON with the date, commit and CPU (the file
that the numba Q8_0 matvec's per-CPU choice between the two AVX2 decode kernels cites). Not a test.

    python tools/q8_0_rows_ab.py                  # 2 and 1 threads, 5 rounds
    python tools/q8_0_rows_ab.py --out book/results/q8_0_rows_<cpu>.json
    python tools/q8_0_rows_ab.py --tiles --out book/results/q8_0_tiles_<cpu>.json
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernel_ab import (add_ab_args, paired_median, q8_0_cases, time_variants,  # noqa: E402
                       write_report)

# wide-model Q8_0 shapes [rows x n]: attn_output_b, attn_q_b, ffn_gate_shexp, ffn_down_shexp
SHAPES = ((4096, 8192), (32768, 1024), (2048, 4096), (4096, 2048))


def tile_layout(w: np.ndarray) -> np.ndarray:
    """Q8_0 rows uint8 [rows, 34 nb] (rows a multiple of 8) -> the same bytes in tiles:
    tile t holds block 0 of rows 8t..8t+7, then block 1 of those rows, and so on."""
    rows, row_bytes = w.shape
    tiles = w.reshape(rows // 8, 8, row_bytes // 34, 34).transpose(0, 2, 1, 3)
    return np.ascontiguousarray(tiles).reshape(rows, row_bytes)


def tiles_kernel():
    """A kernel (wt, xq, xd, xc, lut, out) for one token on tile_layout's copy: per tile
    and block, D.7's one-block step of 8 rows (rows 34 bytes apart), asking for the
    bytes two tiles on, front to back; the bits of q8_0_rows_avx2_kernel."""
    from numba import njit, prange
    from ds4ref.backends.numba.isa import prefetch
    from ds4ref.backends.numba.q8_0.rows import _rows_avx2_1 as step

    @njit(parallel=True)
    def q8_0_tiles_avx2_kernel(wt, xq, xd, xc, lut, out):
        nb, tile_bytes = wt.shape[1] // 34, 8 * wt.shape[1]
        x, c, d = xq.ctypes.data, xc.ctypes.data, xd.ctypes.data
        for tile in prange(wt.shape[0] // 8):
            acc = np.zeros(8, np.float32)
            base = wt.ctypes.data + tile * tile_bytes
            for b in range(nb):
                blk = base + 272 * b                 # 8 blocks of 34 bytes
                for line in range(5):                # the 272 bytes two tiles on
                    prefetch(blk + 2 * tile_bytes + 64 * line)
                step(blk + 2, 34, x + 32 * b, c + 4 * b, d + 4 * b, acc.ctypes.data)
            out[0, 8 * tile:8 * tile + 8] = acc
    return q8_0_tiles_avx2_kernel


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_ab_args(ap, threads="2,1", tokens="1")
    ap.add_argument("--out", help="write the rows as JSON to this path")
    ap.add_argument("--tiles", action="store_true",
                    help="add the tiles variant (AVX2, one token): the weight copied into tiles")
    args = ap.parse_args(argv)

    from ds4ref.backends.numba.isa import F16_TO_F32, host_simd, run_kernel
    from ds4ref.backends.numba.q8_0.portable import q8_0_kernel
    from ds4ref.backends.numba.q8_0.avx2 import q8_0_avx2_kernel
    from ds4ref.backends.numba.q8_0.rows import q8_0_rows_avx2_kernel, q8_0_rows_vnni_kernel
    from ds4ref.backends.numba.q8_0.vnni import q8_0_vnni_kernel

    have = host_simd()
    kernels = {}
    if "avx512vnni" in have:
        kernels |= {"vnni-1": q8_0_vnni_kernel, "vnni-16": q8_0_rows_vnni_kernel}
    if "avx2" in have:
        kernels |= {"avx2-1": q8_0_avx2_kernel, "avx2-8": q8_0_rows_avx2_kernel}
    if not kernels:
        sys.exit("this CPU (or NUMBA_CPU_NAME) has neither AVX2 nor AVX-512 VNNI: nothing to compare")
    if args.tiles:
        if "avx2" not in have or args.tokens != "1":
            sys.exit("--tiles: AVX2 and one token (--tokens 1) only")
        kernels["tiles"] = tiles_kernel()
    base = next(iter(kernels))

    def call(variant, w, a):
        xq, xd, xc = a
        out = np.empty((len(xq), w.shape[0]), np.float32)
        k = kernels[variant]
        if variant == "tiles":
            w = tiled[id(w)]
        if k is q8_0_avx2_kernel:
            run_kernel(k, w, xq, xd, F16_TO_F32, out, rows=w.shape[0])
        else:
            run_kernel(k, w, xq, xd, xc, F16_TO_F32, out, rows=w.shape[0])
        return out

    rng = np.random.default_rng(0)
    results = []
    for threads, rows, n, w, copies in q8_0_cases(args, rng, SHAPES):
        # each copy's tiles, made before any timing
        tiled = {id(c): tile_layout(c) for c in copies} if args.tiles else {}
        for T in [int(t) for t in args.tokens.split(",")]:
            xq = rng.integers(-127, 128, (T, n), dtype=np.int8)  # no -128: AVX2's domain
            xd = rng.uniform(0.001, 1, (T, n // 32)).astype(np.float32)
            xc = 128 * xq.reshape(T, -1, 32).sum(-1, dtype=np.int32)
            want = np.empty((T, rows), np.float32)
            run_kernel(q8_0_kernel, w, xq, xd, F16_TO_F32, want)

            def check(v, got):
                assert np.array_equal(got, want), (v, rows, n, T)
            times = time_variants(call, kernels, copies, (xq, xd, xc), args, check)
            gbs = "  ".join(f"{v} {w.nbytes / min(t) / 1e9:5.1f}" for v, t in times.items())
            rs = "  ".join(f"{v}/{base} {paired_median(times, v, base):.2f}"
                           for v in kernels if v != base)
            print(f"{threads}t  {rows:>5d}x{n:<5d} T={T}  GB/s: {gbs}   {rs}", flush=True)
            results.append({"threads": threads, "rows": rows, "n": n, "tokens": T,
                            "best_gb_per_s": {v: w.nbytes / min(t) / 1e9 for v, t in times.items()},
                            "seconds": times,
                            "paired_ratio_to": base,
                            "paired_ratio": {v: paired_median(times, v, base) for v in kernels}})
    print("\nbest GB/s of weights read per variant; ratio = median over rounds of the paired times, < 1: faster")
    if args.out:
        write_report(args.out, "tools/q8_0_rows_ab.py", args, results)


if __name__ == "__main__":
    main()
