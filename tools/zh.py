#!/usr/bin/env python3
"""The Chinese edition: keep its translations in step with the English, and build it.

    tools/zh.py sync [ID ...]    write locale/zh/<chapter>.md in the chapters' cell order:
                                 current translations kept, changed cells marked stale
                                 (old translation kept), new cells added empty
    tools/zh.py status [ID ...]  per chapter: translated, stale, missing; exit 1 if any gap
    tools/zh.py check [ID ...]   each translation keeps its English cell's links, refs,
                                 math, code and headings; exit 1 on the first chapter that
                                 does not
    tools/zh.py build            build the Chinese edition into _build/html/zh/
                                 (after `jupyter-book build .` made the English one)

A chapter is named by its number (`03`), an appendix by its letter (`A`), or either by its
file name (`03_matvec`, `A_oracle`); none means every chapter and appendix.
"""
from __future__ import annotations

import difflib
import json
import re
import shutil
import subprocess
import sys
from decimal import Decimal
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "book" / "_ext"))
from edition import (cell_key, current, format_translations,  # noqa: E402
                     parse_translations)

LOCALE = ROOT / "locale" / "zh"
CAPTIONS = {"Weights and formats": "权重与格式", "The layer": "一层之内",
            "The engine": "引擎", "Appendix": "附录"}
TITLE = "ds4ref：ds4.c 之书"


def chapters(args: list[str]) -> list[Path]:
    """The book's chapters in table-of-contents order, or those named."""
    toc = yaml.safe_load((ROOT / "_toc.yml").read_text())
    files = [toc["root"]] + [c["file"] for p in toc["parts"] for c in p["chapters"]]
    paths = [ROOT / f"{f}.ipynb" for f in files]
    if not args:
        return paths
    named = {a: [p for p in paths if p.stem.split("_")[0] == a or p.stem == a] for a in args}
    unknown = [a for a, hits in named.items() if not hits]
    if unknown:
        ids = ", ".join(p.stem.split("_")[0] for p in paths)
        raise SystemExit(f"no chapter or appendix {', '.join(unknown)} (the ids: {ids})")
    return [p for p in paths if any(p in hits for hits in named.values())]


def english_cells(nb_path: Path) -> list[tuple[int, str]]:
    nb = json.loads(nb_path.read_text())
    return [(i, "".join(c["source"]).strip()) for i, c in enumerate(nb["cells"])
            if c["cell_type"] == "markdown"]


def translation_path(nb_path: Path) -> Path:
    return LOCALE / f"{nb_path.stem}.md"


# A changed cell keeps the block of its previous English when the two are this alike:
# SAME_GAP when the cell stands between the same unchanged neighbours the block stood
# between, ANYWHERE when it moved too, ALONE when it is the only changed cell between those
# neighbours and the block the only unclaimed one (a rewrite in place).
ALONE, SAME_GAP, ANYWHERE = 0.25, 0.5, 0.75
KEPT_WORDS = 20


def similarity(a: str, b: str) -> float:
    """How alike two English texts are, 0 to 1, word by word: difflib's ratio (twice the
    words that line up over the words of both), or, once KEPT_WORDS or more words line
    up, the share of the shorter text's words that do if that is larger (a paragraph
    added to a cell, or cut from it, keeps the rest)."""
    a_words, b_words = a.split(), b.split()
    if not a_words or not b_words:
        return float(a_words == b_words)
    sm = difflib.SequenceMatcher(None, a_words, b_words, autojunk=False)
    kept = sum(m.size for m in sm.get_matching_blocks())
    ratio = 2 * kept / (len(a_words) + len(b_words))
    if kept >= KEPT_WORDS:
        return max(ratio, kept / min(len(a_words), len(b_words)))
    return ratio


def _translates(b: dict) -> str | None:
    """The English a block's translation was made for, or None if that is not known."""
    if not b["zh"]:
        return None
    if not b["stale"]:
        return b["en"] if cell_key(b["en"]) == b["key"] else None
    return b.get("was") or None


