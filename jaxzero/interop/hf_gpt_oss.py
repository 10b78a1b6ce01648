"""gpt-oss's transformers `config.json` (`GptOssForCausalLM`, model_type "gpt_oss") and jaxzero's
`ModelConfig` of family "gpt_oss", in both directions (`jaxzero.interop.hf_config_map` dispatches here).

What jaxzero computes is exactly transformers' gpt-oss: yarn (or plain) rope, every N-th layer global
(`layer_types` must be such a pattern; the released ones alternate), the released checkpoints' MXFP4
experts (`quantization_config.quant_method = "mxfp4"`, dequantised at import, `jaxzero.interop.mxfp4`).
Anything else (another quantisation, partial rotary, yarn's mscale pair, attention dropout) is refused
with a ConfigError naming it. The load-balancing loss's fields are read by neither direction: export
writes transformers' defaults, as for Qwen3-MoE and Mixtral (`jaxzero.interop.hf_moe_config`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from jaxzero.config import ConfigError, ModelConfig
from jaxzero.interop.hf_moe_config import aux_loss_coef_from_hf

ARCHITECTURE = "GptOssForCausalLM"
# GptOssConfig's defaults (transformers 5): gpt-oss-120b's shape, for fields a config.json leaves out.
DEFAULTS: dict[str, Any] = {
    "num_hidden_layers": 36,
    "num_local_experts": 128,
    "vocab_size": 201088,
    "hidden_size": 2880,
    "intermediate_size": 2880,
    "head_dim": 64,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "sliding_window": 128,
    "tie_word_embeddings": False,
    "initializer_range": 0.02,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "num_experts_per_tok": 4,
    "swiglu_alpha": 1.702,
    "swiglu_limit": 7.0,
    "attention_bias": True,
    "rope_theta": 150000.0,
}
DEFAULT_ROPE = {
    "rope_type": "yarn",
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 4096,
}


def _get(d: Mapping[str, Any], key: str) -> Any:
    v = d.get(key)
    return DEFAULTS.get(key) if v is None else v


def _int(d: Mapping[str, Any], key: str, where: str) -> int:
    v = _get(d, key)
    if type(v) is not int or v < 1:
        raise ConfigError(f"{where}: {key}={v!r} must be a positive integer.")
    return v


def _num(v: Any, key: str, where: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0:
        raise ConfigError(f"{where}: {key}={v!r} must be a positive number.")
    return float(v)


def _bool(d: Mapping[str, Any], key: str, where: str) -> bool:
    v = _get(d, key)
    if not isinstance(v, bool):
        raise ConfigError(f"{where}: {key}={v!r} must be true or false.")
    return v


def _rope(d: Mapping[str, Any], where: str, unsupported: list[str]) -> dict[str, Any]:
    """The ModelConfig rope fields of config.json `d` (transformers 4's `rope_scaling` + `rope_theta`
    or 5's `rope_parameters`; a legacy `rope_scaling` wins, as in transformers)."""
    rope = d.get("rope_scaling") or d.get("rope_parameters") or DEFAULT_ROPE
    if not isinstance(rope, Mapping):
        raise ConfigError(f"{where}: rope_parameters={rope!r} must be an object.")
    theta = _num(rope.get("rope_theta", _get(d, "rope_theta")), "rope_theta", where)
    kind = rope.get("rope_type", rope.get("type", "default"))
    if rope.get("partial_rotary_factor", d.get("partial_rotary_factor")) not in (None, 1, 1.0):
        unsupported.append("partial_rotary_factor (jaxzero rotates the whole head)")
    if kind == "default":
        return {"rope_theta": theta, "rope_type": "default"}
    if kind != "yarn":
        unsupported.append(f"rope type {kind!r} (jaxzero's gpt-oss implements yarn and default)")
        return {}
    old = int(_num(rope.get("original_max_position_embeddings"), "original_max_position_embeddings", where))
    factor = rope.get("factor")
    factor = (
        _int(d, "max_position_embeddings", where) / old if factor is None else _num(factor, "factor", where)
    )
    attention = rope.get("attention_factor")
    if attention is None and rope.get("mscale") and rope.get("mscale_all_dim"):
        unsupported.append("yarn's mscale and mscale_all_dim (DeepSeek's attention factor)")
    truncate = rope.get("truncate", True)
    if not isinstance(truncate, bool):
        raise ConfigError(f"{where}: rope truncate={truncate!r} must be true or false.")
    return {
        "rope_theta": theta,
        "rope_type": "yarn",
        "rope_factor": factor,
        "rope_original_max_len": old,
        "rope_beta_fast": _num(rope.get("beta_fast") or 32, "beta_fast", where),
        "rope_beta_slow": _num(rope.get("beta_slow") or 1, "beta_slow", where),
        "rope_truncate": truncate,
        "rope_attention_factor": 0.0 if attention is None else _num(attention, "attention_factor", where),
    }


def gpt_oss_from_hf(d: Mapping[str, Any], name: str, where: str) -> ModelConfig:
    """The ModelConfig of gpt-oss config.json `d`; ConfigError naming every unsupported feature."""
    arch = d.get("architectures") or []
    if any(a not in (ARCHITECTURE, "GptOssModel") for a in arch):
        raise ConfigError(
            f"{where}: architectures={arch} is not supported: jaxzero imports only {ARCHITECTURE}."
        )
    unsupported: list[str] = []
    rope = _rope(d, where, unsupported)
    quant = d.get("quantization_config")
    if quant and (not isinstance(quant, Mapping) or quant.get("quant_method") != "mxfp4"):
        unsupported.append(f"quantization_config={quant!r} (jaxzero dequantises MXFP4 only)")
    if d.get("attention_dropout"):
        unsupported.append(f"attention_dropout={d['attention_dropout']} (jaxzero trains without dropout)")
    layers = _int(d, "num_hidden_layers", where)
    kinds = d.get("layer_types")
    pattern = 2
    if kinds is not None:  # read as a period: the first global layer's position
        pattern = next((i + 1 for i, k in enumerate(kinds) if k == "full_attention"), layers + 1)
        want = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(layers)]
        if list(kinds) != want:
            unsupported.append(f"layer_types={list(kinds)} (jaxzero's global layers are every N-th)")
    if unsupported:
        raise ConfigError(f"{where}: unsupported {ARCHITECTURE} features: " + "; ".join(unsupported) + ".")
    window = 0 if "sliding_window" in d and d["sliding_window"] is None else _int(d, "sliding_window", where)
    width = _int(d, "intermediate_size", where)
    return ModelConfig(
        name=name,
        family="gpt_oss",
        vocab_size=_int(d, "vocab_size", where),
        hidden_size=_int(d, "hidden_size", where),
        num_layers=layers,
        num_heads=_int(d, "num_attention_heads", where),
        num_kv_heads=_int(d, "num_key_value_heads", where),
        head_size=_int(d, "head_dim", where),
        intermediate_size=width,
        max_seq_len=_int(d, "max_position_embeddings", where),
        tie_embeddings=_bool(d, "tie_word_embeddings", where),
        **rope,
        attention_bias=_bool(d, "attention_bias", where),
        num_experts=_int(d, "num_local_experts", where),
        num_experts_per_tok=_int(d, "num_experts_per_tok", where),
        moe_intermediate_size=width,
        swiglu_alpha=_num(_get(d, "swiglu_alpha"), "swiglu_alpha", where),
        swiglu_limit=_num(_get(d, "swiglu_limit"), "swiglu_limit", where),
        router_aux_loss_coef=aux_loss_coef_from_hf(d, where),
        sliding_window=window,
        sliding_window_pattern=pattern,
        hf_model_type="gpt_oss",
        norm_eps=_num(_get(d, "rms_norm_eps"), "rms_norm_eps", where),
        init_std=_num(_get(d, "initializer_range"), "initializer_range", where),
    )


