"""`python -m jaxzero.launch --nproc=N [options] [--] TRAIN_ARGS...`: train with N processes on this
machine, as `torchrun --nproc-per-node=N` does.

Starts N processes of `python -m jaxzero.train TRAIN_ARGS`, joined through JAX's distributed runtime
(`jaxzero.run.distributed`): each gets JAX_COORDINATOR_ADDRESS (a free port on 127.0.0.1),
JAX_NUM_PROCESSES=N and JAX_PROCESS_ID=its rank. They train one model on one global batch; a
process's rank decides which rows of every batch it reads.

Options (before TRAIN_ARGS; `--` ends them):
  --nproc=N                 processes to start (required).
  --cpu_devices_per_proc=K  train on K CPU devices per process (JAX_PLATFORMS=cpu and XLA's
                            --xla_force_host_platform_device_count=K): several processes without GPUs.
  --log_dir=DIR             also write each rank's output to DIR/rank<r>.log.
  --grace_s=S               seconds the others get to stop after one fails before they are killed
                            (default 10: after a failure the others cannot checkpoint).
  --script=PATH             run `python PATH TRAIN_ARGS` instead of `python -m jaxzero.train`.
  --bind_cores=true|false   give each process its own equal share of the launcher's CPU cores
                            (default true, Linux): each process's host update then runs a thread
                            per core of its share but one, not one per core of the machine each.

GPUs. With G GPUs visible (CUDA_VISIBLE_DEVICES, else `nvidia-smi -L`), process i sees GPUs
[i*G/N, (i+1)*G/N) through its own CUDA_VISIBLE_DEVICES; N must divide G. Without visible GPUs (or
with JAX_PLATFORMS=cpu) the processes see the CPU backend.

Output. Every line of every process is printed with its rank in front (`[1] ...`), stdout to stdout,
stderr to stderr, so a warning or an error says which process it came from. The trainer prints its
progress and metrics from process 0 only, so they appear once.

Failures. When a process exits with an error or is killed, the launcher stops the others (SIGTERM,
then SIGKILL after --grace_s seconds) and exits non-zero, naming the rank and how it ended: the failed
process's exit status, or 128 + the signal number that killed it.

Signals. SIGTERM, SIGHUP (a closed terminal) or Ctrl-C to the launcher is passed on as SIGTERM to every
process: they stop at the same step with a checkpoint, and the launcher waits for them and exits with 3
(SIGTERM, SIGHUP) or 130 (Ctrl-C). A second signal kills them at once. The processes run in their own sessions
(a terminal's Ctrl-C reaches only the launcher) and, on Linux, are killed if the launcher itself is.
"""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import IO, TextIO

from jaxzero.run.console import detach_hung_up_terminal
from jaxzero.run.distributed import COORDINATOR, NUM_PROCESSES, PROCESS_ID

EXIT_USAGE = 2
# jaxzero.train's exit statuses, named in the launcher's messages.
MEANINGS = {1: "training failed", 2: "config error", 3: "preempted", 130: "interrupted"}
PREEMPTED, INTERRUPTED = 3, 130
_POLL_S = 0.1  # how often the launcher looks at its processes
_PR_SET_PDEATHSIG = 1  # prctl(2): the signal a child gets when its parent dies


# Gloo (the CPU backend's cross-process collectives) prints this to stdout from C++ for every rank
# as the first collective connects, where no setting reaches it: passed on only when a peer is missing.
# It writes the line in pieces from one thread per rank, so two ranks' pieces can share a line.
_GLOO_PIECES = re.compile(
    r"\[Gloo\] Rank \d+|is connected to (\d+)|peer ranks\. Expected number of "
    r"connected peer ranks is : (\d+)|\s+"
)


def _says_nothing(line: str) -> bool:
    """Whether `line` is third-party output that tells a user nothing: pieces of Gloo's "connected"
    lines, interleaved or not, in which every rank has as many peers as it expects."""
    if "[Gloo]" not in line and "is connected to" not in line:
        return False
    pieces = list(_GLOO_PIECES.finditer(line))
    if sum(m.end() - m.start() for m in pieces) != len(line):
        return False  # something besides Gloo's pieces
    connected = [m.group(1) for m in pieces if m.group(1) is not None]
    expected = [m.group(2) for m in pieces if m.group(2) is not None]
    return bool(connected) and len(set(connected + expected)) == 1 and len(connected) == len(expected)


class UsageError(ValueError):
    """The launcher's command line or the machine does not allow the launch; the message says why."""


@dataclass(frozen=True)
class LaunchArgs:
    """The launcher's command line, parsed."""

    nproc: int
    cpu_devices_per_proc: int = 0  # 0: not a CPU run with fake devices
    log_dir: str = ""
    grace_s: float = 10.0
    script: str = ""  # "": python -m jaxzero.train
    bind_cores: bool = True
    args: list[str] = field(default_factory=list)  # for the program


