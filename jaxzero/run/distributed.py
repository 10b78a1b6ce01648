"""Joining a run of several processes through JAX's own runtime (`jax.distributed`), and leaving it.

Where the processes come from, read from the environment in this order:

* JAX's variables: ``JAX_COORDINATOR_ADDRESS=host:port`` (process 0's host, a free port),
  ``JAX_NUM_PROCESSES=N`` and ``JAX_PROCESS_ID=i``. `python -m jaxzero.launch` sets them; so can a
  script on each of several hosts. (JAX itself reads only the address; jaxzero passes the count and
  the id.)
* SLURM (``srun``): ``SLURM_NTASKS`` > 1, with the variables JAX's own SLURM detection needs
  (``SLURM_JOB_ID``, ``SLURM_STEP_NODELIST``, ``SLURM_PROCID``, ``SLURM_LOCALID``). JAX derives the
  coordinator (the step's first node; the port from the job id, or ``JAX_COORDINATOR_PORT``) and, by
  its convention, gives each process the GPU of its local rank: one task per GPU, or set
  ``JAX_LOCAL_DEVICE_IDS=0,1,...`` to drive several.
* Open MPI (``mpirun``): ``OMPI_COMM_WORLD_SIZE`` > 1. JAX derives the coordinator from Open MPI's
  ``OMPI_MCA_orte_hnp_uri`` (Open MPI 4 and older); elsewhere set ``JAX_COORDINATOR_ADDRESS`` too
  (e.g. ``mpirun -x JAX_COORDINATOR_ADDRESS=host0:12345``), rank and size come from Open MPI.

One process (none of these, or a count of 1) starts nothing: a runtime of one would only print a GRPC
error at exit.

Bounded failure: JAX is given ``parallel.timeout_s`` for joining (``initialization_timeout``), for
declaring a silent peer dead (``heartbeat_timeout_seconds``: every other process then stops with an
error naming the task) and for the exit barrier (``shutdown_timeout_seconds``), each where the
installed JAX accepts it. A process that dies therefore never leaves the others waiting for ever;
one that fails on its own exits at once (`stop`), so that a launcher sees it and stops the others.
"""

from __future__ import annotations

import inspect
import os
import sys
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import jax

# JAX has no public API for its coordination service's barriers and key-value store, which need no
# backend and take a timeout; Orbax's multihost utilities use this same client.
from jax._src import distributed as jax_distributed

from jaxzero.config import ConfigError

__all__ = ["Processes", "barrier", "detect", "index", "initialize_arguments", "start", "stop"]

COORDINATOR = "JAX_COORDINATOR_ADDRESS"
NUM_PROCESSES = "JAX_NUM_PROCESSES"
PROCESS_ID = "JAX_PROCESS_ID"
# What JAX's SLURM detection (jax/_src/clusters/slurm_cluster.py) needs, all of it: with only some of
# them (a shell on an allocated node) JAX's detection fails, so jaxzero does not start it either.
_SLURM = ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID")
_OMPI_SIZE = "OMPI_COMM_WORLD_SIZE"
_OMPI_URI = "OMPI_MCA_orte_hnp_uri"  # set by Open MPI 4's mpirun; JAX reads the coordinator's IP from it


@dataclass(frozen=True)
class Processes:
    """How this process joins a run of several.

    count:       processes in the run (> 1).
    index:       this process's id, in ``[0, count)``; process 0 hosts the coordinator.
    coordinator: ``host:port`` of the coordinator, or None: JAX's cluster detection derives it.
    source:      which environment said so, for messages (``JAX_NUM_PROCESSES``, ``SLURM``, ``Open MPI``).
    """

    count: int
    index: int
    coordinator: str | None
    source: str

    def describe(self) -> str:
        """One line for logs."""
        where = self.coordinator or "the address JAX derives from it"
        return f"process {self.index} of {self.count} ({self.source}; coordinator {where})"


def _int(environ: Mapping[str, str], name: str) -> int:
    value = environ.get(name)
    if value is None:
        raise ConfigError(f"{name} is not set, but the other variables of a run of several processes are.")
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"{name}={value!r} must be an integer.") from None


def detect(environ: Mapping[str, str] | None = None) -> Processes | None:
    """The run of several processes `environ` (default `os.environ`) describes, or None for one
    process. Raises ConfigError for variables that contradict each other or miss a partner, saying
    which to set."""
    env = os.environ if environ is None else environ
    coordinator = env.get(COORDINATOR) or None
    if NUM_PROCESSES in env or PROCESS_ID in env:
        if NUM_PROCESSES not in env or PROCESS_ID not in env:
            given, missing = (NUM_PROCESSES, PROCESS_ID)
            if NUM_PROCESSES not in env:
                given, missing = missing, given
            raise ConfigError(
                f"{given}={env[given]} is set but {missing} is not: set both (the process count and "
                f"this process's id, 0 to count - 1), with {COORDINATOR}=host:port of process 0."
            )
        count, index, source = _int(env, NUM_PROCESSES), _int(env, PROCESS_ID), NUM_PROCESSES
    elif all(name in env for name in _SLURM) and _int(env, "SLURM_NTASKS") > 1:
        count, index, source = _int(env, "SLURM_NTASKS"), _int(env, "SLURM_PROCID"), "SLURM"
    elif _OMPI_SIZE in env and _int(env, _OMPI_SIZE) > 1:
        count, index, source = _int(env, _OMPI_SIZE), _int(env, "OMPI_COMM_WORLD_RANK"), "Open MPI"
        if coordinator is None and _OMPI_URI not in env:
            raise ConfigError(
                f"Open MPI started {count} processes, but without {_OMPI_URI} (Open MPI 5 and later) JAX "
                f"cannot find the coordinator: set {COORDINATOR}=host:port (process 0's host, a free "
                f"port) for every process, e.g. mpirun -x {COORDINATOR}=$(hostname):12345 ..."
            )
    elif coordinator is not None:
        raise ConfigError(
            f"{COORDINATOR}={coordinator} is set, but not how many processes there are: set "
            f"{NUM_PROCESSES}=N and {PROCESS_ID}=i (0 to N - 1) in every process too, or unset "
            f"{COORDINATOR} to train in one process."
        )
    else:
        return None
    if count < 1 or not 0 <= index < count:
        raise ConfigError(
            f"process id {index} of {count} processes ({source}) is impossible: the count must be >= 1 "
            "and the id in [0, count)."
        )
    if count == 1:
        return None
    if source == NUM_PROCESSES and coordinator is None:
        raise ConfigError(
            f"{NUM_PROCESSES}={count} needs {COORDINATOR}=host:port: process 0's host and a free port, "
            "the same in every process."
        )
    return Processes(count=count, index=index, coordinator=coordinator, source=source)


