"""Export jaxzero parameters as a transformers checkpoint directory, and import one back.

Memory: export converts and writes one unit (the embedding, one block, the head) at a time, so the
host holds the model once (the caller's `params`) plus one unit in the target dtype; import reads
memory-mapped safetensors and builds the float32 result one unit at a time.

Files are the safetensors format of `jaxzero.interop.safetensors` (NumPy only); transformers itself is
not needed at runtime.
"""

from __future__ import annotations

import json
import os
import re
from functools import partial
from pathlib import Path
from typing import Any

import jax
import numpy as np

from jaxzero.config import CheckpointError, ConfigError, ModelConfig
from jaxzero.interop.hf_config_map import CONFIG_NAME, EXPORT_DTYPES, hf_config, model_config_from_hf
from jaxzero.interop.hf_names import (
    BASE_ALIASES,
    BASE_PREFIX,
    IGNORED,
    HFUnit,
    get_path,
    hf_units,
    leaf_paths,
    set_path,
    unit_trees,
)
from jaxzero.interop.hf_variants import GRANITE_SCALARS
from jaxzero.interop.mxfp4 import dequantize_expert, packed_shapes
from jaxzero.interop.safetensors import SafetensorsError, SafetensorsReader, SafetensorsWriter, TensorSpec
from jaxzero.models import ModelParams
from jaxzero.primitives.deferred import Deferred, abstract, resolved
from jaxzero.storage import export_dir

WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"

# Stored dtypes import reads (and converts to float32); integer or float8 tensors mean a quantized
# checkpoint whose scales jaxzero does not model.
_FLOAT_CODES = ("F64", "F32", "F16", "BF16")


# -------------------------------------------------------------------------------------------------
# Export
# -------------------------------------------------------------------------------------------------


def _check_params(params: ModelParams, cfg: ModelConfig, units: list[HFUnit]) -> None:
    """Raise ValueError listing every leaf of `params` that is missing, unexpected or mis-shaped."""
    trees = list(unit_trees(params))
    if len(trees) != len(units):
        raise ValueError(
            f"params has {len(params.blocks)} blocks but model.num_layers={cfg.num_layers}; "
            "export the params with the config they were trained with."
        )
    problems = []
    for unit, tree in zip(units, trees):
        have = dict(leaf_paths(tree))
        want = {t.path: t for t in unit.tensors}
        for path, t in want.items():
            if path not in have:
                problems.append(f"{unit.label}: missing {'/'.join(path)} (-> {t.hf_name})")
            elif tuple(np.shape(have[path])) != t.full_shape:
                problems.append(
                    f"{unit.label}: {'/'.join(path)} has shape {tuple(np.shape(have[path]))}, "
                    f"the config needs {t.full_shape}"
                )
        problems += [f"{unit.label}: unexpected {'/'.join(p)}" for p in have if p not in want]
    if problems:
        raise ValueError(
            f"params do not match model config {cfg.name!r} ({cfg.family}, tie_embeddings="
            f"{cfg.tie_embeddings}):\n  " + "\n  ".join(problems)
        )


def _write_json(path: Path, obj: Any) -> None:
    tmp = path.with_name(path.name + ".partial")
    tmp.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)


