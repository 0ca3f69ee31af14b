#!/usr/bin/env python3
"""Record llama.cpp's MTP block on ds4ref's bundled tiny model (seed 7) for chapter 10's check.

    python tools/llama_cpp/mtp_crosscheck.py OUTDIR [data/llama_cpp/mtp_tiny_seed7.npz]

OUTDIR is tools/llama_cpp/build_mtp.sh's (OUTDIR/bin/llama-mtp-logits). The steps fed to both:
the target (ds4ref, numpy backend) decodes PROMPT from position 0; the MTP block then runs at
each prompt position p from (token p, position p, the target's final HC state at p), as
mtp_draft_step does for the first draft, on one MTP cache; then DRAFTS more steps chain from
its own output (token = the previous step's argmax, HC state = ds4ref's block output), as the
later drafts of eval_speculative_argmax do. The inputs of every step are ds4ref's, so each
step compares the two blocks on the same input (their caches hold each one's own rows).
Recorded: the inputs and llama.cpp's logits and output HC state per step (the test and the
chapter recompute ds4ref's side), and for step 0 a few of llama.cpp's intermediate tensors
(STAGES, from the driver's LLAMA_MTP_DUMP), so that each stage can be checked on llama.cpp's
own input to it. ds4ref's outputs are printed for a look only.
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from mtp_for_llama import write_mtp_for_llama  # noqa: E402

PROMPT = "The quick brown fox jumps"
DRAFTS = 4
CTX = 64
LLAMA_CPP = "0c1e570 (llama-cpp-python 0.3.36)"
STAGES = {"input": "mtp_eh_proj-6", "attn_x": "mtp_hc_attn_pre-6", "attn_norm": "mtp_attn_norm-6",
          "q_rope": "q-6", "kv_rope": "kv-6", "heads": "attn_raw-6 (reshaped)",
          "after_attn": "mtp_hc_attn_post-6", "hc_out": "mtp_l_out-6", "logits": "result_output"}


def read_dump(path) -> dict:
    """The driver's LLAMA_MTP_DUMP file: {name: float32 array} (first tensor of each name)."""
    b, o, out = Path(path).read_bytes(), 0, {}
    while o < len(b):
        name = b[o:o + 64].split(b"\0")[0].decode()
        ne = np.frombuffer(b[o + 64:o + 96], "<i8")
        k = int(np.prod(ne))
        a = np.frombuffer(b[o + 96:o + 96 + 4 * k], "<f4").reshape(tuple(int(x) for x in ne[::-1]))
        out.setdefault(name, a.squeeze().copy())
        o += 96 + 4 * k
    return out


def ds4ref_inputs(eng):
    """tokens [N], positions [N], HC inputs [N, n_hc, n_embd], ds4ref logits, block outputs."""
    from ds4ref.kvcache import KVCache, LayerCache
    from ds4ref.mtp import MTP_IL, decode_rows, mtp_draft_step
    cfg, w, be = eng.cfg, eng.weights, eng.backend
    prompt = eng.tokenizer.encode(PROMPT)
    _, hc = decode_rows(eng.model, KVCache(cfg, CTX), prompt, 0)
    cache = LayerCache(cfg, MTP_IL, CTX)
    toks, pos, h_in, logits, h_out = [], [], [], [], []

    def step(t, p, h):
        lg, X = mtp_draft_step(cfg, w, eng.mtp, cache, t, p, h, be)
        toks.append(t), pos.append(p), h_in.append(h), logits.append(lg), h_out.append(X)

    for p, t in enumerate(prompt):
        step(int(t), p, hc[p])
    for _ in range(DRAFTS):
        step(int(np.argmax(logits[-1])), pos[-1] + 1, h_out[-1])
    return (np.array(toks, np.int32), np.array(pos, np.int32), np.stack(h_in),
            np.stack(logits), np.stack(h_out))


def run_llama(exe, model, toks, pos, h_in, n_vocab, dump=None):
    """llama-mtp-logits on these steps: logits [N, n_vocab], output HC states like h_in."""
    n, width = len(toks), h_in[0].size
    env = None if dump is None else {**os.environ, "LLAMA_MTP_DUMP": str(dump)}
    with tempfile.TemporaryDirectory() as d:
        src, dst = Path(d) / "in.bin", Path(d) / "out.bin"
        with open(src, "wb") as f:
            f.write(np.array([n, width], "<i4").tobytes())
            for t, p, h in zip(toks, pos, h_in):
                f.write(np.array([t, p], "<i4").tobytes())
                f.write(np.asarray(h, "<f4").tobytes())
        subprocess.run([str(exe), str(model), str(src), str(dst), "1"], check=True, env=env,
                       stderr=subprocess.DEVNULL)
        out = np.fromfile(dst, "<f4").reshape(n, n_vocab + width)
    return out[:, :n_vocab].copy(), out[:, n_vocab:].reshape(h_in.shape).copy()


def main(outdir, dst="data/llama_cpp/mtp_tiny_seed7.npz"):
    from ds4ref.checks import rel
    from ds4ref.engine import Engine
    from ds4ref.dev.writer import (
        WRITER_VERSION,
        synthetic_model_path,
        synthetic_mtp_path,
    )
    eng = Engine.open(synthetic_model_path(), backend="numpy",
                      mtp_path=synthetic_mtp_path())
    exe = Path(outdir) / "bin" / "llama-mtp-logits"
    toks, pos, h_in, ours, ours_h = ds4ref_inputs(eng)
    with tempfile.TemporaryDirectory() as d:
        model = write_mtp_for_llama(synthetic_model_path(), synthetic_mtp_path(),
                                    Path(d) / "tiny.mtp.llama.gguf")
        lg, hn = run_llama(exe, model, toks, pos, h_in, eng.cfg.n_vocab)
        run_llama(exe, model, toks[:1], pos[:1], h_in[:1], eng.cfg.n_vocab, Path(d) / "dump")
        dumped = read_dump(Path(d) / "dump")
    stages = {f"stage_{k}": dumped[v] for k, v in STAGES.items()}
    Path(dst).parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(dst, tokens=toks, pos=pos, h_in=h_in, llama_logits=lg,
                        llama_h_next=hn, n_prompt=np.int32(len(toks) - DRAFTS),
                        writer_version=np.int32(WRITER_VERSION), llama_cpp=LLAMA_CPP, **stages)
    print(f"wrote {dst}: {len(toks)} steps ({len(toks) - DRAFTS} prompt, {DRAFTS} chained)")
    for i in range(len(toks)):
        print(f"step {i:2d} tok {toks[i]:4d} pos {pos[i]:2d}  logits rel {rel(ours[i], lg[i]):.2e}"
              f"  h rel {rel(ours_h[i], hn[i]):.2e}  argmax {int(np.argmax(ours[i]))}"
              f" / {int(np.argmax(lg[i]))}")


if __name__ == "__main__":
    if len(sys.argv) not in (2, 3):
        raise SystemExit(__doc__)
    main(*sys.argv[1:])
