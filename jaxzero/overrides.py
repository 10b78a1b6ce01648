"""How a run's config is built: defaults, then a TOML preset, then `--section.key=value` overrides.

A run's config is built in three layers, later ones winning:

1. the dataclass defaults of `jaxzero.config` (the built-in default run: a tiny Llama on bundled bytes),
2. an optional TOML preset (`--config=configs/NAME.toml`),
3. command-line overrides `--section.key=value` (top-level keys: `--steps`, `--seed`, `--run_dir`,
   `--determinism`).

`model.name` selects a named size (`jaxzero.models.sizes`) or, as `hf:DIR`, the shape of a Hugging
Face checkpoint (`jaxzero.interop`); every other `model.*` key then overrides one field of it. All
values are type-checked against the field annotations, and `parse_args` ends with `validate`.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import logging
import re
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

from jaxzero import deepspeed
from jaxzero.config import (
    SECTIONS,
    SIZE_SHAPES,
    TOP_LEVEL_KEYS,
    ConfigError,
    ModelConfig,
    OptimizerConfig,
    TrainConfig,
)
from jaxzero.config.checks import validate
from jaxzero.deepspeed import Translation
from jaxzero.interop import model_config_from_hf

log = logging.getLogger(__name__)  # the library speaks through logging (`jaxzero.run.console`)


def _field_types(cls: type) -> dict[str, Any]:
    """{field: its annotation} of a config dataclass, its fields only."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _coerce(key: str, raw: Any, typ: Any) -> Any:
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


def _removed_key(key: str) -> ConfigError:
    return ConfigError(f"config key {key!r} was removed: {REMOVED_KEYS[key]}.")


def _unknown_key(key: str, valid: list[str]) -> ConfigError:
    close = difflib.get_close_matches(key, all_keys(), n=1, cutoff=0.6)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    return ConfigError(f"unknown config key {key!r}.{hint} Valid keys: {', '.join(valid)}.")


def all_keys() -> list[str]:
    """Every settable key, dotted, in declaration order."""
    keys = list(TOP_LEVEL_KEYS)
    for sec, cls in SECTIONS.items():
        keys += [f"{sec}.{f.name}" for f in dataclasses.fields(cls)]
    return keys


def apply_overrides(cfg: TrainConfig, overrides: dict[str, Any]) -> TrainConfig:
    """Return `cfg` with dotted `overrides` applied (values as strings or TOML-typed values).

    `model.name` is applied first: it resets the model section to that named size (or, for
    `hf:DIR`, to the shape of a Hugging Face checkpoint whose weights the run starts from), and the
    other `model.*` keys then override single fields of it.
    """
    top: dict[str, Any] = {}
    per_section: dict[str, dict[str, Any]] = {}
    for key, raw in overrides.items():
        if key in TOP_LEVEL_KEYS:
            top[key] = _coerce(key, raw, _field_types(TrainConfig)[key])
            continue
        if key in REMOVED_KEYS:
            raise _removed_key(key)
        sec, _, name = key.partition(".")
        if sec not in SECTIONS or not name:
            raise _unknown_key(key, all_keys())
        hints = _field_types(SECTIONS[sec])
        if name not in hints:
            valid = [f"{sec}.{k}" for k in hints]
            raise _unknown_key(key, valid)
        per_section.setdefault(sec, {})[name] = _coerce(key, raw, hints[name])

    optimizer = per_section.get("optimizer", {})
    if optimizer.get("name") == "adam" and "weight_decay" not in optimizer:
        # Adam has no weight decay: where no setting names one, it takes its own default, not adamw's
        if cfg.optimizer.weight_decay == OptimizerConfig().weight_decay:
            optimizer["weight_decay"] = 0.0
    model = cfg.model
    model_over = per_section.pop("model", {})
    if "name" in model_over:
        name = model_over.pop("name")
        if name.startswith("hf:"):  # a Hugging Face checkpoint: its shape, and its weights to start from
            model = model_config_from_hf(name[3:], name=name)
            model = dataclasses.replace(model, init_from=name[3:])
        else:
            model = ModelConfig.named(name)
    model = dataclasses.replace(model, **model_over)
    sections = {sec: dataclasses.replace(getattr(cfg, sec), **vals) for sec, vals in per_section.items()}
    return dataclasses.replace(cfg, model=model, **sections, **top)


