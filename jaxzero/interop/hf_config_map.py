"""Translate between a transformers `config.json` and jaxzero's ModelConfig, in both directions.

Supported: the Llama family (`LlamaForCausalLM` "llama" with default, linear or llama3 rope scaling;
`Qwen2ForCausalLM` "qwen2", biases on q, k, v; `Qwen3ForCausalLM` "qwen3", q/k norms and a head_dim of
its own; `MistralForCausalLM` "mistral"; `Qwen3MoeForCausalLM` "qwen3_moe" and `MixtralForCausalLM`
"mixtral", whose expert fields `hf_moe_config` maps; `Phi3ForCausalLM` "phi3" (Phi-3, Phi-4) and
`Olmo2ForCausalLM` "olmo2", `GraniteForCausalLM` "granite" and `GraniteMoeForCausalLM` "granitemoe",
whose block variants `hf_variants` maps (Granite MoE's experts too); tied or untied head, grouped-query
attention), GPT-2 (`GPT2LMHeadModel` "gpt2"), Gemma 3's text models (`Gemma3ForCausalLM` "gemma3_text"
and the text model of `Gemma3ForConditionalGeneration` "gemma3") and gpt-oss (`GptOssForCausalLM`
"gpt_oss", `hf_gpt_oss`). Anything these models cannot compute exactly (dynamic/yarn/longrope rope,
partial rotary outside Phi-3, o_proj or MLP biases, a head_dim other than hidden_size / num_heads
outside Qwen3, other activations, quantized weights, ...) is refused with a ConfigError that names the
field, rather than loaded into a model that would silently compute something else. A sliding window is
kept in ModelConfig.sliding_window; Qwen's runs longer than it are refused (`config.checks.validate`).
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
from jaxzero.interop import hf_variants
from jaxzero.interop.hf_gpt_oss import gpt_oss_from_hf, gpt_oss_to_hf
from jaxzero.interop.hf_moe_config import MOE_ARCHITECTURES, MOE_DEFAULTS, moe_from_hf, moe_to_hf
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
# The Llama-family model types and their causal-LM classes.
_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mistral": "MistralForCausalLM",
    **MOE_ARCHITECTURES,  # Qwen3-MoE and Mixtral: the Llama family with a sparse MLP
    **hf_variants.VARIANTS,  # Phi-3, OLMo 2 and Granite: the Llama family with block variants
}
# Defaults of Qwen2Config / Qwen3Config / MistralConfig (transformers 5) that differ from LlamaConfig's.
_FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {},
    "qwen2": {
        "vocab_size": 151936,
        "intermediate_size": 22016,
        "max_position_embeddings": 32768,
        "use_sliding_window": False,
        "sliding_window": 4096,
        "max_window_layers": 28,
    },
    "qwen3": {
        "vocab_size": 151936,
        "intermediate_size": 22016,
        "max_position_embeddings": 32768,
        "head_dim": 128,
        "use_sliding_window": False,
        "sliding_window": 4096,
        "max_window_layers": 28,
    },
    "mistral": {
        "intermediate_size": 14336,
        "num_key_value_heads": 8,
        "max_position_embeddings": 4096 * 32,
        "sliding_window": 4096,
    },
    **MOE_DEFAULTS,
    **hf_variants.VARIANT_DEFAULTS,
}
# GPT-2's "gelu_new" and "gelu_pytorch_tanh" are both the tanh approximation jaxzero computes.
_GPT2_ACTIVATIONS = ("gelu_new", "gelu_pytorch_tanh")


def hf_config(cfg: ModelConfig, dtype: str = "bfloat16") -> dict[str, Any]:
    """The transformers `config.json` (as a dict) of a `cfg`-shaped model whose weights are `dtype`.

    Llama family -> `LlamaForCausalLM` (model_type "llama"), or `Qwen2ForCausalLM` /
    `Qwen3ForCausalLM` / `MistralForCausalLM` as `cfg.hf_model_type` says (with q, k, v biases: Qwen2;
    with q/k norms: Qwen3); GPT-2 ->
    `GPT2LMHeadModel` (model_type "gpt2"); Gemma 3 -> `Gemma3ForCausalLM` (model_type "gemma3_text").
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
    if cfg.family == "gemma3":
        return _gemma3_to_hf(cfg, common)
    if cfg.family == "gpt_oss":
        return gpt_oss_to_hf(cfg, common)
    if cfg.family == "llama":
        model_type = hf_variants.llama_model_type(cfg)
        rope: dict[str, Any] = {"rope_type": cfg.rope_type, "rope_theta": cfg.rope_theta}
        if cfg.rope_type != "default":
            rope["factor"] = cfg.rope_factor
        if cfg.rope_type == "llama3":
            rope.update(
                low_freq_factor=cfg.rope_low_freq_factor,
                high_freq_factor=cfg.rope_high_freq_factor,
                original_max_position_embeddings=cfg.rope_original_max_len,
            )
        out = {
            "architectures": [_ARCHITECTURES[model_type]],
            "model_type": model_type,
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
            "rope_parameters": rope,
            # transformers 4 reads scaling from rope_scaling (null: none)
            "rope_scaling": None if cfg.rope_type == "default" else rope,
            "attention_dropout": 0.0,
            "tie_word_embeddings": cfg.tie_embeddings,
            **common,
        }
        if model_type == "llama":
            out.update(attention_bias=False, mlp_bias=False, pretraining_tp=1)
        elif model_type in ("qwen2", "qwen3", "qwen3_moe"):
            if model_type != "qwen2":
                out.update(attention_bias=False)
            window = cfg.sliding_window or cfg.max_seq_len
            out.update(
                use_sliding_window=bool(cfg.sliding_window),
                sliding_window=window,
                max_window_layers=0 if cfg.sliding_window else cfg.num_layers,
            )
        else:
            out["sliding_window"] = cfg.sliding_window or None
        if cfg.num_experts:
            out.update(moe_to_hf(cfg, model_type))
        if model_type in (*hf_variants.VARIANTS, "granitemoe"):
            out.pop("sliding_window")
        out.update(hf_variants.variant_to_hf(cfg, model_type, rope))
        return out
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