def initialize_arguments(processes: Processes, timeout_s: int, accepted: Collection[str]) -> dict[str, Any]:
    """The keyword arguments of `jax.distributed.initialize` for `processes`, bounded by `timeout_s`,
    keeping only the names in `accepted` (the installed JAX's signature)."""
    args: dict[str, Any] = {
        "initialization_timeout": timeout_s,
        "heartbeat_timeout_seconds": timeout_s,
        "shutdown_timeout_seconds": timeout_s,
    }
    if processes.source == NUM_PROCESSES:
        # Everything is given: no cluster detection, which would otherwise also pin this process to
        # one GPU when SLURM or Open MPI variables are around (the launcher's children inherit them).
        args.update(
            coordinator_address=processes.coordinator,
            num_processes=processes.count,
            process_id=processes.index,
            cluster_detection_method="deactivate",
        )
    else:
        # JAX's detection of SLURM or Open MPI gives the rest; an address given explicitly wins.
        args.update(coordinator_address=processes.coordinator, num_processes=processes.count)
        args["process_id"] = processes.index
    return {k: v for k, v in args.items() if k in accepted}


def start(
    timeout_s: int,
    environ: Mapping[str, str] | None = None,
    console: TextIO | None = sys.stdout,
    initialize: Callable[..., None] | None = None,
) -> Processes | None:
    """Join the run of several processes the environment describes (`detect`), before any JAX backend
    starts; returns it, or None when there is one process (nothing started) or JAX's runtime is
    already running. `timeout_s` (`parallel.timeout_s`) bounds joining, a silent peer and the exit.

    On the CPU backend cross-process collectives need an implementation: gloo, unless one was chosen.
    `initialize` is `jax.distributed.initialize` (replaceable in tests)."""
    processes = detect(environ)
    if processes is None or jax.distributed.is_initialized():
        return None
    initialize = jax.distributed.initialize if initialize is None else initialize
    if jax.config.jax_cpu_collectives_implementation is None:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    accepted = inspect.signature(initialize).parameters
    if console is not None:
        print(
            f"jaxzero: joining as {processes.describe()}, waiting up to parallel.timeout_s={timeout_s} s "
            "for the others",
            file=console,
            flush=True,
        )
    initialize(**initialize_arguments(processes, timeout_s, accepted))
    return processes


# The first line of what `stop` sends to the error log: what follows is not an error of the run.
SHUTDOWN_HEADER = "jaxzero: the runtime's messages as this process shut down (not errors of the run):\n"


def stop(failed_with: int | None = None, chatter: Path | None = None) -> None:
    """Leave the runtime `start` started. `failed_with` None: the processes stop together (done, or
    preempted at one step), so JAX's clean shutdown, whose exit barrier waits for the others; a failure
    there only warns. Else this process failed alone: it exits at once with that status (output
    flushed), since the exit barrier would hold it for `parallel.timeout_s` waiting for processes that
    are not stopping; the launcher, or JAX's heartbeat check, then stops the others.

    `chatter`: a file (the run's error log) that takes this process's stderr from the clean shutdown
    on, for good: the GPU client's task watch reports the coordination service going away as GRPC
    warnings from C++ (`WatchTasksAsync failed ... CANCELLED`, then `UNAVAILABLE` once a second until
    the process ends), which no setting of JAX turns off and which tell a user nothing."""
    if failed_with is not None:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(failed_with)
    warn = sys.stderr
    if chatter is not None and chatter.parent.is_dir():
        sys.stdout.flush()
        sys.stderr.flush()
        warn = os.fdopen(os.dup(2), "w")  # the real stderr, for this function's own warning
        target = os.open(chatter, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.write(target, SHUTDOWN_HEADER.encode())
        os.dup2(target, 2)
        os.close(target)
    try:
        jax.distributed.shutdown()
    except Exception as e:  # noqa: BLE001 - whatever the runtime raises, the exit status stands
        print(f"jaxzero: warning: jax.distributed did not shut down cleanly: {e}", file=warn, flush=True)


def barrier(name: str, timeout_s: int) -> None:
    """Wait until every process reaches the barrier `name`, at most `timeout_s` seconds (then JAX
    raises an error naming the processes missing). Nothing for one process; starts no backend."""
    client = jax_distributed.global_state.client
    if client is not None:
        client.wait_at_barrier(f"jaxzero/{name}", timeout_s * 1000)


def index() -> int:
    """This process's id in the run (0 for one process), read from JAX's runtime without starting a
    backend (which a GPU process would otherwise start early, taking GPU memory)."""
    return jax_distributed.global_state.process_id if jax_distributed.global_state.client is not None else 0