def parse_args(argv: Sequence[str]) -> LaunchArgs:
    """The launcher's options up to `--` or the first argument that is not one of them, and the
    program's arguments after. Raises UsageError."""
    options: dict[str, str] = {}
    names = {"nproc", "cpu_devices_per_proc", "log_dir", "grace_s", "script", "bind_cores"}
    rest = list(argv)
    while rest:
        arg = rest[0]
        if arg == "--":
            rest.pop(0)
            break
        match = re.fullmatch(r"--([a-z_]+)(?:=(.*))?", arg)
        if match is None or match.group(1) not in names:
            break
        rest.pop(0)
        value = match.group(2)
        if value is None:  # --name VALUE
            if not rest:
                raise UsageError(f"{arg} needs a value: {arg}=VALUE.")
            value = rest.pop(0)
        options[match.group(1)] = value
    if "nproc" not in options:
        raise UsageError("--nproc=N is required: how many processes to start on this machine.")

    def number(name: str, kind: Callable[[str], float], low: float, default: float) -> float:
        if name not in options:
            return default
        try:
            value = kind(options[name])
        except ValueError:
            raise UsageError(f"--{name}={options[name]!r} must be a number.") from None
        if value < low:
            raise UsageError(f"--{name}={options[name]} must be >= {low:g}.")
        return value

    bind = options.get("bind_cores", "true").lower()
    if bind not in ("true", "false"):
        raise UsageError(f"--bind_cores={options['bind_cores']!r} must be true or false.")
    return LaunchArgs(
        bind_cores=bind == "true",
        nproc=int(number("nproc", int, 1, 0)),
        cpu_devices_per_proc=int(number("cpu_devices_per_proc", int, 1, 0)),
        log_dir=options.get("log_dir", ""),
        grace_s=number("grace_s", float, 0, 10.0),
        script=options.get("script", ""),
        args=rest,
    )


# -- GPUs and environments -------------------------------------------------------------------------


def visible_gpus(environ: Mapping[str, str], nvidia_smi: Callable[[], str | None] | None = None) -> list[str]:
    """The GPUs this machine lets its processes see, without starting JAX: the entries of
    CUDA_VISIBLE_DEVICES when set, else one per line of `nvidia-smi -L`, else none."""
    if "CUDA_VISIBLE_DEVICES" in environ:
        return [d.strip() for d in environ["CUDA_VISIBLE_DEVICES"].split(",") if d.strip()]
    listing = (nvidia_smi or _nvidia_smi)()
    count = sum(1 for line in (listing or "").splitlines() if line.startswith("GPU "))
    return [str(i) for i in range(count)]


def _nvidia_smi() -> str | None:
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        return subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return None


def split_gpus(gpus: Sequence[str], nproc: int) -> list[str]:
    """CUDA_VISIBLE_DEVICES of each of `nproc` processes: process i gets GPUs [i*G/N, (i+1)*G/N).
    Raises UsageError when `nproc` does not divide the G GPUs."""
    if len(gpus) % nproc:
        fits = [n for n in range(1, len(gpus) + 1) if len(gpus) % n == 0]
        raise UsageError(
            f"--nproc={nproc} processes cannot share {len(gpus)} visible GPU(s) ({','.join(gpus)}) evenly: "
            f"use --nproc={' or '.join(map(str, fits))}, or set CUDA_VISIBLE_DEVICES to a multiple of "
            f"{nproc} GPUs."
        )
    per = len(gpus) // nproc
    return [",".join(gpus[i * per : (i + 1) * per]) for i in range(nproc)]


def child_env(
    base: Mapping[str, str], rank: int, nproc: int, port: int, gpus: str | None, cpu_devices: int
) -> dict[str, str]:
    """The environment of process `rank`: `base` with JAX's process variables, its GPUs (`gpus`, a
    CUDA_VISIBLE_DEVICES value, or None to leave them), and, for `cpu_devices` > 0, a CPU run with that
    many devices."""
    env = dict(base)
    env.update(
        {
            COORDINATOR: f"127.0.0.1:{port}",
            NUM_PROCESSES: str(nproc),
            PROCESS_ID: str(rank),
            "PYTHONUNBUFFERED": "1",  # lines arrive as they are printed
        }
    )
    env.setdefault("JAX_COORDINATOR_BIND_ADDRESS", f"127.0.0.1:{port}")  # local processes: loopback only
    if gpus is not None:
        env["CUDA_VISIBLE_DEVICES"] = gpus
    if cpu_devices:
        flags = re.sub(r"--xla_force_host_platform_device_count=\S*", "", env.get("XLA_FLAGS", ""))
        env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={cpu_devices}".strip()
        env["JAX_PLATFORMS"] = "cpu"
    return env


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the coordinator binds it a moment later)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def describe_exit(code: int) -> str:
    """How a process ended, from its Popen return code."""
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    meaning = f" ({MEANINGS[code]})" if code in MEANINGS else ""
    return f"exited with status {code}{meaning}"


