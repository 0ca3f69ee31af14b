"""`tools/zh.py sync` follows the English by content: after cells are inserted, deleted,
moved or edited, each cell keeps the translation made for its own English (current if the
English is unchanged, stale if it was edited), never another cell's; translations whose
English is gone are dropped. Small synthetic chapters in tmp_path."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "book" / "_ext"))
sys.path.insert(0, str(ROOT / "tools"))
import edition  # noqa: E402
import zh  # noqa: E402

# Paragraphs of one chapter: alike in style, each about its own thing.
H = "# 9. A small chapter"
P = {
    "intro": "This chapter reads one block of weights and multiplies it by an activation. "
             "Each step is checked against the values ds4.c recorded while it ran.",
    "scale": "The scale of a block is stored as a half-precision float in its first two "
             "bytes. The quantized weights follow it, one signed byte for each of the "
             "thirty-two weights.",
    "dot": "The dot product runs over integers first: thirty-two products of signed bytes "
           "are added in a wide register, and only the sum is multiplied by both scales.",
    "rows": "A matrix is a list of rows, and every row is a list of blocks. The kernel "
            "walks the rows in order and writes one output value for each row it reads.",
    "test": "The test compares every output with the recorded one bit for bit. A single "
            "differing bit names the row, the block and the position where it appeared.",
    "sum": "## Summary\n\nBlocks of thirty-two weights share one scale; the dot product "
           "works on integers and scales once at the end of each block.",
}
NEW = {
    "a": "A second format packs the weights in four bits each, two to a byte, with a "
         "minimum beside the scale, so a block of the same size holds twice as many.",
    "b": "Threads split the rows between them. No two threads ever write the same output, "
         "so they need no lock and the result does not depend on their number.",
}


def zh_of(en: str) -> str:
    """A stand-in translation that names the English it was made for."""
    return f"译文（{edition.cell_key(en)}）"


def write_chapter(tmp_path: Path, texts: list[str]) -> Path:
    """A notebook whose markdown cells are `texts`, with a code cell after the first."""
    cells = []
    for k, text in enumerate(texts):
        cells.append({"cell_type": "markdown", "metadata": {}, "source": text})
        if k == 0:
            cells.append({"cell_type": "code", "metadata": {}, "source": "x = 1",
                          "outputs": [], "execution_count": None})
    path = tmp_path / "book" / "09_small.ipynb"
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps({"cells": cells, "metadata": {}, "nbformat": 4,
                                "nbformat_minor": 5}))
    return path


@pytest.fixture
def chapter(tmp_path, monkeypatch):
    """Write version 1 of a chapter, translate all of it, then hand back a function that
    writes version 2, syncs, and returns (states, dropped)."""
    monkeypatch.setattr(zh, "LOCALE", tmp_path / "locale" / "zh")

    def make(v1: list[str], translate: bool = True):
        nb = write_chapter(tmp_path, v1)
        assert zh.sync(nb) == []
        if translate:
            path = zh.translation_path(nb)
            blocks = edition.parse_translations(path.read_text())
            for b in blocks:
                b["zh"] = zh_of(b["en"])
            path.write_text(edition.format_translations(blocks))

        def to(v2: list[str]):
            write_chapter(tmp_path, v2)
            dropped = zh.sync(nb)
            return states(nb), [b["en"] for b in dropped]
        return to
    return make


def states(nb: Path) -> list[tuple]:
    """Per markdown cell: ("current", en) | ("stale", en, was) | ("missing", en), where
    `was` is the English whose translation the stale cell holds (checked to be so)."""
    blocks = edition.parse_translations(zh.translation_path(nb).read_text())
    cells = zh.english_cells(nb)
    assert [(b["cell"], b["en"]) for b in blocks] == cells
    table = edition.current(blocks)
    out = []
    for b in blocks:
        if b["key"] in table:
            assert b["zh"] == zh_of(b["en"])
            out.append(("current", b["en"]))
        elif b["stale"]:
            assert b["zh"] == zh_of(b["was"]), "a stale block quotes what it translates"
            out.append(("stale", b["en"], b["was"]))
        else:
            assert b["zh"] == ""
            out.append(("missing", b["en"]))
    return out


def edit(text: str) -> str:
    """A small edit: a clause inserted after the first word."""
    first, rest = text.split(" ", 1)
    return f"{first} (as chapter 3 showed) {rest}"


V1 = [H, P["intro"], P["scale"], P["dot"], P["rows"], P["test"], P["sum"]]


def test_unchanged_chapter_is_left_as_it_is(chapter):
    to = chapter(V1)
    got, dropped = to(V1)
    assert got == [("current", t) for t in V1] and dropped == []


def test_insert_two_and_edit_two(chapter):
    """The case that attached a translation by cell index: with two cells inserted above
    them, the two edited cells each get their own old translation, marked stale."""
    to = chapter(V1)
    v2 = [H, NEW["a"], P["intro"], edit(P["scale"]), P["dot"], NEW["b"], edit(P["rows"]),
          P["test"], P["sum"]]
    got, dropped = to(v2)
    assert got == [("current", H), ("missing", NEW["a"]), ("current", P["intro"]),
                   ("stale", edit(P["scale"]), P["scale"]), ("current", P["dot"]),
                   ("missing", NEW["b"]), ("stale", edit(P["rows"]), P["rows"]),
                   ("current", P["test"]), ("current", P["sum"])]
    assert dropped == []


def test_delete(chapter):
    to = chapter(V1)
    got, dropped = to([H, P["intro"], P["dot"], P["rows"], P["test"], P["sum"]])
    assert got == [("current", t) for t in [H, P["intro"], P["dot"], P["rows"],
                                            P["test"], P["sum"]]]
    assert dropped == [P["scale"]]


def test_delete_one_and_edit_its_neighbour(chapter):
    """The edited neighbour keeps its own translation, not the deleted cell's."""
    to = chapter(V1)
    got, dropped = to([H, P["intro"], edit(P["dot"]), P["rows"], P["test"], P["sum"]])
    assert got[2] == ("stale", edit(P["dot"]), P["dot"])
    assert [s[0] for s in got] == ["current", "current", "stale", "current", "current",
                                   "current"]
    assert dropped == [P["scale"]]


