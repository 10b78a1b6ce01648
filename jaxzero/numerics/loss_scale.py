"""Dynamic loss scaling for float16 training, with DeepSpeed's rules and parameter names.

float16 gradients underflow unless the loss is multiplied by a large scale before the backward pass.
The scale starts at 2**`initial_scale_power`. A step whose gradients hold an inf or NaN overflowed:
its update is skipped (it consumes its batch but does not advance the step count or the learning-rate
schedule) and the scale is halved, unless `hysteresis` overflows are still tolerated, in which case
only the remaining tolerance shrinks. After `loss_scale_window` stable steps since the last overflow
the scale doubles (and the tolerance is refilled); with `consecutive_hysteresis` every stable step
refills it. The scale never drops below `min_loss_scale`.

The state is a small pytree updated by a pure function, so it runs inside a jitted step on the
accelerator (resident trainer) or on the host (offload engine), and is saved in checkpoints.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxzero.config import FP16Config


class LossScaleState(NamedTuple):
    """scale: float32; cur_iter, last_overflow_iter, cur_hysteresis: int32 scalars."""

    scale: jax.Array
    cur_iter: jax.Array  # steps seen, overflowing or not
    last_overflow_iter: jax.Array  # -1 before the first overflow
    cur_hysteresis: jax.Array  # overflows still tolerated before the scale drops


def init_loss_scale(cfg: FP16Config) -> LossScaleState:
    return LossScaleState(
        scale=jnp.float32(2.0**cfg.initial_scale_power),
        cur_iter=jnp.int32(0),
        last_overflow_iter=jnp.int32(-1),
        cur_hysteresis=jnp.int32(cfg.hysteresis),
    )


def update_loss_scale(state: LossScaleState, overflow: jax.Array, cfg: FP16Config) -> LossScaleState:
    """The state after a step that did (`overflow`, bool scalar) or did not overflow."""
    refill = jnp.int32(cfg.hysteresis)
    # Overflow: halve the scale once the tolerance is spent, else spend one unit of it.
    drop = (cfg.hysteresis == 1) | (state.cur_hysteresis == 1)
    scale_on_overflow = jnp.where(drop, jnp.maximum(state.scale / 2.0, cfg.min_loss_scale), state.scale)
    hysteresis_on_overflow = jnp.where(drop, state.cur_hysteresis, state.cur_hysteresis - 1)
    # No overflow: double after each full window of stable steps since the last overflow.
    stable = state.cur_iter - state.last_overflow_iter - 1
    grow = (stable > 0) & (stable % cfg.loss_scale_window == 0)
    hysteresis_on_ok = refill if cfg.consecutive_hysteresis else jnp.where(grow, refill, state.cur_hysteresis)
    scale_on_ok = jnp.where(grow, state.scale * 2.0, state.scale)
    return LossScaleState(
        scale=jnp.where(overflow, scale_on_overflow, scale_on_ok).astype(jnp.float32),
        cur_iter=state.cur_iter + 1,
        last_overflow_iter=jnp.where(overflow, state.cur_iter, state.last_overflow_iter),
        cur_hysteresis=jnp.where(overflow, hysteresis_on_overflow, hysteresis_on_ok).astype(jnp.int32),
    )


def all_finite(tree: Any) -> jax.Array:
    """bool scalar: no inf or NaN in any leaf."""
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]))
