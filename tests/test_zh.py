"""The Chinese edition: every English paragraph has a current translation that keeps its links,
refs, math, code and headings; the build swaps the translations in and links the twins."""
from __future__ import annotations

import csv
import gettext
import json
import posixpath
import sys
from pathlib import Path

import pytest
import sphinx_book_theme

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "book" / "_ext"))
sys.path.insert(0, str(ROOT / "tools"))
import edition  # noqa: E402
import zh  # noqa: E402

CHAPTERS = zh.chapters([])


def test_every_chapter_of_the_book_is_covered():
    names = {p.name for p in CHAPTERS}
    on_disk = {p.name for p in [*(ROOT / "book").glob("[0-9][0-9]_*.ipynb"),
                                *(ROOT / "book").glob("[A-Z]_*.ipynb")]}
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
               "was": "Hi", "zh": "你好"},
              {"cell": 5, "key": edition.cell_key("A $x$"), "stale": False,
               "en": "A $x$", "was": "", "zh": "一个 $x$"}]
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


@pytest.mark.parametrize("page", ["book/00_intro", "book/D_cpu_kernels", "index"])
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


# `check` compares each translation with its English beyond links and code: table columns,
# numbers, and whether it was translated at all.
EN_TABLE = ("Three formats:\n\n| format | bytes | weights |\n|---|---|---|\n"
            "| Q8_0 | 34 | 32 |\n| Q2_K | 84 | 256 |")
ZH_TABLE = ("三种格式：\n\n| 格式 | 字节 | 权重 |\n|---|---|---|\n"
            "| Q8_0 | 34 | 32 |\n| Q2_K | 84 | 256 |")


def test_check_passes_a_faithful_translation():
    assert zh.check_block(EN_TABLE, ZH_TABLE) == []
    en = ("DeepSeek V4 Flash has about 284 billion parameters in 43 layers; a token reads "
          "13 billion of them, and the 3-D expert tensors hold 2 of its 8 sets.")
    ok = "DeepSeek V4 Flash 约有 2840 亿参数，共 43 层；一个 token 读取 130 亿，三维专家张量存两组（共 8 组）。"
    assert zh.check_block(en, ok) == []


def test_check_fails_on_a_dropped_table_column():
    dropped = ZH_TABLE.replace("| 字节 ", "").replace("|---|---|---|", "|---|---|") \
        .replace("| 34 ", "").replace("| 84 ", "")
    problems = zh.check_block(EN_TABLE, dropped)
    assert len(problems) == 2     # the column and its numbers
    assert problems[0].startswith("table columns differ from row 1 on (English [3, 3, 3]")
    assert problems[1] == "numbers of the English missing: ['34', '84']"
    # a row merged into another is a change of shape too, even with the same numbers
    merged = ZH_TABLE.replace(" |\n| Q2_K", " | Q2_K")
    assert any(p.startswith("table columns differ from row 3 on (English [3, 3]")
               for p in zh.check_block(EN_TABLE, merged))


def test_check_fails_on_a_changed_number():
    problems = zh.check_block(EN_TABLE, ZH_TABLE.replace("| 256 |", "| 265 |"))
    assert problems == ["numbers of the English missing: ['256']"]
    en = "A decode reads 13 billion of the 284 billion parameters, at 1,024 tokens."
    assert zh.check_block(en, "解码读取 2840 亿参数中的 120 亿，1,024 个 token 时。") == \
        ["numbers of the English missing: ['13']"]
    assert zh.check_block(en, "解码读取 2840 亿参数中的 130 亿，1024 个 token 时。") == []
    # numerals stand for 0 to 10 only
    assert zh.check_block("The 12 experts.", "十二个专家。") == \
        ["numbers of the English missing: ['12']"]


def test_check_fails_on_a_block_left_in_english():
    en = "The scale of a block is stored as a half-precision float, see `d` and $d$."
    assert zh.check_block(en, en) == ["left in English (no Chinese character)"]
    two = en + ("\n\nThe quantized weights follow it, one signed byte for each weight, "
                "and the kernel reads them in order.")
    half = "块的缩放因子以半精度浮点存放，见 `d` 与 $d$。\n\n" + two.split("\n\n")[1]
    assert zh.check_block(two, half) == ["half left in English (18 of its 30 English words)"]


@pytest.mark.parametrize("block", [
    "$$y = \\sum_i w_i x_i$$",
    "```python\nprint(matvec_q8_0(w, x))\n```",
    "[ds4.c](https://github.com/antirez/ds4) · [llama.cpp](https://github.com/ggml-org/llama.cpp)",
    "(errata)=\n| `Q8_0` | `Q2_K` |\n|---|---|\n| 34 | 84 |",
])
def test_check_lets_code_math_and_names_stay_as_they_are(block):
    """A block with no English word outside code, math, link targets and names
    (ds4.c, llama.cpp, Q8_0) may be its own translation."""
    assert zh.untranslated(block, block) == ""
    assert zh.check_block(block, block) == []


