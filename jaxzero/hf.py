"""Hugging Face interop: export jaxzero parameters as a transformers checkpoint, import one back.

    paths = export_hf(params, cfg, "out/")       # config.json + model.safetensors (or shards + index)
    model = transformers.AutoModelForCausalLM.from_pretrained("out/")
    cfg, params = import_hf("some-hf-checkpoint/")  # float32 NumPy ModelParams
    params = load_hf_into(run_cfg, "some-hf-checkpoint/")  # same, checked against a run's config

Supported: Llama (`LlamaForCausalLM`, model_type "llama": tied or untied head, grouped-query attention,
plain RoPE) and GPT-2 (`GPT2LMHeadModel`, model_type "gpt2"). Anything these models cannot compute
exactly (rope scaling, partial rotary, attention or MLP biases in Llama, a head_dim other than
hidden_size / num_heads, other activations, quantized weights, ...) is refused with a ConfigError that
names the field, rather than loaded into a model that would silently compute something else.

Name and layout map (see the docstrings of `jaxzero.models.llama` and `jaxzero.models.gpt2`): jaxzero's
parameter dicts already use HF's module names, so a tensor's HF name is its unit prefix plus its dict
path, with "kernel"/"scale"/"embedding" renamed to "weight". Llama kernels are stored (in, out) in
jaxzero and (out, in) by torch's `nn.Linear`, so they are transposed; GPT-2's `Conv1D` already stores
(in, out), so GPT-2 is a pure rename.

Memory: export converts and writes one unit (the embedding, one block, the head) at a time, so the
host holds the model once (the caller's `params`) plus one unit in the target dtype; import reads
memory-mapped safetensors and builds the float32 result one unit at a time.

Files are the safetensors format of `jaxzero.safetensors_io` (NumPy only); transformers itself is not
needed at runtime.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import ml_dtypes
import numpy as np

from jaxzero.checkpoint import CheckpointError
from jaxzero.config import ConfigError, ModelConfig
from jaxzero.models import ModelParams, build_model
from jaxzero.safetensors_io import SafetensorsReader, SafetensorsWriter, TensorSpec

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
_SHARD_RE = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")

EXPORT_DTYPES: Mapping[str, np.dtype] = {
    "float32": np.dtype(np.float32),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "float16": np.dtype(np.float16),
}

# The prefix of the base model's modules inside `*ForCausalLM` (transformers' `base_model_prefix`).
# Checkpoints saved from the headless base class (`LlamaModel`, `GPT2Model`; e.g. the original
# openai-community/gpt2 files) lack it, and transformers accepts both, so import does too.
_BASE_PREFIX = {"llama": "model.", "gpt2": "transformer."}

# Tensors some writers saved that are buffers or duplicates, not parameters: RoPE inverse frequencies
# (old Llama checkpoints), GPT-2's causal-mask buffers `attn.bias`/`attn.masked_bias` (not the
# parameter `attn.c_attn.bias`), and the output head of a tied model (transformers re-ties it to the
# input embedding on load, so that copy is never used; we do the same).
_IGNORED = {
    "llama": re.compile(r"^(model\.)?layers\.\d+\.self_attn\.rotary_emb\.inv_freq$"),
    "gpt2": re.compile(r"^(transformer\.)?h\.\d+\.attn\.(bias|masked_bias)$|^lm_head\.weight$"),
}

# Defaults of transformers' LlamaConfig / GPT2Config (transformers 5), used for fields a config.json
# leaves out, exactly as transformers itself would fill them in.
_LLAMA_DEFAULTS: dict[str, Any] = {
    "vocab_size": 32000,
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6,
    "initializer_range": 0.02,
    "tie_word_embeddings": False,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
}
_GPT2_DEFAULTS: dict[str, Any] = {
    "vocab_size": 50257,
    "n_positions": 1024,
    "n_embd": 768,
    "n_layer": 12,
    "n_head": 12,
    "layer_norm_epsilon": 1e-5,
    "initializer_range": 0.02,
    "activation_function": "gelu_new",
    "tie_word_embeddings": True,
}
# GPT-2's "gelu_new" and "gelu_pytorch_tanh" are both the tanh approximation jaxzero computes.
_GPT2_ACTIVATIONS = ("gelu_new", "gelu_pytorch_tanh")


# Stored dtypes import reads (and converts to float32); integer or float8 tensors mean a quantized
# checkpoint whose scales jaxzero does not model.
_FLOAT_CODES = ("F64", "F32", "F16", "BF16")


# A checkpoint's files or tensors do not match its config: the project's one CheckpointError (a
# ConfigError, so the CLI reports it as bad input).


# -------------------------------------------------------------------------------------------------
# The tensor map
# -------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Tensor:
    """One parameter: its HF name (with the base prefix), where it lives in its jaxzero unit, its
    jaxzero shape, and whether HF stores it transposed (torch Linear's (out, in))."""

    hf_name: str
    path: tuple[str, ...]
    shape: tuple[int, ...]
    transpose: bool = False

    @property
    def hf_shape(self) -> tuple[int, ...]:
        return self.shape[::-1] if self.transpose else self.shape


@dataclass(frozen=True)
class _Unit:
    """One unit of `ModelParams` ("embed", "block i", "head") and its tensors, in HF save order."""

    label: str
    tensors: tuple[_Tensor, ...]


def _llama_units(cfg: ModelConfig) -> list[_Unit]:
    d, f, v, hd = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.head_dim
    q, kv = cfg.num_heads * hd, cfg.num_kv_heads * hd
    units = [_Unit("embed", (_Tensor("model.embed_tokens.weight", ("embed_tokens", "embedding"), (v, d)),))]
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        units.append(
            _Unit(
                f"block {i}",
                (
                    _Tensor(p + "input_layernorm.weight", ("input_layernorm", "scale"), (d,)),
                    _Tensor(p + "self_attn.q_proj.weight", ("self_attn", "q_proj", "kernel"), (d, q), True),
                    _Tensor(p + "self_attn.k_proj.weight", ("self_attn", "k_proj", "kernel"), (d, kv), True),
                    _Tensor(p + "self_attn.v_proj.weight", ("self_attn", "v_proj", "kernel"), (d, kv), True),
                    _Tensor(p + "self_attn.o_proj.weight", ("self_attn", "o_proj", "kernel"), (q, d), True),
                    _Tensor(
                        p + "post_attention_layernorm.weight", ("post_attention_layernorm", "scale"), (d,)
                    ),
                    _Tensor(p + "mlp.gate_proj.weight", ("mlp", "gate_proj", "kernel"), (d, f), True),
                    _Tensor(p + "mlp.up_proj.weight", ("mlp", "up_proj", "kernel"), (d, f), True),
                    _Tensor(p + "mlp.down_proj.weight", ("mlp", "down_proj", "kernel"), (f, d), True),
                ),
            )
        )
    head = [_Tensor("model.norm.weight", ("norm", "scale"), (d,))]
    if not cfg.tie_embeddings:
        head.append(_Tensor("lm_head.weight", ("lm_head", "kernel"), (d, v), True))
    units.append(_Unit("head", tuple(head)))
    return units


def _gpt2_units(cfg: ModelConfig) -> list[_Unit]:
    d, f, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    units = [
        _Unit(
            "embed",
            (
                _Tensor("transformer.wte.weight", ("wte", "embedding"), (v, d)),
                _Tensor("transformer.wpe.weight", ("wpe", "embedding"), (cfg.max_seq_len, d)),
            ),
        )
    ]
    for i in range(cfg.num_layers):
        p = f"transformer.h.{i}."
        units.append(
            _Unit(
                f"block {i}",
                (
                    _Tensor(p + "ln_1.weight", ("ln_1", "scale"), (d,)),
                    _Tensor(p + "ln_1.bias", ("ln_1", "bias"), (d,)),
                    _Tensor(p + "attn.c_attn.weight", ("attn", "c_attn", "kernel"), (d, 3 * d)),
                    _Tensor(p + "attn.c_attn.bias", ("attn", "c_attn", "bias"), (3 * d,)),
                    _Tensor(p + "attn.c_proj.weight", ("attn", "c_proj", "kernel"), (d, d)),
                    _Tensor(p + "attn.c_proj.bias", ("attn", "c_proj", "bias"), (d,)),
                    _Tensor(p + "ln_2.weight", ("ln_2", "scale"), (d,)),
                    _Tensor(p + "ln_2.bias", ("ln_2", "bias"), (d,)),
                    _Tensor(p + "mlp.c_fc.weight", ("mlp", "c_fc", "kernel"), (d, f)),
                    _Tensor(p + "mlp.c_fc.bias", ("mlp", "c_fc", "bias"), (f,)),
                    _Tensor(p + "mlp.c_proj.weight", ("mlp", "c_proj", "kernel"), (f, d)),
                    _Tensor(p + "mlp.c_proj.bias", ("mlp", "c_proj", "bias"), (d,)),
                ),
            )
        )
    units.append(
        _Unit(
            "head",
            (
                _Tensor("transformer.ln_f.weight", ("ln_f", "scale"), (d,)),
                _Tensor("transformer.ln_f.bias", ("ln_f", "bias"), (d,)),
            ),
        )
    )
    return units


def _units(cfg: ModelConfig) -> list[_Unit]:
    """embed, block 0 .. block L-1, head: the units of `ModelParams` in order, with their HF tensors."""
    build_model(cfg)  # validates the shape (divisibility, even head_dim, gpt2 multi-head) first
    return _llama_units(cfg) if cfg.family == "llama" else _gpt2_units(cfg)


def hf_tensor_names(cfg: ModelConfig) -> list[str]:
    """The HF names of every parameter of a `cfg`-shaped model, in save order (what `export_hf` writes)."""
    return [t.hf_name for u in _units(cfg) for t in u.tensors]


def _unit_trees(params: ModelParams) -> Iterator[Any]:
    yield params.embed
    yield from params.blocks
    yield params.head


def _leaf_paths(tree: Any, prefix: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], Any]]:
    """(key path, leaf) of every leaf of a nested dict."""
    if isinstance(tree, Mapping):
        for k, v in tree.items():
            yield from _leaf_paths(v, (*prefix, str(k)))
    else:
        yield prefix, tree


