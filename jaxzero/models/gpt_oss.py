"""gpt-oss (`GptOssForCausalLM`, model_type "gpt_oss"): pre-norm blocks of RMSNorm, grouped-query
attention with biases on q, k, v and o and a learned per-head "sink" logit in each softmax's
denominator, yarn rope, local (sliding-window) and global layers alternating, and a sparse MLP of
biased experts with the clamped SwiGLU (`jaxzero.models.moe.gpt_oss_spec`); untied head.

Every layer has the same parameters; what differs between a local and a global layer (its window) is
the block's per-layer input, `GptOss.layer_input(i)`, as for Gemma 3.

Parameter pytrees are named after HF `GptOssForCausalLM` (kernels stored (in, out)):

    embed:  {"embed_tokens": {"embedding": (V, D)}}
    block:  {"input_layernorm": {"scale": (D,)},
             "self_attn": {"q_proj": {"kernel": (D, N*H), "bias": (N*H,)},
                           "k_proj": {"kernel": (D, K*H), "bias": (K*H,)},
                           "v_proj": {"kernel": (D, K*H), "bias": (K*H,)},
                           "o_proj": {"kernel": (N*H, D), "bias": (D,)},
                           "sinks": (N,)},                   (biases only with attention_bias)
             "post_attention_layernorm": {"scale": (D,)},
             "mlp": {"router":  {"kernel": (D, E), "bias": (E,)},
                     "gate_up": {"kernel": (E, D, 2F), "bias": (E, 2F)},   [gate | up]
                     "down":    {"kernel": (E, F, D), "bias": (E, D)}}}
    head:   {"norm": {"scale": (D,)}, "lm_head": {"kernel": (D, V)}}  (no lm_head when tied)

HF stores gate_up with gate and up interleaved on the last axis; `jaxzero.interop` de-interleaves.
H = head_dim (64 in the released models, whatever D / N is), F = moe_intermediate_size.

Attention with its sinks is `jaxzero.models.sinks`: with cuDNN (`model.attention_impl=auto` on a CUDA
GPU in bfloat16, or `cudnn`), a global layer runs the kernel's causal attention with the sink as a
prepended key and a local layer runs blocks of its window in XLA, chosen per layer on the device
(`sinks.windowed_sink_attention`); with XLA (`xla`, or `auto` elsewhere), float32 scores (B, N, S, S)
as transformers' eager attention makes them. Packed documents and decoding attend with XLA's dense
mask either way.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax.core import unfreeze

from jaxzero.config import ModelConfig
from jaxzero.models import layers, moe
from jaxzero.models.base import KVCache, ModelParams, init_params
from jaxzero.models.gemma import NO_WINDOW, is_global_layer, need_layer
from jaxzero.models.llama import Llama, _Linear, _RMSNorm
from jaxzero.models.lora import LoraSpec, dequantize
from jaxzero.models.sinks import augmented_head_dim, sink_attention, window_mask, windowed_sink_attention


def moe_spec(c: ModelConfig) -> moe.MoeSpec:
    """The experts of a gpt_oss config: biased router, softmax over the top-k logits, clamped SwiGLU."""
    return moe.gpt_oss_spec(c.num_experts, c.num_experts_per_tok, c.swiglu_alpha, c.swiglu_limit)


def rope_tables(c: ModelConfig, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """cos and sin (S, H) float32 at int positions (S,): yarn's frequencies, both times its attention
    factor (transformers scales the tables, so q and k each carry it)."""
    inv = jnp.asarray(layers.rope_inv_freq(c), jnp.float32)
    freqs = positions.astype(jnp.float32)[:, None] * inv[None, :]
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    factor = jnp.float32(layers.rope_attention_factor(c))
    return jnp.cos(emb) * factor, jnp.sin(emb) * factor


class _Attention(nn.Module):
    config: ModelConfig
    lora: LoraSpec | None = None

    @nn.compact
    def __call__(
        self,
        h: jax.Array,
        layer: dict[str, jax.Array],
        cache: KVCache | None = None,
        pos: jax.Array | None = None,
        segments: jax.Array | None = None,
    ) -> Any:
        c, lora = self.config, self.lora
        b, s, _ = h.shape
        n, k, hd = c.num_heads, c.num_kv_heads, c.head_dim
        bias = c.attention_bias
        q = _Linear(n * hd, c.init_std, bias, lora, name="q_proj")(h).reshape(b, s, n, hd)
        kk = _Linear(k * hd, c.init_std, bias, lora, name="k_proj")(h).reshape(b, s, k, hd)
        v = _Linear(k * hd, c.init_std, bias, lora, name="v_proj")(h).reshape(b, s, k, hd)
        sinks = self.param("sinks", lambda key, shape: layers.normal(key, shape, c.init_std), (n,))
        out = _Linear(c.hidden_size, c.init_std, bias, lora, name="o_proj")
        scale = 1.0 / math.sqrt(hd)
        positions = jnp.arange(s) if cache is None else pos + jnp.arange(s)
        cos, sin = rope_tables(c, positions)
        q, kk = layers.apply_rope(q, cos, sin), layers.apply_rope(kk, cos, sin)
        sinks = sinks.astype(q.dtype)
        impl = layers.resolve_attention_impl(c.attention_impl, q.dtype, augmented_head_dim(hd))
        if cache is None and segments is None and impl == "cudnn":
            o = windowed_sink_attention(
                q,
                kk,
                v,
                sinks,
                window=layer["window"],
                local_window=c.sliding_window or NO_WINDOW,
                scale=scale,
                impl=impl,
            )
            return out(o.reshape(b, s, n * hd))
        if cache is None:
            mask = window_mask(positions, positions, layer["window"])[None]
            if segments is not None:  # each token reads only its own document
                mask = mask & (segments[:, :, None] == segments[:, None, :])
            o = sink_attention(q, kk, v, sinks, mask, scale)
            return out(o.reshape(b, s, n * hd))
        k_cache = jax.lax.dynamic_update_slice_in_dim(cache[0], kk, pos, axis=1)
        v_cache = jax.lax.dynamic_update_slice_in_dim(cache[1], v, pos, axis=1)
        mask = window_mask(positions, jnp.arange(k_cache.shape[1]), layer["window"])[None]
        o = sink_attention(q, k_cache, v_cache, sinks, mask, scale)
        return out(o.reshape(b, s, n * hd)), (k_cache, v_cache)


class _Experts(nn.Module):
    """The sparse MLP (`jaxzero.models.moe`): biased router and experts, float32 masters used in x's
    dtype (int8 kernels with their "kernel_scale" dequantised first, as `_Linear` does). No LoRA
    adapters: LoRA adapts attention. Returns (y, this layer's `moe.RouterStats` over the tokens of h
    where `token_mask` (bool (B, S)) is True, every token without one, from the biased router logits,
    as transformers records them for the load-balancing loss)."""

    config: ModelConfig

    @nn.compact
    def __call__(
        self, h: jax.Array, token_mask: jax.Array | None = None
    ) -> tuple[jax.Array, moe.RouterStats]:
        c = self.config
        d, f, e = c.hidden_size, c.moe_intermediate_size, c.num_experts

        def init(shape: tuple[int, ...], bias: tuple[int, ...]) -> Any:
            return lambda key: {"kernel": layers.normal(key, shape, c.init_std), "bias": layers.zeros(bias)}

        params = {
            "router": self.param("router", init((d, e), (e,))),
            "gate_up": self.param("gate_up", init((e, d, 2 * f), (e, 2 * f))),
            "down": self.param("down", init((e, f, d), (e, d))),
        }
        for name, p in params.items():
            if "kernel_scale" in p:
                params[name] = {
                    "kernel": dequantize(p["kernel"], p["kernel_scale"], h.dtype),
                    "bias": p["bias"],
                }
        return moe.moe_layer(params, h, moe_spec(c), c.moe_impl, token_mask)


class GptOssBlock(nn.Module):
    """One gpt-oss block: (B, S, D) -> (B, S, D) in the compute dtype, for the layer whose per-layer
    input is `layer` ({"window": int32 scalar}).

        x = x + o_proj(sink_attention(rope(q_proj(n1(x))), rope(k_proj(n1(x))), v_proj(n1(x))))
        x = x + experts(n2(x))

    `stats` (without a cache): return (x, the layer's `moe.RouterStats`) instead of x.
    """

    config: ModelConfig
    lora: LoraSpec | None = None
    stats: bool = False

    @nn.compact
    def __call__(
        self,
        x: jax.Array,
        layer: dict[str, jax.Array],
        cache: KVCache | None = None,
        pos: jax.Array | None = None,
        segments: jax.Array | None = None,
        token_mask: jax.Array | None = None,
    ) -> Any:
        c = self.config
        x = x.astype(layers.compute_dtype(c))
        attn = _Attention(c, self.lora, name="self_attn")
        h = _RMSNorm(c.norm_eps, name="input_layernorm")(x)
        if cache is None:
            x = x + attn(h, layer, segments=segments)
        else:
            a, cache = attn(h, layer, cache, pos)
            x = x + a
        h = _RMSNorm(c.norm_eps, name="post_attention_layernorm")(x)
        y, stats = _Experts(c, name="mlp")(h, token_mask)
        x = x + y
        if cache is not None:
            return x, cache
        return (x, stats) if self.stats else x


@dataclass(frozen=True)
class GptOss:
    """A gpt-oss model of shape `config`; pure, jit-able methods (the instance is static). `lora`: how
    LoRA adapters among a block's parameters apply (`jaxzero.models.lora`)."""

    config: ModelConfig
    lora: LoraSpec | None = None

    @property
    def emits_stats(self) -> bool:
        """Its blocks emit their router's statistics (`block_stats`, `aux_loss`): every block has experts."""
        return True

    def __post_init__(self) -> None:
        layers.check_shape(self.config, "gpt_oss")

    @property
    def dtype(self) -> jnp.dtype:
        return layers.compute_dtype(self.config)

    # The Llama family's embedding, head and cache, unit for unit: they read only `config` and `dtype`.
    init_embed = Llama.init_embed
    init_head = Llama.init_head
    embed = Llama.embed
    embed_step = Llama.embed_step
    init_cache = Llama.init_cache
    head = Llama.head

    def init(self, key: jax.Array) -> ModelParams:
        """Fresh float32 parameters; a pure function of `key`."""
        return init_params(self, key)

    def init_block(self, key: jax.Array) -> dict[str, Any]:
        x = jax.ShapeDtypeStruct((1, 1, self.config.hidden_size), self.dtype)
        return unfreeze(GptOssBlock(self.config).lazy_init(key, x, self.layer_input(0))["params"])

    def layer_input(self, i: int) -> dict[str, jax.Array]:
        """Layer i's per-layer input: its window, int32 (`sliding_window` for a local layer, else none)."""
        c = self.config
        local = not is_global_layer(c, i) and c.sliding_window
        return {"window": jnp.int32(c.sliding_window if local else NO_WINDOW)}

    def block(
        self,
        block_params: Any,
        x: jax.Array,
        segments: jax.Array | None = None,
        dropout_key: jax.Array | None = None,
        layer: dict[str, jax.Array] | None = None,
    ) -> jax.Array:
        """One `GptOssBlock` of the layer whose `layer_input` is `layer`: (B, S, D) -> (B, S, D)."""
        need_layer(layer, "gpt-oss")
        rngs = None if dropout_key is None else {"dropout": dropout_key}
        return GptOssBlock(self.config, self.lora).apply(
            {"params": block_params}, x, layer, segments=segments, rngs=rngs
        )

    def block_stats(
        self,
        block_params: Any,
        x: jax.Array,
        segments: jax.Array | None = None,
        dropout_key: jax.Array | None = None,
        layer: dict[str, jax.Array] | None = None,
        *,
        token_mask: jax.Array | None = None,
    ) -> tuple[jax.Array, moe.RouterStats]:
        """`block`, and its router's statistics over the B*S tokens (`moe.RouterStats`: counts (E,),
        prob_sum (E,), rows (), float32): those where `token_mask` (bool (B, S)) is True, every token
        without one."""
        need_layer(layer, "gpt-oss")
        rngs = None if dropout_key is None else {"dropout": dropout_key}
        return GptOssBlock(self.config, self.lora, stats=True).apply(
            {"params": block_params}, x, layer, segments=segments, token_mask=token_mask, rngs=rngs
        )

    def aux_loss(self, stats: moe.RouterStats) -> jax.Array:
        """The load-balancing loss (float32 scalar, unweighted) of the statistics summed over every
        layer of one micro-batch (`moe.load_balancing_loss`, transformers' `load_balancing_loss_func`)."""
        return moe.load_balancing_loss(stats)

    def block_step(
        self,
        block_params: Any,
        x: jax.Array,
        cache: KVCache,
        pos: jax.Array,
        layer: dict[str, jax.Array] | None = None,
    ) -> tuple[jax.Array, KVCache]:
        """`block` at positions pos .. pos+S-1 over the cache of the positions before."""
        need_layer(layer, "gpt-oss")
        return GptOssBlock(self.config, self.lora).apply({"params": block_params}, x, layer, cache, pos)
