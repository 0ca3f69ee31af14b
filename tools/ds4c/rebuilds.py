"""ds4.c against itself: rebuild it with other compiler flags and measure how far each build lands from
the golden files. This is the yardstick for ds4ref's end-to-end agreement (chapter 08).

For each variant the script builds ds4.c (tools/ds4c/build.sh: the tiny shape, the expert-choice log),
replays the cases on both of ds4.c's paths through its public API (ds4c_run), and stores, per golden
row, the agreement (corr, mean |d|, max |d|) with the golden logits, plus the experts that build chose in
the top-k layers. Cases: A and C of the shared oracle (data/oracle/golden_{A,C}.npz on dev_seed1.gguf),
and "bundled": ds4ref's own bundled model (ds4ref.dev.writer, seed 7) with goldens that record.py made with
ds4.c's Makefile flags (data/oracle/ds4c_bundled.npz). The first variant is those Makefile flags: it
must reproduce the golden files bit for bit, which checks the harness.

    python tools/ds4c/rebuilds.py --ds4 PATH/TO/ds4-checkout [--work DIR]
writes data/oracle/rebuilds.npz and data/oracle/rebuilds.json.

    python tools/ds4c/rebuilds.py --ds4 PATH/TO/ds4-checkout --steering
writes data/oracle/rebuilds_steering.npz and .json: the same measures for chapter 10's steering goldens
(data/oracle/ds4c_steering.npz: three settings, both paths, the recorded greedy tokens fed), from every build
this machine can execute. Those goldens come from the Makefile build on the oracle's AVX-512 machine; here the
Makefile flags (-march=native) give another build, kept as the sample "makefile" (on the oracle's machine kind
it reproduces the goldens and adds a distance of 0). The variants with fixed targets (avx2, sse2) give the same
binary on any host: on an AVX2-only Zen 3 they reproduced rebuilds.npz's rows of cases A, C and bundled bit for
bit. avx512-w512 is skipped on a host without AVX-512. The goldens hold no expert log, so neither do these.

    python tools/ds4c/rebuilds.py --ds4 PATH/TO/ds4-checkout --indexer
writes data/oracle/rebuilds_indexer.npz and .json: case A (the one case whose goldens record the indexer's
choices) from every build this machine can execute, patched to log the indexer's selections (shape_patch.py
--log-indexer), with the same logit measures and expert ids; the json says whether the instrumented builds
with fixed targets still give rebuilds.npz's rows bit for bit.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ds4c_io import PATHS, golden_rows, indexer_log, read_expert_log, read_indexer_log, run  # noqa: E402

from ds4ref.dev.oracle import logit_agreement  # noqa: E402

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


# name -> (golden file, model): the model is a path relative to the repository, or "bundled" for the model
# ds4ref.dev.writer.synthetic_model_path() writes. Add a case with --case NAME=GOLDEN.npz:MODEL.gguf (both inside
# the repository, e.g. under data/oracle/): the golden file needs the arrays of data/oracle/README.md's
# table (prompt_ids, prompt_logits, step_logits, greedy_tokens, stream_*, trace_*_expert_ids/_margin).
CASES = {"A": ("data/oracle/golden_A.npz", "data/oracle/dev_seed1.gguf"),
         "C": ("data/oracle/golden_C.npz", "data/oracle/dev_seed1.gguf"),
         "bundled": ("data/oracle/ds4c_bundled.npz", "bundled")}


def model_path(model: str) -> Path:
    from ds4ref.dev.writer import synthetic_model_path
    return synthetic_model_path() if model == "bundled" else ROOT / model


def cases(extra: dict | None = None) -> dict:
    """name -> (golden arrays, model path), for the cases whose golden file exists."""
    table = CASES | (extra or {})
    return {name: (np.load(ROOT / golden), model_path(model)) for name, (golden, model) in table.items()
            if (ROOT / golden).exists()}


def run_variant(name: str, flags: str, ds4: Path, work: Path, extra: dict | None = None,
                reuse: bool = False) -> dict:
    d = work / name
    model_any = ORACLE / "dev_seed1.gguf"                  # every case has the tiny shape
    if not (reuse and (d / "ds4c_run").exists()):
        subprocess.run([str(ROOT / "tools/ds4c/build.sh"), str(ds4), str(model_any), str(d), *flags.split()],
                       check=True, capture_output=True)
    out = {}
    for case, (g, model) in cases(extra).items():
        n_prompt = len(g["prompt_ids"])
        for path, (steps_key, _, _) in PATHS.items():
            logits, _, log = run(d, model, path, g["prompt_ids"], g[steps_key], d / "run")
            ref = golden_rows(g, path)
            m = logit_agreement(logits, ref)
            key = f"{case}.{path}.{name}"
            out.update({f"{key}.{k}": np.asarray(v, np.float32) for k, v in m.items()})
            out[f"{key}.bit_exact_rows"] = np.asarray((logits == ref).all(-1))
            out[f"{key}.argmax"] = np.argmax(logits, axis=-1).astype(np.int16)
            ids, _ = read_expert_log(log, path, n_prompt, len(g[steps_key]), n_expert=16)
            out[f"{key}.expert_ids"] = ids.astype(np.int8)
    return out


STEER_GOLDEN = "data/oracle/ds4c_steering.npz"
STEER_ENV = {"none": None, "ffn1": {}, "ffn-2_attn0.5": {"DS4C_STEER_FFN": "-2", "DS4C_STEER_ATTN": "0.5"}}


def host_has_avx512() -> bool:
    flags = next((l for l in Path("/proc/cpuinfo").read_text().splitlines() if l.startswith("flags")), "")
    return "avx512f" in flags.split()


def steering_variants() -> dict:
    """The builds for the steering goldens: the Makefile flags as a sample, and every variant this host runs."""
    out = {"makefile" if k == "golden" else k: v for k, v in VARIANTS.items()}
    if not host_has_avx512():
        del out["avx512-w512"]
    return out


def run_steering_variant(name: str, flags: str, ds4: Path, work: Path, reuse: bool = False) -> dict:
    """One build on the three steering settings and both paths, fed the golden's greedy tokens."""
    d = work / name
    model = ORACLE / "dev_seed1.gguf"
    if not (reuse and (d / "ds4c_run").exists()):
        subprocess.run([str(ROOT / "tools/ds4c/build.sh"), str(ds4), str(model), str(d), *flags.split()],
                       check=True, capture_output=True)
    g, out = np.load(ROOT / STEER_GOLDEN), {}
    for case, env in STEER_ENV.items():
        env = None if env is None else dict(env, DS4C_STEER_FILE=str(ORACLE / "ds4c_steering_dirs.f32"))
        for path in PATHS:
            logits, _, _ = run(d, model, path, g["prompt_ids"], g[f"{case}.{path}_tokens"], d / "run", env=env)
            ref = g[f"{case}.{path}_logits"]
            key = f"{case}.{path}.{name}"
            out.update({f"{key}.{k}": np.asarray(v, np.float32)
                        for k, v in logit_agreement(logits, ref).items()})
            out[f"{key}.bit_exact_rows"] = np.asarray((logits == ref).all(-1))
            out[f"{key}.argmax"] = np.argmax(logits, axis=-1).astype(np.int16)
    return out


