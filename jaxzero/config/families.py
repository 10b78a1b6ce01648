"""The rules of the model families' own settings (Gemma 3's layer pattern and norms, gpt-oss's
experts, windows and yarn rope), checked by `jaxzero.config.checks.validate_model`."""

from __future__ import annotations

from jaxzero.config import ConfigError, ModelConfig


def validate_gemma3(m: ModelConfig) -> None:
    """Gemma 3's own rules: a tied head, its layer pattern and local rope base, no q/k/v biases."""
    need = {
        "model.tie_embeddings=true (Gemma 3's head is its embedding)": m.tie_embeddings,
        "model.sliding_window_pattern >= 1 (every N-th layer global)": m.sliding_window_pattern >= 1,
        "model.rope_local_theta > 0 (the local layers' rotary base)": m.rope_local_theta > 0,
        "model.query_pre_attn_scalar >= 0 and model.final_logit_softcap >= 0": min(
            m.query_pre_attn_scalar, m.final_logit_softcap
        )
        >= 0,
        "model.attention_bias=false and model.qk_norm=false (its q/k norms are always there)": not (
            m.attention_bias or m.qk_norm
        ),
    }
    missing = [k for k, ok in need.items() if not ok]
    if missing:
        raise ConfigError(f"model.family=gemma3 needs {'; '.join(missing)}.")


def validate_gpt_oss(m: ModelConfig) -> None:
    """gpt-oss's own rules: experts of a width, every N-th layer global, no q/k norms; yarn's ramp."""
    need = {
        "model.num_experts >= 1 and 1 <= model.num_experts_per_tok <= model.num_experts (every block's "
        "MLP is its experts)": 1 <= m.num_experts_per_tok <= m.num_experts,
        "model.moe_intermediate_size >= 1 (each expert's width)": m.moe_intermediate_size >= 1,
        "model.sliding_window_pattern >= 1 (every N-th layer global; 2 in the released ones)": (
            m.sliding_window_pattern >= 1
        ),
        "model.qk_norm=false (gpt-oss has no q/k norms)": not m.qk_norm,
        "model.swiglu_alpha > 0 and model.swiglu_limit > 0": min(m.swiglu_alpha, m.swiglu_limit) > 0,
        "model.rope_beta_fast > model.rope_beta_slow > 0 and model.rope_attention_factor >= 0": (
            m.rope_beta_fast > m.rope_beta_slow > 0 and m.rope_attention_factor >= 0
        ),
    }
    missing = [k for k, ok in need.items() if not ok]
    if missing:
        raise ConfigError(f"model.family=gpt_oss needs {'; '.join(missing)}.")
