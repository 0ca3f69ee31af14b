#!/usr/bin/env python3
"""Build it yourself: a learner's notebook per core chapter, checked against ds4.c.

A chapter marks the functions that are its mechanism with a cell tag
`learn:<name>` on the export cell that defines them (`learn:GGUFFile._parse` for a
method). The tag changes neither the cell's source, nor its id, nor what the tangler
or the book's pages make of it.

    python tools/learn.py make [NN ...] [--force]  learn/NN_x.ipynb per core chapter
                                                   (an existing one is kept: yours)
    python tools/learn.py check NN [--notebook P]  the learner's functions against ds4.c
                               [--time-limit S]   (S seconds each, all cases; 60)

`make` copies the chapter (outputs cleared) and replaces each marked function's body,
after its docstring, by a stub that raises NotImplementedError; a first code cell
defines `exercise`, the decorator that runs the book's version (ds4ref's) while the
stub is still there, saying so once, and puts the learner's function into ds4ref for
the later cells of their notebook. The reference solutions are the chapters.

`check` runs the learner notebook's export cells (nothing else) in a fresh namespace
and compares each marked function, op by op, with ds4.c's recorded values (data/oracle)
or the `gguf` package's decoding; it reports the first place where they differ.
Whatever the learner's notebook or code does (a folder for a notebook, a syntax error,
an exception, an endless loop, sys.exit, a None or float64 result), the check names it
with the function or cell and exits 1 or 2, never with a traceback from inside it.
"""
from __future__ import annotations

import argparse
import ast
import contextlib
import json
import os
import signal
import sys
import threading
import types
from pathlib import Path

from tangle import code_cells  # tools/: the tangler's reading of `#|` lines

ROOT = Path(__file__).resolve().parents[1]
BOOK = ROOT / "book"
LEARN = ROOT / "learn"
TAG = "learn:"
CORE = ("01", "02", "03", "04", "05", "06", "07", "08")
STUB = "{name}: write me"
LIMIT = 60.0      # seconds a learner's function may run, all its cases together

# The first code cell of every learner's notebook (and of every `check` namespace).
HELPER = '''\
# Build it yourself: every function marked @exercise is yours to write. Until its
# body stops raising NotImplementedError, the book's version (in ds4ref) runs instead,
# so the rest of this chapter still runs. Check yours against ds4.c (in a terminal at
# the repository's root) with
#     .venv/bin/python tools/learn.py check {nn}
import functools
import importlib

STRICT = set()    # names that must not fall back (the check sets them)
INSTALL = True    # later cells' `from ds4ref... import` get the learner's functions
_told, _book = set(), {{}}


def book_version(module, qualname):
    """(owner, name, the book's function): the first one seen, before any install."""
    if (module, qualname) not in _book:
        owner = importlib.import_module("ds4ref." + module)
        *path, name = qualname.split(".")
        for part in path:
            owner = getattr(owner, part)
        _book[module, qualname] = owner, name, getattr(owner, name)
    return _book[module, qualname]


def exercise(module, qualname):
    """Run the learner's function; while it is a stub, the book's, saying so once."""
    owner, name, book = book_version(module, qualname)

    def wrap(fn):
        @functools.wraps(fn)
        def run(*args, **kwargs):
            try:
                return fn(*args, **kwargs)
            except NotImplementedError as e:
                if qualname in STRICT or not str(e).startswith(qualname + ": write"):
                    raise
            if qualname not in _told:
                _told.add(qualname)
                print(f"{{qualname}}: not written yet, running the book's "
                      f"(ds4ref.{{module}}.{{qualname}})")
            return book(*args, **kwargs)
        run.exercise = (module, qualname)
        if INSTALL:
            setattr(owner, name, run)
        return run
    return wrap
'''


class LearnError(Exception):
    """A chapter number, notebook or marker the learner tools cannot use."""


class TimeLimit(BaseException):
    """Raised inside the learner's code once it has run past its time. A BaseException,
    so that their own `except Exception:` does not swallow it."""


def chapter_path(nn: str) -> Path:
    hits = sorted(BOOK.glob(f"{nn}_*.ipynb"))
    if not (len(nn) == 2 and nn.isdigit() or len(nn) == 1 and "A" <= nn <= "Z") or not hits:
        # `4` and `04_norms_hc` are the two likely slips: name the number meant
        guess = nn.zfill(2) if nn.isdigit() else nn.split("_")[0]
        hint = f"; did you mean {guess}?" if guess in CORE and guess != nn else ""
        raise LearnError(f"chapter {nn!r}: no book/{nn}_*.ipynb (core chapters: "
                         f"{', '.join(CORE)}{hint})")
    return hits[0]


