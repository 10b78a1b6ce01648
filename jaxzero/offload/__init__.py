"""The offload engine: host-resident masters and optimizer state, streamed weights, Optax on the host.

`build_offload_trainer` returns a `Trainer` with the same contract as the resident one; the state it
carries is an `OffloadState`. A step is

    loss, grads = streamed.grads(weights, batch)     # accelerator; gradients land in pinned_host
    masters, opt_state, weights = host.update(...)   # host CPU; new compute weights written back

Where each array lives is decided by `jaxzero.placement.OffloadPlacement`.
"""

from __future__ import annotations

from functools import partial
from typing import Any, NamedTuple

import jax
import numpy as np
from jax.sharding import Mesh

from jaxzero import placement as placement_lib
from jaxzero.config import TrainConfig
from jaxzero.loss_scale import init_loss_scale, update_loss_scale
from jaxzero.models import ModelParams, build_model, init_keys
from jaxzero.models.layers import compute_dtype
from jaxzero.offload.host_optimizer import HostOptimizer, host_view
from jaxzero.offload.streaming import StreamedModel
from jaxzero.optim import build_optimizer


class OffloadState(NamedTuple):
    """Training state of the offload engine (a pytree).

    step:      int32 scalar on the host device: optimizer updates applied.
    params:    float32 masters, host RAM (CPU backend).
    opt_state: one optax state per unit in `ModelParams` layout (embed, blocks, head), host RAM.
    weights:   compute-dtype weights: embed/head and resident blocks in accelerator memory, streamed
               blocks in the accelerator's pinned_host memory.
    loss_scale: float16 training's `LossScaleState` on the host device; None otherwise.
    """

    step: jax.Array
    params: ModelParams
    opt_state: ModelParams
    weights: ModelParams
    loss_scale: Any = None


def _delete(tree: Any) -> None:
    """Release buffers now rather than when Python drops the last reference (their memory is reused)."""
    for x in jax.tree.leaves(tree):
        x.delete()


