"""What a checkpoint is on disk, readable without starting Orbax: its directories, the parts its state
is written in, its metadata, and the sizes and shapes of a saved state.

A checkpoint is one step directory under `<run_dir>/checkpoints/` holding two items:

    state  one ordinary Orbax PyTree checkpoint per part, in the order they are written:
             state/scalars      {"step"} (int32), and float16's {"loss_scale"}
             state/embed        {"params": float32 masters, "opt_state": the unit's optax state}
             state/block_0000   the same for each block, ...
             state/head         the same for the head
           (`ocp.PyTreeCheckpointer().restore(<step>/state/block_0003)` reads one back as NumPy)
    meta   JSON: the data iterator's position, the resolved config, the trainer's layout, the step

beside `checksums.json` (`jaxzero.storage.checkpoint_disk`). Checkpoints of the earlier layout hold the whole
state as one PyTree under `state/`. The compute-dtype weights of the offload engine are not saved: they
are a cast of the masters and are rebuilt on restore. `jaxzero.storage.checkpoint_handler` writes and reads
the parts, `jaxzero.storage.checkpoint` runs saves and restores.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

import jax
import numpy as np

from jaxzero.config import CheckpointError, TrainConfig
from jaxzero.finetune.provenance import base_record
from jaxzero.models import ModelParams
from jaxzero.primitives.deferred import abstract, is_deferred, pair

CHECKPOINT_DIR = "checkpoints"
UNREADABLE_DIR = f"{CHECKPOINT_DIR}-unreadable"  # checkpoints that failed to restore, set aside
PYTREE_METADATA = "_METADATA"  # in every directory Orbax's PyTree handler writes
SCALARS = "scalars"  # the part of the state that is not per unit: the step count, float16's loss scale


class Part(NamedTuple):
    """One part of a checkpoint's state, written (and read) as one Orbax PyTree checkpoint.

    name:     its directory under `state/` (`SCALARS`, "embed", "block_0000", ..., "head").
    position: the unit's position in the forward order (embedding 0, block i at 1 + i, head last),
              the key of `WriteFence`; None for the scalars.
    tree:     its arrays ({"params", "opt_state"} of a unit), or ShapeDtypeStructs to restore onto.
    """

    name: str
    position: int | None
    tree: Any


def part_names(num_blocks: int) -> list[str]:
    """The units' part names in forward order: "embed", "block_0000", ..., "head"."""
    return ["embed", *(f"block_{i:04d}" for i in range(num_blocks)), "head"]


def state_parts(state: dict[str, Any]) -> list[Part]:
    """A saved state ({"step", "params", "opt_state"} and float16's "loss_scale"; params and
    opt_state in `ModelParams` layout) as its parts, in the order a save writes them: the scalars,
    then each unit in forward order."""
    params, opt_state = state["params"], state["opt_state"]
    scalars = {k: v for k, v in state.items() if k not in ("params", "opt_state")}
    units = [
        (params.embed, opt_state.embed),
        *zip(params.blocks, opt_state.blocks),
        (params.head, opt_state.head),
    ]
    names = part_names(len(params.blocks))

    def unit(p: Any, o: Any) -> Any:  # a disk unit's halves are read together, when it is written
        both = pair(p, o, ("params", "opt_state")) if is_deferred(p) and is_deferred(o) else None
        return both if both is not None else {"params": p, "opt_state": o}

    return [Part(SCALARS, None, scalars)] + [
        Part(name, i, unit(p, o)) for i, (name, (p, o)) in enumerate(zip(names, units))
    ]


def join_parts(trees: Sequence[Any]) -> dict[str, Any]:
    """The saved state of its parts' trees, in `state_parts`' order (inverse of `state_parts`)."""
    scalars, *units = trees
    unit = lambda key: [u[key] for u in units]  # noqa: E731
    params, opt_state = ModelParams.from_units(unit("params")), ModelParams.from_units(unit("opt_state"))
    return {**scalars, "params": params, "opt_state": opt_state}


def _leaf_bytes(tree: Any) -> list[int]:
    """Bytes of each array (or ShapeDtypeStruct, or `Deferred`'s) of `tree`, whole."""
    return [int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(abstract(tree))]


def largest_array_bytes(tree: Any) -> int:
    """Bytes of the largest array (or ShapeDtypeStruct) of a saved state, whole."""
    return max(_leaf_bytes(tree))


def state_bytes(tree: Any) -> int:
    """Bytes of the arrays (or ShapeDtypeStructs) of a saved state: about the size of its checkpoint."""
    return sum(_leaf_bytes(tree))


def state_shapes(tree: Any) -> dict[str, list[int]]:
    """{key path: shape} of every leaf, for the metadata and the pre-restore shape check."""
    flat = jax.tree_util.tree_flatten_with_path(abstract(tree))[0]
    return {jax.tree_util.keystr(path): list(leaf.shape) for path, leaf in flat}