def learner_path(nn: str) -> Path:
    return LEARN / chapter_path(nn).name


def cells(nb: dict):
    """(cell, source, export module or None, [marked qualnames]) over the code cells,
    the default module resolved as the tangler resolves it."""
    for cell, _, mods in code_cells(nb):
        names = [t[len(TAG):] for t in cell.get("metadata", {}).get("tags", [])
                 if t.startswith(TAG)]
        yield cell, "".join(cell["source"]), (mods[0] if mods else None), names


def marked(nn: str) -> list[tuple[str, str]]:
    """[(module, qualname)] of the chapter's marked functions, in book order."""
    nb = json.loads(chapter_path(nn).read_text())
    out = []
    for _, _, mod, names in cells(nb):
        if names and mod is None:
            raise LearnError(f"chapter {nn}: {names} marked on a cell that is not "
                             "exported")
        out += [(mod, n) for n in names]
    return out


def _find(tree: ast.Module, qualname: str):
    body, node = tree.body, None
    for part in qualname.split("."):
        node = next((n for n in body if isinstance(
            n, (ast.FunctionDef, ast.ClassDef)) and n.name == part), None)
        if node is None:
            raise LearnError(f"{qualname}: no such function in its tagged cell")
        body = node.body
    if not isinstance(node, ast.FunctionDef):
        raise LearnError(f"{qualname}: a class, not a function")
    return node


def stub_source(src: str, module: str, qualname: str, nn: str) -> str:
    """The cell's source with qualname's body (after its docstring) replaced by a stub
    and the `exercise` decorator put on it."""
    lines = src.splitlines()
    fn = _find(ast.parse(src), qualname)
    pad = " " * fn.col_offset
    inner = " " * fn.body[0].col_offset
    head = fn.body[0]
    doc = (isinstance(head, ast.Expr) and isinstance(head.value, ast.Constant)
           and isinstance(head.value.value, str))
    # the body after the docstring (comments just before the first statement stay)
    first = fn.body[0].end_lineno + 1 if doc else fn.body[0].lineno
    what = "the docstring says" if doc else "the chapter's text above says"
    stub = [f"{inner}# Your code here: {what} what to compute (the book's",
            f"{inner}# version is in book/{chapter_path(nn).name}).",
            f"{inner}raise NotImplementedError(",
            f'{inner}    "{STUB.format(name=qualname)}, then check it: '
            f'tools/learn.py check {nn}")']
    top = fn.decorator_list[0].lineno if fn.decorator_list else fn.lineno
    deco = f'{pad}@exercise("{module}", "{qualname}")'
    return "\n".join(lines[:top - 1] + [deco] + lines[top - 1:first - 1] + stub
                     + lines[fn.end_lineno:])


def make(nn: str, out: Path | None = None) -> Path:
    """Write the learner's notebook of chapter nn (default learn/NN_x.ipynb)."""
    src_path = chapter_path(nn)
    nb = json.loads(src_path.read_text())
    names = marked(nn)
    if not names:
        raise LearnError(f"chapter {nn}: no function is marked `{TAG}<name>`")
    for cell, src, mod, tags in cells(nb):
        for q in tags:
            src = stub_source(src, mod, q, nn)
        if tags:
            cell["source"] = src.splitlines(keepends=True)
    for cell in nb["cells"]:
        if cell["cell_type"] == "code":
            cell["outputs"], cell["execution_count"] = [], None
    listing = "\n".join(f"- `{q}` (the book's: `ds4ref.{m}.{q}`)" for m, q in names)
    intro = (f"# Build it yourself: {src_path.stem}\n\nThis is chapter {nn} with the "
             "bodies of its mechanism taken out. Write them:\n\n"
             f"{listing}\n\nA function you have not written yet runs the book's "
             "version, so the whole chapter runs at any time. Once its cell has run, "
             "yours also replaces the book's in `ds4ref` for this notebook's later "
             "cells (restart the kernel to get the book's back). Check yours against "
             "ds4.c's recorded values, in a terminal at the repository's root:\n\n"
             f"```\n.venv/bin/python tools/learn.py check {nn}\n```\n\nThe check "
             "names the first op, layer and position where yours differs. The "
             f"reference solutions are the chapter itself, `book/{src_path.name}`.")
    head = [{"cell_type": "markdown", "id": "learn-intro", "metadata": {},
             "source": intro.splitlines(keepends=True)},
            {"cell_type": "code", "id": "learn-helper", "metadata": {},
             "execution_count": None, "outputs": [],
             "source": HELPER.format(nn=nn).splitlines(keepends=True)}]
    nb["cells"] = head + nb["cells"]
    out = out or learner_path(nn)
    write_notebook(out, nb)
    return out


