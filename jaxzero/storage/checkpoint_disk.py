"""A checkpoint's files on disk: their checksums, the room a save needs, and the cause of a failed
write in a few words.

Integrity: as a save commits, the CRC-32 of every file of its items (in 64 MiB pieces) goes to
`<step>/checksums.json`; a restore, and every program that reads a checkpoint (export, eval,
generate), checks them first (`checkpoint.verify`). Room: a save whose checkpoint cannot fit on its
file system is refused before anything is written, and a run that cannot hold the checkpoints it
keeps is refused before training (`ensure_disk_room`).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from jaxzero.config import CheckpointConfig, CheckpointError
from jaxzero.planner.memory import checkpoints_on_disk

log = logging.getLogger(__name__)  # the library speaks through logging (`jaxzero.run.console`)

CHECKSUMS_FILE = "checksums.json"
CHECKSUM_PIECE = 64 << 20  # bytes per CRC-32: pieces of one file are summed in parallel
TMP_MARKER = ".orbax-checkpoint-tmp"  # in the names of Orbax's half-written step directories
TMP_SUFFIX = re.escape(TMP_MARKER) + r"[^/]*"  # of a temporary directory's name, to its end


class CheckpointWriteError(RuntimeError):
    """A checkpoint could not be written; the message names the step, the directory and the cause."""


# -- checksums ---------------------------------------------------------------------------------------


def _files(step_dir: Path) -> list[Path]:
    """The files of a step's items (`state/`, `meta/`): Orbax rewrites its own bookkeeping files at
    the step's top level as it commits, so those are not summed."""
    return sorted(p for p in step_dir.rglob("*") if p.is_file() and p.parent != step_dir)


def _piece_crc(path: Path, offset: int) -> int:
    with open(path, "rb") as f:
        f.seek(offset)
        return zlib.crc32(f.read(CHECKSUM_PIECE))


def file_checksums(step_dir: Path, pool: ThreadPoolExecutor) -> dict[str, list[int]]:
    """{file path relative to `step_dir`: [size, CRC-32 of each 64 MiB piece...]}, pieces in parallel.
    Paths are named as committed: summed before Orbax renames its temporary item directories, a
    path drops their temporary suffix."""
    files = _files(step_dir)
    jobs = {
        (p, off): pool.submit(_piece_crc, p, off)
        for p in files
        for off in range(0, max(p.stat().st_size, 1), CHECKSUM_PIECE)
    }
    out: dict[str, list[int]] = {}
    for p in files:
        crcs = [f.result() for (q, _), f in jobs.items() if q == p]
        out[re.sub(TMP_SUFFIX, "", str(p.relative_to(step_dir)))] = [p.stat().st_size, *crcs]
    return out


def write_checksums(step_dir: Path, pool: ThreadPoolExecutor) -> None:
    """Write `checksums.json` for the files of a checkpoint whose items are final (called as Orbax
    commits it, in its temporary directory, so that the checksums commit with it), atomically."""
    tmp = step_dir / f".{CHECKSUMS_FILE}.tmp"
    tmp.write_text(json.dumps(file_checksums(step_dir, pool)))
    os.replace(tmp, step_dir / CHECKSUMS_FILE)


def verify_checksums(step_dir: Path, pool: ThreadPoolExecutor) -> None:
    """Raise CheckpointError if a file of `step_dir` is missing or changed since its checksum was
    written (`changed_files`)."""
    bad = changed_files(step_dir, pool)
    if bad:
        raise CheckpointError(
            f"the bytes of {len(bad)} file(s) of checkpoint {step_dir} changed since it was saved "
            f"(checksum mismatch or missing): {', '.join(bad[:4])}"
        )


def changed_files(step_dir: Path, pool: ThreadPoolExecutor) -> list[str]:
    """The files of `step_dir`'s items missing or changed since their checksums were written, as paths
    relative to it; [] where all match. A checkpoint without `checksums.json` (saved by an older
    jaxzero, or by a process that stopped right after the save committed) is read unverified, with a
    note; CheckpointError where that file is unreadable."""
    path = step_dir / CHECKSUMS_FILE
    if not path.exists():
        log.warning(f"checkpoint {step_dir} has no {CHECKSUMS_FILE}; reading it unverified.")
        return []
    try:
        expected = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path} is unreadable: {e}") from e
    actual = file_checksums(step_dir, pool)
    return sorted(k for k in expected if actual.get(k) != expected[k])


# -- room on disk ------------------------------------------------------------------------------------


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"


def ensure_room(directory: Path, nbytes: int, what: str) -> None:
    """Raise `CheckpointWriteError` if the file system holding `directory` (or its nearest existing
    parent) has less than `nbytes` free: a checkpoint that cannot fit is refused before any write."""
    existing = directory
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    free = shutil.disk_usage(existing).free
    if free < nbytes:
        raise CheckpointWriteError(
            f"not enough free space for {what} in {directory}: it needs about {_size(nbytes)}, and "
            f"{_size(free)} is free. Free space there (the run's older checkpoints are deleted only after a "
            "new one is written, so delete any you do not need yourself), or set checkpoint.enabled=false."
        )


def bytes_under(directory: Path) -> int:
    """Bytes of the files under `directory` (a checkpoint's on disk)."""
    return sum(f.stat().st_size for f in directory.rglob("*") if f.is_file())


def ensure_disk_room(directory: Path, size: int, cfg: CheckpointConfig, saves: int) -> None:
    """Raise `CheckpointWriteError`, before training, if the file system holding `directory` cannot
    hold the checkpoints (each `size` bytes) a run keeps at once while it makes `saves` more saves
    (`checkpoints_on_disk`), counting the room its checkpoints already there take."""
    steps = [p for p in directory.iterdir() if p.name.isdigit()] if directory.is_dir() else []
    have = sum(bytes_under(p) for p in steps)
    count = checkpoints_on_disk(cfg, len(steps), saves)
    if count * size - have > 0:
        ensure_room(
            directory,
            count * size - have,
            f"this run's checkpoints ({count} of {_size(size)} at once at most: the newest checkpoint.keep="
            f"{cfg.keep} and the one being written before the oldest is deleted; a lower checkpoint.keep "
            "needs less)",
        )


# -- write errors ------------------------------------------------------------------------------------


def describe_write_error(error: BaseException) -> str:
    """The cause of a failed write in a few words: the OS error if one is in the chain (the Orbax and
    TensorStore errors around it can run to pages), else the first line of the error."""
    seen, chain = set(), []
    e: BaseException | None = error
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        chain.append(e)
        e = e.__cause__ or e.__context__
    for e in chain:
        if isinstance(e, OSError) and e.errno:
            return f"{os.strerror(e.errno)} (errno {e.errno})"
    text = " ".join(str(e) for e in chain)
    code = re.search(r"os_error_code='?(\d+)", text)  # TensorStore's own errors carry the OS's number
    if code and int(code.group(1)):
        return f"{os.strerror(int(code.group(1)))} (errno {code.group(1)})"
    for errno_name, message in (
        ("ENOSPC", "No space left on device"),
        ("EPERM", "Operation not permitted"),
        ("EACCES", "Permission denied"),
        ("EROFS", "Read-only file system"),
        ("EDQUOT", "Disk quota exceeded"),
    ):
        if message.lower() in text.lower():
            return f"{message} ({errno_name})"
    first = (str(error).strip().splitlines() or [type(error).__name__])[0]
    return f"{type(error).__name__}: {first[:300]}"
