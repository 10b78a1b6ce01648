"""Orbax checkpoints of the whole training state, saved from where it lives and restored to where it
belongs.

A checkpoint is one step directory under `<run_dir>/checkpoints/` holding two items:

    state  {"step", "params", "opt_state"}, and float16's "loss_scale": int32 step, float32 masters,
           optimizer state one optax state per unit (embedding, each block, head), whichever
           trainer saved it
    meta   JSON: the data iterator's position, the resolved config, the trainer's layout, the step

The compute-dtype weights of the offload engine are not saved: they are a cast of the masters and
are rebuilt on restore. Saves are asynchronous and atomic (Orbax writes into a temporary directory
and renames it when complete; a save killed half-way leaves no step directory behind). Training is
blocked only while the state is snapshotted into host memory: the arrays it keeps updating in place
(donated masters and optimizer state) must not change under the writer.

Restores always target the abstract state *with its placement* (`Trainer.abstract_saved_state`):
Orbax does not record memory kinds, and a restore without a target would put host-resident state
into accelerator memory.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from jaxzero.config import CheckpointConfig, CheckpointError, TrainConfig

CHECKPOINT_DIR = "checkpoints"


@dataclass(frozen=True)
class Restored:
    """A restored checkpoint: the saved arrays placed per the target, and its metadata."""

    step: int
    state: dict[str, Any]  # {"step", "params", "opt_state"}
    meta: dict[str, Any]  # {"data_state", "config", "layout", "step"}


def _snapshot(tree: Any, pool: ThreadPoolExecutor) -> Any:
    """Host copies of every leaf, so an asynchronous write never sees later in-place updates.

    Host-resident leaves are copied in host memory; accelerator leaves are fetched to host. Leaves
    are copied concurrently (NumPy copies release the GIL): one thread moves a fraction of the
    host's memory bandwidth.
    """

    def copy(x):
        with jax.transfer_guard_device_to_host("allow"):  # a deliberate copy for the checkpoint
            return np.array(x, copy=True)

    leaves, treedef = jax.tree.flatten(tree)
    return jax.tree.unflatten(treedef, list(pool.map(copy, leaves)))


class Checkpointer:
    """Saves and restores training state under `<run_dir>/checkpoints` with an Orbax CheckpointManager.

    Keeps the newest `keep` checkpoints, plus every `keep_every`-th step if set. `save` returns once
    the state is snapshotted; `wait` blocks until pending writes are committed.
    """

    def __init__(self, run_dir: str | Path, cfg: CheckpointConfig):
        self.directory = Path(run_dir).absolute() / CHECKPOINT_DIR
        self.cfg = cfg
        options = ocp.CheckpointManagerOptions(
            max_to_keep=cfg.keep,
            keep_period=cfg.keep_every or None,
            enable_async_checkpointing=cfg.async_save,
            create=True,
            cleanup_tmp_directories=True,  # remove what a killed save left half-written
        )
        self.manager = ocp.CheckpointManager(self.directory, options=options)
        self._pool = ThreadPoolExecutor(
            max(1, min(16, os.cpu_count() or 1)), thread_name_prefix="jaxzero-ckpt"
        )

    # -- saving --------------------------------------------------------------------------------------

    def save(self, step: int, state: dict[str, Any], meta: dict[str, Any]) -> None:
        """Save `state` ({"step", "params", "opt_state"}) and JSON `meta` as checkpoint `step`."""
        arrays = _snapshot(state, self._pool) if self.cfg.async_save else state
        self.manager.save(
            step,
            args=ocp.args.Composite(state=ocp.args.StandardSave(arrays), meta=ocp.args.JsonSave(meta)),
            force=True,
        )

    def wait(self) -> None:
        """Block until every pending save is committed to disk."""
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()
        self._pool.shutdown()

    # -- restoring -----------------------------------------------------------------------------------

    def steps(self) -> list[int]:
        """Committed checkpoint steps, oldest first (half-written saves are never listed)."""
        self.manager.reload()
        return sorted(self.manager.all_steps())

    def read_meta(self, step: int) -> dict[str, Any]:
        """The JSON metadata of checkpoint `step` (cheap: no arrays are read)."""
        return read_meta(self.directory, step)

    def restore_latest(
        self, abstract_state: dict[str, Any], layout: str, run: TrainConfig
    ) -> Restored | None:
        """The newest checkpoint that restores cleanly onto `abstract_state`, or None if there is none.

        A checkpoint that fails to restore (corrupted or partial files) is reported and skipped in
        favour of the previous one; a checkpoint whose shapes do not match is an error, not skipped.
        """
        steps = self.steps()
        unreadable: list[int] = []
        for step in reversed(steps):
            try:
                restored = self.restore(step, abstract_state, layout, run)
            except CheckpointError:
                raise
            except Exception as e:  # noqa: BLE001 - Orbax/tensorstore raise many types for bad files
                print(
                    f"jaxzero: checkpoint {self.directory / str(step)} is unreadable ({type(e).__name__}: "
                    f"{str(e)[:300]}); trying the previous one.",
                    file=sys.stderr,
                )
                unreadable.append(step)
                continue
            for bad in unreadable:  # set aside, not deleted, so the resumed run can save those steps anew
                target = self.directory.with_name(f"{CHECKPOINT_DIR}-unreadable") / str(bad)
                target.parent.mkdir(exist_ok=True)
                shutil.move(self.directory / str(bad), target)
                print(f"jaxzero: moved unreadable checkpoint {bad} to {target}", file=sys.stderr)
            self.manager.reload()
            return restored
        if steps:
            raise CheckpointError(
                f"no checkpoint in {self.directory} could be restored (steps {steps}); see the messages "
                "above."
            )
        return None

    def restore(self, step: int, abstract_state: dict[str, Any], layout: str, run: TrainConfig) -> Restored:
        """Restore checkpoint `step` onto `abstract_state` (ShapeDtypeStructs carrying shardings)."""
        meta = self.read_meta(step)
        if meta.get("layout") != layout:  # allowed: the saved optimizer state is per unit either way
            print(
                f"jaxzero: checkpoint {step} was saved by the {meta.get('layout')} trainer; resuming under "
                f"the {layout} trainer.",
                file=sys.stderr,
            )
        check_shapes(self.directory / str(step), meta, abstract_state, run)
        restored = self.manager.restore(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract_state), meta=ocp.args.JsonRestore()
            ),
        )
        return Restored(step=step, state=dict(restored["state"]), meta=dict(restored["meta"]))


def check_shapes(where: Path, meta: dict[str, Any], abstract_state: dict[str, Any], run: TrainConfig) -> None:
    """Raise CheckpointError naming the mismatch when the checkpoint's arrays do not have this run's
    shapes (a different model config), before any array is read."""
    saved = meta.get("shapes", {})
    expected = state_shapes(abstract_state)
    wrong = [k for k in expected if k in saved and tuple(saved[k]) != tuple(expected[k])]
    missing = [k for k in expected if k not in saved]
    if not wrong and not missing:
        return
    saved_model = meta.get("config", {}).get("model", {})
    fields = [
        f"model.{k}={v!r} (this run: {getattr(run.model, k)!r})"
        for k, v in saved_model.items()
        if hasattr(run.model, k) and getattr(run.model, k) != v
    ]
    arrays = [f"{k}: {tuple(saved[k])} saved, {tuple(expected[k])} expected" for k in wrong[:3]]
    arrays += [f"{k}: not in the checkpoint" for k in missing[:3]]
    raise CheckpointError(
        f"checkpoint {where} does not match this run's model ({'; '.join(arrays)}). It was saved with "
        f"{', '.join(fields) or 'another optimizer or layout'}. Resume with the config it was saved with, "
        "or start a new run_dir."
    )


def state_shapes(tree: Any) -> dict[str, list[int]]:
    """{key path: shape} of every leaf, for the metadata and the pre-restore shape check."""
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {jax.tree_util.keystr(path): list(leaf.shape) for path, leaf in flat}


def make_meta(
    step: int, data_state: dict[str, int], cfg: TrainConfig, layout: str, state: Any
) -> dict[str, Any]:
    """The JSON metadata saved with a checkpoint."""
    return {
        "step": step,
        "data_state": data_state,
        "config": cfg.to_dict(),
        "layout": layout,
        "shapes": state_shapes(state),
    }


def saved_steps(run_dir: str | Path) -> list[int]:
    """Steps of the committed checkpoints under `<run_dir>/checkpoints`, oldest first, read from the
    directory names without starting Orbax (a half-written save has no step-named directory)."""
    directory = Path(run_dir) / CHECKPOINT_DIR
    return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit()) if directory.is_dir() else []


def read_meta(directory: str | Path, step: int) -> dict[str, Any]:
    """The JSON metadata of checkpoint `step` in the checkpoints `directory` (no arrays are read)."""
    path = Path(directory) / str(step) / "meta" / "metadata"
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"checkpoint {Path(directory) / str(step)} has unreadable metadata: {e}") from e
