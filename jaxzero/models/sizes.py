"""Named model sizes (published shapes), analytic parameter counts and training FLOPs per token.

`model.name=NAME` on the command line selects one of `NAMED_SIZES`; the other `model.*` keys then
override single fields of it (see `jaxzero.config.apply_overrides`).

Parameter counts of the published sizes (checked by tests/test_models.py):

    gpt2-small    124,439,808      llama-1b    1,235,814,400   (Llama 3.2 1B)
    gpt2-medium   354,823,168      llama-3b    3,212,749,824   (Llama 3.2 3B)
    gpt2-large    774,030,080      llama-7b    6,738,415,616   (Llama 2 7B)
    gpt2-xl     1,557,611,200      llama-13b  13,015,864,320   (Llama 2 13B)
                                   llama-20b  19,861,149,696   (InternLM2-20B shape)
    llama-3.4b-bench 3,367,676,928 llama-30b  32,528,943,616   (LLaMA-1 33B)

Released checkpoints' shapes, with their rope scaling and biases (`model.name=hf:DIR` loads weights):

    llama-3.1-8b  8,030,261,248    qwen2.5-0.5b   494,032,768    mistral-7b  7,248,023,552 (v0.3)
    llama-3.2-1b  1,235,814,400    qwen2.5-7b   7,615,616,512
    llama-3.2-3b  3,212,749,824    qwen2.5-14b 14,770,033,664
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from types import MappingProxyType

from jaxzero.config import ConfigError, ModelConfig


def _gpt2(name: str, num_layers: int, hidden_size: int, num_heads: int) -> ModelConfig:
    """A published GPT-2 shape: vocab 50257, context 1024, MLP 4D, tied, LayerNorm eps 1e-5."""
    return ModelConfig(
        name=name,
        family="gpt2",
        vocab_size=50257,
        hidden_size=hidden_size,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_heads,
        intermediate_size=4 * hidden_size,
        max_seq_len=1024,
        tie_embeddings=True,
        norm_eps=1e-5,
    )


_SIZES: dict[str, ModelConfig] = {
    # Tiny shapes for tests and the default CLI run. llama-tiny is exactly the ModelConfig defaults.
    "llama-tiny": ModelConfig(),
    "gpt2-tiny": ModelConfig(
        name="gpt2-tiny",
        family="gpt2",
        vocab_size=256,
        hidden_size=128,
        num_layers=4,
        num_heads=4,
        num_kv_heads=4,
        intermediate_size=512,
        max_seq_len=1024,
        tie_embeddings=True,
    ),
    # OpenAI GPT-2 (HF gpt2, gpt2-medium, gpt2-large, gpt2-xl).
    "gpt2-small": _gpt2("gpt2-small", 12, 768, 12),
    "gpt2-medium": _gpt2("gpt2-medium", 24, 1024, 16),
    "gpt2-large": _gpt2("gpt2-large", 36, 1280, 20),
    "gpt2-xl": _gpt2("gpt2-xl", 48, 1600, 25),
    # Llama 3.2 1B / 3B (tied), with plain RoPE: shapes to train from scratch. The released
    # checkpoints' rope ("llama3" scaling) is llama-3.2-1b / llama-3.2-3b below.
    "llama-1b": ModelConfig(
        name="llama-1b",
        family="llama",
        vocab_size=128256,
        hidden_size=2048,
        num_layers=16,
        num_heads=32,
        num_kv_heads=8,
        intermediate_size=8192,
        max_seq_len=131072,
        tie_embeddings=True,
        rope_theta=500000.0,
        norm_eps=1e-5,
    ),
    "llama-3b": ModelConfig(
        name="llama-3b",
        family="llama",
        vocab_size=128256,
        hidden_size=3072,
        num_layers=28,
        num_heads=24,
        num_kv_heads=8,
        intermediate_size=8192,
        max_seq_len=131072,
        tie_embeddings=True,
        rope_theta=500000.0,
        norm_eps=1e-5,
    ),
    # Llama 2 7B / 13B (untied, multi-head).
    "llama-7b": ModelConfig(
        name="llama-7b",
        family="llama",
        vocab_size=32000,
        hidden_size=4096,
        num_layers=32,
        num_heads=32,
        num_kv_heads=32,
        intermediate_size=11008,
        max_seq_len=4096,
        tie_embeddings=False,
        rope_theta=10000.0,
        norm_eps=1e-5,
    ),
    "llama-13b": ModelConfig(
        name="llama-13b",
        family="llama",
        vocab_size=32000,
        hidden_size=5120,
        num_layers=40,
        num_heads=40,
        num_kv_heads=40,
        intermediate_size=13824,
        max_seq_len=4096,
        tie_embeddings=False,
        rope_theta=10000.0,
        norm_eps=1e-5,
    ),
    # InternLM2-20B's Llama-style shape (GQA 48/8, vocab 92544, theta 1e6, 32k context).
    "llama-20b": ModelConfig(
        name="llama-20b",
        family="llama",
        vocab_size=92544,
        hidden_size=6144,
        num_layers=48,
        num_heads=48,
        num_kv_heads=8,
        intermediate_size=16384,
        max_seq_len=32768,
        tie_embeddings=False,
        rope_theta=1000000.0,
        norm_eps=1e-5,
    ),
    # LLaMA-1 "30B" (33B): 60 layers of width 6656, RMSNorm eps 1e-6, 2k context.
    "llama-30b": ModelConfig(
        name="llama-30b",
        family="llama",
        vocab_size=32000,
        hidden_size=6656,
        num_layers=60,
        num_heads=52,
        num_kv_heads=52,
        intermediate_size=17920,
        max_seq_len=2048,
        tie_embeddings=False,
        rope_theta=10000.0,
        norm_eps=1e-6,
    ),
    # The shape benchmarked against DeepSpeed: Llama 3.2 3B's trunk with multi-head attention and the
    # Llama 2 vocabulary, untied.
    "llama-3.4b-bench": ModelConfig(
        name="llama-3.4b-bench",
        family="llama",
        vocab_size=32000,
        hidden_size=3072,
        num_layers=28,
        num_heads=24,
        num_kv_heads=24,
        intermediate_size=8192,
        max_seq_len=4096,
        tie_embeddings=False,
        rope_theta=10000.0,
        norm_eps=1e-5,
    ),
}


def _released(name: str, base: ModelConfig | None = None, **fields: object) -> ModelConfig:
    """A released checkpoint's shape, for planning and from-scratch runs (`model.name=hf:DIR` loads
    the weights): `base`'s fields (or ModelConfig's) with `fields` over them."""
    return dataclasses.replace(base or ModelConfig(), name=name, **fields)


_LLAMA3 = dict(
    family="llama",
    vocab_size=128256,
    num_heads=32,
    num_kv_heads=8,
    max_seq_len=131072,
    rope_theta=500000.0,
    rope_type="llama3",
    rope_low_freq_factor=1.0,
    rope_high_freq_factor=4.0,
    rope_original_max_len=8192,
    norm_eps=1e-5,
)
_QWEN25 = dict(
    family="llama",
    attention_bias=True,
    hf_model_type="qwen2",
    vocab_size=152064,
    max_seq_len=131072,
    rope_theta=1000000.0,
    norm_eps=1e-6,
)
_SIZES.update(
    {
        # Meta's Llama 3.1 8B and 3.2 1B / 3B: "llama3" rope scaling (factor 8, 32, 32).
        "llama-3.1-8b": _released(
            "llama-3.1-8b",
            **_LLAMA3,
            hidden_size=4096,
            num_layers=32,
            intermediate_size=14336,
            rope_factor=8.0,
        ),
        "llama-3.2-1b": _released(
            "llama-3.2-1b",
            **_LLAMA3,
            hidden_size=2048,
            num_layers=16,
            intermediate_size=8192,
            tie_embeddings=True,
            rope_factor=32.0,
        ),
        "llama-3.2-3b": _released(
            "llama-3.2-3b",
            **{**_LLAMA3, "num_heads": 24},
            hidden_size=3072,
            num_layers=28,
            intermediate_size=8192,
            tie_embeddings=True,
            rope_factor=32.0,
        ),
        # Qwen2.5 0.5B (tied, 32K context), 7B and 14B: q, k, v biases, theta 1e6.
        "qwen2.5-0.5b": _released(
            "qwen2.5-0.5b",
            **{**_QWEN25, "vocab_size": 151936, "max_seq_len": 32768},
            hidden_size=896,
            num_layers=24,
            num_heads=14,
            num_kv_heads=2,
            intermediate_size=4864,
            tie_embeddings=True,
        ),
        "qwen2.5-7b": _released(
            "qwen2.5-7b",
            **_QWEN25,
            hidden_size=3584,
            num_layers=28,
            num_heads=28,
            num_kv_heads=4,
            intermediate_size=18944,
        ),
        "qwen2.5-14b": _released(
            "qwen2.5-14b",
            **{**_QWEN25, "norm_eps": 1e-5},
            hidden_size=5120,
            num_layers=48,
            num_heads=40,
            num_kv_heads=8,
            intermediate_size=13824,
        ),
        # Mistral 7B v0.3: vocabulary 32768, theta 1e6, no sliding window.
        "mistral-7b": _released(
            "mistral-7b",
            family="llama",
            hf_model_type="mistral",
            vocab_size=32768,
            hidden_size=4096,
            num_layers=32,
            num_heads=32,
            num_kv_heads=8,
            intermediate_size=14336,
            max_seq_len=32768,
            rope_theta=1000000.0,
            norm_eps=1e-5,
        ),
    }
)

NAMED_SIZES: Mapping[str, ModelConfig] = MappingProxyType(_SIZES)
"""Every named size, read-only. Keys are the valid values of `model.name`."""


def named_model_config(name: str) -> ModelConfig:
    """The ModelConfig of a named size; an unknown name raises ConfigError listing the valid ones."""
    try:
        return NAMED_SIZES[name]
    except KeyError:
        raise ConfigError(f"unknown model.name {name!r}. Valid names: {', '.join(NAMED_SIZES)}.") from None


def _block_matmul_params(cfg: ModelConfig) -> int:
    """Elements of one block's matmul kernels (no norms, no biases)."""
    d, f = cfg.hidden_size, cfg.intermediate_size
    q_width = cfg.num_heads * cfg.head_dim
    kv_width = cfg.num_kv_heads * cfg.head_dim
    if cfg.family == "llama":
        # q, k, v, o projections and the three SwiGLU matrices.
        return d * q_width + 2 * d * kv_width + q_width * d + 3 * d * f
    if cfg.family == "gpt2":
        # fused qkv (D, 3D), attention c_proj (D, D), c_fc (D, F), mlp c_proj (F, D).
        return 3 * d * d + d * d + 2 * d * f
    raise ConfigError(f"unknown model family {cfg.family!r}; choose 'llama' or 'gpt2'.")


