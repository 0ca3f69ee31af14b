"""Appendix A: every key of the oracle README's test recipe is checked by some test file.

The per-op comparisons live in the chapter test files (test_quant, test_matvec, test_norms_hc,
test_attention, test_kvcache, test_moe). This file only guards their coverage: if the README's
recipe names an ops_A key that no test reads, or that ops_A does not contain, it fails. It also checks
the appendix's claim about where ops_A's position 0 comes from."""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

TESTS = Path(__file__).resolve().parent
README = TESTS.parent / "data" / "oracle" / "README.md"


def recipe_rows() -> dict[str, list[str]]:
    """{op: [key names]} from the README's 'Suggested test recipe' table (wildcards like `ffn_*` dropped)."""
    text = README.read_text()
    start = text.index("### Suggested test recipe")
    table = text[start:text.index("Tolerances:", start)]
    rows = {}
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 2 or cells[0] in ("op", "---"):
            continue
        keys = [k for k in re.findall(r"`([^`]+)`", cells[1]) if "*" not in k]
        rows[cells[0]] = keys
    return rows


def base_name(key: str) -> str:
    """'P.q8.output' -> 'output', 'q8k.ffn_down_exps' -> 'ffn_down_exps', 'hc_out' -> 'hc_out'."""
    return re.sub(r"^(L\d\s+)?(P\.)?(q8k?\.)?", "", key)


LANE_PREFIXES = ("attn_", "ffn_", "comp_", "icomp_")


def is_read(name: str, sources: str) -> bool:
    """name appears as a string in a test, whole ("attn_norm", k + "attn_norm") or, for per-lane and
    per-sub-layer names, as the composed suffix the tests build (f"{s}_hc_mix", nm + "_score")."""
    if re.search(rf"[\"'.]{re.escape(name)}[\"'.]", sources):
        return True
    for pre in LANE_PREFIXES:
        if name.startswith(pre) and re.search(rf"(\"_|\}}_){re.escape(name[len(pre):])}[\"']", sources):
            return True
    return False


def test_is_read_recognises_whole_and_composed_names():
    src = 'ops[k + "qr_norm"]; ops_A[f"{k}{s}_hc_mix"]; ops[k + nm + "_score"]'
    assert is_read("qr_norm", src) and is_read("attn_hc_mix", src) and is_read("comp_score", src)
    assert not is_read("qr", src) and not is_read("kv_fp8", src) and not is_read("hc_mix", src)


def test_the_recipe_table_is_parsed():
    rows = recipe_rows()
    assert len(rows) == 12, list(rows)
    assert rows["norms"][:2] == ["attn_x", "attn_norm"]
    assert sum(len(v) for v in rows.values()) > 80


@pytest.mark.parametrize("op", list(recipe_rows()))
def test_every_recipe_key_exists_in_ops_A_and_is_read_by_a_test(op, ops_A):
    names = {k.split(".", 2)[2] for k in ops_A.files if k.startswith("L")} | \
            {k.split(".", 1)[1] for k in ops_A.files if k.startswith("P")}
    sources = "\n".join(p.read_text() for p in sorted(TESTS.glob("test_*.py")) if p.name != Path(__file__).name)
    for key in recipe_rows()[op]:
        if key == "sinks":                                        # a GGUF tensor (attn_sinks), not an ops_A key
            assert "attn_sinks" in sources
            continue
        plain = re.sub(r"^(L\d\s+)?(P\.)?", "", key)
        assert plain in names or any(n.startswith(plain + ".") for n in names), f"{op}: {key!r} is not in ops_A"
        assert is_read(base_name(key), sources), f"{op}: no test reads {key!r}"


def test_ops_A_position_0_is_decoded_but_later_positions_equal_the_golden_stream(ops_A, golden_A):
    """The appendix's warning: P0 comes from a separate decode run, so its logits differ from the golden
    stream's row 0 (a 1-token batch prefill) by about 0.55; every later dumped position is bit-identical."""
    stream = golden_A["stream_pos_logits"]
    d0 = float(np.abs(ops_A["P0.logits"] - stream[0]).max())
    assert 0.4 < d0 < 0.7, d0
    later = [int(p) for p in ops_A["positions"] if 0 < p < len(stream)]
    assert len(later) == 16
    for p in later:
        assert np.array_equal(ops_A[f"P{p}.logits"], stream[p]), p