# Defaults of transformers' Gemma3TextConfig (transformers 5) for fields a config.json leaves out.
_GEMMA3_DEFAULTS: dict[str, Any] = {
    "vocab_size": 262_208,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 26,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 131_072,
    "initializer_range": 0.02,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
    "sliding_window_pattern": 6,
}


def _gemma3_to_hf(cfg: ModelConfig, common: dict[str, Any]) -> dict[str, Any]:
    """`Gemma3ForCausalLM`'s config.json (model_type "gemma3_text") of a gemma3 `cfg`."""
    full: dict[str, Any] = {"rope_type": cfg.rope_type, "rope_theta": cfg.rope_theta}
    if cfg.rope_type != "default":
        full["factor"] = cfg.rope_factor
    layer_types = [
        "full_attention" if (i + 1) % cfg.sliding_window_pattern == 0 else "sliding_attention"
        for i in range(cfg.num_layers)
    ]
    return {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_activation": "gelu_pytorch_tanh",
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps,
        "rope_parameters": {
            "full_attention": full,
            "sliding_attention": {"rope_type": "default", "rope_theta": cfg.rope_local_theta},
        },
        # transformers 4's spellings of the same (5 reads rope_parameters)
        "rope_theta": cfg.rope_theta,
        "rope_local_base_freq": cfg.rope_local_theta,
        "rope_scaling": None
        if cfg.rope_type == "default"
        else {"rope_type": cfg.rope_type, "factor": cfg.rope_factor},
        "sliding_window_pattern": cfg.sliding_window_pattern,
        "layer_types": layer_types,
        "sliding_window": cfg.sliding_window or cfg.max_seq_len,
        "query_pre_attn_scalar": cfg.query_pre_attn_scalar or cfg.head_dim,
        "final_logit_softcapping": cfg.final_logit_softcap or None,
        "attn_logit_softcapping": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "use_bidirectional_attention": False,
        "tie_word_embeddings": True,
        **common,
    }


