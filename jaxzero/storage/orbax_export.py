"""What an Orbax export is: the parameters as one Orbax PyTree checkpoint and, beside them, `model.json`,
the model they belong to. `jaxzero.storage.checkpoint_masters.export_orbax` writes it; `model.name=orbax:DIR`
(`read_model`) and `jaxzero.interop.exports.from_export` read it.

    DIR/model.json        {"format": "jaxzero-orbax-export", "format_version": 1, "dtype": "bfloat16",
                           "model": {every ModelConfig field but init_from}, "params": "..."}
    DIR/_METADATA, d/...  Orbax's files: {"embed": {...}, "blocks": [{...}, ...], "head": {...}}, every
                          leaf a NumPy array of `dtype` (Orbax restores `ModelParams` as that dict)
    DIR/.jaxzero-export   the export's marker (`jaxzero.storage.export_dir`)

Plain Orbax reads the parameters without jaxzero (`orbax.checkpoint.PyTreeCheckpointer().restore(DIR)`, or
the V1 API's `load(DIR)`); `model.json` is plain JSON a reader without jaxzero can read too.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import jax
import numpy as np

from jaxzero.config import ConfigError, ModelConfig
from jaxzero.models import ModelParams, build_model
from jaxzero.primitives.deferred import Deferred
from jaxzero.storage.export_dir import MARKER

MODEL_FILE = "model.json"
FORMAT = "jaxzero-orbax-export"
FORMAT_VERSION = 1
PREFIX = "orbax:"  # model.name=orbax:DIR
# Choices of the run that trains or runs the weights, not properties of them: `model.name=orbax:DIR` takes
# them from the run's own settings (ModelConfig's defaults unless given), as `hf:DIR` does.
RUN_CHOICES = ("compute_dtype", "attention_impl", "moe_impl")
# Fields a run over the weights may set otherwise without changing what they compute.
_FREE_FIELDS = ("name", "init_from", "init_std", *RUN_CHOICES)


def description(model: ModelConfig, dtype: str) -> dict[str, Any]:
    """The `model.json` of an export of `model`'s parameters stored as `dtype` (the module docstring)."""
    fields = {k: v for k, v in dataclasses.asdict(model).items() if k != "init_from"}
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "dtype": dtype,
        "model": fields,
        "params": (
            "an Orbax PyTree {embed, blocks: [one per layer], head} (jaxzero.models.ModelParams); "
            "jaxzero.from_export(DIR) returns (model, params) and jaxzero.models.forward(model, params, "
            "tokens) the logits"
        ),
    }


def write_model_file(directory: Path, model: ModelConfig, dtype: str) -> Path:
    """Write `model.json` into `directory` (an export's staging directory, moved into place with the
    parameters) and return its path."""
    path = directory / MODEL_FILE
    path.write_text(json.dumps(description(model, dtype), indent=2) + "\n")
    return path


def is_orbax_export(path: str | os.PathLike[str]) -> bool:
    """Whether `path` is a directory holding an Orbax export's `model.json`."""
    return (Path(path) / MODEL_FILE).is_file()


def read_model(path: str | os.PathLike[str], *, name: str | None = None) -> tuple[ModelConfig, str]:
    """(the ModelConfig, the stored dtype) of the Orbax export at `path`; the config is named `name`
    (default `orbax:<path>`) and keeps every field `model.json` records. ConfigError, in one line with
    what to do, for a path that is no such export or a `model.json` this version cannot read."""
    where = Path(path)
    name = name or f"{PREFIX}{path}"
    if not where.is_dir():
        raise ConfigError(f"{name}: {where} is not a directory; give an Orbax export's directory.")
    if not is_orbax_export(where):
        hint = f" It holds a Hugging Face checkpoint: use model.name=hf:{path}." if _is_hf(where) else ""
        raise ConfigError(
            f"{name}: {where} holds no {MODEL_FILE}, so it is not an Orbax export of jaxzero's (python -m "
            f"jaxzero.export --format=orbax writes one).{hint or earlier_export_hint(where)}"
        )
    marker = _marker(where)
    if marker is not None and not marker.get("finished"):
        raise ConfigError(
            f"{name}: {where} is an export that did not finish (killed midway, or still being written): "
            "run the export again."
        )
    try:
        record = json.loads((where / MODEL_FILE).read_text())
        if not isinstance(record, dict):
            raise ValueError(f"a JSON {type(record).__name__}, not an object")
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ConfigError(f"{name}: {where / MODEL_FILE} cannot be read ({e}); export the run again.") from e
    if record.get("format") != FORMAT or record.get("format_version") != FORMAT_VERSION:
        raise ConfigError(
            f"{name}: {where / MODEL_FILE} is format {record.get('format')!r} version "
            f"{record.get('format_version')!r}; this jaxzero reads {FORMAT!r} version {FORMAT_VERSION}."
        )
    fields, dtype = record.get("model"), record.get("dtype")
    known = {f.name for f in dataclasses.fields(ModelConfig)} - {"init_from"}
    if not isinstance(fields, dict) or set(fields) - known or dtype not in ("float32", "bfloat16", "float16"):
        unknown = sorted(set(fields) - known) if isinstance(fields, dict) else fields
        raise ConfigError(
            f"{name}: {where / MODEL_FILE} does not describe a model this jaxzero builds (model fields "
            f"unknown: {unknown}, dtype {dtype!r}); export the run again with this version."
        )
    try:
        model = ModelConfig(**{**fields, "name": name})
        build_model(model)  # the same checks a run would make
    except (TypeError, ConfigError) as e:
        raise ConfigError(f"{name}: {where / MODEL_FILE} describes no valid model: {e}") from e
    return model, dtype


