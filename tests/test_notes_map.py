"""Appendix G: the study notes' ds4.c line citations (data/notes_lines.tsv) are consistent, show
the offsets G and erratum 34 state, agree with G's own links, and G's section pointers resolve."""
from __future__ import annotations

import csv
import json
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
COLUMNS = ["part", "trace", "name", "notes_line", "pinned_line", "offset"]
BLOB = "https://github.com/antirez/ds4/blob/8d576642c39b9a2d782a80159ba84ef5a81c0b81/ds4.c#L"


def rows() -> list[dict]:
    with open(ROOT / "data" / "notes_lines.tsv", newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f, delimiter="\t")
        assert reader.fieldnames == COLUMNS
        return [{k: v if k == "name" else int(v) for k, v in r.items()} for r in reader]


def markdown(page: str) -> str:
    nb = json.loads((ROOT / "book" / f"{page}.ipynb").read_text(encoding="utf-8"))
    return "\n".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "markdown")


def test_every_offset_is_pinned_minus_notes():
    bad = [r["name"] for r in rows() if r["offset"] != r["pinned_line"] - r["notes_line"]]
    assert not bad


def test_rows_name_a_part_and_trace_of_the_notes_and_a_c_identifier():
    for r in rows():
        assert 1 <= r["part"] <= 4 and 1 <= r["trace"] <= 5, r
        assert re.fullmatch(r"[A-Za-z_]\w*", r["name"]), r
        assert r["notes_line"] > 0 and r["pinned_line"] > 0, r


def test_names_are_unique_per_part_and_in_the_notes_order():
    rs = rows()
    keys = [(r["part"], r["name"]) for r in rs]
    assert len(keys) == len(set(keys))
    order = [(r["part"], r["trace"]) for r in rs]
    assert order == sorted(order)
    assert {r["part"] for r in rs} == {1, 2, 3, 4}


def test_offsets_are_zero_up_to_1635_then_72_to_215():
    """G's opening and erratum 34: the pinned line up to the notes' l. 1635, then too small by
    72 to 215, in runs that only grow along the file (72 over l. 1987-5022, 79-87 over
    l. 5029-6613, 215 from l. 14874)."""
    rs = sorted(rows(), key=lambda r: r["notes_line"])
    same = [r["notes_line"] for r in rs if r["offset"] == 0]
    later = [r for r in rs if r["offset"] != 0]
    assert max(same) == 1635 and min(r["notes_line"] for r in later) == 1987
    assert min(r["offset"] for r in later) == 72 and max(r["offset"] for r in later) == 215
    offsets = [r["offset"] for r in rs]
    assert offsets == sorted(offsets)
    for lo, hi, allowed in ((1987, 5022, {72}), (5029, 6613, set(range(79, 88))),
                            (14874, 10**6, {215})):
        inside = {r["offset"] for r in rs if lo <= r["notes_line"] <= hi}
        assert inside and inside <= allowed, (lo, hi, inside)


def test_g_links_each_cited_name_to_the_pinned_line_of_the_table():
    """Where G's trace tables link a name the notes cite by line, it is the TSV's pinned line."""
    text = markdown("G_notes_map")
    linked = {m[1]: int(m[2]) for m in
              re.finditer(r"\[`(\w+)`\]\(" + re.escape(BLOB) + r"(\d+)\)", text)}
    both = [r for r in rows() if r["name"] in linked]
    assert len(both) >= 20
    assert [(r["name"], linked[r["name"]]) for r in both] == \
        [(r["name"], r["pinned_line"]) for r in both]


def test_g_points_to_sections_by_labels_the_chapters_define():
    """Every {ref} of G names a `(label)=` line of some chapter's markdown, set before a
    heading, and G quotes no section title."""
    text = markdown("G_notes_map")
    refs = set(re.findall(r"\{ref\}`(?:[^`<]*<)?([\w-]+)>?`", text))
    labels = {}
    for nb in (ROOT / "book").glob("*.ipynb"):
        for cell in json.loads(nb.read_text(encoding="utf-8"))["cells"]:
            lines = "".join(cell["source"]).split("\n") if cell["cell_type"] == "markdown" else []
            for i, line in enumerate(lines):
                if m := re.fullmatch(r"\(([\w-]+)\)=", line):
                    assert i + 1 < len(lines) and lines[i + 1].startswith("#"), (nb.name, line)
                    labels[m[1]] = nb.stem
    labels.update({f"erratum-{n}": "A_oracle" for n in range(1, 40)})
    assert not refs - set(labels), sorted(refs - set(labels))
    assert len({labels[r] for r in refs}) >= 9
    assert not re.search(r'\.ipynb\)[:,]? "', text), "a section named by its quoted title"


@pytest.fixture()
def notes_lines_tool():
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import notes_lines
        yield notes_lines
    finally:
        sys.path.remove(str(ROOT / "tools"))


def test_the_tool_pairs_each_spelling_with_its_definition(notes_lines_tool):
    """The three spellings of a citation, a range, a repeated name and a prototype, on a
    made-up file and made-up notes."""
    c = "\n".join([
        "#define QK 256",                      # 1
        "typedef struct {",                    # 2
        "    int d;",
        "} block_a;",
        "static void f(int x);",               # 5: a prototype, not the definition
        "",
        "static void f(int x) {",              # 7
        "}",
        "int g(int *out,",                     # 9
        "      int n) {",
        "}",
    ])
    notes = "\n".join([
        "1. 第一部分",
        "追踪 1：结构",
        "block_a        块（行 1-3）",
        "// 行 4: 宏",
        "#define QK 256",
        "2. 第二部分",
        "追踪 2：函数",
        "g(out, n)   [行 8]",
        "// `f()` 中（约 6 行）: 函数",
        "追踪 3：再一次",
        "g(out, n)   [行 8]",
    ])
    assert notes_lines_tool.table(notes, c) == [
        (1, 1, "block_a", 1, 2, 1), (1, 1, "QK", 4, 1, -3),
        (2, 2, "g", 8, 9, 1), (2, 2, "f", 6, 7, 1)]


def test_the_tool_refuses_a_name_cited_with_two_lines(notes_lines_tool):
    notes = "1. 一\n追踪 1：x\ng(a)  [行 9]\ng(a)  [行 10]\n"
    with pytest.raises(notes_lines_tool.NotesLinesError, match="g cited as l. 9 and l. 10"):
        notes_lines_tool.citations(notes)
