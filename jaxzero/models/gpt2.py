"""GPT-2 decoder: learned position embeddings, pre-norm blocks of LayerNorm, multi-head attention with a
fused qkv projection and a GELU (tanh) MLP, biases on every linear, output head tied to the token
embedding.

Parameter pytrees are plain nested dicts named after HF `GPT2LMHeadModel`. HF's GPT-2 uses `Conv1D`,
whose weight is already (in, out), so conversion is a pure name map with no transposes:

    embed:  {"wte": {"embedding": (V, D)}, "wpe": {"embedding": (max_seq_len, D)}}  transformer.wte/wpe
    block:  {"ln_1": {"scale": (D,), "bias": (D,)},                   transformer.h.i.ln_1.{weight,bias}
             "attn": {"c_attn": {"kernel": (D, 3D), "bias": (3D,)},   ...attn.c_attn.{weight,bias}
                      "c_proj": {"kernel": (D, D),  "bias": (D,)}},
             "ln_2": {"scale": (D,), "bias": (D,)},
             "mlp":  {"c_fc":   {"kernel": (D, F),  "bias": (F,)},
                      "c_proj": {"kernel": (F, D),  "bias": (D,)}}}
    head:   {"ln_f": {"scale": (D,), "bias": (D,)}}                    transformer.ln_f
            (logits = ln_f(x) @ wte^T; HF's lm_head.weight is the same tensor as wte)

The fused c_attn output is [q | k | v] along its last axis, each D wide and laid out (N, H)
head-major, exactly as HF splits it. D = hidden_size, N = num_heads, H = head_dim, F =
intermediate_size (4D in the published sizes), V = vocab_size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxzero.config import ConfigError, ModelConfig
from jaxzero.models import layers
from jaxzero.models.base import KVCache, ModelParams, init_params


class _Conv1D(nn.Module):
    """y = x @ kernel + bias (GPT-2's Conv1D), kernel (in, out) ~ Normal(0, std), bias zeros; used in
    x's (compute) dtype."""

    features: int
    std: float

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        kernel = self.param(
            "kernel", lambda k, shape: layers.normal(k, shape, self.std), (x.shape[-1], self.features)
        )
        bias = self.param("bias", lambda _, shape: layers.zeros(shape), (self.features,))
        return layers.dense(x, kernel.astype(x.dtype), bias.astype(x.dtype))


class _LayerNorm(nn.Module):
    """LayerNorm with learned `scale` (ones) and `bias` (zeros); statistics in float32."""

    eps: float

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        scale = self.param("scale", lambda _, shape: layers.ones(shape), (x.shape[-1],))
        bias = self.param("bias", lambda _, shape: layers.zeros(shape), (x.shape[-1],))
        # Cast like every weight (to the compute dtype) so f32 masters and streamed bf16 weights agree.
        return layers.layer_norm(x, scale.astype(x.dtype), bias.astype(x.dtype), self.eps)


class _Attention(nn.Module):
    """Causal self-attention (within each segment where `segments` is given), or, with a `cache`
    (k, v), of positions pos .. pos+S-1 over the cache (returned with their keys and values written
    in)."""

    config: ModelConfig

    @nn.compact
    def __call__(
        self,
        h: jax.Array,
        cache: KVCache | None = None,
        pos: jax.Array | None = None,
        segments: jax.Array | None = None,
    ) -> Any:
        c = self.config
        b, s, d = h.shape
        n, hd = c.num_heads, c.head_dim
        resid_std = c.init_std / math.sqrt(2 * c.num_layers)
        qkv = _Conv1D(3 * d, c.init_std, name="c_attn")(h)  # (B, S, 3D)
        q, k, v = (t.reshape(b, s, n, hd) for t in jnp.split(qkv, 3, axis=-1))
        out = _Conv1D(d, resid_std, name="c_proj")
        if cache is None:
            return out(layers.causal_attention(q, k, v, c.attention_impl, segments).reshape(b, s, d))
        k_cache = jax.lax.dynamic_update_slice_in_dim(cache[0], k, pos, axis=1)
        v_cache = jax.lax.dynamic_update_slice_in_dim(cache[1], v, pos, axis=1)
        o = layers.cached_attention(q, k_cache, v_cache, pos).reshape(b, s, d)
        return out(o), (k_cache, v_cache)


class _MLP(nn.Module):
    config: ModelConfig

    @nn.compact
    def __call__(self, h: jax.Array) -> jax.Array:
        c = self.config
        resid_std = c.init_std / math.sqrt(2 * c.num_layers)
        # GPT-2's "gelu_new" is the tanh approximation; the exact erf GELU differs by up to ~1e-3.
        h = jax.nn.gelu(_Conv1D(c.intermediate_size, c.init_std, name="c_fc")(h), approximate=True)
        return _Conv1D(c.hidden_size, resid_std, name="c_proj")(h)


class GPT2Block(nn.Module):
    """One pre-norm GPT-2 block as a Flax module: (B, S, D) -> (B, S, D) in the compute dtype.

        x = x + attn.c_proj(attn(split_qkv(c_attn(ln_1(x)))))
        x = x + mlp.c_proj(gelu_tanh(c_fc(ln_2(x))))

    The residual-stream output projections (both c_proj) start with std / sqrt(2 * num_layers).
    `segments` (B, S) int32: attention stays within each segment; not with a `cache`.
    """

    config: ModelConfig

    @nn.compact
    def __call__(
        self,
        x: jax.Array,
        cache: KVCache | None = None,
        pos: jax.Array | None = None,
        segments: jax.Array | None = None,
    ) -> Any:
        c = self.config
        x = x.astype(layers.compute_dtype(c))
        attn = _Attention(c, name="attn")
        h = _LayerNorm(c.norm_eps, name="ln_1")(x)
        if cache is None:
            x = x + attn(h, segments=segments)
        else:
            a, cache = attn(h, cache, pos)
            x = x + a
        x = x + _MLP(c, name="mlp")(_LayerNorm(c.norm_eps, name="ln_2")(x))
        return x if cache is None else (x, cache)


@dataclass(frozen=True)
class GPT2:
    """A GPT-2 model of shape `config`; all methods are pure and jit-able (the instance is static).

    GPT-2 is always tied and always multi-head: `tie_embeddings` is ignored and `num_kv_heads` must
    equal `num_heads`.
    """

    config: ModelConfig

    def __post_init__(self) -> None:
        layers.check_shape(self.config, "gpt2")
        c = self.config
        if c.num_kv_heads != c.num_heads:
            raise ConfigError(
                f"gpt2 uses multi-head attention: model.num_kv_heads={c.num_kv_heads} "
                f"must equal model.num_heads={c.num_heads}."
            )

    @property
    def dtype(self) -> jnp.dtype:
        """The compute dtype (bfloat16 or float32)."""
        return layers.compute_dtype(self.config)

    # ---------------------------------------------------------------------------------------------
    # Initialization (GPT-2 paper / HF `GPT2PreTrainedModel._init_weights`): Normal(0, init_std) for
    # matrices and embeddings, with the residual-stream output projections (both c_proj) scaled by
    # 1/sqrt(2 * num_layers) so the residual variance does not grow with depth; ones for LayerNorm
    # scales, zeros for biases. float32.
    # ---------------------------------------------------------------------------------------------

    def init(self, key: jax.Array) -> ModelParams:
        """Fresh float32 parameters; a pure function of `key` (see `layers.split_init_keys`)."""
        return init_params(self, key)

    def init_embed(self, key: jax.Array) -> dict[str, Any]:
        """Embedding unit: token table wte (V, D) and position table wpe (max_seq_len, D), float32."""
        c = self.config
        k_wte, k_wpe = jax.random.split(key)
        return {
            "wte": {"embedding": layers.normal(k_wte, (c.vocab_size, c.hidden_size), c.init_std)},
            "wpe": {"embedding": layers.normal(k_wpe, (c.max_seq_len, c.hidden_size), c.init_std)},
        }

    def init_block(self, key: jax.Array) -> dict[str, Any]:
        """One block's float32 parameters (layout in the module docstring), from `GPT2Block`'s own
        initializers; shapes are inferred without running the block."""
        return layers.init_block_module(GPT2Block(self.config), self.config, key)

    def init_head(self, key: jax.Array) -> dict[str, Any]:
        """Head unit: the final LayerNorm only (the projection is the tied wte). `key` is unused."""
        del key
        d = self.config.hidden_size
        return {"ln_f": {"scale": layers.ones((d,)), "bias": layers.zeros((d,))}}

    # ---------------------------------------------------------------------------------------------
    # Forward units
    # ---------------------------------------------------------------------------------------------

    def embed(self, embed_params: Any, tokens: jax.Array) -> jax.Array:
        """tokens int (B, S) -> wte[tokens] + wpe[:S], (B, S, D) in the compute dtype. S <= max_seq_len.

        Rows are gathered before the cast (no compute-dtype copy of the whole table); the sum is taken
        in the compute dtype so the result is the same whether the tables arrive as f32 or bf16.
        Out-of-range token ids give NaN rows (`jnp.take`'s "fill" mode) rather than another token's row.
        """
        s = tokens.shape[-1]
        if s > self.config.max_seq_len:
            raise ValueError(
                f"sequence length {s} exceeds model.max_seq_len={self.config.max_seq_len}: "
                "GPT-2 has no position embedding beyond it."
            )
        tok = jnp.take(embed_params["wte"]["embedding"], tokens, axis=0).astype(self.dtype)
        pos = embed_params["wpe"]["embedding"][:s].astype(self.dtype)
        return tok + pos[None, :, :]

    def block(self, block_params: Any, x: jax.Array, segments: jax.Array | None = None) -> jax.Array:
        """One `GPT2Block`, causal: (B, S, D) -> (B, S, D) compute dtype. Params may be float32
        masters or already in the compute dtype. `segments` int32 (B, S) or None: each token attends
        only within its segment. Only the mask changes: the learned positions (`embed`) stay those of
        the row, as GPT-2 was pre-trained on packed text whose positions do not restart."""
        return GPT2Block(self.config).apply({"params": block_params}, x, segments=segments)

    # ---------------------------------------------------------------------------------------------
    # Generation: the same units over a key/value cache
    # ---------------------------------------------------------------------------------------------

    def init_cache(self, batch: int, length: int) -> KVCache:
        """One block's empty cache: keys and values (B, length, N, H) in the compute dtype."""
        c = self.config
        shape = (batch, length, c.num_heads, c.head_dim)
        return jnp.zeros(shape, self.dtype), jnp.zeros(shape, self.dtype)  # two buffers: both are donated

    def embed_step(self, embed_params: Any, tokens: jax.Array, pos: jax.Array) -> jax.Array:
        """`embed` of tokens (B, S) at positions pos .. pos+S-1: wte[tokens] + wpe[pos:pos+S]."""
        s = tokens.shape[-1]
        tok = jnp.take(embed_params["wte"]["embedding"], tokens, axis=0).astype(self.dtype)
        wpe = jax.lax.dynamic_slice_in_dim(embed_params["wpe"]["embedding"], pos, s).astype(self.dtype)
        return tok + wpe[None, :, :]

    def block_step(
        self, block_params: Any, x: jax.Array, cache: KVCache, pos: jax.Array
    ) -> tuple[jax.Array, KVCache]:
        """`block` of x (B, S, D) at positions pos .. pos+S-1 over the block's `cache` of the positions
        before -> (y, the cache with these positions written in)."""
        return GPT2Block(self.config).apply({"params": block_params}, x, cache, pos)

    def head(self, head_params: Any, embed_params: Any, x: jax.Array) -> jax.Array:
        """Final LayerNorm and tied projection: (B, S, D) -> logits (B, S, V) float32 = ln_f(x) @ wte^T."""
        c = self.config
        head_params = layers.cast_tree(head_params, self.dtype)
        x = x.astype(self.dtype)
        h = layers.layer_norm(x, head_params["ln_f"]["scale"], head_params["ln_f"]["bias"], c.norm_eps)
        w = embed_params["wte"]["embedding"].astype(self.dtype).T  # (D, V)
        return layers.logits_matmul(h, w)