def _get(tree: Any, path: tuple[str, ...]) -> Any:
    for k in path:
        tree = tree[k]
    return tree


def _set(tree: dict[str, Any], path: tuple[str, ...], value: Any) -> None:
    for k in path[:-1]:
        tree = tree.setdefault(k, {})
    tree[path[-1]] = value


# -------------------------------------------------------------------------------------------------
# config.json
# -------------------------------------------------------------------------------------------------


def hf_config(cfg: ModelConfig, dtype: str = "bfloat16") -> dict[str, Any]:
    """The transformers `config.json` (as a dict) of a `cfg`-shaped model whose weights are `dtype`.

    Llama -> `LlamaForCausalLM` (model_type "llama"), GPT-2 -> `GPT2LMHeadModel` (model_type "gpt2").
    Written for transformers 5 (`dtype`, `rope_parameters`) and readable by transformers 4 (`torch_dtype`,
    top-level `rope_theta`; transformers 5 reads both spellings). Token ids (bos/eos/pad) are null:
    jaxzero does not know the tokenizer; set them if you ship one. Dropout is 0, as jaxzero trains.
    """
    if dtype not in EXPORT_DTYPES:
        raise ConfigError(f"export dtype {dtype!r} is not one of {list(EXPORT_DTYPES)}.")
    build_model(cfg)  # shape validation
    common = {
        "vocab_size": cfg.vocab_size,
        "initializer_range": cfg.init_std,
        "bos_token_id": None,
        "eos_token_id": None,
        "pad_token_id": None,
        "use_cache": True,
        "dtype": dtype,
        "torch_dtype": dtype,
    }
    if cfg.family == "llama":
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": cfg.hidden_size,
            "intermediate_size": cfg.intermediate_size,
            "num_hidden_layers": cfg.num_layers,
            "num_attention_heads": cfg.num_heads,
            "num_key_value_heads": cfg.num_kv_heads,
            "head_dim": cfg.head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": cfg.max_seq_len,
            "rms_norm_eps": cfg.norm_eps,
            "rope_theta": cfg.rope_theta,
            "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
            "attention_bias": False,
            "attention_dropout": 0.0,
            "mlp_bias": False,
            "pretraining_tp": 1,
            "tie_word_embeddings": cfg.tie_embeddings,
            **common,
        }
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "n_embd": cfg.hidden_size,
        "n_layer": cfg.num_layers,
        "n_head": cfg.num_heads,
        "n_positions": cfg.max_seq_len,
        "n_inner": cfg.intermediate_size,
        "activation_function": "gelu_new",
        "layer_norm_epsilon": cfg.norm_eps,
        "attn_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "resid_pdrop": 0.0,
        "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False,
        "add_cross_attention": False,
        "tie_word_embeddings": True,
        **common,
    }


