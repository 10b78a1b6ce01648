"""Low-rank adapters and int8 weights inside a projection: what a block computes, not where it lives.

A projection's parameter dict (`{"kernel": (in, out)}`, plus "bias") may carry two extras, which the
Llama family's projections read where present:

    "kernel_scale"  float32 (out,): "kernel" is int8 (in, out), weight-only quantised per output
                    channel (`quantize_kernel`); it is dequantised in float32 and cast to the compute
                    dtype inside the block's computation, one projection at a time.
    "lora_a"        float32 (in, r) and "lora_b" float32 (r, out): a LoRA adapter, added as
                    y += dropout(x) @ lora_a @ lora_b * (alpha / r), PEFT's rule.

So a frozen base and its adapters are one parameter tree (`merge_trees`), and a block's gradient with
respect to the adapters alone is the gradient of the same function.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

INT8_MAX = 127


@dataclass(frozen=True)
class LoraSpec:
    """How the adapters of a model apply (static: part of the model, compiled in).

    scale:   alpha / rank, the factor of the low-rank product (PEFT's `scaling`).
    dropout: the probability of dropping an input element of the adapter path (0: none); applied
             only where the block is given a dropout key.
    """

    scale: float
    dropout: float = 0.0


def dequantize(kernel: jax.Array, scale: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """int8 kernel (..., in, out) times its per-output-channel float32 scale (..., out), in float32,
    then cast to `dtype`. Leading axes are a stack of kernels (a block's experts)."""
    return (kernel.astype(jnp.float32) * scale.astype(jnp.float32)[..., None, :]).astype(dtype)


def quantize_kernel(kernel: jax.Array) -> tuple[jax.Array, jax.Array]:
    """A float kernel (..., in, out) as (int8 (..., in, out), float32 scale (..., out)): symmetric,
    per output channel of each kernel of the stack, scale = max |column| / 127 (1 for an all-zero
    column), values rounded to nearest even. Each element's dequantisation error is at most scale / 2
    of its column (and float32 rounding)."""
    k = kernel.astype(jnp.float32)
    peak = jnp.max(jnp.abs(k), axis=-2)
    scale = jnp.where(peak > 0, peak / jnp.float32(INT8_MAX), jnp.float32(1.0))
    q = jnp.clip(jnp.round(k / scale[..., None, :]), -INT8_MAX, INT8_MAX).astype(jnp.int8)
    return q, scale


def lora_delta(x: jax.Array, a: jax.Array, b: jax.Array, spec: LoraSpec, rng: jax.Array | None) -> jax.Array:
    """The adapter's term for x (..., in): dropout(x) @ a (in, r) @ b (r, out) * scale, in x's dtype.
    `rng`: the dropout key (None: no dropout)."""
    # The dropout factor and the scale are applied in float32: in bfloat16, alpha / r = 4/3 would
    # train with 1.336, not the 1.333 a merge and PEFT use.
    if rng is not None and spec.dropout > 0:
        keep = jax.random.bernoulli(rng, 1.0 - spec.dropout, x.shape)
        kept = x.astype(jnp.float32) / jnp.float32(1.0 - spec.dropout)
        x = jnp.where(keep, kept, jnp.float32(0.0)).astype(x.dtype)
    h = jnp.matmul(x, a.astype(x.dtype))
    return (jnp.matmul(h, b.astype(x.dtype)).astype(jnp.float32) * jnp.float32(spec.scale)).astype(x.dtype)


def merge_trees(base: Any, extra: Any) -> Any:
    """Nested dicts `base` with the leaves of `extra` (same nesting, fewer keys) added beside them:
    a block's frozen weights with its adapters. Neither is changed."""
    if not isinstance(extra, dict):
        return extra
    out = dict(base)
    for k, v in extra.items():
        out[k] = merge_trees(base[k], v) if k in base and isinstance(base[k], dict) else v
    return out


def storage_dtype(base_dtype: str) -> jnp.dtype:
    """The dtype of a frozen base's non-quantised leaves (`finetune.base_dtype`): bfloat16 for int8 bases."""
    return jnp.dtype(jnp.float32 if base_dtype == "float32" else jnp.bfloat16)
