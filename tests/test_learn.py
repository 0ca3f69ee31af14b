"""Build it yourself (tools/learn.py): the learner's notebooks generated from the
chapters' `learn:` tags, their stubs and fallback, and the check against ds4.c's
recorded values. A planted bug must be located at the right op, layer, position and
index, with ds4.c's value as the expected one; the chapters' own code must pass."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

import learn  # noqa: E402
from learn import (CORE, LearnError, cells, chapter_path, load, make,  # noqa: E402
                   marked)
from learn_checks import CHECKS, check, oracle, report  # noqa: E402

from ds4ref.bundled import data_path  # noqa: E402


def test_every_core_chapter_marks_functions_that_have_a_check():
    names = {nn: [q for _, q in marked(nn)] for nn in CORE}
    assert all(names.values()), names
    assert sorted(q for qs in names.values() for q in qs) == sorted(CHECKS)
    assert names["04"] == ["rms_norm_weight", "hc_split_sinkhorn"]
    assert names["08"] == ["Session.sync"]


def test_the_tags_leave_the_tangled_package_alone():
    """A tag is metadata: the tangler reads sources only, so ds4ref/ is unchanged."""
    sys.path.insert(0, str(ROOT / "tools"))
    import tangle
    want = tangle.tangle()
    for path, text in want.items():
        assert path.read_text() == text, path


def test_stub_keeps_signature_and_docstring_and_raises_a_clear_message(tmp_path):
    ns = load("04", make("04", tmp_path / "04.ipynb"))
    fn = ns["rms_norm_weight"]
    assert fn.exercise == ("norms", "rms_norm_weight")
    assert "Mirrors ds4.c: rms_norm_weight" in fn.__doc__
    x = np.arange(1, 9, dtype=np.float32)
    with pytest.raises(NotImplementedError) as e:
        fn.__wrapped__(x, np.ones(8, np.float32))
    assert str(e.value) == ("rms_norm_weight: write me, then check it: "
                            "tools/learn.py check 04")


def test_an_unwritten_function_falls_back_to_the_book_saying_so_once(tmp_path, capsys):
    from ds4ref.norms import rms_norm_weight
    ns = load("04", make("04", tmp_path / "04.ipynb"))
    x = np.arange(1, 9, dtype=np.float32)
    w = np.linspace(0.5, 2, 8, dtype=np.float32)
    assert np.array_equal(ns["rms_norm_weight"](x, w), rms_norm_weight(x, w))
    assert np.array_equal(ns["rms_norm_weight"](x, w), rms_norm_weight(x, w))
    assert capsys.readouterr().out == (
        "rms_norm_weight: not written yet, running the book's "
        "(ds4ref.norms.rms_norm_weight)\n")


def test_the_unwritten_steps_of_the_reader_fall_back_to_the_book(tmp_path, capsys):
    import gguf
    ns = load("01", make("01", tmp_path / "01.ipynb"))
    path = data_path("oracle") / "dev_seed1.gguf"
    c = ns["_Cursor"](path.read_bytes())
    _, n_tensors, n_kv = ns["parse_header"](c)
    _, _, alignment = ns["parse_metadata"](c, n_kv)
    tensors, _, _ = ns["parse_tensors"](c, n_tensors, alignment)
    assert len(tensors) == len(gguf.GGUFReader(path).tensors) == 178
    out = capsys.readouterr().out
    assert "parse_metadata: not written yet" in out
    assert "parse_tensors: not written yet" in out


def test_an_unwritten_method_falls_back_too(tmp_path, capsys):
    from ds4ref.engine import Engine
    ns = load("08", make("08", tmp_path / "08.ipynb"))
    eng = Engine.open(data_path("oracle") / "dev_seed1.gguf", backend="numpy")
    assert ns["Session"](eng, 64).sync([1, 2, 3]) == 3
    assert "Session.sync: not written yet" in capsys.readouterr().out


def test_unwritten_functions_are_reported_as_such_not_as_failures(tmp_path):
    results = check("04", make("04", tmp_path / "04.ipynb"))
    assert [(r.name, r.status) for r in results] == [
        ("rms_norm_weight", "todo"), ("hc_split_sinkhorn", "todo")]
    assert "0 of 2 functions agree" in report("04", results)


@pytest.mark.parametrize("nn", CORE)
def test_the_chapters_own_code_passes_the_check(nn):
    results = check(nn, chapter_path(nn))
    assert [r.status for r in results] == ["ok"] * len(results), report(nn, results)


def written(tmp_path, nn, qualname, old, new):
    """A learner's notebook of chapter nn where `qualname` is written as the book
    writes it, with `old` replaced by `new` (the planted bug); the rest stays stubs."""
    path = make(nn, tmp_path / f"{nn}.ipynb")
    book = json.loads(chapter_path(nn).read_text())
    cell, src, mod, tags = next(c for c in cells(book) if qualname in c[3])
    assert src.count(old) == 1, (qualname, old)
    src = src.replace(old, new)
    for other in tags:
        if other != qualname:
            src = learn.stub_source(src, mod, other, nn)
    nb = json.loads(path.read_text())
    mine = next(c for c in nb["cells"] if c.get("id") == cell["id"])
    mine["source"] = src.splitlines(keepends=True)
    path.write_text(json.dumps(nb, indent=1))
    return path


def result(results, name):
    return next(r for r in results if r.name == name)


def test_a_wrong_eps_in_rmsnorm_is_located_at_the_first_norm(tmp_path):
    ops, cfg, W, positions = oracle()
    nb = written(tmp_path, "04", "rms_norm_weight", "_rms_scale(x, eps)) * w",
                 "_rms_scale(x, 1e-2)) * w")
    r = check("04", nb)
    assert [x.status for x in r] == ["differs", "todo"]
    msg = r[0].message
    assert msg.startswith(f"layer 0, position {positions[0]}: attn_x -> attn_norm: "
                          "largest difference at [dim ")
    assert msg.endswith("bound 5e-07)")
    dim = int(msg.split("[dim ")[1].split("]")[0])
    want = ops[f"L0.P{positions[0]}.attn_norm"][dim]
    assert f"expected {float(want):.7g}, got " in msg


def test_a_sign_flip_in_rope_is_located_at_the_first_nonzero_angle(tmp_path):
    ops, cfg, W, positions = oracle()
    nb = written(tmp_path, "05", "rope_tail", "= x0 * c - x1 * s", "= x0 * c + x1 * s")
    r = result(check("05", nb), "rope_tail")
    assert r.status == "differs"
    p = positions[1]          # position 0 rotates by 0: the flip shows from the next
    assert r.message.startswith(
        f"layer 0 (ratio 0), position {p}: q_normed -> q_rope at {p}: largest "
        "difference at [head "), r.message
    h, d = (int(v.split()[-1]) for v in r.message.split("[")[1].split("]")[0]
            .split(", "))
    assert d >= cfg.head_dim - cfg.n_rot           # only the rotated tail moves
    assert f"expected {float(ops[f'L0.P{p}.q_rope'][h, d]):.7g}" in r.message


def test_an_off_by_one_in_topk_routing_names_the_slot_and_the_experts(tmp_path):
    ops, cfg, W, positions = oracle()
    nb = written(tmp_path, "07", "topk_selected_experts", "return topk_desc(score, k)",
                 "return topk_desc(score, k + 1)[..., 1:]")
    r = check("07", nb)
    top = result(r, "topk_selected_experts")
    assert result(r, "hash_selected_experts").status == "todo"
    assert top.status == "differs"
    l, p = cfg.n_hash_layer, positions[0]
    ids = ops[f"L{l}.P{p}.exp_ids"]
    assert top.message == (
        f"layer {l} (top-k), position {p}: router_probs + bias -> exp_ids: first "
        f"difference at [slot 0]: expected {int(ids[0])}, got {int(ids[1])} (must be "
        "equal; 6 of 6 differ)")


def test_signed_codes_read_as_unsigned_are_located_at_the_first_negative_weight(
        tmp_path):
    import gguf
    from gguf.quants import dequantize
    nb = written(tmp_path, "02", "_dequantize_q8_0", 'b["qs"].astype(np.float32)',
                 'b["qs"].view(np.uint8).astype(np.float32)')
    r = result(check("02", nb), "_dequantize_q8_0")
    assert r.status == "differs"
    t = next(t for t in gguf.GGUFReader(data_path("oracle") / "dev_seed1.gguf").tensors
             if int(t.tensor_type) == 8)
    want = dequantize(np.asarray(t.data)[:8], t.tensor_type)
    row, i = (int(v) for v in np.argwhere(want < 0)[0])
    assert r.message.startswith(
        f"tensor {t.name!r}, rows 0-7, as `gguf` dequantizes it: first difference at "
        f"[row {row}, weight {i}]: expected {float(want[row, i])!r}, got "), r.message


def test_a_sync_that_always_rebuilds_is_caught_at_the_first_extension(tmp_path):
    nb = written(tmp_path, "08", "Session.sync",
                 "if self._valid and len(toks) >= len(live)",
                 "if False and len(toks) >= len(live)")
    r = check("08", nb)[0]
    g = np.load(data_path("oracle") / "golden_C.npz")
    assert r.status == "differs"
    assert r.message.startswith(
        f"step 0: sync(the transcript + greedy token {int(g['greedy_tokens'][0])}): "
        "tokens computed")
    assert r.message.endswith(f"expected 1, got {len(g['prompt_ids']) + 1} (must be "
                              "equal)")


def test_a_directory_read_without_its_alignment_padding_names_the_offset(tmp_path):
    import gguf
    nb = written(tmp_path, "01", "parse_tensors",
                 "data_offset = -(-c.pos // alignment) * alignment",
                 "data_offset = c.pos")
    r = check("01", nb)[1]
    t = gguf.GGUFReader(data_path("oracle") / "dev_seed1.gguf").tensors[0]
    assert r.status == "differs"
    assert r.message.startswith(f"tensor {t.name!r} (type, shape, offset, nbytes): "
                                "first difference at the data offset: expected "
                                f"{int(t.data_offset)}, got "), r.message


def test_the_command_line(tmp_path):
    def run(*args):
        return subprocess.run([sys.executable, str(ROOT / "tools" / "learn.py"), *args],
                              capture_output=True, text=True, cwd=tmp_path)
    todo = run("check", "07", "--notebook", str(make("07", tmp_path / "07.ipynb")))
    assert todo.returncode == 0, todo.stderr
    assert "hash_selected_experts    not written yet" in todo.stdout
    bad = written(tmp_path, "07", "hash_selected_experts", "table, token, axis=0",
                  "table, token + 1, axis=0")
    out = run("check", "07", "--notebook", str(bad))
    assert out.returncode == 1 and "hash_selected_experts    DIFFERS: layer 0 (hash)" \
        in out.stdout, out.stdout
    missing = run("check", "07", "--notebook", str(tmp_path / "nope.ipynb"))
    assert missing.returncode == 2 and "no learner's notebook" in missing.stderr
    assert run("check", "99").returncode == 2


def test_unknown_chapter_and_unexported_marks_are_named():
    with pytest.raises(LearnError, match="chapter '99'"):
        chapter_path("99")
    with pytest.raises(LearnError, match="no such function"):
        learn.stub_source("def f():\n    pass\n", "m", "g", "04")


def test_in_the_learners_kernel_their_function_replaces_the_books(tmp_path,
                                                                  monkeypatch):
    """Once its cell has run, a later `from ds4ref.norms import rms_norm_weight` in the
    learner's notebook gets theirs; unwritten, it still computes the book's."""
    import types

    import ds4ref.norms as norms
    book = norms.rms_norm_weight
    monkeypatch.setattr(norms, "rms_norm_weight", book)      # restored afterwards
    nb = json.loads(make("04", tmp_path / "04.ipynb").read_text())
    kernel = types.ModuleType("learn_kernel")
    monkeypatch.setitem(sys.modules, kernel.__name__, kernel)
    for c in nb["cells"]:
        src = "".join(c["source"])
        tags = c["metadata"].get("tags", [])
        if c.get("id") == "learn-helper" or "learn:rms_norm_weight" in tags:
            exec(src, kernel.__dict__)
    from ds4ref.norms import rms_norm_weight as later
    assert later is kernel.rms_norm_weight is not book
    x, w = np.arange(1, 9, dtype=np.float32), np.full(8, 0.5, np.float32)
    assert np.array_equal(later(x, w), book(x, w))


def test_a_cell_that_does_not_run_is_named(tmp_path):
    nb = written(tmp_path, "07", "hash_selected_experts",
                 "    table = lw.ffn_gate_tid2eid", "    table = lw.ffn_gate_tid2eid)")
    with pytest.raises(LearnError, match=r"07\.ipynb: cell \w+ does not run: "
                                         "SyntaxError"):
        check("07", nb)


@pytest.mark.parametrize("nn", CORE)
def test_the_generated_cells_stay_within_88_columns_and_compile(tmp_path, nn):
    nb = json.loads(make(nn, tmp_path / f"{nn}.ipynb").read_text())
    mine = [c for c in nb["cells"] if c.get("id") == "learn-helper"
            or any(t.startswith("learn:") for t in c["metadata"].get("tags", []))]
    assert len(mine) == 1 + len({c["id"] for c in mine[1:]}) >= 2
    for c in mine:
        src = "".join(c["source"])
        compile(src, c["id"], "exec")
        assert max(len(line) for line in src.splitlines()) <= 88, c["id"]


def test_make_keeps_a_learners_notebook_unless_forced(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(learn, "LEARN", tmp_path)
    assert learn.main(["make", "07"]) == 0
    mine = tmp_path / "07_moe.ipynb"
    mine.write_text(mine.read_text().replace("write me", "my work"))
    assert learn.main(["make", "07"]) == 0 and "my work" in mine.read_text()
    assert learn.main(["make", "07", "--force"]) == 0
    assert "my work" not in mine.read_text()
    assert capsys.readouterr().out.splitlines() == [
        f"wrote {mine}", f"kept {mine} (yours: --force writes a fresh copy over it)",
        f"wrote {mine}"]


def first_case(key):
    """(layer, position) of the first case, in the check's order, that has ops `key`."""
    ops, cfg, W, positions = oracle()
    return next((l, p) for l in range(cfg.n_layer) for p in positions
                if f"L{l}.P{p}.{key}" in ops)


