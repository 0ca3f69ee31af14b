"""Appendix H: every glossary row defines its term in both languages and links to a section of
the chapter it names, by the id the English edition gives that section's heading."""
from __future__ import annotations

import csv
import json
import re
from pathlib import Path

from docutils.nodes import make_id

ROOT = Path(__file__).resolve().parents[1]


def rows():
    with open(ROOT / "data" / "glossary.tsv", newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f, delimiter="\t"))


def page_sections(page: str) -> tuple[str, set[str]]:
    """A chapter's label ("3", "A", "intro", from its title) and its sections' ids."""
    nb = json.loads((ROOT / "book" / f"{page}.ipynb").read_text(encoding="utf-8"))
    heads = [line for c in nb["cells"] if c["cell_type"] == "markdown"
             for line in "".join(c["source"]).split("\n") if line.startswith("#")]
    title = re.match(r"# (\w+)\.", heads[0])
    label = title[1] if title else "intro"
    return label, {make_id(h.lstrip("#").strip().replace("`", "")) for h in heads[1:]}


def test_every_row_is_defined_in_both_languages():
    undefined = [r["english"] for r in rows() if not (r["remark"] and r["说明"])]
    assert not undefined, f"glossary rows without a definition: {undefined}"


def test_the_terms_the_book_teaches_have_rows():
    terms = {r["english"] for r in rows()}
    for term in ("Q8_0", "Q8_K", "Q2_K", "IQ2_XXS", "Sinkhorn", "YaRN", "Hadamard transform",
                 "FP4", "VNNI", "SLP vectorizer", "warp", "fiber", "perplexity", "imatrix"):
        assert term in terms


def test_every_row_links_to_a_section_of_a_chapter_it_names():
    wrong = []
    for r in rows():
        page, _, anchor = r["section"].partition("#")
        if not (ROOT / "book" / f"{page}.ipynb").exists():
            wrong.append((r["english"], f"no chapter {page}"))
            continue
        label, ids = page_sections(page)
        where = [w.strip() for w in r["where"].split(",")]
        if anchor not in ids:
            wrong.append((r["english"], f"{page} has no section #{anchor}"))
        elif label not in where:
            wrong.append((r["english"], f"{page} is {label}, not in 'where' {where}"))
    assert not wrong, wrong