def make_meta(
    step: int, data_state: dict[str, int], cfg: TrainConfig, layout: str, state: Any
) -> dict[str, Any]:
    """The JSON metadata saved with a checkpoint (and, for a run with a frozen part over files, which
    base it trained against: `jaxzero.finetune.provenance`)."""
    meta = {
        "step": step,
        "data_state": data_state,
        "config": cfg.to_dict(),
        "layout": layout,
        "shapes": state_shapes(state),
    }
    base = base_record(cfg)
    return meta if base is None else {**meta, "base": base}


def checkpoints_dir(run_dir: str | Path) -> Path:
    """`<run_dir>/checkpoints`, absolute (Orbax wants absolute paths), `~` expanded."""
    return Path(os.path.abspath(os.path.expanduser(run_dir))) / CHECKPOINT_DIR


def saved_steps(run_dir: str | Path) -> list[int]:
    """Steps of the committed checkpoints under `<run_dir>/checkpoints`, oldest first, read from the
    directory names without starting Orbax (a half-written save has no step-named directory)."""
    directory = checkpoints_dir(run_dir)
    return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit()) if directory.is_dir() else []


def saved_step(run_dir: str | Path, step: int | None, purpose: str) -> int:
    """`step` if `run_dir` holds a committed checkpoint of it, or (None) its newest checkpoint's
    step; CheckpointError naming the steps there are otherwise. `purpose` says in that message what
    the checkpoint was wanted for ("restore", "evaluate", "read")."""
    directory = checkpoints_dir(run_dir)
    if not directory.parent.is_dir():
        raise CheckpointError(
            f"run_dir {str(directory.parent)!r} does not exist: name a jaxzero run's directory."
        )
    steps = saved_steps(run_dir)
    if not steps:
        raise CheckpointError(
            f"{directory} holds no checkpoint to {purpose}; train with checkpoint.enabled=true first."
        )
    if step is None:
        return steps[-1]
    if step not in steps:
        raise CheckpointError(
            f"{directory} has no checkpoint {step} to {purpose}; it has checkpoints {steps}."
        )
    return step


def unreadable_files(path: Path, error: Exception, resuming: bool = False) -> str:
    """What to say of checkpoint arrays under `path` (`<run_dir>/checkpoints/<step>/...`) that could
    not be read: which checkpoint, the cause, and how to go on (`resuming`: for a resume that did not
    check the checkpoints' checksums; otherwise for a program that reads one checkpoint)."""
    step = next((p for p in [path, *path.parents] if p.parent.name == CHECKPOINT_DIR), path)
    run_dir = step.parent.parent
    cause = (
        f"checkpoint {step} could not be read ({type(error).__name__}: {str(error)[:200]}): its files "
        "are damaged or incomplete."
    )
    if resuming:
        return (
            f"{cause} checkpoint.verify=false skipped the check of their checksums; resume with "
            "--checkpoint.verify=true, which sets a damaged checkpoint aside and resumes from the one before."
        )
    others = [s for s in saved_steps(run_dir) if str(s) != step.name]
    return (
        f"{cause} Name another with --step=N (this run has {others or 'no other'}); `python -m "
        f"jaxzero.train --run_dir={run_dir}` checks every checkpoint's checksums when it resumes and "
        "sets a damaged one aside."
    )


def read_meta(directory: str | Path, step: int) -> dict[str, Any]:
    """The JSON metadata of checkpoint `step` in the checkpoints `directory` (no arrays are read)."""
    path = Path(directory) / str(step) / "meta" / "metadata"
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"checkpoint {Path(directory) / str(step)} has unreadable metadata: {e}") from e


class CheckpointMismatch(CheckpointError):
    """A readable checkpoint of another run (other shapes): an error, not a reason to fall back."""


def check_shapes(where: Path, meta: dict[str, Any], abstract_state: dict[str, Any], run: TrainConfig) -> None:
    """Raise CheckpointMismatch naming the mismatch when the checkpoint's arrays are not this run's:
    other shapes (a different model config), arrays missing, or arrays this run does not have (a
    float16 run's loss scale, another optimizer's state), before any array is read."""
    saved = meta.get("shapes", {})
    expected = state_shapes(abstract_state)
    wrong = [k for k in expected if k in saved and tuple(saved[k]) != tuple(expected[k])]
    missing = [k for k in expected if k not in saved]
    extra = [k for k in saved if k not in expected]  # e.g. float16's loss scale, restored into bfloat16
    if not wrong and not missing and not extra:
        return
    saved_model = meta.get("config", {}).get("model", {})
    fields = [
        f"model.{k}={v!r} (this run: {getattr(run.model, k)!r})"
        for k, v in saved_model.items()
        if hasattr(run.model, k) and getattr(run.model, k) != v
    ]
    arrays = [f"{k}: {tuple(saved[k])} saved, {tuple(expected[k])} expected" for k in wrong[:3]]
    arrays += [f"{k}: not in the checkpoint" for k in missing[:3]]
    arrays += [f"{k}: in the checkpoint, not in this run's state" for k in extra[:3]]
    raise CheckpointMismatch(
        f"checkpoint {where} does not match this run's model ({'; '.join(arrays)}). It was saved with "
        f"{', '.join(fields) or 'another optimizer or layout'}. Resume with the config it was saved with, "
        "or start a new run_dir."
    )
