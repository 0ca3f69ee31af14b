"""Package layout: the import graph of ds4ref (top-level and function-level imports) has
no cycle, so the modules stack up formats -> ops -> backend -> sublayers -> model -> engine."""
from __future__ import annotations

import ast
from pathlib import Path

import ds4ref

PKG = Path(ds4ref.__file__).resolve().parent

# Edges of known import cycles, each to be removed (test_known_cycle_edges_still_exist keeps
# the list honest): none left.
KNOWN_CYCLE_EDGES: set[tuple[str, str]] = set()


def import_graph(pkg_dir: Path) -> dict[str, dict[str, int]]:
    """{module: {imported module of the same package: first line}} over every import
    statement, at module level or inside a function, of the package at pkg_dir."""
    root = pkg_dir.name
    paths = {}
    for path in sorted(pkg_dir.rglob("*.py")):
        parts = path.relative_to(pkg_dir.parent).with_suffix("").parts
        paths[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph: dict[str, dict[str, int]] = {}
    for mod, path in paths.items():
        edges: dict[str, int] = {}
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                # `from pkg import sub` imports the module pkg.sub
                names = [target] + [f"{target}.{a.name}" for a in node.names]
            else:
                continue
            for name in names:
                while name and name not in paths:  # a name inside a module: the module
                    name = name.rpartition(".")[0]
                if name and name != mod and name.split(".")[0] == root:
                    edges.setdefault(name, node.lineno)
        graph[mod] = edges
    return graph


def find_cycle(graph: dict[str, dict[str, int]], skip=frozenset()) -> list[str] | None:
    """One cycle of the graph as [m0, m1, ..., m0], or None (edges in `skip` left out)."""
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    path: list[str] = []

    def visit(m):
        state[m] = 1
        path.append(m)
        for n in sorted(graph.get(m, {})):
            if (m, n) in skip:
                continue
            if state.get(n) == 1:
                return path[path.index(n):] + [n]
            if n not in state:
                found = visit(n)
                if found:
                    return found
        path.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state:
            found = visit(m)
            if found:
                return found
    return None


def _describe(graph, cycle):
    return " -> ".join(f"{a} (l. {graph[a][b]})" for a, b in zip(cycle, cycle[1:])) \
        + f" -> {cycle[-1]}"


def test_ds4ref_import_graph_has_no_cycle():
    graph = import_graph(PKG)
    cycle = find_cycle(graph, skip=KNOWN_CYCLE_EDGES)
    assert cycle is None, "import cycle: " + _describe(graph, cycle)


def test_the_layers_stack_up():
    """The ops the backend binds sit below it; the backends package does not import its
    own modules' importer back; the layers take their backend as an argument and import
    nothing of its definition."""
    g = import_graph(PKG)
    assert "ds4ref.ops" in g["ds4ref.backend"]
    layers = ("norms", "hc", "rope", "attention", "kvcache", "compressor", "indexer",
              "attention_layer", "moe", "model", "mtp")
    assert not [m for m in layers if "ds4ref.backend" in g[f"ds4ref.{m}"]]
    for low in ("ds4ref.ops", "ds4ref.matvec", "ds4ref.trace"):
        assert not {"ds4ref.backend", "ds4ref.attention", "ds4ref.moe", "ds4ref.hc"} & set(g[low])
    for sub in ("numba.backend", "mlx_backend", "cupy_backend"):
        assert "ds4ref.backends" not in g[f"ds4ref.backends.{sub}"], sub
    # the tables of facts sit at the bottom: ggml's type ids / block sizes and the IQ2_XXS
    # tables import nothing of ds4ref, and the modules that use them import them from there
    assert g["ds4ref.ggml_types"] == {} and g["ds4ref.iq2_tables"] == {}
    assert "ds4ref.ggml_types" in g["ds4ref.gguf"] and "ds4ref.iq2_tables" in g["ds4ref.quant"]


def test_known_cycle_edges_still_exist():
    graph = import_graph(PKG)
    gone = {e for e in KNOWN_CYCLE_EDGES if e[1] not in graph.get(e[0], {})}
    assert not gone, f"no longer imported, remove from KNOWN_CYCLE_EDGES: {sorted(gone)}"
    # and each still closes a cycle (else it needs no exemption)
    for a, b in KNOWN_CYCLE_EDGES:
        assert _reaches(graph, b, a), f"{a} -> {b} closes no cycle now"


def _reaches(graph, a, b) -> bool:
    seen, todo = set(), [a]
    while todo:
        m = todo.pop()
        if m == b:
            return True
        if m not in seen:
            seen.add(m)
            todo.extend(graph.get(m, {}))
    return False


def _toy(tmp_path, files: dict[str, str]) -> Path:
    pkg = tmp_path / "toy"
    for rel, text in files.items():
        (pkg / rel).parent.mkdir(parents=True, exist_ok=True)
        (pkg / rel).write_text(text)
    return pkg


def test_the_check_finds_a_cycle_through_a_function_level_import(tmp_path):
    """A deliberately cyclic toy package: b imports a at the top, a imports b inside a
    function (the way backend.py once imported attention_rows); and a relative one."""
    pkg = _toy(tmp_path, {
        "__init__.py": "",
        "a.py": "def f():\n    from toy.b import g\n    return g\n",
        "b.py": "from toy import a\n\ndef g():\n    return a\n",
        "sub/__init__.py": "def get():\n    from .impl import X\n    return X\n",
        "sub/impl.py": "from toy.sub import get\nX = 1\n",
        "c.py": "import toy.a\n",
    })
    graph = import_graph(pkg)
    assert graph["toy.a"] == {"toy.b": 2} and graph["toy.b"] == {"toy": 1, "toy.a": 1}
    assert graph["toy.sub"] == {"toy.sub.impl": 2}
    cycle = find_cycle(graph)
    assert cycle == ["toy.a", "toy.b", "toy.a"], cycle
    cycle = find_cycle(graph, skip={("toy.a", "toy.b")})
    assert cycle == ["toy.sub", "toy.sub.impl", "toy.sub"], cycle
    assert find_cycle(graph, skip={("toy.a", "toy.b"), ("toy.sub.impl", "toy.sub")}) is None


def test_inference_never_imports_dev_tooling():
    """ds4ref.dev (the writer, the weight quantizers, oracle helpers, benches) sits above the model:
    only dev itself, the optional trainer and the command line's lazy names may import it."""
    graph = import_graph(PKG)      # ds4ref's lazy _LAZY names are strings, not imports
    bad = {(a, b) for a, edges in graph.items() for b in edges
           if b.startswith("ds4ref.dev") and not a.startswith(("ds4ref.dev", "ds4ref.train"))}
    assert not bad, sorted(bad)
    assert "ds4ref.engine" in graph["ds4ref.dev.oracle"]       # dev builds on the engine, not the reverse


def test_benchmark_entry_points_resolve():
    """`python -m ds4ref.dev.bench engine --help` reaches the engine benchmark's own parser (the
    Makefile's `bench` target and the README run it): a moved module must not leave it dangling."""
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-m", "ds4ref.dev.bench", "engine", "--help"],
                       capture_output=True, text=True, cwd=PKG.parent)
    assert r.returncode == 0, r.stderr
    assert "--llama-cpp" in r.stdout and "--ds4c" in r.stdout


MAX_MODULE_LINES = 420     # "no module over about 400 lines"


def test_no_module_over_about_400_lines():
    """Every module of the package, generated or not, stays readable: a module over
    MAX_MODULE_LINES lines is split into cohesive modules in its chapter (no exceptions)."""
    sizes = {p.relative_to(PKG.parent).as_posix(): len(p.read_text().splitlines())
             for p in sorted(PKG.rglob("*.py"))}
    assert len(sizes) > 50 and "ds4ref/gguf.py" in sizes
    big = {m: n for m, n in sizes.items() if n > MAX_MODULE_LINES}
    assert not big, "modules over %d lines: %s" % (
        MAX_MODULE_LINES, ", ".join(f"{m} ({n})" for m, n in sorted(big.items())))