def export_hf(
    params: ModelParams,
    cfg: ModelConfig,
    out_dir: str | os.PathLike[str],
    dtype: str = "bfloat16",
    max_shard_bytes: int = 5 * 2**30,
    *,
    overwrite: bool = False,
    source: dict[str, Any] | None = None,
) -> list[Path]:
    """Write `params` as a transformers checkpoint in `out_dir`; returns the written paths.

    params: a `cfg`-shaped ModelParams; leaves float32/bfloat16, NumPy or jax arrays on any device
        (each unit is fetched with `jax.device_get` when it is written), or a unit a
        `jaxzero.primitives.deferred.Deferred`, read when it is written (`checkpoint.masters_by_unit`).
    dtype: "bfloat16" (default), "float32" or "float16", the dtype of the written tensors (rounded to
        nearest even, as torch's `.to()` does) and of config.json's `dtype`.
    max_shard_bytes: if the tensors total more than this, they are split into
        `model-0000i-of-0000N.safetensors` files of at most this size (a single larger tensor gets a
        shard of its own) plus `model.safetensors.index.json`; otherwise one `model.safetensors`.
    overwrite: replace an earlier export in `out_dir` (the files its marker lists are deleted first,
        so no stale shard survives). `out_dir` must be new, empty or an earlier jaxzero export; anything
        else is refused (`jaxzero.storage.export_dir.ExportRefused`, a FileExistsError) with or without it.
    source: what is exported (e.g. {"run_dir": ..., "step": ...}), recorded in the export's marker.

    Returns [config.json, weight file(s)..., index (when sharded)]; the directory also holds the marker
    `.jaxzero-export`. The files are written unit by unit: the host holds one unit in the target dtype
    at a time besides `params` itself. If anything fails, the files this call wrote are removed.
    """
    if dtype not in EXPORT_DTYPES:
        raise ValueError(f"dtype={dtype!r} is not one of {list(EXPORT_DTYPES)}.")
    if max_shard_bytes < 1:
        raise ValueError(f"max_shard_bytes={max_shard_bytes} must be >= 1.")
    np_dtype = EXPORT_DTYPES[dtype]
    units = hf_units(cfg)
    _check_params(abstract(params), cfg, units)
    config = hf_config(cfg, dtype)

    # Plan the shards: consecutive tensors in save order, greedily packed (what transformers does).
    shards: list[list[TensorSpec]] = [[]]
    shard_bytes = 0
    for unit in units:
        for t in unit.tensors:
            spec = TensorSpec(t.hf_name, np_dtype, t.hf_shape)
            if shards[-1] and shard_bytes + spec.nbytes > max_shard_bytes:
                shards.append([])
                shard_bytes = 0
            shards[-1].append(spec)
            shard_bytes += spec.nbytes
    n = len(shards)
    files = [WEIGHTS_NAME] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]

    out = Path(out_dir)
    names = [CONFIG_NAME, *files, *([INDEX_NAME] if n > 1 else [])]
    with export_dir.writing(
        out, format="hf", dtype=dtype, files=names, overwrite=overwrite, source=source
    ) as export:  # refuses a directory holding anything but an earlier export, before writing
        written = _write_shards(out, params, units, np_dtype, shards, files)
        if n > 1:
            index = {
                "metadata": {
                    "total_size": sum(s.nbytes for specs in shards for s in specs),
                    "total_parameters": sum(int(np.prod(s.shape)) for specs in shards for s in specs),
                },
                "weight_map": {spec.name: files[k] for k, specs in enumerate(shards) for spec in specs},
            }
            _write_json(out / INDEX_NAME, index)
            written.append(out / INDEX_NAME)
        # config.json last: a directory with a config.json holds a complete checkpoint.
        _write_json(out / CONFIG_NAME, config)
        export.finish([CONFIG_NAME, *(p.name for p in written)])
    return [out / CONFIG_NAME, *written]


def _write_shards(
    out: Path,
    params: ModelParams,
    units: list[HFUnit],
    np_dtype: Any,
    shards: list[list[TensorSpec]],
    files: list[str],
) -> list[Path]:
    """Write the weight files `files` (shard k holding `shards[k]`) in `out`, casting to `np_dtype`,
    one unit of `params` on the host at a time; the paths written. On an exception the unfinished file
    is deleted (the caller's `export_dir.writing` deletes the finished ones)."""
    shard_of = {spec.name: k for k, specs in enumerate(shards) for spec in specs}
    written: list[Path] = []
    writer: SafetensorsWriter | None = None
    current = -1
    try:
        for unit, tree in zip(units, unit_trees(params)):
            host = jax.device_get(resolved(tree))  # one unit on the host at a time (read now if deferred)
            for t in unit.tensors:
                k = shard_of[t.hf_name]
                if k != current:  # shards hold consecutive tensors: finish the last one, start the next
                    if writer is not None:
                        written.append(writer.close())
                    # transformers 4 refuses a safetensors file whose metadata lacks "format".
                    writer = SafetensorsWriter(out / files[k], shards[k], metadata={"format": "pt"})
                    current = k
                leaf = t.take(np.asarray(get_path(host, t.path)))
                # One copy: transpose (Llama kernels) or interleave, and cast together, C-contiguous.
                array = t.to_hf(leaf, np_dtype)
                assert writer is not None
                writer.write(t.hf_name, array)
                del array
            del host
        assert writer is not None
        written.append(writer.close())
        writer = None
    except BaseException:
        if writer is not None:
            writer.abort()
        raise
    return written


