"""Run jaxzero's command-line programs as a user does: a fresh process with one CPU device."""

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


# The test session's persistent compilation cache (conftest.py), shared with every program the tests
# start: they compile the same tiny programs again and again. Numba's kernels are cached on disk by
# jaxzero itself (`host_kernels._load`), for every process.
COMPILATION_CACHE = {
    "JAX_COMPILATION_CACHE_DIR": os.path.join(
        os.environ.get("TMPDIR", "/tmp"), f"jaxzero-test-cache-{os.getuid()}"
    ),
    "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
    "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
}


def user_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # no fake devices: a plain run
    env.update(PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu", **COMPILATION_CACHE, **extra)
    return env


def run_module(module: str, *args: str, cwd: Path, env_extra: dict | None = None, wait: bool = True):
    """`python -m module args` in `cwd`: a CompletedProcess, or with `wait=False` a running Popen."""
    return _run([sys.executable, "-m", module, *args], cwd, env_extra, wait)


def run_program(name: str, *args: str, cwd: Path, env_extra: dict | None = None, wait: bool = True):
    """`python tests/programs/NAME args` in `cwd`, as `run_module` runs a module."""
    return _run([sys.executable, str(REPO / "tests" / "programs" / name), *args], cwd, env_extra, wait)


def _run(cmd: list[str], cwd: Path, env_extra: dict | None, wait: bool):
    env = user_env(**(env_extra or {}))
    if not wait:
        return subprocess.Popen(
            cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
