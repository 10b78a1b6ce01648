"""The offload trainer: a `Trainer` whose masters and optimizer state live in host RAM.

`build_offload_trainer` returns a `Trainer` with the same contract as the resident one; the state it
carries is an `OffloadState`. It builds the parts' shared context and wires four parts into it:

    StateInit          (jaxzero.offload.state_init)     init, init_from_params, the pinned pool's growth
    OffloadStep        (jaxzero.offload.step)           step, eval_loss
    CheckpointAdapter  (jaxzero.offload.checkpointing)  saved_state, abstract_saved_state, from_saved_state
    StepTimings        (jaxzero.offload.breakdown)      timings

Where each unit's arrays live and how the host update runs is the offload plan's (`jaxzero.plan`);
its shardings are `jaxzero.plan.placement.OffloadPlacement`'s.
"""

from __future__ import annotations

from functools import partial

import optax
from jax.sharding import Mesh

from jaxzero.config import TrainConfig
from jaxzero.models import Model
from jaxzero.numerics.optim import build_optimizer
from jaxzero.offload.breakdown import StepTimings
from jaxzero.offload.checkpointing import CheckpointAdapter
from jaxzero.offload.context import build_engine_context
from jaxzero.offload.state_init import StateInit
from jaxzero.offload.step import OffloadStep
from jaxzero.offload.streaming import StreamedModel
from jaxzero.plan import OffloadPlan, resolve_plan
from jaxzero.plan import placement as placement_lib
from jaxzero.state import Trainer


def build_offload_trainer(
    cfg: TrainConfig,
    mesh: Mesh,
    *,
    plan: OffloadPlan | None = None,
    pinned_reserve: int = 0,
    model: Model | None = None,
    optimizer: optax.GradientTransformation | None = None,
) -> Trainer:
    """A `Trainer` for a plan whose units' state lives in host RAM (`offload.optimizer=cpu`, with
    `offload.params` none or cpu), over every device of `mesh` (ZeRO sharding: each process keeps and
    updates its devices' shards of the masters and optimizer state). `plan` defaults to
    `resolve_plan(cfg)`.

    `pinned_reserve`: bytes (this process's) to allocate and free in the pinned pool before the state's
    first pinned array, so that the pool grows at start-up, not inside a step
    (`jaxzero.planner.memory.pinned_pool_reservation`).

    `model` and `optimizer`: the researcher's own, in place of `cfg.model`'s and `cfg.optimizer`'s;
    the optimizer is applied to each unit alone, on the host as optax on XLA:CPU (`build_engine_context`).
    `trainer.plan` says what runs."""
    plan = resolve_plan(cfg) if plan is None else plan
    ctx = build_engine_context(cfg, mesh, plan, model=model, optimizer=optimizer)
    plan = ctx.plan  # with the host update a custom optimizer needs
    streamed = StreamedModel(ctx.model, ctx.where, cfg.data.grad_accum, prefetch=plan.prefetch)
    start = StateInit(ctx, pinned_reserve)
    steps = OffloadStep(ctx, streamed)
    saved = CheckpointAdapter(ctx, start)
    return Trainer(
        config=cfg,
        plan=plan,
        model=ctx.model,
        mesh=mesh,
        optimizer=build_optimizer(cfg.optimizer, cfg.schedule_steps, custom=optimizer),
        init=start.init,
        init_from_params=start.init_from_params,
        step=steps.step,
        eval_loss=steps.eval_loss,
        put_batch=partial(placement_lib.put_train_batch, mesh=mesh),
        put_eval_batch=partial(placement_lib.put_eval_batch, mesh=mesh),
        layout="offload",
        saved_state=saved.saved_state,
        abstract_saved_state=saved.abstract_saved_state,
        from_saved_state=saved.from_saved_state,
        timings=StepTimings(ctx.clock, ctx.pipeline, ctx.disk),
        close=ctx.disk.close if ctx.disk is not None else _nothing,
        fence=ctx.fence,
    )


def _nothing() -> None:
    pass
