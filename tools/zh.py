#!/usr/bin/env python3
"""The Chinese edition: keep its translations in step with the English, and build it.

    tools/zh.py sync [NN ...]    write locale/zh/<chapter>.md in the chapters' cell order:
                                 current translations kept, changed cells marked stale
                                 (old translation kept), new cells added empty
    tools/zh.py status [NN ...]  per chapter: translated, stale, missing; exit 1 if any gap
    tools/zh.py check [NN ...]   each translation keeps its English cell's links, refs,
                                 math, code and headings; exit 1 on the first chapter that
                                 does not
    tools/zh.py build            build the Chinese edition into _build/html/zh/
                                 (after `jupyter-book build .` made the English one)

A chapter is named by its number (`03`) or its file name; none means every chapter.
"""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
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
    return [p for p in paths if any(p.name.startswith(a) or p.stem == a for a in args)]


def english_cells(nb_path: Path) -> list[tuple[int, str]]:
    nb = json.loads(nb_path.read_text())
    return [(i, "".join(c["source"]).strip()) for i, c in enumerate(nb["cells"])
            if c["cell_type"] == "markdown"]


def translation_path(nb_path: Path) -> Path:
    return LOCALE / f"{nb_path.stem}.md"


def sync(nb_path: Path) -> None:
    path = translation_path(nb_path)
    old = parse_translations(path.read_text()) if path.exists() else []
    by_key = {b["key"]: b for b in old if cell_key(b["en"]) == b["key"]}
    by_cell = {b["cell"]: b for b in old}
    cells = english_cells(nb_path)
    keys = {cell_key(en) for _, en in cells}
    blocks = []
    for i, en in cells:
        key = cell_key(en)
        if key in by_key:
            blocks.append({**by_key[key], "cell": i, "en": en})
            continue
        was = by_cell.get(i)
        # the old translation of a changed cell stays, marked stale, for the translator
        zh = was["zh"] if was and was["key"] not in keys else ""
        blocks.append({"cell": i, "key": key, "stale": bool(zh), "en": en, "zh": zh})
    LOCALE.mkdir(parents=True, exist_ok=True)
    path.write_text(format_translations(blocks))


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
ROLE = re.compile(r"\{(?:ref|numref|doc|eq)\}`[^`<]*?<?([^`<>]+)>?`")
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


def check(nb_path: Path) -> list[str]:
    """Translations that lost or changed a link, ref, formula, code or heading."""
    path = translation_path(nb_path)
    if not path.exists():
        return []
    problems = []
    for b in parse_translations(path.read_text()):
        if not b["zh"] or b["stale"]:
            continue
        en, zh = structure(b["en"]), structure(b["zh"])
        for what in en:
            if en[what] != zh[what]:
                lost = [x for x in en[what] if x not in zh[what]]
                added = [x for x in zh[what] if x not in en[what]]
                problems.append(f"{nb_path.name} cell {b['cell']}: {what} differ"
                                f" (English only: {lost[:3]}, Chinese only: {added[:3]})")
    return problems


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
            sync(nb_path)
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
