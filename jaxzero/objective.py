"""The training objective: next-token cross-entropy over a window of tokens.

Shared by the resident trainer and the offload engine so that both optimise the very same function.
A batch window is int32 `(B, S + 1)`: inputs are `[:, :-1]`, targets `[:, 1:]`.
"""

from __future__ import annotations

from typing import Any

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


# The head's float32 logits and their gradient take 8 bytes per token and vocabulary entry. Past this
# many bytes for one micro-batch the loss runs over equal pieces of each sequence, each piece's logits
# made (and, differentiated, remade in the backward pass) alone: long sequences are not bounded by them.
HEAD_LOGITS_BYTES = 8 * 2**30


def head_pieces(rows: int, seq_len: int, vocab_size: int) -> int:
    """The pieces each sequence's head loss runs in (`head_loss`): the fewest dividing `seq_len` whose
    logits and gradient for `rows` sequences fit `HEAD_LOGITS_BYTES` (1 for the usual shapes)."""
    for n in range(1, seq_len + 1):
        if seq_len % n == 0 and rows * (seq_len // n) * vocab_size * 8 <= HEAD_LOGITS_BYTES:
            return n
    return seq_len


def head_loss(model: Model, head_w: Any, embed_w: Any, x: jax.Array, targets: jax.Array) -> jax.Array:
    """Mean next-token cross-entropy of `model.head` on hidden states x (B, S, D) against int32 targets
    (B, S) -> float32 scalar. In `head_pieces` pieces along S where the logits would be too large:
    the mean of the pieces' means (equal sizes: the same mean, summed in another order), with the
    head's weights taken in float32 so that their gradient sums over the pieces in float32."""
    rows, seq_len, width = x.shape
    n = head_pieces(rows, seq_len, model.config.vocab_size)
    if n == 1:
        return cross_entropy(model.head(head_w, embed_w, x), targets)
    head_w, embed_w = jax.tree.map(lambda a: a.astype(jnp.float32), (head_w, embed_w))
    xs = x.reshape(rows, n, seq_len // n, width).swapaxes(0, 1)
    ts = targets.reshape(rows, n, seq_len // n).swapaxes(0, 1)

    @jax.checkpoint  # the backward pass remakes one piece's logits at a time
    def piece(hw: Any, ew: Any, xp: jax.Array, tp: jax.Array) -> jax.Array:
        return cross_entropy(model.head(hw, ew, xp), tp)

    return jnp.mean(jax.lax.map(lambda a: piece(head_w, embed_w, *a), (xs, ts)))


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
    return head_loss(model, params.head, params.embed, x, targets)
