"""The run directory: the one the user names is the one used, and nothing in it is lost.

A run's identity is its directory, not a path stored inside it: a moved or copied run resumes where it
now is. A jaxzero run directory holds

    config.json        the resolved config (written atomically, once the run has validated and started)
    metrics.jsonl      one record per logged step
    summary.json       written when the run completes
    checkpoints/       Orbax checkpoints (`jaxzero.storage.checkpoint`)
    tensorboard/       the records as TensorBoard event files (`logging.tensorboard`); a resume adds a file
    profile/           JAX profiler traces (`profile.steps`)
    offload-state/     the disk tier's working files (`offload.optimizer=disk` without offload.disk_path)
    previous-attempts/ files of attempts that stopped before their first checkpoint, kept aside
    trainer.lock       while a trainer runs there: its lock, naming it (`jaxzero.storage.run_lock`)
    error.log          tracebacks of errors, and the runtime's own messages as several processes end
                       (its first line `ERROR_HEADER`: a lone error.log without it is not jaxzero's)

`inspect_run_dir` says what a directory is before anything is written: new (absent or empty), a run to
resume (it has checkpoints), a run to start over (it stopped before its first checkpoint), or refused
(a finished run without checkpoints, or a directory that is not a jaxzero run: never written into).
`hold` takes the directory for one trainer before it decides (two trainers never both start "new").
"""

from __future__ import annotations

import dataclasses
import datetime
import enum
import json
import os
import shlex
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jaxzero.config import OFFLOAD_STATE_DIR, ConfigError, TrainConfig
from jaxzero.config.keys import all_keys, config_from_dict, set_by_preset
from jaxzero.storage.checkpoint_layout import CHECKPOINT_DIR, UNREADABLE_DIR, saved_steps
from jaxzero.storage.run_lock import LOCK_FILE, RunLock, lock_run_dir

CONFIG_FILE = "config.json"
METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.json"
ERROR_FILE = "error.log"  # tracebacks of errors, and what the runtime prints as several processes shut down
ATTEMPTS_DIR = "previous-attempts"
TENSORBOARD_DIR = "tensorboard"  # TensorBoard event files of the records (`run.metrics.TensorBoardLog`)
PROFILE_DIR = "profile"  # JAX profiler traces (`jaxzero.run.profiling.StepTrace`)
PLOTS_DIR = "plots"  # `python -m jaxzero.plot`'s figures, by default
# Files and directories a run creates; a directory holding anything else is not (only) a jaxzero run.
# The disk tier's working directories (`OFFLOAD_STATE_DIR`) are the run's own: each is removed at the
# end of its run, a killed run's stays, and none may make the run look foreign.
RUN_FILES = (
    CONFIG_FILE,
    METRICS_FILE,
    SUMMARY_FILE,
    ERROR_FILE,
    ATTEMPTS_DIR,
    CHECKPOINT_DIR,
    UNREADABLE_DIR,
    TENSORBOARD_DIR,
    PROFILE_DIR,
    PLOTS_DIR,
    LOCK_FILE,
    OFFLOAD_STATE_DIR,
)
# Keys a resumed run may change: they change how it runs or reports, not what it computes.
RESUMABLE = (
    "steps",
    "run_dir",
    "determinism",  # the same arithmetic, in a fixed order
    "logging.",
    "checkpoint.",
    "offload.",
    "parallel.",  # checkpoints restore at any stage and on any device count
    "machine.",  # what the planner plans for: a run may move to another machine
    "model.moe_impl",  # how experts' rows are grouped, not what they compute: the machine's choice
    "optimizer.decay_steps",
    "data.check_tokens",
    "profile.",  # which steps are traced
)


class RunKind(enum.Enum):
    NEW = "new"  # absent or empty: a new run
    RESUME = "resume"  # a jaxzero run with checkpoints
    RESTART = "restart"  # a jaxzero run that stopped before its first checkpoint: start over


@dataclass(frozen=True)
class RunDir:
    """What a run directory holds, read before anything is written to it."""

    path: Path  # absolute
    kind: RunKind
    saved: TrainConfig | None  # the config.json of an existing run


def locate(run_dir: str, model_name: str) -> Path:
    """The absolute run directory: `run_dir` against the working directory, or a new
    `runs/<model_name>-<UTC time>` there."""
    if not run_dir:
        stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%d-%H%M%S")
        run_dir = os.path.join("runs", f"{model_name}-{stamp}")
    return Path(os.path.abspath(os.path.expanduser(run_dir)))  # normalised: no ".." left