def expected_in(msg: str, want) -> bool:
    """The message's index, read back, points at the oracle value it quotes."""
    idx = tuple(int(part.split()[-1]) for part in
                msg.split(" at [")[1].split("]")[0].split(", "))
    v = np.asarray(want)[idx]
    quoted = f"{float(v):.7g}" if "largest difference" in msg else repr(v.item())
    return f"expected {quoted}, got " in msg


# (chapter, function, book text, planted text, output key of the first case, where)
PLANTED = [
    ("03", "matvec_q8_0_prequant", "(wd[:, :, None] * xd.T[:, None])", "wd[:, :, None]",
     "qr", "qr = attn_q_a . q8.attn_q_a"),
    ("04", "hc_split_sinkhorn", "post = 2.0 / (1.0", "post = 1.0 / (1.0",
     "attn_hc_split", "attn_hc_mix -> attn_hc_split"),
    ("05", "attention_rows", "denom = np.exp(sinks[:, None] - m) + ", "denom = ",
     "heads", "heads from q_rope"),
    ("06", "compressor_pool", "(w * kv).sum(axis=0) / w.sum(axis=0)",
     "(w * kv).sum(axis=0)", "comp_pooled", "comp_state -> comp_pooled"),
    ("06", "indexer_topk", "[:top_k]", "[1:top_k + 1]", "idx_selected",
     "the top 16 of"),
]