def _gemma3_from_hf(d: Mapping[str, Any], name: str, where: str) -> ModelConfig:
    f = _Fields(d, _GEMMA3_DEFAULTS, where)
    _check_architectures(d, ("Gemma3ForCausalLM", "Gemma3TextModel"), where)
    unsupported = []
    if f.raw("hidden_activation") not in _GPT2_ACTIVATIONS:
        unsupported.append(
            f"hidden_activation={f.raw('hidden_activation')!r} (jaxzero's Gemma 3 MLP is GeGLU, tanh)"
        )
    for key in (
        "attention_bias",
        "attn_logit_softcapping",
        "use_bidirectional_attention",
        "quantization_config",
    ):
        if d.get(key):
            unsupported.append(f"{key}={d[key]!r}")
    if not f.get_bool("tie_word_embeddings"):
        unsupported.append("tie_word_embeddings=false (jaxzero's Gemma 3 head is its embedding)")
    layers = f.get_int("num_hidden_layers")
    # Transformers 5 nests each layer kind's rope in rope_parameters; 4 spelled the global one
    # rope_theta + rope_scaling and the local one rope_local_base_freq.
    rope = d.get("rope_parameters") or {}
    if not isinstance(rope, Mapping) or not all(isinstance(v, Mapping) for v in rope.values()):
        raise ConfigError(f"{where}: rope_parameters={rope!r} must map each layer kind to an object.")
    full = {**(rope.get("full_attention") or {}), **(d.get("rope_scaling") or {})}
    theta = full.get("rope_theta", d.get("rope_theta", 1e6))
    local = (rope.get("sliding_attention") or {}).get("rope_theta", d.get("rope_local_base_freq", 1e4))
    rope_type = full.get("rope_type", full.get("type", "default"))
    if rope_type not in ("default", "linear"):
        unsupported.append(f"global rope type {rope_type!r} (jaxzero implements default and linear)")
    local_type = (rope.get("sliding_attention") or {}).get("rope_type", "default")
    if local_type != "default":
        unsupported.append(f"local rope type {local_type!r} (jaxzero's local layers use plain rope)")
    pattern = f.get_int("sliding_window_pattern")
    kinds = d.get("layer_types")
    if kinds is not None:
        # transformers' layer_types, read as a period: the first global layer's position.
        pattern = next((i + 1 for i, k in enumerate(kinds) if k == "full_attention"), layers + 1)
        want = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(layers)]
        if list(kinds) != want:
            unsupported.append(f"layer_types={list(kinds)} (jaxzero's global layers are every N-th)")
    if unsupported:
        raise ConfigError(f"{where}: unsupported Gemma3ForCausalLM features: " + "; ".join(unsupported) + ".")
    softcap = d.get("final_logit_softcapping")
    return ModelConfig(
        name=name,
        family="gemma3",
        vocab_size=f.get_int("vocab_size"),
        hidden_size=f.get_int("hidden_size"),
        num_layers=layers,
        num_heads=f.get_int("num_attention_heads"),
        num_kv_heads=f.get_int("num_key_value_heads"),
        head_size=f.get_int("head_dim"),
        intermediate_size=f.get_int("intermediate_size"),
        max_seq_len=f.get_int("max_position_embeddings"),
        tie_embeddings=True,
        rope_theta=_positive(theta, "rope_theta", where),
        rope_type=rope_type,
        rope_factor=_positive(full.get("factor"), "rope factor", where) if rope_type == "linear" else 1.0,
        sliding_window=f.get_int("sliding_window"),
        sliding_window_pattern=pattern,
        rope_local_theta=_positive(local, "rope_local_base_freq", where),
        query_pre_attn_scalar=f.get_int("query_pre_attn_scalar"),
        final_logit_softcap=0.0 if softcap is None else _positive(softcap, "final_logit_softcapping", where),
        hf_model_type="gemma3_text",
        norm_eps=f.get_float("rms_norm_eps"),
        init_std=f.get_float("initializer_range"),
    )


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
    except OSError as e:
        raise ConfigError(f"{file} cannot be read ({e.strerror or e}): check its permissions.") from e
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


