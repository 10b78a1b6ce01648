"""A checkpoint read outside training, and weights written for inference as Orbax: a checkpoint's
float32 masters one unit at a time (`load_masters`, `masters_by_unit`: for export, generation and
fine-tuning from a run), every array of it for inspection (`read_saved_state`), and parameters cast
and saved as an Orbax export with its model's description (`export_orbax`; the format is
`jaxzero.storage.orbax_export`). A training process restores through
`jaxzero.storage.checkpoint.Checkpointer` instead.

Each reader first checks the checkpoint's files against their checksums, as a resume does (`verify`,
the programs' `--checkpoint.verify`): all of them, since a unit's masters share their files with its
optimizer state.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from jaxzero.config import CheckpointError, ModelConfig, TrainConfig
from jaxzero.config.keys import config_from_dict
from jaxzero.finetune.adapters import LORA_LAYOUT
from jaxzero.finetune.merged import merged_units
from jaxzero.finetune.provenance import check_base
from jaxzero.finetune.trainable import FROZEN_LAYOUT, trainable_shapes
from jaxzero.models import ModelParams, build_model
from jaxzero.primitives.deferred import Deferred, resolved
from jaxzero.storage import export_dir
from jaxzero.storage.checkpoint_disk import changed_files
from jaxzero.storage.checkpoint_layout import (
    PYTREE_METADATA,
    SCALARS,
    checkpoints_dir,
    join_parts,
    part_names,
    read_meta,
    saved_step,
    saved_steps,
    unreadable_files,
)
from jaxzero.storage.orbax_export import MODEL_FILE, write_model_file

ORBAX_STAGE = ".orbax-export"  # where an Orbax export is written, inside its directory, before moving up


def export_orbax(
    params: ModelParams,
    model: ModelConfig,
    out: str | Path,
    dtype: str,
    *,
    overwrite: bool = False,
    source: dict[str, Any] | None = None,
) -> Path:
    """Save `params` (of the model `model` describes) cast to `dtype` as an Orbax checkpoint at `out`,
    casting one unit at a time, with `model.json` beside it (`jaxzero.storage.orbax_export`).
    `out` must be new, empty or an earlier jaxzero export (`jaxzero.storage.export_dir`: `overwrite` replaces
    a finished one; anything else is refused with or without it). Orbax writes into a directory of
    its own inside `out`, where `model.json` joins them, whose entries then move up into `out`, beside the
    export's marker; `source`
    (e.g. run_dir and step) is recorded in the marker."""
    out = Path(out).absolute()
    np_dtype = np.dtype(jax.numpy.dtype(dtype))
    cast = lambda tree: jax.tree.map(lambda x: np.asarray(x).astype(np_dtype), tree)  # noqa: E731
    with export_dir.writing(
        out, format="orbax", dtype=dtype, files=[ORBAX_STAGE], overwrite=overwrite, source=source
    ) as export:  # refuses a directory holding anything but an earlier export, before writing
        blocks = list(params.blocks)
        for i in range(len(blocks)):  # replace each float32 block as it is cast (read now if deferred)
            blocks[i] = cast(resolved(blocks[i]))
        tree = ModelParams(cast(resolved(params.embed)), tuple(blocks), cast(resolved(params.head)))
        checkpointer = ocp.StandardCheckpointer()
        checkpointer.save(out / ORBAX_STAGE, tree)
        checkpointer.wait_until_finished()  # host sync: committed before the process exits
        checkpointer.close()
        write_model_file(out / ORBAX_STAGE, model, dtype)
        entries = sorted(p.name for p in (out / ORBAX_STAGE).iterdir())
        clash = [e for e in entries if (out / e).exists() or (out / e).is_symlink()]
        if clash:  # files put beside an earlier export by hand are never replaced
            raise export_dir.ExportRefused(
                f"{out} holds {clash}, which the export did not write and Orbax's checkpoint needs: remove "
                "them yourself, or choose a new directory (--out)."
            )
        # model.json last: where it is, the parameters it describes are
        for e in sorted(entries, key=lambda e: e == MODEL_FILE):
            os.replace(out / ORBAX_STAGE / e, out / e)
        (out / ORBAX_STAGE).rmdir()
        export.finish(entries)
    return out


def load_masters(
    run_dir: str | Path, step: int | None = None, *, verify: bool = True
) -> tuple[TrainConfig, ModelParams, int]:
    """(config, float32 NumPy masters, step) of the newest (or given) checkpoint of `run_dir`, read
    one unit at a time (the optimizer state is not read), its files checked against their checksums
    first unless not `verify` (CheckpointError naming those that changed)."""
    cfg, params, step = masters_by_unit(run_dir, step, verify=verify)
    return cfg, resolved(params), step


def masters_by_unit(
    run_dir: str | Path, step: int | None = None, *, verify: bool = True, base_as_given: bool = False
) -> tuple[TrainConfig, ModelParams, int]:
    """As `load_masters`, but each unit a `Deferred`, read (as float32 NumPy) when resolved: an export
    holds one unit in host RAM at a time; the checksums are checked now, before any unit is read. A
    checkpoint of the earlier one-PyTree layout is read whole. A run with a frozen base: the base
    rebuilt as trained, or with `base_as_given` as `model.init_from` gives it (`merged_units`)."""
    ckpt_dir, step, meta = _checkpoint(run_dir, step)
    if verify:
        _verify(ckpt_dir, step)
    cfg = config_from_dict(meta["config"])
    shapes = jax.eval_shape(build_model(cfg.model).init, jax.random.key(0))
    state_dir = ckpt_dir / str(step) / "state"
    if (state_dir / PYTREE_METADATA).exists():  # the earlier layout: one PyTree
        return cfg, _read_numpy(state_dir, {"params": shapes})["params"], step
    names = part_names(len(shapes.blocks))
    if meta.get("layout") in (LORA_LAYOUT, FROZEN_LAYOUT):  # what trained saved; the base rebuilt
        check_base(meta, f"checkpoint {ckpt_dir / str(step)}")
        units = merged_units(cfg, _trainable_reader(state_dir, cfg), base_as_given=base_as_given)
        return cfg, units, step
    units = shapes.units()

    def unit(name: str, u: Any) -> Deferred:
        return Deferred(lambda: (_read_numpy(state_dir / name, {"params": u})["params"],), 0, u)

    read = [unit(name, u) for name, u in zip(names, units)]
    return cfg, ModelParams.from_units(read), step


def saved_adapters(
    run_dir: str | Path, step: int | None = None, *, verify: bool = True
) -> tuple[TrainConfig, ModelParams, int] | None:
    """(config, float32 NumPy adapters, step) of a LoRA run's newest (or given) checkpoint
    (`jaxzero.finetune.adapters`' layout), its files checked against their checksums first unless not
    `verify`; None where the run trained whole units (nothing but its metadata read)."""
    ckpt_dir, step, meta = _checkpoint(run_dir, step)
    if meta.get("layout") != LORA_LAYOUT:
        return None
    check_base(meta, f"checkpoint {ckpt_dir / str(step)}")
    if verify:
        _verify(ckpt_dir, step)
    cfg = config_from_dict(meta["config"])
    read = _trainable_reader(ckpt_dir / str(step) / "state", cfg)
    return cfg, ModelParams({}, tuple(read(1 + i) for i in range(cfg.model.num_layers)), {}), step


def _trainable_reader(state_dir: Path, cfg: TrainConfig) -> Callable[[int], Any]:
    """A function reading what trained of the unit at position k (embedding 0, block i at 1 + i, head
    L + 1) from checkpoint `state_dir` of a run with a frozen part (float32 NumPy; `{}` for a unit
    with nothing that trains)."""
    t = trainable_shapes(build_model(cfg.model), cfg.finetune)
    shapes = t.units()
    names = part_names(len(t.blocks))

    def read(k: int) -> Any:
        return _read_numpy(state_dir / names[k], {"params": shapes[k]})["params"] if shapes[k] else {}

    return read


def verify_checkpoint(run_dir: str | Path, step: int | None = None) -> int:
    """Check the files of the newest (or given) checkpoint of `run_dir` against their checksums, as the
    readers here do with `verify=True` (for a program that then reads it otherwise, e.g. restores a
    LoRA run's state); CheckpointError naming those that changed, before JAX starts. Returns the step."""
    ckpt_dir = checkpoints_dir(run_dir)
    step = saved_step(run_dir, step, "read")
    _verify(ckpt_dir, step)
    return step


def _verify(ckpt_dir: Path, step: int) -> None:
    """Raise CheckpointError, naming the files and how to go on, if a file of checkpoint `step`
    changed since it was saved. Every file is summed, as a resume sums them: a unit's masters share
    their files with its optimizer state. Called before any array is read or anything is written."""
    step_dir = ckpt_dir / str(step)
    workers = max(1, min(16, os.cpu_count() or 1))
    with ThreadPoolExecutor(workers, thread_name_prefix="jaxzero-verify") as pool:
        bad = changed_files(step_dir, pool)
    if bad:
        others = [s for s in saved_steps(ckpt_dir.parent) if s != step]
        raise CheckpointError(
            f"checkpoint {step_dir} could not be read as saved: the bytes of {len(bad)} of its files "
            f"changed since it was saved (checksum mismatch or missing): {', '.join(bad[:4])}. Name "
            f"another with --step=N (this run has {others or 'no other'}), or read it unchecked with "
            "--checkpoint.verify=false."
        )


def _checkpoint(run_dir: str | Path, step: int | None) -> tuple[Path, int, dict[str, Any]]:
    """(the absolute checkpoints directory (Orbax wants absolute paths), the step, its meta) of the
    newest (or given) checkpoint of `run_dir`; CheckpointError where there is none such."""
    ckpt_dir = checkpoints_dir(run_dir)
    step = saved_step(run_dir, step, "read")
    return ckpt_dir, step, read_meta(ckpt_dir, step)


def _read_numpy(path: Path, shapes: Any) -> Any:
    """The arrays of the Orbax PyTree checkpoint at `path` that `shapes` names (a subtree of what it
    holds, e.g. {"params": ...}), as NumPy arrays in the structure of `shapes`."""
    item = jax.tree.map(lambda s: np.zeros((), s.dtype), shapes)
    restore_args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), shapes)
    try:
        restored = ocp.PyTreeCheckpointer().restore(
            path, args=ocp.args.PyTreeRestore(item=item, restore_args=restore_args, partial_restore=True)
        )
    except Exception as e:  # noqa: BLE001 - Orbax and tensorstore raise many types for damaged files
        raise CheckpointError(unreadable_files(path, e)) from e
    return jax.tree.unflatten(jax.tree.structure(shapes), jax.tree.leaves(restored))


def read_saved_state(step_dir: str | Path) -> dict[str, Any]:
    """Every array of checkpoint `step_dir` (`<run_dir>/checkpoints/<step>`) as NumPy, whole, in the
    saved state's layout ({"step", "params", "opt_state"}, params and opt_state as `ModelParams`): for
    inspection and tests; a training process restores through `Checkpointer` instead."""
    state_dir = Path(step_dir).absolute() / "state"
    if (state_dir / PYTREE_METADATA).exists():
        return dict(ocp.PyTreeCheckpointer().restore(state_dir))
    names = [SCALARS, *part_names(len(list(state_dir.glob("block_*"))))]
    return join_parts([ocp.PyTreeCheckpointer().restore(state_dir / name) for name in names])
