"""Build a directional-steering file from paired prompt sets with ds4ref (as ds4.c's build_direction.py).

For each pair, the prompt is rendered as ds4.c's extractor renders it (BOS, system, <｜User｜> prompt,
<｜Assistant｜>, then </think>, or <think> with --think), prefilled once, and the last token's FFN (or
attention) output row of every layer is captured with ds4ref's Trace. The direction of each layer is
mean(good) - mean(bad) (or the mean of normalized pair differences), normalized, then made orthogonal to the
control mean, written as float32 [n_layer, n_embd] next to a JSON description.

    .venv/bin/python tools/build_direction.py --good-file G.txt --bad-file B.txt --out out/dir.json \
        [-m MODEL] [--component ffn_out|attn_out] [--system TEXT] [--think] [--pair-normalize]
        [--no-orthogonalize]

Use the .f32 with `python -m ds4ref --dir-steering-file out/dir.f32 --dir-steering-ffn -1` (negative
amplifies the good prompts' direction, positive suppresses it). One prompt per non-empty line; lines
starting with '#' are comments.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def read_prompt_file(path: Path) -> list[str]:
    prompts = [ln.strip() for ln in path.read_text(encoding="utf-8").splitlines()]
    prompts = [p for p in prompts if p and not p.startswith("#")]
    if not prompts:
        raise SystemExit(f"{path}: no prompts found")
    return prompts


def main(argv=None) -> int:
    from ds4ref.engine import Engine
    from ds4ref.steering import build_direction, capture_rows

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", default=None, help="GGUF (default: the bundled model)")
    ap.add_argument("--good-file", type=Path, required=True, help="target prompts, one per line")
    ap.add_argument("--bad-file", type=Path, required=True, help="contrast prompts, one per line")
    ap.add_argument("--out", type=Path, required=True, help="JSON path; the .f32 is written next to it")
    ap.add_argument("--system", default="You are a helpful assistant.")
    ap.add_argument("--component", default="ffn_out", choices=("ffn_out", "attn_out"))
    ap.add_argument("--think", action="store_true", help="capture after <think> (default: </think>)")
    ap.add_argument("--pair-normalize", action="store_true")
    ap.add_argument("--no-orthogonalize", action="store_true")
    ap.add_argument("--backend", default="numpy")
    args = ap.parse_args(argv)

    eng = Engine.open(args.model, backend=args.backend, mtp_draft_tokens=1)
    good, bad = read_prompt_file(args.good_file), read_prompt_file(args.bad_file)
    n = min(len(good), len(bad))
    think = "high" if args.think else "none"
    cap = lambda p: capture_rows(eng, eng.tokenizer.chat_prompt(p, args.system, think), args.component)
    g = np.stack([cap(p) for p in good[:n]])
    b = np.stack([cap(p) for p in bad[:n]])
    dirs = build_direction(g, b, args.pair_normalize, not args.no_orthogonalize)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    f32 = args.out.with_suffix(".f32")
    dirs.astype("<f4").tofile(f32)
    args.out.write_text(json.dumps({
        "format": "ds4-directional-steering-v1", "shape": list(dirs.shape), "component": args.component,
        "thinking": args.think, "pair_normalize": args.pair_normalize,
        "orthogonalize_control_mean": not args.no_orthogonalize, "pairs": n,
        "good_file": str(args.good_file), "bad_file": str(args.bad_file), "model": str(eng.path),
        "note": "runtime positive scale suppresses this direction; negative scale amplifies it"}, indent=2))
    print(f"wrote {args.out} and {f32} ({n} pairs)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
