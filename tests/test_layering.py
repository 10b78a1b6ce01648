"""The package's layering, read from its source: no import circles, imports at the top of modules, and
the directions docs/architecture.md promises (config is a leaf, models know nothing of placement, the
offload engine and the trainer contract nothing of Orbax, run directories, the exporters, logging or
the CLI, nothing imports the programs). A direction holds for everything a module loads: the modules it
imports, theirs in turn, and the packages above each (Python runs a package's `__init__` first); one
import of `jaxzero.offload.engine` in a fresh process confirms it for Orbax."""

from __future__ import annotations

import ast
import functools
import json
import subprocess
import sys
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


def runtime_nodes(tree: ast.AST) -> list[ast.AST]:
    """Every node of `tree` but those under `if TYPE_CHECKING:`, which never run (type hints only)."""
    out, todo = [], [tree]
    while todo:
        node = todo.pop()
        out.append(node)
        for child in ast.iter_child_nodes(node):
            test = child.test if isinstance(child, ast.If) else None
            if isinstance(test, ast.Name | ast.Attribute) and ast.unparse(test).endswith("TYPE_CHECKING"):
                todo.extend(child.orelse)
            else:
                todo.append(child)
    return out


@functools.cache
def graph() -> dict[str, frozenset[str]]:
    """{module: the jaxzero modules it imports}, anywhere in it (inside functions too: they run when
    called), type-checking-only imports left out."""
    edges: dict[str, set[str]] = {m: set() for m in MODULES}
    for m, path in MODULES.items():
        for node in runtime_nodes(ast.parse(path.read_text())):
            edges[m].update(imported(m, node))
    return {m: frozenset(ns) for m, ns in edges.items()}


def packages_above(module: str) -> list[str]:
    """The packages Python runs before `module`: "jaxzero.offload.engine" -> jaxzero, jaxzero.offload."""
    parts = module.split(".")
    return [p for p in (".".join(parts[:i]) for i in range(1, len(parts))) if p in MODULES]


@functools.cache
def loads(module: str) -> dict[str, str | None]:
    """{every jaxzero module that the imports of `module` load: the one it was reached from}
    (`module` itself: None), so that `chain` can say how a forbidden module is reached. The packages
    above `module` count only where something else loads them (the package `jaxzero` loads nothing
    itself: `test_the_directions_of_the_layers`)."""
    edges, seen, todo = graph(), {module: None}, [module]
    while todo:
        m = todo.pop(0)
        for n in sorted(edges[m] | (set(packages_above(m)) if m != module else set())):
            if n not in seen:
                seen[n] = m
                todo.append(n)
    return seen


def chain(module: str, target: str) -> str:
    """How importing `module` loads `target`: "a -> b -> target"."""
    via, path = loads(module), [target]
    while via[path[-1]] is not None:
        path.append(via[path[-1]])
    return " -> ".join(reversed(path))


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


# What the run's side of the house is made of, which the engines and the contract must not load.
STORAGE = {"jaxzero.storage"}
CONFIG_BUILDING = {"jaxzero.interop", "jaxzero.overrides", "jaxzero.deepspeed"}  # the CLI, the HF exporter
# The run's loop and its reporting (not `jaxzero.run.distributed`, which the planner's pass reads).
THE_RUN = {
    "jaxzero.run.metrics",
    "jaxzero.run.loop",
    "jaxzero.run.start",
    "jaxzero.run.nonfinite",
    "jaxzero.run.finish",
    "jaxzero.run.samples",
}
ENGINES = {"jaxzero.offload", "jaxzero.trainer", "jaxzero.decode"}
# The programs: `jaxzero.cli`, and the flat modules and `jaxzero.plan.__main__` that `python -m` runs.
PROGRAMS = {
    "jaxzero.cli",
    "jaxzero.train",
    "jaxzero.export",
    "jaxzero.generate",
    "jaxzero.eval",
    "jaxzero.prepare",
    "jaxzero.launch",
    "jaxzero.plot",
    "jaxzero.plan.__main__",
}


def in_layer(module: str, layer: str) -> bool:
    return module == layer or module.startswith(layer + ".")


