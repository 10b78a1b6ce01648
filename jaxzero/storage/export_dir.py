"""The directory an export writes into: a new or empty one, or an earlier jaxzero export; never anything
else, `--overwrite` or not.

An export (`jaxzero.interop.export_hf`, `jaxzero.storage.checkpoint_masters.export_orbax`, `python -m
jaxzero.export`, `jaxzero.interop.state_export.export_state`) writes the marker `.jaxzero-export`
first, a small JSON object naming what it exports (format, dtype, `run_dir` and step when known, start
time) and the files it writes, and marks it finished last. The marker is what makes a directory an
export of jaxzero's:

- new, or empty: written.
- holding anything without the marker (a Hugging Face download, an export jaxzero made before markers,
  a file): refused, with or without `overwrite`; nothing in it is touched. Choose a new directory or
  remove it yourself.
- a finished export: refused without `overwrite`; with it, the files the earlier export lists are
  deleted first (only those: a `tokenizer.json` copied in beside them stays) and the new ones written.
- an unfinished export (its writer was killed, or the machine died): replaced, with or without
  `overwrite`: it never held a usable result, and its marker says which files are its own.

One export writes into a directory at a time: it holds a POSIX lock on `.jaxzero-export.lock` there while it
writes (`jaxzero.storage.run_lock`), and a second, on any host, is refused naming the first. An export that
fails with an exception removes the files it wrote; the marker goes too when the directory held nothing before
(a directory the export created is removed), else it stays, unfinished, so that a rerun replaces the rest. An
export killed midway leaves its marker unfinished: the rerun of the same command replaces it. Refusals are
`ExportRefused` (a FileExistsError), raised before anything is written.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jaxzero.storage.run_lock import EXPORT_LOCK_FILE, RunDirInUse, lock_export_dir

MARKER = ".jaxzero-export"
# What a writer leaves beside a file it has not finished: SafetensorsWriter's and the JSON writers'
# `<name>.partial`, Orbax's `<name>.orbax-checkpoint-tmp-<timestamp>` directory.
_TEMPORARY = (".partial", ".orbax-checkpoint-tmp*")


class ExportRefused(FileExistsError):
    """The output directory holds something an export may not replace; nothing was written."""


@dataclass
class Earlier:
    """What the output directory holds now: its entries and, for an export, its marker's record."""

    entries: list[str]
    record: dict[str, Any] | None = None

    @property
    def finished(self) -> bool:
        return self.record is not None and self.record.get("finished") is not None

    @property
    def files(self) -> list[str]:
        """The files the earlier export lists as its own (none without one)."""
        return [f for f in (self.record or {}).get("files", []) if isinstance(f, str)]


def _describe(record: Mapping[str, Any]) -> str:
    what = f"{record.get('format')} {record.get('dtype')}"
    if record.get("run_dir"):
        what += f" of step {record.get('step')} of {record['run_dir']}"
    return f"{what}, written {record.get('finished') or record.get('started')}"


def existing(out: str | os.PathLike[str]) -> Earlier:
    """What `out` holds; ExportRefused (with what is in the way and what to do) when an export may not
    write there at all, `overwrite` or not."""
    out = Path(out)
    if not out.exists() and not out.is_symlink():
        return Earlier([])
    if not out.is_dir():
        raise ExportRefused(
            f"{out} is a file, not a directory: choose a new directory for the export (--out), or remove "
            "the file yourself."
        )
    entries = sorted(p.name for p in out.iterdir() if p.name != EXPORT_LOCK_FILE)  # a writer's, not content
    if not entries:
        return Earlier([])
    if MARKER not in entries:
        shown = ", ".join(entries[:5]) + (f" and {len(entries) - 5} more" if len(entries) > 5 else "")
        raise ExportRefused(
            f"{out} is not empty and is not a jaxzero export (it holds {shown}; no {MARKER}): an export "
            "writes only into a new or empty directory or over an earlier export, with --overwrite or "
            "not. Choose a new directory (--out), or remove what is there yourself."
        )
    try:
        record = json.loads((out / MARKER).read_text())
        if not isinstance(record, dict) or not isinstance(record.get("files"), list):
            raise ValueError(f"a JSON {type(record).__name__} without a list of files")
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ExportRefused(
            f"{out / MARKER} cannot be read ({e}), so which files in {out} are an export's is unknown: "
            "choose a new directory (--out), or remove it yourself."
        ) from e
    return Earlier(entries, record)