def gpt_oss_to_hf(cfg: ModelConfig, common: Mapping[str, Any]) -> dict[str, Any]:
    """`GptOssForCausalLM`'s config.json of a gpt_oss `cfg` (unquantised weights), with `common`'s
    fields (vocabulary, token ids, dtype). Its one width, `intermediate_size`, is the experts'
    (`moe_intermediate_size`: a gpt_oss model has no dense MLP, so its `intermediate_size` is unused)."""
    rope: dict[str, Any] = {"rope_type": cfg.rope_type, "rope_theta": cfg.rope_theta}
    if cfg.rope_type == "yarn":
        rope.update(
            factor=cfg.rope_factor,
            beta_fast=cfg.rope_beta_fast,
            beta_slow=cfg.rope_beta_slow,
            truncate=cfg.rope_truncate,
            original_max_position_embeddings=cfg.rope_original_max_len,
        )
        if cfg.rope_attention_factor:
            rope["attention_factor"] = cfg.rope_attention_factor
    kinds = [
        "full_attention" if (i + 1) % cfg.sliding_window_pattern == 0 else "sliding_attention"
        for i in range(cfg.num_layers)
    ]
    return {
        "architectures": [ARCHITECTURE],
        "model_type": "gpt_oss",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.moe_intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "num_local_experts": cfg.num_experts,
        "num_experts_per_tok": cfg.num_experts_per_tok,
        "swiglu_alpha": cfg.swiglu_alpha,
        "swiglu_limit": cfg.swiglu_limit,
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps,
        "rope_parameters": rope,
        "rope_theta": cfg.rope_theta,  # transformers 4's spelling (5 reads rope_parameters)
        "rope_scaling": None if cfg.rope_type == "default" else rope,
        "layer_types": kinds,
        "sliding_window": cfg.sliding_window or cfg.max_seq_len,  # 0 (none): a window of the context
        "attention_bias": cfg.attention_bias,
        "attention_dropout": 0.0,
        "hidden_act": "silu",
        # transformers adds the load-balancing loss only with output_router_logits (its default: off)
        "output_router_logits": cfg.router_aux_loss_coef > 0,
        "router_aux_loss_coef": cfg.router_aux_loss_coef or 0.001,
        "tie_word_embeddings": cfg.tie_embeddings,
        **common,
    }