def test_move(chapter):
    to = chapter(V1)
    v2 = [H, P["rows"], P["intro"], P["scale"], P["dot"], P["test"], P["sum"]]
    got, dropped = to(v2)
    assert got == [("current", t) for t in v2] and dropped == []


def test_move_and_edit(chapter):
    """A cell moved to the far end and edited is still found by its English."""
    to = chapter(V1)
    v2 = [H, P["intro"], P["dot"], P["rows"], P["test"], P["sum"], edit(P["scale"])]
    got, dropped = to(v2)
    assert got[-1] == ("stale", edit(P["scale"]), P["scale"])
    assert all(s[0] == "current" for s in got[:-1]) and dropped == []


def test_swap_two_edited_cells(chapter):
    """Two cells that trade places and are both edited each keep their own translation."""
    to = chapter(V1)
    v2 = [H, P["intro"], edit(P["rows"]), P["dot"], edit(P["scale"]), P["test"],
          P["sum"]]
    got, _ = to(v2)
    assert got[2] == ("stale", edit(P["rows"]), P["rows"])
    assert got[4] == ("stale", edit(P["scale"]), P["scale"])


def test_replace_by_another_paragraph(chapter):
    """A cell replaced by unrelated text in the same place does not inherit the old
    translation: the new text is missing and the old translation is dropped."""
    to = chapter(V1)
    assert zh.similarity(NEW["b"], P["dot"]) < zh.ALONE
    got, dropped = to([H, P["intro"], P["scale"], NEW["b"], P["rows"], P["test"],
                       P["sum"]])
    assert got[3] == ("missing", NEW["b"]) and dropped == [P["dot"]]


