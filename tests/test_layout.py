"""fastcall's modules import one another one way: no import cycle (imports inside functions
counted), and the core reaches Flax NNX only through its gate: only the public API's module
plugs the NNX plugin (`fastcall._nnx`) in, and only the plugin imports flax."""

from __future__ import annotations

import ast
import pathlib

import fastcall

# (the fastcall that is imported: the checkout's, or the installed copy the version matrix tests)
PACKAGE = pathlib.Path(fastcall.__file__).resolve().parent


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: pathlib.Path, modules: set[str]) -> dict[str, int]:
    """The fastcall modules and the outside packages `path` imports, anywhere in it (module
    level, functions, conditionals), each with the line of its first import."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found: dict[str, int] = {}
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            # `from . import _plan` imports the module fastcall._plan; `from ._plan import X`, fastcall._plan
            targets = [f"{source}.{alias.name}" for alias in node.names if f"{source}.{alias.name}" in modules]
            targets = targets or [source]
        for target in targets:
            found.setdefault(target, node.lineno)
    return found


def _graph() -> dict[str, dict[str, int]]:
    paths = sorted(PACKAGE.rglob("*.py"))
    modules = {_module_name(p) for p in paths}
    graph = {}
    for p in paths:
        graph[_module_name(p)] = _imports(p, modules)
    return graph


def test_no_import_cycle():
    graph = _graph()
    assert "fastcall._dispatch" in graph and "fastcall._nnx._adapter" in graph  # (not vacuous)
    edges = {m: [t for t in targets if t in graph and t != "fastcall"] for m, targets in graph.items()}
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for t in edges[m]:
            if state.get(t) == 1:
                return path[path.index(t) :] + [t]
            if t not in state:
                cycle = visit(t)
                if cycle:
                    return cycle
        path.pop()
        state[m] = 2
        return None

    for m in sorted(edges):
        if m not in state:
            cycle = visit(m)
            assert cycle is None, "import cycle: " + " -> ".join(
                f"{a} (line {graph[a][b]})" for a, b in zip(cycle, cycle[1:])
            ) + f" -> {cycle[-1]}"


def _in_plugin(module: str) -> bool:
    return module == "fastcall._nnx" or module.startswith("fastcall._nnx.")  # (not fastcall._nnx_gate)


def test_the_core_reaches_nnx_only_through_its_gate():
    graph = _graph()
    for module, targets in graph.items():
        if _in_plugin(module) or module in ("fastcall", "fastcall._api"):
            continue
        plugin = [t for t in targets if _in_plugin(t)]
        assert not plugin, f"{module} imports the NNX plugin ({plugin}): ask fastcall._nnx_gate"
        flax = [t for t in targets if t == "flax" or t.startswith("flax.")]
        assert not flax, f"{module} imports flax ({flax}, line {graph[module][flax[0]]}): only fastcall._nnx may"
    # (the API module plugs it in; the test above would pass vacuously if nothing did)
    assert "fastcall._nnx" in graph["fastcall._api"]
    assert any(t.startswith("flax") for module, targets in graph.items() if _in_plugin(module) for t in targets)


def test_the_layout_check_sees_imports_inside_functions():
    """The graph counts an import inside a function (the kind that hid the old cycle, through
    the gate's loader)."""
    graph = _graph()
    assert "fastcall._nnx._adapter" in graph["fastcall._nnx"]  # (`load` imports it when called)


MAX_LINES = 800


def test_no_python_module_is_over_800_lines():
    """A module a reader can hold (the C wrapper, `_accel.c`, too)."""
    sizes = {
        p.relative_to(PACKAGE).as_posix(): len(p.read_text().splitlines())
        for pattern in ("*.py", "*.c")
        for p in PACKAGE.rglob(pattern)
        if not (p.suffix == ".c" and p.with_suffix(".py").exists())  # (Cython's output: generated)
    }
    assert "_accel.c" in sizes  # (not vacuous)
    assert "_dispatch.py" in sizes and "_nnx/_adapter.py" in sizes  # (not vacuous)
    over = {name: n for name, n in sizes.items() if n > MAX_LINES}
    assert not over, f"modules over {MAX_LINES} lines: {over}: split them by concern"


def _code_lines(node: ast.AST) -> int:
    """A function's or class's lines, its own docstring excluded (an API's documentation is
    not code a reader has to hold)."""
    lines = node.end_lineno - node.lineno + 1  # type: ignore[attr-defined]
    body = getattr(node, "body", [])
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        if isinstance(body[0].value.value, str):
            lines -= body[0].end_lineno - body[0].lineno + 1  # type: ignore[operator]
    return lines


def test_no_function_is_over_80_lines_nor_class_over_200():
    """A function, or a class, a reader can hold: 80 and 200 lines, docstrings excluded."""
    over = []
    counted = 0
    for p in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(p.read_text(), str(p))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                counted += 1
                limit = 200 if isinstance(node, ast.ClassDef) else 80
                if _code_lines(node) > limit:
                    over.append(f"{p.relative_to(PACKAGE).as_posix()}:{node.name} ({_code_lines(node)} lines)")
    assert counted > 300  # (not vacuous)
    assert not over, f"over the limit: {over}: split them by concern"


def test_the_size_rule_counts_code_not_docstrings():
    tree = ast.parse('def f():\n    """doc\n\n    more"""\n    return 1\n')
    assert _code_lines(tree.body[0]) == 2
