"""PEFT's LoRA adapter format: export jaxzero's adapters for `peft.PeftModel.from_pretrained`, and import
one back. (Merging adapters into a base for a plain export: `jaxzero.finetune.merged.merged_params`.)

A PEFT LoRA adapter is a directory of two files (what PEFT's `save_pretrained` writes and reads):

    adapter_config.json        {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": r, "lora_alpha": alpha,
                                "target_modules": ["q_proj", "v_proj", ...], ...}
    adapter_model.safetensors  base_model.model.model.layers.{i}.{self_attn|mlp}.{proj}.lora_A.weight (r, in)
                               base_model.model.model.layers.{i}.{self_attn|mlp}.{proj}.lora_B.weight (out, r)

PEFT saves the tensors without the adapter's name ("default"), adding it back on load. jaxzero's adapters
(`jaxzero.finetune.adapters`) are the same matrices transposed, lora_a (in, r) = lora_A.weight.T and
lora_b (r, out) = lora_B.weight.T; both apply y += x @ lora_a @ lora_b * (lora_alpha / r).

Exports also hold jaxzero's marker `.jaxzero-export` (`jaxzero.storage.export_dir`), which PEFT ignores.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import jax
import numpy as np

from jaxzero.config import LORA_TARGETS, CheckpointError, ConfigError, FinetuneConfig, ModelConfig
from jaxzero.finetune.adapters import TARGET_PATHS, block_adapter_shapes
from jaxzero.interop.safetensors import SafetensorsError, SafetensorsReader, SafetensorsWriter, TensorSpec
from jaxzero.models import ModelParams, build_model
from jaxzero.storage import export_dir

ADAPTER_CONFIG_NAME = "adapter_config.json"
ADAPTER_WEIGHTS_NAME = "adapter_model.safetensors"

# PeftModelForCausalLM holds the transformers model as `base_model` (a LoraModel) whose `model` is the
# `*ForCausalLM`, whose decoder is `model`: hence the doubled "model." of every key.
_PREFIX = "base_model.model.model.layers."
# A key PEFT writes for one of the Llama family's projections; a headless base (LlamaModel) lacks the
# inner "model.".
_KEY = re.compile(
    r"^base_model\.model\.(?:model\.)?layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$"
)
# PEFT's module name of each target (q_proj ...) -> finetune.lora_targets' name (q ...).
_TARGET_OF_MODULE = {proj: name for name, (_, proj) in TARGET_PATHS.items()}
# The families whose blocks have PEFT's projections (q_proj ... down_proj).
PEFT_FAMILIES = ("llama", "gemma3", "gpt_oss")
# Stored dtypes import reads (and converts to float32).
_FLOAT_CODES = ("F64", "F32", "F16", "BF16")

# adapter_config.json fields whose other values change what the adapter computes beyond
# y += x @ A^T @ B^T * alpha / r on every layer's projections: {field: the values allowed}.
_MUST_BE = {
    "fan_in_fan_out": (False, None),
    "use_dora": (False, None),
    "use_rslora": (False, None),
    "bias": ("none", None),
    "lora_bias": (False, None),
    "modules_to_save": (None, []),
    "rank_pattern": ({}, None),
    "alpha_pattern": ({}, None),
    "layer_replication": (None,),
    "trainable_token_indices": (None,),
    "target_parameters": (None, []),
    "alora_invocation_tokens": (None,),
    "use_qalora": (False, None),
}
# init_lora_weights values whose initialisation rewrote the base weights as well as the adapters: the
# adapter is only right over that rewritten base, which the original checkpoint is not.
_BASE_REWRITING_INITS = ("pissa", "olora", "corda", "loftq")


# -------------------------------------------------------------------------------------------------
# Shared checks
# -------------------------------------------------------------------------------------------------


def _check_finetune(ft: FinetuneConfig) -> None:
    """ValueError for settings no adapter has: rank < 1, alpha <= 0, no or unknown targets."""
    names = [t.strip() for t in ft.lora_targets.split(",") if t.strip()]
    unknown = [t for t in names if t not in LORA_TARGETS]
    if ft.lora_rank < 1 or not ft.lora_alpha > 0 or unknown or not names:
        raise ValueError(
            f"finetune settings lora_rank={ft.lora_rank}, lora_alpha={ft.lora_alpha}, "
            f"lora_targets={ft.lora_targets!r} describe no LoRA adapter: the rank must be >= 1, alpha > 0, "
            f"and the targets some of {', '.join(LORA_TARGETS)} (unknown: {unknown or 'none'})."
        )


def _check_family(model_cfg: ModelConfig) -> None:
    """ValueError for a base whose blocks have none of PEFT's projection names."""
    if model_cfg.family not in PEFT_FAMILIES:
        raise ValueError(
            f"model {model_cfg.name!r} is of family {model_cfg.family!r}: PEFT LoRA adapters here are the "
            "projections of the llama family (Llama, Qwen2, Qwen3, Mistral), Gemma 3 and gpt-oss."
        )


