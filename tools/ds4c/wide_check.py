"""ds4ref against ds4.c at the real widths: the benchmark's "wide" model (4096 wide, 64 heads of 512, 256
experts, q/o-LoRA 1024, 8 output groups; 2 dense hash-routed layers, vocab 1024), where ds4.c runs with
no literal edits at all. The shared oracle only covers the tiny shape.

Replays a 32-token prompt and 8 greedy steps (ds4's own) on both of ds4.c's paths with the Makefile build,
and the same tokens through ds4ref's numpy reference; with --strict, also through a no-fast-math rebuild,
the yardstick of chapter 08. Writes book/results/wide_agreement.json, which chapter 09 shows.

    tools/ds4c/build.sh DS4 WIDE.gguf /tmp/ds4-wide                    (and with -O2 -march=native for --strict)
    python tools/ds4c/wide_check.py --build /tmp/ds4-wide [--strict /tmp/ds4-wide-strict] [--cache-dir DIR]
"""
from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ds4c_io import run  # noqa: E402

from ds4ref.dev.bench_engine import wide_model_path  # noqa: E402
from ds4ref.engine import Engine  # noqa: E402
from ds4ref.dev.oracle import logit_agreement, replay_golden

ROOT = Path(__file__).resolve().parents[2]
N_PROMPT, N_STEPS = 32, 8


def ds4ref_rows(eng: Engine, path: str, prompt: list[int], steps: np.ndarray) -> np.ndarray:
    """ds4ref's logit rows for ds4.c's replay of `path`: replay_golden with the prompt and ds4's steps."""
    run = replay_golden(eng, {"prompt_ids": prompt, "greedy_tokens": steps, "stream_greedy_tokens": steps}, path)
    first = run["pos_logits"] if path == "stream" else run["prompt_logits"][None]
    return np.concatenate([first, run["step_logits"]])


def summary(ours: np.ndarray, ref: np.ndarray) -> dict:
    m = logit_agreement(ours, ref)
    return {"corr": m["corr"].tolist(), "mean_abs": m["mean_abs"].tolist(), "max_abs": m["max_abs"].tolist(),
            "argmax_equal": (np.argmax(ours, 1) == np.argmax(ref, 1)).tolist()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build", type=Path, required=True, help="build.sh OUTDIR for the wide model (Makefile flags)")
    ap.add_argument("--strict", type=Path, default=None, help="build.sh OUTDIR with -O2 -march=native")
    ap.add_argument("--cache-dir", default=None)
    ap.add_argument("--out", type=Path, default=ROOT / "book/results/wide_agreement.json")
    args = ap.parse_args()
    model = wide_model_path(args.cache_dir)
    rnd = random.Random(4242)
    prompt = [0] + [rnd.randrange(2, 1024) for _ in range(N_PROMPT - 1)]
    eng = Engine.open(model, backend="numpy")          # the reference: the json labels it "ds4ref (numpy)"
    res = {"model": model.name, "prompt": prompt, "n_layer": eng.cfg.n_layer, "n_embd": eng.cfg.n_embd,
           "n_head": eng.cfg.n_head, "n_expert": eng.cfg.n_expert, "paths": {}}
    work = Path("/tmp/ds4c-wide-check")
    for path in ("stream", "batch"):
        ref, steps, _ = run(args.build, model, path, prompt, N_STEPS, work / path)   # ds4's own greedy steps
        entry = {"steps": steps.tolist(), "ds4ref": summary(ds4ref_rows(eng, path, prompt, steps), ref)}
        if args.strict is not None:
            strict, _, _ = run(args.strict, model, path, prompt, steps, work / (path + "-strict"))
            entry["ds4c_strict"] = summary(strict, ref)
        res["paths"][path] = entry
        for who in ("ds4ref", "ds4c_strict"):
            if who in entry:
                e = entry[who]
                print(f"{path:6s} {who:12s} min corr {min(e['corr']):.6f}  worst mean|d| {max(e['mean_abs']):.4f}  "
                      f"worst max|d| {max(e['max_abs']):.4f}  argmax equal {sum(e['argmax_equal'])}/{len(e['corr'])}")
    args.out.write_text(json.dumps(res, indent=1) + "\n")
    print("wrote", args.out)


if __name__ == "__main__":
    main()
