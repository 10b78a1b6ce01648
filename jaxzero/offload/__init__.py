"""The offload engine: host-resident masters and optimizer state, streamed weights, the update on the host.

`build_offload_trainer` returns a `Trainer` with the same contract as the resident one; the state it
carries is an `OffloadState`. A step is

    loss, grads, norm = streamed.grads(weights, batch)   # accelerator; gradients land in pinned_host
    units = pipeline.submit(units, grads, norm)          # host; one background update per unit

and returns as soon as the accelerator work is issued. The next step's forward pass waits for each
unit's update only when it reaches that unit (`jaxzero.offload.pipeline`).

Where each array lives is decided by `jaxzero.placement.OffloadPlacement`.
"""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jaxzero import placement as placement_lib
from jaxzero.config import TrainConfig
from jaxzero.loss_scale import init_loss_scale, update_loss_scale
from jaxzero.models import ModelParams, build_model, init_keys
from jaxzero.models.layers import compute_dtype
from jaxzero.offload.host_optimizer import HostOptimizer
from jaxzero.offload.pipeline import (
    OffloadState,
    UpdatePipeline,
    speculative_units,
    two_pass_units,
    weights_of,
)
from jaxzero.offload.streaming import StreamedModel
from jaxzero.offload.timeline import StepClock
from jaxzero.optim import build_optimizer

if TYPE_CHECKING:
    from jaxzero.trainer import Trainer

__all__ = ["OffloadState", "build_offload_trainer"]


