"""The config's keys as data: each dotted key's type (`field_types`), a value read as it (`coerce`),
the keys that are no more (`REMOVED_KEYS`), settings applied to a config (`set_keys`), a saved config
read back (`config_from_dict`), and where a layered setting came from (`set_by_preset`). Imports
nothing of jaxzero but the config; `jaxzero.overrides` adds what reads files (presets, DeepSpeed
configs, Hugging Face checkpoints for `model.name=hf:DIR`)."""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from typing import Any, Literal, get_args, get_origin

from jaxzero.config import (
    SECTIONS,
    SIZE_SHAPES,
    TOP_LEVEL_KEYS,
    ConfigError,
    DataConfig,
    ModelConfig,
    OptimizerConfig,
    TrainConfig,
)


def field_types(cls: type) -> dict[str, Any]:
    """{field: its annotation} of a config dataclass, its fields only."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def coerce(key: str, raw: Any, typ: Any) -> Any:
    """Convert `raw` (a CLI string or a TOML value) to `typ`, or raise ConfigError naming the key."""
    origin = get_origin(typ)
    if origin is Literal:
        choices = get_args(typ)
        if raw in choices:
            return raw
        # Names are case-insensitive (optimizer.name=AdamW is adamw); stored as written in the choices.
        folded = raw.lower() if isinstance(raw, str) else raw
        same = [c for c in choices if isinstance(c, str) and c.lower() == folded]
        if not same:
            raise ConfigError(f"{key}={raw!r} is not one of {list(choices)}.")
        return same[0]
    if origin in (types.UnionType, typing.Union):
        raise TypeError(f"unsupported annotation for {key}: {typ}")  # no optional fields by design
    if typ is bool:
        if isinstance(raw, bool):
            return raw
        if isinstance(raw, str) and raw.lower() in ("true", "1", "yes", "false", "0", "no"):
            return raw.lower() in ("true", "1", "yes")
        raise ConfigError(f"{key}={raw!r} is not a boolean; use true or false.")
    if typ is int:
        if isinstance(raw, bool):
            raise ConfigError(f"{key}={raw!r} is not an integer.")
        if isinstance(raw, int):
            return raw
        if isinstance(raw, str):
            try:
                return int(raw.replace("_", ""))
            except ValueError:
                pass
        raise ConfigError(f"{key}={raw!r} is not an integer.")
    if typ is float:
        if isinstance(raw, bool):
            raise ConfigError(f"{key}={raw!r} is not a number.")
        if isinstance(raw, (int, float)):
            return float(raw)
        if isinstance(raw, str):
            try:
                return float(raw)
            except ValueError:
                pass
        raise ConfigError(f"{key}={raw!r} is not a number.")
    if typ is str:
        if isinstance(raw, str):
            return raw
        raise ConfigError(f"{key}={raw!r} is not a string.")
    raise TypeError(f"unsupported annotation for {key}: {typ}")


# Keys jaxzero had and no longer has, each with why it went: setting one (command line, preset,
# `build_trainer`) is refused with that reason rather than as a typo; a run's saved config drops it.
REMOVED_KEYS = {
    "offload.speculative_units": (
        "speculative updates were slower than waiting for the gradient norm in every measurement "
        "(BENCHMARKS.md), and computed the same bits: drop the key, and the run computes the same"
    ),
}


def removed_key(key: str) -> ConfigError:
    return ConfigError(f"config key {key!r} was removed: {REMOVED_KEYS[key]}.")


def unknown_key(key: str, valid: list[str]) -> ConfigError:
    close = difflib.get_close_matches(key, all_keys(), n=1, cutoff=0.6)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    return ConfigError(f"unknown config key {key!r}.{hint} Valid keys: {', '.join(valid)}.")


def all_keys() -> list[str]:
    """Every settable key, dotted, in declaration order."""
    keys = list(TOP_LEVEL_KEYS)
    for sec, cls in SECTIONS.items():
        keys += [f"{sec}.{f.name}" for f in dataclasses.fields(cls)]
    return keys


def set_keys(cfg: TrainConfig, overrides: dict[str, Any]) -> TrainConfig:
    """`cfg` with dotted `overrides` applied (values as strings or TOML-typed values), each checked
    against its field's type. `model.name` is applied first: it resets the model section to that named
    size, and the other `model.*` keys then override single fields of it (`hf:DIR` names are
    `jaxzero.overrides.apply_overrides`'s, which reads the checkpoint's shape)."""
    top: dict[str, Any] = {}
    per_section: dict[str, dict[str, Any]] = {}
    for key, raw in overrides.items():
        if key in TOP_LEVEL_KEYS:
            top[key] = coerce(key, raw, field_types(TrainConfig)[key])
            continue
        if key in REMOVED_KEYS:
            raise removed_key(key)
        sec, _, name = key.partition(".")
        if sec not in SECTIONS or not name:
            raise unknown_key(key, all_keys())
        hints = field_types(SECTIONS[sec])
        if name not in hints:
            valid = [f"{sec}.{k}" for k in hints]
            raise unknown_key(key, valid)
        per_section.setdefault(sec, {})[name] = coerce(key, raw, hints[name])

    optimizer = per_section.get("optimizer", {})
    if optimizer.get("name") == "adam" and "weight_decay" not in optimizer:
        # Adam has no weight decay: where no setting names one, it takes its own default, not adamw's
        if cfg.optimizer.weight_decay == OptimizerConfig().weight_decay:
            optimizer["weight_decay"] = 0.0
    data = per_section.get("data", {})
    if data.get("path") and "source" not in data and cfg.data.source == DataConfig().source:
        # a data.path names token files: where no setting names the source, that is the source
        data["source"] = "tokens"
    model = cfg.model
    model_over = per_section.pop("model", {})
    if "name" in model_over:
        name = model_over.pop("name")
        model = ModelConfig.named(name)
    model = dataclasses.replace(model, **model_over)
    sections = {sec: dataclasses.replace(getattr(cfg, sec), **vals) for sec, vals in per_section.items()}
    return dataclasses.replace(cfg, model=model, **sections, **top)


def flatten_toml(tree: dict[str, Any], path: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in tree.items():
        key = f"{path}{k}"
        if isinstance(v, dict):
            out.update(flatten_toml(v, key + "."))
        else:
            out[key] = v
    return out


COMMAND_LINE = "the command line"  # `Layered.sources`' name of a key set by `--section.key=value`
DEEPSPEED_SOURCE = "--deepspeed="  # `Layered.sources`' name of a key a DeepSpeed file set: this and its path


def set_by_preset(source: str) -> bool:
    """Whether a `Layered.sources` value is a preset's path: a file of jaxzero's own keys (a DeepSpeed
    file's keys are its own, translated)."""
    return source != COMMAND_LINE and not source.startswith(DEEPSPEED_SOURCE)


def config_from_dict(d: dict[str, Any]) -> TrainConfig:
    """Rebuild a TrainConfig from `TrainConfig.to_dict()` output (e.g. a run's config.json). Its model
    section gives every field, and a ModelConfig keeps each field given: a named size with fields
    changed loads as saved. A key the saved config lacks takes its default, except
    `data.cross_document_attention`, which keeps the behaviour of the runs saved before it (true).
    `offload.device_state_units=0` beside `offload.optimizer=auto` reads as -1: until -1 existed, 0
    was the default and, with the optimizer's tier left to the planner, meant "the planner's choice"
    (a run that pins 0 under an auto tier resumes with the planner choosing). A `REMOVED_KEYS` key
    is dropped: none of them changed what a run computes."""
    flat = flatten_toml(d)
    for key in REMOVED_KEYS:
        flat.pop(key, None)
    # A run saved before document-aware attention existed attended across documents: it keeps doing so.
    flat.setdefault("data.cross_document_attention", True)
    if flat.get("offload.optimizer") == "auto" and flat.get("offload.device_state_units") == 0:
        flat["offload.device_state_units"] = -1
    model_keys = {k: v for k, v in flat.items() if k.startswith("model.")}
    rest = {k: v for k, v in flat.items() if not k.startswith("model.")}
    cfg = dataclasses.replace(TrainConfig(), model=_saved_model({k[6:]: v for k, v in model_keys.items()}))
    return set_keys(cfg, rest)


def _saved_model(fields: dict[str, Any]) -> ModelConfig:
    """A saved model section: every field it gives kept; one it lacks (a config saved before that field
    existed) takes its named size's value, or llama-tiny's under a name of no size."""
    name = fields.pop("name", ModelConfig.name)
    return ModelConfig.named(name, **fields) if name in SIZE_SHAPES else ModelConfig(name=name, **fields)


