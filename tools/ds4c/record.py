"""Record ds4.c's tokenizer and sampler on the oracle model, as exact-match data for ds4ref's tests.

Runs the golden build (ds4.c's Makefile flags, tools/ds4c/build.sh) through ds4c_run:
- `ds4_tokenize_text`, `ds4_tokenize_rendered_chat` and `ds4_encode_chat_prompt` (three think modes) on
  varied text (Chinese, emoji, code, whitespace runs, digits, full-width punctuation, specials), with the
  oracle model's vocab and with the bundled model's (the writer's trained BPE, key "bundled");
- `ds4_token_text` of every token id;
- `ds4_session_sample` after syncing case C's and case A's prompts (so the logits are exactly the golden
  `prompt_logits`), over a grid of temperature / top-k / top-p / min-p and seeds: every draw and the
  generator state after the last one;
- a third end-to-end case, "bundled": ds4ref's own bundled model (`ds4ref.dev.writer`, seed 7, so ds4.c also
  checks that the writer's GGUF loads), a 160-token prompt and 16 greedy steps on both paths, in the layout
  of the shared golden files (logits, greedy tokens, expert ids and margins of the top-k layers).

- directional steering (`--steering`, only that; needs a build made with DS4C_PATCH=--dump-steering): the
  oracle model with a seeded direction file (`ds4c_steering_dirs.f32`, one random unit vector per layer)
  under three settings (none; FFN 1, ds4's default with a file; FFN -2 with attention 0.5), both paths, a
  48-token prompt and 8 greedy steps; plus the rows going into and out of
  cpu_directional_steering_project_rows in the last setting (batch path: 7 of the 48 prefill rows of
  every call, every decode call).

    python tools/ds4c/record.py --build DIR      (DIR from build.sh with the default flags)
writes data/oracle/ds4c_tokenizer.json, data/oracle/ds4c_sample.npz and data/oracle/ds4c_bundled.npz;
    python tools/ds4c/record.py --build DIR --steering
writes data/oracle/ds4c_steering.npz and data/oracle/ds4c_steering_dirs.f32.
"""
from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import random
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ds4c_io import PATHS, read_expert_log, run as replay  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
ORACLE = ROOT / "data" / "oracle"
MODEL = ORACLE / "dev_seed1.gguf"

TEXTS = [
    "Hello world, the answer is 12345!",
    "    int main(void) {\n\treturn 0;\n}\n",
    "def f(x):\n    return x**2  # square\n\n\nclass A: pass",
    "中文分词测试，还有标点。 and mixed 日本語のテキスト カタカナ",
    "全角标点！？（括号）「引号」、顿号；冒号：",
    "emoji 😀👍🏽 ok 🇮🇹!",
    "a  b   c\n\n\n  d\r\n\te\t\t f",
    "price: $3.14159 ~ 1e-10, 2024-11-30 12:00:00, 0xDEADbeef 1234567890",
    "x = [1,2,3]; y=x.append(4)\r\n",
    "Ünïcödé àccents — “quotes” ‘single’ naïve café",
    "   leading and trailing spaces   ",
    "tabs\tand\u00a0nbsp\u2003em-space",
    "<think>not special here</think> <｜User｜>",
    "!!!???...;;;\n\n",
    "ŁÓDŹ Ωμέγα Кириллица עברית العربية",
    "I'm can't we'll they've O'Neil's 'quoted'",
    "123456789 1 22 333 4444 55555",
    "über-long-wordwithoutspaces_and_underscores__x",
    "\n\n\n",
    " ",
    "a\u0301 e\u0308 combining marks",
    "",
]
RENDERED = [
    "<｜begin▁of▁sentence｜>You are helpful.<｜User｜>Hi there<｜Assistant｜></think>Hello!<｜end▁of▁sentence｜>",
    "<｜User｜>中文<｜Assistant｜><think>thinking</think>answer",
    "plain text with no specials",
    "｜DSML｜ tool <｜User｜><｜User｜>twice",
]
CHATS = [("", "Hello", "none"), ("", "Hello", "high"), ("", "Hello", "max"),
         ("You are a poet.", "写一首诗", "none"), ("System prompt\n", "code: x=1\n", "high"), ("", "", "max")]