@pytest.mark.parametrize("nn, name, old, new, key, what", PLANTED,
                         ids=[p[1] for p in PLANTED])
def test_a_planted_bug_is_located_at_its_first_case(tmp_path, nn, name, old, new, key,
                                                   what):
    ops, cfg, W, positions = oracle()
    r = result(check(nn, written(tmp_path, nn, name, old, new)), name)
    l, p = first_case(key)
    assert r.status == "differs", r
    assert r.message.startswith(f"layer {l}") and f"position {p}: {what}" in r.message
    assert expected_in(r.message, ops[f"L{l}.P{p}.{key}"]), r.message


def test_a_wrong_shift_in_iq2_xxs_decoding_is_found_against_gguf(tmp_path):
    import gguf
    from gguf.quants import dequantize
    nb = written(tmp_path, "02", "unpack_iq2_xxs_indices", "(aux >> np.uint32(28))",
                 "(aux >> np.uint32(27))")
    r = result(check("02", nb), "unpack_iq2_xxs_indices")
    t = next(t for t in gguf.GGUFReader(data_path("oracle") / "dev_seed1.gguf").tensors
             if int(t.tensor_type) == 16)
    assert r.status == "differs"
    assert r.message.startswith(f"tensor {t.name!r}, rows 0-7")
    raw = np.asarray(t.data).reshape(-1, t.data.shape[-1])[:8]
    assert expected_in(r.message, dequantize(raw, t.tensor_type))


