"""Package structure: one error hierarchy under DS4RefError; a light `import ds4ref`."""
from __future__ import annotations

import ast
import builtins
import importlib
import subprocess
import sys
from pathlib import Path

import ds4ref
from ds4ref import DS4RefError

PKG = Path(ds4ref.__file__).resolve().parent
BUILTIN_EXC = {n for n, v in vars(builtins).items()
               if isinstance(v, type) and issubclass(v, BaseException)}


def _modules() -> dict[str, ast.Module]:
    """{dotted module name: parsed source} for every module of ds4ref."""
    out = {}
    for path in sorted(PKG.rglob("*.py")):
        parts = path.relative_to(PKG.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = ast.parse(path.read_text())
    return out


def _exception_classes() -> dict[str, list[tuple[str, list[str]]]]:
    """{class name: [(module, base names)]} for every class of ds4ref that derives
    from an exception, found by following base names through the package's classes."""
    classes = [(mod, node.name, [ast.unparse(b).split(".")[-1] for b in node.bases])
               for mod, tree in _modules().items() for node in ast.walk(tree)
               if isinstance(node, ast.ClassDef)]
    exc = set(BUILTIN_EXC)
    grew = True
    while grew:
        grew = False
        for _, name, bases in classes:
            if name not in exc and any(b in exc for b in bases):
                exc.add(name)
                grew = True
    found: dict[str, list[tuple[str, list[str]]]] = {}
    for mod, name, bases in classes:
        if name in exc and name not in BUILTIN_EXC:
            found.setdefault(name, []).append((mod, bases))
    return found


def _reaches_base(name: str, found) -> bool:
    """True if the package's exception `name` reaches DS4RefError through its bases."""
    if name == "DS4RefError":
        return True
    return any(b in found and b != name and _reaches_base(b, found)
               for b in found[name][0][1])


def test_every_exception_is_a_ds4ref_error_defined_once():
    found = _exception_classes()
    assert {"GGUFError", "SessionError", "BackendError"} <= set(found), sorted(found)
    assert len(found) >= 15, sorted(found)
    twice = {n: [m for m, _ in defs] for n, defs in found.items() if len(defs) > 1}
    assert not twice, f"exceptions defined in more than one module: {twice}"
    not_ours = [f"{d[0][0]}.{n}" for n, d in found.items()
                if not _reaches_base(n, found)]
    assert not not_ours, f"not derived from DS4RefError: {not_ours}"
    for name, [(mod, _)] in found.items():   # as classes too, where the module imports
        try:
            cls = getattr(importlib.import_module(mod), name)
        except ImportError:                  # a backend whose package is absent here
            continue
        assert issubclass(cls, DS4RefError) and cls.__module__ == mod, f"{mod}.{name}"


def test_errors_keep_their_builtin_base():
    """Code that catches ValueError / OSError goes on catching the named errors."""
    import ds4ref.backends
    import ds4ref.engine
    from ds4ref.backend import BackendError
    from ds4ref.session import ContextOverflowError, SessionError
    from ds4ref.gguf import GGUFError
    from ds4ref.dev.writer import SparseFileError
    for cls in (GGUFError, SessionError, ContextOverflowError, BackendError):
        assert issubclass(cls, ValueError) and issubclass(cls, DS4RefError)
    assert issubclass(SparseFileError, OSError)
    assert issubclass(SparseFileError, DS4RefError)
    assert ds4ref.engine.BackendError is ds4ref.backends.BackendError is BackendError


HEAVY = ("numba", "llvmlite", "mlx", "cupy", "matplotlib", "ds4ref.dev.writer")


def test_import_ds4ref_is_light():
    """`import ds4ref` loads no JIT, GPU or plotting package, nor the writer's corpus
    and BPE trainer; the names it resolves lazily still work."""
    code = ("import sys, ds4ref; print(' '.join(sorted(m for m in sys.modules "
            f"if m in {HEAVY!r} or m.split('.')[0] in {HEAVY!r})))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       cwd=PKG.parent, check=True)
    assert r.stdout.split() == [], f"import ds4ref loaded: {r.stdout.strip()}"
    assert ds4ref.write_model.__module__ == "ds4ref.dev.writer"