def _llama_from_hf(d: Mapping[str, Any], model_type: str, name: str, where: str) -> ModelConfig:
    defaults = {**_LLAMA_DEFAULTS, **_FAMILY_DEFAULTS[model_type]}
    if "sliding_window" in d and d["sliding_window"] is None:
        defaults.pop("sliding_window", None)  # an explicit null: no window (transformers keeps the null)
    f = _Fields(d, defaults, where)
    arch = _ARCHITECTURES[model_type]
    _check_architectures(d, (arch, arch.replace("ForCausalLM", "Model")), where)
    unsupported = []
    if f.raw("hidden_act") != "silu":
        unsupported.append(f"hidden_act={f.raw('hidden_act')!r} (jaxzero's Llama MLP is SwiGLU with silu)")
    if model_type == "llama":
        for key, what in (("attention_bias", "q, k, v and o_proj"), ("mlp_bias", "the MLP")):
            if d.get(key):
                unsupported.append(f"{key}=true (biases on {what}; jaxzero's Llama biases q, k, v only)")
    # Transformers 4 spelled rope settings `rope_theta` + `rope_scaling`; 5 nests them in
    # `rope_parameters`. Like transformers, a legacy `rope_scaling` wins, and a theta inside the dict
    # wins over the top-level one.
    rope = d.get("rope_scaling") or d.get("rope_parameters") or {}
    if not isinstance(rope, Mapping):
        raise ConfigError(f"{where}: rope_parameters={rope!r} must be an object.")
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    scaling: dict[str, Any] = {}
    if rope_type in ("linear", "llama3"):
        scaling["rope_factor"] = _positive(rope.get("factor"), "rope factor", where)
    if rope_type == "llama3":
        scaling.update(
            rope_low_freq_factor=_positive(rope.get("low_freq_factor"), "rope low_freq_factor", where),
            rope_high_freq_factor=_positive(rope.get("high_freq_factor"), "rope high_freq_factor", where),
            rope_original_max_len=int(
                _positive(
                    rope.get("original_max_position_embeddings"), "original_max_position_embeddings", where
                )
            ),
        )
    elif rope_type not in ("default", "linear") and model_type != "phi3":  # phi3's: `variant_from_hf`
        unsupported.append(
            f"rope type {rope_type!r} (rope_parameters/rope_scaling={dict(rope)}); jaxzero implements "
            "default, linear and llama3"
        )
    partial = rope.get("partial_rotary_factor", d.get("partial_rotary_factor"))
    if partial not in (None, 1, 1.0) and model_type != "phi3":
        unsupported.append(f"partial_rotary_factor={partial} (jaxzero rotates the whole head)")
    theta = rope.get("rope_theta", d.get("rope_theta"))
    theta = _LLAMA_DEFAULTS["rope_theta"] if theta is None else theta
    if d.get("quantization_config"):
        unsupported.append("quantization_config (quantized weights)")
    hidden, heads = f.get_int("hidden_size"), f.get_int("num_attention_heads")
    head_dim = d.get("head_dim")
    qwen3 = model_type in ("qwen3", "qwen3_moe")
    if qwen3:  # a width of its own, whatever hidden_size / heads is (Qwen3-MoE's defaults to that)
        head_dim = f.get_int("head_dim") if model_type == "qwen3" or head_dim is not None else hidden // heads
        if d.get("attention_bias"):
            unsupported.append(
                "attention_bias=true (biases on q, k, v and o_proj; jaxzero's biases q, k, v only)"
            )
    elif head_dim is not None and heads and head_dim != hidden // heads:
        unsupported.append(
            f"head_dim={head_dim} != hidden_size/num_attention_heads = {hidden}/{heads} "
            "(jaxzero derives head_dim from the two)"
        )
    window = 0
    if model_type in ("mistral", "mixtral", "phi3") and f.raw("sliding_window") is not None:
        window = f.get_int("sliding_window")
    if model_type in ("qwen2", "qwen3", "qwen3_moe") and f.get_bool("use_sliding_window"):
        window = f.get_int("sliding_window")
    extra: dict[str, Any] = {}  # the experts' fields, or Phi-3's and OLMo 2's block variants
    if model_type in MOE_ARCHITECTURES:
        extra, more = moe_from_hf(d, model_type, where)
        unsupported += more
    variant, more = hf_variants.variant_from_hf(d, model_type, rope, where)
    extra, unsupported = {**extra, **variant}, unsupported + more
    if unsupported:
        raise ConfigError(f"{where}: unsupported {arch} features: " + "; ".join(unsupported) + ".")
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or theta <= 0:
        raise ConfigError(f"{where}: rope_theta={theta!r} must be a positive number.")
    kv = d.get("num_key_value_heads", defaults.get("num_key_value_heads"))
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
        rope_type=rope_type,
        **scaling,
        head_size=head_dim if qwen3 else 0,
        attention_bias=model_type == "qwen2",
        qk_norm=qwen3 or model_type == "olmo2",
        **extra,
        sliding_window=window,
        hf_model_type="" if model_type == "llama" else model_type,
        norm_eps=f.get_float("rms_norm_eps"),
        init_std=f.get_float("initializer_range"),
    )


def _positive(v: Any, what: str, where: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0:
        raise ConfigError(f"{where}: {what}={v!r} must be a positive number.")
    return float(v)


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
    if model_type in _ARCHITECTURES:
        cfg = _llama_from_hf(d, model_type, name, where)
    elif model_type == "gpt2":
        cfg = _gpt2_from_hf(d, name, where)
    elif model_type == "gemma3_text":
        cfg = _gemma3_from_hf(d, name, where)
    elif model_type == "gpt_oss":
        cfg = gpt_oss_from_hf(d, name, where)
    elif model_type == "gemma3" and isinstance(d.get("text_config"), Mapping):
        # Gemma3ForConditionalGeneration (4B-27B): its text model, the vision tower left out.
        _check_architectures(d, ("Gemma3ForConditionalGeneration",), where)
        cfg = _gemma3_from_hf(d["text_config"], name, f"{where} (text_config)")
    else:
        raise ConfigError(
            f"{where}: model_type={model_type!r} is not supported; jaxzero imports "
            + ", ".join(f"{t!r} ({a})" for t, a in _ARCHITECTURES.items())
            + ", 'gpt2' (GPT2LMHeadModel), 'gemma3_text' (Gemma3ForCausalLM), 'gemma3' (the text model "
            "of Gemma3ForConditionalGeneration) and 'gpt_oss' (GptOssForCausalLM)."
        )
    try:
        build_model(cfg)  # divisibility, even head_dim, ...: the same checks a run would make
    except ConfigError as e:
        raise ConfigError(f"{where}: the checkpoint's shape is invalid for jaxzero: {e}") from e
    return cfg