def _flatten_toml(tree: dict[str, Any], path: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in tree.items():
        key = f"{path}{k}"
        if isinstance(v, dict):
            out.update(_flatten_toml(v, key + "."))
        else:
            out[key] = v
    return out


def check_overrides(overrides: dict[str, Any], source: str) -> None:
    """Raise ConfigError, naming `source`, for an unknown key or a value of the wrong type, before
    anything is applied (ranges are checked on the whole config later)."""
    for key, raw in overrides.items():
        sec, _, name = key.partition(".")
        try:
            if key in TOP_LEVEL_KEYS:
                _coerce(key, raw, _field_types(TrainConfig)[key])
            elif key in REMOVED_KEYS:
                raise _removed_key(key)
            elif sec not in SECTIONS or name not in _field_types(SECTIONS[sec]):
                raise _unknown_key(
                    key,
                    all_keys()
                    if sec not in SECTIONS
                    else [f"{sec}.{k}" for k in _field_types(SECTIONS[sec])],
                )
            else:
                _coerce(key, raw, _field_types(SECTIONS[sec])[name])
        except ConfigError as e:
            raise ConfigError(f"in {source}: {e}") from e


def load_preset(path: str | Path) -> dict[str, Any]:
    """Read a TOML preset into dotted overrides. Missing files, bad TOML, unknown keys and values of the
    wrong type raise ConfigError naming the file."""
    p = Path(path)
    if not p.is_file():
        what = "is a directory, not a TOML file" if p.is_dir() else "does not exist"
        raise ConfigError(f"config file {str(p)!r} {what}. Presets live in configs/, e.g. configs/tiny.toml.")
    try:
        tree = tomllib.loads(p.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {str(p)!r} is not valid TOML: {e}") from e
    flat = _flatten_toml(tree)
    check_overrides(flat, f"config file {str(p)!r}")
    # `model.name` first, so that a preset may name a size and then adjust it.
    return dict(sorted(flat.items(), key=lambda kv: kv[0] != "model.name"))


@dataclass(frozen=True)
class Arguments:
    """A command line's settings, nothing applied yet: a TOML preset's dotted overrides (read from
    `preset_path`, as given), a DeepSpeed config (parsed JSON, `jaxzero.deepspeed`), and the
    `--section.key=value` overrides."""

    preset: dict[str, Any] = field(default_factory=dict)
    cli: dict[str, Any] = field(default_factory=dict)
    deepspeed: dict[str, Any] | None = None
    deepspeed_path: str = ""
    preset_path: str = ""


COMMAND_LINE = "the command line"  # `Layered.sources`' name of a key set by `--section.key=value`
DEEPSPEED_SOURCE = "--deepspeed="  # `Layered.sources`' name of a key a DeepSpeed file set: this and its path


def set_by_preset(source: str) -> bool:
    """Whether a `Layered.sources` value is a preset's path: a file of jaxzero's own keys (a DeepSpeed
    file's keys are its own, translated)."""
    return source != COMMAND_LINE and not source.startswith(DEEPSPEED_SOURCE)


@dataclass(frozen=True)
class Layered:
    """A config built from `Arguments`, how its DeepSpeed config was read (None without one), and
    `sources`: where each key the arguments set came from (the preset's path as given,
    `--deepspeed=PATH`, or `COMMAND_LINE`; the last layer that set it). A key absent was left as it was."""

    config: TrainConfig
    deepspeed: Translation | None = None
    sources: dict[str, str] = field(default_factory=dict)


def split_args(argv: list[str]) -> Arguments:
    """The settings of `[--config=PATH] [--deepspeed=PATH] [--section.key=value ...]`, as dotted
    keys; nothing applied yet; of a key given twice the last wins (with a note on stderr). Raises
    ConfigError for an argument of another form, or a preset or DeepSpeed file that cannot be read."""
    preset: dict[str, Any] = {}
    cli: dict[str, Any] = {}
    ds, ds_path, preset_path = None, "", ""
    seen: dict[str, str] = {}
    for arg in argv:
        if not arg.startswith("--") or "=" not in arg:
            raise ConfigError(
                f"cannot parse argument {arg!r}: write overrides as --section.key=value "
                f"(e.g. --steps=100 --offload.params=cpu) and presets as --config=PATH."
            )
        key, _, value = arg[2:].partition("=")
        if key in seen:  # the last wins, as scripts that append overrides expect, but not silently
            log.warning(f"--{key} is given twice ({seen[key]!r}, then {value!r}): using {value!r}.")
        seen[key] = value
        if key == "config":
            preset, preset_path = load_preset(value), value
        elif key == "deepspeed":
            ds, ds_path = deepspeed.load(value), value
        else:
            cli[key] = value
    return Arguments(preset, cli, ds, ds_path, preset_path)


def layer(base: TrainConfig, args: Arguments) -> Layered:
    """`base` with a preset's overrides, then a DeepSpeed config's, then the command line's, applied
    (unvalidated, but for the values the DeepSpeed config set: one jaxzero refuses is refused here in
    the file's own keys, `deepspeed.check`). A CLI `model.name` replaces the preset's whole model
    section before the DeepSpeed config (which may set its compute dtype) and the CLI's other keys
    apply."""
    cfg = apply_overrides(base, args.preset)
    sources = dict.fromkeys(args.preset, args.preset_path or "the preset")
    cli = dict(args.cli)
    if "model.name" in cli:
        cfg = apply_overrides(cfg, {"model.name": cli.pop("model.name")})
    translation = None
    if args.deepspeed is not None:
        source = f"{DEEPSPEED_SOURCE}{args.deepspeed_path}"
        translation = deepspeed.translate(args.deepspeed, apply_overrides(cfg, cli), source)
        check_overrides(translation.overrides, source)
        overridden = {k: args.cli[k] for k in translation.overrides if k in args.cli}
        translation = dataclasses.replace(translation, overridden=overridden)
        cfg = apply_overrides(cfg, translation.overrides)
        sources.update(dict.fromkeys(translation.overrides, source))
    sources.update(dict.fromkeys(args.cli, COMMAND_LINE))
    cfg = apply_overrides(cfg, cli)
    if translation is not None:
        deepspeed.check(translation, cfg)
    return Layered(cfg, translation, sources)


def parse_args(argv: list[str]) -> TrainConfig:
    """Build a validated TrainConfig from `[--config=PATH] [--deepspeed=PATH] [--section.key=value ...]`."""
    cfg = layer(TrainConfig(), split_args(argv)).config
    validate(cfg)
    return cfg


def config_from_dict(d: dict[str, Any]) -> TrainConfig:
    """Rebuild a TrainConfig from `TrainConfig.to_dict()` output (e.g. a run's config.json). Its model
    section gives every field, and a ModelConfig keeps each field given: a named size with fields
    changed loads as saved. A key the saved config lacks takes its default, except
    `data.cross_document_attention`, which keeps the behaviour of the runs saved before it (true).
    `offload.device_state_units=0` beside `offload.optimizer=auto` reads as -1: until -1 existed, 0
    was the default and, with the optimizer's tier left to the planner, meant "the planner's choice"
    (a run that pins 0 under an auto tier resumes with the planner choosing). A `REMOVED_KEYS` key
    is dropped: none of them changed what a run computes."""
    flat = _flatten_toml(d)
    for key in REMOVED_KEYS:
        flat.pop(key, None)
    # A run saved before document-aware attention existed attended across documents: it keeps doing so.
    flat.setdefault("data.cross_document_attention", True)
    if flat.get("offload.optimizer") == "auto" and flat.get("offload.device_state_units") == 0:
        flat["offload.device_state_units"] = -1
    model_keys = {k: v for k, v in flat.items() if k.startswith("model.")}
    rest = {k: v for k, v in flat.items() if not k.startswith("model.")}
    cfg = dataclasses.replace(TrainConfig(), model=_saved_model({k[6:]: v for k, v in model_keys.items()}))
    return apply_overrides(cfg, rest)


def _saved_model(fields: dict[str, Any]) -> ModelConfig:
    """A saved model section: every field it gives kept; one it lacks (a config saved before that field
    existed) takes its named size's value, or llama-tiny's under a name of no size."""
    name = fields.pop("name", ModelConfig.name)
    return ModelConfig.named(name, **fields) if name in SIZE_SHAPES else ModelConfig(name=name, **fields)


# ---------------------------------------------------------------------------------------------------
# --help: every key with its type or choices, default and meaning, from the dataclasses themselves.
# ---------------------------------------------------------------------------------------------------

_FIELD_LINE = re.compile(r"^    (\w+): [^=]+= .*?(?:  # (.*))?$")


def field_meanings(cls: type) -> dict[str, str]:
    """{field: its meaning}: the comment beside the field in `jaxzero/config.py`, else the comment lines
    right above it."""
    meanings: dict[str, str] = {}
    above: list[str] = []
    for line in inspect.getsource(cls).splitlines():
        stripped = line.strip()
        if line.startswith("    #"):
            above.append(stripped.lstrip("# "))
            continue
        m = _FIELD_LINE.match(line)
        if m:
            meanings[m.group(1)] = m.group(2) or " ".join(above)
        above = []
    return meanings


def _type_text(typ: Any) -> str:
    if get_origin(typ) is Literal:
        return " | ".join(str(c) for c in get_args(typ))
    return typ.__name__


def help_text() -> str:
    """The `--help` listing: every key, grouped by section, with its type or choices, its default and
    its meaning."""
    groups: list[tuple[str, type, Any]] = [("", TrainConfig, TrainConfig())]
    groups += [(f"{sec}.", cls, cls()) for sec, cls in SECTIONS.items()]
    lines = []
    for prefix, cls, defaults in groups:
        hints, meanings = typing.get_type_hints(cls), field_meanings(cls)
        title = prefix[:-1] if prefix else "run"
        summary = " ".join((cls.__doc__ or "").split("\n\n")[0].split())  # the first paragraph
        lines.append(f"\n[{title}] {summary}")
        for f in dataclasses.fields(cls):
            if cls is TrainConfig and f.name in SECTIONS:  # the sections, listed below
                continue
            default = getattr(defaults, f.name)
            lines.append(
                f"  --{prefix}{f.name}  ({_type_text(hints[f.name])}, default {default!r})\n"
                f"      {meanings.get(f.name, '')}"
            )
    return "\n".join(lines)
