"""The engine benchmark's llama.cpp rows and interleaved rounds (chapter 09, `ds4ref.bench_engine`):
a stand-in llama-bench, the GGUF copy on the oracle model, and the paired ratios. No timings."""
import json
from pathlib import Path

import gguf
import numpy as np
import pytest

from ds4ref.bench_engine import (LLAMA_GATING_KEY, bench_llama_cpp, llama_model_path,
                                 paired_ratios, summarize_rounds)

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
    r = bench_llama_cpp(tmp_path, "model.llama.gguf", 16, steps=3, threads=2)   # OUTDIR
    assert (exe.parent / "args.txt").read_text().split() == [
        "-m", "model.llama.gguf", "-p", "16", "-n", "3", "-t", "2", "-r", "1", "-o", "json"]
    assert r["backend"] == "llama.cpp" and r["label"] == "llama.cpp 2t" and r["threads"] == 2
    assert r["prompt_tokens"] == 16 and r["prefill_tok_s"] == 64.0 and r["prefill_s"] == 0.25
    assert r["decode_steps"] == 3 and r["decode_tok_s"] == 40.0
    assert r["decode_s_per_token_median"] == 0.025 and r["decode_s_per_token_min"] == 0.025
    assert r["profile"] == []
    assert bench_llama_cpp(exe, "m", 16, 3, 2)["label"] == "llama.cpp 2t"        # the binary


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
    import ds4ref.bench_engine as be
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
