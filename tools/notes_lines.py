#!/usr/bin/env python3
"""The study notes' ds4.c line citations against the definitions' lines at the pinned commit.

    python tools/notes_lines.py NOTES_TXT DS4C_C --out data/notes_lines.tsv

The notes (《ds4.c 学习笔记》, part 3: four parts of five traces 追踪) cite ds4.c lines of an
older revision in three spellings:

    // 行 3494: <what follows>                   a comment above the code it is about
    // `rms_norm_weight()` 中（约 2709 行）: ...   the name in the comment
    weights_bind(&e->weights, &e->model)  [行 2578]    a call tree; also "name  ...（行 1987-2023）"

Each citation is paired with the function, struct or macro it is about: the name on its own
line, else the first definition in the code lines below a comment. That name's definition is
then found in ds4.c by name: the first line of `typedef struct { ... } name;`, `struct name {`,
`#define NAME`, or a function definition `... name(` at column 0 whose signature ends in `{`
(a prototype, ending in `;`, is skipped). A range (`行 1987-2023`) cites its first line. A name
cited twice in one part must be cited with one line; it gets one row, at its first trace.

Writes a TSV: part, trace, name, notes_line, pinned_line, offset (= pinned_line - notes_line),
in the notes' order. Numbers and names only: no text of the notes.
"""
from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

PART = re.compile(r"^([1-4])\.\s+\S")
TRACE = re.compile(r"^追踪\s*([1-5])\s*[：:]")
CITE = re.compile(r"行\s*(\d{1,5})(?:\s*-\s*\d{1,5})?|约\s*(\d{1,5})\s*行")
NAMED = re.compile(r"`([A-Za-z_]\w*)\(?\)?`")
# a call-tree or struct-tree line: tree drawing, then the name
LEAD = re.compile(r"^[\s│├└─]*([A-Za-z_]\w*)\s*(?:\(|\s{2,}|\[)")
CODE_DEF = (
    re.compile(r"^#define\s+([A-Za-z_]\w*)"),
    re.compile(r"^\}\s*([A-Za-z_]\w*)\s*;"),
    re.compile(r"^(?:typedef\s+)?struct\s+([A-Za-z_]\w*)\s*\{"),
    re.compile(r"^[A-Za-z_][\w\s\*]*?\b([A-Za-z_]\w*)\s*\("),
)


class NotesLinesError(ValueError):
    """A citation that cannot be paired with a name, or a name ds4.c does not define."""


def defined_in_code(lines: list[str], start: int) -> str:
    """The name the code below a `// 行 N` comment defines (a macro, a struct, a function)."""
    typedef_open = False
    for line in lines[start:start + 40]:
        s = line.rstrip()
        if s.startswith("typedef struct") and s.endswith("{"):
            typedef_open = True
            continue
        for pat in CODE_DEF:
            m = pat.match(s)
            if m and (typedef_open or pat is not CODE_DEF[1]):
                return m.group(1)
        if s.strip() and not s.lstrip().startswith("//") and not typedef_open:
            raise NotesLinesError(f"no definition below the comment: {s.strip()[:40]!r}")
    raise NotesLinesError(f"no definition within 40 lines of notes' line {start}")


def citations(notes: str) -> list[tuple[int, int, str, int]]:
    """(part, trace, name, notes_line) for every line citation, in order, one per name and part."""
    lines = notes.splitlines()
    part = trace = 0
    out: list[tuple[int, int, str, int]] = []
    seen: dict[tuple[int, str], int] = {}
    for i, line in enumerate(lines):
        if m := PART.match(line):
            part, trace = int(m.group(1)), 0
            continue
        if m := TRACE.match(line):
            trace = int(m.group(1))
            continue
        cite = CITE.search(line)
        if not cite:
            continue
        n = int(cite.group(1) or cite.group(2))
        if m := NAMED.search(line):
            name = m.group(1)
        elif line.lstrip().startswith("//"):
            name = defined_in_code(lines, i + 1)
        elif m := LEAD.match(line):
            name = m.group(1)
        else:
            raise NotesLinesError(f"notes' line {i + 1}: a citation with no name")
        if not (part and trace):
            raise NotesLinesError(f"notes' line {i + 1}: a citation before any part and trace")
        if (part, name) in seen:
            if seen[part, name] != n:
                raise NotesLinesError(f"part {part}: {name} cited as l. {seen[part, name]} "
                                      f"and l. {n}")
            continue
        seen[part, name] = n
        out.append((part, trace, name, n))
    return out


def definition_line(src: list[str], name: str) -> int:
    """1-based line where ds4.c defines `name` (first line of its definition)."""
    esc = re.escape(name)
    func = re.compile(rf"^[A-Za-z_][\w\s\*]*?\b{esc}\s*\(")
    for i, line in enumerate(src):
        if re.match(rf"^#define\s+{esc}\b", line):
            return i + 1
        if re.match(rf"^(?:typedef\s+)?struct\s+{esc}\s*\{{", line):
            return i + 1
        if re.match(rf"^\}}\s*{esc}\s*;", line):
            for j in range(i, -1, -1):
                if re.match(r"^typedef\s+(?:struct|union)\b.*\{\s*$", src[j]):
                    return j + 1
        if func.match(line):
            for j in range(i, min(i + 12, len(src))):
                tail = src[j].rstrip()
                if tail.endswith("{"):
                    return i + 1
                if tail.endswith(";"):
                    break
    raise NotesLinesError(f"ds4.c defines no {name!r}")


def table(notes: str, ds4c: str) -> list[tuple[int, int, str, int, int, int]]:
    src = ds4c.splitlines()
    rows = []
    for part, trace, name, n in citations(notes):
        p = definition_line(src, name)
        rows.append((part, trace, name, n, p, p - n))
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("notes", type=Path)
    ap.add_argument("ds4c", type=Path)
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args(argv)
    rows = table(a.notes.read_text(encoding="utf-8"), a.ds4c.read_text(encoding="utf-8"))
    head = "part\ttrace\tname\tnotes_line\tpinned_line\toffset\n"
    a.out.write_text(head + "".join("\t".join(map(str, r)) + "\n" for r in rows),
                     encoding="utf-8")
    print(f"{len(rows)} citations -> {a.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