def read_saved_config(path: Path) -> TrainConfig | None:
    """The run config in `path/config.json`, or None if there is none or it is not a jaxzero config."""
    try:
        d = json.loads((path / CONFIG_FILE).read_text())
    except (OSError, ValueError):
        return None
    sections = {k for k in TrainConfig.__dataclass_fields__}
    if not isinstance(d, dict) or not set(d) <= sections or not {"steps", "model", "offload"} <= set(d):
        return None
    try:
        return config_from_dict(d)
    except (ConfigError, TypeError, ValueError):
        return None


def inspect_run_dir(path: Path) -> RunDir:
    """What `path` is (see the module docstring). Raises ConfigError for a directory that must not or
    cannot be written into, saying why and what to do."""
    if not path.exists():
        _check_creatable(path)
        return RunDir(path, RunKind.NEW, None)
    if not path.is_dir():
        raise ConfigError(f"run_dir {str(path)!r} is a file; pass a directory (new or a jaxzero run).")
    # Hidden temporary files of `write_atomic` (a process killed mid-write) are ours too, and so are
    # the `.nfs*` names an NFS client gives a file removed while open (the lock file, as it is released).
    entries = sorted(p.name for p in path.iterdir() if not _transient(p.name))
    saved = read_saved_config(path)
    foreign = [e for e in entries if e not in RUN_FILES]
    if saved is None:
        # Without a jaxzero config.json, only what jaxzero's own stopped attempts leave is ours: an
        # empty checkpoints/, previous-attempts/, checkpoints-unreadable/, error.log, trainer.lock.
        checkpoints = path / CHECKPOINT_DIR
        ours = set(entries) <= {ATTEMPTS_DIR, UNREADABLE_DIR, ERROR_FILE, CHECKPOINT_DIR, LOCK_FILE}
        if ERROR_FILE in entries and not _our_error_log(path / ERROR_FILE):
            ours, foreign = False, [*foreign, ERROR_FILE]  # a user's own file of that name
        if ours and (not checkpoints.is_dir() or not any(checkpoints.iterdir())):
            return RunDir(path, RunKind.RESTART if (path / ERROR_FILE).exists() else RunKind.NEW, None)
        foreign = foreign or [e for e in entries if e in (CONFIG_FILE, METRICS_FILE, SUMMARY_FILE)]
    ours_saved = (
        []
        if saved is not None
        else [
            k for k in saved_steps(path) if (path / CHECKPOINT_DIR / str(k) / "meta" / "metadata").is_file()
        ]
    )
    if ours_saved:
        state = "is not a readable jaxzero config" if (path / CONFIG_FILE).exists() else "is missing"
        raise ConfigError(
            f"run_dir {str(path)!r} holds jaxzero checkpoints ({ours_saved}) but its config.json {state} "
            "(edited, damaged or removed). Each checkpoint keeps the config it was "
            'saved with, in checkpoints/<step>/meta/metadata (its "config"): write that back as '
            "config.json to resume, or pass another --run_dir."
        )
    if saved is None or foreign:
        what = f"it holds {', '.join(entries[:8])}{', ...' if len(entries) > 8 else ''}"
        raise ConfigError(
            f"run_dir {str(path)!r} is not a jaxzero run ({what}"
            + (f"; not made by jaxzero: {', '.join(foreign[:8])}" if foreign else "; no jaxzero config.json")
            + "). jaxzero writes only into a new or empty directory or one of its own runs: pass another "
            "--run_dir."
        )
    if saved_steps(path):
        return RunDir(path, RunKind.RESUME, saved)
    if (path / SUMMARY_FILE).exists():
        if (path / UNREADABLE_DIR).is_dir() and any((path / UNREADABLE_DIR).iterdir()):
            raise ConfigError(
                f"run_dir {str(path)!r} holds a finished run whose checkpoints could not be read and were "
                f"set aside to {path / UNREADABLE_DIR}: move one you trust back into checkpoints/ to "
                "resume from it, or pass a new --run_dir."
            )
        why = (
            f", whose checkpoints are gone (none in {path / CHECKPOINT_DIR}),"
            if saved.checkpoint.enabled
            else " without checkpoints (checkpoint.enabled=false),"
        )
        raise ConfigError(
            f"run_dir {str(path)!r} already holds a run, finished{why} so there is nothing to resume, "
            "and its results are not overwritten: pass a new --run_dir."
        )
    return RunDir(path, RunKind.RESTART, saved)


def _transient(name: str) -> bool:
    return name.startswith(".") and (".tmp-" in name or name.startswith(".nfs"))


