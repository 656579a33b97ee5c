"""The layers of docs/architecture.md, enforced: every import in zerodp/, those inside functions included.

Pure reading of the source with `ast` (no import runs), so it checks the whole package in well under a
second. A failure names the modules and the import that breaks the rule.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "zerodp"

ENTRY = ("zerodp.cli", "zerodp.launcher", "zerodp.compat", "zerodp.demo.train")
"""Entry points: parse, print, exit codes; `import deepspeed`. Nothing in zerodp imports compat."""
REPORT = ("zerodp.report",)
"""Side-by-side runs of DDP, FSDP2, DeepSpeed and zerodp, and their report: it trains through initialize()."""
SURFACE = ("zerodp", "zerodp.api")
"""The public package and initialize(), which wires the runtime with plan/'s preflight and OOM doctor."""
PLAN = ("zerodp.plan",)
"""Predictions before a run and the diagnosis after an OOM; it builds engines through a factory it is
given (zerodp/plan/engines.py), never by importing the surface above it."""
MODEL_ZOO = ("zerodp.demo", "zerodp.demo.model", "zerodp.demo.data")
"""The demo's model and data: leaves (torch only) that the estimator's "demo" workload builds too."""
MAX_FILE_LINES, MAX_FUNCTION_LINES = 600, 60


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


MODULES = _modules()


def _targets(module: str, node: ast.Import | ast.ImportFrom) -> list[str]:
    """The zerodp modules one import statement depends on (a `from pkg import name` on the submodule
    when `name` is one, else on the package)."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        if node.module == "__future__":
            return []
        base = module.split(".") if MODULES[module].name == "__init__.py" else module.split(".")[:-1]
        prefix = ".".join(base[: len(base) - node.level + 1] + ([node.module] if node.module else [])) \
            if node.level else node.module or ""
        names = [f"{prefix}.{alias.name}" for alias in node.names]
        names = [n for n in names if n in MODULES] or [prefix]
    out = []
    for name in names:
        while name and name not in MODULES:
            name = name.rpartition(".")[0]
        if name and name != module:
            out.append(name)
    return out


def _edges() -> dict[str, dict[str, int]]:
    """module -> {imported zerodp module: line of the first such import}."""
    edges: dict[str, dict[str, int]] = {m: {} for m in MODULES}
    for module, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for target in _targets(module, node):
                    edges[module].setdefault(target, node.lineno)
    return edges


EDGES = _edges()


def _under(module: str, layer: tuple[str, ...]) -> bool:
    return any(module == top or module.startswith(top + ".") for top in layer)


def _layer(module: str) -> str:
    if module in SURFACE:
        return "surface"
    for name, layer in (("zoo", MODEL_ZOO), ("entry", ENTRY), ("report", REPORT), ("plan", PLAN)):
        if module in layer if name == "zoo" else _under(module, layer):
            return name
    return "runtime"


def _violations(allowed: dict[str, set[str]]) -> list[str]:
    return [f"{a} ({_layer(a)}) imports {b} ({_layer(b)}) at {MODULES[a].relative_to(PACKAGE.parent)}:{line}"
            for a, targets in EDGES.items() for b, line in targets.items() if _layer(b) not in allowed[_layer(a)]]


def test_imports_point_down_only():
    """entry > report > surface > plan > runtime, and the zoo of leaves: each layer imports its own and
    those below (plan and report the zoo too). compat is imported by nothing else in zerodp."""
    allowed = {"runtime": {"runtime"}, "zoo": {"zoo"}, "plan": {"plan", "runtime", "zoo"},
               "surface": {"surface", "plan", "runtime"}, "report": {"report", "surface", "plan", "runtime", "zoo"},
               "entry": {"entry", "report", "surface", "plan", "runtime", "zoo"}}
    assert _violations(allowed) == []
    into_compat = [a for a, targets in EDGES.items() for b in targets
                   if _under(b, ("zerodp.compat",)) and not _under(a, ("zerodp.compat",))]
    assert into_compat == []


def test_no_import_cycles():
    """Tarjan's strongly connected components over every import, function-level ones included."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in EDGES[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
            if len(component) > 1:
                cycles.append(sorted(component))

    for module in MODULES:
        if module not in index:
            visit(module)
    assert cycles == []


def test_the_checker_sees_function_level_imports_and_cycles(tmp_path, monkeypatch):
    """The rules would catch what they exist for: an import inside a function, and a cycle."""
    node = ast.parse("def f():\n    from zerodp.plan import doctor\n").body[0].body[0]
    assert _targets("zerodp.engine", node) == ["zerodp.plan.doctor"]
    monkeypatch.setitem(EDGES, "zerodp.engine", {**EDGES["zerodp.engine"], "zerodp.plan.doctor": 1})
    assert any("zerodp.engine (runtime) imports zerodp.plan.doctor" in v
               for v in _violations({"runtime": {"runtime"}, "zoo": set(), "plan": set(), "surface": set(),
                                     "report": set(), "entry": set()}))
    monkeypatch.setitem(EDGES, "zerodp.memory", {**EDGES["zerodp.memory"], "zerodp.engine": 1})
    with pytest.raises(AssertionError):
        test_no_import_cycles()


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_file_or_function_is_too_long(module):
    """design.md §2: a file past ~600 lines is two things; a function past 60 is several named steps."""
    text = MODULES[module].read_text()
    assert text.count("\n") <= MAX_FILE_LINES, f"{module}: {text.count(chr(10))} lines"
    long = [f"{n.name} ({n.end_lineno - n.lineno + 1} lines)" for n in ast.walk(ast.parse(text))
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.end_lineno - n.lineno + 1 > MAX_FUNCTION_LINES]
    assert long == []