def _block_shapes(
    model_cfg: ModelConfig, ft: FinetuneConfig
) -> dict[tuple[str, str], dict[str, tuple[int, ...]]]:
    """{(group, proj): {"lora_a": (in, r), "lora_b": (r, out)}} of one block of `model_cfg` under `ft`."""
    _check_family(model_cfg)
    shapes = block_adapter_shapes(build_model(model_cfg), ft)
    return {
        (group, proj): {k: tuple(s.shape) for k, s in pair.items()}
        for group, projs in shapes.items()
        for proj, pair in projs.items()
    }


def _leaf_shapes(tree: Any, prefix: tuple[str, ...] = ()) -> dict[tuple[str, ...], tuple[int, ...]]:
    """{key path: shape} of every leaf of a nested dict."""
    if isinstance(tree, dict):
        out: dict[tuple[str, ...], tuple[int, ...]] = {}
        for k, v in tree.items():
            out.update(_leaf_shapes(v, (*prefix, str(k))))
        return out
    return {prefix: tuple(np.shape(tree))}


def _check_adapters(adapters: ModelParams, model_cfg: ModelConfig, ft: FinetuneConfig) -> None:
    """ValueError listing every adapter leaf that is missing, unexpected or mis-shaped for `model_cfg`
    under `ft` (rank, targets)."""
    if adapters.embed or adapters.head:
        raise ValueError(
            "adapters hold embedding or head entries (embed keys "
            f"{sorted(adapters.embed)}, head keys {sorted(adapters.head)}): PEFT LoRA adapters here are the "
            "blocks' projections only; embed and head must be {}."
        )
    if len(adapters.blocks) != model_cfg.num_layers:
        raise ValueError(
            f"adapters have {len(adapters.blocks)} blocks but model {model_cfg.name!r} has "
            f"num_layers={model_cfg.num_layers}: export the adapters with the model config they were "
            "trained with."
        )
    want = {
        (group, proj, k): shape
        for (group, proj), pair in _block_shapes(model_cfg, ft).items()
        for k, shape in pair.items()
    }
    problems = []
    for i, block in enumerate(adapters.blocks):
        have = _leaf_shapes(block)
        for path, shape in want.items():
            if path not in have:
                problems.append(f"block {i}: missing {'/'.join(path)} {shape}")
            elif have[path] != shape:
                problems.append(f"block {i}: {'/'.join(path)} has shape {have[path]}, expected {shape}")
        problems += [f"block {i}: unexpected {'/'.join(p)}" for p in have if p not in want]
    if problems:
        raise ValueError(
            f"adapters do not match model {model_cfg.name!r} (hidden {model_cfg.hidden_size}, "
            f"intermediate {model_cfg.intermediate_size}) with lora_rank={ft.lora_rank}, "
            f"lora_targets={','.join(ft.targets)!r}:\n  " + "\n  ".join(problems)
        )


# -------------------------------------------------------------------------------------------------
# Export
# -------------------------------------------------------------------------------------------------