def test_check_names_the_chapter_and_cell(tmp_path, monkeypatch):
    monkeypatch.setattr(zh, "LOCALE", tmp_path)
    nb = ROOT / "book" / "09_small.ipynb"   # only its name is used
    blocks = [{"cell": 4, "key": edition.cell_key(EN_TABLE), "stale": False,
               "en": EN_TABLE, "was": "", "zh": ZH_TABLE.replace("256", "265")},
              {"cell": 6, "key": edition.cell_key("Hello."), "stale": True, "en": "Hello.",
               "was": "Hi.", "zh": "Hi."}]    # stale blocks wait for the translator
    (tmp_path / "09_small.md").write_text(edition.format_translations(blocks))
    assert zh.check(nb) == ["09_small.ipynb cell 4: numbers of the English missing: ['256']"]


# The theme's own words on Chinese pages, in simplified Chinese.
BOOKTHEME_LOCALES = (Path(sphinx_book_theme.__file__).parent / "theme" / "sphinx_book_theme"
                     / "static" / "locales")


def test_ui_words_are_simplified_chinese():
    values = [v for group in edition.UI_ZH.values() for v in group.values()]
    for v in values:
        # GB 2312, the simplified character set, has no traditional character
        "".join(zh.CJK.findall(v)).encode("gb2312")
        assert zh.CJK.search(v) and "列印" not in v


def test_ui_catalog_override_puts_simplified_chinese_first():
    """sphinx-book-theme's own zh_CN catalog says 列印成 PDF (Taiwan's word); wrapped,
    it says 打印为 PDF and keeps its other words."""
    booktheme = gettext.translation("booktheme", BOOKTHEME_LOCALES, ["zh_CN"])
    assert booktheme.gettext("Print to PDF") == "列印成 PDF"
    translators = {("general", "booktheme"): booktheme}
    edition.translate_catalogs(translators, edition.UI_ZH["catalog"])
    edition.translate_catalogs(translators, edition.UI_ZH["catalog"])   # wraps once
    wrapped = translators["general", "booktheme"]
    assert wrapped.gettext("Print to PDF") == "打印为 PDF"
    assert wrapped.gettext("Contents") == "目录"
    assert wrapped.gettext("Fullscreen mode") == "全屏模式"
    assert wrapped.gettext("an unknown phrase") == "an unknown phrase"
    assert wrapped._fallback is booktheme


def test_ui_prompts_of_folded_cells():
    from docutils import nodes
    tree = nodes.container()
    for what in ("source", "content", "outputs"):
        tree += nodes.container(prompt_show=f"Show code cell {what}",
                                prompt_hide=f"Hide code cell {what}")
    edition.translate_prompts(tree, edition.UI_ZH["prompts"])
    got = [(n["prompt_show"], n["prompt_hide"]) for n in tree.children]
    assert got == [("显示代码单元格源码", "隐藏代码单元格源码"),
                   ("显示代码单元格内容", "隐藏代码单元格内容"),
                   ("显示代码单元格输出", "隐藏代码单元格输出")]


def test_ui_attributes_written_by_templates():
    html = ('<button title="Toggle primary sidebar" data-x="Main"></button>'
            '<summary aria-label="Toggle hidden content"><nav aria-label="Main">'
            '<p title="Main text">Main</p>')
    assert edition.translate_attributes(html, edition.UI_ZH["attributes"]) == (
        '<button title="显示或隐藏主侧栏" data-x="Main"></button>'
        '<summary aria-label="显示或隐藏折叠内容"><nav aria-label="主导航">'
        '<p title="Main text">Main</p>')


def test_check_fails_on_a_space_between_chinese_characters():
    en = "Quantized dots, routed experts and sink attention, on `xp` arrays."
    assert zh.check_block(en, "量化点积、路由专家和汇点注意力，作用于 `xp` 数组。") == []
    assert zh.check_block(en, "量化点积、路由专家和 汇点注意力，作用于 `xp` 数组。") == \
        ["a space between Chinese characters: ['和 汇']"]


@pytest.mark.parametrize("language", ["zh_CN", "en"])
def test_ui_config_only_on_chinese_pages(language, monkeypatch):
    """What the zh build sets when Sphinx reads its configuration; the English one keeps
    the theme's words."""
    from types import SimpleNamespace

    from sphinx import locale
    booktheme = gettext.translation("booktheme", BOOKTHEME_LOCALES, ["zh_CN"])
    translators = {("general", "sphinx"): gettext.NullTranslations(),
                   ("general", "booktheme"): booktheme}
    monkeypatch.setattr(locale, "translators", translators)
    config = SimpleNamespace(language=language, html_theme_options={"logo": {}},
                             togglebutton_hint="Click to show",
                             togglebutton_hint_hide="Click to hide")
    app = SimpleNamespace(config=config, translator=translators["general", "sphinx"])
    edition._ui_config(app, config)
    got = (config.html_theme_options, config.togglebutton_hint,
           translators["general", "booktheme"].gettext("Print to PDF"))
    if language == "en":
        assert got == ({"logo": {}}, "Click to show", "列印成 PDF")
    else:
        assert got == ({"logo": {}, "search_bar_text": "搜索本书……"}, "点击显示", "打印为 PDF")
        assert config.togglebutton_hint_hide == "点击隐藏"
        assert app.translator is translators["general", "sphinx"]
        assert app.translator.gettext("Color mode") == "颜色模式"