def build_offload_trainer(cfg: TrainConfig, mesh: Mesh, *, prefetch: int = 1):
    """A `Trainer` for `offload.optimizer=cpu` (and `offload.params` none or cpu) on `mesh`'s one device."""
    from jaxzero.trainer import StepMetrics, Trainer, abstract_placed  # trainer.py imports us lazily

    model = build_model(cfg.model)
    where = placement_lib.offload_placement(
        mesh, cfg.model.num_layers, cfg.offload.params, cfg.offload.resident_blocks
    )
    masters_shape = jax.eval_shape(model.init, jax.random.key(0))
    host = HostOptimizer(
        cfg.optimizer, cfg.steps, masters_shape, compute_dtype(cfg.model), where, cfg.data.grad_accum
    )
    streamed = StreamedModel(model, where, cfg.data.grad_accum, prefetch=prefetch)
    # Masters are created unit by unit on the host: one compiled block init serves every block, and
    # the transient memory is one unit, not a second copy of the model.
    keys = jax.jit(partial(init_keys, num_layers=cfg.model.num_layers), out_shardings=where.host)
    init_unit = ModelParams(
        *(jax.jit(f, out_shardings=where.host) for f in (model.init_embed, model.init_block, model.init_head))
    )
    increment = jax.jit(lambda step: step + 1)
    fp16 = cfg.model.compute_dtype == "float16"
    one_host = jax.device_put(np.float32(1.0), where.host)
    one_device = jax.device_put(np.float32(1.0), where.device)
    new_loss_scale = jax.jit(partial(init_loss_scale, cfg.fp16), out_shardings=where.host)
    next_loss_scale = jax.jit(partial(update_loss_scale, cfg=cfg.fp16), out_shardings=where.host)
    overflowed = {flag: jax.device_put(np.bool_(flag), where.host) for flag in (False, True)}

    def fresh(masters: ModelParams) -> OffloadState:
        step = jax.device_put(np.zeros((), np.int32), where.host)
        scale = new_loss_scale() if fp16 else None
        return OffloadState(step, masters, host.init(masters), host.compute_weights(masters), scale)

    def init(key: jax.Array) -> OffloadState:
        # Created on the host directly: the key moves to the CPU backend, never the state to the GPU.
        k_embed, k_blocks, k_head = keys(jax.device_put(key, where.host))
        masters = ModelParams(
            init_unit.embed(k_embed), tuple(init_unit.blocks(k) for k in k_blocks), init_unit.head(k_head)
        )
        return fresh(masters)

    def init_from_params(params: ModelParams) -> OffloadState:
        return fresh(jax.device_put(params, where.host))  # NumPy masters -> host device (CPU backend)

    def step(state: OffloadState, batch: jax.Array) -> tuple[OffloadState, StepMetrics]:
        loss, grads = streamed.grads(state.weights, batch, one_device)
        grads, norm = host.prepare(grads, one_host)
        _delete(state.weights)  # the new weights take their place (deletion waits for pending reads)
        masters, opt_state, weights, lr = host.apply(
            state.step, state.params, state.opt_state, grads, norm, one_host
        )
        del grads
        return OffloadState(increment(state.step), masters, opt_state, weights), StepMetrics(loss, norm, lr)

    def step_fp16(state: OffloadState, batch: jax.Array) -> tuple[OffloadState, StepMetrics]:
        """float16: the backward pass carries the loss scale; an overflowing step changes nothing but
        the loss scale (DeepSpeed's rules, `jaxzero.loss_scale`)."""
        ls = state.loss_scale
        loss, grads = streamed.grads(state.weights, batch, jax.device_put(ls.scale, where.device))
        grads, norm = host.prepare(grads, ls.scale)
        # Host sync: the update must not start before we know it is wanted. A non-finite norm means an
        # inf or NaN in some gradient (an astronomically large finite one would also count).
        ok = bool(np.isfinite(host_view(norm)))
        scale = next_loss_scale(ls, overflowed[not ok])
        if not ok:
            metrics = StepMetrics(loss, norm, host.lr(state.step), ls.scale, overflowed[True])
            return state._replace(loss_scale=scale), metrics
        _delete(state.weights)
        masters, opt_state, weights, lr = host.apply(
            state.step, state.params, state.opt_state, grads, norm, ls.scale
        )
        del grads
        new = OffloadState(increment(state.step), masters, opt_state, weights, scale)
        return new, StepMetrics(loss, norm, lr, ls.scale, overflowed[False])

    def saved_state(state: OffloadState) -> dict[str, Any]:
        saved = {"step": state.step, "params": state.params, "opt_state": state.opt_state}
        return saved if state.loss_scale is None else {**saved, "loss_scale": state.loss_scale}

    def abstract_saved_state() -> dict[str, Any]:
        masters = jax.eval_shape(model.init, jax.random.key(0))
        shapes = {
            "step": jax.ShapeDtypeStruct((), np.int32),
            "params": masters,
            "opt_state": jax.eval_shape(host.init, masters),
        }
        if fp16:
            shapes["loss_scale"] = jax.eval_shape(partial(init_loss_scale, cfg.fp16))
        return abstract_placed(shapes, jax.tree.map(lambda _: where.host, shapes))

    def from_saved_state(saved: dict[str, Any]) -> OffloadState:
        params = saved["params"]
        weights = host.compute_weights(params)
        return OffloadState(saved["step"], params, saved["opt_state"], weights, saved.get("loss_scale"))

    def eval_loss(state: OffloadState, window: jax.Array) -> jax.Array:
        return streamed.loss(state.weights, window[None])

    def put_batch(batch):  # whole batch on the one accelerator
        return jax.device_put(batch, where.device)

    mode = "ZeRO-3 offload" if cfg.offload.params == "cpu" else "ZeRO-Offload"
    streamed_n = sum(where.is_streamed(i) for i in range(cfg.model.num_layers))
    return Trainer(
        config=cfg,
        model=model,
        mesh=mesh,
        optimizer=build_optimizer(cfg.optimizer, cfg.steps),
        init=init,
        init_from_params=init_from_params,
        step=step_fp16 if fp16 else step,
        eval_loss=eval_loss,
        put_batch=put_batch,
        put_eval_batch=put_batch,
        strategy=(
            f"{mode}: fp32 masters and {cfg.optimizer.name} state in host RAM (optax on the CPU); "
            f"{streamed_n}/{cfg.model.num_layers} blocks streamed from pinned host memory, "
            f"the rest of the {cfg.model.compute_dtype} weights on {where.accelerator}"
        ),
        layout="offload",
        saved_state=saved_state,
        abstract_saved_state=abstract_saved_state,
        from_saved_state=from_saved_state,
    )
