"""Llama-family decoder (Llama 2/3, and Llama-shaped models such as InternLM2): pre-norm blocks of
RMSNorm, rotary grouped-query attention and a SwiGLU MLP, no biases, tied or untied output head.

Parameter pytrees are plain nested dicts named after HF `LlamaForCausalLM`, so that conversion is a
name map plus a transpose of each "kernel" (stored (in, out) here, (out, in) in torch):

    embed:  {"embed_tokens": {"embedding": (V, D)}}           model.embed_tokens.weight
    block:  {"input_layernorm":          {"scale": (D,)},     model.layers.i.input_layernorm.weight
             "self_attn": {"q_proj": {"kernel": (D, N*H)},    ...self_attn.q_proj.weight
                           "k_proj": {"kernel": (D, K*H)},
                           "v_proj": {"kernel": (D, K*H)},
                           "o_proj": {"kernel": (N*H, D)}},
             "post_attention_layernorm": {"scale": (D,)},
             "mlp": {"gate_proj": {"kernel": (D, F)},         ...mlp.gate_proj.weight
                     "up_proj":   {"kernel": (D, F)},
                     "down_proj": {"kernel": (F, D)}}}
    head:   {"norm": {"scale": (D,)},                         model.norm.weight
             "lm_head": {"kernel": (D, V)}}                   lm_head.weight
            ("lm_head" is absent when `tie_embeddings`; logits then use embed_tokens)

D = hidden_size, N = num_heads, K = num_kv_heads, H = head_dim, F = intermediate_size, V = vocab_size.
q/k heads are laid out head-major along the projection's output axis, (N, H), as in HF; the rotary
embedding uses HF's rotate-half pairing (i, i + H/2), so HF checkpoints need no q/k permutation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from jaxzero.config import ModelConfig
from jaxzero.models import ModelParams
from jaxzero.models import layers as L


@dataclass(frozen=True)
class Llama:
    """A Llama model of shape `config`; all methods are pure and jit-able (the instance is static)."""

    config: ModelConfig

    def __post_init__(self) -> None:
        L.check_shape(self.config, "llama")  # includes the even head_dim that rotary embeddings need

    @property
    def dtype(self) -> jnp.dtype:
        """The compute dtype (bfloat16 or float32)."""
        return L.compute_dtype(self.config)

    # ---------------------------------------------------------------------------------------------
    # Initialization: Normal(0, init_std) for matrices and embeddings, ones for norm scales. float32.
    # ---------------------------------------------------------------------------------------------

    def init(self, key: jax.Array) -> ModelParams:
        """Fresh float32 parameters; a pure function of `key` (see `layers.split_init_keys`)."""
        k_embed, k_blocks, k_head = L.split_init_keys(key, self.config.num_layers)
        blocks = tuple(self.init_block(k_blocks[i]) for i in range(self.config.num_layers))
        return ModelParams(embed=self.init_embed(k_embed), blocks=blocks, head=self.init_head(k_head))

    def init_embed(self, key: jax.Array) -> dict[str, Any]:
        """Embedding unit: {"embed_tokens": {"embedding": (V, D) float32}}."""
        c = self.config
        return {"embed_tokens": {"embedding": L.normal(key, (c.vocab_size, c.hidden_size), c.init_std)}}

    def init_block(self, key: jax.Array) -> dict[str, Any]:
        """One block's float32 parameters (layout in the module docstring)."""
        c = self.config
        d, f, hd = c.hidden_size, c.intermediate_size, c.head_dim
        kq, kk, kv, ko, kg, ku, kd = jax.random.split(key, 7)
        std = c.init_std
        return {
            "input_layernorm": {"scale": L.ones((d,))},
            "self_attn": {
                "q_proj": {"kernel": L.normal(kq, (d, c.num_heads * hd), std)},
                "k_proj": {"kernel": L.normal(kk, (d, c.num_kv_heads * hd), std)},
                "v_proj": {"kernel": L.normal(kv, (d, c.num_kv_heads * hd), std)},
                "o_proj": {"kernel": L.normal(ko, (c.num_heads * hd, d), std)},
            },
            "post_attention_layernorm": {"scale": L.ones((d,))},
            "mlp": {
                "gate_proj": {"kernel": L.normal(kg, (d, f), std)},
                "up_proj": {"kernel": L.normal(ku, (d, f), std)},
                "down_proj": {"kernel": L.normal(kd, (f, d), std)},
            },
        }

    def init_head(self, key: jax.Array) -> dict[str, Any]:
        """Head unit: final norm, plus the (D, V) output projection unless embeddings are tied."""
        c = self.config
        head: dict[str, Any] = {"norm": {"scale": L.ones((c.hidden_size,))}}
        if not c.tie_embeddings:
            head["lm_head"] = {"kernel": L.normal(key, (c.hidden_size, c.vocab_size), c.init_std)}
        return head

    # ---------------------------------------------------------------------------------------------
    # Forward units
    # ---------------------------------------------------------------------------------------------

    def embed(self, embed_params: Any, tokens: jax.Array) -> jax.Array:
        """tokens int (B, S) -> activations (B, S, D) in the compute dtype.

        Rows are gathered first and cast after: identical values to casting the table first, without
        materializing a compute-dtype copy of the whole (V, D) table. Out-of-range ids give NaN rows
        (`jnp.take`'s "fill" mode) so that bad data fails loudly instead of aliasing another token.
        """
        table = embed_params["embed_tokens"]["embedding"]
        return jnp.take(table, tokens, axis=0).astype(self.dtype)

    def block(self, block_params: Any, x: jax.Array) -> jax.Array:
        """One pre-norm block, causal over positions arange(S): (B, S, D) -> (B, S, D) compute dtype.

        x = x + o_proj(attn(rope(q_proj(n1(x))), rope(k_proj(n1(x))), v_proj(n1(x))))
        x = x + down_proj(silu(gate_proj(n2(x))) * up_proj(n2(x)))
        Params may be float32 masters or already in the compute dtype.
        """
        c = self.config
        p = L.cast_tree(block_params, self.dtype)
        x = x.astype(self.dtype)
        b, s, _ = x.shape
        n, k, hd = c.num_heads, c.num_kv_heads, c.head_dim

        attn = p["self_attn"]
        h = L.rms_norm(x, p["input_layernorm"]["scale"], c.norm_eps)
        q = L.dense(h, attn["q_proj"]["kernel"]).reshape(b, s, n, hd)
        kk = L.dense(h, attn["k_proj"]["kernel"]).reshape(b, s, k, hd)
        v = L.dense(h, attn["v_proj"]["kernel"]).reshape(b, s, k, hd)
        cos, sin = L.rope_cos_sin(s, hd, c.rope_theta)
        q = L.apply_rope(q, cos, sin)
        kk = L.apply_rope(kk, cos, sin)
        o = L.causal_attention(q, kk, v, c.attention_impl).reshape(b, s, n * hd)
        x = x + L.dense(o, attn["o_proj"]["kernel"])

        mlp = p["mlp"]
        h = L.rms_norm(x, p["post_attention_layernorm"]["scale"], c.norm_eps)
        gated = jax.nn.silu(L.dense(h, mlp["gate_proj"]["kernel"])) * L.dense(h, mlp["up_proj"]["kernel"])
        return x + L.dense(gated, mlp["down_proj"]["kernel"])

    def head(self, head_params: Any, embed_params: Any, x: jax.Array) -> jax.Array:
        """Final RMSNorm and output projection: (B, S, D) -> logits (B, S, V) float32.

        With `tie_embeddings` the projection is embed_tokens^T and `head_params` holds only the norm.
        """
        c = self.config
        # Cast like `block` does, so results do not depend on whether the caller passes f32 or bf16.
        head_params = L.cast_tree(head_params, self.dtype)
        x = x.astype(self.dtype)
        h = L.rms_norm(x, head_params["norm"]["scale"], c.norm_eps)
        if c.tie_embeddings:
            w = embed_params["embed_tokens"]["embedding"].astype(self.dtype).T  # (D, V)
        else:
            w = head_params["lm_head"]["kernel"].astype(self.dtype)
        return L.logits_matmul(h, w)