INDEXER_CASES = ("A",)     # the cases whose golden files record indexer selections


def ratio4_layers(model: Path) -> tuple:
    """The layers with an indexer (compression ratio 4), in order: the golden traces' middle axis."""
    from ds4ref.config import ModelConfig
    from ds4ref.gguf import GGUFFile
    with GGUFFile(model) as g:
        cfg = ModelConfig.from_gguf(g)
    return tuple(il for il in range(cfg.n_layer) if cfg.compress_ratio(il) == 4)


def run_indexer_variant(name: str, flags: str, ds4: Path, work: Path, reuse: bool = False) -> dict:
    """One build patched with --log-indexer on the cases with indexer traces: the logit measures, argmax and
    expert ids as run_variant, plus the indexer's selected rows."""
    d = work / f"{name}-indexer"
    model = ORACLE / "dev_seed1.gguf"
    if not (reuse and (d / "ds4c_run").exists()):
        subprocess.run([str(ROOT / "tools/ds4c/build.sh"), str(ds4), str(model), str(d), *flags.split()],
                       check=True, capture_output=True, env=dict(os.environ, DS4C_PATCH="--log-indexer"))
    out = {}
    for case in INDEXER_CASES:
        g, model = cases()[case]
        n_prompt = len(g["prompt_ids"])
        for path, (steps_key, _, _) in PATHS.items():
            logits, _, log = run(d, model, path, g["prompt_ids"], g[steps_key], d / "run")
            ref = golden_rows(g, path)
            key = f"{case}.{path}.{name}"
            out.update({f"{key}.{k}": np.asarray(v, np.float32) for k, v in logit_agreement(logits, ref).items()})
            out[f"{key}.bit_exact_rows"] = np.asarray((logits == ref).all(-1))
            out[f"{key}.argmax"] = np.argmax(logits, axis=-1).astype(np.int16)
            ids, _ = read_expert_log(log, path, n_prompt, len(g[steps_key]), n_expert=16)
            out[f"{key}.expert_ids"] = ids.astype(np.int8)
            sel = read_indexer_log(indexer_log(log), n_prompt + len(g[steps_key]), ratio4_layers(model))
            out[f"{key}.indexer_selected"] = sel.astype(np.int16)
    return out