SAMPLE_GRID = {"temperature": [0.0, 0.3, 1.0, 1.7], "top_k": [0, 1, 5, 40], "top_p": [1.0, 0.9, 0.5],
               "min_p": [0.0, 0.05, 0.3]}
SEEDS = [1, 12345, 0xDEADBEEFCAFEF00D]
N_DRAWS = 40
BUNDLED_PROMPT, BUNDLED_STEPS, BUNDLED_SEED = 160, 16, 7007


def run_mode(build: Path, mode: str, a: str, b: str, out: Path, model: Path = MODEL) -> bytes:
    subprocess.run([str(build / "ds4c_run"), str(model), mode, a, b, str(out)], check=True, capture_output=True)
    return out.read_bytes()


def record_tokenizer(build: Path, t: Path, model: Path) -> dict:
    """ds4.c's tokenizer outputs on one model's vocab."""
    go = lambda mode, a: id_lists(run_mode(build, mode, a, "-", t / "o", model))
    tok = {"texts": TEXTS, "tokenize": go("tokenize", str(t / "texts")),
           "rendered": RENDERED, "rendered_ids": go("rendered", str(t / "rendered")),
           "chats": [list(c) for c in CHATS], "chat_ids": go("chat", str(t / "chats"))}
    raw, vocab, i = run_mode(build, "vocab", "-", "-", t / "o", model), [], 0
    while i < len(raw):
        n = int(np.frombuffer(raw[i:i + 4], "<i4")[0])
        vocab.append(raw[i + 4:i + 4 + n].hex())
        i += 4 + n
    tok["token_text_hex"] = vocab
    tok["model_sha256"] = hashlib.sha256(model.read_bytes()).hexdigest()
    tok["source"] = f"ds4.c 8d57664 (golden build) via tools/ds4c/record.py on {model.name}"
    return tok


def id_lists(raw: bytes) -> list[list[int]]:
    a, out, i = np.frombuffer(raw, "<i4"), [], 0
    while i < len(a):
        out.append(a[i + 1: i + 1 + a[i]].tolist())
        i += 1 + a[i]
    return out


def bundled_prompt(n_vocab: int) -> list[int]:
    rnd = random.Random(BUNDLED_SEED)
    return [0] + [rnd.randrange(2, n_vocab) for _ in range(BUNDLED_PROMPT - 1)]


def trained_prompt() -> list[int]:
    """BOS and the first 159 tokens of data/trained/heldout.txt in the bundled model's vocab."""
    from ds4ref.engine import Engine
    text = (ROOT / "data" / "trained" / "heldout.txt").read_text()
    return [0] + Engine.open(backend="numpy").tokenizer.encode(text)[:BUNDLED_PROMPT - 1]


def record_bundled(build: Path, work: Path, trained: bool = False) -> None:
    """Case "bundled" (the seed-7 synthetic model, random prompt ids) or, with trained=True,
    case "trained" (the bundled trained model, held-out text) in the golden files' layout
    (data/oracle/README.md), from ds4.c's Makefile build."""
    from ds4ref.config import ModelConfig
    from ds4ref.gguf import GGUFFile
    from ds4ref.bundled import default_model_path
    from ds4ref.dev.writer import synthetic_model_path
    model = default_model_path() if trained else synthetic_model_path()
    with GGUFFile(model) as g:
        cfg = ModelConfig.from_gguf(g)
    prompt = trained_prompt() if trained else bundled_prompt(cfg.n_vocab)
    out = {"prompt_ids": np.array(prompt, np.int32),
           "model_sha256": np.array(hashlib.sha256(model.read_bytes()).hexdigest()), "model_name": np.array(model.name)}
    for path, (tokens_key, first_key, steps_key) in PATHS.items():
        logits, fed, log = replay(build, model, path, prompt, BUNDLED_STEPS, work / path)
        n_first = len(prompt) if path == "stream" else 1
        out[first_key] = logits[:n_first] if path == "stream" else logits[0]
        out[steps_key], out[tokens_key] = logits[n_first:], fed.astype(np.int32)
        ids, margin = read_expert_log(log, path, len(prompt), len(fed), cfg.n_expert, cfg.n_expert_used)
        out[f"trace_{path}_expert_ids"], out[f"trace_{path}_expert_margin"] = ids.astype(np.int32), margin
    np.savez_compressed(ORACLE / ("ds4c_trained.npz" if trained else "ds4c_bundled.npz"), **out)


