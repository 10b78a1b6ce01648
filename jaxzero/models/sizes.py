"""Named model sizes (published shapes), analytic parameter counts and training FLOPs per token.

`NAMED_SIZES` are the named sizes' ModelConfigs. Their shapes are data of `jaxzero.config`
(`SIZE_SHAPES`), built by `ModelConfig.named`: `ModelConfig.named("llama-7b")` and
`--model.name=llama-7b` are the same model, and other `model.*` keys override single fields of it.

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

    qwen3-0.6b      596,049,920    qwen3-4b     4,022,468,096    qwen3-14b  14,768,307,200
    qwen3-1.7b    1,720,574,976    qwen3-8b     8,190,735,360    qwen3-32b  32,762,123,264

    phi-3-mini    3,821,079,552    olmo-2-7b    7,298,617,344    olmo-2-32b  32,234,279,936
    phi-4        14,659,507,200    olmo-2-13b  13,716,198,400

Mixtures of experts count every expert's parameters; their FLOPs count the parameters a token
multiplies by (`block_matmul_params`: the router and its top-k experts):

    qwen3-30b-a3b    30,532,122,624    qwen3-235b-a22b  235,093,634,560    mixtral-8x7b  46,702,792,704
    gpt-oss-20b      20,914,757,184    gpt-oss-120b     116,829,156,672

    granite-3.1-1b-a400m  1,334,628,352    granite-3.1-3b-a800m  3,298,793,472    (Granite 3.1 MoE,
    granite-3.1-8b        8,170,848,256    (dense)                                 tied; derived)
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from jaxzero.config import SIZE_SHAPES, ConfigError, ModelConfig

NAMED_SIZES: Mapping[str, ModelConfig] = MappingProxyType(
    {name: ModelConfig.named(name) for name in SIZE_SHAPES}
)
"""Every named size, read-only. Keys are the valid values of `model.name`."""


def ties_output(cfg: ModelConfig) -> bool:
    """Whether the output projection is the token embedding (`tie_embeddings`; gpt2 always is)."""
    return cfg.tie_embeddings or cfg.family in ("gpt2", "gemma3")


def block_matmul_params(cfg: ModelConfig) -> int:
    """Elements of one block's matmul kernels that each token multiplies by (no norms, no biases):
    with experts, the router's and the top-k experts' (`jaxzero.models.moe.active_matmul_params`)."""
    d, f = cfg.hidden_size, cfg.intermediate_size
    q_width = cfg.num_heads * cfg.head_dim
    kv_width = cfg.num_kv_heads * cfg.head_dim
    if cfg.num_experts:  # llama with experts, gpt_oss
        experts = d * cfg.num_experts + cfg.num_experts_per_tok * 3 * d * cfg.moe_intermediate_size
        return d * q_width + 2 * d * kv_width + q_width * d + experts
    if cfg.family in ("llama", "gemma3"):
        # q, k, v, o projections and the three SwiGLU (GeGLU) matrices.
        return d * q_width + 2 * d * kv_width + q_width * d + 3 * d * f
    if cfg.family == "gpt2":
        # fused qkv (D, 3D), attention c_proj (D, D), c_fc (D, F), mlp c_proj (F, D).
        return 3 * d * d + d * d + 2 * d * f
    raise ConfigError(f"unknown model family {cfg.family!r}; choose 'llama', 'gpt2', 'gemma3' or 'gpt_oss'.")


Shape = tuple[int, ...]


def unit_param_shapes(cfg: ModelConfig) -> tuple[list[Shape], list[Shape], list[Shape]]:
    """The shapes of the arrays of the (embed unit, one block, head unit) that `build_model(cfg).init`
    makes, from the config alone (no JAX: the placement is planned before JAX starts); their order
    is not the pytree's. A tied output head shares the token embedding, so it is in the embed unit."""
    d, f, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    q_width, kv_width = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    if cfg.family == "llama":
        # q, k, v, o projections, the three SwiGLU matrices, the two RMSNorm scales (OLMo 2's after
        # the attention and the MLP, the others' before them)
        block = [(d, q_width), (d, kv_width), (d, kv_width), (q_width, d), (d, f), (d, f), (f, d), (d,), (d,)]
        if cfg.num_experts:  # the router and the experts' [gate | up] and down kernels instead
            e, fe = cfg.num_experts, cfg.moe_intermediate_size
            block[4:7] = [(d, e), (e, d, 2 * fe), (e, fe, d)]
        if cfg.fused_projections:  # Phi-3: [q | k | v] and [gate | up] each one kernel
            block[0:3] = [(d, q_width + 2 * kv_width)]
            block[2:4] = [(d, 2 * f)]
        if cfg.attention_bias:
            block += [(q_width,), (kv_width,), (kv_width,)]
        if cfg.qk_norm and cfg.qk_norm_scope == "projection":  # OLMo 2: over all q heads, all k heads
            block += [(q_width,), (kv_width,)]
        elif cfg.qk_norm:
            block += [(cfg.head_dim,), (cfg.head_dim,)]  # one scale over each q head, one over each k head
        head = [(d,)] + ([] if cfg.tie_embeddings else [(d, v)])  # final norm (+ lm_head)
        return [(v, d)], block, head
    if cfg.family == "gpt_oss":
        # q, k, v, o (with their biases), the sinks, two RMSNorm scales, the router and the experts'
        # [gate | up] and down kernels, each with its biases
        e, fe = cfg.num_experts, cfg.moe_intermediate_size
        block = [(d, q_width), (d, kv_width), (d, kv_width), (q_width, d), (cfg.num_heads,), (d,), (d,)]
        block += [(d, e), (e,), (e, d, 2 * fe), (e, 2 * fe), (e, fe, d), (e, d)]
        if cfg.attention_bias:
            block += [(q_width,), (kv_width,), (kv_width,), (d,)]
        head = [(d,)] + ([] if cfg.tie_embeddings else [(d, v)])
        return [(v, d)], block, head
    if cfg.family == "gemma3":
        # q, k, v, o, the three GeGLU matrices, four norms of the width, the q and k head norms
        block = [(d, q_width), (d, kv_width), (d, kv_width), (q_width, d), (d, f), (d, f), (f, d)]
        block += [(d,)] * 4 + [(cfg.head_dim,)] * 2
        return [(v, d)], block, [(d,)]  # the embedding; the final norm (the head is always tied)
    if cfg.family == "gpt2":
        # fused qkv (D, 3D), attention c_proj, c_fc, mlp c_proj with their biases; ln_1, ln_2
        block = [(d, 3 * d), (3 * d,), (d, d), (d,), (d, f), (f,), (f, d), (d,), (d,), (d,), (d,), (d,)]
        return [(v, d), (cfg.max_seq_len, d)], block, [(d,), (d,)]  # wte, wpe; ln_f (always tied)
    raise ConfigError(f"unknown model family {cfg.family!r}; choose 'llama', 'gpt2', 'gemma3' or 'gpt_oss'.")