# -------------------------------------------------------------------------------------------------
# Import
# -------------------------------------------------------------------------------------------------


def _reader(path: Path) -> SafetensorsReader:
    """An open reader of `path`. A file that is truncated, corrupt or unreadable raises CheckpointError
    (a ConfigError: a refusal before training, exit 2) naming the file and what is wrong with it."""
    try:
        return SafetensorsReader(path)
    except SafetensorsError as e:
        raise CheckpointError(str(e)) from e
    except OSError as e:
        raise CheckpointError(
            f"{path} cannot be read ({e.strerror or e}): check its permissions, or download it again."
        ) from e


def _open_weights(ckpt: Path) -> tuple[dict[str, SafetensorsReader], list[SafetensorsReader]]:
    """({tensor name: reader of the file holding it}, all readers) of a checkpoint directory; a file
    that cannot be read raises CheckpointError naming it."""
    index_file, single = ckpt / INDEX_NAME, ckpt / WEIGHTS_NAME
    if index_file.is_file():
        try:
            index = json.loads(index_file.read_text())
            weight_map = index["weight_map"]
        except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, OSError) as e:
            if isinstance(e, KeyError | TypeError):
                what = "it holds no 'weight_map' object"
            elif isinstance(e, OSError):
                what = f"it cannot be read: {e.strerror or e}"
            else:
                what = f"not valid JSON: {e}"
            raise CheckpointError(
                f"{index_file} is not a valid index ({what}): the download is incomplete or the file "
                "damaged; download it again."
            ) from e
        if not isinstance(weight_map, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
        ):
            raise CheckpointError(f"{index_file}: weight_map must map tensor names to file names.")
        shard_files = sorted(set(weight_map.values()))
        missing = [f for f in shard_files if not (ckpt / f).is_file()]
        if missing:
            raise CheckpointError(f"{index_file} names shard files that do not exist in {ckpt}: {missing}.")
        readers: dict[str, SafetensorsReader] = {}
        try:
            for f in shard_files:
                readers[f] = _reader(ckpt / f)
            absent = [f"{n} (in {f})" for n, f in weight_map.items() if n not in readers[f]]
            if absent:
                raise CheckpointError(f"{index_file} lists tensors its shard files do not contain: {absent}.")
        except BaseException:
            for r in readers.values():
                r.close()
            raise
        return {n: readers[f] for n, f in weight_map.items()}, list(readers.values())
    if single.is_file():
        reader = _reader(single)
        return {n: reader for n in reader}, [reader]
    others = sorted(p.name for p in ckpt.glob("*.bin")) + sorted(p.name for p in ckpt.glob("*.pt*"))
    hint = (
        f" It holds {others}: jaxzero reads only safetensors; re-save with transformers' "
        "`save_pretrained(dir)` (safetensors is its default format)."
        if others
        else ""
    )
    raise CheckpointError(f"{ckpt} has neither {WEIGHTS_NAME} nor {INDEX_NAME}.{hint}")


def _read_params(cfg: ModelConfig, ckpt: Path) -> ModelParams:
    """float32 NumPy ModelParams of `cfg`'s shape from the safetensors of `ckpt`, unit by unit."""
    return resolved(_params_by_unit(cfg, ckpt))


