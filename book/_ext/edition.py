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
Between its English and its translation it quotes the English that translation was made for:

    === cell 7 · en 5b1e07aa93c2 · stale
    <the English cell now>
    --- was en 3f2a9c01b4de
    <the English the translation below translates>
    --- zh
    <the old translation, to mend>

Each section of a Chinese page also carries the id of its English twin's section (its
heading's slug, `add_english_ids`), so that a link to `page.html#slug`, such as the
glossary's to the section that teaches a term, lands on the section in both editions.

Every page of both editions also gets a link to its twin in the other edition, and on the
Chinese pages the theme's own words (buttons, tooltips, the search box) are in simplified
Chinese: see `UI_ZH`.
"""
from __future__ import annotations

import gettext
import hashlib
import json
import re
from pathlib import Path

HEADER = re.compile(r"^=== cell (\d+) · en ([0-9a-f]{12})( · stale)?$")
WAS = re.compile(r"^--- was en [0-9a-f]{12}$")
ZH_DIR = "zh"          # the Chinese edition's HTML lives in <html root>/zh/


def cell_key(english: str) -> str:
    """The key of an English markdown cell: 12 hex digits of its sha256."""
    return hashlib.sha256(english.strip().encode()).hexdigest()[:12]


def parse_translations(text: str) -> list[dict]:
    """Blocks of a translation file: cell, key, stale, en, was, zh (in file order).
    `was` is the English a stale block's translation was made for ("" if not quoted)."""
    blocks, cur, part = [], None, None
    for line in text.split("\n"):
        m = HEADER.match(line)
        if m:
            cur = {"cell": int(m[1]), "key": m[2], "stale": bool(m[3]),
                   "en": [], "was": [], "zh": []}
            blocks.append(cur)
            part = "en"
        elif cur is not None and WAS.match(line) and part == "en":
            part = "was"
        elif cur is not None and line == "--- zh" and part in ("en", "was"):
            part = "zh"
        elif cur is not None:
            cur[part].append(line)
    for b in blocks:
        for part in ("en", "was", "zh"):
            b[part] = "\n".join(b[part]).strip()
    return blocks


def format_translations(blocks: list[dict]) -> str:
    """The text of a translation file; a block's `was` is written only while it is stale."""
    out = []
    for b in blocks:
        mark = " · stale" if b["stale"] else ""
        out += [f"=== cell {b['cell']} · en {b['key']}{mark}", b["en"]]
        if b["stale"] and b.get("was"):
            out += [f"--- was en {cell_key(b['was'])}", b["was"]]
        out += ["--- zh", b["zh"], ""]
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


MYST_EXTENSIONS = ["dollarmath", "amsmath", "colon_fence", "deflist", "html_image",
                   "substitution"]  # as _config.yml's parse: the titles render the same


def heading_lines(markdown: str) -> list[str]:
    """The heading lines (`#` to `######`) of a markdown text, outside fenced code."""
    out, fence = [], None
    for line in markdown.split("\n"):
        m = re.match(r"^[ \t]*(`{3,}|~{3,})", line)
        if m and (fence is None or m[1].startswith(fence)):
            fence = None if fence else m[1]
        elif fence is None and re.match(r"^#{1,6} ", line):
            out.append(line)
    return out


def section_ids(headings: list[str]) -> list[str]:
    """The id docutils gives the section of each heading, in order, as the English page
    has it (`## 3.2 Q8_0 × Q8_0: an integer dot per block` is
    `q8-0-q8-0-an-integer-dot-per-block`); "" where the id is not made from the title
    alone (a repeated title's is numbered by its place on the page)."""
    from docutils import nodes
    from docutils.core import publish_doctree
    from myst_parser.parsers.docutils_ import Parser

    doc = publish_doctree("\n\n".join(headings), parser=Parser(), settings_overrides={
        "myst_enable_extensions": MYST_EXTENSIONS, "doctitle_xform": False,
        "report_level": 5, "halt_level": 5, "myst_suppress_warnings": ["myst.header"]})
    ids = []
    for s in doc.findall(nodes.section):
        natural = nodes.make_id(s[0].astext())  # from its title; a repeat gets another
        ids.append(natural if natural and natural in s["ids"] else "")
    if len(ids) != len(headings):
        raise ValueError(f"{len(headings)} headings gave {len(ids)} sections")
    return ids


def english_section_ids(nb: dict) -> list[str]:
    """section_ids of a notebook's markdown cells, in page order (before translation)."""
    return section_ids([h for c in nb["cells"] if c["cell_type"] == "markdown"
                        for h in heading_lines("".join(c["source"]))])


def add_english_ids(doctree, english: list[str]) -> list[str]:
    """Give each section of a translated page the id its English twin's section has, so a
    link to `page.html#english-id` (the glossary's, any output's) lands on the section in
    both editions. Return what could not be matched."""
    from docutils import nodes
    sections = list(doctree.findall(nodes.section))
    if len(sections) != len(english):
        return [f"{len(sections)} sections, {len(english)} English headings"]
    for section, eid in zip(sections, english):
        if eid and eid not in section["ids"] and eid not in doctree.ids:
            section["ids"].append(eid)
            doctree.ids[eid] = section
    return []


def twin_href(pagename: str, to_zh: bool) -> str:
    """Relative link from a page to the same page in the other edition.

    The English page `book/01_gguf` is `<root>/book/01_gguf.html`; its twin is
    `<root>/zh/book/01_gguf.html`."""
    up = "../" * pagename.count("/")
    if to_zh:
        return f"{up}{ZH_DIR}/{pagename}.html"
    return f"{up}../{pagename}.html"


