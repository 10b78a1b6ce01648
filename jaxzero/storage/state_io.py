"""A trainer's state to and from disk, for research code: save it as a run directory that
`python -m jaxzero.train` resumes, restore it into the trainer's placement, export its weights for
inference.

    path = save_state(trainer, state, "runs/x", step=100, data_state=batches.state)
    state, step, data_state = restore_state(trainer, "runs/x")
    export_state(trainer, state, "export/x")     # Hugging Face safetensors

None of them consumes the state; each refuses one a step has consumed (`jaxzero.state.ensure_live`).
They live apart from `jaxzero.state` (types only), which the engines import without Orbax, the run
directory or the exporters.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import jax

from jaxzero.data.types import DataState
from jaxzero.finetune.adapters import LORA_LAYOUT
from jaxzero.finetune.merged import merged_units
from jaxzero.finetune.trainable import FROZEN_LAYOUT
from jaxzero.interop import export_hf
from jaxzero.interop.peft import export_peft_adapter
from jaxzero.plan.placement import process_count
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
from jaxzero.storage.checkpoint_masters import export_orbax


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


def export_state(
    trainer: Trainer,
    state: Any,
    out_dir: str | Path,
    format: str = "hf",
    dtype: str = "bfloat16",
    overwrite: bool = False,
) -> Path:
    """Write the weights of `trainer`'s `state` for inference: `format="hf"` a transformers
    checkpoint (`config.json` + safetensors), `"orbax"` the parameters alone; `dtype` bfloat16,
    float32 or float16. `out_dir` must be new, empty or an earlier export (`jaxzero.storage.export_dir`):
    `overwrite` replaces a finished one, and anything else is refused (FileExistsError) with or
    without it. Returns `out_dir`. The state is not consumed; the float32 masters are copied to host
    RAM whole, so one process must hold them all (a run of several processes exports a checkpoint
    with `python -m jaxzero.export` instead). A LoRA trainer's state: `format="peft"` its adapter in
    PEFT's format, "hf" / "orbax" the base (as trained) with the adapter merged in."""
    ensure_live(state)
    lora = trainer.layout == LORA_LAYOUT
    partial = lora or trainer.layout == FROZEN_LAYOUT
    if format not in ("hf", "orbax", "peft") or (format == "peft" and not lora):
        formats = "'peft' (the adapter), 'hf', 'orbax' (the merged model)" if lora else "'hf', 'orbax'"
        raise ValueError(f"format={format!r} is not one of {formats}.")
    if process_count(trainer.mesh) > 1:
        raise ValueError(
            "export runs in one process: each of this run's processes holds only part of the weights. "
            "Save a checkpoint (save_state) and export it from one process: python -m jaxzero.export "
            "--run_dir=DIR --out=OUT."
        )
    if partial:  # LoRA's adapters in PEFT's format, or what trained with the base as it was trained
        cfg = trainer.config
        trained = jax.device_get(state.params)  # what trained: the adapters, or the unfrozen units
        if format == "peft":
            base = cfg.model.init_from or None
            return export_peft_adapter(trained, cfg.model, cfg.finetune, out_dir, base, overwrite=overwrite)
        by_position = trained.units()
        masters = merged_units(cfg, lambda k: by_position[k])
    else:
        masters = jax.device_get(state.params)  # float32, one host copy
    if format == "hf":
        export_hf(masters, trainer.config.model, out_dir, dtype=dtype, overwrite=overwrite)
    else:
        export_orbax(masters, out_dir, dtype, overwrite=overwrite)
    return Path(out_dir)
