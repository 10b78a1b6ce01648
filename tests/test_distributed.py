"""Tests for jaxzero.run.distributed: which environments start a run of several processes, what JAX is
given, and the errors for variables that miss a partner. No processes are started here (the launcher's
tests in test_launch.py start some)."""

from __future__ import annotations

import inspect
import io
from typing import Any

import jax
import pytest

from jaxzero.config import ConfigError
from jaxzero.primitives import coordination
from jaxzero.run import distributed
from jaxzero.run.distributed import Processes, detect, initialize_arguments

JAX_VARS = {"JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234", "JAX_NUM_PROCESSES": "4", "JAX_PROCESS_ID": "2"}
SLURM = {
    "SLURM_JOB_ID": "77",
    "SLURM_STEP_NODELIST": "node[001-002]",
    "SLURM_NTASKS": "16",
    "SLURM_PROCID": "9",
    "SLURM_LOCALID": "1",
}
ACCEPTED = set(inspect.signature(jax.distributed.initialize).parameters)


def test_one_process_starts_nothing() -> None:
    assert detect({}) is None
    assert detect({"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_NUM_PROCESSES": "1", "JAX_PROCESS_ID": "0"}) is None
    assert detect({**SLURM, "SLURM_NTASKS": "1", "SLURM_PROCID": "0"}) is None
    assert detect({"OMPI_COMM_WORLD_SIZE": "1", "OMPI_COMM_WORLD_RANK": "0"}) is None
    # A shell on a SLURM node (no srun step): JAX's SLURM detection would fail, so nothing starts.
    assert detect({k: v for k, v in SLURM.items() if k != "SLURM_STEP_NODELIST"}) is None


def test_jax_variables() -> None:
    assert detect(JAX_VARS) == Processes(
        count=4, index=2, coordinator="10.0.0.1:1234", source="JAX_NUM_PROCESSES"
    )
    # They win over SLURM's (the launcher's processes inherit a SLURM step's variables).
    assert detect({**SLURM, **JAX_VARS}) == detect(JAX_VARS)


def test_slurm_and_open_mpi() -> None:
    assert detect(SLURM) == Processes(count=16, index=9, coordinator=None, source="SLURM")
    ompi = {
        "OMPI_COMM_WORLD_SIZE": "8",
        "OMPI_COMM_WORLD_RANK": "3",
        "OMPI_MCA_orte_hnp_uri": "1.0;tcp://10.0.0.5:1",
    }
    assert detect(ompi) == Processes(count=8, index=3, coordinator=None, source="Open MPI")
    # Open MPI 5 has no orte URI: the coordinator must be given, rank and size come from Open MPI.
    five = {k: v for k, v in ompi.items() if k != "OMPI_MCA_orte_hnp_uri"}
    with pytest.raises(ConfigError, match=r"set JAX_COORDINATOR_ADDRESS=host:port .*mpirun -x"):
        detect(five)
    given = detect({**five, "JAX_COORDINATOR_ADDRESS": "10.0.0.5:999"})
    assert given == Processes(count=8, index=3, coordinator="10.0.0.5:999", source="Open MPI")


@pytest.mark.parametrize(
    "env,message",
    [
        ({"JAX_COORDINATOR_ADDRESS": "h:1"}, r"not how many processes there are: set JAX_NUM_PROCESSES=N"),
        ({"JAX_NUM_PROCESSES": "2", "JAX_COORDINATOR_ADDRESS": "h:1"}, r"JAX_PROCESS_ID is not"),
        ({"JAX_PROCESS_ID": "0"}, r"JAX_PROCESS_ID=0 is set but JAX_NUM_PROCESSES is not"),
        ({"JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "1"}, r"needs JAX_COORDINATOR_ADDRESS=host:port"),
        ({**JAX_VARS, "JAX_NUM_PROCESSES": "two"}, r"JAX_NUM_PROCESSES='two' must be an integer"),
        ({**JAX_VARS, "JAX_PROCESS_ID": "4"}, r"process id 4 of 4 processes .* impossible"),
    ],
)
def test_variables_that_miss_a_partner_or_contradict(env: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        detect(env)


def test_initialize_is_bounded_by_the_timeout() -> None:
    args = initialize_arguments(detect(JAX_VARS), 42, ACCEPTED)  # type: ignore[arg-type]
    assert args["initialization_timeout"] == 42
    # JAX 0.10 takes the heartbeat and shutdown timeouts too; a JAX without them gets only what it has.
    assert args.get("heartbeat_timeout_seconds", 42) == args.get("shutdown_timeout_seconds", 42) == 42
    assert (args["coordinator_address"], args["num_processes"], args["process_id"]) == ("10.0.0.1:1234", 4, 2)
    assert args.get("cluster_detection_method", "deactivate") == "deactivate"  # everything given
    assert set(initialize_arguments(detect(JAX_VARS), 42, {"initialization_timeout"})) == {  # type: ignore[arg-type]
        "initialization_timeout"
    }
    slurm = initialize_arguments(detect(SLURM), 42, ACCEPTED)  # type: ignore[arg-type]
    assert slurm["coordinator_address"] is None  # JAX's SLURM detection derives it (and the local GPU)
    assert "cluster_detection_method" not in slurm


def test_start_passes_what_jax_accepts_and_nothing_for_one_process(
    capsys: pytest.CaptureFixture[str],
) -> None:
    calls: list[dict[str, Any]] = []

    def initialize(coordinator_address=None, num_processes=None, process_id=None, initialization_timeout=300):
        calls.append(
            dict(
                coordinator_address=coordinator_address,
                num_processes=num_processes,
                process_id=process_id,
                initialization_timeout=initialization_timeout,
            )
        )

    assert distributed.start(7, environ={}, initialize=initialize) is None and calls == []
    console = io.StringIO()
    processes = distributed.start(7, environ=JAX_VARS, console=console, initialize=initialize)
    assert processes == detect(JAX_VARS)
    assert calls == [
        dict(coordinator_address="10.0.0.1:1234", num_processes=4, process_id=2, initialization_timeout=7)
    ]
    assert "joining as process 2 of 4" in console.getvalue()
    assert jax.config.jax_cpu_collectives_implementation == "gloo"  # CPU collectives across processes


def test_barrier_and_agree_are_nothing_for_one_process() -> None:
    distributed.barrier("alone", 1)
    assert coordination.agree("run_dir", "runs/x", 1) == "runs/x"


def test_a_clean_stop_sends_the_runtimes_shutdown_chatter_to_the_error_log(tmp_path) -> None:
    """From the clean shutdown on, what C++ writes to stderr (the GPU client's GRPC warnings as the
    coordination service goes away) lands in the run's error log, not on the user's terminal."""
    import subprocess
    import sys

    from subprocess_run import user_env

    code = (
        "import os, sys; from pathlib import Path; from jaxzero.run import distributed; "
        "print('before', file=sys.stderr, flush=True); "
        f"distributed.stop(chatter=Path({str(tmp_path / 'error.log')!r})); "
        "os.write(2, b'W pjrt_client.cc WatchTasksAsync failed: CANCELLED\\n')"
    )
    proc = subprocess.run([sys.executable, "-c", code], env=user_env(), capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == "before\n"
    assert (tmp_path / "error.log").read_text() == (
        "jaxzero: the runtime's messages as this process shut down (not errors of the run):\n"
        "W pjrt_client.cc WatchTasksAsync failed: CANCELLED\n"
    )