def test_section_ids_are_those_of_the_english_page():
    heads = ["# 3. Quantized matvec", "## 3.2 Q8_0 × Q8_0: an integer dot per block",
             "## 7.3 The router: $p = \\sqrt{\\mathrm{softplus}(\\ell)}$",
             "## 1.4 The shape: `ModelConfig`", "## Exercises", "## Exercises",
             "## G.3 Part 3 · 注意力机制"]
    assert edition.section_ids(heads) == [
        "quantized-matvec", "q8-0-q8-0-an-integer-dot-per-block",
        "the-router-p-sqrt-mathrm-softplus-ell", "the-shape-modelconfig", "exercises", "",
        "g-3-part-3"]
    # a `#` line in fenced code is no heading
    assert edition.heading_lines("## 1.1 A\n```python\n# not a heading\n```\n### B") == [
        "## 1.1 A", "### B"]


def _translated_page(page: str):
    """The Chinese page's doctree as the build makes it, from its translated markdown:
    its sections, with the English ids `add_english_ids` gives them."""
    from docutils.core import publish_doctree
    from myst_parser.parsers.docutils_ import Parser

    nb = json.loads((ROOT / "book" / f"{page}.ipynb").read_text())
    english = edition.english_section_ids(nb)
    table = edition.current_translations(ROOT / "locale" / "zh" / f"{page}.md")
    assert edition.translate_notebook(nb, table) == []
    zh_heads = [h for c in nb["cells"] if c["cell_type"] == "markdown"
                for h in edition.heading_lines("".join(c["source"]))]
    doc = publish_doctree("\n\n".join(zh_heads), parser=Parser(), settings_overrides={
        "myst_enable_extensions": edition.MYST_EXTENSIONS, "doctitle_xform": False,
        "report_level": 5, "myst_suppress_warnings": ["myst.header"]})
    return english, doc, edition.add_english_ids(doc, english)


def test_glossary_links_land_on_their_section_in_both_editions():
    """Each glossary row links to `page.html#anchor`. The anchor is a section of the English
    page, and the Chinese page's section (whose heading is Chinese, so docutils would name it
    otherwise) carries it too."""
    from docutils import nodes

    with open(ROOT / "data" / "glossary.tsv", newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f, delimiter="\t"))
    pages = {}
    lost = []
    for r in rows:
        page, _, anchor = r["section"].partition("#")
        if page not in pages:
            pages[page] = _translated_page(page)
        english, doc, problems = pages[page]
        assert problems == [], (page, problems)
        if anchor not in english:
            lost.append(f"{r['english']}: no section #{anchor} on the English {page}")
        target = doc.ids.get(anchor)
        if not isinstance(target, nodes.section):
            lost.append(f"{r['english']}: no section #{anchor} on the Chinese {page}")
    assert not lost, "\n".join(lost)
    # the glossary page's stored table links exactly these targets
    out = json.loads((ROOT / "book" / "H_glossary.ipynb").read_text())
    html = "".join("".join(o.get("data", {}).get("text/html", []))
                   for c in out["cells"] if c["cell_type"] == "code" for o in c["outputs"])
    import re
    assert sorted(re.findall(r'<a href="([^"]+)">', html)) == sorted(
        "{}.html#{}".format(*r["section"].split("#")) for r in rows)


def test_a_chinese_heading_alone_would_lose_the_english_anchor():
    """Without add_english_ids a Chinese heading's section has another id: the case the
    extension exists for."""
    from docutils.core import publish_doctree
    from myst_parser.parsers.docutils_ import Parser

    doc = publish_doctree("## 3.2 Q8_0 × Q8_0：每块一次整数点积", parser=Parser(),
                          settings_overrides={"doctitle_xform": False, "report_level": 5})
    assert "q8-0-q8-0-an-integer-dot-per-block" not in doc.ids
    assert edition.add_english_ids(doc, ["q8-0-q8-0-an-integer-dot-per-block"]) == []
    assert "q8-0-q8-0-an-integer-dot-per-block" in doc.ids
    assert edition.add_english_ids(doc, ["a", "b"]) == ["1 sections, 2 English headings"]


def test_chapters_are_named_by_number_or_letter():
    assert [p.stem for p in zh.chapters(["A", "10"])] == ["10_beyond", "A_oracle"]
    assert [p.stem for p in zh.chapters(["03_matvec"])] == ["03_matvec"]
    with pytest.raises(SystemExit, match="no chapter or appendix 11"):
        zh.chapters(["11"])
