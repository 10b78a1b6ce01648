"""The resident trainer (`offload.optimizer=none`): fp32 masters, optimizer state and the bf16 casts
made inside each block all in accelerator memory; one jitted step per optimizer update. It is the
oracle the offload engine is tested against.

`build_resident_trainer` builds the parts' shared context (`ResidentContext`: the model, the optax
transformation, the state's shapes and shardings) and wires three parts into a `Trainer`:

    ResidentInit        init, init_from_params
    ResidentStep        step, eval_loss
    ResidentCheckpoint  saved_state, abstract_saved_state, from_saved_state

The ZeRO stage of the plan says what is split over the `data` mesh axis: 0 nothing (data parallel),
1 the optimizer state, 2 also the gradients (reduce-scattered), 3 also the parameters (FSDP:
all-gathered per use).

What trains is the builder's parameter (`trains`): every parameter (the above), or the trainable
part of a run with a frozen part (LoRA adapters, the units `finetune.freeze` leaves;
`jaxzero.offload.trains.FrozenTrains`), on one device. Then the state, its update (`apply_update`:
optax over what trains, global-norm clipping over all of it) and its checkpoint form are the same
over the trainable tree; its init (`FrozenPartInit`) and gradients (`FrozenPartStep`: the streamed
schedule over the frozen base, one pass per micro-batch, `StreamedModel.grads_per_micro_batch`) are
chosen when the trainer is built:

    for each micro-batch a:  loss_a, grads_a = one pass of the schedule (its own forward and
                             rematerialised backward, so one micro-batch's activations live)
    grads = sum of grads_a;  params, opt_state = optax update (global-norm clipping)
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh

from jaxzero.config import ConfigError, FP16Config, TrainConfig
from jaxzero.custom import check_optimizer, model_of
from jaxzero.models import Model, ModelParams, emits_stats
from jaxzero.numerics.loss_scale import all_finite, init_loss_scale, update_loss_scale
from jaxzero.numerics.objective import (
    document_eot,
    document_segments,
    loss_fn,
    objective_with_aux,
    per_step,
    real_tokens,
    router_padding,
    step_weight,
)
from jaxzero.numerics.optim import (
    build_optimizer,
    global_norm,
    join_opt_state,
    reported_rate,
    split_opt_state,
)
from jaxzero.offload.streaming import StreamedModel
from jaxzero.offload.trains import FrozenTrains, frozen_part_plan
from jaxzero.plan import OffloadPlan, placement, resolve_plan
from jaxzero.plan.placement import OffloadPlacement
from jaxzero.primitives.deferred import resolved
from jaxzero.primitives.write_fence import WriteFence
from jaxzero.state import StepMetrics, Trainer, TrainState, abstract_placed


def averaged_grads(
    model: Model,
    params: ModelParams,
    batch: jax.Array,
    scale: jax.Array | None = None,
    eot_id: int | None = None,
    padding: int | None = None,
) -> tuple[jax.Array, ModelParams, jax.Array | None]:
    """Mean loss, float32 gradients and mean auxiliary loss over `grad_accum` micro-batches of int32
    (A, mb, S+1).

    The loss is the mean over the step's counted targets (`objective.step_weight` weighs each
    micro-batch's sum; without not-a-target marks, the mean of the micro-batches' means). One
    micro-batch is differentiated directly; more are summed in a `lax.scan` (one float32 gradient
    buffer, not A of them). With a loss `scale` (float16) the gradients are those of `scale * loss`
    (the caller unscales them); the loss returned is unscaled. `eot_id` (static): each document of a
    window attends within itself (`objective.loss_fn`). Where the model's blocks emit statistics
    (`jaxzero.models.emits_stats`, decided here at trace time) each micro-batch's objective adds its
    weighted auxiliary loss (`objective.objective_with_aux`, its statistics without the rows' padding
    after end-of-text id `padding` where given, static: `objective.router_padding`), and the third
    value is the mean over the micro-batches of the unweighted auxiliary loss (float32 scalar); else
    it is None.
    """
    weight = step_weight(batch)
    if emits_stats(model):

        def value(p, window, mask):
            return objective_with_aux(model, p, window, weight, eot_id, mask)

    else:

        def value(p, window, mask):
            loss = loss_fn(model, p, window, weight, eot_id)
            return loss, (loss, None)

    def scaled(p, window, mask):
        objective, losses = value(p, window, mask)
        return (objective if scale is None else objective * scale), losses

    def value_and_grad(window, mask=None):
        (_, losses), grads = jax.value_and_grad(scaled, has_aux=True)(params, window, mask)
        return losses, grads

    def added(carry, window, mask=None):
        return jax.tree.map(jnp.add, carry, value_and_grad(window, mask))

    one, micro = value_and_grad, added
    if padding is not None:  # one program with the mask: a second without would double the compile
        one, micro = _with_mask(value_and_grad, padding), _with_mask(added, padding)

    if batch.shape[0] == 1:
        (loss, aux), grads = one(batch[0])
        return loss, grads, aux

    zero = jnp.zeros((), jnp.float32)
    zeros = ((zero, zero if emits_stats(model) else None), jax.tree.map(jnp.zeros_like, params))
    ((loss, aux), grads), _ = jax.lax.scan(lambda c, w: (micro(c, w), None), zeros, batch)
    loss, aux, grads = jax.tree.map(lambda x: x / batch.shape[0], (loss, aux, grads))
    return loss, grads, aux


def _with_mask(f: Any, padding: int) -> Any:
    """`f(*args, window)` as `f(*args, window, mask)` with the window's token mask
    (`objective.real_tokens` after end-of-text id `padding`). A window without padding computes
    what a run counting every token does, to rounding (a mask of ones fused into the whole model's
    program may round its gradients by an ulp)."""

    def masked(*args: Any) -> Any:
        return f(*args, real_tokens(args[-1], padding))

    return masked


@dataclass(frozen=True, eq=False, kw_only=True)
class ResidentContext:
    """What the resident trainer's parts share, made once by `build_resident_context`.

    tx:             the optax transformation (with clipping where `optimizer.grad_clip` > 0): the
                    named optimizer's, or the researcher's own applied to the whole model.
    schedule:       the learning rate at a step (the metrics report it; NaN for one's own optimizer).
    fp16:           the loss-scaling settings under float16 compute; None otherwise.
    shapes:         the state's global shapes (`TrainState` of `ShapeDtypeStruct`s).
    state_sharding: the state's shardings (`TrainState` of shardings; the ZeRO stage splits them).
    grad_sharding:  the gradients' shardings (split from ZeRO stage 2: a reduce-scatter).
    eot_id:         the end-of-text id whose documents attend only within themselves, or None
                    (`objective.document_eot`): baked into the step and evaluation programs.
    padding:        the end-of-text id after which rows' padding counts in no router statistics, or
                    None (`objective.router_padding`): baked into the step programs.
    trains:         what trains beside a frozen base (the state is over its tree, on its device), or
                    None: every parameter.
    """

    cfg: TrainConfig
    plan: OffloadPlan
    model: Model
    mesh: Mesh
    tx: optax.GradientTransformation
    schedule: optax.Schedule
    fp16: FP16Config | None
    shapes: TrainState
    state_sharding: TrainState
    grad_sharding: ModelParams
    eot_id: int | None
    padding: int | None = None
    trains: FrozenTrains | None = None


def build_resident_context(
    cfg: TrainConfig,
    mesh: Mesh,
    plan: OffloadPlan,
    *,
    model: Model | None = None,
    optimizer: optax.GradientTransformation | None = None,
    trains: FrozenTrains | None = None,
) -> ResidentContext:
    """The resident trainer's context for `plan` (every unit's state on the accelerator) over every
    device of `mesh`: `cfg.model`'s model and `cfg.optimizer`'s transformation, or the researcher's
    own `model` (described by `cfg.model`) and `optimizer` (`jaxzero.custom`); over every parameter,
    or over what `trains` beside a frozen base (its model, its tree, its one device). Allocates
    nothing, compiles nothing."""
    if plan.host_update is not None:
        raise ValueError("build_resident_trainer needs a plan with accelerator-resident state")
    if trains is not None and (model is not None or optimizer is not None):
        raise ConfigError(
            "finetune.method=lora and finetune.freeze train jaxzero's models with cfg.optimizer: "
            "build_trainer's model= and optimizer= apply to runs that train every unit."
        )
    model = model_of(cfg.model, model) if trains is None else trains.model
    tx = build_optimizer(cfg.optimizer, cfg.schedule_steps, custom=optimizer)
    if optimizer is not None:
        check_optimizer(cfg, optimizer, jax.eval_shape(model.init, jax.random.key(0)))
    fp16 = cfg.fp16 if cfg.model.compute_dtype == "float16" else None
    if trains is None:
        shapes = jax.eval_shape(partial(init_state, model, tx, fp16), jax.random.key(0))
        state_sharding = TrainState(
            step=placement.replicated(mesh),
            params=placement.zero_shardings(mesh, shapes.params, plan.shards_weights),
            opt_state=placement.zero_shardings(mesh, shapes.opt_state, plan.shards_state),
            loss_scale=jax.tree.map(lambda _: placement.replicated(mesh), shapes.loss_scale),
        )
        grad_sharding = placement.zero_shardings(mesh, shapes.params, plan.shards_grads)
    else:  # one device (float16 is refused for a frozen part): every array where `trains` keeps it
        shapes = jax.eval_shape(partial(fresh, model, tx, None), trains.shapes)
        state_sharding = jax.tree.map(lambda _: trains.device, shapes)
        grad_sharding = state_sharding.params
    schedule = reported_rate(cfg.optimizer, cfg.schedule_steps, optimizer)
    eot_id = document_eot(cfg.data, model)
    return ResidentContext(
        cfg=cfg,
        plan=plan,
        model=model,
        mesh=mesh,
        tx=tx,
        schedule=schedule,
        fp16=fp16,
        shapes=shapes,
        state_sharding=state_sharding,
        grad_sharding=grad_sharding,
        eot_id=eot_id,
        padding=router_padding(cfg.data, model),
        trains=trains,
    )


def fresh(
    model: Model, tx: optax.GradientTransformation, fp16: FP16Config | None, params: ModelParams
) -> TrainState:
    """A fresh state at step 0 over float32 `params` (a new loss scale under float16); traced."""
    scale = init_loss_scale(fp16) if fp16 is not None else None
    return TrainState(jnp.zeros((), jnp.int32), params, tx.init(params), scale)


def init_state(
    model: Model, tx: optax.GradientTransformation, fp16: FP16Config | None, key: jax.Array
) -> TrainState:
    """A fresh state from a PRNG key; traced."""
    return fresh(model, tx, fp16, model.init(key))


class ResidentInit:
    """`init(key)` and `init_from_params(params)`: a fresh state, placed by `ctx.state_sharding`."""

    def __init__(self, ctx: ResidentContext):
        args = (ctx.model, ctx.tx, ctx.fp16)
        self._params_sharding = ctx.state_sharding.params
        self.init = jax.jit(partial(init_state, *args), out_shardings=ctx.state_sharding)
        self._start_from = jax.jit(partial(fresh, *args), out_shardings=ctx.state_sharding)

    def init_from_params(self, params: ModelParams) -> TrainState:
        """A fresh state from float32 host (NumPy) masters, or units `Deferred` until read."""
        return self._start_from(jax.device_put(resolved(params), self._params_sharding))


class FrozenPartInit:
    """`init(key)` and `init_from_params(params)` of a run with a frozen part: what trains at its
    start (`ctx.trains`, which builds the base first) and a fresh optimizer state over it, on its
    device."""

    def __init__(self, ctx: ResidentContext):
        self._trains = ctx.trains
        self._device = ctx.state_sharding.step
        self._opt_init = jax.jit(ctx.tx.init, out_shardings=ctx.state_sharding.opt_state)

    def init(self, key: jax.Array) -> TrainState:
        """A fresh state: what trains from `key` over the base the config names."""
        return self._state_of(self._trains.fresh(key))

    def init_from_params(self, params: ModelParams) -> TrainState:
        """A fresh state over a base from float32 host units (`Deferred` until read)."""
        return self._state_of(self._trains.fresh_from(params))

    def _state_of(self, trainable: ModelParams) -> TrainState:
        # Not through a jitted `fresh`: that would copy the trainable units, twice their memory at once.
        step = jax.device_put(np.int32(0), self._device)
        return TrainState(step, trainable, self._opt_init(trainable))


def apply_update(
    ctx: ResidentContext,
    state: TrainState,
    grads: ModelParams,
    loss: jax.Array,
    aux: jax.Array | None = None,
) -> tuple[TrainState, StepMetrics]:
    """The optimizer update of `state` by float32 mean gradients `grads` (optax, clipped by their
    global norm where `optimizer.grad_clip` > 0), and the step's metrics (`aux`: the mean auxiliary
    loss, or None); traced."""
    updates, opt_state = ctx.tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    lr = jnp.asarray(ctx.schedule(state.step), jnp.float32)
    metrics = StepMetrics(loss, global_norm(grads), lr, aux_loss=aux)
    return TrainState(state.step + 1, params, opt_state), metrics


def train_step(ctx: ResidentContext, state: TrainState, batch: jax.Array) -> tuple[TrainState, StepMetrics]:
    """One optimizer update over int32 (A, mb, S+1); traced."""
    loss, grads, aux = averaged_grads(ctx.model, state.params, batch, None, ctx.eot_id, ctx.padding)
    return apply_update(ctx, state, _split(ctx, grads), loss, aux)


def train_step_fp16(
    ctx: ResidentContext, state: TrainState, batch: jax.Array
) -> tuple[TrainState, StepMetrics]:
    """float16: a scaled loss; a step that overflows keeps params, optimizer state and step count;
    traced."""
    ls = state.loss_scale
    loss, grads, aux = averaged_grads(ctx.model, state.params, batch, ls.scale, ctx.eot_id, ctx.padding)
    grads = jax.tree.map(lambda g: g / ls.scale, _split(ctx, grads))
    ok = all_finite(grads)
    updates, opt_state = ctx.tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(ok, a, b), new, old)  # noqa: E731
    lr = jnp.asarray(ctx.schedule(state.step), jnp.float32)
    new = TrainState(
        state.step + ok.astype(jnp.int32),
        keep(params, state.params),
        keep(opt_state, state.opt_state),
        update_loss_scale(ls, ~ok, ctx.fp16),
    )
    metrics = StepMetrics(
        loss=loss, grad_norm=global_norm(grads), lr=lr, loss_scale=ls.scale, skipped=~ok, aux_loss=aux
    )
    return new, metrics


def _split(ctx: ResidentContext, grads: ModelParams) -> ModelParams:
    """Gradients constrained to their ZeRO sharding: from stage 2 a reduce-scatter, not an all-reduce."""
    return jax.lax.with_sharding_constraint(grads, ctx.grad_sharding)


def eval_loss(model: Model, eot_id: int | None, state: TrainState, window: jax.Array) -> jax.Array:
    """Mean loss (float32 scalar) of `state` over int32 (B, S+1), each document within itself where
    `eot_id` is an id (static); traced."""
    return loss_fn(model, state.params, window, eot_id=eot_id)


class ResidentStep:
    """`step(state, batch)`, one jitted update that donates the state, and `eval_loss(state, window)`.
    `fence`: where the step waits for a checkpoint being written from the state it donates."""

    def __init__(self, ctx: ResidentContext, fence: WriteFence):
        replicated = placement.replicated(ctx.mesh)
        self.fence = fence
        self._jitted = jax.jit(
            partial(train_step_fp16 if ctx.fp16 is not None else train_step, ctx),
            in_shardings=(ctx.state_sharding, placement.train_batch_sharding(ctx.mesh)),
            out_shardings=(ctx.state_sharding, replicated),
            donate_argnums=(0,),
        )
        self.eval_loss = jax.jit(
            partial(eval_loss, ctx.model, ctx.eot_id),
            in_shardings=(ctx.state_sharding, placement.eval_batch_sharding(ctx.mesh)),
            out_shardings=replicated,
        )

    def step(self, state: TrainState, batch: jax.Array) -> tuple[TrainState, StepMetrics]:
        """One optimizer update; consumes `state` (donated)."""
        self.fence.wait_all()  # the step donates every array a checkpoint being written may still read
        return self._jitted(state, batch)


class FrozenPartStep:
    """`step(state, batch)` and `eval_loss(state, window)` of a run with a frozen part: the
    gradients of what trains from `streamed` (the streamed schedule over the frozen base, one pass per
    micro-batch), then one jitted update (`apply_update`) that donates the state. `fence`: as
    `ResidentStep`'s."""

    def __init__(self, ctx: ResidentContext, fence: WriteFence, streamed: StreamedModel):
        trains, device = ctx.trains, ctx.state_sharding.step
        self.fence = fence
        self._trains, self._streamed = trains, streamed
        # One placement for every state, fresh or updated: the update compiles once.
        self._update = jax.jit(
            partial(apply_update, ctx), donate_argnums=(0,), out_shardings=(ctx.state_sharding, device)
        )
        self._one = jax.device_put(np.float32(1.0), device)  # the loss's cotangent: no loss scale
        self._segments = per_step(document_segments, ctx.eot_id)
        self._mask = per_step(real_tokens, ctx.padding)
        self._keys = trains.dropout_keys

    def step(self, state: TrainState, batch: jax.Array) -> tuple[TrainState, StepMetrics]:
        """One update from int32 (A, mb, S+1) on the accelerator; consumes `state` (donated)."""
        self.fence.wait_all()  # the update donates every array a checkpoint being written may still read
        keys = _no_keys if self._keys is None else partial(self._keys, state.step)
        loss, grads, aux = self._streamed.grads_per_micro_batch(
            self._trains.base_units(),
            batch,
            self._one,
            trainable=state.params,
            segments=self._segments,
            keys=keys,
            token_mask=self._mask,
        )
        return self._update(state, grads, loss, aux)

    def eval_loss(self, state: TrainState, window: jax.Array) -> jax.Array:
        """Mean loss (float32 scalar) over int32 (B, S+1), without dropout."""
        batch = window[None]
        return self._streamed.loss(self._trains.base_units(), batch, self._segments(batch), state.params)