def main_indexer(args) -> None:
    """Every build this host runs, patched to log the indexer, on the cases with indexer traces; checks that
    the instrumented builds with fixed targets (avx2, sse2) give rebuilds.npz's rows bit for bit."""
    data, variants = {}, steering_variants()
    for name, flags in variants.items():
        print(f"{name:12s} {flags}", flush=True)
        data.update(run_indexer_variant(name, flags, args.ds4, args.work, args.reuse_builds))
    known = np.load(ORACLE / "rebuilds.npz")
    same = {v: all(np.array_equal(data[k], known[k]) for k in data if f".{v}." in k and k in known.files)
            for v in ("avx2", "sse2") if v in variants}
    out = ORACLE / "rebuilds_indexer.npz"
    np.savez_compressed(out, **data)
    meta = {"ds4_commit": "8d576642c39b9a2d782a80159ba84ef5a81c0b81", **machine(),
            "native": native_target(), "variants": variants,
            "fixed_target_builds_equal_rebuilds_npz": same,
            "cases": {c: {"golden": CASES[c][0], "model": CASES[c][1]} for c in INDEXER_CASES},
            "how": "tools/ds4c/rebuilds.py --indexer: build.sh with DS4C_PATCH=--log-indexer, 1 thread, ctx 1024",
            "keys": "{case}.{path}.{variant}.{corr,mean_abs,max_abs,bit_exact_rows,argmax,expert_ids,"
                    "indexer_selected}; indexer_selected [rows, 2 ratio-4 layers, 16] as the golden traces "
                    "(-1: no selection)"}
    out.with_suffix(".json").write_text(json.dumps(meta, indent=1) + "\n")
    print("wrote", out, "and", out.with_suffix(".json"), "; avx2/sse2 equal to rebuilds.npz:", same)


def machine() -> dict:
    cc = subprocess.run([os.environ.get("CC", "gcc"), "--version"], capture_output=True, text=True).stdout.splitlines()[0]
    cpu = next((l.split(":", 1)[1].strip() for l in Path("/proc/cpuinfo").read_text().splitlines()
                if l.startswith("model name")), platform.processor())
    return {"compiler": cc, "cpu": cpu}


def native_target() -> str:
    """What -march=native means on this host (gcc's answer)."""
    q = subprocess.run([os.environ.get("CC", "gcc"), "-march=native", "-Q", "--help=target"],
                       capture_output=True, text=True).stdout
    return next((l.split()[-1] for l in q.splitlines() if l.strip().startswith("-march=")), "?")


