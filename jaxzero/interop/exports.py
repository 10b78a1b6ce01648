"""A model and its weights from an export, Orbax or Hugging Face alike: `from_export(DIR)` for a JAX
user, and `load_by_unit`, the weights a run starts from (`model.init_from`, set by `model.name=hf:DIR`
or `model.name=orbax:DIR`), read one unit at a time.

    model, params = from_export("export/x")            # the export's model, float32 NumPy ModelParams
    logits = forward(model, params, tokens)             # jaxzero.models.forward: (B, S, V) float32

An Orbax export is recognised by its `model.json` (`jaxzero.storage.orbax_export`); any other directory is
read as a Hugging Face checkpoint (`jaxzero.interop.hf_io`).
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import jax
import numpy as np

from jaxzero.config import ConfigError, ModelConfig
from jaxzero.interop.hf_config_map import CONFIG_NAME, model_config_from_hf
from jaxzero.interop.hf_io import load_hf_by_unit
from jaxzero.models import Model, ModelParams, build_model
from jaxzero.primitives.deferred import resolved
from jaxzero.storage.orbax_export import (
    MODEL_FILE,
    earlier_export_hint,
    is_orbax_export,
    load_orbax_by_unit,
    read_model,
)


def load_by_unit(cfg: ModelConfig, path: str | os.PathLike[str]) -> ModelParams:
    """The weights of the export at `path` for a run configured by `cfg`, each unit a
    `jaxzero.primitives.deferred.Deferred` read as float32 NumPy when resolved: an Orbax export's
    (`load_orbax_by_unit`) where `path` holds `model.json`, else a Hugging Face checkpoint's
    (`load_hf_by_unit`). Every check against `cfg` is made now, before any array is read."""
    if is_orbax_export(path):
        return load_orbax_by_unit(cfg, path)
    return load_hf_by_unit(cfg, path)


def export_model(path: str | os.PathLike[str]) -> ModelConfig:
    """The ModelConfig of the export at `path` as it was trained (an Orbax export's compute dtype and
    attention included; a Hugging Face checkpoint's as `model_config_from_hf` reads it). ConfigError,
    saying what `path` is, where it is neither."""
    if is_orbax_export(path):
        return read_model(path)[0]
    if not (Path(path) / CONFIG_NAME).is_file():
        raise ConfigError(
            f"{path} is no export: it holds neither {MODEL_FILE} (an Orbax export, python -m jaxzero.export "
            f"--format=orbax) nor {CONFIG_NAME} (a Hugging Face checkpoint).{earlier_export_hint(Path(path))}"
        )
    return model_config_from_hf(path, name=f"hf:{path}")


def from_export(
    path: str | os.PathLike[str], *, compute_dtype: str | None = None, dtype: str = "float32"
) -> tuple[Model, ModelParams]:
    """(model, params) of the export at `path`: an Orbax export of `python -m jaxzero.export
    --format=orbax` (its `model.json` and parameters) or a Hugging Face checkpoint (`--format=hf`, or a
    download `model.name=hf:DIR` reads).

    model:  `jaxzero.models.build_model` of the export's ModelConfig (`model.config`), computing in
            `compute_dtype` (default: an Orbax export's recorded one, a Hugging Face checkpoint's
            bfloat16, as `model.name=hf:DIR` trains).
    params: `ModelParams(embed, blocks, head)` of NumPy host arrays of `dtype` (default float32, whatever
            the export stores), the shapes `model.init` makes (e.g. Llama: embed
            {"embed_tokens": {"embedding": (V, D)}}, each block's projections (in, out)).
    `jaxzero.models.forward(model, params, tokens)` runs it: int32 tokens (B, S) -> float32 logits
    (B, S, V). The whole model is read into host RAM."""
    cfg = export_model(path)
    if compute_dtype is not None:
        cfg = dataclasses.replace(cfg, compute_dtype=compute_dtype)
    model = build_model(cfg)
    np_dtype = np.dtype(jax.numpy.dtype(dtype))
    params = jax.tree.map(lambda x: np.asarray(x).astype(np_dtype), resolved(load_by_unit(cfg, path)))
    return model, params
