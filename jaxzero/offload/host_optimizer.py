"""Optax on the host: the fp32 masters and optimizer state never leave host RAM.

The update runs one unit at a time (embedding, each block, head) as XLA:CPU programs on the CPU
backend, so one compiled block update serves every block and the compute-dtype copy of each unit can
start its way back to the accelerator while the next unit updates. Global-norm clipping needs the norm
of the whole gradient first, so the update is two passes:

    1. norm:   the squared norm of each unit's (averaged) gradient, summed -> the exact global norm
    2. update: per unit, clip with that norm (optax's rule), apply the optax transformation, cast the
               new masters to the compute dtype and write them back to where the weights live.

Optimizer state is one optax state per unit, kept in `ModelParams` layout (embed, blocks, head).

The way back to accelerator-visible memory avoids the CPU backend's slow cross-client path: the
compute-dtype result is read as a NumPy view (no copy) and `device_put` from a pool of threads, the
fast path measured in `shared/design/measurements.md`.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxzero.config import OptimizerConfig
from jaxzero.models import ModelParams
from jaxzero.optim import build_optimizer, clip_by_norm, learning_rate_schedule, weight_decay_mask
from jaxzero.placement import OffloadPlacement


class HostOptimizer:
    """The configured optax transformation applied on the host, unit by unit.

    masters:   float32 `ModelParams` on `placement.host_device`.
    opt_state: `ModelParams`-shaped tuple of per-unit optax states, on the host device.
    grads:     `ModelParams` of gradient *sums* over `grad_accum` micro-batches, anywhere host-readable
               (compute dtype or float32); they are upcast and divided by `grad_accum` here.
    """

    def __init__(
        self,
        cfg: OptimizerConfig,
        total_steps: int,
        masters_shape: ModelParams,
        compute_dtype: jnp.dtype,
        placement: OffloadPlacement,
        grad_accum: int,
        threads: int = 16,
    ):
        self.placement = placement
        self.compute_dtype = jnp.dtype(compute_dtype)
        self.grad_accum = grad_accum
        self.max_norm = cfg.grad_clip
        self.schedule = learning_rate_schedule(cfg, total_steps)
        mask = weight_decay_mask(masters_shape, cfg.decay_norms_biases_embeddings)
        self.tx = ModelParams(
            embed=build_optimizer(cfg, total_steps, clip=False, mask=mask.embed),
            blocks=build_optimizer(cfg, total_steps, clip=False, mask=mask.blocks[0]),  # blocks share one
            head=build_optimizer(cfg, total_steps, clip=False, mask=mask.head),
        )
        self._pool = ThreadPoolExecutor(max(1, threads), thread_name_prefix="jaxzero-writeback")
        host = placement.host

        def mean_grad(g, scale):  # sums of `scale * loss` gradients -> the mean gradient of the loss
            return jax.tree.map(lambda x: x.astype(jnp.float32) / grad_accum / scale, g)

        def sq_norm(g, scale):  # float32 scalar: squared L2 norm of one unit's averaged gradient
            return sum(jnp.sum(jnp.square(x)) for x in jax.tree.leaves(mean_grad(g, scale)))

        def make_update(tx: optax.GradientTransformation):
            def update(masters, opt_state, grads, norm, scale):
                g = mean_grad(grads, scale)
                if self.max_norm > 0:
                    g = clip_by_norm(g, norm, self.max_norm)
                updates, opt_state = tx.update(g, opt_state, masters)
                masters = optax.apply_updates(masters, updates)
                weights = jax.tree.map(lambda p: p.astype(self.compute_dtype), masters)
                return masters, opt_state, weights

            # Masters and state are updated in place (donated); everything runs on the host device.
            return jax.jit(update, donate_argnums=(0, 1), out_shardings=host)

        self._sq_norm = jax.jit(sq_norm, out_shardings=host)
        self._sqrt_sum = jax.jit(lambda parts: jnp.sqrt(sum(parts[1:], parts[0])), out_shardings=host)
        self._lr = jax.jit(lambda step: jnp.asarray(self.schedule(step), jnp.float32), out_shardings=host)
        self._update = ModelParams(
            embed=make_update(self.tx.embed),
            blocks=make_update(self.tx.blocks),
            head=make_update(self.tx.head),
        )
        self._init = ModelParams(
            embed=jax.jit(self.tx.embed.init, out_shardings=host),
            blocks=jax.jit(self.tx.blocks.init, out_shardings=host),
            head=jax.jit(self.tx.head.init, out_shardings=host),
        )
        self._cast = jax.jit(
            lambda p: jax.tree.map(lambda x: x.astype(self.compute_dtype), p), out_shardings=host
        )

    # -- state ---------------------------------------------------------------------------------------

    def init(self, masters: ModelParams) -> ModelParams:
        """Per-unit optimizer state for host-resident float32 masters, created on the host."""
        return ModelParams(
            embed=self._init.embed(masters.embed),
            blocks=tuple(self._init.blocks(b) for b in masters.blocks),
            head=self._init.head(masters.head),
        )

    def compute_weights(self, masters: ModelParams) -> ModelParams:
        """The compute-dtype weights of `masters`, placed per `placement` (used at init and restore)."""
        futures = ModelParams(
            embed=self._write_back(self._cast(masters.embed), self.placement.device),
            blocks=tuple(
                self._write_back(self._cast(b), self._block_target(i)) for i, b in enumerate(masters.blocks)
            ),
            head=self._write_back(self._cast(masters.head), self.placement.device),
        )
        return _resolve(futures)

    # -- the update ----------------------------------------------------------------------------------

    def global_norm(self, grads_host: ModelParams, scale: jax.Array) -> jax.Array:
        """Exact L2 norm of the averaged gradient over all units; float32 scalar on the host."""
        parts = [self._sq_norm(grads_host.embed, scale), self._sq_norm(grads_host.head, scale)]
        parts += [self._sq_norm(g, scale) for g in grads_host.blocks]
        return self._sqrt_sum(parts)

    def prepare(self, grads: ModelParams, scale: jax.Array) -> tuple[ModelParams, jax.Array]:
        """Gradient sums in `pinned_host` -> (the same on the host device, the global norm of the mean
        gradient). `scale` (float32 scalar on the host device) is the loss scale the sums carry.

        For arrays in the accelerator's `pinned_host` memory the move is an alias, not a copy: a
        NumPy view handed to the CPU backend. (A direct device_put between the GPU and CPU clients
        stages through a slow path: ~1 GB/s, measured on the H100/H200 box.)
        """
        grads = jax.device_put(jax.tree.map(host_view, grads), self.placement.host)
        return grads, self.global_norm(grads, scale)

    def apply(
        self,
        step: jax.Array,
        masters: ModelParams,
        opt_state: ModelParams,
        grads: ModelParams,
        norm: jax.Array,
        scale: jax.Array,
    ) -> tuple[ModelParams, ModelParams, ModelParams, jax.Array]:
        """One optimizer step from `prepare`d gradients. Returns (masters, opt_state, weights, lr).

        `masters` and `opt_state` are donated. `weights` are the new compute-dtype weights already
        placed per `placement`; the caller must have released the old ones (their memory is reused).

        Units are updated concurrently from the worker pool: one XLA:CPU call uses only part of the
        host's cores and memory bandwidth, several at once use most of it.
        """
        units = [(self._update.embed, masters.embed, opt_state.embed, grads.embed, self.placement.device)]
        units += [
            (self._update.blocks, m, s, g, self._block_target(i))
            for i, (m, s, g) in enumerate(zip(masters.blocks, opt_state.blocks, grads.blocks))
        ]
        units += [(self._update.head, masters.head, opt_state.head, grads.head, self.placement.device)]
        del masters, opt_state, grads

        def run(update, m, s, g, target):
            m, s, w = update(m, s, g, norm, scale)
            return m, s, place(w, target)  # host sync (worker thread): waits for this unit's update

        results = [f.result() for f in [self._pool.submit(run, *u) for u in units]]  # host sync
        masters_out, states_out, weights_out = (list(col) for col in zip(*results))
        as_params = lambda xs: ModelParams(xs[0], tuple(xs[1:-1]), xs[-1])  # noqa: E731
        return as_params(masters_out), as_params(states_out), as_params(weights_out), self.lr(step)

    def lr(self, step: jax.Array) -> jax.Array:
        """The learning rate of update number `step` (int32 on the host device)."""
        return self._lr(step)

    # -- the way back --------------------------------------------------------------------------------

    def _block_target(self, i: int):
        return self.placement.pinned if self.placement.is_streamed(i) else self.placement.device

    def _write_back(self, unit_host: Any, target) -> Future:
        """`place` a host-device pytree at `target` from a worker thread."""
        return self._pool.submit(place, unit_host, target)


def place(unit_host: Any, target) -> Any:
    """Copy a pytree of host-device (CPU backend) arrays to `target`: a NumPy view (no copy), then one
    `device_put` per leaf, never the CPU client's slow cross-client path. Waits for the arrays (a host
    sync)."""
    return jax.device_put(jax.tree.map(host_view, unit_host), target)


def host_view(x: jax.Array) -> np.ndarray:
    """A read-only NumPy view of an array that lives in host memory (`pinned_host` or the CPU
    backend): no copy. Waits for the array to be ready (a host sync)."""
    with jax.transfer_guard_device_to_host("allow"):  # reading host memory in place is not a transfer
        return np.asarray(x)


def _resolve(futures: ModelParams) -> ModelParams:
    """Wait for every write-back. Host sync."""
    return jax.tree.map(lambda f: f.result(), futures, is_leaf=lambda x: isinstance(x, Future))
