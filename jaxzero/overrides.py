"""How a run's config is built: defaults, then a TOML preset, then `--section.key=value` overrides.

A run's config is built in three layers, later ones winning:

1. the dataclass defaults of `jaxzero.config` (the built-in default run: a tiny Llama on bundled bytes),
2. an optional TOML preset (`--config=configs/NAME.toml`),
3. command-line overrides `--section.key=value` (top-level keys: `--steps`, `--seed`, `--run_dir`,
   `--determinism`).

`model.name` selects a named size (`jaxzero.models.sizes`) or, as `hf:DIR`, the shape of a Hugging
Face checkpoint (`jaxzero.interop`), or, as `orbax:DIR`, of an Orbax export's `model.json`
(`jaxzero.storage.orbax_export`); every other `model.*` key then overrides one field of it. All
values are type-checked against the field annotations, and `parse_args` ends with `validate`.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import re
import tomllib
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

from jaxzero import deepspeed
from jaxzero.config import (
    SECTIONS,
    TOP_LEVEL_KEYS,
    ConfigError,
    ModelConfig,
    TrainConfig,
)
from jaxzero.config.checks import validate
from jaxzero.config.keys import (
    COMMAND_LINE,
    DEEPSPEED_SOURCE,
    REMOVED_KEYS,
    all_keys,
    coerce,
    field_types,
    flatten_toml,
    removed_key,
    set_keys,
    unknown_key,
)
from jaxzero.deepspeed import Translation
from jaxzero.interop import model_config_from_hf
from jaxzero.storage import orbax_export

log = logging.getLogger(__name__)  # the library speaks through logging (`jaxzero.run.console`)


def apply_overrides(cfg: TrainConfig, overrides: dict[str, Any]) -> TrainConfig:
    """Return `cfg` with dotted `overrides` applied (values as strings or TOML-typed values).

    `model.name` is applied first: it resets the model section to that named size (or, for
    `hf:DIR`, to the shape of a Hugging Face checkpoint whose weights the run starts from; for
    `orbax:DIR`, of an Orbax export, its compute dtype and attention the run's own as for `hf:DIR`), and the
    other `model.*` keys then override single fields of it (`jaxzero.config.keys.set_keys`).
    """
    name = overrides.get("model.name")
    if isinstance(name, str) and name.startswith("hf:"):  # a Hugging Face checkpoint: its shape, and
        model = model_config_from_hf(name[3:], name=name)  # its weights to start from
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(model, init_from=name[3:]))
        overrides = {k: v for k, v in overrides.items() if k != "model.name"}
    elif isinstance(name, str) and name.startswith(orbax_export.PREFIX):  # an Orbax export: likewise
        path = name[len(orbax_export.PREFIX) :]
        model, _ = orbax_export.read_model(path, name=name)
        run_choices = {k: getattr(ModelConfig(), k) for k in orbax_export.RUN_CHOICES}
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(model, init_from=path, **run_choices))
        overrides = {k: v for k, v in overrides.items() if k != "model.name"}
    return set_keys(cfg, overrides)


def check_overrides(overrides: dict[str, Any], source: str) -> None:
    """Raise ConfigError, naming `source`, for an unknown key or a value of the wrong type, before
    anything is applied (ranges are checked on the whole config later)."""
    for key, raw in overrides.items():
        sec, _, name = key.partition(".")
        try:
            if key in TOP_LEVEL_KEYS:
                coerce(key, raw, field_types(TrainConfig)[key])
            elif key in REMOVED_KEYS:
                raise removed_key(key)
            elif sec not in SECTIONS or name not in field_types(SECTIONS[sec]):
                raise unknown_key(
                    key,
                    all_keys()
                    if sec not in SECTIONS
                    else [f"{sec}.{k}" for k in field_types(SECTIONS[sec])],
                )
            else:
                coerce(key, raw, field_types(SECTIONS[sec])[name])
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
    flat = flatten_toml(tree)
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
