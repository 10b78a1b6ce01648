"""Translate between a transformers `config.json` and jaxzero's ModelConfig, in both directions.

Supported: Llama (`LlamaForCausalLM`, model_type "llama": tied or untied head, grouped-query attention,
plain RoPE) and GPT-2 (`GPT2LMHeadModel`, model_type "gpt2"). Anything these models cannot compute
exactly (rope scaling, partial rotary, attention or MLP biases in Llama, a head_dim other than
hidden_size / num_heads, other activations, quantized weights, ...) is refused with a ConfigError that
names the field, rather than loaded into a model that would silently compute something else.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from jaxzero.config import ConfigError, ModelConfig
from jaxzero.models import build_model

CONFIG_NAME = "config.json"

# The dtypes a checkpoint can be exported in: config.json's `dtype` names one, and the weight files hold it.
EXPORT_DTYPES: Mapping[str, np.dtype] = {
    "float32": np.dtype(np.float32),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "float16": np.dtype(np.float16),
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
            "(as written by transformers' save_pretrained or jaxzero.interop.export_hf) "
            "or the config.json itself."
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