def _params_by_unit(cfg: ModelConfig, ckpt: Path) -> ModelParams:
    """`_read_params`, each unit a `Deferred` read when resolved (every name, shape and dtype checked
    from the files' headers now, before any data is read)."""
    units = hf_units(cfg)
    where, readers = _open_weights(ckpt)
    try:
        prefix = BASE_PREFIX[cfg.family]
        ignored = IGNORED[cfg.family]
        if cfg.family in ("llama", "gpt_oss") and cfg.tie_embeddings:
            ignored = re.compile(ignored.pattern + r"|^lm_head\.weight$")
        # Resolve every name and check every shape and dtype from the headers before reading any data.
        found: dict[str, str] = {}  # canonical name -> name in the checkpoint
        missing, mismatched = [], []
        for unit in units:
            for t in unit.tensors:
                candidates = [t.hf_name]
                if t.hf_name.startswith(prefix):
                    rest = t.hf_name[len(prefix) :]
                    candidates += [rest] + [alias + rest for alias in BASE_ALIASES.get(cfg.family, ())]
                name = next((c for c in candidates if c in where), None)
                if name is None and t.mxfp4:  # stored packed: "<name>_blocks" and "<name>_scales"
                    name = next((c for c in candidates if c + "_blocks" in where), None)
                    if name is not None:
                        found[t.hf_name] = name
                        mismatched += _packed_mismatches(where, name, t.hf_shape)
                        continue
                if name is None:
                    missing.append(t.hf_name)
                    continue
                found[t.hf_name] = name
                info = where[name].tensors[name]
                if info.shape != t.hf_shape:
                    mismatched.append(
                        f"{name}: checkpoint {list(info.shape)}, config needs {list(t.hf_shape)}"
                    )
                elif info.dtype not in _FLOAT_CODES:
                    mismatched.append(
                        f"{name}: dtype {info.dtype} is not one of {list(_FLOAT_CODES)} (quantized weights?)"
                    )
        used = set(found.values()) | {n + part for n in found.values() for part in ("_blocks", "_scales")}
        unexpected = sorted(n for n in where if n not in used and not ignored.match(n))
        if missing or mismatched or unexpected:
            parts = []
            if missing:
                parts.append(f"missing tensors ({len(missing)}): {missing}")
            if unexpected:
                parts.append(f"unexpected tensors ({len(unexpected)}): {unexpected}")
            if mismatched:
                parts.append(f"shape/dtype mismatches ({len(mismatched)}): {mismatched}")
            raise CheckpointError(
                f"{ckpt}: the weights do not match its config ({cfg.family}, {cfg.num_layers} layers, hidden "
                f"{cfg.hidden_size}, tie_embeddings={cfg.tie_embeddings}):\n  " + "\n  ".join(parts)
            )

    finally:
        for r in readers:
            r.close()

    def read(unit: HFUnit) -> tuple[dict[str, Any]]:  # one unit's tensors, its files opened for it
        where, readers = _open_weights(ckpt)
        try:
            tree: dict[str, Any] = {}
            stacked: dict[tuple[str, ...], np.ndarray] = {}
            for t in unit.tensors:
                name = found[t.hf_name]
                # Always a fresh, writable float32 array that owns its memory, never a view of the file.
                if len(t.shape) == 3:  # every expert's matrix (gpt-oss): converted one expert at a time
                    array = np.empty(t.shape, np.float32)
                    for e in range(t.shape[0]):
                        array[e] = t.from_hf(_expert(where, name, e))
                else:
                    array = t.from_hf(where[name][name])  # memory-mapped: read as it is converted
                if t.part is not None:  # one expert's matrix, written into its (E, in, out) leaf
                    if t.path not in stacked:
                        stacked[t.path] = np.empty(t.leaf_shape, np.float32)
                        set_path(tree, t.path, stacked[t.path])
                    t.take(stacked[t.path])[...] = array
                    continue
                set_path(tree, t.path, array)
            return (tree,)
        finally:
            for r in readers:
                r.close()

    trees = [Deferred(partial(read, unit), 0, _shapes_tree(unit)) for unit in units]
    return ModelParams.from_units(trees)