def check(out: str | os.PathLike[str], overwrite: bool) -> Earlier:
    """`existing(out)`, and ExportRefused for a finished earlier export without `overwrite`: what an
    export into `out` will replace. Reads only; call it before reading the weights."""
    earlier = existing(out)
    if earlier.finished and not overwrite:
        assert earlier.record is not None
        raise ExportRefused(
            f"{out} holds an earlier jaxzero export ({_describe(earlier.record)}); pass overwrite=True "
            "(--overwrite) to replace it, or choose a new directory (--out)."
        )
    return earlier


def _remove(out: Path, names: Sequence[str]) -> None:
    """Delete each of `names` in `out` (a file or a directory) with what its writer leaves unfinished;
    nothing else. A name must be an entry of `out` itself: a marker naming a path elsewhere is ignored."""
    for name in names:
        if not name or Path(name).name != name or name in (".", "..", MARKER):
            continue
        unfinished = [p for suffix in _TEMPORARY for p in out.glob(glob.escape(name) + suffix)]
        for path in [out / name, *unfinished]:
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink(missing_ok=True)


def _write_marker(out: Path, record: Mapping[str, Any]) -> None:
    tmp = out / (MARKER + ".partial")
    tmp.write_text(json.dumps(record, indent=2) + "\n")
    os.replace(tmp, out / MARKER)


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


@dataclass
class ExportDir:
    """An export in progress in `path`: `finish(files)` records the files written and marks it done."""

    path: Path
    record: dict[str, Any]

    def finish(self, files: Sequence[str | os.PathLike[str]]) -> None:
        """Mark the export finished, listing `files` (names in `path`) as its own."""
        self.record = {**self.record, "files": [Path(f).name for f in files], "finished": _now()}
        _write_marker(self.path, self.record)


@contextmanager
def writing(
    out: str | os.PathLike[str],
    *,
    format: str,
    dtype: str,
    files: Sequence[str],
    overwrite: bool,
    source: Mapping[str, Any] | None = None,
) -> Iterator[ExportDir]:
    """Prepare `out` for an export of `format` that writes `files` (names in `out`; a writer's
    temporary `<name>.partial` included), yield it, and on an exception remove what this export wrote
    (module docstring). The block must end with `ExportDir.finish`. ExportRefused, before anything is
    written, where `check` refuses. `source`: what is exported (e.g. run_dir and step), kept in the
    marker."""
    out = Path(out)
    check(out, overwrite)  # refused before anything is written
    try:
        held = lock_export_dir(out.absolute())  # one export writes into `out` at a time
    except RunDirInUse as e:
        raise ExportRefused(str(e)) from e
    with held:  # released last: it removes the directories it created, once empty
        yield from _written(out, format=format, dtype=dtype, files=files, overwrite=overwrite, source=source)


def _written(
    out: Path,
    *,
    format: str,
    dtype: str,
    files: Sequence[str],
    overwrite: bool,
    source: Mapping[str, Any] | None,
) -> Iterator[ExportDir]:
    """`writing`'s body, with `out` held: checked again, since another export may have finished there
    between the first check and the lock."""
    earlier = check(out, overwrite)
    record: dict[str, Any] = {
        "written_by": "jaxzero",
        "format": format,
        "dtype": dtype,
        **dict(source or {}),
        "started": _now(),
        "finished": None,
        # until finished, the earlier export's files too: a rerun after a kill deletes them all
        "files": sorted({*earlier.files, *files}),
    }
    _write_marker(out, record)
    export = ExportDir(out, record)
    try:
        _remove(out, earlier.files)
        yield export
        if export.record.get("finished") is None:
            raise RuntimeError("an export ended without ExportDir.finish: its files are not listed")
    except BaseException:
        _remove(out, record["files"])
        if not earlier.entries:  # the directory held nothing before: leave it so (the lock removes
            (out / MARKER).unlink(missing_ok=True)  # the directories it created)
        raise
