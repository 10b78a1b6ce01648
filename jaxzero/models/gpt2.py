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

import jax
import jax.numpy as jnp

from jaxzero.config import ConfigError, ModelConfig
from jaxzero.models import ModelParams
from jaxzero.models import layers as L


@dataclass(frozen=True)
class GPT2:
    """A GPT-2 model of shape `config`; all methods are pure and jit-able (the instance is static).

    GPT-2 is always tied and always multi-head: `tie_embeddings` is ignored and `num_kv_heads` must
    equal `num_heads`.
    """

    config: ModelConfig

    def __post_init__(self) -> None:
        L.check_shape(self.config, "gpt2")
        c = self.config
        if c.num_kv_heads != c.num_heads:
            raise ConfigError(
                f"gpt2 uses multi-head attention: model.num_kv_heads={c.num_kv_heads} "
                f"must equal model.num_heads={c.num_heads}."
            )

    @property
    def dtype(self) -> jnp.dtype:
        """The compute dtype (bfloat16 or float32)."""
        return L.compute_dtype(self.config)

    # ---------------------------------------------------------------------------------------------
    # Initialization (GPT-2 paper / HF `GPT2PreTrainedModel._init_weights`): Normal(0, init_std) for
    # matrices and embeddings, with the residual-stream output projections (both c_proj) scaled by
    # 1/sqrt(2 * num_layers) so the residual variance does not grow with depth; ones for LayerNorm
    # scales, zeros for biases. float32.
    # ---------------------------------------------------------------------------------------------

    def init(self, key: jax.Array) -> ModelParams:
        """Fresh float32 parameters; a pure function of `key` (see `layers.split_init_keys`)."""
        k_embed, k_blocks, k_head = L.split_init_keys(key, self.config.num_layers)
        blocks = tuple(self.init_block(k_blocks[i]) for i in range(self.config.num_layers))
        return ModelParams(embed=self.init_embed(k_embed), blocks=blocks, head=self.init_head(k_head))

    def init_embed(self, key: jax.Array) -> dict[str, Any]:
        """Embedding unit: token table wte (V, D) and position table wpe (max_seq_len, D), float32."""
        c = self.config
        k_wte, k_wpe = jax.random.split(key)
        return {
            "wte": {"embedding": L.normal(k_wte, (c.vocab_size, c.hidden_size), c.init_std)},
            "wpe": {"embedding": L.normal(k_wpe, (c.max_seq_len, c.hidden_size), c.init_std)},
        }

    def init_block(self, key: jax.Array) -> dict[str, Any]:
        """One block's float32 parameters (layout in the module docstring)."""
        c = self.config
        d, f = c.hidden_size, c.intermediate_size
        k_attn, k_aproj, k_fc, k_mproj = jax.random.split(key, 4)
        std = c.init_std
        resid_std = c.init_std / math.sqrt(2 * c.num_layers)
        return {
            "ln_1": {"scale": L.ones((d,)), "bias": L.zeros((d,))},
            "attn": {
                "c_attn": {"kernel": L.normal(k_attn, (d, 3 * d), std), "bias": L.zeros((3 * d,))},
                "c_proj": {"kernel": L.normal(k_aproj, (d, d), resid_std), "bias": L.zeros((d,))},
            },
            "ln_2": {"scale": L.ones((d,)), "bias": L.zeros((d,))},
            "mlp": {
                "c_fc": {"kernel": L.normal(k_fc, (d, f), std), "bias": L.zeros((f,))},
                "c_proj": {"kernel": L.normal(k_mproj, (f, d), resid_std), "bias": L.zeros((d,))},
            },
        }

    def init_head(self, key: jax.Array) -> dict[str, Any]:
        """Head unit: the final LayerNorm only (the projection is the tied wte). `key` is unused."""
        del key
        d = self.config.hidden_size
        return {"ln_f": {"scale": L.ones((d,)), "bias": L.zeros((d,))}}

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

    def block(self, block_params: Any, x: jax.Array) -> jax.Array:
        """One pre-norm block, causal: (B, S, D) -> (B, S, D) compute dtype.

        x = x + c_proj(attn(split_qkv(c_attn(ln_1(x)))))
        x = x + mlp.c_proj(gelu_tanh(c_fc(ln_2(x))))
        Params may be float32 masters or already in the compute dtype.
        """
        c = self.config
        p = L.cast_tree(block_params, self.dtype)
        x = x.astype(self.dtype)
        b, s, d = x.shape
        n, hd = c.num_heads, c.head_dim

        attn = p["attn"]
        h = L.layer_norm(x, p["ln_1"]["scale"], p["ln_1"]["bias"], c.norm_eps)
        qkv = L.dense(h, attn["c_attn"]["kernel"], attn["c_attn"]["bias"])  # (B, S, 3D)
        q, k, v = (t.reshape(b, s, n, hd) for t in jnp.split(qkv, 3, axis=-1))
        o = L.causal_attention(q, k, v, c.attention_impl).reshape(b, s, d)
        x = x + L.dense(o, attn["c_proj"]["kernel"], attn["c_proj"]["bias"])

        mlp = p["mlp"]
        h = L.layer_norm(x, p["ln_2"]["scale"], p["ln_2"]["bias"], c.norm_eps)
        # GPT-2's "gelu_new" is the tanh approximation; the exact erf GELU differs by up to ~1e-3.
        h = jax.nn.gelu(L.dense(h, mlp["c_fc"]["kernel"], mlp["c_fc"]["bias"]), approximate=True)
        return x + L.dense(h, mlp["c_proj"]["kernel"], mlp["c_proj"]["bias"])

    def head(self, head_params: Any, embed_params: Any, x: jax.Array) -> jax.Array:
        """Final LayerNorm and tied projection: (B, S, D) -> logits (B, S, V) float32 = ln_f(x) @ wte^T."""
        c = self.config
        head_params = L.cast_tree(head_params, self.dtype)
        x = x.astype(self.dtype)
        h = L.layer_norm(x, head_params["ln_f"]["scale"], head_params["ln_f"]["bias"], c.norm_eps)
        w = embed_params["wte"]["embedding"].astype(self.dtype).T  # (D, V)
        return L.logits_matmul(h, w)
