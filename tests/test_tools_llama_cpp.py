"""The engine benchmark's llama.cpp rows and interleaved rounds (chapter 09, `ds4ref.dev.bench_engine`):
a stand-in llama-bench, the GGUF copy on the oracle model, and the paired ratios. No timings."""
import json
from pathlib import Path

import gguf
import numpy as np
import pytest

from ds4ref.dev.bench_programs import (
    LLAMA_GATING_KEY,
    bench_llama_cpp,
    llama_model_path,
)
from ds4ref.dev.bench_timing import paired_ratios, summarize_rounds

ORACLE = Path(__file__).resolve().parents[1] / "data" / "oracle" / "dev_seed1.gguf"

LLAMA_JSON = [
    {"n_prompt": 16, "n_gen": 0, "n_threads": 2, "avg_ts": 64.0, "samples_ts": [64.0]},
    {"n_prompt": 0, "n_gen": 3, "n_threads": 2, "avg_ts": 40.0, "samples_ts": [40.0]},
]


def test_bench_llama_cpp_runs_llama_bench_and_reads_its_json(tmp_path):
    """`bench_llama_cpp` calls llama-bench (here a stand-in script under build.sh's OUTDIR/bin that
    records its arguments) with the model, prompt length, steps, threads, one repetition and JSON
    output, and turns the prompt and generation tests into a row like bench_ds4c's."""
    exe = tmp_path / "bin" / "llama-bench"
    exe.parent.mkdir()
    exe.write_text("#!/bin/sh\n"
                   'echo "$@" > "$(dirname "$0")/args.txt"\n'
                   f"cat <<'JSON'\n{json.dumps(LLAMA_JSON)}\nJSON\n")
    exe.chmod(0o755)
    model = tmp_path / "model.llama.gguf"
    model.write_bytes(bytes(range(256)) * 300)
    r = bench_llama_cpp(tmp_path, model, 16, steps=3, threads=2)   # OUTDIR
    assert (exe.parent / "args.txt").read_text().split() == [
        "-m", str(model), "-p", "16", "-n", "3", "-t", "2", "-r", "1", "-o", "json"]
    assert r["backend"] == "llama.cpp" and r["label"] == "llama.cpp 2t" and r["threads"] == 2
    assert r["prompt_tokens"] == 16 and r["prefill_tok_s"] == 64.0 and r["prefill_s"] == 0.25
    assert r["decode_steps"] == 3 and r["decode_tok_s"] == 40.0
    assert r["decode_s_per_token_median"] == 0.025 and r["decode_s_per_token_min"] == 0.025
    assert r["profile"] == []
    assert bench_llama_cpp(exe, model, 16, 3, 2)["label"] == "llama.cpp 2t"      # the binary
    with pytest.raises(FileNotFoundError):                   # its pages are read first: it must exist
        bench_llama_cpp(exe, tmp_path / "missing.gguf", 16, 3, 2)


def test_warm_file_reads_every_byte(tmp_path):
    from ds4ref.dev.bench_programs import warm_file
    f = tmp_path / "w.bin"
    f.write_bytes(b"x" * 1000 + b"y" * 5)
    assert warm_file(f, chunk=64) == 1005 and warm_file(f) == 1005


def test_llama_model_path_writes_the_copy_once_with_the_gating_key(tmp_path):
    """The llama.cpp copy sits beside the model as NAME.llama.gguf: every key and tensor of the
    original, plus deepseek4.expert_gating_func = 4; a second call reuses it."""
    src = tmp_path / "dev_seed1.gguf"
    src.write_bytes(ORACLE.read_bytes())
    dst = llama_model_path(src)
    assert dst == tmp_path / "dev_seed1.llama.gguf" and not list(tmp_path.glob("*.partial"))
    old, new = gguf.GGUFReader(str(src)), gguf.GGUFReader(str(dst))
    assert int(new.get_field(LLAMA_GATING_KEY).contents()) == 4
    assert old.get_field(LLAMA_GATING_KEY) is None
    assert set(new.fields) - set(old.fields) == {LLAMA_GATING_KEY}
    assert [t.name for t in new.tensors] == [t.name for t in old.tensors]
    for a, b in zip(old.tensors, new.tensors):
        assert a.tensor_type == b.tensor_type and np.array_equal(a.data, b.data), a.name
    stamp = dst.stat().st_mtime_ns
    assert llama_model_path(src) == dst and dst.stat().st_mtime_ns == stamp