def _no_keys(a: int) -> None:
    """No dropout: no keys."""
    return None


class ResidentCheckpoint:
    """The resident state to and from the saved form every trainer shares: the optimizer state per
    unit (the offload engine's layout), so a run saved by either trainer resumes under the other.
    A run with a frozen part saves what trains (its base is rebuilt from the config: `restored`,
    called once a state is restored, builds it)."""

    def __init__(self, ctx: ResidentContext):
        self.ctx = ctx
        self._clipped = ctx.cfg.optimizer.grad_clip > 0
        self._blocks = ctx.cfg.model.num_layers
        self._restored = _nothing if ctx.trains is None else ctx.trains.base_units

    def saved_state(self, state: TrainState) -> dict[str, Any]:
        """`state` (or its abstract form) as {"step", "params", "opt_state"[, "loss_scale"]}."""
        saved = {
            "step": state.step,
            "params": state.params,
            "opt_state": split_opt_state(state.opt_state, self._clipped, self._blocks),
        }
        return saved if state.loss_scale is None else {**saved, "loss_scale": state.loss_scale}

    def abstract_saved_state(self) -> dict[str, Any]:
        """The restore target: every array straight to its place on the accelerator."""
        return self.saved_state(abstract_placed(self.ctx.shapes, self.ctx.state_sharding))

    def from_saved_state(self, saved: dict[str, Any]) -> TrainState:
        """A state from a restored saved form (units may be `Deferred`: read now)."""
        saved = resolved(saved)  # every unit straight to its place on the accelerator
        opt_state = join_opt_state(saved["opt_state"], self.ctx.shapes.opt_state, self._clipped)
        state = TrainState(saved["step"], saved["params"], opt_state, saved.get("loss_scale"))
        self._restored()
        return state


