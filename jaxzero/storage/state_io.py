"""A trainer's state to and from disk, for research code: save it as a run directory that
`python -m jaxzero.train` resumes, restore it into the trainer's placement.

    path = save_state(trainer, state, "runs/x", step=100, data_state=batches.state)
    state, step, data_state = restore_state(trainer, "runs/x")

Neither consumes the state; each refuses one a step has consumed (`jaxzero.state.ensure_live`). They
live apart from `jaxzero.state` (types only), which the engines import without Orbax or the run
directory. Exporting a state's weights for inference is the exporters' (`jaxzero.interop.state_export`).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from jaxzero.data.types import DataState
from jaxzero.state import Trainer, ensure_live
from jaxzero.storage import run_dir as run_dir_lib
from jaxzero.storage.checkpoint import Checkpointer
from jaxzero.storage.checkpoint_layout import (
    CHECKPOINT_DIR,
    largest_array_bytes,
    make_meta,
    saved_step,
    saved_steps,
)


def save_state(
    trainer: Trainer, state: Any, directory: str | Path, step: int, data_state: DataState | None = None
) -> Path:
    """Save `trainer`'s `state` as checkpoint `step` of the run directory `directory` (Orbax,
    blocking, checksummed), writing its `config.json` if it has none: `python -m jaxzero.train
    --run_dir=DIRECTORY` resumes from it. `data_state` is the batch iterator's position
    (`batches.state`), if any. Returns the checkpoint's directory; the state is not consumed.
    Raises ConfigError for a directory that is not a jaxzero run or holds another run's, and
    ValueError for a step saved already."""
    ensure_live(state)
    path = run_dir_lib.locate(str(directory), trainer.config.model.name)
    run = run_dir_lib.inspect_run_dir(path)
    if run.saved is not None:
        run_dir_lib.check_resume(trainer.config, run.saved, path)  # the same run, or refused
    if step in saved_steps(path):
        raise ValueError(f"{path / CHECKPOINT_DIR / str(step)} exists already: save under another step.")
    path.mkdir(parents=True, exist_ok=True)
    if run.saved is None:
        config = dataclasses.replace(run_dir_lib.resolve_paths(trainer.config), run_dir=str(path))
        run_dir_lib.write_atomic(path / run_dir_lib.CONFIG_FILE, config.to_json() + "\n")
    ckpt = Checkpointer(path, dataclasses.replace(trainer.config.checkpoint, async_save=False))
    try:
        saved = trainer.saved_state(state)
        position = {} if data_state is None else data_state.to_dict()
        ckpt.save(step, saved, make_meta(step, position, trainer.config, trainer.layout, saved))
    finally:
        ckpt.close()
    return ckpt.directory / str(step)


def restore_state(
    trainer: Trainer, directory: str | Path, step: int | None = None
) -> tuple[Any, int, DataState | None]:
    """(state, step, data_state) of checkpoint `step` (default: the newest good one) of the run
    directory `directory`, the state in `trainer`'s placement; data_state is None where none was
    saved. Raises CheckpointError if there is no such checkpoint or it holds another model."""
    path = run_dir_lib.locate(str(directory), trainer.config.model.name)  # as `save_state` names it
    saved_step(path, step, "restore")  # that there is one: None restores the newest good one
    abstract = trainer.abstract_saved_state()
    ckpt = Checkpointer(path, trainer.config.checkpoint, largest_array=largest_array_bytes(abstract))
    try:
        if step is None:
            restored = ckpt.restore_latest(abstract, trainer.layout, trainer.config)
        else:
            restored = ckpt.restore(step, abstract, trainer.layout, trainer.config)
    finally:
        ckpt.close()
    position = restored.meta.get("data_state") or None
    data_state = None if position is None else DataState.from_dict(position)
    return trainer.from_saved_state(restored.state), restored.step, data_state
