"""Shared parts of the kernel A/B scripts (tools/q8_0_ab.py, tools/q8_0_avx2_ab.py,
tools/q8_0_rows_ab.py, tools/iq2_xxs_ab.py): random weight rows, the common flags, the
interleaved timing of a row's variants, and the JSON report of --out. Not a test."""
from __future__ import annotations

import statistics
import time

import numpy as np


def random_rows(rng, rows: int, n: int, block_values: int, block_bytes: int) -> np.ndarray:
    """Random rows of a format whose blocks start with an f16 scale (Q8_0: 32 values in
    34 bytes; IQ2_XXS: 256 in 66): uint8 [rows, n/block_values * block_bytes], finite
    scales."""
    raw = rng.integers(0, 256, (rows, n // block_values * block_bytes), dtype=np.uint8)
    blocks = raw.reshape(rows, -1, block_bytes)
    scales = rng.uniform(-0.02, 0.02, blocks.shape[:2] + (1,)).astype(np.float16)
    blocks[..., :2] = scales.view(np.uint8)
    return raw


def add_ab_args(ap, threads: str, tokens: str) -> None:
    """The flags every A/B script takes."""
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", default=threads)
    ap.add_argument("--tokens", default=tokens)
    ap.add_argument("--min-seconds", type=float, default=0.05,
                    help="per timing (repeats the call)")
    ap.add_argument("--stream-mb", type=float, default=256,
                    help="copies of the weights, used in turn, of this many MB in all, so "
                         "that they come from memory as in a model's decode, not from the "
                         "L3 cache")


def stream_copies(w, mb: float) -> list:
    """w (an array or a tuple of arrays) and enough copies of it to fill `mb` MB."""
    parts = w if isinstance(w, tuple) else (w,)
    n = int(mb * 2**20 // sum(p.nbytes for p in parts))
    copies = [tuple(p.copy() for p in parts) for _ in range(n)]
    return [w] + [c if isinstance(w, tuple) else c[0] for c in copies]


def q8_0_cases(args, rng, shapes):
    """(threads, rows, n, w, copies) for every thread count of args.threads and Q8_0 shape
    [rows x n]: numba set to that many threads, random rows w and their copies to stream."""
    import numba
    for threads in [int(t) for t in args.threads.split(",")]:
        numba.set_num_threads(threads)
        for rows, n in shapes:
            w = random_rows(rng, rows, n, 32, 34)
            yield threads, rows, n, w, stream_copies(w, args.stream_mb)


def q8_0_against_portable(args, rng, shapes, call, variants, low: int):
    """Time the Q8_0 variants of a script (one named "portable") on every case of q8_0_cases
    and token count of args.tokens, activation codes from `low` to 127, each result checked
    against the numpy reference; print a row per case: best ms per variant and the paired
    ratios variant / portable."""
    from ds4ref.matvec import matvec_q8_0_prequant
    from ds4ref.quant import Q8Act
    for threads, rows, n, w, copies in q8_0_cases(args, rng, shapes):
        for T in [int(t) for t in args.tokens.split(",")]:
            a = Q8Act(rng.integers(low, 128, (T, n), dtype=np.int8),
                      rng.uniform(0.001, 1, (T, n // 32)).astype(np.float32))
            want = matvec_q8_0_prequant(w, a) if T * rows * n <= 1 << 31 else None

            def check(v, got):
                assert want is None or np.array_equal(got, want), (v, rows, n, T)
            times = time_variants(call, variants, copies, a, args, check)
            ms = "  ".join(f"{v} {min(t) * 1e3:8.3f} ms" for v, t in times.items())
            rs = "  ".join(f"{v}/portable {paired_median(times, v, 'portable'):.2f}"
                           for v in variants if v != "portable")
            print(f"{threads}t  {rows:>4d}x{n:<4d}  T={T:<4d} {ms}   {rs}", flush=True)
    print("\nmin ms per call; ratio = median over rounds of (variant / portable), < 1: faster")


def time_variants(call, variants, copies, a, args, check) -> dict:
    """{variant: [seconds per call, one per round]}: each variant called once to compile
    and checked (check(variant, result)), its repeats sized to args.min_seconds, then
    args.rounds rounds that time every variant in turn on the weight copies."""
    reps = {}
    for v in variants:
        check(v, call(v, copies[0], a))
        t0 = time.perf_counter()
        call(v, copies[0], a)
        reps[v] = max(1, int(args.min_seconds / max(time.perf_counter() - t0, 1e-6)))
    times = {v: [] for v in variants}
    for _ in range(args.rounds):
        for v in variants:
            t0 = time.perf_counter()
            for i in range(reps[v]):
                call(v, copies[i % len(copies)], a)
            times[v].append((time.perf_counter() - t0) / reps[v])
    return times


def paired_median(times: dict, v: str, base: str) -> float:
    """The median over rounds of times[v] / times[base]."""
    return statistics.median(t / p for t, p in zip(times[v], times[base]))


def write_report(out: str, tool: str, args, results: list) -> None:
    """Write an A/B script's rows as JSON to `out`, with the date, commit and CPU of the
    run, the script's name and its rounds and streamed megabytes."""
    import json
    from pathlib import Path
    from ds4ref.dev.bench import machine
    from ds4ref.dev.bench_timing import run_stamp
    report = {**run_stamp(), "tool": tool, "machine": machine(), "rounds": args.rounds,
              "stream_mb": args.stream_mb, "results": results}
    Path(out).write_text(json.dumps(report, indent=1) + "\n")
    print("wrote", out)