def test_rewrite_in_place(chapter):
    """A cell rewritten where it stood (keeps a quarter to a half of its words, the only
    change between unchanged neighbours) keeps its translation, stale."""
    to = chapter(V1)
    rewritten = ("The dot product runs over integers: the signed byte products of a block "
                 "are summed exactly, and the two scales multiply the sum at the end.")
    assert zh.ALONE <= zh.similarity(rewritten, P["dot"]) < zh.SAME_GAP
    got, dropped = to([H, P["intro"], P["scale"], rewritten, P["rows"], P["test"],
                       P["sum"]])
    assert got[3] == ("stale", rewritten, P["dot"]) and dropped == []


def test_grown_cell(chapter):
    """A paragraph added to a cell keeps the rest: its translation follows, stale."""
    to = chapter(V1)
    grown = P["test"] + "\n\n" + NEW["a"] + " " + NEW["b"] + " " + P["intro"]
    assert zh.difflib.SequenceMatcher(None, grown.split(), P["test"].split()).ratio() < 0.5
    got, _ = to([H, P["intro"], P["scale"], P["dot"], P["rows"], grown, P["sum"]])
    assert got[5] == ("stale", grown, P["test"])


def test_edited_again_before_the_translator_came(chapter):
    """A stale cell edited once more keeps the translation of its first English."""
    to = chapter(V1)
    once = edit(P["dot"])
    twice = once + " The order of the additions does not matter for integers."
    to([H, P["intro"], P["scale"], once, P["rows"], P["test"], P["sum"]])
    got, _ = to([H, P["intro"], P["scale"], twice, P["rows"], P["test"], P["sum"]])
    assert got[3] == ("stale", twice, P["dot"])


def test_edit_undone(chapter):
    """English edited and then put back: its translation is current again."""
    to = chapter(V1)
    to([H, P["intro"], P["scale"], edit(P["dot"]), P["rows"], P["test"], P["sum"]])
    got, _ = to(V1)
    assert got == [("current", t) for t in V1]


def test_mended_translation_is_current_and_loses_its_was(chapter, tmp_path):
    to = chapter(V1)
    to([H, P["intro"], P["scale"], edit(P["dot"]), P["rows"], P["test"], P["sum"]])
    path = zh.LOCALE / "09_small.md"
    text = path.read_text()
    assert "--- was en" in text
    blocks = edition.parse_translations(text)
    blocks[3].update(stale=False, zh=zh_of(blocks[3]["en"]))   # the translator's work
    path.write_text(edition.format_translations(blocks))
    got, _ = to([H, P["intro"], P["scale"], edit(P["dot"]), P["rows"], P["test"],
                 P["sum"]])
    assert got == [("current", t) for t in [H, P["intro"], P["scale"], edit(P["dot"]),
                                            P["rows"], P["test"], P["sum"]]]
    assert "--- was en" not in path.read_text()


def test_duplicate_english_cells_share_a_translation(chapter):
    to = chapter(V1)
    got, dropped = to(V1 + [P["sum"]])
    assert got[-1] == ("current", P["sum"]) and dropped == []


def test_untranslated_cells_stay_missing(chapter):
    to = chapter(V1, translate=False)
    got, dropped = to([H, NEW["a"], P["intro"], edit(P["scale"])])
    assert [s[0] for s in got] == ["missing"] * 4 and dropped == []


def test_sync_is_deterministic_and_idempotent(chapter):
    to = chapter(V1)
    v2 = [H, NEW["a"], P["intro"], edit(P["scale"]), P["dot"], NEW["b"], edit(P["rows"]),
          P["sum"]]
    to(v2)
    first = (zh.LOCALE / "09_small.md").read_text()
    to(v2)
    assert (zh.LOCALE / "09_small.md").read_text() == first


@pytest.mark.parametrize("path", sorted((ROOT / "locale" / "zh").glob("*.md")),
                         ids=lambda p: p.stem)
def test_translation_files_round_trip(path):
    """Parsing and writing a file gives it back unchanged, so a sync of an unchanged
    chapter rewrites nothing."""
    text = path.read_text()
    assert edition.format_translations(edition.parse_translations(text)) == text