def hold(path: Path, owner: bool = True) -> RunLock:
    """Hold the run directory `path` for this trainer until the lock is released (`jaxzero.storage.run_lock`:
    one trainer per directory; created if absent), once `inspect_run_dir` has found it one jaxzero may
    write into: a foreign or finished directory is refused before the lock file is written there.
    Raises ConfigError, naming the trainer that holds it, or why it cannot be written. Decide what the
    directory is with `inspect_run_dir` after this, not before: another trainer may have changed it.
    `owner=False` (the processes of a job other than process 0) holds nothing."""
    inspect_run_dir(path)
    return lock_run_dir(path, owner)


def shown(path: Path) -> str:
    """`path` as a user types it: relative to the working directory when inside it (`runs/x`)."""
    relative = os.path.relpath(path)
    return str(path) if relative.startswith("..") else relative


def pasteable(path: str | Path) -> str:
    """`shown(path)` as a shell argument: quoted where the shell would split or expand it (a space), so
    that a printed command pastes as it reads."""
    return shlex.quote(shown(Path(path)))


def _check_creatable(path: Path) -> None:
    """Raise ConfigError if `path` could not be created: a parent is a file, or the nearest existing
    one refuses a new directory (tried with an empty one, removed at once)."""
    parent = path.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise ConfigError(f"run_dir {str(path)!r} cannot be created: {str(parent)!r} is a file.")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".jaxzero-probe-", dir=parent))
    except OSError as e:
        raise ConfigError(
            f"run_dir {str(path)!r} cannot be created in {str(parent)!r}: {e.strerror}. Pass a --run_dir "
            "in a directory you can write to."
        ) from e


def resolve_paths(cfg: TrainConfig) -> TrainConfig:
    """`cfg` with its paths (`data.path`, `model.init_from`, `offload.disk_path`) absolute, resolved
    against the working directory, so that the saved config finds them from wherever the run is resumed."""
    data = cfg.data
    if data.path:
        data = dataclasses.replace(data, path=os.path.abspath(os.path.expanduser(data.path)))
    model = cfg.model
    if model.init_from:
        model = dataclasses.replace(model, init_from=os.path.abspath(os.path.expanduser(model.init_from)))
    offload = cfg.offload
    if offload.disk_path:
        offload = dataclasses.replace(
            offload, disk_path=os.path.abspath(os.path.expanduser(offload.disk_path))
        )
    return dataclasses.replace(cfg, data=data, model=model, offload=offload)


def _get(cfg: TrainConfig, key: str) -> Any:
    obj: Any = cfg
    for part in key.split("."):
        obj = getattr(obj, part)
    return obj


BATCH_KEYS = ("data.batch_size", "data.grad_accum", "data.micro_batch_size")


def check_resume(
    cfg: TrainConfig, saved: TrainConfig, path: Path, sources: Mapping[str, str] | None = None
) -> TrainConfig:
    """`cfg` for resuming the run saved as `saved` in `path`, or ConfigError naming every setting that
    would make it a different run (whatever set it: command line, preset or library call), and the
    preset that set it where `sources` (`overrides.Layered.sources`) says one did.

    A resume that changes `steps` keeps the learning-rate schedule the run started with (its length
    stays `saved.schedule_steps`) unless `optimizer.decay_steps` says otherwise."""
    cfg, saved = resolve_paths(cfg), resolve_paths(saved)  # a relative path means the same place
    # Batch sizes still to be derived for the devices (data.micro_batch_size given) are compared once
    # `resolve_batch` has run: the trainer calls this again then.
    deferred = BATCH_KEYS if cfg.data.micro_batch_size else ()
    different = [
        k
        for k in all_keys()
        if not k.startswith(RESUMABLE) and k not in deferred and _get(cfg, k) != _get(saved, k)
    ]
    if different:
        # A preset's value is named with the preset: given again on resume it applies on top of the
        # saved config, so an edited preset, not the command line, is what changed the run.
        files = {k: s for k, s in (sources or {}).items() if k in different and set_by_preset(s)}
        changes = ", ".join(
            f"{k} ({_get(saved, k)!r} -> {_get(cfg, k)!r}{f' from {files[k]}' if k in files else ''})"
            for k in different
        )
        may = ", ".join(f"{k}*" if k.endswith(".") else k for k in RESUMABLE if k != "run_dir")
        fix = "start a new --run_dir for a different run"
        for file in dict.fromkeys(files.values()):
            keys = ", ".join(k for k in files if files[k] == file)
            fix = f"drop {keys} from {file} (or resume without it), or {fix}"
        raise ConfigError(
            f"run_dir {str(path)!r} holds a checkpointed run; resuming it cannot change {changes}. Only "
            f"{may} may change; {fix}."
        )
    if cfg.optimizer.decay_steps == 0 and cfg.steps != saved.schedule_steps:  # keep the length
        optimizer = dataclasses.replace(cfg.optimizer, decay_steps=saved.schedule_steps)
        cfg = dataclasses.replace(cfg, optimizer=optimizer)
    return cfg