def test_one_sinkhorn_pass_short_is_found_where_it_first_shows(tmp_path):
    """19 passes instead of 20 stay within the bound until the comb has not converged:
    the check names the first case where the book's own 19-pass split leaves it."""
    from ds4ref.checks import rel
    from ds4ref.hc import hc_split_sinkhorn
    ops, cfg, W, positions = oracle()
    first = next(
        (l, p, s) for l in range(cfg.n_layer) for p in positions
        for s in ("attn", "ffn")
        if rel(np.concatenate([np.ravel(a) for a in hc_split_sinkhorn(
            ops[f"L{l}.P{p}.{s}_hc_mix"], getattr(W.layers[l], f"hc_{s}_scale"),
            getattr(W.layers[l], f"hc_{s}_base"), cfg.n_hc, 19)]),
            ops[f"L{l}.P{p}.{s}_hc_split"]) > 5e-7)
    r = result(check("04", written(tmp_path, "04", "hc_split_sinkhorn",
                                   "for _ in range(1, iters):",
                                   "for _ in range(2, iters):")), "hc_split_sinkhorn")
    l, p, s = first
    assert r.status == "differs"
    assert r.message.startswith(f"layer {l}, position {p}: {s}_hc_mix -> {s}_hc_split")
    assert expected_in(r.message, ops[f"L{l}.P{p}.{s}_hc_split"])


