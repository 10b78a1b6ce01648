"""Gemma 3 text decoder (`Gemma3ForCausalLM`, model_type "gemma3_text"): RMSNorms of (1 + w) before
and after each sub-block, q/k head norms, grouped-query attention scaled by
`query_pre_attn_scalar`^-1/2, a GeGLU MLP (tanh GELU), embeddings scaled by sqrt(hidden_size), a tied
head with optional final logit soft-capping, and interleaved local (sliding-window) and global layers,
each kind with its own rotary base.

Every layer has the same parameters, so one compiled block serves them all: what differs between a
local and a global layer (its rotary frequencies and its window) is the block's per-layer input,
`Gemma3.layer_input(i)`, a small array pytree the engines pass beside the block's weights.

Parameter pytrees are named after HF `Gemma3ForCausalLM` (kernels stored (in, out)):

    embed:  {"embed_tokens": {"embedding": (V, D)}}
    block:  {"input_layernorm": {"scale": (D,)},
             "self_attn": {"q_proj": {"kernel": (D, N*H)}, "k_proj": {"kernel": (D, K*H)},
                           "v_proj": {"kernel": (D, K*H)}, "o_proj": {"kernel": (N*H, D)},
                           "q_norm": {"scale": (H,)}, "k_norm": {"scale": (H,)}},
             "post_attention_layernorm": {"scale": (D,)},
             "pre_feedforward_layernorm": {"scale": (D,)},
             "mlp": {"gate_proj": {"kernel": (D, F)}, "up_proj": {"kernel": (D, F)},
                     "down_proj": {"kernel": (F, D)}},
             "post_feedforward_layernorm": {"scale": (D,)}}
    head:   {"norm": {"scale": (D,)}}                     (the head is the embedding, always)

Norm weights are stored as HF stores them (w, applied as 1 + w; zeros at init).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax.core import unfreeze

from jaxzero.config import ModelConfig
from jaxzero.models import layers
from jaxzero.models.base import KVCache, ModelParams, init_params
from jaxzero.models.llama import _Linear
from jaxzero.models.lora import LoraSpec

# The window of a global layer: no key is that far behind its query.
NO_WINDOW = 2**30


def is_global_layer(config: ModelConfig, i: int) -> bool:
    """Whether layer i attends globally: every `sliding_window_pattern`-th layer (transformers'
    `layer_types` default: (i + 1) % pattern == 0)."""
    return (i + 1) % config.sliding_window_pattern == 0


def local_inv_freq(config: ModelConfig) -> np.ndarray:
    """The (head_dim / 2,) rotary frequencies of a local layer: plain rope of `rope_local_theta`."""
    local = dataclasses.replace(config, rope_theta=config.rope_local_theta, rope_type="default")
    return layers.rope_inv_freq(local)


class _GemmaNorm(nn.Module):
    """RMSNorm times (1 + w), w zeros at init; statistics and the product in float32 (HF's order)."""

    eps: float

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        w = self.param("scale", lambda _, shape: layers.zeros(shape), (x.shape[-1],))
        # Cast like every weight (to the compute dtype) so f32 masters and streamed bf16 weights agree.
        return layers.rms_norm(x, 1.0 + w.astype(x.dtype).astype(jnp.float32), self.eps)


def _rope(x: jax.Array, inv_freq: jax.Array, positions: jax.Array) -> jax.Array:
    """`layers.apply_rope` of x (B, S, heads, H) at int positions (S,) with frequencies (H/2,) float32."""
    freqs = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return layers.apply_rope(x, jnp.cos(emb), jnp.sin(emb))


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
        q = _Linear(n * hd, c.init_std, lora=lora, name="q_proj")(h).reshape(b, s, n, hd)
        kk = _Linear(k * hd, c.init_std, lora=lora, name="k_proj")(h).reshape(b, s, k, hd)
        v = _Linear(k * hd, c.init_std, lora=lora, name="v_proj")(h).reshape(b, s, k, hd)
        q = _GemmaNorm(c.norm_eps, name="q_norm")(q)
        kk = _GemmaNorm(c.norm_eps, name="k_norm")(kk)
        out = _Linear(c.hidden_size, c.init_std, lora=lora, name="o_proj")
        scale = 1.0 / math.sqrt(c.query_pre_attn_scalar or hd)
        inv_freq, window = layer["inv_freq"], layer["window"]
        if cache is None:
            positions = jnp.arange(s)
            q, kk = _rope(q, inv_freq, positions), _rope(kk, inv_freq, positions)
            o = layers.causal_attention(
                q,
                kk,
                v,
                c.attention_impl,
                segments,
                window=window,
                local_window=c.sliding_window or None,
                scale=scale,
            )
            return out(o.reshape(b, s, n * hd))
        positions = pos + jnp.arange(s)
        q, kk = _rope(q, inv_freq, positions), _rope(kk, inv_freq, positions)
        k_cache = jax.lax.dynamic_update_slice_in_dim(cache[0], kk, pos, axis=1)
        v_cache = jax.lax.dynamic_update_slice_in_dim(cache[1], v, pos, axis=1)
        o = layers.cached_attention(q, k_cache, v_cache, pos, window=window, scale=scale)
        return out(o.reshape(b, s, n * hd)), (k_cache, v_cache)


class _MLP(nn.Module):
    config: ModelConfig
    lora: LoraSpec | None = None

    @nn.compact
    def __call__(self, h: jax.Array) -> jax.Array:
        c, lora = self.config, self.lora
        gate = _Linear(c.intermediate_size, c.init_std, lora=lora, name="gate_proj")(h)
        up = _Linear(c.intermediate_size, c.init_std, lora=lora, name="up_proj")(h)
        gelu = jax.nn.gelu(gate.astype(jnp.float32), approximate=True).astype(gate.dtype)
        return _Linear(c.hidden_size, c.init_std, lora=lora, name="down_proj")(gelu * up)


class Gemma3Block(nn.Module):
    """One Gemma 3 block: (B, S, D) -> (B, S, D) in the compute dtype, for the layer whose per-layer
    input is `layer` ({"inv_freq": (H/2,) float32, "window": int32 scalar}).

        x = x + post_attention_norm(attn(input_norm(x)))
        x = x + post_feedforward_norm(mlp(pre_feedforward_norm(x)))
    """

    config: ModelConfig
    lora: LoraSpec | None = None

    @nn.compact
    def __call__(
        self,
        x: jax.Array,
        layer: dict[str, jax.Array],
        cache: KVCache | None = None,
        pos: jax.Array | None = None,
        segments: jax.Array | None = None,
    ) -> Any:
        c = self.config
        x = x.astype(layers.compute_dtype(c))
        attn = _Attention(c, self.lora, name="self_attn")
        h = _GemmaNorm(c.norm_eps, name="input_layernorm")(x)
        if cache is None:
            a = attn(h, layer, segments=segments)
        else:
            a, cache = attn(h, layer, cache, pos)
        x = x + _GemmaNorm(c.norm_eps, name="post_attention_layernorm")(a)
        m = _MLP(c, self.lora, name="mlp")(_GemmaNorm(c.norm_eps, name="pre_feedforward_layernorm")(x))
        x = x + _GemmaNorm(c.norm_eps, name="post_feedforward_layernorm")(m)
        return x if cache is None else (x, cache)


def need_layer(layer: Any, family: str) -> None:
    """ValueError where a block of local and global layers (`family`'s, for the message) is called
    without its per-layer input."""
    if layer is None:
        raise ValueError(
            f"a {family} block computes a local or a global layer: pass its per-layer input, "
            "layer=model.layer_input(i) (jaxzero.models.layer_input), as the engines do."
        )


@dataclass(frozen=True)
class Gemma3:
    """A Gemma 3 text model of shape `config`; pure, jit-able methods (the instance is static).
    `lora`: how LoRA adapters among a block's parameters apply (`jaxzero.models.lora`)."""

    config: ModelConfig
    lora: LoraSpec | None = None

    def __post_init__(self) -> None:
        layers.check_shape(self.config, "gemma3")

    @property
    def dtype(self) -> jnp.dtype:
        return layers.compute_dtype(self.config)

    def init(self, key: jax.Array) -> ModelParams:
        """Fresh float32 parameters; a pure function of `key`."""
        return init_params(self, key)

    def init_embed(self, key: jax.Array) -> dict[str, Any]:
        c = self.config
        return {"embed_tokens": {"embedding": layers.normal(key, (c.vocab_size, c.hidden_size), c.init_std)}}

    def init_block(self, key: jax.Array) -> dict[str, Any]:
        layer = self.layer_input(0)
        x = jax.ShapeDtypeStruct((1, 1, self.config.hidden_size), self.dtype)
        return unfreeze(Gemma3Block(self.config).lazy_init(key, x, layer)["params"])

    def init_head(self, key: jax.Array) -> dict[str, Any]:
        return {"norm": {"scale": layers.zeros((self.config.hidden_size,))}}

    def layer_input(self, i: int) -> dict[str, jax.Array]:
        """Layer i's per-layer input: its rotary frequencies (H/2,) float32 (the global base and
        scaling, or `rope_local_theta`) and its window, int32 (`sliding_window`, or none)."""
        c = self.config
        if is_global_layer(c, i):
            inv, window = layers.rope_inv_freq(c), NO_WINDOW
        else:
            inv, window = local_inv_freq(c), c.sliding_window or NO_WINDOW
        return {"inv_freq": jnp.asarray(inv, jnp.float32), "window": jnp.int32(window)}

    def embed(self, embed_params: Any, tokens: jax.Array) -> jax.Array:
        """tokens (B, S) -> (B, S, D) compute dtype, times sqrt(D) rounded to the compute dtype."""
        table = embed_params["embed_tokens"]["embedding"]
        x = jnp.take(table, tokens, axis=0).astype(self.dtype)
        return x * jnp.asarray(math.sqrt(self.config.hidden_size), self.dtype)

    def block(
        self,
        block_params: Any,
        x: jax.Array,
        segments: jax.Array | None = None,
        dropout_key: jax.Array | None = None,
        layer: dict[str, jax.Array] | None = None,
    ) -> jax.Array:
        """One `Gemma3Block` of the layer whose `layer_input` is `layer`: (B, S, D) -> (B, S, D)."""
        need_layer(layer, "Gemma 3")
        rngs = None if dropout_key is None else {"dropout": dropout_key}
        return Gemma3Block(self.config, self.lora).apply(
            {"params": block_params}, x, layer, segments=segments, rngs=rngs
        )

    def init_cache(self, batch: int, length: int) -> KVCache:
        c = self.config
        shape = (batch, length, c.num_kv_heads, c.head_dim)
        return jnp.zeros(shape, self.dtype), jnp.zeros(shape, self.dtype)

    def embed_step(self, embed_params: Any, tokens: jax.Array, pos: jax.Array) -> jax.Array:
        return self.embed(embed_params, tokens)

    def block_step(
        self,
        block_params: Any,
        x: jax.Array,
        cache: KVCache,
        pos: jax.Array,
        layer: dict[str, jax.Array] | None = None,
    ) -> tuple[jax.Array, KVCache]:
        """`block` at positions pos .. pos+S-1 over the cache of the positions before."""
        need_layer(layer, "Gemma 3")
        return Gemma3Block(self.config, self.lora).apply({"params": block_params}, x, layer, cache, pos)

    def head(self, head_params: Any, embed_params: Any, x: jax.Array) -> jax.Array:
        """Final (1 + w) RMSNorm, the tied projection, then soft-capping where
        `final_logit_softcap` is set: (B, S, D) -> logits (B, S, V) float32."""
        c = self.config
        w = head_params["norm"]["scale"].astype(self.dtype).astype(jnp.float32)
        h = layers.rms_norm(x.astype(self.dtype), 1.0 + w, c.norm_eps)
        logits = layers.logits_matmul(h, embed_params["embed_tokens"]["embedding"].astype(self.dtype).T)
        if c.final_logit_softcap:
            cap = jnp.float32(c.final_logit_softcap)
            logits = jnp.tanh(logits / cap) * cap
        return logits
