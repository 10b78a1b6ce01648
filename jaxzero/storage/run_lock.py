"""One writer per directory: an exclusive lock on `<run_dir>/trainer.lock` while a trainer runs there
(`lock_run_dir`), and on `<out>/.jaxzero-export.lock` while an export writes there (`lock_export_dir`).

The lock is a POSIX record lock (`fcntl.lockf`) on the whole file. The kernel drops it when the
process ends, however it ends (a SIGKILL leaves nothing stale), and it is the lock NFS honours
between hosts that share the directory. The file records the holder (host, pid, UTC start time), so
that a second trainer, on any host, is refused at once with a message naming it. The processes of one
job hold the directory as one: process 0 takes the lock, the others take nothing (`owner=False`).

Two rules of POSIX locks shape the code. They belong to the process, so a second lock of the same
file from the same process is granted by the kernel: this module refuses it itself (`_HELD`). And a
process loses its lock when it closes any descriptor of the file, so while the lock is held the
process never opens the file again (a refused process reads the holder through its own descriptor).

Released (on every way out of `train`), the lock file is removed, and so is the directory if the lock
created it and nothing else was written there (a run that fails before it writes anything leaves
nothing). The file is unlinked while still locked, and a trainer that then locks the unlinked file
sees that the path no longer names it and tries again on the new one.
"""

from __future__ import annotations

import datetime
import errno
import fcntl
import json
import os
import socket
import threading
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from jaxzero.config import ConfigError

LOCK_FILE = "trainer.lock"
EXPORT_LOCK_FILE = ".jaxzero-export.lock"
_ATTEMPTS = 10  # lock, find the file replaced by a releasing holder, try again: at most this often


@dataclass(frozen=True)
class Role:
    """What a locked directory is to its writer, in the words of the messages."""

    key: str  # the setting naming the directory: "run_dir"
    flag: str  # its flag: "--run_dir"
    writer: str  # who holds it: "trainer"
    lock_file: str  # the lock's file in the directory


RUN = Role("run_dir", "--run_dir", "trainer", LOCK_FILE)
EXPORT = Role("export directory", "--out", "export", EXPORT_LOCK_FILE)


@dataclass(frozen=True)
class Holder:
    """Who holds a directory: the writer's host, pid and start time (UTC, ISO 8601)."""

    host: str
    pid: int
    started: str

    def describe(self, writer: str = "trainer") -> str:
        return f"the {writer} started {self.started} on host {self.host}, pid {self.pid}"


# The directories this process holds, by (device, inode): POSIX locks do not exclude their own process.
_HELD: dict[tuple[int, int], Holder] = {}
_HELD_GUARD = threading.Lock()


class RunDirInUse(ConfigError):
    """Another writer holds the directory; `holder` says which (None: its record was unreadable)."""

    def __init__(self, directory: Path, holder: Holder | None, role: Role = RUN):
        who = (
            holder.describe(role.writer)
            if holder is not None
            else f"another {role.writer} (its {role.lock_file} is unreadable)"
        )
        super().__init__(
            f"{role.key} {directory} is in use by {who}; wait for it to end or pass another {role.flag}."
        )
        self.holder = holder


class RunLock:
    """A held run directory (`lock_run_dir`); `release`, or leaving its `with` block, lets it go."""

    def __init__(
        self, directory: Path, fd: int | None, key: tuple[int, int] | None, created: list[Path], role: Role
    ):
        self.directory = directory
        self._fd, self._key, self._created, self._role = fd, key, created, role

    def __enter__(self) -> RunLock:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.release()

    def release(self) -> None:
        """Remove the lock file (still locked, so that no other trainer holds it meanwhile), unlock it,
        and remove the directories the lock created if nothing else was written there; again: nothing."""
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        _unlock(fd, self.directory / self._role.lock_file)
        with _HELD_GUARD:
            _HELD.pop(self._key, None)
        _remove(self._created)


def lock_run_dir(directory: Path, owner: bool = True) -> RunLock:
    """Hold run directory `directory` (absolute; created if absent) for this trainer, or raise
    `RunDirInUse` naming the trainer that holds it, or ConfigError if it cannot be written (a read-only
    file system, no permission). `owner=False` (processes other than 0 of a job) holds nothing."""
    if not owner:
        return RunLock(directory, None, None, [], RUN)
    return _hold(directory, RUN)


