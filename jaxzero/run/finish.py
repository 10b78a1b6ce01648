"""How the loop ends a run, in words and files: the summary of a finished run (`summary.json`, which
marks it complete), the line a stopped run ends with and its exit status, a run with nothing left to
do, and a checkpointer closed on the way out of a failure."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, TextIO

from jaxzero.config import TrainConfig
from jaxzero.run.outcome import EXIT_INTERRUPTED, EXIT_PREEMPTED
from jaxzero.storage import run_dir as run_dir_lib
from jaxzero.storage.checkpoint import Checkpointer
from jaxzero.storage.checkpoint_disk import CheckpointWriteError
from jaxzero.storage.run_dir import SUMMARY_FILE


def finish(
    cfg: TrainConfig,
    last: dict[str, Any],
    ckpt: Checkpointer | None,
    wall: float,
    console: TextIO,
    *,
    truncated: int = 0,
) -> None:
    """Print the run's summary and write it to `summary.json` (which marks the run complete). `last`:
    the last metrics record; `wall`: seconds since the set-up began; `truncated`: the fine-tuning
    examples of the run's batches cut to a row, said first."""
    if truncated:
        print(
            f"jaxzero: {truncated:,} fine-tuning examples of this run's batches were longer than a row "
            f"(data.seq_len + 1 = {cfg.data.seq_len + 1} tokens) and were truncated to it",
            file=console,
        )
    checkpoint = None
    if ckpt is not None and ckpt.last_saved is not None:
        checkpoint = str(ckpt.directory / str(ckpt.last_saved))
    summary = {
        "status": "complete",
        "steps": cfg.steps,
        "loss": last.get("loss"),
        "val_loss": last.get("val_loss"),
        "wall_s": round(wall, 3),
        "checkpoint": checkpoint,
    }
    run_dir_lib.write_atomic(Path(cfg.run_dir) / SUMMARY_FILE, json.dumps(summary, indent=2) + "\n")
    losses = ", ".join(f"{k} {last[k]:.4f}" for k in ("loss", "val_loss") if last.get(k) is not None)
    print(f"jaxzero: done: step {cfg.steps} in {wall:.0f} s; {losses}", file=console)
    if checkpoint:
        run = run_dir_lib.pasteable(cfg.run_dir)  # as a shell argument: a path with a space pastes
        print(
            f"jaxzero: checkpoint {checkpoint}\n"
            f"jaxzero: train further: python -m jaxzero.train --run_dir={run} --steps=N\n"
            f"jaxzero: export: python -m jaxzero.export --run_dir={run} --out=DIR",
            file=console,
        )


def stopped_message(
    reason: str, step: int, ckpt: Checkpointer | None, cfg: TrainConfig, defaulted: bool = False
) -> str:
    """The line a stopped run ends with; for a `defaulted` (time-stamped) run_dir the argument to add,
    as the start said: rerunning the same command would start another run."""
    if ckpt is None or not cfg.checkpoint.enabled:
        return f"{reason} at step {step}; checkpoint.enabled=false, so nothing was saved."
    if defaulted:
        return (
            f"{reason}: saved a checkpoint at step {step} in {ckpt.directory}; to resume it: add "
            f"--run_dir={run_dir_lib.pasteable(cfg.run_dir)} to the command."
        )
    return (
        f"{reason}: saved a checkpoint at step {step} in {ckpt.directory}; rerun with "
        f"--run_dir={run_dir_lib.pasteable(cfg.run_dir)} to resume."
    )


def stop_exit_code(reason: str) -> int:
    """The exit status of a run stopped by `reason` (`jaxzero.run.stopping`'s "Ctrl-C" or a signal's name)."""
    return EXIT_INTERRUPTED if reason == "Ctrl-C" else EXIT_PREEMPTED


def nothing_to_do(at: int, steps: int) -> str:
    """What a run already at step `at` says when asked for `steps` <= `at`."""
    return (
        f"jaxzero: nothing to do: the run is at step {at} and steps={steps}; pass --steps=N (N > {at}) "
        "to train further."
    )


def close_quietly(ckpt: Checkpointer | None) -> None:
    """Close `ckpt` on the way out of a failure: a save that failed too is reported, not raised, so
    that the failure that stopped the run stays the one the user reads."""
    if ckpt is None:
        return
    try:
        ckpt.close()
    except CheckpointWriteError as e:
        print(f"jaxzero: also: {e}", file=sys.stderr)
