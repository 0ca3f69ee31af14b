"""Measure what speculative decoding costs on ds4ref (chapter 10's cost model reads the result).

On the bundled trained model (or -m MODEL with --mtp PATH), one backend, after a prompt of --prompt tokens:
- decode_s: one plain decode step (Session.eval), the fastest of --reps (all times are);
- verify_s[k]: one batched forward of k tokens on the live cache (ds4ref.mtp.forward_rows), k = 1..8;
- draft_s: one MTP draft step (ds4ref.mtp.mtp_draft_step);
- snapshot_s: one KV cache copy (the rewind after a partial accept restores it);
- acceptance: a greedy run of --tokens tokens with eval_speculative_argmax, counting the MTP's drafts
  that the target model confirmed (random weights: expect about chance).

    .venv/bin/python tools/mtp_bench.py [--backend numpy] [--out book/results/mtp_bench.json]
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def best_time(fn, reps: int) -> float:
    """The fastest of reps runs: on a shared machine, the least disturbed one."""
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return min(ts)


def main(argv=None) -> int:
    from ds4ref import mtp
    from ds4ref.dev.bench import machine
    from ds4ref.engine import Engine

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", default=None)
    ap.add_argument("--mtp", default=None)
    ap.add_argument("--backend", default="numpy")
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--text", type=Path, default=None,
                    help="prompt from this text file (BOS + its first --prompt - 1 tokens) "
                    "instead of random token ids")
    ap.add_argument("--out", type=Path, default=ROOT / "book" / "results" / "mtp_bench.json")
    args = ap.parse_args(argv)

    eng = Engine.open(args.model, backend=args.backend, mtp_path=args.mtp, mtp_draft_tokens=4)
    if not eng.has_mtp:
        raise SystemExit("mtp_bench: the model has no MTP GGUF (pass --mtp PATH)")
    cfg, w, be = eng.cfg, eng.weights, eng.backend
    rng = np.random.default_rng(11)
    prompt = [0] + rng.integers(2, cfg.n_vocab, args.prompt - 1).tolist()
    if args.text is not None:
        prompt = [0] + eng.tokenizer.encode(args.text.read_text())[:args.prompt - 1]
    s = eng.session(args.prompt + args.tokens + 32)
    s.sync(prompt)
    s.eval(s.argmax())                                   # warm-up: first touch of the decode path
    base = s.snapshot()

    def decode():
        s.restore(base)
        s.eval(7)
    restore_s = best_time(lambda: s.restore(base), args.reps)
    decode_s = best_time(decode, args.reps) - restore_s

    verify = {}
    for k in range(1, 9):
        toks = rng.integers(2, cfg.n_vocab, k).tolist()

        def run():
            s.restore(base)
            mtp.forward_rows(eng.model, s._cache, toks, s.pos)
        verify[k] = best_time(run, args.reps) - restore_s

    st = mtp.MTPState(cfg, s.ctx_size)
    hc = rng.standard_normal((cfg.n_hc, cfg.n_embd)).astype(np.float32)
    draft_s = best_time(lambda: st.step(cfg, w, eng.mtp, 5, s.pos, hc, be), args.reps)
    snapshot_s = best_time(lambda: s._cache.copy(), args.reps)

    # acceptance: count drafts through the session's own speculative loop
    counts = {"cycles": 0, "tokens": 0, "drafted": 0, "first_draft_hits": 0}
    real_step = mtp.MTPState.step

    def counting_step(self, *a):
        counts["drafted"] += 1
        return real_step(self, *a)
    mtp.MTPState.step = counting_step
    try:
        g = eng.session(args.prompt + args.tokens + 32)
        g.sync(prompt)
        t = g.argmax()
        while counts["tokens"] < args.tokens:
            out = g.eval_speculative_argmax(t, args.tokens - counts["tokens"])
            counts["cycles"] += 1
            counts["tokens"] += len(out)
            counts["first_draft_hits"] += len(out) > 1
            t = g.argmax()
    finally:
        mtp.MTPState.step = real_step
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    result = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": commit, "machine": machine(), "load_average": os.getloadavg(),
        "model": str(eng.path.name), "mtp": str(eng.mtp.path.name), "backend": args.backend,
        "prompt_tokens": args.prompt, "reps": args.reps, "timing": "fastest of reps",
        "decode_s": decode_s, "verify_s": {str(k): v for k, v in verify.items()},
        "draft_s": draft_s, "snapshot_s": snapshot_s, "acceptance": counts,
        "prompt_text": None if args.text is None else str(args.text.resolve().relative_to(ROOT)),
        "note": ("random weights: the MTP block's drafts agree with the target about as often as chance"
                 if "trained" not in eng.path.name else "the bundled trained model and its trained MTP head"),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"decode {decode_s * 1e3:.1f} ms, draft {draft_s * 1e3:.1f} ms, snapshot {snapshot_s * 1e3:.2f} ms")
    for k, v in verify.items():
        print(f"verify k={k}: {v * 1e3:.1f} ms ({v / decode_s:.2f} x decode)")
    print("acceptance", counts, "->", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