def _nothing() -> None:
    pass


def build_resident_trainer(
    cfg: TrainConfig,
    mesh: Mesh,
    plan: OffloadPlan | None = None,
    *,
    model: Model | None = None,
    optimizer: optax.GradientTransformation | None = None,
    trains: FrozenTrains | None = None,
) -> Trainer:
    """Everything in accelerator memory; one jitted step per optimizer update. The ZeRO stage of
    `plan` (default `resolve_plan(cfg)`, which must keep every unit's state on the accelerator) says
    what is split over the `data` mesh axis (the module docstring). `model` and `optimizer`: the
    researcher's own, in place of `cfg.model`'s and `cfg.optimizer`'s (`build_resident_context`).
    `trains`: what trains beside a frozen base (`jaxzero.finetune.part.TrainableOverBase`), the
    base's blocks streamed from `pinned_host` where it says so; None: every parameter."""
    plan = resolve_plan(cfg) if plan is None else plan
    ctx = build_resident_context(cfg, mesh, plan, model=model, optimizer=optimizer, trains=trains)
    if trains is None:
        start, steps = ResidentInit(ctx), ResidentStep(ctx, WriteFence())
    else:  # the streamed schedule over the frozen base, what trains and its state on the accelerator
        where = OffloadPlacement(
            mesh, jax.local_devices(backend="cpu")[0], frozen_part_plan(plan, trains.streamed)
        )
        passes = StreamedModel(ctx.model, where, grad_accum=1, trains=trains.schedule)
        start, steps = FrozenPartInit(ctx), FrozenPartStep(ctx, WriteFence(), passes)
    saved = ResidentCheckpoint(ctx)
    return Trainer(
        config=cfg,
        plan=plan,
        model=ctx.model,
        mesh=mesh,
        optimizer=ctx.tx,
        init=start.init,
        init_from_params=start.init_from_params,
        step=steps.step,
        eval_loss=steps.eval_loss,
        put_batch=partial(placement.put_train_batch, mesh=mesh),
        put_eval_batch=partial(placement.put_eval_batch, mesh=mesh),
        layout="resident" if trains is None else trains.layout,
        saved_state=saved.saved_state,
        abstract_saved_state=saved.abstract_saved_state,
        from_saved_state=saved.from_saved_state,
        fence=steps.fence,
        description=None if trains is None else trains.description,
    )