def unit_param_counts(cfg: ModelConfig) -> tuple[int, int, int]:
    """Parameters of the (embed unit, one block, head unit), from the shape alone.

    `param_count(cfg) == embed + num_layers * block + head`. A tied output head shares the token
    embedding, so it counts only in the embed unit.
    """
    d, f, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    block = _block_matmul_params(cfg)
    if cfg.family == "llama":
        block += 2 * d  # input_layernorm, post_attention_layernorm scales
        if cfg.attention_bias:
            block += (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim  # q, k, v biases
        embed = v * d
        head = d + (0 if cfg.tie_embeddings else d * v)  # final norm (+ lm_head)
    else:  # gpt2 (_block_matmul_params rejected any other family)
        block += 2 * 2 * d  # ln_1, ln_2 scale and bias
        block += 3 * d + d + f + d  # biases of c_attn, attn c_proj, c_fc, mlp c_proj
        embed = v * d + cfg.max_seq_len * d  # wte, wpe
        head = 2 * d  # ln_f; always tied
    return embed, block, head


def param_count(cfg: ModelConfig) -> int:
    """Number of parameters (elements of all leaves of `build_model(cfg).init(key)`), from the shape alone."""
    embed, block, head = unit_param_counts(cfg)
    return embed + cfg.num_layers * block + head


def matmul_param_count(cfg: ModelConfig) -> int:
    """Parameters that take part in matmuls: all block kernels plus the (D, V) output projection.

    The output projection counts whether tied or not (a tied head still runs a D x V matmul);
    embedding lookups, norms and biases do not count.
    """
    return cfg.num_layers * _block_matmul_params(cfg) + cfg.hidden_size * cfg.vocab_size


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token for one forward and backward pass without rematerialization.

        flops_per_token = 6 * P_matmul + 12 * num_layers * hidden_size * seq_len

    P_matmul = `matmul_param_count(cfg)`: each matmul weight costs 2 FLOPs (multiply, add) per token in
    the forward pass and 4 in the backward (gradients of the input and of the weight), hence 6.
    The second term is the attention itself, in the accounting of the PaLM paper (Chowdhery et al.
    2022, appendix B): per layer and token, QK^T and the attention-weighted sum of V each take
    2 * seq_len * hidden_size forward FLOPs, times 3 for forward + backward = 12 * hidden_size *
    seq_len. It is not halved for causal masking (the convention MFU numbers are quoted in), and does
    not depend on num_kv_heads (GQA shares k/v across heads but every query head still attends).
    Remat would add another forward pass; that is hardware FLOPs, not the model FLOPs MFU counts.
    """
    return float(6 * matmul_param_count(cfg) + 12 * cfg.num_layers * cfg.hidden_size * seq_len)
