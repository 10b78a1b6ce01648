"""The mixture-of-experts fields of a transformers `config.json` (Qwen3-MoE "qwen3_moe", Mixtral
"mixtral", Granite MoE "granitemoe") and jaxzero's `ModelConfig.num_experts` and friends, in both
directions; the rest of those configs is the Llama family's (`jaxzero.interop.hf_config_map`, with
Granite's scalars in `jaxzero.interop.hf_variants`). Granite's experts are Mixtral's: their width is
`intermediate_size`, and its router's softmax over the top-k logits is the top-k of the softmax
renormalised.

Every released Qwen3-MoE and Mixtral has a sparse MLP in every layer, which is what jaxzero computes:
Qwen3-MoE's `decoder_sparse_step` other than 1 or a non-empty `mlp_only_layers` (dense layers among
the sparse ones) is refused, as is Mixtral's `router_jitter_noise` (training-time noise on the router).

The load-balancing loss: transformers adds `router_aux_loss_coef` x the loss to the objective only
with `output_router_logits=true` (false in every released config and by default). Import sets
`ModelConfig.router_aux_loss_coef` to the config's coefficient where `output_router_logits` is true,
else 0 (the cross-entropy alone, as transformers trains it); export writes `output_router_logits=true`
with the coefficient where it is above 0, else transformers' defaults (false, 0.001), so a round trip
keeps the objective.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from jaxzero.config import ConfigError, ModelConfig

# The causal-LM classes of the MoE model types.
MOE_ARCHITECTURES = {
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "granitemoe": "GraniteMoeForCausalLM",
}
# Defaults of Qwen3MoeConfig / MixtralConfig (transformers 5) that differ from LlamaConfig's.
MOE_DEFAULTS: dict[str, dict[str, Any]] = {
    "qwen3_moe": {
        "vocab_size": 151936,
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "num_hidden_layers": 24,
        "num_key_value_heads": 4,
        "max_position_embeddings": 32768,
        "use_sliding_window": False,
        "sliding_window": 4096,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 768,
        "norm_topk_prob": False,
    },
    "mixtral": {
        "intermediate_size": 14336,
        "num_key_value_heads": 8,
        "max_position_embeddings": 4096 * 32,
        "rms_norm_eps": 1e-5,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
    },
    "granitemoe": {"num_local_experts": 8, "num_experts_per_tok": 2},
}


def _positive_int(
    d: Mapping[str, Any], defaults: Mapping[str, Any], keys: tuple[str, ...], where: str
) -> int:
    """The first of `keys` that `d` sets (else its default): a positive integer."""
    key = next((k for k in keys if d.get(k) is not None), keys[0])
    v = d.get(key, defaults.get(key))
    if type(v) is not int or v < 1:
        raise ConfigError(f"{where}: {key}={v!r} must be a positive integer.")
    return v


def moe_from_hf(d: Mapping[str, Any], model_type: str, where: str) -> tuple[dict[str, Any], list[str]]:
    """(the ModelConfig fields of the experts, the unsupported features found) of a config.json dict
    `d` of `model_type` ("qwen3_moe", "mixtral" or "granitemoe")."""
    defaults = MOE_DEFAULTS[model_type]
    unsupported = []
    # transformers reads either spelling of the expert count (num_experts, num_local_experts).
    experts = _positive_int(d, defaults, ("num_experts", "num_local_experts"), where)
    top_k = _positive_int(d, defaults, ("num_experts_per_tok",), where)
    if model_type in ("mixtral", "granitemoe"):
        width = _positive_int(d, {"intermediate_size": 11008, **defaults}, ("intermediate_size",), where)
        normalize = True
        if d.get("router_jitter_noise"):
            unsupported.append(f"router_jitter_noise={d['router_jitter_noise']} (random router noise)")
    else:
        width = _positive_int(d, defaults, ("moe_intermediate_size",), where)
        normalize = d.get("norm_topk_prob", defaults["norm_topk_prob"])
        if not isinstance(normalize, bool):
            raise ConfigError(f"{where}: norm_topk_prob={normalize!r} must be true or false.")
        if d.get("decoder_sparse_step", 1) != 1 or d.get("mlp_only_layers"):
            unsupported.append(
                f"decoder_sparse_step={d.get('decoder_sparse_step')}, mlp_only_layers="
                f"{d.get('mlp_only_layers')} (dense layers among the sparse ones; jaxzero makes every "
                "layer sparse, as every released Qwen3-MoE does)"
            )
    fields = dict(
        num_experts=experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=width,
        norm_topk_prob=normalize,
        router_aux_loss_coef=aux_loss_coef_from_hf(d, where),
    )
    return fields, unsupported


def aux_loss_coef_from_hf(d: Mapping[str, Any], where: str) -> float:
    """The load-balancing loss's weight in the objective transformers trains `d`'s model with: its
    `router_aux_loss_coef` (default 0.001) where `output_router_logits` is true, else 0. Every MoE
    family's config (Qwen3-MoE, Mixtral, gpt-oss) spells both alike."""
    on = d.get("output_router_logits", False)
    if not isinstance(on, bool):
        raise ConfigError(f"{where}: output_router_logits={on!r} must be true or false.")
    coef = d.get("router_aux_loss_coef", 0.001)
    if not on:
        return 0.0
    if isinstance(coef, bool) or not isinstance(coef, int | float) or not coef >= 0:
        raise ConfigError(f"{where}: router_aux_loss_coef={coef!r} must be a number >= 0.")
    return float(coef)


def moe_to_hf(cfg: ModelConfig, model_type: str) -> dict[str, Any]:
    """The expert fields of the config.json of `cfg` exported as `model_type`."""
    moe_alike = model_type in ("mixtral", "granitemoe")
    if moe_alike and (not cfg.norm_topk_prob or cfg.qk_norm or cfg.attention_bias):
        raise ConfigError(
            f"a model of {cfg.num_experts} experts with norm_topk_prob={cfg.norm_topk_prob}, qk_norm="
            f"{cfg.qk_norm}, attention_bias={cfg.attention_bias} has no transformers class: Mixtral "
            "and Granite renormalise their top-k without q/k norms or biases; Qwen3-MoE "
            "(model.qk_norm=true) has q/k norms."
        )
    out: dict[str, Any] = {
        "num_local_experts": cfg.num_experts,
        "num_experts_per_tok": cfg.num_experts_per_tok,
        # transformers adds the load-balancing loss only with output_router_logits (its default: off)
        "output_router_logits": cfg.router_aux_loss_coef > 0,
        "router_aux_loss_coef": cfg.router_aux_loss_coef or 0.001,
    }
    if moe_alike:
        out.update(intermediate_size=cfg.moe_intermediate_size)
    if model_type == "mixtral":
        out.update(router_jitter_noise=0.0)
    if model_type == "qwen3_moe":
        out.update(
            num_experts=cfg.num_experts,
            moe_intermediate_size=cfg.moe_intermediate_size,
            norm_topk_prob=cfg.norm_topk_prob,
            decoder_sparse_step=1,
            mlp_only_layers=[],
        )
    return out
