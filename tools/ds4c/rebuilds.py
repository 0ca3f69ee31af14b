"""ds4.c against itself: rebuild it with other compiler flags and measure how far each build lands from
the golden files. This is the yardstick for ds4ref's end-to-end agreement (chapter 08).

For each variant the script builds ds4.c (tools/ds4c/build.sh: the tiny shape, the expert-choice log),
replays cases A and C of data/oracle on both of ds4.c's paths through its public API (ds4c_run), and
stores, per golden row, the agreement (corr, mean |d|, max |d|) with the golden logits, plus the
experts that build chose in the top-k layers. The first variant is ds4.c's own Makefile flags: it
must reproduce the golden files bit for bit, which checks the harness.

    python tools/ds4c/rebuilds.py --ds4 PATH/TO/ds4-checkout [--work DIR]
writes data/oracle/rebuilds.npz and data/oracle/rebuilds.json.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
from pathlib import Path

import numpy as np

from ds4ref.engine import logit_agreement

ROOT = Path(__file__).resolve().parents[2]
ORACLE = ROOT / "data" / "oracle"
FAST = "-ffast-math -fno-finite-math-only"
VARIANTS = {   # name -> compiler flags; "golden" is ds4.c's Makefile (CPU object) at commit 8d57664
    "golden": f"-O3 {FAST} -march=native",
    "strict": "-O2 -march=native",                         # no fast-math: the C source's own float order
    "O2-fast": f"-O2 {FAST} -march=native",
    "avx2": f"-O3 {FAST} -march=x86-64-v3",
    "sse2": f"-O3 {FAST} -march=x86-64",
    "no-vec": f"-O3 {FAST} -march=native -fno-tree-vectorize",
    "avx512-w512": f"-O3 {FAST} -march=x86-64-v4 -mprefer-vector-width=512",
}
PATHS = {"stream": ("stream_greedy_tokens", "stream_pos_logits", "stream_step_logits"),
         "batch": ("greedy_tokens", "prompt_logits", "step_logits")}


def golden_rows(g, path: str) -> np.ndarray:
    _, first, steps = PATHS[path]
    head = g[first] if g[first].ndim == 2 else g[first][None]
    return np.concatenate([head, g[steps]])


def expert_rows(log: np.ndarray, path: str, n_prompt: int, n_steps: int) -> np.ndarray:
    """The logged choices in the golden traces' layout [P+S, 3, 6]. Stream: position-major. Batch: the
    prefill is layer-major (layer 3 for every prompt token, then 4, then 5), then decode steps."""
    ids = log.reshape(-1, 6)
    if path == "stream":
        return ids.reshape(n_prompt + n_steps, 3, 6)
    pre = ids[: 3 * n_prompt].reshape(3, n_prompt, 6).transpose(1, 0, 2)
    return np.concatenate([pre, ids[3 * n_prompt:].reshape(n_steps, 3, 6)])


def run_variant(name: str, flags: str, ds4: Path, work: Path, model: Path) -> dict:
    d = work / name
    subprocess.run([str(ROOT / "tools/ds4c/build.sh"), str(ds4), str(model), str(d), *flags.split()],
                   check=True, capture_output=True)
    out = {}
    for case in "AC":
        g = np.load(ORACLE / f"golden_{case}.npz")
        n_prompt = len(g["prompt_ids"])
        (d / "ids.bin").write_bytes(g["prompt_ids"].astype("<i4").tobytes())
        for path, (steps_key, _, _) in PATHS.items():
            steps = g[steps_key]
            (d / "steps.bin").write_bytes(steps.astype("<i4").tobytes())
            log = d / f"{case}_{path}.experts"
            log.unlink(missing_ok=True)
            subprocess.run([str(d / "ds4c_run"), str(model), path, str(d / "ids.bin"), str(d / "steps.bin"),
                            str(d / "logits.bin")], check=True, capture_output=True,
                           env=dict(os.environ, DS4C_EXPERT_LOG=str(log), DS4C_THREADS="1"))
            ref = golden_rows(g, path)
            ours = np.fromfile(d / "logits.bin", np.float32).reshape(len(ref), -1)
            m = logit_agreement(ours, ref)
            key = f"{case}.{path}.{name}"
            out.update({f"{key}.{k}": np.asarray(v, np.float32) for k, v in m.items()})
            out[f"{key}.bit_exact_rows"] = np.asarray((ours == ref).all(-1))
            out[f"{key}.expert_ids"] = expert_rows(np.fromfile(log, np.int32), path, n_prompt, len(steps)).astype(np.int8)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ds4", type=Path, required=True, help="a checkout of antirez/ds4 at commit 8d57664")
    ap.add_argument("--work", type=Path, default=Path("/tmp/ds4c-rebuilds"))
    ap.add_argument("--only", nargs="*", help="variant names (default: all)")
    ap.add_argument("--out", type=Path, default=ORACLE / "rebuilds.npz",
                    help="where to write (the .json goes next to it); use another path with --only")
    args = ap.parse_args()
    model = ORACLE / "dev_seed1.gguf"
    data = {}
    for name, flags in VARIANTS.items():
        if args.only and name not in args.only:
            continue
        print(f"{name:12s} {flags}", flush=True)
        data.update(run_variant(name, flags, args.ds4, args.work, model))
    np.savez_compressed(args.out, **data)
    cc = subprocess.run([os.environ.get("CC", "gcc"), "--version"], capture_output=True, text=True).stdout.splitlines()[0]
    cpu = next((l.split(":", 1)[1].strip() for l in Path("/proc/cpuinfo").read_text().splitlines()
                if l.startswith("model name")), platform.processor())
    meta = {"ds4_commit": "8d576642c39b9a2d782a80159ba84ef5a81c0b81", "compiler": cc, "cpu": cpu,
            "variants": {k: v for k, v in VARIANTS.items() if not args.only or k in args.only},
            "how": "tools/ds4c/rebuilds.py: build.sh (shape_patch.py + ds4c_run.c), 1 thread, ctx 1024",
            "keys": "{case}.{path}.{variant}.{corr,mean_abs,max_abs,bit_exact_rows,expert_ids}; rows as the "
                    "golden arrays: stream = stream_pos_logits then stream_step_logits; batch = prompt_logits "
                    "then step_logits; expert_ids [rows, 3 top-k layers, 6] in ds4's order"}
    args.out.with_suffix(".json").write_text(json.dumps(meta, indent=1) + "\n")
    print("wrote", args.out, "and", args.out.with_suffix(".json"))


if __name__ == "__main__":
    main()