def exit_status(code: int) -> int:
    """The shell's status for a Popen return code: 128 + N for a process killed by signal N."""
    return 128 - code if code < 0 else code


# -- the processes ----------------------------------------------------------------------------------


def split_cores(cores: Sequence[int], nproc: int) -> list[list[int]]:
    """Each process's share of `cores`: `nproc` equal contiguous groups (a remainder stays unused),
    or no binding at all (empty groups) when there are fewer cores than processes."""
    cores = sorted(cores)
    per = len(cores) // nproc
    if per == 0:
        return [[] for _ in range(nproc)]
    return [cores[i * per : (i + 1) * per] for i in range(nproc)]


def _prepare_child(cores: Sequence[int]) -> None:
    """In the child, before exec: get SIGKILL when the launcher dies (Linux), so that no process of a
    killed launcher keeps its GPUs; run on `cores` only (none: every core). Host-update threads of
    several processes each on every core oversubscribe the machine and slow every process's step
    (BENCHMARKS.md, "Two GPUs: ZeRO-3 offload over a mesh")."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass
    if cores:
        os.sched_setaffinity(0, cores)


@dataclass
class Rank:
    """One started process and the threads copying its output."""

    rank: int
    process: subprocess.Popen[bytes]
    pumps: list[threading.Thread]
    code: int | None = None  # its return code once it ended
    asked_to_stop: bool = False  # the launcher sent it SIGTERM or SIGKILL


class Launcher:
    """Starts the processes, copies their output, watches them, and stops them (see the module
    docstring for the rules)."""

    def __init__(self, args: LaunchArgs, environ: Mapping[str, str], out: TextIO, err: TextIO):
        self.args, self.environ, self.out, self.err = args, environ, out, err
        self.ranks: list[Rank] = []
        self.lock = threading.Lock()  # one line at a time on each stream
        self.signals: list[int] = []  # SIGTERM / SIGINT received by the launcher, in order
        self.failure: Rank | None = None  # the first process that failed on its own
        self.kill_at: float | None = None  # when the others get SIGKILL after a failure

    def command(self) -> list[str]:
        program = [self.args.script] if self.args.script else ["-m", "jaxzero.train"]
        return [sys.executable, *program, *self.args.args]

    def start(self) -> None:
        a = self.args
        cpu = a.cpu_devices_per_proc > 0 or self.environ.get("JAX_PLATFORMS", "").strip() == "cpu"
        gpus = visible_gpus(self.environ) if not cpu else []
        groups: list[str | None] = list(split_gpus(gpus, a.nproc)) if gpus else [None] * a.nproc
        port = free_port()
        logs = Path(a.log_dir) if a.log_dir else None
        if logs is not None:
            logs.mkdir(parents=True, exist_ok=True)
        where = f"GPUs {' | '.join(g or '' for g in groups)}" if gpus else "no GPUs split"
        self.note(f"{a.nproc} processes, coordinator 127.0.0.1:{port}, {where}: {' '.join(self.command())}")
        linux = sys.platform.startswith("linux")
        cores = split_cores(os.sched_getaffinity(0), a.nproc) if linux and a.bind_cores else [[]] * a.nproc
        if any(cores):
            self.note(
                f"each process runs on its own {len(cores[0])} cores (process 0 on {cores[0][0]}-"
                f"{cores[0][-1]}; --bind_cores=false: every process on every core)"
            )
        started = []
        for rank in range(a.nproc):  # every process before any thread: preexec_fn runs before exec
            env = child_env(self.environ, rank, a.nproc, port, groups[rank], a.cpu_devices_per_proc)
            process = subprocess.Popen(
                self.command(),
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,  # a terminal's Ctrl-C reaches the launcher, which passes it on
                preexec_fn=partial(_prepare_child, cores[rank]) if linux else None,
            )
            started.append(process)
        for rank, process in enumerate(started):
            log = open(logs / f"rank{rank}.log", "ab", buffering=0) if logs is not None else None
            assert process.stdout is not None and process.stderr is not None
            pumps = [
                threading.Thread(target=self._pump, args=(rank, process.stdout, self.out, log), daemon=True),
                threading.Thread(target=self._pump, args=(rank, process.stderr, self.err, log), daemon=True),
            ]
            for t in pumps:
                t.start()
            self.ranks.append(Rank(rank, process, pumps))

    def note(self, text: str) -> None:
        with self.lock:
            print(f"jaxzero.launch: {text}", file=self.err, flush=True)

    def _pump(self, rank: int, source: IO[bytes], sink: TextIO, log: IO[bytes] | None) -> None:
        """Copy `source` to `sink` line by line, each line with the rank in front (and to `log`)."""
        for raw in iter(source.readline, b""):
            line = raw.decode(errors="replace").rstrip("\n")
            with self.lock:
                if not _says_nothing(line):  # still in the rank's log
                    sink.write(f"[{rank}] {line}\n")
                    sink.flush()
                if log is not None:
                    log.write(raw if raw.endswith(b"\n") else raw + b"\n")
        source.close()

    def on_signal(self, signum: int, frame: object) -> None:
        if signum == signal.SIGHUP:  # the terminal is gone: writes to it would fail (EIO)
            detach_hung_up_terminal()
        self.signals.append(signum)

    def running(self) -> list[Rank]:
        return [r for r in self.ranks if r.code is None]

    def _send(self, sig: signal.Signals) -> None:
        """`sig` to every running process's session: the process and anything it started."""
        for r in self.running():
            r.asked_to_stop = True
            try:
                os.killpg(r.process.pid, sig)
            except ProcessLookupError:
                pass

    def _ended_as_asked(self, r: Rank, code: int) -> bool:
        """Whether `code` is what a process the launcher stopped returns: a checkpoint and exit
        (jaxzero's preempted or interrupted status), or the launcher's own SIGTERM or SIGKILL."""
        return r.asked_to_stop and code in (PREEMPTED, INTERRUPTED, -signal.SIGTERM, -signal.SIGKILL)

    def watch(self) -> int:
        """Wait for every process, acting on failures and signals; returns the launcher's status."""
        handled = 0
        while self.running():
            for signum in self.signals[handled:]:  # pass the first on; kill at the second
                name = signal.Signals(signum).name
                if handled == 0:
                    self.note(
                        f"{name}: asking the {len(self.running())} running processes to stop at the next "
                        f"step with a checkpoint ({name} again: kill them at once)"
                    )
                    self._send(signal.SIGTERM)
                else:
                    self.note(f"{name} again: killing the processes")
                    self._send(signal.SIGKILL)
                handled += 1
            for r in self.running():
                code = r.process.poll()
                if code is None:
                    continue
                r.code = code
                if code == 0 or self.failure is not None or self._ended_as_asked(r, code):
                    continue
                self.failure = r  # the first process to fail on its own: stop the others
                if self.running():
                    self.note(
                        f"rank {r.rank} (pid {r.process.pid}) {describe_exit(code)}; stopping the other "
                        f"{len(self.running())} (SIGTERM, then SIGKILL after {self.args.grace_s:g} s)"
                    )
                    self._send(signal.SIGTERM)
                    self.kill_at = time.monotonic() + self.args.grace_s
            if self.kill_at is not None and time.monotonic() >= self.kill_at:
                self._send(signal.SIGKILL)
                self.kill_at = None
            time.sleep(_POLL_S)
        for r in self.ranks:
            for t in r.pumps:
                t.join(timeout=5)  # a grandchild may hold the pipe open; the process itself is gone
        return self._outcome()

    def _outcome(self) -> int:
        def ended(r: Rank) -> str:
            return f"rank {r.rank} {describe_exit(r.code if r.code is not None else 0)}"

        if self.failure is not None:
            f = self.failure
            # The others: stopped by the launcher, or ended on their own meanwhile.
            others = [
                ended(r) + (" when stopped" if r.asked_to_stop else "") for r in self.ranks if r is not f
            ]
            self.note(f"failed: {ended(f)}" + (f"; then {', '.join(others)}" if others else ""))
            return exit_status(f.code if f.code is not None else 1)
        if self.signals and any(r.code != 0 for r in self.ranks):
            self.note("stopped: " + ", ".join(ended(r) for r in self.ranks))
            return INTERRUPTED if self.signals[0] == signal.SIGINT else PREEMPTED
        return 0  # every process succeeded (also when the run ended before a stop took effect)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] in (["-h"], ["--help"]):
        print(__doc__)
        return 0
    try:
        args = parse_args(argv)
        launcher = Launcher(args, os.environ, sys.stdout, sys.stderr)
        stops = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)
        previous = {s: signal.signal(s, launcher.on_signal) for s in stops}
        try:
            launcher.start()
            return launcher.watch()
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
    except UsageError as e:
        print(f"jaxzero.launch: {e} (python -m jaxzero.launch --help)", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