# --- a learner's mistakes: a clear message and an exit status, never a traceback ----

def cli(*args, cwd=ROOT):
    """tools/learn.py run as a learner runs it (a hang fails the test, not the
    suite)."""
    return subprocess.run([sys.executable, str(ROOT / "tools" / "learn.py"), *args],
                          capture_output=True, text=True, cwd=cwd, timeout=120)


def refused(out, *phrases):
    """The run was refused with one `tools/learn.py: ...` line naming what is wrong."""
    assert out.returncode == 2, (out.stdout, out.stderr)
    assert "Traceback" not in out.stderr, out.stderr
    line = out.stderr.strip().splitlines()[-1]
    assert line.startswith("tools/learn.py"), out.stderr
    for p in phrases:
        assert p in line, line
    return line


NOT_NOTEBOOKS = [  # (file name, content or None for a folder, what the message says)
    ("folder.ipynb", None, "a folder, not a notebook"),
    ("notes.txt", b"my notes\n", "not a notebook (not valid JSON: Expecting value at "
                                "line 1, column 1)"),
    ("empty.ipynb", b"", "not a notebook (not valid JSON"),
    ("cut.ipynb", b'{"cells": [', "not a notebook (not valid JSON"),
    ("latin1.ipynb", b"\xff\xfe{}", "not a notebook (not UTF-8 text"),
    ("list.ipynb", b"[1, 2]", "not a notebook (no list of cells)"),
    ("nocells.ipynb", b'{"metadata": {}}', "not a notebook (no list of cells)"),
    ("nosource.ipynb", b'{"cells": [{"cell_type": "code"}]}',
     "cell 0 has no source text"),
    ("tags.ipynb", b'{"cells": [{"cell_type": "code", "source": "", "metadata": '
     b'{"tags": "learn:rms_norm_weight"}}]}', "cell 0 has metadata.tags that is not"),
]


@pytest.mark.parametrize("name, content, says", NOT_NOTEBOOKS,
                         ids=[n[0] for n in NOT_NOTEBOOKS])
def test_a_file_that_is_no_notebook_is_named(tmp_path, name, content, says):
    path = tmp_path / name
    path.mkdir() if content is None else path.write_bytes(content)
    refused(cli("check", "04", "--notebook", str(path)), str(path), says)


def test_another_chapters_notebook_is_named_with_the_command_that_checks_it(
        tmp_path):
    nb = make("05", tmp_path / "05.ipynb")
    refused(cli("check", "04", "--notebook", str(nb)), "chapter 05's notebook",
            f"check 05 --notebook {nb}", "chapter 04 marks rms_norm_weight, "
            "hc_split_sinkhorn")
    refused(cli("check", "04", "--notebook", str(chapter_path("09"))),
            "no cell is marked `learn:<name>`", "not chapter 04's")


def test_a_chapter_without_functions_to_write_says_so_before_asking_for_make():
    refused(cli("check", "09"), "chapter 09: no function to write")


