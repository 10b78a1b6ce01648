"""The training objective: next-token cross-entropy over a window of tokens.

Shared by the resident trainer and the offload engine so that both optimise the very same function.
A batch window is int32 `(B, S + 1)`: inputs are `[:, :-1]`, targets `[:, 1:]`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxzero.models import Model, ModelParams


def split_window(window: jax.Array) -> tuple[jax.Array, jax.Array]:
    """int32 (B, S+1) -> (inputs (B, S), targets (B, S))."""
    return window[:, :-1], window[:, 1:]


def cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Mean next-token cross-entropy. logits float32 (B, S, V), targets int32 (B, S) -> float32 scalar.

    Computed in float32 with a stable log-sum-exp; the mean is over all B*S positions.
    """
    logits = logits.astype(jnp.float32)
    lse = jax.nn.logsumexp(logits, axis=-1)
    picked = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    return jnp.mean(lse - picked)


def remat_block(model: Model):
    """The block function rematerialised in the backward pass: only its input activation is saved.

    `prevent_cse` stays on so XLA cannot merge the recomputation with the forward pass.
    """
    return jax.checkpoint(model.block, policy=jax.checkpoint_policies.nothing_saveable)


def loss_fn(model: Model, params: ModelParams, window: jax.Array) -> jax.Array:
    """Scalar float32 loss of `params` (any dtype; blocks cast to the compute dtype) on int32 (B, S+1)."""
    inputs, targets = split_window(window)
    block = remat_block(model)
    x = model.embed(params.embed, inputs)
    for p in params.blocks:
        x = block(p, x)
    return cross_entropy(model.head(params.head, params.embed, x), targets)