def _row(backend, threads, decode, prefill):
    return {"backend": backend, "label": f"{backend} {threads}t", "threads": threads,
            "decode_tok_s": decode, "prefill_tok_s": prefill}


def test_paired_ratios_pair_numba_with_each_program_per_round():
    """numba Nt over ds4.c Nt and llama.cpp Nt, per round and their median; rows without a partner
    at the same thread count (numpy, numba 1t here against llama.cpp) give no pair."""
    rounds = [{r.get("label", r["backend"]): r for r in rs} for rs in [
        [_row("numba", 2, 20.0, 30.0), _row("numba", 1, 10.0, 12.0),
         {"backend": "numpy", "decode_tok_s": 1.0, "prefill_tok_s": 1.0},
         _row("ds4.c", 2, 5.0, 6.0), _row("ds4.c", 1, 4.0, 4.0), _row("llama.cpp", 2, 40.0, 60.0)],
        [_row("numba", 2, 30.0, 30.0), _row("numba", 1, 10.0, 12.0),
         {"backend": "numpy", "decode_tok_s": 1.0, "prefill_tok_s": 1.0},
         _row("ds4.c", 2, 10.0, 6.0), _row("ds4.c", 1, 5.0, 4.0), _row("llama.cpp", 2, 30.0, 60.0)],
        [_row("numba", 2, 20.0, 40.0), _row("numba", 1, 10.0, 12.0),
         {"backend": "numpy", "decode_tok_s": 1.0, "prefill_tok_s": 1.0},
         _row("ds4.c", 2, 4.0, 8.0), _row("ds4.c", 1, 2.0, 3.0), _row("llama.cpp", 2, 10.0, 80.0)]]]
    got = paired_ratios(rounds)
    assert set(got) == {"numba 2t / ds4.c 2t", "numba 2t / llama.cpp 2t", "numba 1t / ds4.c 1t"}
    p = got["numba 2t / ds4.c 2t"]
    assert p["decode"] == [4.0, 3.0, 5.0] and p["decode_median"] == 4.0
    assert p["prefill"] == [5.0, 5.0, 5.0] and p["prefill_median"] == 5.0
    q = got["numba 2t / llama.cpp 2t"]
    assert q["decode"] == [0.5, 1.0, 2.0] and q["decode_median"] == 1.0
    assert q["prefill"] == [0.5, 0.5, 0.5]
    assert got["numba 1t / ds4.c 1t"]["decode"] == [2.5, 2.0, 5.0]


def test_summarize_rounds_keeps_the_median_round_and_the_spread():
    rows = [dict(_row("numba", 2, d, p), round=i)
            for i, (d, p) in enumerate([(20.0, 30.0), (10.0, 35.0), (30.0, 25.0), (25.0, 40.0)])]
    r = summarize_rounds(rows)
    assert r["round"] == 0                                  # lower middle of 10, 20, 25, 30
    spread = {k: tuple(r[f"{k}_tok_s_{s}"] for s in ("min", "median", "max"))
              for k in ("decode", "prefill")}
    assert spread == {"decode": (10.0, 22.5, 30.0), "prefill": (25.0, 32.5, 40.0)}
    assert r["decode_tok_s_rounds"] == [20.0, 10.0, 30.0, 25.0]