@pytest.mark.parametrize("typed", ["4", "04_norms_hc"])
def test_a_chapter_typed_as_a_file_name_or_one_digit_gets_the_number_meant(typed):
    refused(cli("check", typed), f"chapter {typed!r}", "did you mean 04?")


def learner_with(tmp_path, nn, cell_has, edit):
    """A fresh learner's notebook of chapter nn whose (first) cell containing
    `cell_has` is edited by edit(source) -> source."""
    path = make(nn, tmp_path / f"{nn}.ipynb")
    nb = json.loads(path.read_text())
    cell = next(c for c in nb["cells"] if cell_has in "".join(c["source"]))
    cell["source"] = edit("".join(cell["source"]))
    path.write_text(json.dumps(nb))
    return path


@pytest.mark.parametrize("edit, says", [
    (lambda s: s.replace("def rms_norm_weight(", "def my_norm("),
     "cell 580c6441 (marked learn:rms_norm_weight) defines no `rms_norm_weight`: "
     "renamed or deleted?"),
    (lambda s: s.replace("#| export\n", "", 1),
     "cell 580c6441 (marked learn:rms_norm_weight) has lost its `#| export` line: "
     "the check runs only export cells"),
], ids=["renamed", "unexported"])
def test_a_renamed_or_unexported_function_is_named_with_its_cell(tmp_path, edit, says):
    nb = learner_with(tmp_path, "04", "def rms_norm_weight(", edit)
    r = check("04", nb)
    assert [(x.status, x.message) for x in r] == [("error", says),
                                                 ("todo", "not written yet")]


def test_a_function_the_check_calls_that_is_gone_is_named(tmp_path):
    nb = learner_with(tmp_path, "01", "def parse_header(",
                      lambda s: s.replace("def parse_header(", "def read_header("))
    r = result(check("01", nb), "parse_metadata")
    assert r.status == "error"
    assert r.message.startswith("the notebook defines no `parse_header` (the check "
                                "calls it)"), r.message


BOOK_RETURN = "return (x * _rms_scale(x, eps)) * w"   # the book's last line

# (the last line of the learner's rms_norm_weight, what the check says)
RETURNS = [
    ("(x * _rms_scale(x, eps)) * w", "returned None (a missing `return`?)"),
    ("return list((x * _rms_scale(x, eps)) * w)",
     "returned list, not a numpy array (expected float32 (256,))"),
    ("return ((x * _rms_scale(x, eps)) * w).astype(np.float64)",
     "dtype float64, expected float32 (as ds4.c computes it)"),
    ("return ((x * _rms_scale(x, eps)) * w).astype(np.int64)",
     "dtype int64, expected float32 (as ds4.c computes it)"),
]


@pytest.mark.parametrize("new, says", RETURNS, ids=["None", "list", "float64", "int"])
def test_what_a_function_returns_is_judged_by_its_kind_first(tmp_path, new, says):
    """A float64 result passes a comparison in float32 and a list passes np.asarray:
    both are named, as a missing return is, not measured as values."""
    ops, cfg, W, positions = oracle()
    assert ops[f"L0.P{positions[0]}.attn_norm"].shape == (cfg.n_embd,) == (256,)
    nb = written(tmp_path, "04", "rms_norm_weight", BOOK_RETURN, new)
    r = check("04", nb)[0]
    assert (r.status, r.message) == (
        "differs", f"layer 0, position {positions[0]}: attn_x -> attn_norm: {says}")


def test_floats_for_expert_ids_and_a_float64_decoder_are_named(tmp_path):
    nb = written(tmp_path, "07", "topk_selected_experts", "return topk_desc(score, k)",
                 "return topk_desc(score, k).astype(np.float64)")
    r = result(check("07", nb), "topk_selected_experts")
    assert r.message.endswith("dtype float64, expected integers (int32)"), r.message
    nb = written(tmp_path, "02", "_dequantize_q8_0", 'b["qs"].astype(np.float32)',
                 'b["qs"].astype(np.float64)')
    r = result(check("02", nb), "_dequantize_q8_0")
    assert r.status == "differs"
    assert r.message.endswith("dtype float64, expected float32 (as ds4.c computes "
                              "it)"), r.message


