"""The docs name only what exists: every file path (`jaxzero/...py`, `tests/...py`, `scripts/...py`,
`configs/...toml`) and every `jaxzero.x.y` name in README.md and docs/*.md is in the tree, every
relative link points to an existing file and, with `#anchor`, to one of its headings, every docs page
is linked from the README, and the README stays short.

A fenced block that starts with `$ ` is a transcript (a command and what it printed on the day it was
run): what it quotes is history, so its names are not checked."""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
DOCS = [README, *sorted((REPO / "docs").glob("*.md"))]
README_MAX_LINES = 300

PATH = re.compile(
    r"(?<![\w./<>-])((?:jaxzero|tests|scripts|configs|docs)/(?:[\w-]+/)*(?:[\w.-]+?\.(?:py|toml|md)\b)?)"
)
MODULE = re.compile(r"(?<![\w./<>-])jaxzero(?:\.\w+)+")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^(#{1,6})\s+(.+?)\s*#*\s*$")


def split_fences(text: str) -> tuple[list[str], list[list[str]]]:
    """The lines outside fenced code blocks (blank in their place), and the blocks' lines."""
    prose, blocks, block = [], [], None
    for line in text.splitlines():
        if line.lstrip().startswith(("```", "~~~")):
            if block is None:
                block = []
            else:
                blocks.append(block)
                block = None
            prose.append("")
        elif block is not None:
            block.append(line)
            prose.append("")
        else:
            prose.append(line)
    return prose, blocks


def checked_text(doc: Path) -> str:
    """What of `doc` names files and modules: its prose and code, transcripts left out."""
    prose, blocks = split_fences(doc.read_text())
    code = [line for b in blocks if not (b and b[0].startswith("$ ")) for line in b]
    return "\n".join(prose + code)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(doc: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for line in split_fences(doc.read_text())[0]:
        m = HEADING.match(line)
        if m:
            base = slug(m.group(2))
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.add(base if n == 0 else f"{base}-{n}")
    return out


def top_level_names(path: Path) -> set[str]:
    """Names a module defines or imports at its top level (inside `if` and `try` too)."""
    names: set[str] = set()

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                names.add(node.name)
            elif isinstance(node, ast.Assign):
                for target in node.targets:
                    names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                names.add(node.target.id)
            elif isinstance(node, ast.Import | ast.ImportFrom):
                names.update((a.asname or a.name).split(".")[0] for a in node.names)
            elif isinstance(node, ast.If | ast.Try):
                for part in ("body", "orelse", "finalbody", "handlers"):
                    for child in getattr(node, part, []):
                        visit(child.body if isinstance(child, ast.ExceptHandler) else [child])

    visit(ast.parse(path.read_text()).body)
    return names


def missing_module(name: str) -> str | None:
    """Why the dotted `name` (a module, or a module's attribute) does not exist; None when it does."""
    parts = name.split(".")
    here, i = REPO / "jaxzero", 1
    while i < len(parts) and ((here / parts[i]).is_dir() or (here / f"{parts[i]}.py").is_file()):
        here = here / parts[i] if (here / parts[i]).is_dir() else here / f"{parts[i]}.py"
        i += 1
    if i == len(parts):
        return None
    source = here / "__init__.py" if here.is_dir() else here
    module = ".".join(parts[:i])
    if not source.is_file():
        return f"{module} has no {source.relative_to(REPO)}"
    if parts[i] not in top_level_names(source):
        return f"neither a module {module}.{parts[i]} nor a name {parts[i]} of {module}"
    return None


def test_every_file_and_module_the_docs_name_exists():
    wrong = []
    for doc in DOCS:
        text = checked_text(doc)
        for path in sorted(set(PATH.findall(text))):
            if not (REPO / path).exists():
                wrong.append(f"{doc.relative_to(REPO)}: {path} does not exist")
        for name in sorted(set(MODULE.findall(text))):
            why = missing_module(name)
            if why:
                wrong.append(f"{doc.relative_to(REPO)}: {name}: {why}")
    assert not wrong, "\n".join(wrong)


def test_every_relative_link_points_to_a_file_and_heading():
    wrong = []
    for doc in DOCS:
        prose = "\n".join(split_fences(doc.read_text())[0])
        for target in LINK.findall(prose):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:, ...
                continue
            file, _, anchor = target.partition("#")
            dest = (doc.parent / file).resolve() if file else doc
            if not dest.exists():
                wrong.append(f"{doc.relative_to(REPO)}: ({target}): no file {file}")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                wrong.append(f"{doc.relative_to(REPO)}: ({target}): no heading #{anchor} in {dest.name}")
    assert not wrong, "\n".join(wrong)


def test_the_readme_links_every_docs_page():
    prose = "\n".join(split_fences(README.read_text())[0])
    linked = {(REPO / t.partition("#")[0]).resolve() for t in LINK.findall(prose)}
    unlinked = [str(d.relative_to(REPO)) for d in DOCS[1:] if d.resolve() not in linked]
    assert not unlinked, f"docs pages the README's contents do not link: {unlinked}"


def test_the_readme_is_at_most_300_lines():
    lines = len(README.read_text().splitlines())
    assert lines <= README_MAX_LINES, (
        f"README.md has {lines} lines; move detail into docs/ (at most {README_MAX_LINES})"
    )


def test_the_checker_sees_what_it_should():
    """The patterns themselves: a missing path or module is caught, an existing one is not."""
    assert PATH.findall("see `jaxzero/offload/disk.py` and configs/llama-3.4b-offload.toml.") == [
        "jaxzero/offload/disk.py",
        "configs/llama-3.4b-offload.toml",
    ]
    assert MODULE.findall("python -m jaxzero.train. `jaxzero.decode.Generator(cfg)`; ~/.jaxzero.x") == [
        "jaxzero.train",
        "jaxzero.decode.Generator",
    ]
    assert missing_module("jaxzero.offload.streaming.StreamedModel") is None
    assert missing_module("jaxzero.resolve_plan") is None
    assert missing_module("jaxzero.no_such_module") is not None
    assert missing_module("jaxzero.plan.no_such_module") is not None
    assert slug("How big can I go?") == "how-big-can-i-go"
    assert slug("Watching a run: metrics, TensorBoard") == "watching-a-run-metrics-tensorboard"