def _read_config_json(path: Path) -> dict[str, Any]:
    file = path / CONFIG_NAME if path.is_dir() else path
    if not file.is_file():
        raise ConfigError(
            f"no HF config at {str(file)!r}: pass a checkpoint directory holding config.json "
            "(as written by transformers' save_pretrained or jaxzero.hf.export_hf) or the config.json itself."
        )
    try:
        d = json.loads(file.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{file} is not valid JSON: {e}") from e
    if not isinstance(d, dict):
        raise ConfigError(f"{file} holds a JSON {type(d).__name__}, expected an object.")
    return d


class _Fields:
    """Typed access to a config.json dict, with transformers' defaults and errors naming the field."""

    def __init__(self, d: Mapping[str, Any], defaults: Mapping[str, Any], where: str) -> None:
        self.d, self.defaults, self.where = d, defaults, where

    def raw(self, key: str) -> Any:
        v = self.d.get(key)
        return self.defaults.get(key) if v is None else v

    def get_int(self, key: str) -> int:
        v = self.raw(key)
        if type(v) is not int or v < 1:
            raise ConfigError(f"{self.where}: {key}={v!r} must be a positive integer.")
        return v

    def get_float(self, key: str) -> float:
        v = self.raw(key)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0:
            raise ConfigError(f"{self.where}: {key}={v!r} must be a positive number.")
        return float(v)

    def get_bool(self, key: str) -> bool:
        v = self.raw(key)
        if not isinstance(v, bool):
            raise ConfigError(f"{self.where}: {key}={v!r} must be true or false.")
        return v


def _check_architectures(d: Mapping[str, Any], allowed: tuple[str, ...], where: str) -> None:
    arch = d.get("architectures") or []
    bad = [a for a in arch if a not in allowed]
    if bad:
        raise ConfigError(
            f"{where}: architectures={arch} is not supported: jaxzero imports only {' or '.join(allowed)} "
            "(a different head, e.g. sequence classification, has tensors jaxzero does not model)."
        )


def _llama_from_hf(d: Mapping[str, Any], name: str, where: str) -> ModelConfig:
    f = _Fields(d, _LLAMA_DEFAULTS, where)
    _check_architectures(d, ("LlamaForCausalLM", "LlamaModel"), where)
    unsupported = []
    if f.raw("hidden_act") != "silu":
        unsupported.append(f"hidden_act={f.raw('hidden_act')!r} (jaxzero's Llama MLP is SwiGLU with silu)")
    for key in ("attention_bias", "mlp_bias"):
        if d.get(key):
            unsupported.append(f"{key}=true (jaxzero's Llama has no biases)")
    # Transformers 4 spelled rope settings `rope_theta` + `rope_scaling`; 5 nests them in
    # `rope_parameters`. Like transformers, a legacy `rope_scaling` wins, and a theta inside the dict
    # wins over the top-level one.
    rope = d.get("rope_scaling") or d.get("rope_parameters") or {}
    if not isinstance(rope, Mapping):
        raise ConfigError(f"{where}: rope_parameters={rope!r} must be an object.")
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        unsupported.append(
            f"rope type {rope_type!r} (rope_parameters/rope_scaling={dict(rope)}); jaxzero implements only "
            "plain RoPE, and ModelConfig has no field for rope scaling"
        )
    partial = rope.get("partial_rotary_factor", d.get("partial_rotary_factor"))
    if partial not in (None, 1, 1.0):
        unsupported.append(f"partial_rotary_factor={partial} (jaxzero rotates the whole head)")
    theta = rope.get("rope_theta", d.get("rope_theta"))
    theta = _LLAMA_DEFAULTS["rope_theta"] if theta is None else theta
    if d.get("quantization_config"):
        unsupported.append("quantization_config (quantized weights)")
    hidden, heads = f.get_int("hidden_size"), f.get_int("num_attention_heads")
    head_dim = d.get("head_dim")
    if head_dim is not None and heads and head_dim != hidden // heads:
        unsupported.append(
            f"head_dim={head_dim} != hidden_size/num_attention_heads = {hidden}/{heads} "
            "(jaxzero derives head_dim from the two)"
        )
    if unsupported:
        raise ConfigError(f"{where}: unsupported Llama features: " + "; ".join(unsupported) + ".")
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or theta <= 0:
        raise ConfigError(f"{where}: rope_theta={theta!r} must be a positive number.")
    kv = d.get("num_key_value_heads")
    return ModelConfig(
        name=name,
        family="llama",
        vocab_size=f.get_int("vocab_size"),
        hidden_size=hidden,
        num_layers=f.get_int("num_hidden_layers"),
        num_heads=heads,
        num_kv_heads=heads if kv is None else f.get_int("num_key_value_heads"),
        intermediate_size=f.get_int("intermediate_size"),
        max_seq_len=f.get_int("max_position_embeddings"),
        tie_embeddings=f.get_bool("tie_word_embeddings"),
        rope_theta=float(theta),
        norm_eps=f.get_float("rms_norm_eps"),
        init_std=f.get_float("initializer_range"),
    )


def _gpt2_from_hf(d: Mapping[str, Any], name: str, where: str) -> ModelConfig:
    f = _Fields(d, _GPT2_DEFAULTS, where)
    _check_architectures(d, ("GPT2LMHeadModel", "GPT2Model"), where)
    unsupported = []
    if f.raw("activation_function") not in _GPT2_ACTIVATIONS:
        unsupported.append(
            f"activation_function={f.raw('activation_function')!r} (jaxzero's GPT-2 uses the tanh GELU, "
            f"{' / '.join(_GPT2_ACTIVATIONS)})"
        )
    if d.get("scale_attn_weights", True) is not True:
        unsupported.append("scale_attn_weights=false (jaxzero scales scores by 1/sqrt(head_dim))")
    if d.get("scale_attn_by_inverse_layer_idx"):
        unsupported.append("scale_attn_by_inverse_layer_idx=true")
    if d.get("add_cross_attention"):
        unsupported.append("add_cross_attention=true (jaxzero's GPT-2 is decoder-only)")
    if not f.get_bool("tie_word_embeddings"):
        unsupported.append("tie_word_embeddings=false (jaxzero's GPT-2 head is always tied to wte)")
    if d.get("quantization_config"):
        unsupported.append("quantization_config (quantized weights)")
    if unsupported:
        raise ConfigError(f"{where}: unsupported GPT-2 features: " + "; ".join(unsupported) + ".")
    # reorder_and_upcast_attn only changes the precision of HF's own attention, not the function.
    hidden, heads = f.get_int("n_embd"), f.get_int("n_head")
    return ModelConfig(
        name=name,
        family="gpt2",
        vocab_size=f.get_int("vocab_size"),
        hidden_size=hidden,
        num_layers=f.get_int("n_layer"),
        num_heads=heads,
        num_kv_heads=heads,
        intermediate_size=4 * hidden if d.get("n_inner") is None else f.get_int("n_inner"),
        max_seq_len=f.get_int("n_positions"),
        tie_embeddings=True,
        norm_eps=f.get_float("layer_norm_epsilon"),
        init_std=f.get_float("initializer_range"),
    )


def model_config_from_hf(
    source: str | os.PathLike[str] | Mapping[str, Any], *, name: str | None = None
) -> ModelConfig:
    """The ModelConfig of an HF checkpoint: `source` is its directory, its config.json, or the parsed dict.

    Fields the file leaves out take transformers' defaults for that model type. The name is `name`, else
    "hf:<directory name>" (or "hf:<model_type>" for a dict). compute_dtype and attention_impl keep
    ModelConfig's defaults: they are run choices, not properties of the checkpoint. Raises ConfigError for
    unsupported model types or features, naming each.
    """
    if isinstance(source, Mapping):
        d, where = dict(source), "HF config"
        default_name = f"hf:{d.get('model_type', 'unknown')}"
    else:
        path = Path(source)
        d = _read_config_json(path)
        where = str(path / CONFIG_NAME if path.is_dir() else path)
        default_name = f"hf:{(path if path.is_dir() else path.parent).resolve().name}"
    name = name or default_name
    model_type = d.get("model_type")
    if model_type == "llama":
        cfg = _llama_from_hf(d, name, where)
    elif model_type == "gpt2":
        cfg = _gpt2_from_hf(d, name, where)
    else:
        raise ConfigError(
            f"{where}: model_type={model_type!r} is not supported; jaxzero imports 'llama' "
            "(LlamaForCausalLM) and 'gpt2' (GPT2LMHeadModel)."
        )
    try:
        build_model(cfg)  # divisibility, even head_dim, ...: the same checks a run would make
    except ConfigError as e:
        raise ConfigError(f"{where}: the checkpoint's shape is invalid for jaxzero: {e}") from e
    return cfg


# -------------------------------------------------------------------------------------------------
# Export
# -------------------------------------------------------------------------------------------------


def _check_params(params: ModelParams, cfg: ModelConfig, units: list[_Unit]) -> None:
    """Raise ValueError listing every leaf of `params` that is missing, unexpected or mis-shaped."""
    trees = list(_unit_trees(params))
    if len(trees) != len(units):
        raise ValueError(
            f"params has {len(params.blocks)} blocks but model.num_layers={cfg.num_layers}; "
            "export the params with the config they were trained with."
        )
    problems = []
    for unit, tree in zip(units, trees):
        have = dict(_leaf_paths(tree))
        want = {t.path: t for t in unit.tensors}
        for path, t in want.items():
            if path not in have:
                problems.append(f"{unit.label}: missing {'/'.join(path)} (-> {t.hf_name})")
            elif tuple(np.shape(have[path])) != t.shape:
                problems.append(
                    f"{unit.label}: {'/'.join(path)} has shape {tuple(np.shape(have[path]))}, "
                    f"the config needs {t.shape}"
                )
        problems += [f"{unit.label}: unexpected {'/'.join(p)}" for p in have if p not in want]
    if problems:
        raise ValueError(
            f"params do not match model config {cfg.name!r} ({cfg.family}, tie_embeddings="
            f"{cfg.tie_embeddings}):\n  " + "\n  ".join(problems)
        )


def _existing_outputs(out: Path) -> list[Path]:
    if not out.is_dir():
        return []
    return sorted(
        p
        for p in out.iterdir()
        if p.name in (CONFIG_NAME, WEIGHTS_NAME, INDEX_NAME) or _SHARD_RE.match(p.name)
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
) -> list[Path]:
    """Write `params` as a transformers checkpoint in `out_dir`; returns the written paths.

    params: a `cfg`-shaped ModelParams; leaves float32/bfloat16, NumPy or jax arrays on any device
        (each unit is fetched with `jax.device_get` when it is written).
    dtype: "bfloat16" (default), "float32" or "float16", the dtype of the written tensors (rounded to
        nearest even, as torch's `.to()` does) and of config.json's `dtype`.
    max_shard_bytes: if the tensors total more than this, they are split into
        `model-0000i-of-0000N.safetensors` files of at most this size (a single larger tensor gets a
        shard of its own) plus `model.safetensors.index.json`; otherwise one `model.safetensors`.
    overwrite: replace an existing checkpoint in `out_dir` (its config.json, model*.safetensors and
        index are deleted first, so no stale shard survives); without it, existing files are an error.

    Returns [config.json, weight file(s)..., index (when sharded)]. The files are written unit by unit:
    the host holds one unit in the target dtype at a time besides `params` itself. If anything fails,
    the files this call wrote are removed.
    """
    if dtype not in EXPORT_DTYPES:
        raise ValueError(f"dtype={dtype!r} is not one of {list(EXPORT_DTYPES)}.")
    if max_shard_bytes < 1:
        raise ValueError(f"max_shard_bytes={max_shard_bytes} must be >= 1.")
    np_dtype = EXPORT_DTYPES[dtype]
    units = _units(cfg)
    _check_params(params, cfg, units)
    config = hf_config(cfg, dtype)

    out = Path(out_dir)
    existing = _existing_outputs(out)
    if existing and not overwrite:
        raise FileExistsError(
            f"{out} already holds a checkpoint ({', '.join(p.name for p in existing)}); "
            "pass overwrite=True to replace it or choose another directory."
        )
    out.mkdir(parents=True, exist_ok=True)
    for p in existing:
        p.unlink()

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
    shard_of = {spec.name: k for k, specs in enumerate(shards) for spec in specs}

    written: list[Path] = []
    writer: SafetensorsWriter | None = None
    current = -1
    try:
        for unit, tree in zip(units, _unit_trees(params)):
            host = jax.device_get(tree)  # one unit on the host at a time
            for t in unit.tensors:
                k = shard_of[t.hf_name]
                if k != current:  # shards hold consecutive tensors: finish the last one, start the next
                    if writer is not None:
                        written.append(writer.close())
                    # transformers 4 refuses a safetensors file whose metadata lacks "format".
                    writer = SafetensorsWriter(out / files[k], shards[k], metadata={"format": "pt"})
                    current = k
                leaf = np.asarray(_get(host, t.path))
                # One copy: transpose (Llama kernels) and cast together, C-contiguous for the writer.
                array = np.array(leaf.T if t.transpose else leaf, dtype=np_dtype, order="C")
                assert writer is not None
                writer.write(t.hf_name, array)
                del array
            del host
        assert writer is not None
        written.append(writer.close())
        writer = None
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
    except BaseException:
        if writer is not None:
            writer.abort()
        for p in written:
            p.unlink(missing_ok=True)
        raise
    return [out / CONFIG_NAME, *written]


# -------------------------------------------------------------------------------------------------
# Import
# -------------------------------------------------------------------------------------------------


def _open_weights(ckpt: Path) -> tuple[dict[str, SafetensorsReader], list[SafetensorsReader]]:
    """({tensor name: reader of the file holding it}, all readers) of a checkpoint directory."""
    index_file, single = ckpt / INDEX_NAME, ckpt / WEIGHTS_NAME
    if index_file.is_file():
        try:
            index = json.loads(index_file.read_text())
            weight_map = index["weight_map"]
        except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(
                f"{index_file} is not a valid index (needs a 'weight_map' object): {e}"
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
                readers[f] = SafetensorsReader(ckpt / f)
            absent = [f"{n} (in {f})" for n, f in weight_map.items() if n not in readers[f]]
            if absent:
                raise CheckpointError(f"{index_file} lists tensors its shard files do not contain: {absent}.")
        except BaseException:
            for r in readers.values():
                r.close()
            raise
        return {n: readers[f] for n, f in weight_map.items()}, list(readers.values())
    if single.is_file():
        reader = SafetensorsReader(single)
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
    units = _units(cfg)
    where, readers = _open_weights(ckpt)
    try:
        prefix = _BASE_PREFIX[cfg.family]
        ignored = _IGNORED[cfg.family]
        if cfg.family == "llama" and cfg.tie_embeddings:
            ignored = re.compile(ignored.pattern + r"|^lm_head\.weight$")
        # Resolve every name and check every shape and dtype from the headers before reading any data.
        found: dict[str, str] = {}  # canonical name -> name in the checkpoint
        missing, mismatched = [], []
        for unit in units:
            for t in unit.tensors:
                candidates = [t.hf_name]
                if t.hf_name.startswith(prefix):
                    candidates.append(t.hf_name[len(prefix) :])
                name = next((c for c in candidates if c in where), None)
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
        used = set(found.values())
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

        trees: list[dict[str, Any]] = []
        for unit in units:
            tree: dict[str, Any] = {}
            for t in unit.tensors:
                name = found[t.hf_name]
                stored = where[name][name]  # a memory-mapped view: read as it is converted
                # Always a fresh, writable float32 array that owns its memory, never a view of the file.
                _set(tree, t.path, np.array(stored.T if t.transpose else stored, dtype=np.float32, order="C"))
            trees.append(tree)
    finally:
        for r in readers:
            r.close()
    return ModelParams(embed=trees[0], blocks=tuple(trees[1:-1]), head=trees[-1])


def import_hf(path: str | os.PathLike[str]) -> tuple[ModelConfig, ModelParams]:
    """(ModelConfig, float32 NumPy ModelParams) of the HF checkpoint directory `path`.

    `path` holds config.json and either model.safetensors or model.safetensors.index.json with its
    shards (transformers' `save_pretrained` layout, or `export_hf`'s). Tensors may be stored in any
    floating dtype; they are converted to float32 and Llama's (out, in) projections transposed to
    jaxzero's (in, out). Names with or without the base prefix ("model." / "transformer.") are accepted.
    Missing, unexpected or mis-shaped tensors raise CheckpointError listing all of them; known buffers
    (rotary inv_freq, GPT-2's attention-mask `attn.bias`) and the duplicate head of a tied model are
    skipped.
    """
    ckpt = Path(path)
    if not ckpt.is_dir():
        raise FileNotFoundError(f"HF checkpoint directory {str(ckpt)!r} does not exist.")
    cfg = model_config_from_hf(ckpt)
    return cfg, _read_params(cfg, ckpt)


# Fields that determine the parameter shapes (and, for gpt2, max_seq_len the wpe table); and fields
# that change the function the weights compute without changing any shape.
_SHAPE_FIELDS = ("family", "vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads")
_NUMERIC_FIELDS = ("norm_eps",)


def load_hf_into(
    cfg: ModelConfig, path: str | os.PathLike[str], *, check_numerics: bool = True
) -> ModelParams:
    """float32 NumPy ModelParams for a run configured by `cfg`, from the HF checkpoint directory `path`.

    Checks that the checkpoint's config matches `cfg` in every shape field (family, vocab_size,
    hidden_size, num_layers, num_heads, num_kv_heads, intermediate_size, tie_embeddings for Llama and
    max_seq_len for GPT-2, whose position table has that many rows) and, unless `check_numerics=False`,
    in the fields that change what the weights compute (norm_eps, and rope_theta for Llama; pass False
    to fine-tune with e.g. a raised rope_theta on purpose). Every mismatching field is named in one
    ConfigError. Training knobs (compute_dtype, attention_impl, init_std, Llama's max_seq_len) are the
    run's own and are not compared.
    """
    ckpt = Path(path)
    hf = model_config_from_hf(ckpt)
    names = list(_SHAPE_FIELDS) + ["intermediate_size"]
    if cfg.family == "llama" and hf.family == "llama":
        names.append("tie_embeddings")
    if cfg.family == "gpt2":
        names.append("max_seq_len")
    if check_numerics:
        names += list(_NUMERIC_FIELDS)
        if cfg.family == "llama":
            names.append("rope_theta")
    differ = [n for n in names if getattr(cfg, n) != getattr(hf, n)]
    if differ:
        bad = [
            f"model.{n}: run config has {getattr(cfg, n)!r}, checkpoint has {getattr(hf, n)!r}"
            for n in differ
        ]
        overrides = " ".join(f"--model.{n}={getattr(hf, n)}" for n in differ)
        raise ConfigError(
            f"the HF checkpoint {ckpt} does not match the model config {cfg.name!r}:\n  "
            + "\n  ".join(bad)
            + f"\nUse a config of the checkpoint's shape (model_config_from_hf, or {overrides})."
        )
    # `cfg` now equals the checkpoint's config in every field that shapes the tensors.
    return _read_params(cfg, ckpt)