def _expert(where: dict[str, SafetensorsReader], name: str, e: int) -> np.ndarray:
    """Expert e's matrix of the (E, ...) tensor `name` as HF holds it: a view of the memory-mapped
    file, or dequantised from its MXFP4 "<name>_blocks" and "<name>_scales" (`jaxzero.interop.mxfp4`)."""
    if name in where:
        return where[name][name][e]
    blocks, scales = name + "_blocks", name + "_scales"
    return dequantize_expert(where[blocks][blocks][e], where[scales][scales][e])


def _packed_mismatches(
    where: dict[str, SafetensorsReader], name: str, hf_shape: tuple[int, ...]
) -> list[str]:
    """What is wrong with the MXFP4 pair "<name>_blocks" / "<name>_scales" standing for a tensor HF
    holds as `hf_shape` (`jaxzero.interop.mxfp4`): each a message, none if they fit."""
    problems = []
    for part, shape in zip(("_blocks", "_scales"), packed_shapes(hf_shape)):
        info = where[name + part].tensors[name + part] if name + part in where else None
        if info is None:
            problems.append(f"{name}{part}: missing (MXFP4 stores blocks and scales together)")
        elif info.shape != shape or info.dtype != "U8":
            problems.append(
                f"{name}{part}: checkpoint {info.dtype} {list(info.shape)}, MXFP4 of {list(hf_shape)} "
                f"needs U8 {list(shape)}"
            )
    return problems


def _shapes_tree(unit: HFUnit) -> dict[str, Any]:
    """The unit's tree of float32 ShapeDtypeStructs, as `_params_by_unit` reads it."""
    tree: dict[str, Any] = {}
    for t in unit.tensors:
        set_path(tree, t.path, jax.ShapeDtypeStruct(t.full_shape, np.float32))
    return tree


def import_hf(path: str | os.PathLike[str]) -> tuple[ModelConfig, ModelParams]:
    """(ModelConfig, float32 NumPy ModelParams) of the HF checkpoint directory `path`.

    `path` holds config.json and either model.safetensors or model.safetensors.index.json with its
    shards (transformers' `save_pretrained` layout, or `export_hf`'s). Tensors may be stored in any
    floating dtype; they are converted to float32 and Llama's (out, in) projections transposed to
    jaxzero's (in, out); gpt-oss's experts, stored bf16 or MXFP4 (`jaxzero.interop.mxfp4`), are
    converted one expert at a time, their gate and up de-interleaved. Names with or without the base
    prefix ("model." / "transformer.") are accepted.
    Missing, unexpected or mis-shaped tensors raise CheckpointError listing all of them; known buffers
    (rotary inv_freq, GPT-2's attention-mask `attn.bias`) and the duplicate head of a tied model are
    skipped.
    """
    ckpt = Path(path)
    if not ckpt.is_dir():
        raise CheckpointError(f"HF checkpoint directory {str(ckpt)!r} does not exist.")
    cfg = model_config_from_hf(ckpt)
    return cfg, _read_params(cfg, ckpt)


# Fields that determine the parameter shapes (and, for gpt2, max_seq_len the wpe table); and fields
# that change the function the weights compute without changing any shape.
_SHAPE_FIELDS = ("family", "vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads")
_NUMERIC_FIELDS = ("norm_eps",)
# What the weights compute besides shapes (Llama family), compared unless check_numerics=False.
_ROPE_FIELDS = (
    "rope_theta",
    "rope_type",
    "rope_factor",
    "rope_low_freq_factor",
    "rope_high_freq_factor",
    "rope_original_max_len",
)