STEER_PROMPT, STEER_STEPS, STEER_SEED = 48, 8, 1105
STEER_CASES = {"none": None, "ffn1": {}, "ffn-2_attn0.5": {"DS4C_STEER_FFN": "-2", "DS4C_STEER_ATTN": "0.5"}}


def record_steering(build: Path, work: Path) -> None:
    """ds4.c with --dir-steering-file/-ffn/-attn (ds4_engine_options) on the oracle model: logits of both paths."""
    from ds4ref.config import ModelConfig
    from ds4ref.gguf import GGUFFile
    with GGUFFile(MODEL) as g:
        cfg = ModelConfig.from_gguf(g)
    rng = np.random.default_rng(STEER_SEED)
    dirs = rng.standard_normal((cfg.n_layer, cfg.n_embd))
    dirs = (dirs / np.linalg.norm(dirs, axis=1, keepdims=True)).astype("<f4")
    dirs_path = ORACLE / "ds4c_steering_dirs.f32"
    dirs.tofile(dirs_path)
    rnd = random.Random(STEER_SEED)
    prompt = [0] + [rnd.randrange(2, cfg.n_vocab) for _ in range(STEER_PROMPT - 1)]
    out = {"prompt_ids": np.array(prompt, np.int32), "dirs": dirs.astype(np.float32),
           "model_sha256": np.array(hashlib.sha256(MODEL.read_bytes()).hexdigest())}
    for case, env in STEER_CASES.items():
        env = None if env is None else dict(env, DS4C_STEER_FILE=str(dirs_path))
        scales = (0.0, 0.0) if env is None else (float(env.get("DS4C_STEER_ATTN", 0)), float(env.get("DS4C_STEER_FFN", 1)))
        out[f"{case}.scales_attn_ffn"] = np.array(scales, np.float32)
        for path in PATHS:
            dump = work / f"{case}.{path}.dump"
            env2 = None if env is None else dict(env, DS4C_STEER_DUMP=str(dump))
            logits, fed, _ = replay(build, MODEL, path, prompt, STEER_STEPS, work / case / path, env=env2)
            out[f"{case}.{path}_logits"], out[f"{case}.{path}_tokens"] = logits, fed.astype(np.int32)
            if env is not None and not dump.exists():
                raise SystemExit(f"{build}: no steering dump; build it with DS4C_PATCH=--dump-steering")
            if case == "ffn-2_attn0.5" and path == "batch":
                out.update(read_steering_dump(dump, cfg.n_embd))
    np.savez_compressed(ORACLE / "ds4c_steering.npz", **out)


def read_steering_dump(dump: Path, n_embd: int) -> dict:
    """shape_patch.py --dump-steering's records -> ops_il, ops_scale [N], ops_x, ops_y [N, n_embd] (prefill
    calls: rows 0, 8, ..., 40 and 47 only)."""
    raw, i, il, sc, xs, ys = dump.read_bytes(), 0, [], [], [], []
    while i < len(raw):
        l, rows = np.frombuffer(raw[i:i + 8], "<u4")
        scale = np.frombuffer(raw[i + 8:i + 12], "<f4")[0]
        i += 12
        n = int(rows) * n_embd * 4
        x = np.frombuffer(raw[i:i + n], "<f4").reshape(rows, n_embd)
        y = np.frombuffer(raw[i + n:i + 2 * n], "<f4").reshape(rows, n_embd)
        i += 2 * n
        keep = list(range(0, rows, 8))[:-1] + [rows - 1] if rows > 1 else [0]
        il += [int(l)] * len(keep)
        sc += [scale] * len(keep)
        xs.append(x[keep])
        ys.append(y[keep])
    return {"ops_il": np.array(il, np.int32), "ops_scale": np.array(sc, np.float32),
            "ops_x": np.concatenate(xs), "ops_y": np.concatenate(ys)}


