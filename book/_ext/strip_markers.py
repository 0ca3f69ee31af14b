"""Sphinx extension: the rendered book shows code without the tangler's `#| ...` lines,
and names instead the module an exported cell goes to.

`#| export` and `#| default_exp` tell `tools/tangle.py` where a cell's code goes in the
package. A reader needs only the answer, so an exported cell opens with a comment naming
its module's file (`# exported to ds4ref/hc.py`), resolved by the tangler's own
`code_cells`, and every `#| ` line is dropped as the notebook is read (the `.ipynb` on
disk keeps them)."""
import importlib.util
import json
from pathlib import Path


def _load_tangler():
    path = Path(__file__).resolve().parents[2] / "tools" / "tangle.py"
    spec = importlib.util.spec_from_file_location("ds4ref_book_tangle", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


TANGLE = _load_tangler()


def module_file(module: str) -> str:
    """The file a dotted module of the package is: "backends.numba.glue" ->
    "ds4ref/backends/numba/glue.py"."""
    return "ds4ref/" + "/".join(module.split(".")) + ".py"


def rendered_source(nb: dict) -> None:
    """Each code cell of nb as the page shows it, in place: `# exported to FILE` for each
    module the cell is exported to, then its code without `#| ` lines."""
    for cell, body, mods in TANGLE.code_cells(nb):
        marks = [f"# exported to {module_file(m)}" for m in dict.fromkeys(mods) if m]
        lines = [x for x in body.split("\n") if not x.startswith("#| ")]
        cell["source"] = "\n".join(marks + lines)


def strip_markers(app, docname, source):
    if not str(app.env.doc2path(docname)).endswith(".ipynb"):
        return
    nb = json.loads(source[0])
    rendered_source(nb)
    source[0] = json.dumps(nb)


def setup(app):
    app.connect("source-read", strip_markers)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
