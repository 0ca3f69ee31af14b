"""Sphinx extension: {anchor}`name` puts a named target where it stands, also inside a
table row, where a MyST label `(name)=` cannot go.

Appendix A's errata table gives each row one (`{anchor}`erratum-12``), so that a chapter's
{ref}`appendix A, erratum 12 <erratum-12>` lands on the row rather than on the section."""
from docutils import nodes


def anchor_role(name, rawtext, text, lineno, inliner, options=None, content=None):
    target = nodes.target("", "", ids=[text], names=[text])
    inliner.document.note_explicit_target(target)
    return [target], []


def setup(app):
    app.add_role("anchor", anchor_role)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
