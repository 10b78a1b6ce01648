"""The offload engine's training state: a future per unit, since host updates run in the background.

Each unit (embedding, block, head) of the state is a `Future[HostUnit]`: its newest update, maybe
still running on the host. Reading masters, optimizer state or weights, flattening the state (e.g.
`jax.block_until_ready`, a checkpoint) waits for every pending update; the training step itself never
does, it hands the futures on.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

import jax

from jaxzero.models import ModelParams
from jaxzero.offload.host_optimizer import HostUnit


def done(value: Any) -> Future:
    """A Future already holding `value`."""
    f: Future = Future()
    f.set_result(value)
    return f


def weights_of(unit: Future) -> Future:
    """A Future of the `weights` of a Future[HostUnit]."""
    out: Future = Future()

    def relay(f: Future) -> None:
        if f.exception() is not None:
            out.set_exception(f.exception())
        else:
            out.set_result(f.result().weights)

    unit.add_done_callback(relay)
    return out


def _is_future(x: Any) -> bool:
    return isinstance(x, Future)


def _is_unit(x: Any) -> bool:
    return isinstance(x, HostUnit)


@jax.tree_util.register_pytree_node_class
class OffloadState:
    """Training state of the offload engine (a pytree; flattening it waits for pending updates).

    step:       int32 scalar: optimizer updates applied (host device; the accelerator under float16,
                where it depends on the overflow check made there).
    units:      `ModelParams` of `Future[HostUnit]`: the newest update of each unit, maybe still
                running on the host. Its params are float32 masters in host RAM (CPU backend), its
                opt_state the unit's optax state there, its weights the compute-dtype weights
                (embed/head and resident blocks in accelerator memory, streamed blocks in the
                accelerator's pinned_host memory).
    read:       `ModelParams` of `Future`s of the weights the next gradient pass reads: the newest
                (`units`' own) or, under the delayed update, those of the update before.
    loss_scale: float16 training's `LossScaleState` (accelerator); None otherwise.

    `params`, `opt_state` and `weights` read the resolved units (host sync).
    """

    def __init__(self, step: jax.Array, units: ModelParams, read: ModelParams, loss_scale: Any = None):
        self.step, self.units, self.read, self.loss_scale = step, units, read, loss_scale
        self.consumed = False  # set by the step that took this state: its host arrays change in place

    @classmethod
    def of(cls, step, params, opt_state, weights, loss_scale=None) -> OffloadState:
        """A state whose units are already updated: `params`, `opt_state` and `weights` in
        `ModelParams` layout."""
        units = ModelParams(
            done(HostUnit(params.embed, opt_state.embed, weights.embed)),
            tuple(done(HostUnit(*u)) for u in zip(params.blocks, opt_state.blocks, weights.blocks)),
            done(HostUnit(params.head, opt_state.head, weights.head)),
        )
        return cls(step, units, jax.tree.map(weights_of, units, is_leaf=_is_future), loss_scale)

    @classmethod
    def of_units(cls, step, units: ModelParams, loss_scale=None) -> OffloadState:
        """A state whose units are already updated: `units`, a `ModelParams` of `HostUnit`s."""
        done_units = jax.tree.map(done, units, is_leaf=_is_unit)
        return cls(step, done_units, jax.tree.map(weights_of, done_units, is_leaf=_is_future), loss_scale)

    def resolved(self) -> HostUnit:
        """Waits for every unit (a host sync); their params, opt_state and weights, each in
        `ModelParams` layout. Raises RuntimeError for a state a step has consumed."""
        if self.consumed:
            raise RuntimeError(
                "this training state was consumed by trainer.step (the host update writes its masters and "
                "optimizer state in place): use the state that step returned."
            )
        units = jax.tree.map(lambda f: f.result(), self.units, is_leaf=_is_future)
        return HostUnit(*(jax.tree.map(lambda u, k=k: u[k], units, is_leaf=_is_unit) for k in range(3)))

    @property
    def params(self) -> ModelParams:
        return self.resolved().params

    @property
    def opt_state(self) -> ModelParams:
        return self.resolved().opt_state

    @property
    def weights(self) -> ModelParams:
        return self.resolved().weights

    def tree_flatten(self):
        return (self.step, *self.resolved(), self.loss_scale), None

    @classmethod
    def tree_unflatten(cls, _aux, children):
        return cls.of(*children)
