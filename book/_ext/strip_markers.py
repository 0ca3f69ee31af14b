"""Sphinx extension: the rendered book shows code without the tangler's `#| ...` lines.

`#| export` and `#| default_exp` tell `tools/tangle.py` where a cell's code goes in the
package. They mean nothing to a reader, so they are dropped from each notebook's code cells
as the notebook is read (the `.ipynb` on disk keeps them)."""
import json


def strip_markers(app, docname, source):
    if not str(app.env.doc2path(docname)).endswith(".ipynb"):
        return
    nb = json.loads(source[0])
    for cell in nb["cells"]:
        if cell["cell_type"] == "code":
            lines = "".join(cell["source"]).split("\n")
            cell["source"] = "\n".join(x for x in lines if not x.startswith("#| "))
    source[0] = json.dumps(nb)


def setup(app):
    app.connect("source-read", strip_markers)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