def load_hf_into(
    cfg: ModelConfig, path: str | os.PathLike[str], *, check_numerics: bool = True
) -> ModelParams:
    """float32 NumPy ModelParams for a run configured by `cfg`, from the HF checkpoint directory `path`.

    Checks that the checkpoint's config matches `cfg` in every shape field (family, vocab_size,
    hidden_size, num_layers, num_heads, num_kv_heads, intermediate_size, tie_embeddings,
    attention_bias, qk_norm, head_dim and the block variants (`jaxzero.config.variants`) for Llama
    and max_seq_len for GPT-2, whose position table has that many rows) and,
    unless `check_numerics=False`, in the fields that change what the weights compute (norm_eps, and
    rope_theta, rope_type, the scaling's fields and Granite's scalars for Llama; pass False to fine-tune
    with e.g. a raised rope_theta on purpose). Every mismatching field is named in one ConfigError.
    Training knobs (compute_dtype, attention_impl, init_std, Llama's max_seq_len) are the run's own and
    are not compared.
    """
    ckpt = Path(path)
    _check_hf_config(cfg, ckpt, check_numerics)
    # `cfg` now equals the checkpoint's config in every field that shapes the tensors.
    return _read_params(cfg, ckpt)


def load_hf_by_unit(
    cfg: ModelConfig, path: str | os.PathLike[str], *, check_numerics: bool = True
) -> ModelParams:
    """`load_hf_into`, each unit a `jaxzero.primitives.deferred.Deferred` read (as float32 NumPy) when
    resolved: `Trainer.init_from_params` places each before the next is read, so host RAM holds one unit of
    the checkpoint at a time. Every check is made now."""
    ckpt = Path(path)
    _check_hf_config(cfg, ckpt, check_numerics)
    return _params_by_unit(cfg, ckpt)


def _check_hf_config(cfg: ModelConfig, ckpt: Path, check_numerics: bool) -> None:
    """Raise ConfigError naming every field in which the checkpoint's config differs from `cfg`
    (see `load_hf_into`)."""
    hf = model_config_from_hf(ckpt)
    names = list(_SHAPE_FIELDS) + ["intermediate_size"]
    if cfg.family == "llama" and hf.family == "llama":
        names += ["tie_embeddings", "attention_bias", "qk_norm", "head_dim", "qk_norm_scope", "post_norm"]
        names += ["fused_projections"] + (["partial_rotary_factor"] if check_numerics else [])
        names += ["num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob"]
    if cfg.family == "gpt2":
        names.append("max_seq_len")
    if cfg.family == "gpt_oss" and hf.family == "gpt_oss":
        names += ["tie_embeddings", "attention_bias", "head_dim", "num_experts", "moe_intermediate_size"]
        names += ["num_experts_per_tok", "sliding_window", "sliding_window_pattern"]
        if check_numerics:
            names += list(_ROPE_FIELDS) + ["rope_beta_fast", "rope_beta_slow", "rope_truncate"]
            names += ["rope_attention_factor", "swiglu_alpha", "swiglu_limit"]
    if cfg.family == "gemma3" and hf.family == "gemma3":
        names += ["head_dim", "sliding_window", "sliding_window_pattern", "query_pre_attn_scalar"]
        if check_numerics:
            names += ["rope_theta", "rope_type", "rope_factor", "rope_local_theta", "final_logit_softcap"]
    if check_numerics:
        names += list(_NUMERIC_FIELDS)
        if cfg.family == "llama":
            names += [
                n for n in _ROPE_FIELDS if n in ("rope_theta", "rope_type") or hf.rope_type != "default"
            ] + list(GRANITE_SCALARS)
    differ = [n for n in names if getattr(cfg, n) != getattr(hf, n)]
    if differ:
        bad = [
            f"model.{n}: run config has {getattr(cfg, n)!r}, checkpoint has {getattr(hf, n)!r}"
            for n in differ
        ]
        key = {"head_dim": "head_size"}  # head_dim is read from model.head_size
        overrides = " ".join(f"--model.{key.get(n, n)}={getattr(hf, n)}" for n in differ)
        raise ConfigError(
            f"the HF checkpoint {ckpt} does not match the model config {cfg.name!r}:\n  "
            + "\n  ".join(bad)
            + f"\nUse a config of the checkpoint's shape (model_config_from_hf, or {overrides})."
        )
