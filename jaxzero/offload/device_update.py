"""Units whose fp32 masters and optimizer state live on the accelerator, updated there.

`offload.device_state_units` (or the planner) keeps the first units of the forward pass (embedding,
block 0, 1, ...) entirely on the accelerator when it has room for them. Their update is one jitted
optax step per unit, issued by the training step right after the gradient pass: the global norm is
already on the accelerator, so nothing waits for the host, and the next forward pass starts on these
units while the host still updates the others.

The update is the host update's rule, so a unit gets the same result wherever its state lives: the
gradient sums times one multiplier (1 / (grad_accum * loss scale), then optax's global-norm clipping
rule), then the unit's optax transformation without clipping (`build_optimizer(..., clip=False)`).
Under float16 a step whose norm is not finite keeps the unit as it was, as the host update skips it.

Arrays are one shard per device (`OffloadPlacement.split`), as the host keeps its state: the masters
and optimizer state in float32 (moments in `optimizer.state_dtype`). No compute-dtype copy is kept:
the passes read the float32 masters and cast them as they use them (`StreamedModel`), as the resident
trainer does, which saves the accelerator 2 bytes per parameter of these units (bf16) for a cast of one
unit at a time.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxzero.config import OptimizerConfig
from jaxzero.models import ModelParams
from jaxzero.numerics.optim import scaled_update, unit_optimizers
from jaxzero.offload.host_memory import place
from jaxzero.offload.host_optimizer import HostUnit
from jaxzero.plan import Tier, UnitKind, UnitPlan
from jaxzero.plan.placement import DEVICE, OffloadPlacement


class DeviceOptimizer:
    """The configured optimizer applied on the accelerator to the units of `placement.plan` whose
    state is `Tier.DEVICE`.

    masters_shape: the model's float32 master shapes (`ShapeDtypeStruct`s, global).
    grad_accum:    micro-batches per step: gradients arrive as sums over them.
    custom:        a researcher's own transformation, applied to each unit alone in place of the
                   named one.
    """

    def __init__(
        self,
        cfg: OptimizerConfig,
        total_steps: int,
        masters_shape: ModelParams,
        placement: OffloadPlacement,
        grad_accum: int,
        *,
        custom: optax.GradientTransformation | None = None,
    ):
        plan = placement.plan
        self.placement = placement
        self.masters_shape = masters_shape
        skips_nonfinite = plan.host_update is not None and plan.host_update.skips_nonfinite
        max_norm = np.float32(cfg.grad_clip)
        txs = unit_optimizers(cfg, total_steps, masters_shape, custom)
        self._shapes = {
            UnitKind.EMBED: masters_shape.embed,
            UnitKind.BLOCK: masters_shape.blocks[0],
            UnitKind.HEAD: masters_shape.head,
        }
        self._update: dict[UnitKind, Any] = {}
        self._init: dict[UnitKind, Any] = {}
        self.targets: dict[UnitKind, tuple[Any, Any]] = {}  # masters, opt_state shardings

        for kind in {u.kind for u in plan.units if u.state is Tier.DEVICE}:
            tx = getattr(txs, kind.value)
            shapes = self._shapes[kind]
            masters_at = placement.split(shapes, DEVICE)
            state_at = placement.split(jax.eval_shape(tx.init, shapes), DEVICE)
            self.targets[kind] = (masters_at, state_at)

            def update(masters, opt_state, grads, norm, scale, tx=tx):
                # The host's multiplier, in the same float32 operations (`HostOptimizer.grad_multiplier`).
                gmul = jnp.float32(1.0) / jnp.float32(grad_accum) / scale
                if max_norm > 0:
                    gmul = jnp.where(norm < max_norm, gmul, gmul / norm * max_norm)
                new_masters, new_state = scaled_update(tx, masters, opt_state, grads, gmul)
                if skips_nonfinite:  # float16 overflow: this step changes nothing
                    keep = jnp.isfinite(norm)
                    new_masters, new_state = jax.tree.map(
                        lambda a, b: jnp.where(keep, a, b), (new_masters, new_state), (masters, opt_state)
                    )
                return new_masters, new_state

            # Masters and state are updated in place (donated).
            self._update[kind] = jax.jit(update, donate_argnums=(0, 1), out_shardings=(masters_at, state_at))
            self._init[kind] = jax.jit(tx.init, out_shardings=state_at)

    def start(self, unit: UnitPlan, local_masters: Any, local_state: Any = None) -> HostUnit:
        """The unit on the accelerator from this process's host blocks of its masters (and of its
        optimizer state, from a checkpoint; None: a fresh state), or from global arrays a restore
        placed as `targets` already (taken as they are). A host sync (the copies). The unit's weights
        are its masters (float32; the passes cast them)."""
        masters_at, state_at = self.targets[unit.kind]
        shapes = self._shapes[unit.kind]
        masters = _placed(local_masters, masters_at, shapes)
        if local_state is None:
            state = self._init[unit.kind](masters)
        else:
            state = _placed(local_state, state_at, jax.eval_shape(self._init[unit.kind], shapes))
        return HostUnit(masters, state, masters)

    def update(
        self, unit: UnitPlan, arrays: HostUnit, grads: Any, norm: jax.Array, scale: jax.Array
    ) -> HostUnit:
        """One optimizer step of `unit` (asynchronous: issued, not waited for).

        arrays: its masters (also its weights) and optimizer state on the accelerator, consumed:
                donated, so the update reuses their memory once the passes that read them are done.
        grads:  its gradient sums on the accelerator, one shard per device (compute dtype or float32).
        norm:   the global norm of the mean gradient; scale: the loss scale (1 but under float16);
                float32 scalars on the accelerator.
        """
        masters, state = self._update[unit.kind](arrays.params, arrays.opt_state, grads, norm, scale)
        return HostUnit(masters, state, masters)


def _placed(tree: Any, targets: Any, shapes: Any) -> Any:
    """`tree` placed by `targets`: its arrays that are there already as they are, the others (this
    process's host blocks) copied there (`place`)."""

    def one(x: Any, target: Any, shape: Any) -> Any:
        if isinstance(x, jax.Array) and x.sharding.is_equivalent_to(target, x.ndim):
            return x
        return place(x, target, shape)

    return jax.tree.map(one, tree, targets, shapes)
