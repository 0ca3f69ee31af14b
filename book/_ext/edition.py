"""Sphinx extension: one book, two editions (English and 中文), from the same notebooks.

The Chinese edition is built from the very notebooks the English one is: code, outputs and
figures are shared. Only the markdown cells differ. Each is replaced, as the notebook is
read, by its translation in `locale/zh/<chapter>.md`, found by the key of the English text
it translates. When the English cell changes, its key changes, the old translation no
longer matches, and the build warns (and `-W` fails) naming the chapter and the cell.

A translation file is a list of blocks, one per English markdown cell, in cell order:

    === cell 7 · en 3f2a9c01b4de
    <the English cell, verbatim, for the translator and the reviewer>
    --- zh
    <its translation>

A block marked `· stale` (written by `tools/zh.py sync` when the English changed) keeps its
old translation for the translator to mend, and counts as missing until the mark is gone.

Every page of both editions also gets a link to its twin in the other edition.
"""
from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

HEADER = re.compile(r"^=== cell (\d+) · en ([0-9a-f]{12})( · stale)?$")
ZH_DIR = "zh"          # the Chinese edition's HTML lives in <html root>/zh/


def cell_key(english: str) -> str:
    """The key of an English markdown cell: 12 hex digits of its sha256."""
    return hashlib.sha256(english.strip().encode()).hexdigest()[:12]


def parse_translations(text: str) -> list[dict]:
    """Blocks of a translation file: cell, key, stale, en, zh (in file order)."""
    blocks, cur, part = [], None, None
    for line in text.split("\n"):
        m = HEADER.match(line)
        if m:
            cur = {"cell": int(m[1]), "key": m[2], "stale": bool(m[3]), "en": [], "zh": []}
            blocks.append(cur)
            part = "en"
        elif cur is not None and line == "--- zh" and part == "en":
            part = "zh"
        elif cur is not None:
            cur[part].append(line)
    for b in blocks:
        b["en"] = "\n".join(b["en"]).strip()
        b["zh"] = "\n".join(b["zh"]).strip()
    return blocks


def format_translations(blocks: list[dict]) -> str:
    out = []
    for b in blocks:
        mark = " · stale" if b["stale"] else ""
        out += [f"=== cell {b['cell']} · en {b['key']}{mark}", b["en"], "--- zh", b["zh"], ""]
    return "\n".join(out)


def current(blocks: list[dict]) -> dict[str, str]:
    """key -> Chinese text, for the blocks that translate the English they quote."""
    return {b["key"]: b["zh"] for b in blocks
            if b["zh"] and not b["stale"] and cell_key(b["en"]) == b["key"]}


def current_translations(path: Path) -> dict[str, str]:
    """current() of a translation file (none if it does not exist)."""
    return current(parse_translations(path.read_text())) if path.exists() else {}


def translate_notebook(nb: dict, table: dict[str, str]) -> list[int]:
    """Replace each markdown cell by its translation; return the cells that have none."""
    missing = []
    for i, cell in enumerate(nb["cells"]):
        if cell["cell_type"] != "markdown":
            continue
        zh = table.get(cell_key("".join(cell["source"])))
        if zh is None:
            missing.append(i)
        else:
            cell["source"] = zh
    return missing


def twin_href(pagename: str, to_zh: bool) -> str:
    """Relative link from a page to the same page in the other edition.

    The English page `book/01_gguf` is `<root>/book/01_gguf.html`; its twin is
    `<root>/zh/book/01_gguf.html`."""
    up = "../" * pagename.count("/")
    if to_zh:
        return f"{up}{ZH_DIR}/{pagename}.html"
    return f"{up}../{pagename}.html"


def _is_zh(app) -> bool:
    return (app.config.language or "").startswith("zh")


def _translate(app, docname, source):
    if not _is_zh(app) or not str(app.env.doc2path(docname)).endswith(".ipynb"):
        return
    name = Path(docname).name
    table = current_translations(Path(app.srcdir) / "locale" / "zh" / f"{name}.md")
    nb = json.loads(source[0])
    missing = translate_notebook(nb, table)
    if missing:
        from sphinx.util import logging
        logging.getLogger(__name__).warning(
            f"{name}: markdown cells {missing} have no current Chinese translation "
            f"(run tools/zh.py status)", location=docname)
    source[0] = json.dumps(nb)


def _switch(app, pagename, templatename, context, doctree):
    if "body" not in context:
        return
    zh = _is_zh(app)
    label = "English edition" if zh else "中文版"
    lang = "en" if zh else "zh-CN"
    link = (f'<p class="edition-switch"><a href="{twin_href(pagename, not zh)}" '
            f'hreflang="{lang}" lang="{lang}">{label}</a></p>\n')
    context["body"] = link + context["body"]


def setup(app):
    app.connect("source-read", _translate)
    app.connect("html-page-context", _switch)
    app.add_css_file("edition.css")
    return {"parallel_read_safe": True, "parallel_write_safe": True}
