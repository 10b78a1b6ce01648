"""The console scripts pyproject.toml installs: each names an importable `main(argv=None) -> int` (the
wrapper pip writes calls `sys.exit(main())`), every program of the package has one, and the README
lists them all."""

from __future__ import annotations

import ast
import importlib
import inspect
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def scripts() -> dict[str, str]:
    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]


def programs() -> set[str]:
    """The programs `python -m` runs: modules ending in `if __name__ == "__main__":`, each named by the
    module its `main` comes from (`jaxzero/train.py` runs `jaxzero.cli.train`'s)."""
    found = set()
    for path in (REPO / "jaxzero").rglob("*.py"):
        body = ast.parse(path.read_text()).body
        if any(isinstance(node, ast.If) and "__main__" in ast.unparse(node.test) for node in body):
            shim = [
                node.module
                for node in body
                if isinstance(node, ast.ImportFrom) and any(a.name == "main" for a in node.names)
            ]
            found.add(shim[0] if shim else ".".join(path.relative_to(REPO).with_suffix("").parts))
    return found


def test_every_script_resolves_to_a_main_taking_argv_and_returning_an_exit_code():
    assert scripts(), "pyproject.toml lists no [project.scripts]"
    for name, target in scripts().items():
        module_name, _, attr = target.partition(":")
        main = getattr(importlib.import_module(module_name), attr)
        assert callable(main), f"{name} = {target!r} is not callable"
        params = inspect.signature(main).parameters
        assert list(params) == ["argv"] and params["argv"].default is None, (
            f"{name} = {target!r}: main takes {list(params)}; the wrapper calls it with no arguments and "
            "tests call main(argv)"
        )
        returns = inspect.signature(main).return_annotation
        assert returns in (int, "int"), f"{name} = {target!r}: main must return the exit code"


def test_every_program_is_a_script_and_the_readme_names_each():
    targets = {target.partition(":")[0] for target in scripts().values()}
    missing = programs() - targets
    assert not missing, f"programs without a console script in pyproject.toml: {sorted(missing)}"
    readme = (REPO / "README.md").read_text()
    unnamed = [name for name in scripts() if f"`{name}`" not in readme]
    assert not unnamed, f"console scripts the README does not name: {unnamed}"