def unit_param_counts(cfg: ModelConfig) -> tuple[int, int, int]:
    """Parameters of the (embed unit, one block, head unit), from the shape alone
    (`unit_param_shapes`). `param_count(cfg) == embed + num_layers * block + head`."""
    embed, block, head = unit_param_shapes(cfg)
    return _elements(embed), _elements(block), _elements(head)


def _elements(shapes: list[Shape]) -> int:
    total = 0
    for shape in shapes:
        n = 1
        for size in shape:
            n *= size
        total += n
    return total


def param_count(cfg: ModelConfig) -> int:
    """Number of parameters (elements of all leaves of `build_model(cfg).init(key)`), from the shape alone."""
    embed, block, head = unit_param_counts(cfg)
    return embed + cfg.num_layers * block + head


def inactive_expert_params(cfg: ModelConfig) -> int:
    """Parameters of one block that a token does not multiply by: the kernels of the experts outside
    its top-k, (E - k) x 3 x D x F'; 0 without experts. A block's parameters less these are what a
    token's FLOPs count."""
    if not cfg.num_experts:
        return 0
    return (cfg.num_experts - cfg.num_experts_per_tok) * 3 * cfg.hidden_size * cfg.moe_intermediate_size


def routed_expert_params(cfg: ModelConfig) -> int:
    """Kernel parameters of one block's experts that a token multiplies by: its top-k's, k x 3 x D x
    F'; 0 without experts."""
    if not cfg.num_experts:
        return 0
    return cfg.num_experts_per_tok * 3 * cfg.hidden_size * cfg.moe_intermediate_size


