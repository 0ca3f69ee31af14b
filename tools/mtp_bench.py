"""Measure what speculative decoding costs on ds4ref (chapter 10's cost model reads the result).

On the bundled trained model (or -m MODEL with --mtp PATH), one backend, after a prompt of --prompt tokens:
- decode_s: one plain decode step (Session.eval), the median of --reps runs (every time is a
  median; the *_reps_s fields keep every run, so a reader sees the spread);
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


def run_times(fn, reps: int) -> list[float]:
    """The wall time of each of reps runs of fn, in the order they ran."""
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return ts


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
    # each timed run restores the cache first: its median is taken off every run
    restore_s = float(np.median(run_times(lambda: s.restore(base), args.reps)))
    decode_reps = [t - restore_s for t in run_times(decode, args.reps)]

    verify_reps = {}
    for k in range(1, 9):
        toks = rng.integers(2, cfg.n_vocab, k).tolist()

        def run():
            s.restore(base)
            mtp.forward_rows(eng.model, s._cache, toks, s.pos)
        verify_reps[k] = [t - restore_s for t in run_times(run, args.reps)]

    st = mtp.MTPState(cfg, s.ctx_size)
    hc = rng.standard_normal((cfg.n_hc, cfg.n_embd)).astype(np.float32)
    draft_reps = run_times(lambda: st.step(cfg, w, eng.mtp, 5, s.pos, hc, be), args.reps)
    snapshot_reps = run_times(lambda: s._cache.copy(), args.reps)
    med = lambda ts: float(np.median(ts))
    decode_s, draft_s, snapshot_s = med(decode_reps), med(draft_reps), med(snapshot_reps)
    verify = {k: med(ts) for k, ts in verify_reps.items()}

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
        "prompt_tokens": args.prompt, "reps": args.reps,
        "timing": "median of reps; *_reps_s: every run (restore's median taken off)",
        "decode_s": decode_s, "verify_s": {str(k): v for k, v in verify.items()},
        "draft_s": draft_s, "snapshot_s": snapshot_s, "acceptance": counts,
        "decode_reps_s": decode_reps, "verify_reps_s": {str(k): v for k, v in verify_reps.items()},
        "draft_reps_s": draft_reps, "snapshot_reps_s": snapshot_reps,
        "prompt_text": None if args.text is None else str(args.text.resolve().relative_to(ROOT)),
        "note": ("random weights: the MTP block's drafts agree with the target about as often as chance"
                 if "trained" not in eng.path.name else "the bundled trained model and its trained MTP head"),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"decode {decode_s * 1e3:.1f} ms ({min(decode_reps) * 1e3:.1f}-{max(decode_reps) * 1e3:.1f}), "
          f"draft {draft_s * 1e3:.1f} ms, snapshot {snapshot_s * 1e3:.2f} ms (medians of {args.reps})")
    for k, v in verify.items():
        lo, hi = min(verify_reps[k]), max(verify_reps[k])
        print(f"verify k={k}: {v * 1e3:.1f} ms ({lo * 1e3:.1f}-{hi * 1e3:.1f}; {v / decode_s:.2f} x decode)")
    print("acceptance", counts, "->", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