def _peft_name(layer: int, group: str, proj: str, which: str) -> str:
    """The saved key of layer `layer`'s `group.proj` adapter matrix `which` ("A" or "B")."""
    return f"{_PREFIX}{layer}.{group}.{proj}.lora_{which}.weight"


def _json_number(x: float) -> int | float:
    """`x` as an int where it is one (PEFT's configs hold lora_alpha as an int), else as a float."""
    return int(x) if float(x).is_integer() else float(x)


def adapter_config(ft: FinetuneConfig, base_model_name_or_path: str = "") -> dict[str, Any]:
    """The adapter_config.json of adapters trained under `ft`: PEFT's LoraConfig with the fields that
    every PEFT release since 0.13 reads, each set to what jaxzero's adapters compute. An empty
    `base_model_name_or_path` is written as null (PEFT's value when none is known)."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path or None,
        "revision": None,
        "inference_mode": True,
        "auto_mapping": None,
        "r": ft.lora_rank,
        "lora_alpha": _json_number(ft.lora_alpha),
        "lora_dropout": float(ft.lora_dropout),
        "target_modules": [TARGET_PATHS[t][1] for t in ft.targets],
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "modules_to_save": None,
        "layers_to_transform": None,
        "layers_pattern": None,
        "rank_pattern": {},
        "alpha_pattern": {},
    }


def _write_json(path: Path, obj: Any) -> None:
    tmp = path.with_name(path.name + ".partial")  # export_dir removes it if the export fails
    tmp.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)


def export_peft_adapter(
    adapters: ModelParams,
    model_cfg: ModelConfig,
    ft: FinetuneConfig,
    out_dir: str | os.PathLike[str],
    base_model_name_or_path: str = "",
    *,
    overwrite: bool = False,
    source: dict[str, Any] | None = None,
) -> Path:
    """Write `adapters` as a PEFT LoRA adapter directory `out_dir`; returns `out_dir` as a Path.

    adapters: ModelParams(embed={}, blocks=(one dict per block), head={}) of float32 lora_a (in, r) and
        lora_b (r, out) for exactly `ft.targets` in every block (`jaxzero.finetune.adapters`); NumPy or
        jax arrays on any device. Anything missing, unexpected or mis-shaped raises ValueError listing it.
    model_cfg: the base's (llama family) config; ft: the adapters' rank, alpha, dropout and targets.
    base_model_name_or_path: recorded in adapter_config.json (PEFT's hint of which base to load).
    overwrite, source: as for `export_hf`: `out_dir` must be new, empty or an earlier jaxzero export (a
        finished one replaced only with `overwrite`); a directory holding anything else is refused with
        `jaxzero.storage.export_dir.ExportRefused` (a FileExistsError) before anything is written.

    Writes adapter_model.safetensors (float32 lora_A.weight (r, in) and lora_B.weight (out, r) per
    adapted projection, the transposes of lora_a and lora_b) and then adapter_config.json
    (`adapter_config`). Each file is written under a temporary name and renamed when complete; if
    anything fails, the files this call wrote are removed.
    """
    _check_finetune(ft)
    _check_adapters(adapters, model_cfg, ft)
    config = adapter_config(ft, base_model_name_or_path)
    shapes = _block_shapes(model_cfg, ft)
    specs = []
    for i in range(model_cfg.num_layers):
        for (group, proj), pair in shapes.items():
            specs.append(
                TensorSpec(_peft_name(i, group, proj, "A"), np.dtype(np.float32), pair["lora_a"][::-1])
            )
            specs.append(
                TensorSpec(_peft_name(i, group, proj, "B"), np.dtype(np.float32), pair["lora_b"][::-1])
            )

    out = Path(out_dir)
    names = [ADAPTER_CONFIG_NAME, ADAPTER_WEIGHTS_NAME]
    with export_dir.writing(
        out, format="peft", dtype="float32", files=names, overwrite=overwrite, source=source
    ) as export:  # refuses a directory holding anything but an earlier export, before writing
        # PEFT (through transformers) refuses a safetensors file whose metadata lacks "format".
        with SafetensorsWriter(out / ADAPTER_WEIGHTS_NAME, specs, metadata={"format": "pt"}) as writer:
            for i, block in enumerate(adapters.blocks):
                host = jax.device_get(block)  # one block's adapters on the host at a time
                for group, proj in shapes:
                    pair = host[group][proj]
                    for which, key in (("A", "lora_a"), ("B", "lora_b")):
                        array = np.array(np.asarray(pair[key]).T, dtype=np.float32, order="C")
                        writer.write(_peft_name(i, group, proj, which), array)
        # adapter_config.json last: a directory with one holds a complete adapter.
        _write_json(out / ADAPTER_CONFIG_NAME, config)
        export.finish(names)
    return out


# -------------------------------------------------------------------------------------------------
# Import
# -------------------------------------------------------------------------------------------------


def _read_config(path: Path) -> dict[str, Any]:
    """adapter_config.json of the adapter directory `path`, as a dict; CheckpointError when absent or
    unreadable."""
    file = path / ADAPTER_CONFIG_NAME
    if not file.is_file():
        raise CheckpointError(
            f"{path} holds no {ADAPTER_CONFIG_NAME}: not a PEFT adapter directory (what PEFT's "
            "`save_pretrained` or jaxzero's export_peft_adapter writes)."
        )
    try:
        config = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{file} cannot be read as JSON ({e}): download or export it again.") from e
    if not isinstance(config, dict):
        raise CheckpointError(f"{file} holds a JSON {type(config).__name__}, not PEFT's object of settings.")
    return config


def _settings(config: dict[str, Any], file: Path) -> tuple[int, float, float, list[str] | None]:
    """(r, lora_alpha, lora_dropout, the targets target_modules names or None for a pattern) of a PEFT
    adapter config; CheckpointError naming each setting jaxzero's adapters cannot compute."""
    problems = []
    if config.get("peft_type") != "LORA":
        raise CheckpointError(
            f"{file}: peft_type is {config.get('peft_type')!r}; jaxzero reads LoRA adapters "
            "(peft_type 'LORA')."
        )
    for field, allowed in _MUST_BE.items():
        if field in config and config[field] not in allowed:
            problems.append(f"{field}={config[field]!r} (jaxzero computes {allowed[0]!r})")
    init = config.get("init_lora_weights")
    if isinstance(init, str) and init.lower().startswith(_BASE_REWRITING_INITS):
        problems.append(
            f"init_lora_weights={init!r} rewrote the base weights too (convert the adapter with PEFT's "
            "path_initial_model_for_weight_conversion when saving)"
        )
    r, alpha, dropout = config.get("r"), config.get("lora_alpha"), config.get("lora_dropout", 0.0)
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        problems.append(f"r={r!r} is not a rank >= 1")
    if not isinstance(alpha, int | float) or isinstance(alpha, bool) or not alpha > 0:
        problems.append(f"lora_alpha={alpha!r} is not a number > 0")
    if not isinstance(dropout, int | float) or isinstance(dropout, bool) or not 0 <= dropout < 1:
        problems.append(f"lora_dropout={dropout!r} is not in [0, 1)")
    targets: list[str] | None = None
    modules = config.get("target_modules")
    if isinstance(modules, list):
        # PEFT matches a listed name against a module's full name or its last dotted parts.
        last = [str(m).rsplit(".", 1)[-1] for m in modules]
        other = [m for m, p in zip(modules, last) if p not in _TARGET_OF_MODULE]
        if other:
            problems.append(f"target_modules names {other}: jaxzero adapts only {sorted(_TARGET_OF_MODULE)}")
        targets = [_TARGET_OF_MODULE[p] for p in last if p in _TARGET_OF_MODULE]
    elif not isinstance(
        modules, str
    ):  # a pattern ("all-linear", a regex): the saved keys say what it matched
        problems.append(f"target_modules={modules!r} is neither a list of module names nor a pattern")
    if problems:
        raise CheckpointError(
            f"{file}: this adapter computes what jaxzero's LoRA does not:\n  " + "\n  ".join(problems)
        )
    assert isinstance(r, int) and isinstance(alpha, int | float)
    return r, float(alpha), float(dropout), targets


def _open_weights(path: Path) -> SafetensorsReader:
    file = path / ADAPTER_WEIGHTS_NAME
    if not file.is_file():
        others = sorted(p.name for p in path.glob("adapter_model.*"))
        hint = (
            f" It holds {others}: jaxzero reads only safetensors; load the adapter with PEFT and save it "
            "again with `save_pretrained(dir)` (safetensors is its default format)."
            if others
            else ""
        )
        raise CheckpointError(f"{path} has no {ADAPTER_WEIGHTS_NAME}.{hint}")
    try:
        return SafetensorsReader(file)
    except SafetensorsError as e:
        raise CheckpointError(str(e)) from e
    except OSError as e:
        raise CheckpointError(f"{file} cannot be read ({e.strerror or e}): check its permissions.") from e


def import_peft_adapter(
    path: str | os.PathLike[str], model_cfg: ModelConfig, ft: FinetuneConfig | None = None
) -> tuple[FinetuneConfig, ModelParams]:
    """(settings, adapters) of the PEFT LoRA adapter directory `path` (PEFT's `save_pretrained` layout
    or `export_peft_adapter`'s), for a base of `model_cfg` (llama family).

    adapters: ModelParams(embed={}, blocks=(one dict per block), head={}) of float32 NumPy lora_a
        (in, r) and lora_b (r, out) (the stored matrices, transposed; any stored float dtype is
        converted to float32), the layout of `jaxzero.finetune.adapters`.
    settings: without `ft`, FinetuneConfig(method="lora") with the adapter's r, lora_alpha, lora_dropout
        and targets (base_dtype left at its default). With `ft` (a run's settings): `ft` itself, after
        checking that its lora_rank, lora_alpha and targets are the adapter's (ConfigError naming each
        that differs); its dropout and base_dtype are the run's own.

    CheckpointError (a ConfigError) names every problem: settings jaxzero's LoRA does not compute (DoRA,
    rsLoRA, fan_in_fan_out, biases, modules_to_save, rank or alpha patterns, ...), tensors that are
    missing, unexpected (e.g. lm_head or embedding adapters) or mis-shaped for `model_cfg`, adapters on
    only some layers, and target_modules that disagree with the saved tensors.
    """
    src = Path(path)
    if not src.is_dir():
        raise CheckpointError(f"PEFT adapter directory {str(src)!r} does not exist.")
    config = _read_config(src)
    config_file = src / ADAPTER_CONFIG_NAME
    r, alpha, dropout, listed = _settings(config, config_file)
    if model_cfg.family not in PEFT_FAMILIES:
        raise CheckpointError(
            f"model {model_cfg.name!r} is of family {model_cfg.family!r}: PEFT LoRA adapters here are the "
            "projections of the llama family (Llama, Qwen2, Qwen3, Mistral), Gemma 3 and gpt-oss."
        )
    weights = src / ADAPTER_WEIGHTS_NAME
    with _open_weights(src) as reader:
        # Which (layer, projection) pairs the file holds, from its keys.
        found: dict[tuple[int, str, str, str], str] = {}
        unexpected = []
        for name in reader:
            m = _KEY.match(name)
            if m is None or (m[2], m[3]) not in TARGET_PATHS.values():
                unexpected.append(name)
                continue
            found[(int(m[1]), m[2], m[3], m[4])] = name
        layers = sorted({k[0] for k in found})
        per_layer = {i: {(g, p) for (j, g, p, _) in found if j == i} for i in layers}
        projs = set().union(*per_layer.values()) if per_layer else set()
        targets = [t for t in LORA_TARGETS if TARGET_PATHS[t] in projs]
        problems = []
        if unexpected:
            problems.append(
                f"tensors jaxzero's adapters do not have ({len(unexpected)}; it adapts the blocks' "
                f"{', '.join(sorted(_TARGET_OF_MODULE))}): {sorted(unexpected)[:8]}"
                + (" ..." if len(unexpected) > 8 else "")
            )
        if not found and not unexpected:
            problems.append("no adapter tensors at all")
        if found and layers != list(range(model_cfg.num_layers)):
            problems.append(
                f"adapters on layers {layers}, but model {model_cfg.name!r} has {model_cfg.num_layers} "
                f"layers (0..{model_cfg.num_layers - 1}) and jaxzero adapts every one (layers_to_transform="
                f"{config.get('layers_to_transform')!r})"
            )
        uneven = {i: sorted(p for _, p in s) for i, s in per_layer.items() if s != projs}
        if uneven:
            problems.append(
                f"layers adapt different projections ({sorted(p for _, p in projs)} among them; these "
                f"layers only some: {uneven}): jaxzero adapts the same projections in every layer"
            )
        halves = [
            f"{i}.{g}.{p}.lora_{w}"
            for (i, g, p) in {k[:3] for k in found}
            for w in "AB"
            if (i, g, p, w) not in found
        ]
        if halves:
            problems.append(f"missing halves of an adapter pair: {sorted(halves)}")
        if listed is not None and found and sorted(set(listed)) != sorted(targets):
            problems.append(
                f"target_modules {config.get('target_modules')} disagree with the saved tensors, which adapt "
                f"{[TARGET_PATHS[t][1] for t in targets]}"
            )
        if problems:
            raise CheckpointError(
                f"{weights}: cannot be used as jaxzero adapters:\n  " + "\n  ".join(problems)
            )

        settings = FinetuneConfig(
            method="lora", lora_rank=r, lora_alpha=alpha, lora_dropout=dropout, lora_targets=",".join(targets)
        )
        shapes = _block_shapes(model_cfg, settings)
        mismatched = []
        for (_, g, p, w), name in sorted(found.items()):
            info = reader.tensors[name]
            want = shapes[(g, p)]["lora_a" if w == "A" else "lora_b"][::-1]
            if info.shape != want:
                mismatched.append(f"{name}: stored {list(info.shape)}, needed {list(want)}")
            elif info.dtype not in _FLOAT_CODES:
                mismatched.append(f"{name}: dtype {info.dtype} is not one of {list(_FLOAT_CODES)}")
        if mismatched:
            raise CheckpointError(
                f"{weights}: the adapters do not fit model {model_cfg.name!r} (hidden "
                f"{model_cfg.hidden_size}, intermediate {model_cfg.intermediate_size}, heads "
                f"{model_cfg.num_heads}/{model_cfg.num_kv_heads} of {model_cfg.head_dim}) at r={r} "
                f"({len(mismatched)}):\n  " + "\n  ".join(mismatched)
            )
        blocks = []
        for i in range(model_cfg.num_layers):
            block: dict[str, Any] = {}
            for g, p in shapes:
                block.setdefault(g, {})[p] = {
                    # A fresh float32 array that owns its memory, never a view of the file.
                    key: np.array(reader[found[(i, g, p, w)]].T, dtype=np.float32, order="C")
                    for w, key in (("A", "lora_a"), ("B", "lora_b"))
                }
            blocks.append(block)
    adapters = ModelParams({}, tuple(blocks), {})
    if ft is None:
        return settings, adapters
    differ = [
        (field, run, mine)
        for field, run, mine in (
            ("lora_rank", ft.lora_rank, r),
            ("lora_alpha", float(ft.lora_alpha), alpha),
            ("lora_targets", ",".join(ft.targets), ",".join(targets)),
        )
        if run != mine
    ]
    if differ:
        raise ConfigError(
            f"the PEFT adapter {src} does not match the run's finetune settings:\n  "
            + "\n  ".join(f"finetune.{f}: run has {run!r}, adapter has {mine!r}" for f, run, mine in differ)
            + "\nUse the adapter's settings: "
            + " ".join(f"--finetune.{f}={mine}" for f, _, mine in differ)
        )
    return ft, adapters


__all__ = [
    "ADAPTER_CONFIG_NAME",
    "ADAPTER_WEIGHTS_NAME",
    "adapter_config",
    "export_peft_adapter",
    "import_peft_adapter",
]
