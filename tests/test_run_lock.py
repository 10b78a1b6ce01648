"""One trainer per run directory (`jaxzero.storage.run_lock`): the lock against another process (held,
released, its holder killed), within one process, shared by the processes of one job, and what it leaves."""

import errno
import os
import signal
import socket
import subprocess
import sys

import pytest
from subprocess_run import user_env

from jaxzero.config import ConfigError
from jaxzero.storage.run_lock import LOCK_FILE, RunDirInUse, lock_run_dir

# Another process: hold `argv[1]` until killed, or try to take it once and say what happened.
HOLD = """
import sys, time
from pathlib import Path
from jaxzero.storage.run_lock import lock_run_dir
lock = lock_run_dir(Path(sys.argv[1]))
print("held", flush=True)
time.sleep(600)
"""
TRY = """
import sys
from pathlib import Path
from jaxzero.storage.run_lock import RunDirInUse, lock_run_dir
try:
    lock_run_dir(Path(sys.argv[1])).release()
    print("taken")
except RunDirInUse as e:
    print(f"refused {e.holder.pid if e.holder else None}: {e}")
"""


def python(code: str, *args: str, wait: bool = True):
    cmd = [sys.executable, "-c", code, *args]
    if not wait:
        return subprocess.Popen(cmd, env=user_env(), stdout=subprocess.PIPE, text=True)
    return subprocess.run(cmd, env=user_env(), capture_output=True, text=True, timeout=120)


def test_another_process_is_refused_naming_the_holder_until_it_is_released(tmp_path):
    run = tmp_path / "r"
    with lock_run_dir(run):
        held = python(TRY, str(run)).stdout
        pid = os.getpid()
        assert held.startswith(f"refused {pid}: run_dir {run} is in use by the trainer started "), held
        host = socket.gethostname()
        assert f"on host {host}, pid {pid}; wait for it to end or pass another --run_dir" in held
    assert not run.exists()  # the lock made it and nothing else was written there: gone with the lock
    taken = python(TRY, str(run))
    assert taken.stdout.strip() == "taken", taken.stderr


def test_a_holder_killed_with_sigkill_leaves_nothing_that_stops_the_next(tmp_path):
    run = tmp_path / "r"
    holder = python(HOLD, str(run), wait=False)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(RunDirInUse, match=f"pid {holder.pid};") as refused:
            lock_run_dir(run)
        assert refused.value.holder.pid == holder.pid
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert f'"pid": {holder.pid}' in (run / LOCK_FILE).read_text()  # its record stays; its lock went with it
    with lock_run_dir(run):
        assert (run / LOCK_FILE).exists()
    assert not (run / LOCK_FILE).exists()


def test_in_one_process_a_held_directory_is_refused_until_released(tmp_path):
    """POSIX locks do not exclude their own process; the module does, whatever the path's spelling."""
    run = tmp_path / "r"
    lock = lock_run_dir(run)
    with pytest.raises(RunDirInUse, match=f"pid {os.getpid()};"):
        lock_run_dir(tmp_path / "r" / ".." / "r")
    lock.release()
    lock.release()  # again: nothing
    with lock_run_dir(run):
        pass


def test_the_processes_of_one_job_hold_the_directory_as_one(tmp_path):
    run = tmp_path / "r"
    with lock_run_dir(run):  # process 0
        other = lock_run_dir(run, owner=False)  # process 1: not refused, holds nothing
        other.release()
        with pytest.raises(RunDirInUse):  # still held by process 0
            lock_run_dir(run)


def test_release_keeps_what_the_run_wrote_and_removes_only_what_the_lock_made(tmp_path):
    with lock_run_dir(tmp_path / "a" / "b" / "c"):
        assert (tmp_path / "a" / "b" / "c" / LOCK_FILE).exists()
    assert sorted(tmp_path.iterdir()) == []  # a/b/c made by the lock, all gone
    run = tmp_path / "r"
    with lock_run_dir(run):
        (run / "config.json").write_text("{}")
    assert sorted(p.name for p in run.iterdir()) == ["config.json"]


def test_a_run_dir_on_a_read_only_file_system_is_one_clear_config_error(tmp_path, monkeypatch):
    run = tmp_path / "r"
    run.mkdir()
    real = os.open

    def read_only(path, *args, **kwargs):
        if os.fspath(path).endswith(LOCK_FILE):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), os.fspath(path))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(os, "open", read_only)
    with pytest.raises(ConfigError, match=r"cannot be written: Read-only file system \(errno 30, EROFS\)"):
        lock_run_dir(run)
    assert list(run.iterdir()) == []


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a directory whatever its permission bits")
def test_a_run_dir_the_user_cannot_write_is_one_clear_config_error(tmp_path):
    run = tmp_path / "r"
    run.mkdir()
    run.chmod(0o555)
    try:
        with pytest.raises(ConfigError, match=r"cannot be written: Permission denied \(errno 13, EACCES\)"):
            lock_run_dir(run)
    finally:
        run.chmod(0o755)