def main_steering(args) -> None:
    data, variants = {}, steering_variants()
    for name, flags in variants.items():
        print(f"{name:12s} {flags}", flush=True)
        data.update(run_steering_variant(name, flags, args.ds4, args.work, args.reuse_builds))
    out = ORACLE / "rebuilds_steering.npz"
    np.savez_compressed(out, **data)
    g = np.load(ROOT / STEER_GOLDEN)
    meta = {"ds4_commit": "8d576642c39b9a2d782a80159ba84ef5a81c0b81", **machine(),
            "native": native_target(), "variants": variants,
            "makefile_reproduces_goldens": bool(all(data[f"{c}.{p}.makefile.bit_exact_rows"].all()
                                                    for c in STEER_ENV for p in PATHS)),
            "cases": {c: {"golden": STEER_GOLDEN, "model": "data/oracle/dev_seed1.gguf",
                          "scales_attn_ffn": [float(v) for v in g[f"{c}.scales_attn_ffn"]]} for c in STEER_ENV},
            "how": "tools/ds4c/rebuilds.py --steering: build.sh, 1 thread, ctx 1024, the golden's greedy tokens fed",
            "keys": "{case}.{path}.{variant}.{corr,mean_abs,max_abs,bit_exact_rows,argmax}; rows as "
                    "{case}.{path}_logits of the golden file"}
    out.with_suffix(".json").write_text(json.dumps(meta, indent=1) + "\n")
    print("wrote", out, "and", out.with_suffix(".json"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ds4", type=Path, required=True, help="a checkout of antirez/ds4 at commit 8d57664")
    ap.add_argument("--work", type=Path, default=Path("/tmp/ds4c-rebuilds"))
    ap.add_argument("--only", nargs="*", help="variant names (default: all)")
    ap.add_argument("--case", action="append", default=[], metavar="NAME=GOLDEN.npz:MODEL.gguf",
                    help="one more case (paths relative to the repository); repeatable")
    ap.add_argument("--out", type=Path, default=ORACLE / "rebuilds.npz",
                    help="where to write (the .json goes next to it); use another path with --only")
    ap.add_argument("--reuse-builds", action="store_true",
                    help="keep the builds already in --work (same source, same flags)")
    ap.add_argument("--steering", action="store_true",
                    help="chapter 10's steering goldens instead: writes data/oracle/rebuilds_steering.*")
    ap.add_argument("--indexer", action="store_true",
                    help="case A with the indexer's selections logged: writes data/oracle/rebuilds_indexer.*")
    args = ap.parse_args()
    if args.steering:
        return main_steering(args)
    if args.indexer:
        return main_indexer(args)
    extra = {}
    for spec in args.case:
        name, _, files = spec.partition("=")
        golden, _, model = files.partition(":")
        if not (name and golden and model):
            raise SystemExit(f"--case {spec!r}: expected NAME=GOLDEN.npz:MODEL.gguf")
        extra[name] = (golden, model)
    data = {}
    for name, flags in VARIANTS.items():
        if args.only and name not in args.only:
            continue
        print(f"{name:12s} {flags}", flush=True)
        data.update(run_variant(name, flags, args.ds4, args.work, extra, args.reuse_builds))
    np.savez_compressed(args.out, **data)
    meta = {"ds4_commit": "8d576642c39b9a2d782a80159ba84ef5a81c0b81", **machine(),
            "variants": {k: v for k, v in VARIANTS.items() if not args.only or k in args.only},
            "cases": {name: {"golden": golden, "model": model} for name, (golden, model) in (CASES | extra).items()
                      if (ROOT / golden).exists()},
            "how": "tools/ds4c/rebuilds.py: build.sh (shape_patch.py + ds4c_run.c), 1 thread, ctx 1024",
            "keys": "{case}.{path}.{variant}.{corr,mean_abs,max_abs,bit_exact_rows,argmax,expert_ids}; rows as the "
                    "golden arrays: stream = stream_pos_logits then stream_step_logits; batch = prompt_logits "
                    "then step_logits; expert_ids [rows, 3 top-k layers, 6] in ds4's order"}
    args.out.with_suffix(".json").write_text(json.dumps(meta, indent=1) + "\n")
    print("wrote", args.out, "and", args.out.with_suffix(".json"))


if __name__ == "__main__":
    main()
