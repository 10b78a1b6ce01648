"""Where a run starts: its state restored from the run directory's newest good checkpoint (a resume),
or initialised from an export, Hugging Face or Orbax (`model.init_from`), or from the seed; the first step
and the batches from there."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, TextIO

import jax

from jaxzero.config import CheckpointError, TrainConfig
from jaxzero.data.types import BatchIterator, Data, DataState
from jaxzero.interop import load_by_unit
from jaxzero.state import Trainer
from jaxzero.storage import run_dir as run_dir_lib
from jaxzero.storage.checkpoint import Checkpointer, trim_host_heap
from jaxzero.storage.checkpoint_layout import unreadable_files
from jaxzero.storage.orbax_export import is_orbax_export
from jaxzero.storage.run_dir import METRICS_FILE


@dataclasses.dataclass(frozen=True)
class Start:
    """Where the loop starts: the state (in its final placement), the first step to run, the batches,
    and the checkpoint step restored (None for a fresh start)."""

    state: Any
    first: int
    batches: BatchIterator
    restored_step: int | None


def start(
    cfg: TrainConfig,
    trainer: Trainer,
    data: Data,
    ckpt: Checkpointer | None,
    console: TextIO,
    main_process: bool = True,
) -> Start:
    """Restore from `ckpt`'s newest good checkpoint when resuming (`ckpt` given), else initialise from
    the export `model.init_from` (Hugging Face or Orbax) or from `seed`. The main process (process 0) drops
    the metrics records past the restored step."""
    restored = None
    if ckpt is not None:
        check_meta = lambda meta: DataState.from_dict(meta["data_state"])  # noqa: E731 - its loader state
        restored = ckpt.restore_latest(trainer.abstract_saved_state(), trainer.layout, cfg, check_meta)
    if restored is not None:
        try:
            state = trainer.from_saved_state(restored.state)  # reads the arrays, unit by unit
        except Exception as e:  # noqa: BLE001 - Orbax and tensorstore raise many types for damaged files
            if cfg.checkpoint.verify or isinstance(e, MemoryError) or "RESOURCE_EXHAUSTED" in str(e):
                raise  # its checksums matched, or memory ran out: not its files
            raise CheckpointError(
                unreadable_files(ckpt.directory / str(restored.step), e, resuming=True)
            ) from e
        trim_host_heap()  # the restore's read buffers, freed, go back to the kernel
        batches = data.train_iter(DataState.from_dict(restored.meta["data_state"]))
        if main_process:
            run_dir_lib.truncate_metrics(Path(cfg.run_dir) / METRICS_FILE, restored.step)
        print(f"jaxzero: resumed from {ckpt.directory / str(restored.step)}", file=console)
        return Start(state, restored.step + 1, batches, restored.step)
    if cfg.model.init_from:
        # each unit read from the files as it is placed: host RAM holds one at a time
        state = trainer.init_from_params(load_by_unit(cfg.model, cfg.model.init_from))
        what = "Orbax export" if is_orbax_export(cfg.model.init_from) else "Hugging Face checkpoint"
        print(f"jaxzero: initialised from the {what} {cfg.model.init_from}", file=console)
        return Start(state, 1, data.train_iter(), None)
    return Start(trainer.init(jax.random.key(cfg.seed)), 1, data.train_iter(), None)