def earlier_export_hint(where: Path) -> str:
    """What to do with a directory that holds Orbax's files but no model.json ("" for anything else)."""
    if (where / "_METADATA").is_file():  # Orbax's own file
        return " It holds an Orbax checkpoint without one (an earlier jaxzero's export): export it again."
    return ""


def _is_hf(where: Path) -> bool:
    return (where / "config.json").is_file()


def _marker(where: Path) -> dict[str, Any] | None:
    """The export marker's record in `where` (`jaxzero.storage.export_dir`), None where there is none or
    it cannot be read (a copy without it is still an export: model.json says what it is)."""
    try:
        record = json.loads((where / MARKER).read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def load_orbax_by_unit(cfg: ModelConfig, path: str | os.PathLike[str]) -> ModelParams:
    """The parameters of the Orbax export at `path` for a model configured by `cfg`, each unit a
    `jaxzero.primitives.deferred.Deferred` read as float32 NumPy host arrays when resolved (one unit in
    host RAM at a time). ConfigError now, before any array is read, where `cfg` differs from the
    export's `model.json` in a field that shapes the arrays or what they compute (the run's choices,
    compute_dtype, attention_impl, init_std and the name, may differ) or the stored arrays are not the
    shapes the model's init makes."""
    # Orbax loads only where an export's arrays are read: the config's path (`model.name=orbax:DIR`,
    # `python -m jaxzero.plan`) reads model.json alone.
    import orbax.checkpoint as ocp

    where = Path(path).absolute()
    saved, _ = read_model(where, name=cfg.name)
    differ = [
        f"model.{f.name}: run config has {getattr(cfg, f.name)!r}, export has {getattr(saved, f.name)!r}"
        for f in dataclasses.fields(ModelConfig)
        if f.name not in _FREE_FIELDS
        and not (f.name == "max_seq_len" and cfg.family == "llama")  # a context length, no array
        and getattr(cfg, f.name) != getattr(saved, f.name)
    ]
    if differ:
        raise ConfigError(
            f"the Orbax export {where} does not match the model config {cfg.name!r}:\n  "
            + "\n  ".join(differ)
            + f"\nUse the export's shape: model.name={PREFIX}{path} without those model.* keys."
        )
    shapes = jax.eval_shape(build_model(cfg).init, jax.random.key(0))
    try:
        stored = ocp.PyTreeCheckpointer().metadata(where).item_metadata.tree
        found = {
            jax.tree_util.keystr(k): tuple(m.shape)
            for k, m in jax.tree_util.tree_flatten_with_path(stored)[0]
        }
    except Exception as e:  # noqa: BLE001 - Orbax and tensorstore raise many types for damaged files
        raise ConfigError(f"the Orbax export {where} cannot be read ({type(e).__name__}: {e}).") from e
    wanted = {
        jax.tree_util.keystr(k): tuple(s.shape)
        for k, s in jax.tree_util.tree_flatten_with_path(_as_saved(shapes))[0]
    }
    if found != wanted:
        wrong = sorted(k for k in found.keys() | wanted.keys() if found.get(k) != wanted.get(k))
        raise ConfigError(
            f"the Orbax export {where} holds other arrays than {MODEL_FILE}'s model: "
            + ", ".join(f"{k}: stored {found.get(k)}, model {wanted.get(k)}" for k in wrong[:5])
            + (f" and {len(wrong) - 5} more" if len(wrong) > 5 else "")
            + "; export the run again."
        )

    units = shapes.units()

    def unit(k: int, u: Any) -> Deferred:
        def read() -> tuple[Any]:
            # every other unit's leaves placeholders: Orbax reads this unit's arrays only
            def pick(leaf: Any) -> dict[str, Any]:
                return _as_saved(
                    ModelParams.from_units(
                        [jax.tree.map(leaf if i == k else _placeholder, x) for i, x in enumerate(units)]
                    )
                )

            args = ocp.args.PyTreeRestore(
                item=pick(lambda s: np.zeros((), s.dtype)),
                restore_args=pick(lambda _: ocp.RestoreArgs(restore_type=np.ndarray)),
            )
            tree = ocp.PyTreeCheckpointer().restore(where, args=args)
            got = ModelParams(tree["embed"], tuple(tree["blocks"]), tree["head"]).units()[k]
            return (jax.tree.map(lambda x: np.asarray(x, np.float32), got),)

        return Deferred(read, 0, u)

    return ModelParams.from_units([unit(k, u) for k, u in enumerate(units)])


def _placeholder(_: Any) -> Any:
    """Orbax's mark of a leaf a restore leaves unread."""
    # Orbax loads only where an export's arrays are read (`load_orbax_by_unit`)
    import orbax.checkpoint as ocp

    return ocp.PLACEHOLDER


def _as_saved(params: ModelParams) -> dict[str, Any]:
    """`params` in the structure Orbax restores a saved `ModelParams` as: {embed, blocks: [...], head}."""
    return {"embed": params.embed, "blocks": list(params.blocks), "head": params.head}
