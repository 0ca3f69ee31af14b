#!/usr/bin/env python3
"""numba's OpenMP and workqueue threading layers, side by side, on the same model.

The threading layer is fixed per process at its first parallel kernel, so every row is a fresh
process (`--child`). Rounds interleave the rows (omp 2t, workqueue 2t, omp 1t, workqueue 1t, ...) so
that a noisy moment of the machine touches all of them; the result keeps min / median / max per row
and the paired ratio omp / workqueue of each round.

    python tools/threading_ab.py                      # the wide model, 5 rounds, 2 and 1 threads
    python tools/threading_ab.py --rounds 3 --steps 8 --out book/results/threading.json

Appendix D's `choose_threading_layer` takes OpenMP where it loads; appendix E plots this file.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROMPT = [0, 511, 574, 370, 228, 17, 42, 99, 7, 300, 301, 302, 303, 304, 305, 306]


def child(model: str, steps: int) -> None:
    from numba import config
    from ds4ref.dev.bench_engine import bench_backend
    r = bench_backend(model, "numba", PROMPT, steps, 256)
    r.pop("profile", None)
    r["threading_layer"] = config.THREADING_LAYER
    print(json.dumps(r))


def run_row(model: str, layer: str, threads: int, steps: int) -> dict:
    env = dict(os.environ, NUMBA_THREADING_LAYER=layer, NUMBA_NUM_THREADS=str(threads))
    out = subprocess.run([sys.executable, __file__, "--child", "--model", model, "--steps", str(steps)],
                         env=env, capture_output=True, text=True, cwd=ROOT, check=True)
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["threading_layer"] == layer, r
    return r


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="default: the wide model (written on first use)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--threads", default="2,1")
    ap.add_argument("--out", default=str(ROOT / "book/results/threading.json"))
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        child(args.model, args.steps)
        return {}
    from ds4ref.backends import machine_description
    from ds4ref.dev.bench_engine import wide_model_path
    from ds4ref.dev.bench_timing import run_stamp, summarize_rounds
    model = args.model or str(wide_model_path())
    threads = [int(t) for t in args.threads.split(",")]
    rows: dict[str, list] = {}
    rounds = []
    for _ in range(args.rounds):
        this = {}
        for t in threads:
            for layer in ("omp", "workqueue"):
                r = run_row(model, layer, t, args.steps)
                rows.setdefault(f"{layer} {t}t", []).append(r)
                this[f"{layer} {t}t"] = r
        rounds.append(this)
    # each row over the rounds as the engine bench keeps its rows: the median round, plus
    # min / median / max and every round's value of decode and prefill tok/s
    table = {label: summarize_rounds(rs) for label, rs in rows.items()}
    ratios = {}
    for t in threads:
        for what in ("decode_tok_s", "prefill_tok_s"):
            rr = sorted(rd[f"omp {t}t"][what] / rd[f"workqueue {t}t"][what] for rd in rounds)
            ratios[f"omp/workqueue {what} {t}t"] = {"min": rr[0], "median": statistics.median(rr),
                                                    "max": rr[-1]}
    print(f"{'row':16s} {'decode tok/s (min / median / max)':>36s} {'prefill tok/s median':>22s}")
    for label, v in table.items():
        print(f"{label:16s} {v['decode_tok_s_min']:10.2f} {v['decode_tok_s_median']:10.2f} "
              f"{v['decode_tok_s_max']:10.2f} {v['prefill_tok_s_median']:18.2f}")
    for k, v in ratios.items():
        print(f"{k:34s} median {v['median']:.2f} (min {v['min']:.2f}, max {v['max']:.2f})")
    res = {**run_stamp(), "machine": machine_description(), "model": Path(model).name,
           "rounds": args.rounds, "steps": args.steps, "prompt_tokens": len(PROMPT),
           "rows": table, "paired_ratios": ratios}
    Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
    print("wrote", args.out)
    return res


if __name__ == "__main__":
    main()
