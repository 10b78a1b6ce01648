"""Reading a DeepSpeed config: the JSON file (`load`), typed access to its keys whose errors name the
file and the key path (`Reader`), and what a reading yields (`Translation`: jaxzero overrides, with the
file's own words for each)."""

from __future__ import annotations

import difflib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from jaxzero.config import ConfigError

AUTO = "auto"


@dataclass(frozen=True)
class Translation:
    """A DeepSpeed config as jaxzero sees it.

    `overrides`: dotted jaxzero keys to values (typed), applied like a preset's. `ignored`: "key: why"
    for each key that has no jaxzero meaning. `notes`: where a key is read differently from
    DeepSpeed's own meaning, or a DeepSpeed default differs from jaxzero's. `origins`: for an override,
    the file's key and value it comes from, as the file writes them (`train_batch_size=16`), so that
    a refusal of it speaks the file's words (`check`). `overridden`: the overrides a later layer set
    again, with the value that won, which the report marks as not used."""

    source: str
    overrides: dict[str, Any] = field(default_factory=dict)
    ignored: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    origins: dict[str, str] = field(default_factory=dict)
    # overrides a later layer (the command line) set again: key -> the value that won, as given there
    overridden: dict[str, Any] = field(default_factory=dict)

    def set(self, key: str, value: Any, path: str, written: Any = None, left_out: bool = False) -> None:
        """The override `key=value`, from the file's `path` whose value is `written` (default `value`),
        or, `left_out`, from DeepSpeed's default for a `path` the file leaves out."""
        self.overrides[key] = value
        if left_out:
            self.origins[key] = f"{path} (left out: {json.dumps(value)})"
        else:
            self.origins[key] = as_written(path, value if written is None else written)

    def report(self) -> str:
        """The lines the trainer prints once at start."""
        lines = [f"jaxzero: {self.source}: {len(self.overrides)} settings read"]
        for k, v in self.overrides.items():
            won = f" (not used: the command line's {k}={self.overridden[k]})" if k in self.overridden else ""
            lines.append(f"  {k}={v!r}{won}")
        if self.ignored:
            lines.append("jaxzero: DeepSpeed keys with no meaning in jaxzero (not applied):")
            lines += [f"  {line}" for line in self.ignored]
        lines += [f"jaxzero: note: {n}" for n in self.notes]
        return "\n".join(lines)


def load(path: str | Path) -> dict[str, Any]:
    """The JSON object in `path`; ConfigError naming the file (and the line and column of a syntax
    error) when it is missing, unreadable or not a JSON object."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(
            f"--deepspeed={path}: {'a directory, not a JSON file' if p.is_dir() else 'no such file'}."
        )
    try:
        tree = json.loads(p.read_text())
    except UnicodeDecodeError as e:
        raise ConfigError(f"--deepspeed={path} is not a UTF-8 text file: {e}") from e
    except json.JSONDecodeError as e:
        raise ConfigError(
            f"--deepspeed={path} is not valid JSON: {e.msg} at line {e.lineno}, column {e.colno} "
            "(DeepSpeed's config is strict JSON: commas between entries, none after the last)."
        ) from e
    if not isinstance(tree, dict):
        raise ConfigError(
            f"--deepspeed={path} holds a JSON {type(tree).__name__}, not an object of settings."
        )
    return tree


def as_written(path: str, value: Any) -> str:
    """`path=value` with the value as JSON writes it (true, "cpu", [0.9, 0.95]): the file's own words."""
    return f"{path}={json.dumps(value)}"


class Reader:
    """Typed access to one DeepSpeed config, each error naming the file and the key path."""

    def __init__(self, source: str) -> None:
        self.source = source

    def error(self, path: str, message: str) -> ConfigError:
        """The error to raise for the key at `path` (dotted, as the file nests it)."""
        return ConfigError(f"{self.source}: {path}: {message}")

    def section(self, tree: Mapping[str, Any], key: str, path: str, known: set[str]) -> dict[str, Any] | None:
        """The dict at `tree[key]` (None if absent), its keys checked against `known`."""
        if key not in tree:
            return None
        value = tree[key]
        if not isinstance(value, dict):
            raise self.error(path, f"{value!r} must be an object {{...}}.")
        self.check_keys(value, path, known)
        return value

    def check_keys(self, tree: Mapping[str, Any], path: str, known: set[str]) -> None:
        """Raise for the first key of `tree` (the object at `path`) not in `known`, with the closest."""
        for k in tree:
            if k not in known:
                close = difflib.get_close_matches(k, sorted(known), n=1, cutoff=0.6)
                hint = f" Did you mean {close[0]!r}?" if close else ""
                where = f"{path}.{k}" if path else k
                raise self.error(
                    where, f"not a DeepSpeed key jaxzero knows.{hint} Known here: {', '.join(sorted(known))}."
                )

    def get(self, tree: Mapping[str, Any] | None, key: str, path: str, kind: type | tuple[type, ...]) -> Any:
        """`tree[key]` checked to be of `kind` (int accepts whole floats like 5e8; float accepts ints);
        None when absent or "auto"."""
        if tree is None or key not in tree or tree[key] == AUTO:
            return None
        value = tree[key]
        kinds = kind if isinstance(kind, tuple) else (kind,)
        if int in kinds and isinstance(value, float) and value.is_integer():
            value = int(value)
        if float in kinds and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if isinstance(value, bool) and bool not in kinds:
            ok = False
        else:
            ok = isinstance(value, kinds)
        if not ok:
            names = " or ".join(
                {
                    int: "an integer",
                    float: "a number",
                    bool: "true or false",
                    str: "a string",
                    list: "a list",
                }[k]
                for k in kinds
            )
            raise self.error(path, f'{value!r} must be {names} (or "auto").')
        return value

    def positive(self, tree: Mapping[str, Any] | None, key: str, path: str) -> int | None:
        """`get` of an integer that must be >= 1."""
        value = self.get(tree, key, path, int)
        if value is not None and value < 1:
            raise self.error(path, f"{value} must be >= 1.")
        return value
