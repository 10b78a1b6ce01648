"""The offload trainer's step, and its evaluation loss.

    loss, grads, norm, aux = streamed.grads(read, batch, loss_scale)  # accelerator; grads in pinned_host
    submitted = pipeline.submit(units, read, grads, norm, ...)   # host; one background update per unit

The step returns as soon as the accelerator work is issued; the next step's forward pass waits for
each unit's update only when it reaches that unit (`jaxzero.offload.pipeline`). Units whose state the
plan keeps on the accelerator are updated there, issued right after the gradient pass.

The strategies are chosen once, when the step is built, never inside it: float16 or not
(`LossScaling`), which weights the next pass reads (overlapped: the new ones, waiting for each
unit's update; delayed: those from before this update), and whether each document of a row attends
only within itself (`objective.document_eot`: then the batch's segment ids are made once per step, one
small program, and every block reads them), and whether rows' padding is left out of the router's
statistics (`objective.router_padding`: then the batch's token mask is made once per step the same way).
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from jaxzero.config import FP16Config
from jaxzero.models import ModelParams
from jaxzero.numerics.loss_scale import LossScaleState, update_loss_scale
from jaxzero.numerics.objective import document_eot, document_segments, per_step, real_tokens, router_padding
from jaxzero.offload.context import EngineContext, put_everywhere
from jaxzero.offload.futures import OffloadState, done, weights_of
from jaxzero.offload.host_optimizer import HostUnit
from jaxzero.offload.pipeline import Submitted
from jaxzero.offload.streaming import StreamedModel
from jaxzero.plan import Tier, UpdateMode
from jaxzero.plan.placement import OffloadPlacement
from jaxzero.state import StepMetrics


class OffloadStep:
    """`step(state, batch)` and `eval_loss(state, window)` of the offload trainer over `ctx`, with
    the passes of `streamed`. Batches are int32 (A, mb, S+1) on the accelerator (`put_train_batch`);
    evaluation windows int32 (B, S+1)."""

    def __init__(self, ctx: EngineContext, streamed: StreamedModel):
        # What the step reads, as attributes of its own: one lookup each per step.
        self._streamed = streamed
        self._pipeline = ctx.pipeline
        self._clock = ctx.clock
        self._fence = ctx.fence
        self._device = ctx.device
        self._lr = ctx.host.lr
        self._on_device = [u for u in ctx.plan.units if u.state is Tier.DEVICE]
        self._scaling: LossScaling = DynamicLossScale(ctx.cfg.fp16) if ctx.fp16 else NoLossScale(ctx.where)
        delayed = ctx.plan.host_update.mode is UpdateMode.DELAYED
        self._next_read = _weights_before_update if delayed else _weights_after_update
        self._segments = per_step(document_segments, document_eot(ctx.cfg.data, ctx.model))
        self._mask = per_step(real_tokens, router_padding(ctx.cfg.data, ctx.model))

    def step(self, state: OffloadState, batch: jax.Array) -> tuple[OffloadState, StepMetrics]:
        """One optimizer step; consumes `state` (its host arrays are updated in place)."""
        scaling = self._scaling
        loss_scale = scaling.scale_of(state)
        segments, mask = self._segments(batch), self._mask(batch)
        loss, grads, norm, aux = self._streamed.grads(
            state.read, batch, loss_scale, self._clock, segments, token_mask=mask
        )
        on_accelerator = self._update_on_device(state, grads, norm, loss_scale)
        submitted = _merged(
            self._pipeline.submit(state.units, state.read, grads, norm, loss_scale), on_accelerator
        )
        next_step, next_ls, metrics = scaling.advance(state, loss, norm, self._lr(state.step))
        metrics = metrics._replace(aux_loss=aux)
        new_state = OffloadState(next_step, submitted.units, self._next_read(state, submitted), next_ls)
        state.consumed = True  # as the resident step's donation does: the old state is gone
        return new_state, metrics

    def eval_loss(self, state: OffloadState, window: jax.Array) -> jax.Array:
        """Mean loss (float32 scalar) of `state` over int32 (B, S+1); the state is not consumed."""
        # The newest weights, each waited for when the pass reaches it.
        batch = window[None]
        return self._streamed.loss(jax.tree.map(weights_of, state.units), batch, self._segments(batch))

    def _update_on_device(
        self, state: OffloadState, grads: ModelParams, norm: jax.Array, loss_scale: jax.Array
    ) -> list[HostUnit | None]:
        """Issue the update of each unit whose state is on the accelerator (no host sync); None in
        the places of the others."""
        units, g = state.units.units(), grads.units()
        updated: list[HostUnit | None] = [None] * len(units)
        fence, device = self._fence, self._device
        for u in self._on_device:
            k = u.position
            old = units[k].result()
            fence.release(k)  # host sync with a checkpoint writer, during a save: the update donates them
            updated[k] = device.update(u, old, g[k], norm, loss_scale)  # donates the old masters
        return updated


class LossScaling:
    """How a step scales its loss and advances its step count: `scale_of(state)` is the cotangent
    the gradient pass starts from (float32 scalar on the accelerator), `advance` the next step
    count, the next loss scale (or None) and the step's metrics."""

    def scale_of(self, state: OffloadState) -> jax.Array:
        raise NotImplementedError

    def advance(
        self, state: OffloadState, loss: jax.Array, norm: jax.Array, lr: jax.Array
    ) -> tuple[jax.Array, LossScaleState | None, StepMetrics]:
        raise NotImplementedError


