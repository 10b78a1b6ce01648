"""The named sizes' shapes: every value of `model.name` that names a size, with each shape field's
value (read by `ModelConfig.named`). Data only, below `jaxzero.config`'s dataclasses."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

# The named sizes' shapes (published or released checkpoints'; parameter counts in
# `jaxzero.models.sizes`): the fields of _ROW, then the settings in which a size differs from _REST.
_ROW = (
    "family",
    "vocab_size",
    "hidden_size",
    "num_layers",
    "num_heads",
    "num_kv_heads",
    "intermediate_size",
    "max_seq_len",
    "tie_embeddings",
    "rope_theta",
    "norm_eps",
)
# fmt: off
_ROWS: dict[str, tuple[Any, ...]] = {
    # name               family   vocab   hidden layers heads kv  mlp    context tied   theta eps
    # Tiny shapes for tests and the default run.
    "llama-tiny":       ("llama", 256,    128,   4,     4,    2,  384,   1024,   False, 1e4,  1e-5),
    "gpt2-tiny":        ("gpt2",  256,    128,   4,     4,    4,  512,   1024,   True,  1e4,  1e-5),
    # OpenAI GPT-2 (HF gpt2, gpt2-medium, gpt2-large, gpt2-xl): context 1024, MLP 4D, tied.
    "gpt2-small":       ("gpt2",  50257,  768,   12,    12,   12, 3072,  1024,   True,  1e4,  1e-5),
    "gpt2-medium":      ("gpt2",  50257,  1024,  24,    16,   16, 4096,  1024,   True,  1e4,  1e-5),
    "gpt2-large":       ("gpt2",  50257,  1280,  36,    20,   20, 5120,  1024,   True,  1e4,  1e-5),
    "gpt2-xl":          ("gpt2",  50257,  1600,  48,    25,   25, 6400,  1024,   True,  1e4,  1e-5),
    # Llama 3.2 1B / 3B (tied) with plain RoPE, to train from scratch (the released checkpoints'
    # rope scaling is llama-3.2-1b / llama-3.2-3b).
    "llama-1b":         ("llama", 128256, 2048,  16,    32,   8,  8192,  131072, True,  5e5,  1e-5),
    "llama-3b":         ("llama", 128256, 3072,  28,    24,   8,  8192,  131072, True,  5e5,  1e-5),
    # Llama 2 7B / 13B (untied, multi-head).
    "llama-7b":         ("llama", 32000,  4096,  32,    32,   32, 11008, 4096,   False, 1e4,  1e-5),
    "llama-13b":        ("llama", 32000,  5120,  40,    40,   40, 13824, 4096,   False, 1e4,  1e-5),
    # InternLM2-20B's Llama-style shape.
    "llama-20b":        ("llama", 92544,  6144,  48,    48,   8,  16384, 32768,  False, 1e6,  1e-5),
    # LLaMA-1 "30B" (33B).
    "llama-30b":        ("llama", 32000,  6656,  60,    52,   52, 17920, 2048,   False, 1e4,  1e-6),
    # Llama 2 70B (grouped-query attention, 8 key/value heads).
    "llama-70b":        ("llama", 32000,  8192,  80,    64,   8,  28672, 4096,   False, 1e4,  1e-5),
    # The shape benchmarked against DeepSpeed: Llama 3.2 3B's trunk, multi-head, Llama 2's vocabulary.
    "llama-3.4b-bench": ("llama", 32000,  3072,  28,    24,   24, 8192,  4096,   False, 1e4,  1e-5),
    # Released checkpoints (`model.name=hf:DIR` loads their weights): Meta's Llama 3.1 8B, 3.2 1B / 3B,
    "llama-3.1-8b":     ("llama", 128256, 4096,  32,    32,   8,  14336, 131072, False, 5e5,  1e-5),
    "llama-3.1-70b":    ("llama", 128256, 8192,  80,    64,   8,  28672, 131072, False, 5e5,  1e-5),
    "llama-3.2-1b":     ("llama", 128256, 2048,  16,    32,   8,  8192,  131072, True,  5e5,  1e-5),
    "llama-3.2-3b":     ("llama", 128256, 3072,  28,    24,   8,  8192,  131072, True,  5e5,  1e-5),
    # Qwen2.5 0.5B, 7B, 14B,
    "qwen2.5-0.5b":     ("llama", 151936, 896,   24,    14,   2,  4864,  32768,  True,  1e6,  1e-6),
    "qwen2.5-7b":       ("llama", 152064, 3584,  28,    28,   4,  18944, 131072, False, 1e6,  1e-6),
    "qwen2.5-14b":      ("llama", 152064, 5120,  48,    40,   8,  13824, 131072, False, 1e6,  1e-5),
    # Mistral 7B v0.3 (no sliding window),
    "mistral-7b":       ("llama", 32768,  4096,  32,    32,   8,  14336, 32768,  False, 1e6,  1e-5),
    # and Qwen3 0.6B ... 32B (q/k norms, head_dim 128 whatever the width: _QWEN3).
    "qwen3-0.6b":       ("llama", 151936, 1024,  28,    16,   8,  3072,  40960,  True,  1e6,  1e-6),
    "qwen3-1.7b":       ("llama", 151936, 2048,  28,    16,   8,  6144,  40960,  True,  1e6,  1e-6),
    "qwen3-4b":         ("llama", 151936, 2560,  36,    32,   8,  9728,  40960,  True,  1e6,  1e-6),
    "qwen3-8b":         ("llama", 151936, 4096,  36,    32,   8,  12288, 40960,  False, 1e6,  1e-6),
    "qwen3-14b":        ("llama", 151936, 5120,  40,    40,   8,  17408, 40960,  False, 1e6,  1e-6),
    "qwen3-32b":        ("llama", 151936, 5120,  64,    64,   8,  25600, 40960,  False, 1e6,  1e-6),
    # Gemma 3 1B, 4B, 12B, 27B, text models (_GEMMA3: windows, local rope, head widths).
    "gemma-3-1b":       ("gemma3", 262144, 1152, 26,    4,    1,  6912,  32768,  True,  1e6,  1e-6),
    "gemma-3-4b":       ("gemma3", 262208, 2560, 34,    8,    4,  10240, 131072, True,  1e6,  1e-6),
    "gemma-3-12b":      ("gemma3", 262208, 3840, 48,    16,   8,  15360, 131072, True,  1e6,  1e-6),
    "gemma-3-27b":      ("gemma3", 262208, 5376, 62,    32,   16, 21504, 131072, True,  1e6,  1e-6),
    # Mixture-of-experts checkpoints (_QWEN3_MOE, _MIXTRAL: experts and their width; "mlp" is the
    # dense width transformers' config carries, which no layer of the released ones uses).
    "qwen3-30b-a3b":    ("llama", 151936, 2048,  48,    32,   4,  6144,  40960,  False, 1e6,  1e-6),
    "qwen3-235b-a22b":  ("llama", 151936, 4096,  94,    64,   4,  12288, 40960,  False, 1e6,  1e-6),
    "mixtral-8x7b":     ("llama", 32000,  4096,  32,    32,   8,  14336, 32768,  False, 1e6,  1e-5),
    # OpenAI's gpt-oss 20B and 120B (_GPT_OSS: heads of 64, biased experts of the width, yarn rope).
    "gpt-oss-20b":      ("gpt_oss", 201088, 2880, 24,   64,   8,  2880,  131072, False, 1.5e5, 1e-5),
    "gpt-oss-120b":     ("gpt_oss", 201088, 2880, 36,   64,   8,  2880,  131072, False, 1.5e5, 1e-5),
    # Phi-3-mini 4k and Phi-4 (_PHI3: fused projections; the mini's window 2047), OLMo 2 7B, 13B
    # (November 2024) and 32B (March 2025; _OLMO2: norms after each sub-block, q/k over the projections).
    "phi-3-mini":       ("llama", 32064,  3072,  32,    32,   32, 8192,  4096,   False, 1e4,  1e-5),
    "phi-4":            ("llama", 100352, 5120,  40,    40,   10, 17920, 16384,  False, 2.5e5, 1e-5),
    "olmo-2-7b":        ("llama", 100352, 4096,  32,    32,   32, 11008, 4096,   False, 5e5,  1e-6),
    "olmo-2-13b":       ("llama", 100352, 5120,  40,    40,   40, 13824, 4096,   False, 5e5,  1e-6),
    "olmo-2-32b":       ("llama", 100352, 5120,  64,    40,   8,  27648, 4096,   False, 5e5,  1e-6),
    # IBM Granite 3.1 MoE 1B-A400M and 3B-A800M, dense 8B (_GRANITE: the four scalars; "mlp" of the
    # MoE sizes is their experts' width, as their config.json's intermediate_size is).
    "granite-3.1-1b-a400m": ("llama", 49155, 1024, 24,  16,   8,  512,   131072, True,  1.5e6, 1e-6),
    "granite-3.1-3b-a800m": ("llama", 49155, 1536, 32,  24,   8,  512,   131072, True,  1e7,  1e-6),
    "granite-3.1-8b":       ("llama", 49155, 4096, 40,  32,   8,  12800, 131072, True,  1e7,  1e-5),
}
# fmt: on
# The other size fields: llama-tiny's, and every size's except where _DIFFERENT says.
_REST: dict[str, Any] = dict(
    rope_type="default",
    rope_factor=1.0,
    rope_low_freq_factor=1.0,
    rope_high_freq_factor=4.0,
    rope_original_max_len=8192,
    **dict(rope_beta_fast=32.0, rope_beta_slow=1.0, rope_truncate=True, rope_attention_factor=0.0),
    head_size=0,
    attention_bias=False,
    qk_norm=False,
    **dict(qk_norm_scope="head", post_norm=False, fused_projections=False, partial_rotary_factor=1.0),
    sliding_window=0,
    **dict(sliding_window_pattern=0, rope_local_theta=0.0, query_pre_attn_scalar=0, final_logit_softcap=0.0),
    hf_model_type="",
    **dict(num_experts=0, num_experts_per_tok=2, moe_intermediate_size=0, norm_topk_prob=True),
    **dict(swiglu_alpha=1.702, swiglu_limit=7.0),
    router_aux_loss_coef=0.0,
    **dict(embedding_multiplier=1.0, residual_multiplier=1.0, attention_multiplier=0.0, logits_scaling=1.0),
)
# Llama 3.1's rope scaling (transformers' "llama3"), each size with its own factor.
_LLAMA3_ROPE = dict(
    rope_type="llama3", rope_low_freq_factor=1.0, rope_high_freq_factor=4.0, rope_original_max_len=8192
)
_QWEN2 = dict(attention_bias=True, hf_model_type="qwen2")  # q, k, v biases
_QWEN3 = dict(qk_norm=True, head_size=128, hf_model_type="qwen3")  # q/k norms; head_dim 128 at every width
# The released MoE configs' load-balancing coefficients (router_aux_loss_coef): Qwen3-MoE 0.001, Mixtral 0.02.
_QWEN3_MOE = dict(
    _QWEN3, hf_model_type="qwen3_moe", num_experts=128, num_experts_per_tok=8, router_aux_loss_coef=0.001
)
_MIXTRAL = dict(
    hf_model_type="mixtral",
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=14336,
    router_aux_loss_coef=0.02,
)
# gpt-oss: a window of 128 on every other layer, yarn x32 over 4096 positions, top 4 of the experts.
_GPT_OSS = dict(
    head_size=64,
    attention_bias=True,
    num_experts_per_tok=4,
    moe_intermediate_size=2880,
    sliding_window=128,
    sliding_window_pattern=2,
    rope_type="yarn",
    rope_factor=32.0,
    rope_original_max_len=4096,
    rope_truncate=False,
    hf_model_type="gpt_oss",
    router_aux_loss_coef=0.9,  # the released configs'
)
# Gemma 3: five local layers (window 1024, rope base 1e4) to one global; from 4B on, global rope linear x8.
_GEMMA3 = dict(
    sliding_window=1024, sliding_window_pattern=6, rope_local_theta=1e4, hf_model_type="gemma3_text"
)
_GEMMA3_LINEAR = {**_GEMMA3, "rope_type": "linear", "rope_factor": 8.0}
_PHI3 = dict(fused_projections=True, hf_model_type="phi3")
_OLMO2 = dict(qk_norm=True, qk_norm_scope="projection", post_norm=True, hf_model_type="olmo2")
# Granite 3.1: embeddings x12, each sub-block's output x0.22, scores x1/head_dim (not its root), logits
# / logits_scaling; the MoE sizes route each token to 8 experts (router_aux_loss_coef 0: off). The
# 1B-A400M's config.json was read; the 3B-A800M's scalars are taken as the 1B's (both heads of 64).
_GRANITE = dict(hf_model_type="granite", embedding_multiplier=12.0, residual_multiplier=0.22)
_GRANITE_MOE = dict(
    _GRANITE,
    hf_model_type="granitemoe",
    num_experts_per_tok=8,
    moe_intermediate_size=512,
    attention_multiplier=0.015625,
    logits_scaling=6.0,
)
_DIFFERENT: dict[str, dict[str, Any]] = {
    "llama-3.1-8b": {**_LLAMA3_ROPE, "rope_factor": 8.0},
    "llama-3.1-70b": {**_LLAMA3_ROPE, "rope_factor": 8.0},
    "llama-3.2-1b": {**_LLAMA3_ROPE, "rope_factor": 32.0},
    "llama-3.2-3b": {**_LLAMA3_ROPE, "rope_factor": 32.0},
    "qwen2.5-0.5b": _QWEN2,
    "qwen2.5-7b": _QWEN2,
    "qwen2.5-14b": _QWEN2,
    "mistral-7b": {"hf_model_type": "mistral"},
    **{f"qwen3-{size}": _QWEN3 for size in ("0.6b", "1.7b", "4b", "8b", "14b", "32b")},
    "qwen3-30b-a3b": {**_QWEN3_MOE, "moe_intermediate_size": 768},
    "qwen3-235b-a22b": {**_QWEN3_MOE, "moe_intermediate_size": 1536},
    "mixtral-8x7b": _MIXTRAL,
    "gpt-oss-20b": {**_GPT_OSS, "num_experts": 32},
    "gpt-oss-120b": {**_GPT_OSS, "num_experts": 128},
    "phi-3-mini": {**_PHI3, "sliding_window": 2047},
    "phi-4": _PHI3,
    **{f"olmo-2-{size}": _OLMO2 for size in ("7b", "13b", "32b")},
    "granite-3.1-1b-a400m": {**_GRANITE_MOE, "num_experts": 32},
    "granite-3.1-3b-a800m": {**_GRANITE_MOE, "num_experts": 40},
    "granite-3.1-8b": {**_GRANITE, "attention_multiplier": 0.0078125, "logits_scaling": 16.0},
    "gemma-3-1b": {**_GEMMA3, "head_size": 256, "query_pre_attn_scalar": 256, "sliding_window": 512},
    "gemma-3-4b": {**_GEMMA3_LINEAR, "head_size": 256, "query_pre_attn_scalar": 256},
    "gemma-3-12b": {**_GEMMA3_LINEAR, "head_size": 256, "query_pre_attn_scalar": 256},
    "gemma-3-27b": {**_GEMMA3_LINEAR, "head_size": 128, "query_pre_attn_scalar": 168},
}

SIZE_SHAPES: Mapping[str, Mapping[str, Any]] = MappingProxyType(
    {
        name: MappingProxyType({**_REST, **dict(zip(_ROW, row)), **_DIFFERENT.get(name, {})})
        for name, row in _ROWS.items()
    }
)
"""Every named size's value of each shape field (those of `_ROW` and `_REST`), read-only; the keys
are the valid values of `model.name`, each built by `ModelConfig.named` (`jaxzero.models.sizes.NAMED_SIZES`
holds them as ModelConfigs)."""
