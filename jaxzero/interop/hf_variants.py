"""The fields of a transformers `config.json` of Phi-3 / Phi-4 ("phi3", `Phi3ForCausalLM`), OLMo 2
("olmo2", `Olmo2ForCausalLM`) and Granite 3 ("granite", `GraniteForCausalLM`; its MoE "granitemoe",
whose experts `jaxzero.interop.hf_moe_config` maps) that differ from the Llama family's, and jaxzero's
block variants (`ModelConfig.fused_projections`, `partial_rotary_factor`, `post_norm`,
`qk_norm_scope`, Granite's `embedding_multiplier`, `residual_multiplier`, `attention_multiplier`,
`logits_scaling`), in both directions; the rest of those configs is read and written as the Llama
family's (`jaxzero.interop.hf_config_map`).

Granite's `attention_multiplier` is the scores' factor itself (transformers' default 1.0, not
1/sqrt(head_dim)): import keeps it as it is, export writes jaxzero's 0 (1/sqrt(head_dim)) as that
number. Its `attention_bias` would also bias o_proj and its `mlp_bias` the MLP: both are refused.

Phi-3's rope scaling "longrope" (Phi-3-mini-128k, Phi-3.5, Phi-4-mini; also spelled "su" and "yarn"
in Phi-3's configs) picks its short or long factors by the length of each call's sequence and
rescales the rotation by an attention factor; transformers recomputes a generation's cache when it
crosses the original length. jaxzero does not implement it and refuses such a config in one line.
Phi-3's `sliding_window` is applied by transformers (Phi-3-mini-4k: 2047) and kept in
`ModelConfig.sliding_window`, every layer's, as Mistral's is (`models.llama`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from jaxzero.config import ConfigError, ModelConfig
from jaxzero.config.variants import GRANITE, validate_variants

# The causal-LM classes of the variant model types (Granite's MoE is among the MoE types).
VARIANTS = {"phi3": "Phi3ForCausalLM", "olmo2": "Olmo2ForCausalLM", "granite": "GraniteForCausalLM"}
# Granite's four scalars: config.json's name -> ModelConfig's field (the same names).
GRANITE_SCALARS = ("embedding_multiplier", "residual_multiplier", "attention_multiplier", "logits_scaling")
# Defaults of Phi3Config / Olmo2Config (transformers 5) that differ from LlamaConfig's.
VARIANT_DEFAULTS: dict[str, dict[str, Any]] = {
    "phi3": {
        "vocab_size": 32064,
        "hidden_size": 3072,
        "intermediate_size": 8192,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "sliding_window": None,
    },
    "olmo2": {"vocab_size": 50304, "rms_norm_eps": 1e-5},
    "granite": {},
}
_LONGROPE = ("longrope", "su", "yarn")


def implied_type(cfg: ModelConfig) -> str:
    """The model type whose transformers class computes `cfg`'s block variants ("" where none are set)."""
    if any(getattr(cfg, k) != getattr(ModelConfig(), k) for k in GRANITE_SCALARS):
        return "granitemoe" if cfg.num_experts else "granite"
    if cfg.fused_projections or cfg.post_norm:
        return "phi3" if cfg.fused_projections else "olmo2"
    return ""


def llama_model_type(cfg: ModelConfig) -> str:
    """The transformers model_type a Llama-family `cfg` is written and named as: `hf_model_type`
    where set, else the one its settings imply (its block variants' type; a mixture of experts'
    qwen3_moe with q/k norms, else mixtral; a dense model's qwen3, qwen2 with biases, else llama).
    config.json's model_type and the tensors' names both follow it."""
    if cfg.hf_model_type:
        return cfg.hf_model_type
    if implied_type(cfg):
        return implied_type(cfg)
    if cfg.num_experts:
        return "qwen3_moe" if cfg.qk_norm else "mixtral"
    return "qwen3" if cfg.qk_norm else "qwen2" if cfg.attention_bias else "llama"


def variant_from_hf(
    d: Mapping[str, Any], model_type: str, rope: Mapping[str, Any], where: str
) -> tuple[dict[str, Any], list[str]]:
    """(the ModelConfig variant fields, the unsupported features found) of a config.json dict `d` of
    `model_type` (none for a type without variants), whose rope settings are `rope`."""
    if model_type in GRANITE:
        return _granite_from_hf(d, where)
    if model_type == "olmo2":
        unsupported = []
        if d.get("attention_bias"):
            unsupported.append("attention_bias=true (biases on q, k, v and o_proj; jaxzero's has none)")
        return dict(qk_norm_scope="projection", post_norm=True), unsupported
    if model_type != "phi3":
        return {}, []
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type in _LONGROPE:
        return {}, [
            f"rope type {rope_type!r} (LongRoPE's short and long factors by sequence length: "
            "Phi-3-mini-128k, Phi-3.5, Phi-4-mini); jaxzero implements Phi-3's default rope only"
        ]
    partial = rope.get("partial_rotary_factor", d.get("partial_rotary_factor"))
    return dict(fused_projections=True, partial_rotary_factor=1.0 if partial is None else float(partial)), []


def variant_to_hf(cfg: ModelConfig, model_type: str, rope: dict[str, Any]) -> dict[str, Any]:
    """The fields of the config.json of `cfg` exported as the Llama-family `model_type` that Phi-3 or
    OLMo 2 add (Phi-3's partial rotary factor also written into its rope settings `rope`); none for
    the other types. Raises ConfigError if no `model_type` model computes `cfg`'s block variants (a
    partial rotary without Phi-3's fused projections: no transformers class has both)."""
    validate_variants(dataclasses.replace(cfg, hf_model_type=model_type))
    if model_type in GRANITE:
        scalars = {k: float(getattr(cfg, k)) for k in GRANITE_SCALARS}
        scalars["attention_multiplier"] = cfg.attention_multiplier or cfg.head_dim**-0.5
        return {**scalars, "attention_bias": False, **({} if cfg.num_experts else {"mlp_bias": False})}
    if model_type not in VARIANTS:
        return {}
    if model_type == "olmo2":
        return {"attention_bias": False}
    rope["partial_rotary_factor"] = cfg.partial_rotary_factor
    return {
        "partial_rotary_factor": cfg.partial_rotary_factor,
        "original_max_position_embeddings": cfg.max_seq_len,
        "sliding_window": cfg.sliding_window or None,
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
    }


def _granite_from_hf(d: Mapping[str, Any], where: str) -> tuple[dict[str, Any], list[str]]:
    """Granite's four scalars of its config.json `d` (transformers' default 1.0 where absent), and
    the biases jaxzero's Llama block has not."""
    fields = {}
    for key in GRANITE_SCALARS:
        v = d.get(key)
        v = 1.0 if v is None else v
        if isinstance(v, bool) or not isinstance(v, int | float) or v <= 0:
            raise ConfigError(f"{where}: {key}={v!r} must be a positive number.")
        fields[key] = float(v)
    unsupported = []
    for key, what in (("attention_bias", "q, k, v and o_proj"), ("mlp_bias", "the MLP")):
        if d.get(key):
            unsupported.append(f"{key}=true (biases on {what}; jaxzero's Granite has none)")
    return fields, unsupported