def write_notebook(out: Path, nb: dict) -> None:
    """Write nb to out, its folder made first; what stands in the way is named."""
    if out.parent.exists() and not out.parent.is_dir():
        raise LearnError(f"{out.parent}: a file, not a folder; move it away and run "
                         "make again")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n")
    except OSError as e:
        raise LearnError(f"{out}: cannot write it ({e.strerror or e})") from e


def notebook_path(nn: str, notebook=None) -> Path:
    return Path(notebook) if notebook else learner_path(nn)


def read_notebook(path: Path, nn: str) -> dict:
    """The notebook at path, its cells checked to be what the check reads; anything
    else (a folder, a text file, broken JSON, a cell without source) is named."""
    if not path.exists():
        raise LearnError(f"{path}: no learner's notebook; run `python tools/learn.py "
                         f"make {nn}` (or `make learn`) first")
    if path.is_dir():
        raise LearnError(f"{path}: a folder, not a notebook (give --notebook a "
                         ".ipynb file)")
    try:
        nb = json.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise LearnError(f"{path}: cannot read it ({e.strerror or e})") from e
    except UnicodeDecodeError as e:
        raise LearnError(f"{path}: not a notebook (not UTF-8 text: {e.reason} at "
                         f"byte {e.start})") from e
    except json.JSONDecodeError as e:
        raise LearnError(f"{path}: not a notebook (not valid JSON: {e.msg} at line "
                         f"{e.lineno}, column {e.colno})") from e
    if not (isinstance(nb, dict) and isinstance(nb.get("cells"), list)):
        raise LearnError(f"{path}: not a notebook (no list of cells)")
    for i, cell in enumerate(nb["cells"]):
        problem = cell_problem(cell)
        if problem:
            raise LearnError(f"{path}: not a notebook the check can read: cell {i} "
                             f"{problem}")
    return nb


def cell_problem(cell) -> str | None:
    """What keeps the check from reading a cell (None: nothing)."""
    if not isinstance(cell, dict) or not isinstance(cell.get("cell_type"), str):
        return "is not a cell (no cell_type)"
    src = cell.get("source")
    if not (isinstance(src, str) or isinstance(src, list)
            and all(isinstance(line, str) for line in src)):
        return "has no source text"
    meta = cell.get("metadata", {})
    if not isinstance(meta, dict) or not isinstance(meta.get("tags", []), list):
        return "has metadata.tags that is not a list"
    return None


def belongs(nb: dict, nn: str, path: Path) -> None:
    """Refuse a notebook that marks none of chapter nn's functions: another chapter's
    notebook checked under the wrong number, or no learner's notebook at all."""
    theirs = {q for _, _, _, names in cells(nb) for q in names}
    want = [q for _, q in marked(nn)]
    if theirs & set(want):
        return
    other = [c for c in CORE if theirs & {q for _, q in marked(c)}]
    what = (f"chapter {other[0]}'s notebook (`tools/learn.py check {other[0]} "
            f"--notebook {path}` checks it)" if other else
            "no learner's notebook (no cell is marked `learn:<name>`)")
    raise LearnError(f"{path}: {what}, not chapter {nn}'s; chapter {nn} marks "
                     f"{', '.join(want)}")


def why_missing(nb: dict, qualname: str) -> str:
    """Why the learner's namespace has no qualname, in terms of their notebook."""
    top = qualname.split(".")[0]
    for cell, _, mod, names in cells(nb):
        if qualname in names:
            where = f"cell {cell.get('id')} (marked learn:{qualname})"
            if mod is None:
                return (f"{where} has lost its `#| export` line: the check runs only "
                        "export cells")
            return f"{where} defines no `{top}`: renamed or deleted?"
    return f"no cell is marked learn:{qualname} and no export cell defines `{top}`"


