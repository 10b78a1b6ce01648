"""The rules of the Llama family's block variants that Phi-3, OLMo 2 and Granite checkpoints need:
fused q/k/v and gate/up projections, partial rotary embeddings, q/k norms over the whole projections,
norms after each sub-block instead of before it, and Granite's four scalars (`ModelConfig` fields).
Called by `jaxzero.config.checks.validate_model`; imports only the config.
"""

from __future__ import annotations

from jaxzero.config import ConfigError, ModelConfig

# Granite's model types: the MoE (GraniteMoeForCausalLM) and the dense (GraniteForCausalLM).
GRANITE = ("granitemoe", "granite")
# The transformers model types of the Llama family ('': jaxzero's own).
LLAMA_TYPES = ("", "llama", "qwen2", "qwen3", "mistral", "qwen3_moe", "mixtral", "phi3", "olmo2", *GRANITE)
# Qwen's types, whose `use_sliding_window` windows only the layers from `max_window_layers` on: a
# Llama-family model windows every layer (Mistral's, Mixtral's, Phi-3's), so theirs fit one window.
QWEN_WINDOWS = ("qwen2", "qwen3", "qwen3_moe")
# The transformers model types that compute each variant; '' (jaxzero's own) computes every one.
_TYPES_OF = {
    "fused_projections": ("phi3",),
    "partial_rotary_factor": ("phi3",),
    "post_norm": ("olmo2",),
    "qk_norm_scope": ("olmo2",),
    "embedding_multiplier": GRANITE,
    "residual_multiplier": GRANITE,
    "attention_multiplier": GRANITE,
    "logits_scaling": GRANITE,
}


def _set(m: ModelConfig) -> list[str]:
    """The variant fields `m` sets away from their defaults."""
    defaults = ModelConfig()
    return [k for k in _TYPES_OF if getattr(m, k) != getattr(defaults, k)]


def validate_variants(m: ModelConfig) -> None:
    """Raise ConfigError if `m`'s variant fields describe no model jaxzero computes, or no model of
    its `hf_model_type`, naming the fields, their values and the fix."""
    bad = [f"model.{k}={getattr(m, k)!r}" for k in _set(m)]
    if m.family != "llama" and bad:
        raise ConfigError(f"{', '.join(bad)}: Llama-family settings; model.family={m.family!r} has none.")
    if not 0 < m.partial_rotary_factor <= 1 or int(m.head_dim * m.partial_rotary_factor) % 2:
        raise ConfigError(
            f"model.partial_rotary_factor={m.partial_rotary_factor} must be in (0, 1] and leave an even "
            f"number of rotated dims of each head: int(head_dim={m.head_dim} x factor) = "
            f"{int(m.head_dim * m.partial_rotary_factor)}."
        )
    scalars = (m.embedding_multiplier, m.residual_multiplier, m.logits_scaling)
    if min(scalars) <= 0 or m.attention_multiplier < 0:
        raise ConfigError(
            f"model.embedding_multiplier={m.embedding_multiplier}, residual_multiplier="
            f"{m.residual_multiplier} and logits_scaling={m.logits_scaling} must be > 0, "
            f"attention_multiplier={m.attention_multiplier} >= 0 (0: 1/sqrt(head_dim))."
        )
    if m.qk_norm_scope == "projection" and not m.qk_norm:
        raise ConfigError("model.qk_norm_scope=projection needs model.qk_norm=true (the norms it places).")
    if m.fused_projections and (m.num_experts or m.attention_bias):
        raise ConfigError(
            f"model.fused_projections=true fuses a dense MLP's gate and up and unbiased q, k, v (Phi-3); "
            f"got model.num_experts={m.num_experts}, model.attention_bias={m.attention_bias}."
        )
    wrong = [f"model.{k}={getattr(m, k)!r}" for k in _set(m) if m.hf_model_type not in ("", *_TYPES_OF[k])]
    if wrong:
        raise ConfigError(
            f"{', '.join(wrong)}: no {m.hf_model_type} model of transformers computes this. Phi-3 "
            "(model.hf_model_type=phi3) has fused projections and partial rotary, OLMo 2 (olmo2) norms "
            "after each sub-block and q/k norms over the projections, Granite (granite, granitemoe) the "
            "four multipliers; model.hf_model_type='' trains any of them, but only a shape one of those "
            "types computes exports to Hugging Face."
        )
    if m.hf_model_type in GRANITE:
        need = {
            "qk_norm=false": not m.qk_norm,
            "attention_bias=false (Granite's would also bias o_proj)": not m.attention_bias,
            "head_size=0 (hidden_size / num_heads)": m.head_size in (0, m.hidden_size // m.num_heads),
            "sliding_window=0": not m.sliding_window,
            # top-k of the logits, softmax over the k: the softmax's top-k renormalised
            "norm_topk_prob=true": m.norm_topk_prob or not m.num_experts,
        }
        _need_all(m.hf_model_type, need, m)
    if m.hf_model_type == "phi3":
        need = {
            "fused_projections=true": m.fused_projections,
            "qk_norm=false": not m.qk_norm,
            "rope_type=default (longrope is not implemented)": m.rope_type == "default",
            "head_size=0 (hidden_size / num_heads)": m.head_size in (0, m.hidden_size // m.num_heads),
        }
        _need_all("phi3", need, m)
    if m.hf_model_type == "olmo2":
        need = {
            "post_norm=true": m.post_norm,
            "qk_norm=true": m.qk_norm,
            "qk_norm_scope=projection": m.qk_norm_scope == "projection",
            "attention_bias=false (OLMo 2's would also bias o_proj)": not m.attention_bias,
            "head_size=0 (hidden_size / num_heads)": m.head_size in (0, m.hidden_size // m.num_heads),
            "sliding_window=0": not m.sliding_window,
        }
        _need_all("olmo2", need, m)


def _need_all(model_type: str, need: dict[str, bool], m: ModelConfig) -> None:
    missing = [k for k, ok in need.items() if not ok]
    if missing:
        raise ConfigError(
            f"model.hf_model_type={model_type!r} needs model.{', model.'.join(missing)}; got "
            f"fused_projections={m.fused_projections}, qk_norm={m.qk_norm} ({m.qk_norm_scope}), "
            f"post_norm={m.post_norm}, rope_type={m.rope_type}, head_size={m.head_size}, "
            f"attention_bias={m.attention_bias}, sliding_window={m.sliding_window}."
        )


def lora_target_problem(m: ModelConfig, targets: list[str]) -> str | None:
    """Why `targets` (finetune.lora_targets' names) name projections that `m`'s blocks have not, or
    None: a model with `fused_projections` has qkv and gate_up where others have q, k, v, gate, up."""
    fused, split = {"qkv", "gate_up"}, {"q", "k", "v", "gate", "up"}
    wrong = [t for t in targets if t in (split if m.fused_projections else fused)]
    if not wrong:
        return None
    if m.fused_projections:
        return (
            f"finetune.lora_targets names {', '.join(wrong)}, which model.fused_projections=true (Phi-3) "
            "fuses into qkv_proj and gate_up_proj: use --finetune.lora_targets=qkv,o,gate_up,down (PEFT's "
            "qkv_proj, o_proj, gate_up_proj, down_proj)."
        )
    return (
        f"finetune.lora_targets names {', '.join(wrong)}, Phi-3's fused projections, which model "
        f"{m.name!r} has not: name q, k, v, o, gate, up, down."
    )