def config_for_run_dir(
    cfg: TrainConfig, run: RunDir, path: Path, sources: Mapping[str, str]
) -> tuple[TrainConfig, list[str]]:
    """`cfg` with its input paths absolute, in `path`, and for a resume checked against the saved run
    (`check_resume`: the keys that change what is computed stay); with the notes to print
    about what a resume changes."""
    notes = []
    cfg = resolve_paths(cfg)
    if run.kind is RunKind.RESUME:
        resumed = check_resume(cfg, run.saved, path, sources)  # the guard, whatever set the keys
        if resumed.optimizer.decay_steps != cfg.optimizer.decay_steps:
            notes.append(
                f"jaxzero: steps {run.saved.steps} -> {cfg.steps}: the learning-rate schedule keeps the "
                f"{resumed.optimizer.decay_steps} steps it started with and holds lr x min_lr_ratio after "
                "them; pass --optimizer.decay_steps=N to give it N steps instead."
            )
        elif resumed.schedule_steps != run.saved.schedule_steps:
            notes.append(
                f"jaxzero: the learning-rate schedule changes length from {run.saved.schedule_steps} to "
                f"{resumed.schedule_steps} steps (optimizer.decay_steps): the learning rate of the next "
                "steps follows the new schedule, not the old one."
            )
        cfg = resumed
    return dataclasses.replace(cfg, run_dir=str(path)), notes


def write_atomic(path: Path, text: str) -> None:
    """Write `text` to `path` through a temporary file renamed over it: readers see the old file or
    the new one, never a partial one."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


# The first line of every error log jaxzero starts: a directory holding only an error.log is a stopped
# attempt of jaxzero's only where the file says so (a user's own error.log is not moved).
ERROR_HEADER = "jaxzero: error log of this run directory's runs (tracebacks and background errors)\n"


def write_error(run_dir: Path, text: str, replace: bool = False) -> None:
    """Append `text` to `run_dir`'s error log (`replace`: the log becomes `text`), which starts with
    `ERROR_HEADER`. Raises OSError where it cannot be written."""
    path = run_dir / ERROR_FILE
    if replace:
        write_atomic(path, ERROR_HEADER + text.rstrip() + "\n")
        return
    with open(path, "a") as f:
        f.write(("" if f.tell() else ERROR_HEADER) + text.rstrip() + "\n")


def _our_error_log(path: Path) -> bool:
    try:
        with open(path) as f:
            return f.readline() == ERROR_HEADER
    except (OSError, UnicodeDecodeError):
        return False


def set_aside_attempt(path: Path) -> Path:
    """Move the files of an attempt that stopped before its first checkpoint (config.json,
    metrics.jsonl, error.log, tensorboard/, profile/; an empty checkpoints/ is removed) into
    `previous-attempts/<UTC time>/`; returns that folder."""
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%d-%H%M%S-%f")
    target = path / ATTEMPTS_DIR / stamp
    target.mkdir(parents=True)
    for name in (CONFIG_FILE, METRICS_FILE, ERROR_FILE, TENSORBOARD_DIR, PROFILE_DIR):
        if (path / name).exists():
            os.replace(path / name, target / name)
    checkpoints = path / CHECKPOINT_DIR
    if checkpoints.is_dir() and not any(checkpoints.iterdir()):
        checkpoints.rmdir()  # empty: made by the stopped attempt's checkpointer
    return target


def truncate_metrics(path: Path, last_step: int) -> None:
    """Drop records past `last_step`: the resumed run recomputes them (identically), so the file keeps
    one record per step. Rewritten atomically. A last line without its newline is a record a killed
    run was writing: dropped too. Any other line that is not a record is an error naming it (the file
    is not ours to discard)."""
    if not path.exists():
        return
    text = path.read_text()
    lines = text.split("\n")
    if lines[-1]:  # no newline at the end: cut off while written
        lines.pop()
    keep = []
    for number, line in enumerate(lines, 1):
        if not line:
            continue
        try:
            step = json.loads(line)["step"]
        except (json.JSONDecodeError, TypeError, KeyError) as e:
            raise ConfigError(
                f"{path}, line {number}, is not a metrics record ({e}): the resumed run would rewrite this "
                "file. Move it aside (the checkpoints do not need it) or repair the line."
            ) from e
        if step <= last_step:
            keep.append(line)
    write_atomic(path, "".join(ln + "\n" for ln in keep))
