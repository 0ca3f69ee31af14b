#!/usr/bin/env python3
"""Which autograd framework trains fastest on this CPU: matrix-product speed of the two shapes a
training step of the tiny model is made of, for numpy (no autograd, the yardstick), PyTorch
float32 and bfloat16, and MLX float32. Prints a table and writes book/results/train_frameworks.json.

    .venv/bin/python tools/train_frameworks.py [--threads 1] [--repeats 7]

Appendix B reads the file. Run it on a quiet machine: the best of `repeats` runs is kept.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

BMM = (64, 256, 256)          # attention: 8 sequences x 8 heads of 256x256 products
MM = (2048, 256, 256)         # projections: 2048 tokens x [256 -> 256]


def best(f, repeats: int) -> float:
    f()
    ts = []
    for _ in range(repeats):
        t = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t)
    return min(ts)


def gflops(shape_flops: float, seconds: float) -> float:
    return round(shape_flops / seconds / 1e9, 1)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=7)
    a = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", str(a.threads))
    b, n, _ = BMM
    f_bmm = 2.0 * b * n ** 3
    m, k, o = MM
    f_mm = 2.0 * m * k * o
    rows = []
    rng = np.random.default_rng(0)
    A, B = rng.standard_normal(BMM, np.float32), rng.standard_normal(BMM, np.float32)
    X, W = rng.standard_normal((m, k), np.float32), rng.standard_normal((k, o), np.float32)
    rows.append(dict(framework="numpy float32 (no autograd)",
                     bmm_gflops=gflops(f_bmm, best(lambda: A @ B, a.repeats)),
                     mm_gflops=gflops(f_mm, best(lambda: X @ W, a.repeats))))
    import torch
    torch.set_num_threads(a.threads)
    for dt, name in ((torch.float32, "torch float32"), (torch.bfloat16, "torch bfloat16")):
        tA, tB = torch.from_numpy(A).to(dt), torch.from_numpy(B).to(dt)
        tX, tW = torch.from_numpy(X).to(dt), torch.from_numpy(W).to(dt)
        rows.append(dict(framework=f"{name} {torch.__version__}",
                         bmm_gflops=gflops(f_bmm, best(lambda: tA @ tB, a.repeats)),
                         mm_gflops=gflops(f_mm, best(lambda: tX @ tW, a.repeats))))
    try:
        import mlx.core as mx
        mA, mB, mX, mW = (mx.array(v) for v in (A, B, X, W))
        rows.append(dict(framework=f"mlx float32 {mx.__version__} (cpu)",
                         bmm_gflops=gflops(f_bmm, best(lambda: mx.eval(mA @ mB), a.repeats)),
                         mm_gflops=gflops(f_mm, best(lambda: mx.eval(mX @ mW), a.repeats))))
    except ImportError:
        pass
    from ds4ref.dev.bench_timing import run_stamp
    from ds4ref.train.ship import machine
    out = dict(**run_stamp(), machine=machine(), load_average=os.getloadavg(),
               threads=a.threads, repeats=a.repeats,
               shapes=dict(bmm=BMM, mm=MM), rows=rows)
    for r in rows:
        print(f"{r['framework']:34s} bmm {r['bmm_gflops']:7.1f}  mm {r['mm_gflops']:7.1f} GFLOP/s")
    path = ROOT / "book" / "results" / "train_frameworks.json"
    path.write_text(json.dumps(out, indent=1) + "\n")
    print("wrote", path.relative_to(ROOT))
    return 0


if __name__ == "__main__":
    sys.exit(main())
