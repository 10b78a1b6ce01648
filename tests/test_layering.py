"""The package's layering, read from its source: no import circles, imports at the top of modules, and
the directions docs/architecture.md promises (config is a leaf, models know nothing of placement, the
offload engine nothing of Orbax, logging or the CLI, nothing imports the programs)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "jaxzero"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in PACKAGE.rglob("*.py")}


def imported(module: str, node: ast.AST) -> list[str]:
    """The jaxzero modules an import statement of `module` depends on."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:
            here = module.split(".") if MODULES[module].name == "__init__.py" else module.split(".")[:-1]
            base = ".".join(here[: len(here) - node.level + 1] + ([node.module] if node.module else []))
        names = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
    else:
        return []
    out = []
    for name in names:
        while name and name not in MODULES:
            name = name.rpartition(".")[0]
        if name and name != module:
            out.append(name)
    return out


def graph() -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {m: set() for m in MODULES}
    for m, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            edges[m].update(imported(m, node))
    return edges


def test_no_import_circles():
    edges, state, circles = graph(), {}, []

    def visit(m: str, stack: list[str]) -> None:
        state[m] = "open"
        for n in sorted(edges[m]):
            if state.get(n) == "open":
                circles.append(stack[stack.index(n) :] + [n])
            elif n not in state:
                visit(n, stack + [n])
        state[m] = "done"

    for m in sorted(MODULES):
        if m not in state:
            visit(m, [m])
    assert not circles, "import circles: " + "; ".join(" -> ".join(c) for c in circles)


def test_imports_inside_functions_say_why():
    """An import inside a function hides a dependency; each one carries a comment with its reason."""
    silent = []
    for path in MODULES.values():
        lines = path.read_text().splitlines()
        for fn in ast.walk(ast.parse(path.read_text())):
            if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            for node in ast.walk(fn):
                if isinstance(node, ast.Import | ast.ImportFrom):
                    here, above = lines[node.lineno - 1], lines[node.lineno - 2].strip()
                    if "#" not in here and not above.startswith("#"):
                        silent.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}")
    assert not silent, f"imports inside functions without a reason: {silent}"


def depends(prefix: str) -> set[str]:
    edges = graph()
    return {n for m, ns in edges.items() if m == prefix or m.startswith(prefix + ".") for n in ns}


def test_the_directions_of_the_layers():
    assert graph()["jaxzero.config"] == set(), "config is a leaf"
    forbidden = {
        "jaxzero.models": {"jaxzero.plan", "jaxzero.placement", "jaxzero.memory", "jaxzero.offload"},
        "jaxzero.offload": {
            "jaxzero.checkpoint",
            "jaxzero.run_dir",
            "jaxzero.metrics",
            "jaxzero.train",
            "jaxzero.overrides",
        },
        # The plan's resolution is below the memory check; the planner, which counts each placement's
        # memory, is above it (and below the engines), and `python -m jaxzero.plan` is a program.
        "jaxzero.plan": {"jaxzero.offload", "jaxzero.placement", "jaxzero.memory", "jaxzero.trainer"},
        **{
            f"jaxzero.plan.{m}": {"jaxzero.offload", "jaxzero.placement", "jaxzero.trainer"}
            for m in ("machine", "cost", "candidates", "search", "report")
        },
        # The calibration is data; the memory plan only counts: no Orbax, no process environment, no
        # engine.
        "jaxzero.plan.calibration": {"jaxzero"},
        "jaxzero.memory": {
            "jaxzero.checkpoint",
            "jaxzero.runtime",
            "jaxzero.offload",
            "jaxzero.trainer",
            "jaxzero.decode",
        },
    }
    edges = graph()
    for layer, names in forbidden.items():
        imports = edges[layer] if layer == "jaxzero.plan" else depends(layer)  # the package's own module
        wrong = {n for n in imports if any(n == f or n.startswith(f + ".") for f in names)}
        assert not wrong, f"{layer} imports {sorted(wrong)}"
    programs = {
        "jaxzero.train",
        "jaxzero.export",
        "jaxzero.generate",
        "jaxzero.prepare",
        "jaxzero.launch",
        "jaxzero.plan.__main__",
        "jaxzero.plot",
    }
    importers = {m for m, ns in edges.items() if programs & ns}
    assert importers == set(), f"programs are imported by {importers}"
