#!/usr/bin/env python3
"""The IQ2_XXS gate/up pair kernels side by side, in one process: portable, AVX2 one-token, few-token, lanes.

Every row is one (threads, tokens) case on the wide model's routed-expert shape (gate and up
[n_ff_exp = 2048 rows x n_embd = 4096], one expert); each round times every variant of the row once, in
turn, so that a noisy moment of the machine touches them all. Variants (all through
`numba_matvec_iq2_xxs_pair_q8_K`, so the lanes rows include the activation repack):

  portable  iq2_xxs_pair_kernel (IQ2_XXS_SIMD and IQ2_XXS_LANES forced to None)
  one-tok   IQ2_XXS_SIMD (AVX2 byte dots, each row decoded again for every token) for every T
  tokens    IQ2_XXS_TOKENS (each row decoded once, then dotted with each token) for every T >= 2
  lanes     IQ2_XXS_LANES (each row decoded once, 8 or 16 tokens per vector) for every T
  own       the matvec's own choice (one-token for T = 1, few-token below IQ2_XXS_LANES_MIN_T, lanes)
  gather    with --gather: one-tok with each group's four grid rows loaded by one AVX2 gather
            (vpgatherdq) instead of four 64-bit loads and inserts; one token only; an experiment of
            this script, not a package kernel

Each timing cycles through copies of the weights (--stream-mb) so that they stream from memory, as in
a model. Prints min time per variant and the median over rounds of the paired ratio variant / portable
(and lanes / one-tok); with --out, writes the rows as JSON with the date, commit and CPU. Not a test.

    python tools/iq2_xxs_ab.py                              # T = 1, 16, 128; 2 and 1 threads
    python tools/iq2_xxs_ab.py --tokens 1,2,3,4,6,8,12 --no-portable
    python tools/iq2_xxs_ab.py --tokens 1 --no-portable --gather --out book/results/iq2_xxs_gather_<cpu>.json
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernel_ab import (add_ab_args, paired_median, random_rows, stream_copies,  # noqa: E402
                       time_variants, write_report)

ROWS, N = 2048, 4096  # ModelConfig.real(): n_ff_exp x n_embd of ffn_gate_exps / ffn_up_exps


def gather_kernel():
    """The one-token AVX2 pair kernel (appendix D.4) with one change: each group's four
    grid rows come from one vpgatherdq (llvm.x86.avx2.gather.d.q.256) at the group's four
    index bytes, not from four 64-bit loads inserted into a vector. Same bits."""
    import ds4ref.backends.numba.iq2_xxs.avx2 as av
    from llvmlite import ir
    from numba import njit, prange
    from ds4ref.backends.numba.isa import B32, f16_at, ir_fn
    i8, i32, i64 = ir.IntType(8), ir.IntType(32), ir.IntType(64)
    v4q, v4d = ir.VectorType(i64, 4), ir.VectorType(i32, 4)

    def group_grid(builder, w, grid, g):   # the 32 grid bytes of group g, one gather
        gather = ir_fn(builder, "llvm.x86.avx2.gather.d.q.256", v4q,
                       [v4q, i8.as_pointer(), v4d, v4q, i8])
        word = builder.load(builder.inttoptr(builder.add(w, ir.Constant(i64, 8 * g)),
                                             i32.as_pointer()), align=1)
        b = builder.bitcast(builder.insert_element(ir.Constant(v4d, None), word,
                                                   ir.Constant(i32, 0)),
                            ir.VectorType(i8, 16))
        idx = builder.zext(builder.shuffle_vector(b, b, ir.Constant(v4d, [0, 1, 2, 3])),
                           v4d)
        rows = builder.call(gather, [ir.Constant(v4q, [0] * 4),
                                     builder.inttoptr(grid, i8.as_pointer()), idx,
                                     ir.Constant(v4q, [-1] * 4), ir.Constant(i8, 8)])
        return builder.bitcast(rows, B32)

    block = av._iq2_xxs_pair_block_intrinsic(group_grid)  # D.4's, rows gathered

    @njit(inline="always")
    def row(wg, wu, r, yq, yd, ga, lut):        # av._iq2_xxs_pair_row_avx2, token 0
        gr, ur = wg.ctypes.data + r * wg.strides[0], wu.ctypes.data + r * wu.strides[0]
        acc_g, acc_u = np.float32(0.0), np.float32(0.0)
        for b in range(wg.shape[1] // 66):
            o = b * 66 + 2
            bsum_g, bsum_u = block(gr + o, ur + o, yq.ctypes.data + 256 * b, ga)
            acc_g += (f16_at(lut, wg, r, o - 2) * yd[0, b]) * np.float32(bsum_g)
            acc_u += (f16_at(lut, wu, r, o - 2) * yd[0, b]) * np.float32(bsum_u)
        return np.float32(0.125) * acc_g, np.float32(0.125) * acc_u

    @njit(parallel=True)
    def iq2_xxs_pair_gather_kernel(wg, wu, yq, yd, grid, lut, out_g, out_u):
        ga = grid.ctypes.data
        for r in prange(wg.shape[0]):
            out_g[0, r], out_u[0, r] = row(wg, wu, r, yq, yd, ga, lut)
    return iq2_xxs_pair_gather_kernel


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_ab_args(ap, threads="2,1", tokens="1,16,128")
    ap.add_argument("--no-portable", action="store_true", help="skip the (slow) portable kernel")
    ap.add_argument("--gather", action="store_true",
                    help="add the gather variant (one token): grid rows by vpgatherdq")
    ap.add_argument("--out", help="write the rows as JSON to this path")
    args = ap.parse_args(argv)

    import numba
    import ds4ref.backends.numba.iq2_xxs as nm
    from ds4ref.matvec import matvec_iq2_xxs_pair_q8_K
    from ds4ref.quant import Q8KAct

    if nm.IQ2_XXS_SIMD is None or nm.IQ2_XXS_LANES is None:
        sys.exit("this CPU (or NUMBA_CPU_NAME) has no AVX2: nothing to compare")
    own = (nm.IQ2_XXS_SIMD, nm.IQ2_XXS_LANES, nm.IQ2_XXS_LANES_MIN_T, nm.IQ2_XXS_TOKENS)
    variants = {"portable": (None, None, 1 << 30, None),
                "one-tok": (own[0], None, 1 << 30, None),
                "tokens": (own[0], None, 1 << 30, own[3]),
                "lanes": (own[0], own[1], 1, None), "own": own}
    if args.no_portable:
        del variants["portable"]
    if args.gather:
        if args.tokens != "1":
            sys.exit("--gather: one token only (--tokens 1)")
        variants["gather"] = (gather_kernel(), None, 1 << 30, None)
    base = next(iter(variants))
    lanes_kernel = own[1][0].__name__
    print(f"lanes kernel: {lanes_kernel} ({own[1][1]} tokens per vector), "
          f"IQ2_XXS_LANES_MIN_T = {own[2]}")

    def call(variant, w, a):
        (nm.IQ2_XXS_SIMD, nm.IQ2_XXS_LANES, nm.IQ2_XXS_LANES_MIN_T,
         nm.IQ2_XXS_TOKENS) = variants[variant]
        return nm.numba_matvec_iq2_xxs_pair_q8_K(w[0], w[1], a)

    rng = np.random.default_rng(0)
    results = []
    w = (random_rows(rng, ROWS, N, 256, 66), random_rows(rng, ROWS, N, 256, 66))
    copies = stream_copies(w, args.stream_mb)
    try:
        for threads in [int(t) for t in args.threads.split(",")]:
            numba.set_num_threads(threads)
            for T in [int(t) for t in args.tokens.split(",")]:
                qs = rng.integers(-127, 128, (T, N), dtype=np.int8)
                a = Q8KAct(qs, rng.uniform(0.001, 1, (T, N // 256)).astype(np.float32),
                           qs.reshape(T, -1, 16).astype(np.int32).sum(-1).astype(np.int16))
                want = matvec_iq2_xxs_pair_q8_K(w[0], w[1], a) if T <= 16 else None
                def check(v, got):
                    if want is not None:
                        assert all(np.array_equal(g, e) for g, e in zip(got, want)), (v, T)
                times = time_variants(call, variants, copies, a, args, check)
                ratios = {f"{v}/{base}": paired_median(times, v, base)
                          for v in variants if v != base}
                if base != "one-tok":
                    ratios["lanes/one-tok"] = paired_median(times, "lanes", "one-tok")
                best = {v: min(t) for v, t in times.items()}
                ms = "  ".join(f"{v} {t * 1e3:9.3f}" for v, t in best.items())
                rs = "  ".join(f"{k} {r:.3f}" for k, r in ratios.items())
                print(f"{threads}t  T={T:<4d} ms: {ms}   {rs}", flush=True)
                nbytes = 2 * w[0].nbytes              # the gate and the up rows
                results.append({"threads": threads, "tokens": T, "rows": ROWS, "n": N,
                                "best_gb_per_s": {v: nbytes / t / 1e9 for v, t in best.items()},
                                "seconds": times, "paired_ratio": ratios})
    finally:
        nm.IQ2_XXS_SIMD, nm.IQ2_XXS_LANES, nm.IQ2_XXS_LANES_MIN_T, nm.IQ2_XXS_TOKENS = own
    print("\nmin ms per call; ratio = median over rounds of (variant / reference), < 1: faster")
    if args.out:
        write_report(args.out, "tools/iq2_xxs_ab.py", args, results)


if __name__ == "__main__":
    main()