def _anchors(pairs: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The longest run of (cell, block) pairs in the same order on both sides (a longest
    increasing subsequence; ties go to the earliest block, so the result is deterministic)."""
    best: list[list[tuple[int, int]]] = []   # best[k]: a chain of length k+1, smallest tail
    for p in sorted(pairs):
        k = next((k for k, chain in enumerate(best) if chain[-1][1] >= p[1]), len(best))
        chain = (best[k - 1] if k else []) + [p]
        if k == len(best):
            best.append(chain)
        else:
            best[k] = chain
    return best[-1] if best else []


def _same_english(old: list[dict], cells: list[tuple[int, str]]) -> dict[int, int]:
    """Cell position -> the block that quoted its very English or, failing that, the stale
    block whose translation was made for it. A second cell with the same English shares."""
    by_en: dict[str, list[int]] = {}
    by_made: dict[str, list[int]] = {}
    for j, b in enumerate(old):
        by_en.setdefault(cell_key(b["en"]), []).append(j)
        if b["stale"] and _translates(b) is not None:
            by_made.setdefault(cell_key(_translates(b)), []).append(j)
    claimed: dict[int, int] = {}
    for n, (_, en) in enumerate(cells):
        key = cell_key(en)
        for table in (by_en, by_made):
            free = [j for j in table.get(key, []) if j not in claimed.values()]
            if free or table.get(key):
                claimed[n] = (free or table[key])[0]
                break
    return claimed


def _edited(old: list[dict], cells: list[tuple[int, str]],
            claimed: dict[int, int]) -> dict[int, int]:
    """Changed cell position -> the translated block of its previous English (step 2 of
    `plan`)."""
    anchors = _anchors(list(claimed.items()))

    def gap(pos: int, side: int) -> int:
        return sum(a[side] < pos for a in anchors)

    free_cells = [n for n in range(len(cells)) if n not in claimed]
    free_blocks = [j for j in range(len(old)) if j not in claimed.values()]
    candidates = []
    for n in free_cells:
        for j in free_blocks:
            if old[j]["zh"]:
                same = gap(n, 0) == gap(j, 1)
                s = similarity(cells[n][1], old[j]["en"])
                if s >= (SAME_GAP if same else ANYWHERE):
                    candidates.append((-s, not same, abs(n - j), n, j))
    edited: dict[int, int] = {}
    for _, _, _, n, j in sorted(candidates):
        if n not in edited and j not in edited.values():
            edited[n] = j
    # a rewrite in place: the only changed cell and the only unclaimed block between the
    # same two anchors
    by_gap: dict[int, tuple[list[int], list[int]]] = {}
    for n in free_cells:
        if n not in edited:
            by_gap.setdefault(gap(n, 0), ([], []))[0].append(n)
    for j in free_blocks:
        if j not in edited.values():
            by_gap.setdefault(gap(j, 1), ([], []))[1].append(j)
    for ns, js in by_gap.values():
        if len(ns) == len(js) == 1 and old[js[0]]["zh"] and \
                similarity(cells[ns[0]][1], old[js[0]]["en"]) >= ALONE:
            edited[ns[0]] = js[0]
    return edited


def plan(old: list[dict], cells: list[tuple[int, str]]) -> tuple[list[dict], list[dict]]:
    """The blocks for a chapter's markdown cells now, from the blocks of the last sync;
    and the old blocks whose translation no cell keeps (dropped), in file order.

    A translation belongs to the English it was made for, never to a cell index:
    1. a cell whose English is what a block quoted keeps that block as it was (current or
       stale), wherever the cell moved; a cell whose English is back to what a stale
       block's translation was made for gets that translation back, current;
    2. the unchanged cells that kept their order are anchors; each changed cell is paired
       with the unclaimed block whose English it most resembles (`similarity`), at least
       SAME_GAP alike between the same anchors or ANYWHERE alike elsewhere, best pair
       first; then a cell that is the only changed one between two anchors, where one
       block is left unclaimed, takes it if ALONE alike. A paired cell gets the block's
       translation, marked stale, quoting the English the translation was made for;
    3. any other cell gets an empty block; a block no cell claimed is dropped."""
    claimed = _same_english(old, cells)
    edited = _edited(old, cells, claimed)
    blocks = []
    for n, (i, en) in enumerate(cells):
        block = {"cell": i, "key": cell_key(en), "stale": False, "en": en, "was": "",
                 "zh": ""}
        if n in claimed:
            b = old[claimed[n]]
            made = en if cell_key(b["en"]) != block["key"] else _translates(b)
            stale = bool(b["zh"]) and made != en
            block.update(stale=stale, was=(made or "") if stale else "", zh=b["zh"])
        elif n in edited:
            b = old[edited[n]]
            block.update(stale=True, was=_translates(b) or "", zh=b["zh"])
        blocks.append(block)
    kept = set(claimed.values()) | set(edited.values())
    return blocks, [b for j, b in enumerate(old) if j not in kept and b["zh"]]


def sync(nb_path: Path) -> list[dict]:
    """Rewrite a chapter's translation file in step with its cells (see `plan`); return
    the blocks whose translation was dropped."""
    path = translation_path(nb_path)
    old = parse_translations(path.read_text()) if path.exists() else []
    blocks, dropped = plan(old, english_cells(nb_path))
    LOCALE.mkdir(parents=True, exist_ok=True)
    path.write_text(format_translations(blocks))
    return dropped


def gaps(nb_path: Path) -> dict[str, list[int]]:
    """Markdown cells of a chapter without a current translation, by reason."""
    path = translation_path(nb_path)
    blocks = parse_translations(path.read_text()) if path.exists() else []
    table, stale = current(blocks), {b["key"] for b in blocks if b["stale"]}
    out = {"stale": [], "missing": []}
    for i, en in english_cells(nb_path):
        key = cell_key(en)
        if key not in table:
            out["stale" if key in stale else "missing"].append(i)
    return out


# What a translation must carry over unchanged from the English it translates.
FENCE = re.compile(r"^[ \t]*(`{3,})(.*?)\n(.*?)^[ \t]*\1[ \t]*$", re.S | re.M)
DISPLAY_MATH = re.compile(r"\$\$.*?\$\$", re.S)
LINK = re.compile(r"\]\(([^)\s]+)\)")
ROLE = re.compile(r"\{(?:ref|numref|doc|eq|anchor)\}`[^`<]*?<?([^`<>]+)>?`")
CODE = re.compile(r"`([^`]+)`")  # a code span may wrap onto the next line
INLINE_MATH = re.compile(r"(?<![\\$])\$([^$\n]+?)\$")
HEADING = re.compile(r"^(#{1,6}) ", re.M)


def _fences(md: str) -> tuple[list[str], str]:
    """Code blocks verbatim, and the text outside them. A MyST directive (```{note}) is
    not code: its name and options must stay, its body is text to translate."""
    kept = []

    def one(m):
        info, body = m[2].strip(), m[3]
        if not info.startswith("{"):
            kept.append("\n".join(x.strip() for x in m[0].split("\n")))
            return ""
        options = [x.strip() for x in body.split("\n") if x.strip().startswith(":")]
        kept.append(info.split("}")[0] + "} " + " ".join(options))
        inner, text = _fences("\n".join(x for x in body.split("\n")
                                         if not x.strip().startswith(":")))
        kept.extend(inner)
        return text
    text = FENCE.sub(one, md)
    return kept, text


def structure(md: str) -> dict:
    fences, rest = _fences(md)
    display = DISPLAY_MATH.findall(rest)
    rest = DISPLAY_MATH.sub("", rest)
    roles = ROLE.findall(rest)
    rest_nr = ROLE.sub("", rest)
    return {"code blocks": fences, "display math": sorted(display),
            "links": sorted(LINK.findall(rest)), "refs": sorted(roles),
            "code spans": sorted(set(" ".join(c.split()) for c in CODE.findall(rest_nr))),
            "inline math": sorted(set(m.strip() for m in INLINE_MATH.findall(
                CODE.sub("", rest_nr)))),
            "headings": [len(h) for h in HEADING.findall(rest)]}


HTML_TAG = re.compile(r"<[^>\n]+>")
BARE_URL = re.compile(r"https?://\S+")
LABEL = re.compile(r"^\([\w:-]+\)=[ \t]*$", re.M)
CJK = re.compile(r"[\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff]")
CJK_SPACE_CJK = re.compile(r"[\u3400-\u4dbf\u4e00-\u9fff][ \t]+[\u3400-\u4dbf\u4e00-\u9fff]")
# an English word: two or more Latin letters standing alone, not a piece of a name such
# as ds4.c, llama.cpp, Q8_0 or IQ2_XXS
WORD = re.compile(r"(?<![\w.])[A-Za-z]{2,}(?!\w|\.\w)")
NUMBER = re.compile(r"\d+(?:\.\d+)*")
THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")
TABLE_ROW = re.compile(r"^[ \t]*\|.*\|[ \t]*$", re.M)
CELL_BAR = re.compile(r"(?<!\\)\|")


def prose(md: str, hole: str = " ") -> str:
    """The words a translator translates: a cell without its code blocks, math, code
    spans, refs, link targets, URLs, HTML tags and MyST labels (which stay as they are),
    each replaced by `hole`."""
    _, text = _fences(md)
    for pattern in (DISPLAY_MATH, ROLE, CODE, INLINE_MATH, LABEL, HTML_TAG):
        text = pattern.sub(hole, text)
    text = LINK.sub("]", text)
    return BARE_URL.sub(hole, text)


SCALED = re.compile(r"(\d+(?:\.\d+)?)[ -](thousand|million|billion)\b")
# Chinese counts large numbers in 万 (10^4) and 亿 (10^8): 284 billion is 2840 亿
IN_WAN_YI = {"thousand": (Decimal("0.1"),), "million": (Decimal(100),),
             "billion": (Decimal(10),)}
NUMERALS = "零一二三四五六七八九十"


def numbers(md: str) -> set[str]:
    """The numbers of a cell's prose (1,024 read as 1024); a number in code or math is
    `structure`'s to check."""
    return set(NUMBER.findall(THOUSANDS.sub("", prose(md))))


def lost_numbers(en: str, zh: str) -> list[str]:
    """Numbers of the English prose that the Chinese does not have. Each must appear,
    in any order, as digits, except: a number of thousands, millions or billions may
    be counted in 万 or 亿 (284 billion as 2840 亿), and one from 0 to 10 may be its
    Chinese numeral (3-D as 三维, 2 as 两)."""
    have, text = numbers(zh), prose(zh)
    scaled = {}
    for n, unit in SCALED.findall(THOUSANDS.sub("", prose(en))):
        scaled.setdefault(n, set()).update(
            format((Decimal(n) * f).normalize(), "f") for f in IN_WAN_YI[unit])
    lost = []
    for n in numbers(en) - have:
        if scaled.get(n, set()) & have:
            continue
        if n.isdigit() and int(n) <= 10 and (
                NUMERALS[int(n)] in text or (n == "2" and "两" in text)):
            continue
        lost.append(n)
    return sorted(lost, key=lambda x: (len(x), x))


def table_columns(md: str) -> list[int]:
    """Cells in each table row, in order (a pipe escaped as \\| is inside a cell)."""
    _, text = _fences(md)
    return [len(CELL_BAR.findall(row.strip())) - 1 for row in TABLE_ROW.findall(text)]


def untranslated(en: str, zh: str) -> str:
    """Why a block is still English, or "". A block whose English prose has no word
    (code, math, links to names, numbers) may stay as it is; any other must have a
    Chinese character, and keep fewer than half of its English words (names, quoted
    titles: at most a quarter in the book)."""
    en_words = WORD.findall(prose(en))
    if not en_words:
        return ""
    if not CJK.search(zh):
        return "left in English (no Chinese character)"
    kept = len(WORD.findall(prose(zh)))
    if 2 * kept >= len(en_words):
        return f"half left in English ({kept} of its {len(en_words)} English words)"
    return ""


def check_block(en: str, zh: str) -> list[str]:
    """What a translation lost or changed of its English: links, refs, math, code,
    headings, table columns, numbers; or that it is no translation at all, or has a
    stray space between two Chinese characters."""
    problems = [why] if (why := untranslated(en, zh)) else []
    s_en, s_zh = structure(en), structure(zh)
    for what in s_en:
        if s_en[what] != s_zh[what]:
            lost = [x for x in s_en[what] if x not in s_zh[what]]
            added = [x for x in s_zh[what] if x not in s_en[what]]
            problems.append(f"{what} differ (English only: {lost[:3]}, Chinese only:"
                            f" {added[:3]})")
    t_en, t_zh = table_columns(en), table_columns(zh)
    if t_en != t_zh:
        rows = [k for k in range(max(len(t_en), len(t_zh)))
                if k >= len(t_en) or k >= len(t_zh) or t_en[k] != t_zh[k]]
        problems.append(f"table columns differ from row {rows[0] + 1} on (English"
                        f" {t_en[rows[0]:rows[0] + 3]}, Chinese {t_zh[rows[0]:rows[0] + 3]})")
    lost = lost_numbers(en, zh)
    if lost:
        problems.append(f"numbers of the English missing: {lost[:6]}")
    spaced = CJK_SPACE_CJK.findall(prose(zh, hole="\0"))
    if spaced:
        problems.append(f"a space between Chinese characters: {spaced[:3]}")
    return problems


def check(nb_path: Path) -> list[str]:
    """Translations that lost or changed a link, ref, formula, code, heading, table
    column or number, or were left in English."""
    path = translation_path(nb_path)
    if not path.exists():
        return []
    return [f"{nb_path.name} cell {b['cell']}: {p}"
            for b in parse_translations(path.read_text()) if b["zh"] and not b["stale"]
            for p in check_block(b["en"], b["zh"])]


def build() -> int:
    """The Chinese edition, from the same notebooks, into _build/html/zh/."""
    conf = yaml.safe_load((ROOT / "_config.yml").read_text())
    conf["title"] = TITLE
    exts = conf["sphinx"]["local_extensions"]
    for name in exts:
        exts[name] = str((ROOT / exts[name]).resolve())
    conf["sphinx"]["config"]["language"] = "zh_CN"
    toc = yaml.safe_load((ROOT / "_toc.yml").read_text())
    for part in toc["parts"]:
        part["caption"] = CAPTIONS.get(part["caption"], part["caption"])
    work = ROOT / "_build" / "zh_config"
    work.mkdir(parents=True, exist_ok=True)
    (work / "_config.yml").write_text(yaml.safe_dump(conf, allow_unicode=True))
    (work / "_toc.yml").write_text(yaml.safe_dump(toc, allow_unicode=True))
    out = ROOT / "_build" / "zh_out"
    jb = Path(sys.executable).parent / "jupyter-book"
    r = subprocess.run([str(jb), "build", str(ROOT), "-W", "-n", "--keep-going",
                        "--config", str(work / "_config.yml"), "--toc", str(work / "_toc.yml"),
                        "--path-output", str(out)])
    if r.returncode:
        return r.returncode
    dest = ROOT / "_build" / "html" / "zh"
    shutil.rmtree(dest, ignore_errors=True)
    shutil.copytree(out / "_build" / "html", dest)
    print(f"Chinese edition: {dest / 'index.html'}")
    return 0


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in {"sync", "status", "check", "build"}:
        print(__doc__)
        return 2
    cmd, args = argv[0], argv[1:]
    if cmd == "build":
        return build()
    bad = 0
    for nb_path in chapters(args):
        if cmd == "sync":
            for b in sync(nb_path):
                first = b["en"].splitlines()[0][:60] if b["en"] else ""
                print(f"{nb_path.name}: dropped the translation of old cell {b['cell']}"
                      f" ({first!r}): no cell has that English now")
        if cmd in {"sync", "status"}:
            g = gaps(nb_path)
            n = len(english_cells(nb_path))
            done = n - len(g["stale"]) - len(g["missing"])
            print(f"{nb_path.name:26} {done:3}/{n:<3} translated"
                  + (f"; stale {g['stale']}" if g["stale"] else "")
                  + (f"; missing {g['missing']}" if g["missing"] else ""))
            bad += bool(g["stale"] or g["missing"])
        if cmd == "check":
            for p in check(nb_path):
                print(p)
                bad += 1
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