class NoLossScale(LossScaling):
    """No loss scale: the gradients are those of the loss itself; the step count lives on the host
    and every step counts."""

    def __init__(self, where: OffloadPlacement):
        self._one = put_everywhere(np.float32(1.0), where.device)
        self._increment = jax.jit(lambda step: step + 1)

    def scale_of(self, state: OffloadState) -> jax.Array:
        return self._one

    def advance(
        self, state: OffloadState, loss: jax.Array, norm: jax.Array, lr: jax.Array
    ) -> tuple[jax.Array, None, StepMetrics]:
        return self._increment(state.step), None, StepMetrics(loss, norm, lr)


class DynamicLossScale(LossScaling):
    """float16: whether the step overflowed is known on the accelerator (the norm is computed there),
    so the step count and loss scale advance there too, with no host sync."""

    def __init__(self, cfg: FP16Config):
        self._advance = jax.jit(partial(_advance_fp16, cfg))

    def scale_of(self, state: OffloadState) -> jax.Array:
        return state.loss_scale.scale

    def advance(
        self, state: OffloadState, loss: jax.Array, norm: jax.Array, lr: jax.Array
    ) -> tuple[jax.Array, LossScaleState, StepMetrics]:
        next_step, next_ls, skipped = self._advance(state.step, state.loss_scale, norm)
        return (
            next_step,
            next_ls,
            StepMetrics(loss=loss, grad_norm=norm, lr=lr, loss_scale=state.loss_scale.scale, skipped=skipped),
        )


def _advance_fp16(
    cfg: FP16Config, step: jax.Array, ls: LossScaleState, norm: jax.Array
) -> tuple[jax.Array, LossScaleState, jax.Array]:
    """The step count (+1 unless the norm overflowed), the next loss scale, and whether the step was
    skipped; traced."""
    return (
        step + jnp.isfinite(norm).astype(step.dtype),
        update_loss_scale(ls, ~jnp.isfinite(norm), cfg),
        ~jnp.isfinite(norm),
    )


def _weights_before_update(state: OffloadState, submitted: Submitted) -> ModelParams:
    """Delayed updates: the next pass reads the weights from before this step's update."""
    return jax.tree.map(weights_of, state.units)


def _weights_after_update(state: OffloadState, submitted: Submitted) -> ModelParams:
    """Overlapped updates: the next pass reads the new weights, waiting for each unit's."""
    return submitted.weights


def _merged(submitted: Submitted, on_accelerator: list[HostUnit | None]) -> Submitted:
    """The host's Futures with the accelerator's updates in the places the host left empty."""
    pairs = zip(submitted.units.units(), submitted.weights.units(), on_accelerator)
    units, weights = zip(*((h, w) if d is None else (done(d), done(d.weights)) for h, w, d in pairs))
    return Submitted(ModelParams.from_units(units), ModelParams.from_units(weights))
