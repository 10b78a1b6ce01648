"""Llama-family decoder (Llama 2/3, Qwen2/2.5, Qwen3, Mistral, Phi-3/4, OLMo 2, Granite 3, and
Llama-shaped models such as InternLM2): pre-norm blocks of RMSNorm, rotary grouped-query attention
(rope scaled as `ModelConfig.rope_type` says; q, k, v biases with `attention_bias`; each q and k head
RMS-normalised before the rotation with `qk_norm`, as Qwen3) and a SwiGLU MLP, tied or untied output
head. Granite scales the embeddings, each sub-block's output, the attention scores and the logits by
the config's four scalars (`embedding_multiplier`, ...; 1 and 1/sqrt(head_dim) for every other model).

Parameter pytrees are plain nested dicts named after HF `LlamaForCausalLM`, so that conversion is a
name map plus a transpose of each "kernel" (stored (in, out) here, (out, in) in torch):

    embed:  {"embed_tokens": {"embedding": (V, D)}}           model.embed_tokens.weight
    block:  {"input_layernorm":          {"scale": (D,)},     model.layers.i.input_layernorm.weight
             "self_attn": {"q_proj": {"kernel": (D, N*H)},    ...self_attn.q_proj.weight
                                      (and "bias": (N*H,), K*H for k and v, with attention_bias)
                           "k_proj": {"kernel": (D, K*H)},
                           "v_proj": {"kernel": (D, K*H)},
                           "o_proj": {"kernel": (N*H, D)},
                           (and "q_norm", "k_norm": {"scale": (H,)} with qk_norm; (N*H,) and
                            (K*H,) with qk_norm_scope=projection)},
             "post_attention_layernorm": {"scale": (D,)},
             "mlp": {"gate_proj": {"kernel": (D, F)},         ...mlp.gate_proj.weight
                     "up_proj":   {"kernel": (D, F)},
                     "down_proj": {"kernel": (F, D)}}}
    head:   {"norm": {"scale": (D,)},                         model.norm.weight
             "lm_head": {"kernel": (D, V)}}                   lm_head.weight
            ("lm_head" is absent when `tie_embeddings`; logits then use embed_tokens)

Phi-3 (`fused_projections`) keeps q, k, v as one "qkv_proj" {"kernel": (D, (N+2K)*H)} ([q | k | v]
along its output) and gate, up as one "gate_up_proj" {"kernel": (D, 2F)} ([gate | up]), as its
checkpoints do, and may rotate only the first int(H x `partial_rotary_factor`) dims of each head.
OLMo 2 (`post_norm`) has no "input_layernorm": "post_attention_layernorm" normalises the attention's
output and "post_feedforward_layernorm" {"scale": (D,)} the MLP's, each before its residual add.

With `num_experts` E > 0 (Qwen3-MoE, Mixtral, Granite MoE) the block's "mlp" is the sparse MLP of
`jaxzero.models.moe` instead, dropless top-k routing over SwiGLU experts of width F' =
`moe_intermediate_size`:

             "mlp": {"router":  {"kernel": (D, E)},           ...mlp.gate.weight (Mixtral: block_sparse_moe)
                     "gate_up": {"kernel": (E, D, 2F')},      [gate | up] of each of experts.e.gate_proj,
                     "down":    {"kernel": (E, F', D)}}       up_proj (Mixtral w1, w3) and down_proj (w2)

D = hidden_size, N = num_heads, K = num_kv_heads, H = head_dim (`head_size`, or D / N), F =
intermediate_size, V = vocab_size.
q/k heads are laid out head-major along the projection's output axis, (N, H), as in HF; the rotary
embedding uses HF's rotate-half pairing (i, i + H/2), so HF checkpoints need no q/k permutation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxzero.config import ModelConfig
from jaxzero.config.variants import QWEN_WINDOWS
from jaxzero.models import layers, moe
from jaxzero.models.base import KVCache, ModelParams, init_params
from jaxzero.models.lora import LoraSpec, dequantize, lora_delta


class _Linear(nn.Module):
    """y = x @ kernel [+ bias], kernel (in, out) float32 ~ Normal(0, std), bias (out,) zeros at init
    (with `use_bias`), both used in x's (compute) dtype. Where its parameters carry them
    (`jaxzero.models.lora`): an int8 kernel with its "kernel_scale", dequantised here, and a LoRA
    adapter ("lora_a", "lora_b") added as `lora` says, with dropout where a "dropout" key is given."""

    features: int
    std: float
    use_bias: bool = False
    lora: LoraSpec | None = None

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        kernel = self.param(
            "kernel", lambda k, shape: layers.normal(k, shape, self.std), (x.shape[-1], self.features)
        )
        if self.has_variable("params", "kernel_scale"):
            kernel = dequantize(kernel, self.get_variable("params", "kernel_scale"), x.dtype)
        bias = None
        if self.use_bias:
            bias = self.param("bias", lambda _, shape: layers.zeros(shape), (self.features,)).astype(x.dtype)
        y = layers.dense(x, kernel.astype(x.dtype), bias)
        if self.lora is not None and self.has_variable("params", "lora_a"):
            a, b = self.get_variable("params", "lora_a"), self.get_variable("params", "lora_b")
            rng = self.make_rng("dropout") if self.has_rng("dropout") else None
            y = y + lora_delta(x, a, b, self.lora, rng)
        return y


class _RMSNorm(nn.Module):
    """RMSNorm with a learned `scale` (ones at init); statistics in float32 (`layers.rms_norm`)."""

    eps: float

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        scale = self.param("scale", lambda _, shape: layers.ones(shape), (x.shape[-1],))
        # Cast like every weight (to the compute dtype) so f32 masters and streamed bf16 weights agree.
        return layers.rms_norm(x, scale.astype(x.dtype), self.eps)


class _Attention(nn.Module):
    """Causal self-attention over the sequence (within each segment where `segments` is given), or,
    with a `cache` (k, v), of the tokens at positions pos .. pos+S-1 over the cache, which it returns
    with their keys and values written in."""

    config: ModelConfig
    lora: LoraSpec | None = None

    @nn.compact
    def __call__(
        self,
        h: jax.Array,
        cache: KVCache | None = None,
        pos: jax.Array | None = None,
        segments: jax.Array | None = None,
    ) -> Any:
        c = self.config
        b, s, _ = h.shape
        n, k, hd = c.num_heads, c.num_kv_heads, c.head_dim
        bias = c.attention_bias
        lora = self.lora
        if c.fused_projections:  # one (D, (N+2K)H) matmul, [q | k | v] along its output (Phi-3)
            qkv = _Linear((n + 2 * k) * hd, c.init_std, lora=lora, name="qkv_proj")(h)
            q, kk, v = jnp.split(qkv, [n * hd, (n + k) * hd], axis=-1)
        else:
            q = _Linear(n * hd, c.init_std, bias, lora, name="q_proj")(h)
            kk = _Linear(k * hd, c.init_std, bias, lora, name="k_proj")(h)
            v = _Linear(k * hd, c.init_std, bias, lora, name="v_proj")(h)
        if c.qk_norm and c.qk_norm_scope == "projection":  # over all heads at once (OLMo 2)
            q = _RMSNorm(c.norm_eps, name="q_norm")(q)
            kk = _RMSNorm(c.norm_eps, name="k_norm")(kk)
        q, kk, v = q.reshape(b, s, n, hd), kk.reshape(b, s, k, hd), v.reshape(b, s, k, hd)
        if c.qk_norm and c.qk_norm_scope == "head":  # each head over its own width (Qwen3)
            q = _RMSNorm(c.norm_eps, name="q_norm")(q)
            kk = _RMSNorm(c.norm_eps, name="k_norm")(kk)
        out = _Linear(c.hidden_size, c.init_std, lora=lora, name="o_proj")
        scale = c.attention_multiplier or None  # Granite's factor; None: 1/sqrt(head_dim)
        # Mistral's, Mixtral's and Phi-3's window covers every layer; Qwen's only some, so it is left
        # out (`config.checks` refuses a Qwen run longer than it). Where the keys fit in one window
        # it changes nothing, and is left out too (packed documents keep cuDNN's packed layout).
        keys = s if cache is None else cache[0].shape[1]
        windowed = c.sliding_window and c.hf_model_type not in QWEN_WINDOWS and keys > c.sliding_window
        window = jnp.int32(c.sliding_window) if windowed else None
        if cache is None:
            cos, sin = layers.rope_cos_sin(s, layers.rope_inv_freq(c))
            # Rotary positions run over the whole row, not from 0 at each segment: scores depend only on
            # the offset between query and key, which is the same either way within a segment.
            o = layers.causal_attention(
                layers.apply_rope(q, cos, sin),
                layers.apply_rope(kk, cos, sin),
                v,
                c.attention_impl,
                segments,
                window=window,
                local_window=c.sliding_window if windowed else None,
                scale=scale,
            )
            return out(o.reshape(b, s, n * hd))
        cos, sin = layers.rope_cos_sin(cache[0].shape[1], layers.rope_inv_freq(c))
        cos, sin = (jax.lax.dynamic_slice_in_dim(t, pos, s) for t in (cos, sin))
        k_cache = jax.lax.dynamic_update_slice_in_dim(cache[0], layers.apply_rope(kk, cos, sin), pos, axis=1)
        v_cache = jax.lax.dynamic_update_slice_in_dim(cache[1], v, pos, axis=1)
        q = layers.apply_rope(q, cos, sin)
        o = layers.cached_attention(q, k_cache, v_cache, pos, window=window, scale=scale)
        return out(o.reshape(b, s, n * hd)), (k_cache, v_cache)


class _MLP(nn.Module):
    config: ModelConfig
    lora: LoraSpec | None = None

    @nn.compact
    def __call__(self, h: jax.Array) -> jax.Array:
        c, lora = self.config, self.lora
        if c.fused_projections:  # one (D, 2F) matmul, [gate | up] along its output (Phi-3)
            gate_up = _Linear(2 * c.intermediate_size, c.init_std, lora=lora, name="gate_up_proj")(h)
            gate, up = jnp.split(gate_up, 2, axis=-1)
        else:
            gate = _Linear(c.intermediate_size, c.init_std, lora=lora, name="gate_proj")(h)
            up = _Linear(c.intermediate_size, c.init_std, lora=lora, name="up_proj")(h)
        return _Linear(c.hidden_size, c.init_std, lora=lora, name="down_proj")(jax.nn.silu(gate) * up)


def moe_spec(c: ModelConfig) -> moe.MoeSpec:
    """The experts' routing of a Llama-family config with `num_experts` > 0: softmax over all
    experts, the top `num_experts_per_tok`, renormalised with `norm_topk_prob` (Mixtral always is;
    so is Granite, whose softmax over the top-k logits is the same weights: tests/test_moe.py)."""
    return moe.qwen3_moe_spec(c.num_experts, c.num_experts_per_tok, c.norm_topk_prob)


class _MoE(nn.Module):
    """The sparse MLP (`jaxzero.models.moe`): router and experts, float32 masters used in x's dtype
    (int8 kernels with their "kernel_scale" dequantised first, as `_Linear` does). Experts are grouped
    as `model.moe_impl` says (`moe.moe_layer`). No LoRA adapters: LoRA adapts attention.
    Returns (y, this layer's `moe.RouterStats` over the tokens of h where `token_mask` (bool (B, S))
    is True, over every token without one: the load-balancing loss's)."""

    config: ModelConfig

    @nn.compact
    def __call__(
        self, h: jax.Array, token_mask: jax.Array | None = None
    ) -> tuple[jax.Array, moe.RouterStats]:
        c = self.config
        spec = moe_spec(c)
        d, f, e = c.hidden_size, c.moe_intermediate_size, c.num_experts

        def kernel(shape: tuple[int, ...]) -> Any:
            return lambda key: {"kernel": layers.normal(key, shape, c.init_std)}

        params = {
            "router": self.param("router", kernel((d, e))),
            "gate_up": self.param("gate_up", kernel((e, d, 2 * f))),
            "down": self.param("down", kernel((e, f, d))),
        }
        for name, p in params.items():
            if "kernel_scale" in p:
                params[name] = {"kernel": dequantize(p["kernel"], p["kernel_scale"], h.dtype)}
        return moe.moe_layer(params, h, spec, c.moe_impl, token_mask)


def _residual(y: jax.Array, c: ModelConfig) -> jax.Array:
    """A sub-block's output y as its residual add takes it: times `residual_multiplier` (Granite)
    in y's dtype, as transformers multiplies; y itself where the multiplier is 1."""
    return y if c.residual_multiplier == 1.0 else y * jnp.asarray(c.residual_multiplier, y.dtype)


class LlamaBlock(nn.Module):
    """One pre-norm Llama block as a Flax module: (B, S, D) -> (B, S, D) in the compute dtype.

        x = x + o_proj(attn(rope(q_proj(n1(x))), rope(k_proj(n1(x))), v_proj(n1(x))))
        x = x + down_proj(silu(gate_proj(n2(x))) * up_proj(n2(x)))

    (with `post_norm`: x = x + n1(attn(x)), then x = x + n2(mlp(x)), OLMo 2's order; Granite: each
    added output times `residual_multiplier`, the scores times `attention_multiplier`.)

    Its parameters are the block pytree of the module docstring; every weight is used in the compute
    dtype, so float32 masters and compute-dtype copies give the same result. `segments` (B, S) int32:
    attention stays within each segment (`layers.causal_attention`); not with a `cache`. `lora`: how
    adapters in the parameters apply (`jaxzero.models.lora`). `stats` (experts only, without a
    cache): return (x, the layer's `moe.RouterStats` over the tokens of `token_mask`, bool (B, S), where
    given) instead of x.
    """

    config: ModelConfig
    lora: LoraSpec | None = None
    stats: bool = False

    @nn.compact
    def __call__(
        self,
        x: jax.Array,
        cache: KVCache | None = None,
        pos: jax.Array | None = None,
        segments: jax.Array | None = None,
        token_mask: jax.Array | None = None,
    ) -> Any:
        c = self.config
        x = x.astype(layers.compute_dtype(c))
        attn = _Attention(c, self.lora, name="self_attn")
        if c.post_norm:  # OLMo 2: each sub-block's output normalised, its input not
            h = x
        else:
            h = _RMSNorm(c.norm_eps, name="input_layernorm")(x)
        if cache is None:
            a = attn(h, segments=segments)
        else:
            a, cache = attn(h, cache, pos)
        if c.post_norm:
            x = x + _residual(_RMSNorm(c.norm_eps, name="post_attention_layernorm")(a), c)
            h = x
        else:
            x = x + _residual(a, c)
            h = _RMSNorm(c.norm_eps, name="post_attention_layernorm")(x)
        stats = None
        if c.num_experts:
            y, stats = _MoE(c, name="mlp")(h, token_mask)
        else:
            y = _MLP(c, self.lora, name="mlp")(h)
        if c.post_norm:
            y = _RMSNorm(c.norm_eps, name="post_feedforward_layernorm")(y)
        x = x + _residual(y, c)
        if cache is not None:
            return x, cache
        return (x, stats) if self.stats else x


@dataclass(frozen=True)
class Llama:
    """A Llama model of shape `config`; all methods are pure and jit-able (the instance is static).
    `lora`: how LoRA adapters among a block's parameters apply (`jaxzero.models.lora`); None: none."""

    config: ModelConfig
    lora: LoraSpec | None = None

    @property
    def emits_stats(self) -> bool:
        """Experts' blocks emit their router's statistics (`block_stats`, `aux_loss`)."""
        return self.config.num_experts > 0

    def __post_init__(self) -> None:
        layers.check_shape(self.config, "llama")  # includes the even head_dim that rotary embeddings need

    @property
    def dtype(self) -> jnp.dtype:
        """The compute dtype (bfloat16 or float32)."""
        return layers.compute_dtype(self.config)

    # ---------------------------------------------------------------------------------------------
    # Initialization: Normal(0, init_std) for matrices and embeddings, ones for norm scales. float32.
    # ---------------------------------------------------------------------------------------------

    def init(self, key: jax.Array) -> ModelParams:
        """Fresh float32 parameters; a pure function of `key` (see `layers.split_init_keys`)."""
        return init_params(self, key)

    def init_embed(self, key: jax.Array) -> dict[str, Any]:
        """Embedding unit: {"embed_tokens": {"embedding": (V, D) float32}}."""
        c = self.config
        return {"embed_tokens": {"embedding": layers.normal(key, (c.vocab_size, c.hidden_size), c.init_std)}}

    def init_block(self, key: jax.Array) -> dict[str, Any]:
        """One block's float32 parameters (layout in the module docstring), from `LlamaBlock`'s own
        initializers; shapes are inferred without running the block."""
        return layers.init_block_module(LlamaBlock(self.config), self.config, key)

    def init_head(self, key: jax.Array) -> dict[str, Any]:
        """Head unit: final norm, plus the (D, V) output projection unless embeddings are tied."""
        c = self.config
        head: dict[str, Any] = {"norm": {"scale": layers.ones((c.hidden_size,))}}
        if not c.tie_embeddings:
            head["lm_head"] = {"kernel": layers.normal(key, (c.hidden_size, c.vocab_size), c.init_std)}
        return head

    # ---------------------------------------------------------------------------------------------
    # Forward units
    # ---------------------------------------------------------------------------------------------

    def embed(self, embed_params: Any, tokens: jax.Array) -> jax.Array:
        """tokens int (B, S) -> activations (B, S, D) in the compute dtype, times
        `embedding_multiplier` (Granite).

        Rows are gathered first and cast after: identical values to casting the table first, without
        materializing a compute-dtype copy of the whole (V, D) table. Out-of-range ids give NaN rows
        (`jnp.take`'s "fill" mode) so that bad data fails loudly instead of aliasing another token.
        """
        table = embed_params["embed_tokens"]["embedding"]
        x = jnp.take(table, tokens, axis=0).astype(self.dtype)
        m = self.config.embedding_multiplier  # Granite's; in the compute dtype, as transformers scales
        return x if m == 1.0 else x * jnp.asarray(m, self.dtype)

    def block(
        self,
        block_params: Any,
        x: jax.Array,
        segments: jax.Array | None = None,
        dropout_key: jax.Array | None = None,
    ) -> jax.Array:
        """One `LlamaBlock`, causal over positions arange(S): (B, S, D) -> (B, S, D) compute dtype.
        Params may be float32 masters or already in the compute dtype (or carry int8 kernels and
        LoRA adapters, `jaxzero.models.lora`). `segments` int32 (B, S) or None: each token attends
        only within its segment (its document); rotary positions stay arange(S), which within a
        segment gives the scores that positions restarting at 0 give. `dropout_key`: the adapters'
        dropout key (None: no dropout)."""
        rngs = None if dropout_key is None else {"dropout": dropout_key}
        return LlamaBlock(self.config, self.lora).apply(
            {"params": block_params}, x, segments=segments, rngs=rngs
        )

    def block_stats(
        self,
        block_params: Any,
        x: jax.Array,
        segments: jax.Array | None = None,
        dropout_key: jax.Array | None = None,
        *,
        token_mask: jax.Array | None = None,
    ) -> tuple[jax.Array, moe.RouterStats]:
        """`block` of an experts' model, and its router's statistics over the B*S tokens
        (`moe.RouterStats`: counts (E,), prob_sum (E,), rows (), float32): those where `token_mask`
        (bool (B, S)) is True, as transformers counts those its attention mask keeps; every token
        without one."""
        rngs = None if dropout_key is None else {"dropout": dropout_key}
        return LlamaBlock(self.config, self.lora, stats=True).apply(
            {"params": block_params}, x, segments=segments, token_mask=token_mask, rngs=rngs
        )

    def aux_loss(self, stats: moe.RouterStats) -> jax.Array:
        """The load-balancing loss (float32 scalar, unweighted) of the statistics summed over every
        layer of one micro-batch: transformers' `load_balancing_loss_func` (`moe.load_balancing_loss`)."""
        return moe.load_balancing_loss(stats)

    # ---------------------------------------------------------------------------------------------
    # Generation: the same units over a key/value cache
    # ---------------------------------------------------------------------------------------------

    def init_cache(self, batch: int, length: int) -> KVCache:
        """One block's empty cache: keys and values (B, length, K, H) in the compute dtype."""
        c = self.config
        shape = (batch, length, c.num_kv_heads, c.head_dim)
        return jnp.zeros(shape, self.dtype), jnp.zeros(shape, self.dtype)  # two buffers: both are donated

    def embed_step(self, embed_params: Any, tokens: jax.Array, pos: jax.Array) -> jax.Array:
        """`embed` of tokens (B, S) at positions pos .. pos+S-1 (rotary positions enter in the blocks)."""
        return self.embed(embed_params, tokens)

    def block_step(
        self, block_params: Any, x: jax.Array, cache: KVCache, pos: jax.Array
    ) -> tuple[jax.Array, KVCache]:
        """`block` of x (B, S, D) at positions pos .. pos+S-1 over the block's `cache` of the positions
        before -> (y, the cache with these positions written in). Equal to `block` over the whole
        sequence so far, at these positions."""
        return LlamaBlock(self.config, self.lora).apply({"params": block_params}, x, cache, pos)

    def head(self, head_params: Any, embed_params: Any, x: jax.Array) -> jax.Array:
        """Final RMSNorm and output projection: (B, S, D) -> logits (B, S, V) float32, divided by
        `logits_scaling` (Granite).

        With `tie_embeddings` the projection is embed_tokens^T and `head_params` holds only the norm.
        """
        c = self.config
        # Cast like `block` does, so results do not depend on whether the caller passes f32 or bf16.
        head_params = layers.cast_tree(head_params, self.dtype)
        x = x.astype(self.dtype)
        h = layers.rms_norm(x, head_params["norm"]["scale"], c.norm_eps)
        if c.tie_embeddings:
            w = embed_params["embed_tokens"]["embedding"].astype(self.dtype).T  # (D, V)
        else:
            w = head_params["lm_head"]["kernel"].astype(self.dtype)
        logits = layers.logits_matmul(h, w)
        # Granite's logits are divided (not multiplied by the inverse), in float32, as transformers does
        return logits if c.logits_scaling == 1.0 else logits / jnp.float32(c.logits_scaling)
