"""tools/ds4c (the local ds4.c builds behind data/oracle/rebuilds.* and ds4c_*): the parts that run without a
ds4.c checkout. The shape patch is checked on a stand-in source holding exactly the patterns it must find
at commit 8d57664 (enum entries and literals), and on one that lacks a pattern."""
from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import numpy as np
import pytest

from ds4ref.config import ModelConfig

TOOLS = Path(__file__).resolve().parents[1] / "tools" / "ds4c"


def _load(name):
    spec = importlib.util.spec_from_file_location(f"ds4c_{name}", TOOLS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


shape_patch, ds4c_io = _load("shape_patch"), _load("ds4c_io")


def stand_in_source() -> str:
    """A C-like text with ds4.c's enum (real values) and each patched literal pattern as often as ds4.c has it."""
    real = ModelConfig.real()
    enum = "enum {\n" + "".join(f"    {name:<22s} = {getattr(real, field)},\n"
                                for name, field in shape_patch.ENUM.items()) + "};\n"
    samples = {0: "float *qr = xmalloc(1024 * sizeof(qr[0]));", 1: "float *q = xmalloc((size_t)n_tok * 1024 * sizeof(q[0]));",
               2: "x + (uint64_t)t * 1024,", 3: "rms_norm_weight(o, x, q_a_norm, 1024, DS4_RMS_EPS);",
               4: "rms_norm_weight(o,\n        x,\n        q_a_norm,\n        1024,\n        DS4_RMS_EPS);",
               5: "const uint32_t rank = 1024;", 6: "const uint32_t n_groups = 8;"}
    body = "\n".join(samples[i] for i, (_, _, n) in enumerate(shape_patch.LITERALS) for _ in range(n))
    select = "    " + shape_patch.EXPERT_SELECT + "\n"
    return enum + body + "\n" + select


def test_shape_patch_writes_the_tiny_shape_and_names_the_literals():
    tiny = ModelConfig.tiny()
    out = shape_patch.patch(stand_in_source(), tiny, log_experts=True)
    for name, field in shape_patch.ENUM.items():
        assert re.search(rf"\n\s+{name}\s+= {getattr(tiny, field)},", out), name
    body = out.split("};", 1)[1]
    assert "1024" not in body                                   # every literal rank became an enum name
    assert "= 8;" not in body and body.count("DS4_N_OUT_GROUP;") == 3
    assert body.count("DS4_N_LORA_Q") == 15 and body.count("rank = DS4_N_LORA_O;") == 3
    assert "DS4C_EXPERT_LOG" in out and out.count(shape_patch.EXPERT_SELECT) == 1


def test_shape_patch_refuses_a_source_it_does_not_recognise():
    src = stand_in_source()
    with pytest.raises(SystemExit, match="DS4_N_HC_SINKHORN_ITER"):
        shape_patch.patch(src.replace("DS4_N_HC_SINKHORN_ITER", "DS4_N_SINKHORN"), ModelConfig.tiny())
    with pytest.raises(SystemExit, match="matched 5 times, expected 6"):
        shape_patch.patch(src.replace("float *qr = xmalloc(1024 * sizeof(qr[0]));", "", 1), ModelConfig.tiny())


def test_expert_log_layout_and_margins_match_the_golden_traces(tmp_path):
    """ds4.c logs top-k choices in call order: the stream path position-major, the batch prefill layer-major
    (layer 3 for every prompt token, then 4, then 5) followed by decode steps position-major. Each record is
    6 int32 ids then the 16 float32 scores; the margin is min(chosen) - max(not chosen)."""
    P, S, n_expert = 4, 2, 16
    rng = np.random.default_rng(0)
    scores = {(p, l): rng.permutation(n_expert).astype(np.float32) / 8 for p in range(P + S) for l in range(3)}
    chosen = {k: np.argsort(-v, kind="stable")[:6].astype(np.int32) for k, v in scores.items()}
    rec = lambda k: chosen[k].tobytes() + scores[k].tobytes()
    orders = {"stream": [(p, l) for p in range(P + S) for l in range(3)],
              "batch": [(p, l) for l in range(3) for p in range(P)] + [(p, l) for p in range(P, P + S) for l in range(3)]}
    for path, order in orders.items():
        log = tmp_path / f"{path}.experts"
        log.write_bytes(b"".join(rec(k) for k in order))
        ids, margin = ds4c_io.read_expert_log(log, path, P, S, n_expert)
        assert ids.shape == (P + S, 3, 6) and margin.shape == (P + S, 3)
        for (p, l), want in chosen.items():
            assert np.array_equal(ids[p, l], want), (path, p, l)
            v = scores[p, l]
            assert margin[p, l] == np.sort(v)[-6] - np.sort(v)[-7]      # 6th best minus 7th best


def test_bench_ds4c_runs_the_driver_warmed_and_reads_its_timings(tmp_path):
    """The engine benchmark's ds4.c rows: `bench_ds4c` calls ds4c_run's bench mode (here a stand-in script that
    records its arguments and environment) with the prompt, the step count, the thread count and DS4C_WARM, and
    turns the three timings it writes into a row like bench_backend's."""
    from ds4ref.dev.bench_programs import bench_ds4c
    exe = tmp_path / "ds4c_run"
    exe.write_text("#!/bin/sh\n"
                   'echo "$1 $2 $4 $DS4C_THREADS $DS4C_WARM" > "$(dirname "$0")/args.txt"\n'
                   'cp "$3" "$(dirname "$0")/ids.bin"\n'
                   'echo "0.5 0.25 0.2" > "$5"\n')
    exe.chmod(0o755)
    r = bench_ds4c(tmp_path, "model.gguf", [0, 5, 7, 9], steps=3, threads=2)   # a build dir is accepted too
    assert (tmp_path / "args.txt").read_text().split() == ["model.gguf", "bench", "3", "2", "1"]
    assert np.fromfile(tmp_path / "ids.bin", "<i4").tolist() == [0, 5, 7, 9]
    assert r["label"] == "ds4.c 2t" and r["prefill_tok_s"] == 8.0 and r["decode_tok_s"] == 4.0
    assert r["decode_s_per_token_min"] == 0.2 and r["profile"] == []