@contextlib.contextmanager
def time_limit(seconds, what: str):
    """Raise TimeLimit in the code inside once it has run `seconds`: a learner's
    endless loop must not hang the check. seconds None: no limit. Where there is no
    SIGALRM (Windows) or off the main thread, nothing can interrupt it: no limit.
    A computation inside one C call (a huge numpy op) is interrupted when it returns."""
    if seconds is None or not hasattr(signal, "setitimer") \
            or threading.current_thread() is not threading.main_thread():
        yield
        return
    if seconds <= 0:
        raise TimeLimit(what)
    fired = [0]

    def alarm(signum, frame):
        fired[0] += 1
        if fired[0] > 5:      # their code swallowed it five times (a bare except:)
            print(f"tools/learn.py: {what}: still running after {seconds:g} s, and "
                  "it catches the interrupt (a bare `except:`?); stopped",
                  file=sys.stderr, flush=True)
            os._exit(1)
        raise TimeLimit(what)
    old = signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds, 1.0)   # then again every second
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def load(nn: str, notebook: Path | None = None, limit: float | None = LIMIT) -> dict:
    """The learner's namespace: the helper cell and every export cell of their notebook,
    run in order (export cells never depend on the demonstration cells)."""
    path = notebook_path(nn, notebook)
    nb = read_notebook(path, nn)
    belongs(nb, nn, path)
    # a registered module: dataclasses look their class's module up in sys.modules
    mod = types.ModuleType(f"learn_{nn}")
    sys.modules[mod.__name__] = mod
    ns = mod.__dict__
    # the tool's own helper, whatever became of the notebook's copy of it
    exec(compile(HELPER.format(nn=nn), "learn-helper", "exec"), ns)
    ns["INSTALL"] = False           # the check leaves ds4ref as the book wrote it
    mine = {}
    for cell, _, mods in code_cells(nb):
        if mods and cell.get("id") != "learn-helper":
            run_cell(ns, cell, path, limit)
        for t in cell.get("metadata", {}).get("tags", []):
            top = t[len(TAG):].split(".")[0]
            if t.startswith(TAG) and top in ns:     # absent: check says why
                mine[top] = ns[top]
    # a later cell may import the book's version under the same name: the learner's
    # functions win, for the check and for the functions that call them
    ns.update(mine)
    return ns


def run_cell(ns: dict, cell: dict, path: Path, limit) -> None:
    """Run one of the learner's export cells in ns; whatever stops it is named with
    the cell, never a traceback from inside the tool."""
    name = f"{path.name}: cell {cell.get('id')}"
    try:
        code = compile("".join(cell["source"]), f"{path.name} cell {cell.get('id')}",
                       "exec")
        with time_limit(limit, name):
            exec(code, ns)
    except TimeLimit:
        raise LearnError(f"{name} does not finish within {limit:g} s (an endless "
                         "loop at its top level?)") from None
    except SystemExit as e:
        raise LearnError(f"{name} does not run: it calls sys.exit({e.code!r})") from e
    except Exception as e:          # the learner's cell: say which, do not crash
        raise LearnError(f"{name} does not run: {type(e).__name__}: {e}") from e


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="tools/learn.py",
                                description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("make", help="write learn/NN_x.ipynb")
    m.add_argument("chapters", nargs="*", default=list(CORE))
    m.add_argument("--force", action="store_true",
                   help="write over an existing learner's notebook (your work in it)")
    c = sub.add_parser("check", help="check a learner's functions against ds4.c")
    c.add_argument("chapter")
    c.add_argument("--notebook", type=Path, default=None)
    c.add_argument("--time-limit", type=seconds, default=LIMIT, metavar="SECONDS",
                   help=f"how long each function may run, all its cases together "
                   f"(default {LIMIT:g})")
    a = p.parse_args(argv)
    try:
        if a.cmd == "make":
            for nn in a.chapters:
                path = learner_path(nn)
                shown = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
                if path.exists() and not a.force:
                    print(f"kept {shown} (yours: --force writes a fresh copy over it)")
                else:
                    make(nn, path)
                    print("wrote", shown)
            return 0
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from learn_checks import check, report
        results = check(a.chapter, a.notebook, a.time_limit)
        print(report(a.chapter, results))
        return 1 if any(r.status in ("differs", "error") for r in results) else 0
    except LearnError as e:
        print(f"tools/learn.py: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("tools/learn.py: interrupted", file=sys.stderr)
        return 130


def seconds(text: str) -> float:
    """--time-limit's argument: a positive number of seconds."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r}: not a positive number of seconds")
    return value


if __name__ == "__main__":
    sys.modules.setdefault("learn", sys.modules[__name__])  # one LearnError for both
    sys.exit(main(sys.argv[1:]))
