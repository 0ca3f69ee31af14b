#!/usr/bin/env python3
"""Make every ds4.c line citation in the book's prose a link to that line at the pinned commit.

    python tools/ds4c_links.py          # rewrite the chapters' markdown cells in place
    python tools/ds4c_links.py --check  # exit 1 and name each cell that is not linked yet

A citation is `l. N`, `l. N-M` or `ll. N-M`, possibly followed by more numbers (`l. 5094-5106,
5130`). It points into ds4.c unless the words just before it name another file of the
repository (`ds4.h l. 103`, `ds4_cuda.cu l. 7989`). Line numbers of the study notes (`the
notes' l. 3494`) are not ds4.c's at this commit and stay plain text. Code spans and math are
left alone. The rewrite is idempotent: a linked citation is not linked twice.
"""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COMMIT = "8d576642c39b9a2d782a80159ba84ef5a81c0b81"
BLOB = f"https://github.com/antirez/ds4/blob/{COMMIT}/"
# the other files of ds4's repository that the prose cites by line
FILES = ("ds4.h", "ds4_cuda.cu", "ds4_metal.m", "ds4_server.c", "ds4_cli.c", "ds4_gpu.h")

NUM = r"\d{1,5}(?:[-–]\d{1,5})?"
CITE = re.compile(rf"(?<![\w\[])(ll?\. ?)({NUM})((?:, {NUM}(?![\d.]))*)(?!\]|\d)")
# a code span, inline math or an existing link's text: never rewritten inside
SKIP = re.compile(r"`[^`\n]*`|\$[^$\n]+\$|\[[^\]\n]*\]\([^)\n]*\)")
NOT_DS4C = re.compile(r"(notes'|notes’|笔记|about)\s*$")


def url(file: str, span: str) -> str:
    a, _, b = span.replace("–", "-").partition("-")
    return f"{BLOB}{file}#L{a}" + (f"-L{b}" if b else "")


def cited_file(before: str) -> str | None:
    """ds4.c, another file named just before the citation, or None for the notes' numbers."""
    tail = before[-60:]
    if NOT_DS4C.search(before[-12:]) or re.search(r"notes'(?:(?!\.\s+[A-Z]|[;|]).)*$", tail):
        return None
    named = [(tail.rfind(f), f) for f in FILES if f in tail]
    if named:
        pos, f = max(named)
        if "ds4.c" not in tail[pos:]:
            return f
    return "ds4.c"


def link_text(text: str) -> str:
    out, last = [], 0
    protected = [m.span() for m in SKIP.finditer(text)]

    def inside(i):
        return any(a <= i < b for a, b in protected)

    for m in CITE.finditer(text):
        if inside(m.start()):
            continue
        file = cited_file(text[: m.start()])
        if file is None:
            continue
        prefix, first, more = m.groups()
        parts = [f"[{prefix}{first}]({url(file, first)})"]
        for extra in re.findall(NUM, more):
            parts.append(f"[{extra}]({url(file, extra)})")
        out.append(text[last:m.start()])
        out.append(", ".join(parts))
        last = m.end()
    out.append(text[last:])
    return "".join(out)


def chapters():
    book = ROOT / "book"
    return sorted([*book.glob("[0-9][0-9]_*.ipynb"), *book.glob("[A-Z]_*.ipynb")])


def unlinked(path: Path) -> list[int]:
    nb = json.loads(path.read_text())
    return [i for i, c in enumerate(nb["cells"]) if c["cell_type"] == "markdown"
            and link_text("".join(c["source"])) != "".join(c["source"])]


def rewrite(path: Path) -> int:
    raw = path.read_text()
    nb = json.loads(raw)
    changed = 0
    for cell in nb["cells"]:
        if cell["cell_type"] != "markdown":
            continue
        src = "".join(cell["source"])
        new = link_text(src)
        if new != src:
            cell["source"] = new.splitlines(keepends=True)
            changed += 1
    if changed:
        path.write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n")
    return changed


if __name__ == "__main__":
    if sys.argv[1:] == ["--check"]:
        bad = [(p.name, i) for p in chapters() for i in unlinked(p)]
        for name, i in bad:
            print(f"{name} cell {i}: a ds4.c line citation without its link")
        sys.exit(1 if bad else 0)
    for p in chapters():
        n = rewrite(p)
        if n:
            print(f"{p.name}: {n} cells linked")