def test_an_endless_loop_in_a_function_is_stopped_and_named(tmp_path):
    ops, cfg, W, positions = oracle()
    nb = written(tmp_path, "04", "rms_norm_weight", BOOK_RETURN,
                 "while True:\n        pass")
    out = cli("check", "04", "--notebook", str(nb), "--time-limit", "2")
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    assert out.stdout.splitlines()[1] == (
        f"  rms_norm_weight          FAILS: layer 0, position {positions[0]}: "
        "attn_x -> attn_norm: still running after 2 s, all its cases together (an "
        "endless loop?); 0 cases agreed before it; --time-limit SECONDS allows longer")
    assert "hc_split_sinkhorn        not written yet" in out.stdout


def test_an_endless_loop_that_swallows_the_interrupt_is_still_stopped(tmp_path):
    nb = written(tmp_path, "04", "rms_norm_weight", BOOK_RETURN,
                 "while True:\n        try:\n            sum(range(10000))\n"
                 "        except BaseException:\n            pass")
    out = cli("check", "04", "--notebook", str(nb), "--time-limit", "1")
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    assert out.stderr.strip() == (
        "tools/learn.py: rms_norm_weight: still running after 1 s, and it catches the "
        "interrupt (a bare `except:`?); stopped")


def test_an_endless_loop_at_a_cells_top_level_is_named(tmp_path):
    nb = learner_with(tmp_path, "04", "def rms_norm_weight(",
                      lambda s: s + "\nwhile True:\n    pass\n")
    refused(cli("check", "04", "--notebook", str(nb), "--time-limit", "2"),
            "04.ipynb: cell 580c6441 does not finish within 2 s (an endless loop at "
            "its top level?)")


@pytest.mark.parametrize("bad", ["0", "-1", "nan", "inf", "soon"])
def test_the_time_limit_must_be_a_positive_number_of_seconds(bad):
    out = cli("check", "04", "--time-limit", bad)
    assert out.returncode == 2 and out.stderr.strip().endswith(
        f"argument --time-limit: {bad!r}: not a positive number of seconds")


def test_sys_exit_in_the_learners_code_is_reported_not_obeyed(tmp_path):
    nb = written(tmp_path, "04", "rms_norm_weight", BOOK_RETURN,
                 "import sys\n    sys.exit('bye')")
    r = check("04", nb)[0]
    assert r.status == "error" and r.message.endswith("calls sys.exit('bye')")
    nb = learner_with(tmp_path, "04", "def rms_norm_weight(",
                      lambda s: s + "\nimport sys\nsys.exit(3)\n")
    with pytest.raises(LearnError, match=r"cell 580c6441 does not run: it calls "
                                         r"sys.exit\(3\)"):
        check("04", nb)


def check_cases(name):
    """The cases the check runs for `name` (with the book's functions)."""
    import learn_checks
    ns = load("04", chapter_path("04"))
    return learn_checks.CHECKS[name](ns)


def test_what_the_learners_function_prints_does_not_bury_the_report(tmp_path):
    nb = written(tmp_path, "04", "rms_norm_weight", BOOK_RETURN,
                 "print('x is', x[:2])\n    " + BOOK_RETURN)
    out = cli("check", "04", "--notebook", str(nb))
    n = sum(1 for _ in check_cases("rms_norm_weight"))
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "chapter 04: 1 of 2 functions agree with ds4.c"
    assert lines[1].startswith(
        f"  rms_norm_weight          ok: agrees with ds4.c in all {n} cases (it "
        f"printed {n} lines, not shown; the first: 'x is [")
    assert len(lines) == 3


def test_make_names_a_learn_folder_that_is_a_file_or_cannot_be_written(
        tmp_path, monkeypatch, capsys):
    (tmp_path / "learn").write_text("not a folder")
    monkeypatch.setattr(learn, "LEARN", tmp_path / "learn")
    assert learn.main(["make", "04"]) == 2
    assert capsys.readouterr().err == (
        f"tools/learn.py: {tmp_path / 'learn'}: a file, not a folder; move it away "
        "and run make again\n")

    def read_only(self, *a, **k):
        raise PermissionError(13, "Permission denied", str(self))
    monkeypatch.setattr(learn, "LEARN", tmp_path / "ro")
    monkeypatch.setattr(Path, "write_text", read_only)
    assert learn.main(["make", "04"]) == 2
    assert capsys.readouterr().err == (
        f"tools/learn.py: {tmp_path / 'ro' / '04_norms_hc.ipynb'}: cannot write it "
        "(Permission denied)\n")