def experts_at_rate(cfg: ModelConfig, share: float) -> float:
    """What one block's experts add to its parameter count as the accelerator's time counts them:
    its top-k experts' kernel parameters divided by their grouped matmuls' `share` of the dense rate,
    in place of every expert's (`routed_expert_params`, `inactive_expert_params`). Negative where
    the experts the tokens skip outweigh the slower rate; 0 without experts."""
    return routed_expert_params(cfg) * (1 / share - 1) - inactive_expert_params(cfg)


def matmul_param_count(cfg: ModelConfig) -> int:
    """Parameters that take part in each token's matmuls: all block kernels (of experts, the top-k's)
    plus the (D, V) output projection.

    The output projection counts whether tied or not (a tied head still runs a D x V matmul);
    embedding lookups, norms and biases do not count.
    """
    return cfg.num_layers * block_matmul_params(cfg) + cfg.hidden_size * cfg.vocab_size


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token for one forward and backward pass without rematerialization.

        flops_per_token = 6 * P_matmul + 12 * num_layers * num_heads * head_dim * seq_len

    P_matmul = `matmul_param_count(cfg)`: each matmul weight costs 2 FLOPs (multiply, add) per token in
    the forward pass and 4 in the backward (gradients of the input and of the weight), hence 6.
    The second term is the attention itself, in the accounting of the PaLM paper (Chowdhery et al.
    2022, appendix B): per layer and token, QK^T and the attention-weighted sum of V each take
    2 * seq_len * num_heads * head_dim forward FLOPs (hidden_size * seq_len but where heads have a
    width of their own, as Qwen3's; over a Gemma 3 local layer's window where shorter:
    `attention_span`), times 3 for forward + backward. It is not halved for causal
    masking (the convention MFU numbers are quoted in), and does not depend on num_kv_heads (GQA
    shares k/v across heads but every query head still attends).
    Remat would add another forward pass; that is hardware FLOPs, not the model FLOPs MFU counts.
    """
    attention_width = cfg.num_heads * cfg.head_dim
    spans = sum(attention_span(cfg, i, seq_len) for i in range(cfg.num_layers))
    return float(6 * matmul_param_count(cfg) + 12 * attention_width * spans)


def attention_span(cfg: ModelConfig, layer: int, seq_len: int) -> int:
    """The keys each query of block `layer` is counted against in the FLOP accounting: seq_len, or
    a Gemma 3 or gpt-oss local layer's window where that is shorter, or any Llama-family layer's."""
    local = cfg.family in ("gemma3", "gpt_oss") and (layer + 1) % cfg.sliding_window_pattern
    windowed = local or cfg.family == "llama"
    if windowed and cfg.sliding_window:
        return min(seq_len, cfg.sliding_window)
    return seq_len


def projection_shapes(m: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in, out) of each of a Llama block's projections, by `LORA_TARGETS` name, from the config
    alone (no JAX: the planner counts with it before JAX starts). A model with `fused_projections`
    has "qkv" and "gate_up" instead of q, k, v, gate and up."""
    d, f = m.hidden_size, m.intermediate_size
    q, kv = m.num_heads * m.head_dim, m.num_kv_heads * m.head_dim
    if m.fused_projections:
        return {"qkv": (d, q + 2 * kv), "o": (q, d), "gate_up": (d, 2 * f), "down": (f, d)}
    return {
        "q": (d, q),
        "k": (d, kv),
        "v": (d, kv),
        "o": (q, d),
        "gate": (d, f),
        "up": (d, f),
        "down": (f, d),
    }