def test_the_directions_of_the_layers():
    # config is a leaf: its dataclasses import only the named sizes' table, which imports nothing
    assert graph()["jaxzero.config"] == {"jaxzero.config.sizes"}, "config is a leaf"
    assert graph()["jaxzero.config.sizes"] == set(), "config is a leaf"
    forbidden = {
        # The package's names are imported on first use: importing any module loads no other layer.
        "jaxzero": {"jaxzero"},
        "jaxzero.models": {"jaxzero.plan", "jaxzero.planner", "jaxzero.plan.placement", "jaxzero.offload"},
        # The engine and the contract every trainer returns: no Orbax, run directory, exporter, CLI,
        # logging of the run or program (saving and restoring are `jaxzero.storage.state_io`'s, exporting
        # `jaxzero.interop.state_export`'s).
        "jaxzero.offload": STORAGE | CONFIG_BUILDING | THE_RUN | PROGRAMS,
        "jaxzero.state": STORAGE | CONFIG_BUILDING | THE_RUN | PROGRAMS | ENGINES | {"jaxzero.data"},
        # The plan the engines read is below everything that decides: it imports nothing of the
        # planner (which counts each placement's memory); `python -m jaxzero.plan` is a program.
        "jaxzero.plan": {"jaxzero.offload", "jaxzero.plan.placement", "jaxzero.planner", "jaxzero.trainer"},
        # The planner is below the engines, the run and storage; its search and its parts below the
        # shardings too (the resolution pass, `preflight`, reads the model's shapes through them).
        "jaxzero.planner": STORAGE | ENGINES | THE_RUN | PROGRAMS,
        **{
            f"jaxzero.planner.{m}": {"jaxzero.offload", "jaxzero.plan.placement", "jaxzero.trainer"}
            for m in ("machine", "cost", "candidates", "search", "report", "partial")
        },
        # The calibration is data; the memory plan only counts: no Orbax, no process environment, no
        # engine.
        "jaxzero.planner.calibration": {"jaxzero"},
        "jaxzero.planner.memory": STORAGE | ENGINES | {"jaxzero.planner.runtime"},
    }
    wrong = []
    for layer, names in forbidden.items():
        # A layer is its modules (`jaxzero`, `jaxzero.plan`: the package's own module, not the rest).
        own = layer in ("jaxzero", "jaxzero.plan")
        members = [layer] if own else [m for m in MODULES if in_layer(m, layer)]
        for member in members:
            via = loads(member)
            bad = {n for n in via if n != member and any(in_layer(n, f) for f in names)}
            # Where each path first enters what is forbidden (what that loads in turn is not listed).
            wrong += [f"{layer}: {chain(member, n)}" for n in bad if via[n] not in bad]
    assert not wrong, "imports against the layers:\n" + "\n".join(sorted(wrong))
    def program(m: str) -> bool:
        return any(in_layer(m, p) for p in PROGRAMS)

    importers = {m for m, ns in graph().items() if not program(m) and any(program(n) for n in ns)}
    assert importers == set(), f"programs are imported by {importers}"


def test_the_engine_and_the_contract_load_no_orbax():
    """What the source says, in a fresh process: importing the offload engine and the trainer contract
    loads no Orbax, and none of the modules the engine must not reach."""
    code = "import json, sys, jaxzero.offload.engine, jaxzero.state; print(json.dumps(sorted(sys.modules)))"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    loaded = json.loads(run.stdout.splitlines()[-1])
    banned = STORAGE | CONFIG_BUILDING | THE_RUN | PROGRAMS
    wrong = [m for m in loaded if in_layer(m, "orbax") or any(in_layer(m, b) for b in banned)]
    assert not wrong, f"importing jaxzero.offload.engine loads {wrong}"


# The layers as folders, bottom up: a module imports from its own layer and those below. Each entry is
# a package (or a flat module) of `jaxzero`; `jaxzero` itself (the lazy library API) is on top.
LAYERS = [
    {"config", "primitives"},
    {"models"},
    {"numerics"},
    {"data"},
    {"plan"},
    {"planner"},
    {"offload", "finetune", "resident", "custom", "decode", "state", "trainer"},
    {"storage"},
    {"interop", "deepspeed", "overrides"},
    {"run"},
    {"cli", "train", "export", "generate", "eval", "prepare", "launch", "plot"},
]
# The imports that still run back up those layers, each with what would remove it. No other may
# be added: a new one is a module in the wrong folder.
UPWARD = {
    # a frozen base rebuilt from `model.init_from`'s Hugging Face files (`finetune.base.source_units`,
    # on every resume): removed once the reader is handed to the trainer by the run and the programs
    ("jaxzero.finetune", "jaxzero.interop"),
}


def _layer(module: str) -> str:
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 1 else module


def test_imports_run_down_the_folders():
    rank = {f"jaxzero.{name}": i for i, layer in enumerate(LAYERS) for name in layer}
    assert {_layer(m) for m in MODULES} - {"jaxzero"} == set(rank), "a folder or module without a layer"
    upward: dict[tuple[str, str], list[str]] = {}
    for m, ns in graph().items():
        for n in ns:
            a, b = _layer(m), _layer(n)
            if a != "jaxzero" and m != "jaxzero.plan.__main__" and rank[b] > rank[a]:
                upward.setdefault((a, b), []).append(f"{m} -> {n}")
    new = {k: v for k, v in upward.items() if k not in UPWARD}
    assert not new, f"imports up the layers: {new}"
    gone = UPWARD - set(upward)
    assert not gone, f"no longer imported up the layers (remove from UPWARD): {gone}"


def test_the_house_has_walls():
    """At most 14 modules directly in `jaxzero/` (the rest in their layers' folders), none over 600
    lines (a module past that does more than one job)."""
    flat = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(flat) <= 14, f"{len(flat)} modules directly in jaxzero/: {flat}"
    long = {m: n for m, p in MODULES.items() if (n := len(p.read_text().splitlines())) > 600}
    assert not long, f"modules over 600 lines: {long}"
