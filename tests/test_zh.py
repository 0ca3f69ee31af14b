"""The Chinese edition: every English paragraph has a current translation that keeps its links,
refs, math, code and headings; the build swaps the translations in and links the twins."""
from __future__ import annotations

import csv
import json
import posixpath
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "book" / "_ext"))
sys.path.insert(0, str(ROOT / "tools"))
import edition  # noqa: E402
import zh  # noqa: E402

CHAPTERS = zh.chapters([])


def test_every_chapter_of_the_book_is_covered():
    names = {p.name for p in CHAPTERS}
    on_disk = {p.name for p in (ROOT / "book").glob("[0-9][0-9]_*.ipynb")}
    assert names == on_disk


@pytest.mark.parametrize("chapter", CHAPTERS, ids=lambda p: p.stem)
def test_every_paragraph_has_a_current_translation(chapter):
    gaps = zh.gaps(chapter)
    cells = dict(zh.english_cells(chapter))
    lines = [f"{chapter.name} cell {i} ({why}): {cells[i].splitlines()[0][:70]!r}"
             for why in ("stale", "missing") for i in gaps[why]]
    assert not lines, ("no current Chinese translation (tools/zh.py sync, then "
                       "translate):\n" + "\n".join(lines))


@pytest.mark.parametrize("chapter", CHAPTERS, ids=lambda p: p.stem)
def test_translations_keep_links_refs_math_code_and_headings(chapter):
    problems = zh.check(chapter)
    assert not problems, "\n".join(problems)


def test_a_changed_english_cell_loses_its_translation():
    """Edit one English cell: its translation no longer applies and the cell is named."""
    chapter = ROOT / "book" / "04_norms_hc.ipynb"
    nb = json.loads(chapter.read_text())
    table = edition.current_translations(zh.translation_path(chapter))
    i, cell = next((i, c) for i, c in enumerate(nb["cells"]) if c["cell_type"] == "markdown")
    cell["source"] = "".join(cell["source"]) + "\nOne more English sentence."
    missing = edition.translate_notebook(nb, table)
    assert missing == [i]
    others = [c for c in nb["cells"] if c["cell_type"] == "markdown" and c is not cell]
    assert all(isinstance(c["source"], str) for c in others)  # replaced by Chinese
    assert all(any("\u4e00" <= ch <= "\u9fff" for ch in c["source"]) for c in others)


def test_stale_marks_and_parsing_round_trip(tmp_path):
    blocks = [{"cell": 3, "key": edition.cell_key("Hello"), "stale": True, "en": "Hello",
               "zh": "你好"},
              {"cell": 5, "key": edition.cell_key("A $x$"), "stale": False,
               "en": "A $x$", "zh": "一个 $x$"}]
    path = tmp_path / "t.md"
    path.write_text(edition.format_translations(blocks))
    assert edition.parse_translations(path.read_text()) == blocks
    # the stale block does not count; the current one does
    assert edition.current_translations(path) == {blocks[1]["key"]: "一个 $x$"}


def test_check_names_a_lost_link():
    en = "See [chapter 3](03_matvec.ipynb) and `matvec_any`, $x^2$."
    zh_ok = "见[第 3 章](03_matvec.ipynb)与 `matvec_any`，$x^2$。"
    zh_bad = "见第 3 章与 `matvec_any`，$x^2$。"
    assert zh.structure(en) == zh.structure(zh_ok)
    assert zh.structure(en)["links"] != zh.structure(zh_bad)["links"]


@pytest.mark.parametrize("page", ["book/00_intro", "book/14_cpu_kernels", "index"])
def test_twin_links_point_at_the_same_page(page):
    """Resolve each relative link from the page's own folder, as a browser does."""
    here = posixpath.dirname(page)
    to_zh = posixpath.normpath(posixpath.join(here, edition.twin_href(page, True)))
    assert to_zh == f"zh/{page}.html"
    zh_page = f"zh/{page}"
    back = posixpath.normpath(posixpath.join(posixpath.dirname(zh_page),
                                             edition.twin_href(page, False)))
    assert back == f"{page}.html"


def test_glossary_table():
    with open(ROOT / "data" / "glossary.tsv", newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f, delimiter="\t"))
    terms = [r["english"] for r in rows]
    assert len(terms) == len(set(terms)) and terms == sorted(terms, key=str.lower)
    assert all(r["中文"] and r["where"] for r in rows)
    # a remark in one language has its twin in the other
    assert all(bool(r["remark"]) == bool(r["说明"]) for r in rows)
