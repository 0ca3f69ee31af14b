"""Time the engine of two checkouts side by side, in interleaved rounds.

    tools/engine_ab.py --tree before=/path/to/checkout-A --tree after=/path/to/checkout-B \
        --rounds 5 --out book/results/NAME

Each round runs `python -m ds4ref.dev.bench engine --backends numba --models wide` once in
each checkout (its own package, its own numba cache), in the same order, so that a slow
minute of a shared machine falls on both. Writes NAME_<label>.json per checkout: the
checkout's commit, the machine, every round's rows and each row's min / median / max; the
last file also holds the per-round ratios (this checkout / the first). Prints the table.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

KEYS = ("prefill_tok_s", "decode_tok_s")


def commit_of(tree: Path) -> str:
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=tree,
                          capture_output=True, text=True).stdout.strip()


def one_round(tree: Path, python: str, bench_args: list[str]) -> dict:
    """One `bench engine` run in `tree`: {row label: row}, and the run's header."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "r.json"
        env = {**os.environ, "PYTHONPATH": str(tree)}
        subprocess.run([python, "-m", "ds4ref.dev.bench", "engine", *bench_args,
                        "--out", str(out)], cwd=tree, env=env, check=True)
        res = json.loads(out.read_text())
    rows = {r.get("label", r["backend"]): r for r in res["models"]["wide"]["runs"]}
    return {"rows": rows, "header": {k: res[k] for k in ("date", "machine",
                                                          "read_bandwidth", "prompt")}}


def spread(values: list[float]) -> dict:
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tree", action="append", required=True, help="LABEL=PATH")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", required=True, help="path prefix of the result files")
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--prompt-len", default="128")
    ap.add_argument("--steps", default="16")
    ap.add_argument("--numba-threads", default="all,1")
    args = ap.parse_args(argv)
    trees = [(s.split("=", 1)[0], Path(s.split("=", 1)[1]).resolve()) for s in args.tree]
    bench_args = ["--backends", "numba", "--models", "wide", "--prompt-len",
                  args.prompt_len, "--steps", args.steps, "--numba-threads",
                  args.numba_threads]
    rounds = {label: [] for label, _ in trees}
    for k in range(args.rounds):
        for label, tree in trees:
            print(f"round {k + 1} of {args.rounds}: {label} ({tree})", flush=True)
            rounds[label].append(one_round(tree, args.python, bench_args))
    first = trees[0][0]
    rows = list(rounds[first][0]["rows"])
    print(f"\n{'checkout':10s} {'row':9s} {'prefill tok/s min/med/max':>28s} "
          f"{'decode tok/s min/med/max':>28s}")
    for label, tree in trees:
        res = {"tool": "tools/engine_ab.py", "checkout": label, "tree_commit":
               commit_of(tree), "bench_args": bench_args, "rounds": args.rounds,
               "order": [lbl for lbl, _ in trees],
               "machine": rounds[label][0]["header"]["machine"],
               "dates": [r["header"]["date"] for r in rounds[label]],
               "read_bandwidth": [r["header"]["read_bandwidth"] for r in rounds[label]],
               "rows": {}}
        for row in rows:
            got = [r["rows"][row] for r in rounds[label]]
            res["rows"][row] = {key: spread([g[key] for g in got]) for key in KEYS}
            res["rows"][row]["per_round"] = [{key: g[key] for key in KEYS}
                                             for g in got]
            cells = "  ".join(" / ".join(f"{v:7.2f}" for v in res["rows"][row][key]
                                         .values()) for key in KEYS)
            print(f"{label:10s} {row:9s} {cells}")
        if label != first:
            res["ratio_to"] = first
            res["ratios"] = {row: {key: spread([
                a["rows"][row][key] / b["rows"][row][key]
                for a, b in zip(rounds[label], rounds[first])]) for key in KEYS}
                for row in rows}
            for row, r in res["ratios"].items():
                print(f"{label}/{first} {row:9s} " + "  ".join(
                    f"{key.split('_')[0]} " + " / ".join(f"{v:.3f}" for v in
                                                         r[key].values())
                    for key in KEYS))
        out = Path(f"{args.out}_{label}.json")
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(res, indent=1))
        print("wrote", out)


if __name__ == "__main__":
    main()