def write_tokenizer_inputs(t: Path) -> None:
    """The NUL-separated texts, rendered chats and chat turns that record_tokenizer feeds ds4c_run."""
    (t / "texts").write_bytes(b"\0".join(s.encode() for s in TEXTS) + b"\0")
    (t / "rendered").write_bytes(b"\0".join(s.encode() for s in RENDERED) + b"\0")
    (t / "chats").write_bytes(b"".join(b"\0".join(x.encode() for x in c) + b"\0" for c in CHATS))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build", type=Path, required=True)
    ap.add_argument("--steering", action="store_true", help="record only the directional steering case")
    ap.add_argument("--trained", action="store_true",
                    help="record only the bundled trained model: case 'trained' and its tokenizer")
    args = ap.parse_args()
    build = args.build
    if args.trained:
        with tempfile.TemporaryDirectory() as tmp:
            t = Path(tmp)
            write_tokenizer_inputs(t)
            from ds4ref.bundled import default_model_path
            path = ORACLE / "ds4c_tokenizer.json"
            tok = json.loads(path.read_text())
            tok["trained"] = record_tokenizer(build, t, default_model_path())
            path.write_text(json.dumps(tok, ensure_ascii=False, indent=0) + "\n")
            record_bundled(build, t / "trained", trained=True)
        print("wrote", ORACLE / "ds4c_trained.npz", "and key 'trained' of", ORACLE / "ds4c_tokenizer.json")
        return
    if args.steering:
        with tempfile.TemporaryDirectory() as tmp:
            record_steering(build, Path(tmp))
        print("wrote", ORACLE / "ds4c_steering.npz", "and", ORACLE / "ds4c_steering_dirs.f32")
        return
    with tempfile.TemporaryDirectory() as tmp:
        t = Path(tmp)
        write_tokenizer_inputs(t)
        from ds4ref.dev.writer import synthetic_model_path
        tok = record_tokenizer(build, t, MODEL)                      # the oracle's vocab (761 merges)
        tok["bundled"] = record_tokenizer(build, t, synthetic_model_path())   # the writer's trained vocab
        (ORACLE / "ds4c_tokenizer.json").write_text(json.dumps(tok, ensure_ascii=False, indent=0) + "\n")

        rows = list(itertools.product(*SAMPLE_GRID.values(), SEEDS))
        params = np.array([[tp, k, p, mp, s & 0xFFFFFFFF, s >> 32, N_DRAWS] for tp, k, p, mp, s in rows], np.float64)
        (t / "params").write_bytes(params.astype("<f8").tobytes())
        out = {"params": params, "seeds": np.array([s for *_, s in rows], np.uint64)}
        for case in "CA":
            g = np.load(ORACLE / f"golden_{case}.npz")
            (t / "ids").write_bytes(g["prompt_ids"].astype("<i4").tobytes())
            raw = run_mode(build, "sample", str(t / "ids"), str(t / "params"), t / "o")
            per = np.frombuffer(raw, np.uint8).reshape(len(rows), 4 * N_DRAWS + 8)
            out[f"{case}.draws"] = per[:, :4 * N_DRAWS].copy().view("<i4")
            out[f"{case}.rng_after"] = per[:, 4 * N_DRAWS:].copy().view("<u8").ravel()
        np.savez_compressed(ORACLE / "ds4c_sample.npz", **out)
        record_bundled(build, t / "bundled")
    print("wrote", ORACLE / "ds4c_tokenizer.json", ORACLE / "ds4c_sample.npz", "and", ORACLE / "ds4c_bundled.npz")


if __name__ == "__main__":
    main()