def build_offload_trainer(
    cfg: TrainConfig, mesh: Mesh, *, prefetch: int = 1, pinned_reserve: int = 0
) -> Trainer:
    """A `Trainer` for `offload.optimizer=cpu` (and `offload.params` none or cpu) on `mesh`'s one device.

    `pinned_reserve`: bytes to allocate and free in the accelerator's pinned pool before the state's
    first pinned array, so that the pool grows at start-up, not inside a step
    (`jaxzero.memory.pinned_pool_reservation`)."""
    from jaxzero.trainer import StepMetrics, Trainer, abstract_placed  # trainer.py imports us lazily

    model = build_model(cfg.model)
    where = placement_lib.offload_placement(
        mesh, cfg.model.num_layers, cfg.offload.params, cfg.offload.resident_blocks
    )
    masters_shape = jax.eval_shape(model.init, jax.random.key(0))
    host = HostOptimizer(
        cfg.optimizer,
        cfg.steps,
        masters_shape,
        compute_dtype(cfg.model),
        where,
        cfg.data.grad_accum,
        fused=cfg.offload.fused_update,
        threads=cfg.offload.host_threads or None,
    )
    streamed = StreamedModel(model, where, cfg.data.grad_accum, prefetch=prefetch)
    fp16 = cfg.model.compute_dtype == "float16"
    delayed = cfg.offload.update == "delayed"
    clock = StepClock()
    pipeline = UpdatePipeline(
        host,
        cfg.model.num_layers,
        needs_norm=cfg.optimizer.grad_clip > 0 or fp16,
        skip_nonfinite=fp16,
        delayed=delayed,
        speculative_units=speculative_units(cfg),
        two_pass_units=two_pass_units(cfg),
        adaptive_two_pass=cfg.offload.two_pass_units < 0,
        clock=clock,
    )
    # Masters are created unit by unit on the host: one compiled block init serves every block, and
    # the transient memory is one unit, not a second copy of the model.
    keys = jax.jit(partial(init_keys, num_layers=cfg.model.num_layers), out_shardings=where.host)
    init_unit = ModelParams(
        *(jax.jit(f, out_shardings=where.host) for f in (model.init_embed, model.init_block, model.init_head))
    )
    increment = jax.jit(lambda step: step + 1)
    one = jax.device_put(np.float32(1.0), where.device)
    new_loss_scale = jax.jit(partial(init_loss_scale, cfg.fp16), out_shardings=where.device)
    # float16: whether the step overflowed is known on the accelerator (the norm is computed there),
    # so the step count and loss scale advance there too, with no host sync.
    advance_fp16 = jax.jit(
        lambda step, ls, norm: (
            step + jnp.isfinite(norm).astype(step.dtype),
            update_loss_scale(ls, ~jnp.isfinite(norm), cfg.fp16),
            ~jnp.isfinite(norm),
        )
    )

    def reserve_pinned() -> None:
        nonlocal pinned_reserve
        if not pinned_reserve:
            return
        try:
            # A copy of zero pages into the pool (seconds; no host RAM besides the pool's own).
            reserved = jax.device_put(np.zeros(pinned_reserve, np.uint8), where.pinned)
            jax.block_until_ready(reserved).delete()  # host sync
        except RuntimeError as e:  # XLA's allocation errors are RuntimeErrors
            raise RuntimeError(
                f"could not allocate the {pinned_reserve / 2**30:.1f} GiB of pinned (page-locked) host "
                f"memory this offloaded run needs: {e}. Check the locked-memory limit (`ulimit -l` should "
                "be unlimited) and free host RAM, raise XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB, or lower "
                "offload.two_pass_units (two-pass units keep their gradients pinned longer)."
            ) from e
        pinned_reserve = 0

    def fresh(masters: ModelParams) -> OffloadState:
        reserve_pinned()
        on = where.device if fp16 else where.host
        step = jax.device_put(np.zeros((), np.int32), on)
        scale = new_loss_scale() if fp16 else None
        return OffloadState.of(step, masters, host.init(masters), host.compute_weights(masters), scale)

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
        ls = state.loss_scale
        seed = ls.scale if fp16 else one
        loss, grads, norm = streamed.grads(state.in_use, batch, seed, clock)
        submitted = pipeline.submit(state.units, state.in_use, grads, norm, seed)
        lr = host.lr(state.step)
        if fp16:
            next_step, next_ls, skipped = advance_fp16(state.step, ls, norm)
            metrics = StepMetrics(loss, norm, lr, ls.scale, skipped)
        else:
            next_step, next_ls, metrics = increment(state.step), None, StepMetrics(loss, norm, lr)
        # Overlapped, the next pass reads the new weights (waiting per unit); delayed, the previous ones.
        in_use = jax.tree.map(weights_of, state.units) if delayed else submitted.weights
        return OffloadState(next_step, submitted.units, in_use, next_ls), metrics

    def saved_state(state: OffloadState) -> dict[str, Any]:
        """Waits for the pending host updates (a host sync). Everything saved lives on the host."""
        units = state.resolved()
        saved = {
            "step": jax.device_put(state.step, where.host),
            "params": units.params,
            "opt_state": units.opt_state,
        }
        if state.loss_scale is not None:
            saved["loss_scale"] = jax.device_put(state.loss_scale, where.host)
        return saved

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
        reserve_pinned()
        params = saved["params"]
        weights = host.compute_weights(params)
        step, scale = saved["step"], saved.get("loss_scale")
        if fp16:  # the step count and loss scale advance on the accelerator
            step, scale = jax.device_put((step, scale), where.device)
        return OffloadState.of(step, params, saved["opt_state"], weights, scale)

    def eval_loss(state: OffloadState, window: jax.Array) -> jax.Array:
        # The newest weights, each waited for when the pass reaches it.
        return streamed.loss(jax.tree.map(weights_of, state.units), window[None])

    def timings(wall: float, steps: int) -> dict[str, float]:
        """Per-step breakdown (seconds, `timeline`) of what finished since the last call, and the
        speculative unit updates kept and recomputed, and units updated in two passes, per step."""
        n = max(steps, 1)
        out = {f"{k}_s": v / n for k, v in clock.summary(wall).items()}
        kept, redone, two_pass = pipeline.take_counts()
        counts = {"speculated": kept / n, "rolled_back": redone / n, "two_pass_units": two_pass / n}
        return {**out, **counts}

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
        step=step,
        eval_loss=eval_loss,
        put_batch=put_batch,
        put_eval_batch=put_batch,
        strategy=(
            f"{mode}: fp32 masters and {cfg.optimizer.name} state in host RAM, updated on the CPU "
            f"({'fused kernels' if host.fused else 'optax on XLA:CPU'}, {cfg.offload.update}); "
            f"{streamed_n}/{cfg.model.num_layers} blocks streamed from pinned host memory, "
            f"the rest of the {cfg.model.compute_dtype} weights on {where.accelerator}"
        ),
        layout="offload",
        saved_state=saved_state,
        abstract_saved_state=abstract_saved_state,
        from_saved_state=from_saved_state,
        timings=timings,
    )