# The theme's words on Chinese pages. Each extension takes them from a different place:
UI_ZH = {
    # message catalogs: sphinx-book-theme's zh_CN has the traditional 列印成 PDF, and
    # Sphinx's and pydata-sphinx-theme's leave these empty or English
    "catalog": {
        "Print to PDF": "打印为 PDF",
        "Color mode": "颜色模式",
        "System Settings": "跟随系统",
        "Link to this heading": "链接到此标题",
        "© Copyright %(copyright)s.": "© 版权所有 %(copyright)s。",
        "Copyright %(copyright)s": "版权所有 %(copyright)s",
    },
    # myst-nb's prompts of a folded cell ("Show code cell {type}")
    "prompts": {
        f"{verb} code cell {what}": f"{zh_verb}代码单元格{zh_what}"
        for verb, zh_verb in (("Show", "显示"), ("Hide", "隐藏"))
        for what, zh_what in (("source", "源码"), ("content", "内容"),
                              ("output", "输出"), ("outputs", "输出"))
    },
    # words the templates and myst-nb write as they are, in these HTML attributes
    "attributes": {
        "Toggle primary sidebar": "显示或隐藏主侧栏",
        "Toggle secondary sidebar": "显示或隐藏次侧栏",
        "Toggle hidden content": "显示或隐藏折叠内容",
        "Main": "主导航",
        "Page": "本页导航",
    },
    # options of the theme and of sphinx-togglebutton
    "config": {
        "search_bar_text": "搜索本书……",
        "togglebutton_hint": "点击显示",
        "togglebutton_hint_hide": "点击隐藏",
    },
}
UI_ATTRIBUTES = ("title", "aria-label", "placeholder", "data-bs-title")


class _Overrides(gettext.NullTranslations):
    """A message catalog whose own table comes first, then the catalog it wraps."""

    def __init__(self, table: dict[str, str], fallback):
        super().__init__()
        self.table = table
        self.add_fallback(fallback)

    def gettext(self, message):
        return self.table.get(message) or super().gettext(message)


def translate_catalogs(translators: dict, table: dict[str, str]) -> None:
    """Put `table` in front of every loaded catalog (Sphinx's, the themes')."""
    for key, catalog in list(translators.items()):
        if not isinstance(catalog, _Overrides):
            translators[key] = _Overrides(table, catalog)


def translate_prompts(doctree, table: dict[str, str]) -> None:
    """The show/hide prompts of folded cells (set by myst-nb after its transforms)."""
    for node in doctree.findall(lambda n: "prompt_show" in getattr(n, "attributes", {})):
        for k in ("prompt_show", "prompt_hide"):
            node[k] = table.get(node[k], node[k])


def translate_attributes(html: str, table: dict[str, str]) -> str:
    """Attribute values (tooltips, labels) that equal one of the table's English words."""
    names = "|".join(UI_ATTRIBUTES)
    return re.sub(rf'\b({names})="([^"]*)"',
                  lambda m: f'{m[1]}="{table.get(m[2], m[2])}"', html)


def _ui_config(app, config):
    if not _is_zh(app):
        return
    from sphinx import locale
    translate_catalogs(locale.translators, UI_ZH["catalog"])
    app.translator = locale.translators["general", "sphinx"]
    opts = UI_ZH["config"]
    config.html_theme_options = {**(config.html_theme_options or {}),
                                 "search_bar_text": opts["search_bar_text"]}
    config.togglebutton_hint = opts["togglebutton_hint"]
    config.togglebutton_hint_hide = opts["togglebutton_hint_hide"]


def _ui_prompts(app, doctree, docname):
    if _is_zh(app):
        translate_prompts(doctree, UI_ZH["prompts"])


def _ui_attributes(app, exception):
    if exception or not _is_zh(app) or app.builder.format != "html":
        return
    for page in Path(app.outdir).rglob("*.html"):
        text = page.read_text(encoding="utf-8")
        new = translate_attributes(text, UI_ZH["attributes"])
        if new != text:
            page.write_text(new, encoding="utf-8")


def _is_zh(app) -> bool:
    return (app.config.language or "").startswith("zh")


def _translate(app, docname, source):
    if not _is_zh(app) or not str(app.env.doc2path(docname)).endswith(".ipynb"):
        return
    name = Path(docname).name
    table = current_translations(Path(app.srcdir) / "locale" / "zh" / f"{name}.md")
    nb = json.loads(source[0])
    app.env.temp_data["english_section_ids"] = english_section_ids(nb)
    missing = translate_notebook(nb, table)
    if missing:
        from sphinx.util import logging
        logging.getLogger(__name__).warning(
            f"{name}: markdown cells {missing} have no current Chinese translation "
            f"(run tools/zh.py status)", location=docname)
    source[0] = json.dumps(nb)


def _english_ids(app, doctree):
    english = app.env.temp_data.pop("english_section_ids", None)
    if not _is_zh(app) or english is None:
        return
    for problem in add_english_ids(doctree, english):
        from sphinx.util import logging
        logging.getLogger(__name__).warning(
            f"{app.env.docname}: the English section ids cannot be added: {problem}",
            location=app.env.docname)


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
    app.connect("doctree-read", _english_ids)
    app.connect("html-page-context", _switch)
    # before sphinx-togglebutton writes its hints into the pages' scripts
    app.connect("config-inited", _ui_config, priority=100)
    app.connect("doctree-resolved", _ui_prompts)
    app.connect("build-finished", _ui_attributes)
    app.add_css_file("edition.css")
    return {"parallel_read_safe": True, "parallel_write_safe": True}