def test_main_interleaves_rounds_and_stores_the_ratios(tmp_path, monkeypatch):
    """`main --rounds 2 --ds4c --llama-cpp` on the oracle model standing in for the wide one (and
    stand-ins for both programs): every row runs once per round in the same order, each kept row
    carries its spread, and the results file holds the paired ratios."""
    import ds4ref.dev.bench_engine as be
    calls = []
    model = tmp_path / "wide.gguf"
    model.write_bytes(ORACLE.read_bytes())
    fake = {"gbps": 10.0, "parallel_gbps": 10.0, "numpy_1_thread_gbps": 10.0, "threads": 1}
    monkeypatch.setattr(be, "wide_model_path", lambda cache=None: model)
    monkeypatch.setattr(be, "read_bandwidth", lambda: dict(fake))

    def stand_in(name):
        def run(*args):
            calls.append(f"{name} {args[-1]}t")
            return {**_row(name, args[-1], 10.0 + len(calls), 20.0), "profile": []}
        return run
    monkeypatch.setattr(be, "bench_ds4c", stand_in("ds4.c"))
    monkeypatch.setattr(be, "bench_llama_cpp", stand_in("llama.cpp"))
    monkeypatch.setattr(be, "bench_numbered", lambda *a: stand_in("numba")(a[-2]))
    monkeypatch.setattr(be.os, "cpu_count", lambda: 2)
    from numba import config          # NUMBA_NUM_THREADS=1 in the environment caps the rows
    monkeypatch.setattr(config, "NUMBA_NUM_THREADS", 2)
    out = tmp_path / "bench.json"
    res = be.main(["--backends", "numba", "--models", "wide", "--numba-threads", "2",
                   "--rounds", "2", "--ds4c", "x", "--llama-cpp", "y", "--out", str(out)])
    one = ["numba 2t", "ds4.c 2t", "ds4.c 1t", "llama.cpp 2t", "llama.cpp 1t"]
    assert calls == one + one
    assert (tmp_path / "wide.llama.gguf").exists()
    runs = res["models"]["wide"]["runs"]
    assert [r["label"] for r in runs] == one
    assert runs[0]["decode_tok_s_rounds"] == [11.0, 16.0]
    pair = json.loads(out.read_text())["ratios"]["wide"]["numba 2t / llama.cpp 2t"]
    assert pair["decode"] == [11.0 / 14.0, 16.0 / 19.0] and pair["prefill"] == [1.0, 1.0]


def _tool(name):
    import importlib.util
    import sys
    path = Path(__file__).resolve().parents[1] / "tools" / "llama_cpp" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"llama_cpp_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def test_mtp_for_llama_writes_llamas_nextn_layout(tmp_path):
    """The bundled model's MTP GGUF as llama.cpp's MTP-only deepseek4 file: one appended block
    (block_count 7, nextn_predict_layers 1, a 7th ratio / clamp entry), no trunk layer, the block's
    tensors under blk.6, eh_proj = e_proj and h_proj side by side, the HC head and head norm the
    block's, embedding and LM head the target's."""
    from ds4ref.dev.writer import synthetic_model_path, synthetic_mtp_path
    tool = _tool("mtp_for_llama")
    dst = tool.write_mtp_for_llama(synthetic_model_path(), synthetic_mtp_path(), tmp_path / "m.gguf")
    r, main, mtp = (gguf.GGUFReader(str(p)) for p in (dst, synthetic_model_path(), synthetic_mtp_path()))
    val = lambda k: r.get_field(k).contents()
    assert val("deepseek4.block_count") == 7 and val("deepseek4.nextn_predict_layers") == 1
    assert val("deepseek4.attention.compress_ratios") == [0, 0, 4, 128, 4, 128, 0]
    assert val("deepseek4.swiglu_clamp_exp") == [10.0] * 7 and val(LLAMA_GATING_KEY) == 4
    assert val("tokenizer.ggml.tokens") == main.get_field("tokenizer.ggml.tokens").contents()
    t = {x.name: x for x in r.tensors}
    src = {x.name: x for x in main.tensors} | {x.name: x for x in mtp.tensors}
    assert not any(n.startswith(("blk.0.", "blk.5.", "mtp.")) for n in t)
    assert len(t) == 3 + 32 - 1                            # e_proj + h_proj -> one eh_proj
    same = {"token_embd.weight": "token_embd.weight", "output.weight": "output.weight",
            "output_hc_fn.weight": "mtp.0.hc_head_fn.weight",
            "blk.6.nextn.shared_head_norm.weight": "mtp.0.norm.weight",
            "blk.6.nextn.hnorm.weight": "mtp.0.hnorm.weight",
            "blk.6.exp_probs_b.bias": "mtp.0.exp_probs_b.bias",
            "blk.6.ffn_down_exps.weight": "mtp.0.ffn_down_exps.weight"}
    for ours, theirs in same.items():
        assert t[ours].tensor_type == src[theirs].tensor_type, ours
        assert np.array_equal(t[ours].data, src[theirs].data), ours
    eh = t["blk.6.nextn.eh_proj.weight"]
    assert [int(n) for n in eh.shape] == [512, 256] and eh.tensor_type == gguf.GGMLQuantizationType.Q8_0
    e, h = src["mtp.0.e_proj.weight"].data, src["mtp.0.h_proj.weight"].data
    assert np.array_equal(eh.data[:, :e.shape[1]], e) and np.array_equal(eh.data[:, e.shape[1]:], h)


