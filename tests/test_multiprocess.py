"""Two processes on loopback save and restore one checkpoint (jax.distributed with gloo on CPU)."""

import socket
import subprocess
import sys
from pathlib import Path

import pytest
from subprocess_run import user_env

pytestmark = pytest.mark.slow  # two processes joined through jax.distributed

PROGRAM = Path(__file__).parent / "programs" / "multiprocess_checkpoint.py"


def test_two_processes_save_and_restore_one_checkpoint(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = user_env()  # one CPU device per process
    procs = [
        subprocess.Popen(
            [sys.executable, str(PROGRAM), str(port), str(i), str(tmp_path / "ckpt")],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    lines = [next(ln for ln in out.splitlines() if ln.startswith("process ")) for out, _ in outs]
    assert all("devices 2" in ln and "restored_equal True" in ln for ln in lines), lines
    assert lines[0].split("loss")[1] == lines[1].split("loss")[1]  # one global step, one loss
    assert (tmp_path / "ckpt" / "checkpoints" / "1").is_dir()
