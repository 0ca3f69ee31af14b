#!/usr/bin/env python3
"""Author and execute chapters.

    python tools/nb.py build book/_drafts/03_matvec.py   # percent script -> book/03_matvec.ipynb, executed
    python tools/nb.py run book/03_matvec.ipynb          # re-execute in place, store outputs
    python tools/nb.py draft book/03_matvec.ipynb        # ipynb -> book/_drafts/03_matvec.py to edit
    python tools/nb.py write book/_drafts/03_matvec.py   # percent script -> ipynb, NOT executed (no
                                                         # outputs): tangle and test first, build after

Chapters are executed with the current Python (the repo's venv), cwd = book/,
so that stored outputs are exactly what nbval will see. Drafts are scratch
(git-ignored): the .ipynb is the source of the book and of ds4ref.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import jupytext
import nbformat
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[1]
BOOK = ROOT / "book"


def execute(nb, timeout=1800):
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.metadata.setdefault("language_info", {"name": "python"})
    client = NotebookClient(nb, timeout=timeout, kernel_name="python3",
                            resources={"metadata": {"path": str(BOOK)}})
    client.execute()
    for cell in nb.cells:  # keep the stored notebook free of volatile execution metadata
        cell.metadata.pop("execution", None)
    return nb


def stable_ids(nb) -> None:
    """Name each cell after its source (sha1, numbered on repeats) instead of jupytext's random ids,
    so that rebuilding a chapter changes only the cells that changed and branches merge cleanly."""
    import hashlib
    seen: dict[str, int] = {}
    for cell in nb.cells:
        h = hashlib.sha1((cell.cell_type + "\0" + cell.source).encode()).hexdigest()[:8]
        seen[h] = seen.get(h, 0) + 1
        cell["id"] = h if seen[h] == 1 else f"{h}-{seen[h]}"


def tangle() -> None:
    subprocess.run([sys.executable, str(ROOT / "tools" / "tangle.py")], check=True)


def build(src: Path) -> Path:
    """Draft -> ipynb, tangle (so the chapter's own modules exist), execute, store."""
    nb = jupytext.read(src)
    stable_ids(nb)
    out = BOOK / (src.stem + ".ipynb")
    nbformat.write(nb, out)
    tangle()
    execute(nb)
    nbformat.write(nb, out)
    return out


def write(src: Path) -> Path:
    """Draft -> ipynb without executing it (its outputs are dropped), then tangle."""
    nb = jupytext.read(src)
    stable_ids(nb)
    out = BOOK / (src.stem + ".ipynb")
    nbformat.write(nb, out)
    tangle()
    return out


def run(path: Path) -> Path:
    nb = nbformat.read(path, as_version=4)
    stable_ids(nb)
    execute(nb)
    nbformat.write(nb, path)
    return path


def draft(path: Path) -> Path:
    nb = nbformat.read(path, as_version=4)
    nb.metadata.pop("jupytext", None)   # a stored filter would drop the cells' tags
    out = BOOK / "_drafts" / (path.stem + ".py")
    out.parent.mkdir(exist_ok=True)
    jupytext.write(nb, out, fmt="py:percent")
    return out


if __name__ == "__main__":
    cmd, *paths = sys.argv[1:]
    fn = {"build": build, "run": run, "draft": draft, "write": write}[cmd]
    for p in paths:
        print(cmd, "->", fn(Path(p).resolve()).relative_to(ROOT))