def test_read_dump_reads_the_drivers_records(tmp_path):
    """mtp_crosscheck.read_dump: 64-byte name, four int64 dims (ggml order), float32 data."""
    tool = _tool("mtp_crosscheck")
    a = np.arange(6, dtype="<f4").reshape(2, 3)
    rec = lambda n, x, ne: n.encode().ljust(64, b"\0") + np.array(ne, "<i8").tobytes() + x.tobytes()
    (tmp_path / "d").write_bytes(rec("kv-6", a, [3, 2, 1, 1]) + rec("kv-6", a + 1, [3, 2, 1, 1])
                                 + rec("q", a[0], [3, 1, 1, 1]))
    got = tool.read_dump(tmp_path / "d")
    assert set(got) == {"kv-6", "q"} and np.array_equal(got["kv-6"], a)     # the first of a name
    assert np.array_equal(got["q"], a[0])


def test_mtp_crosscheck_builds_its_inputs():
    """mtp_crosscheck.ds4ref_inputs (ds4ref's side of the llama.cpp MTP cross-check) runs on the synthetic
    model: the recorded prompt tokens and positions of data/llama_cpp/mtp_tiny_seed7.npz, then DRAFTS drafts,
    each the argmax of the step before at the next position, with HC states of the model's shape. (The float
    values are not compared: on random weights a last-bit difference flips a code and moves them by ~1e-2.)"""
    from ds4ref.dev.writer import synthetic_model_path, synthetic_mtp_path
    from ds4ref.engine import Engine
    tool = _tool("mtp_crosscheck")
    rec = np.load(Path(__file__).resolve().parents[1] / "data" / "llama_cpp" / "mtp_tiny_seed7.npz")
    eng = Engine.open(synthetic_model_path(), backend="numpy", mtp_path=synthetic_mtp_path())
    toks, pos, h_in, logits, h_out = tool.ds4ref_inputs(eng)
    n, cfg = int(rec["n_prompt"]), eng.cfg
    assert len(toks) == n + tool.DRAFTS and np.array_equal(toks[:n], rec["tokens"][:n])
    assert np.array_equal(pos, np.arange(len(toks)))
    assert h_in.shape == h_out.shape == (len(toks), cfg.n_hc, cfg.n_embd) and logits.shape == (len(toks), cfg.n_vocab)
    assert all(int(toks[i]) == int(np.argmax(logits[i - 1])) for i in range(n, len(toks)))
    assert np.array_equal(h_in[n:], h_out[n - 1:-1])        # a draft's input is the step before's output
