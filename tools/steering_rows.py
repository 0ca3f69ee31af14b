"""Record ds4ref's steered replays against ds4.c (chapter 10.3 reads the result).

For each of ds4.c's three recorded steering settings (data/oracle/ds4c_steering.npz: none;
FFN 1; FFN -2 with attention 0.5), the numpy reference opens the tiny model with ds4.c's
direction file and scales, replays the batch path (the prompt, then ds4.c's 8 greedy tokens
fed) and keeps its logit rows: `{case}.batch.rows`, float32 [9, n_vocab], with the machine and
commit in a JSON beside it. The digits are this machine's (rounding chaos moves them with the
BLAS kernel); tests/test_beyond.py replays the same runs and holds both the fresh rows and
these to the steering rebuild yardstick.

    .venv/bin/python tools/steering_rows.py [--out book/results/steering_ds4ref.npz]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from oracle_rows import write_record  # noqa: E402 (tools/: the recorders share it)

ORACLE = ROOT / "data" / "oracle"
CASES = ("none", "ffn1", "ffn-2_attn0.5")


def steered_golden(z, case: str) -> dict:
    """ds4c_steering.npz's run of one setting in the golden files' layout."""
    P = len(z["prompt_ids"])
    b, s = z[f"{case}.batch_logits"], z[f"{case}.stream_logits"]
    return {"prompt_ids": z["prompt_ids"], "greedy_tokens": z[f"{case}.batch_tokens"],
            "stream_greedy_tokens": z[f"{case}.stream_tokens"], "prompt_logits": b[0],
            "step_logits": b[1:], "stream_pos_logits": s[:P], "stream_step_logits": s[P:]}


def steered_rows(z, case: str, path: str = "batch", backend: str = "numpy") -> np.ndarray:
    """ds4ref's replay of one steered setting: logit rows [R, n_vocab] in golden_rows' order."""
    from ds4ref.dev.oracle import replay_golden, run_rows
    from ds4ref.engine import Engine
    a, f = (float(v) for v in z[f"{case}.scales_attn_ffn"])
    eng = Engine.open(ORACLE / "dev_seed1.gguf", backend=backend,
                      steering_file=None if case == "none" else ORACLE / "ds4c_steering_dirs.f32",
                      steering_attn=a, steering_ffn=f)
    return run_rows(replay_golden(eng, steered_golden(z, case), path, ctx_size=64), path)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "book/results/steering_ds4ref.npz"))
    args = ap.parse_args(argv)
    z = np.load(ORACLE / "ds4c_steering.npz")
    arrays = {f"{case}.batch.rows": steered_rows(z, case).astype(np.float32) for case in CASES}
    write_record(Path(args.out), arrays,
                 "ds4ref's steered replays, batch path (tools/steering_rows.py)",
                 cases=list(CASES))
    return 0


if __name__ == "__main__":
    sys.exit(main())