def lock_export_dir(directory: Path) -> RunLock:
    """Hold export directory `directory` (created if absent) for this export, as `lock_run_dir` holds a
    run directory: a second export into it, on any host, is `RunDirInUse` naming the first."""
    return _hold(directory, EXPORT)


def _hold(directory: Path, role: Role) -> RunLock:
    holder = Holder(
        socket.gethostname(), os.getpid(), datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    )
    created = _make_dirs(directory, role)
    path = directory / role.lock_file
    key = None
    try:
        stat = directory.stat()
        with _HELD_GUARD:  # claimed before the kernel's lock: two threads never both pass
            if (stat.st_dev, stat.st_ino) in _HELD:
                raise RunDirInUse(directory, _HELD[(stat.st_dev, stat.st_ino)], role)
            key = (stat.st_dev, stat.st_ino)
            _HELD[key] = holder
        fd = _lock(directory, path, role)
        try:
            _write_holder(fd, holder)
        except OSError as e:
            _unlock(fd, path)
            raise _unwritable(directory, e, role) from e
    except BaseException:
        if key is not None:
            with _HELD_GUARD:
                _HELD.pop(key, None)
        _remove(created)
        raise
    return RunLock(directory, fd, key, created, role)


def _make_dirs(directory: Path, role: Role) -> list[Path]:
    """Create `directory` and its missing parents; returns those created, outermost first. Raises
    ConfigError naming the cause if one cannot be created."""
    missing = []
    parent = directory
    while not parent.exists() and parent != parent.parent:
        missing.append(parent)
        parent = parent.parent
    created = []
    for path in reversed(missing):
        try:
            path.mkdir()
        except FileExistsError:  # made meanwhile (another trainer, or a process of this job)
            continue
        except OSError as e:
            _remove(created)
            raise _unwritable(directory, e, role) from e
        created.append(path)
    return created


def _lock(directory: Path, path: Path, role: Role) -> int:
    """A descriptor of `path` holding its exclusive lock, or `RunDirInUse`."""
    for _ in range(_ATTEMPTS):
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as e:
            raise _unwritable(directory, e, role) from e
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = _read_holder(fd)
            os.close(fd)
            if e.errno in (errno.EACCES, errno.EAGAIN):  # held: POSIX says either
                raise RunDirInUse(directory, holder, role) from e
            raise ConfigError(
                f"{role.key} {directory} cannot be locked ({os.strerror(e.errno or 0)}, errno {e.errno}): "
                f"jaxzero holds a POSIX lock on its {role.lock_file} so that one {role.writer} writes there "
                f"at a time. On NFS, mount with locking (no `nolock`), or pass a {role.flag} on a local disk."
            ) from e
        try:
            current = os.stat(path)
        except FileNotFoundError:
            current = None
        if current is not None and os.path.samestat(os.fstat(fd), current):
            return fd
        os.close(fd)  # the file a releasing holder just removed: lock the new one
    raise ConfigError(
        f"{role.key} {directory}: its {role.lock_file} was replaced {_ATTEMPTS} times while this "
        f"{role.writer} tried to lock it ({role.writer}s starting and stopping there at once?); try again."
    )


def _unlock(fd: int, path: Path) -> None:
    """Remove the lock file `fd` holds (still locked: no other trainer holds it meanwhile), then close
    it, which drops the lock."""
    try:
        if os.path.samestat(os.fstat(fd), os.stat(path)):
            os.unlink(path)
    except OSError:  # gone, or a file system that refuses: the lock still goes with the descriptor
        pass
    os.close(fd)


def _remove(created: list[Path]) -> None:
    """Remove the directories the lock created, deepest first, up to one that holds anything."""
    for made in reversed(created):
        try:
            made.rmdir()
        except OSError:
            break


def _write_holder(fd: int, holder: Holder) -> None:
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(holder.__dict__) + "\n").encode(), 0)
    os.fsync(fd)  # NFS: the record reaches the server, where another host's trainer reads it


def _read_holder(fd: int) -> Holder | None:
    try:
        d = json.loads(os.pread(fd, 4096, 0))
        return Holder(str(d["host"]), int(d["pid"]), str(d["started"]))
    except (OSError, ValueError, TypeError, KeyError):
        return None


def _unwritable(directory: Path, e: OSError, role: Role) -> ConfigError:
    return ConfigError(
        f"{role.key} {directory} cannot be written: {e.strerror or e} (errno {e.errno}"
        f"{', ' + errno.errorcode[e.errno] if e.errno in errno.errorcode else ''}). Pass a {role.flag} on a "
        "file system you can write to, or make it writable."
    )
