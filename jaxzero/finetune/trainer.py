"""The trainer of a run with a frozen part: LoRA adapters over a frozen base (`finetune.method=lora`),
or the units `finetune.freeze` leaves trainable. What trains, with its optimizer state, lives on the
accelerator; the frozen units (the base) beside it, resident or streamed (`jaxzero.finetune.base`).

The passes are the offload engine's streamed schedule (`jaxzero.offload.streaming.StreamedModel`)
over a `FrozenPart` (`jaxzero.offload.trains`): every unit is the pair (base unit, trainable unit),
merged in each block program; gradients are taken with respect to what trains and the activations
only, and below the lowest block that trains no backward pass runs. A streamed base block is
copied one block ahead of the pass that needs it by the schedule's prefetch. One step:

    for each micro-batch a:  loss_a, grads_a = one pass of the schedule (its own forward and
                             rematerialised backward, so one micro-batch's activations live)
    grads = sum of grads_a;  trainable, opt_state = optax update (global-norm clipping)

The loss is the resident trainer's (`jaxzero.numerics.objective`: the mean cross-entropy over the step's
counted targets, micro-batches weighted by their targets). Dropout on the adapters' inputs takes a key
per step, micro-batch and block, the same in a block's forward pass and its recomputation.

A checkpoint holds what trains, its optimizer state (one per unit, as every trainer saves it) and the
step; the base is rebuilt from the config (`model.init_from`, else `seed`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, SingleDeviceSharding

from jaxzero.config import ConfigError, TrainConfig
from jaxzero.finetune.adapters import init_adapters, lora_spec
from jaxzero.finetune.base import BaseBuilder, FrozenBase, source_units
from jaxzero.finetune.trainable import layout_of, trainable_shapes
from jaxzero.models import ModelParams, build_model
from jaxzero.numerics.objective import document_eot, document_segments, step_weight
from jaxzero.numerics.optim import (
    build_optimizer,
    global_norm,
    join_opt_state,
    learning_rate_schedule,
    split_opt_state,
)
from jaxzero.offload.streaming import StreamedModel
from jaxzero.offload.trains import FrozenPart
from jaxzero.plan import OffloadPlan, Tier, UnitKind, placement
from jaxzero.plan.placement import OffloadPlacement
from jaxzero.primitives.deferred import resolved
from jaxzero.primitives.write_fence import WriteFence
from jaxzero.state import StepMetrics, Trainer, abstract_placed

ADAPTER_KEY = 0x10A  # folded into the run's key for the adapters' init, so the base keeps the model's keys
DROPOUT_KEY = 0xD0  # folded into the run's key for the adapters' dropout


class PartialState(NamedTuple):
    """The state of a run with a frozen part (a pytree on the accelerator).

    step:      int32 scalar, updates applied so far.
    trainable: float32 `ModelParams` of what trains (`jaxzero.finetune.trainable`): LoRA adapters, or
               the units `finetune.freeze` leaves, `{}` elsewhere.
    opt_state: the optax state of `Trainer.optimizer` over them.
    """

    step: jax.Array
    trainable: ModelParams
    opt_state: Any


class PartialTrainer:
    """The programs and the frozen base of one run with a frozen part, on one device; see the module
    docstring."""

    def __init__(
        self, cfg: TrainConfig, mesh: Mesh, plan: OffloadPlan, streamed: bool, pinned_reserve: int = 0
    ):
        what = "finetune.method=lora" if cfg.finetune.method == "lora" else "finetune.freeze"
        if mesh.size != 1:
            raise ConfigError(
                f"{what} trains on one device; the mesh has {mesh.size}. Run it on one GPU "
                "(CUDA_VISIBLE_DEVICES=0), or train every unit (finetune.method=full) on several."
            )
        ft = cfg.finetune
        self.cfg = cfg
        self.lora = ft.method == "lora"
        model = build_model(cfg.model)
        self.model = dataclasses.replace(model, lora=lora_spec(ft)) if self.lora else model
        self.tx = build_optimizer(cfg.optimizer, cfg.schedule_steps)
        self.schedule = learning_rate_schedule(cfg.optimizer, cfg.schedule_steps)
        self.streamed = streamed
        device = mesh.devices.flat[0]
        self.device = SingleDeviceSharding(device, memory_kind=placement.DEVICE)
        self.home = (
            SingleDeviceSharding(device, memory_kind=placement.PINNED_HOST) if streamed else self.device
        )
        self.shapes = trainable_shapes(self.model, ft)
        self.layout = layout_of(ft)
        self._kept = ft.base_positions(cfg.model.num_layers)  # the units the base holds
        self._builder = BaseBuilder(
            self._kept,
            ft.base_dtype,
            device=self.device,
            home=self.home,
            streamed=streamed,
            pinned_reserve=pinned_reserve,
            keeps_trainable=not self.lora,
        )
        self._clipped = cfg.optimizer.grad_clip > 0
        self._eot = document_eot(cfg.data, self.model)
        self._dropout = self.lora and ft.lora_dropout > 0
        self._base: FrozenBase | None = None
        self._initial: ModelParams | None = None  # under freeze: the trainable units' starting values
        self.fence = WriteFence()  # a checkpoint being written from a state's arrays
        model = self.model
        # The one streamed schedule of every engine, over what trains: the base's blocks prefetched
        # from pinned_host (or resident), each merged with its trainable part in the block programs.
        low = ft.lowest_trainable_block(cfg.model.num_layers)
        trains = FrozenPart(lowest_block=low, embed=bool(self.shapes.embed), device=self.device)
        where = OffloadPlacement(mesh, jax.local_devices(backend="cpu")[0], schedule_plan(plan, streamed))
        self._streamed = StreamedModel(model, where, grad_accum=1, trains=trains)
        self._one = jax.device_put(np.float32(1.0), self.device)  # the loss's cotangent: no loss scale

        def update(adapters, opt_state, grads, step):
            updates, opt_state = self.tx.update(grads, opt_state, adapters)
            lr = jnp.asarray(self.schedule(step), jnp.float32)
            return optax.apply_updates(adapters, updates), opt_state, step + 1, global_norm(grads), lr

        def keys(step: jax.Array, a: int) -> jax.Array:
            """Micro-batch `a`'s dropout keys of `step`, (L, 1): block i's forward and its recomputation
            read row i."""
            key = jax.random.fold_in(jax.random.key(cfg.seed ^ DROPOUT_KEY), step)
            return jax.random.split(jax.random.fold_in(key, a), cfg.model.num_layers)[:, None]

        # One placement for every state, fresh or updated: the update compiles once.
        self._update = jax.jit(update, donate_argnums=(0, 1, 3), out_shardings=self.device)
        self._keys = jax.jit(keys) if self._dropout else None
        self._add = jax.jit(lambda a, b: jax.tree.map(jnp.add, a, b), donate_argnums=(0,))
        self._segments = jax.jit(lambda w: None if self._eot is None else document_segments(w, self._eot))
        self._weight = jax.jit(lambda b: step_weight(b) / b.shape[0])
        self._init_adapters = jax.jit(lambda k: init_adapters(k, model, ft), out_shardings=self.device)

    # -- the base ---------------------------------------------------------------------------------

    def base(self) -> FrozenBase:
        """The frozen base, built from the config on first use (`model.init_from`, else `seed`)."""
        if self._base is None:
            self._build(source_units(self.cfg, self.model), keep_initial=False)
        return self._base

    def _build(self, source: ModelParams, keep_initial: bool) -> None:
        """The base from float32 units (`BaseBuilder.build`); under `freeze`, with `keep_initial`,
        the units that train as the source has them, the starting point of a fresh state."""
        self._base = None  # an earlier base goes before this one is placed
        self._base, initial = self._builder.build(source, keep_initial)
        if initial is not None:
            self._initial = initial

    # -- state ------------------------------------------------------------------------------------

    def init(self, key: jax.Array) -> PartialState:
        """A fresh state: LoRA adapters from `key` (the adapted model starts as the base), or the units
        that train as the model starts them; and their optimizer state. The base (and a freeze's
        starting units) is the model's own init from `seed` (or `model.init_from`'s weights),
        whatever `key` is: a checkpoint holds no base, so every later reader rebuilds it from the
        config."""
        self._build(source_units(self.cfg, self.model), keep_initial=True)
        return self._fresh_state(key)

    def init_from_params(self, params: ModelParams) -> PartialState:
        """The base (and a freeze's starting units) from float32 host units (a Hugging Face import:
        `Deferred` units), fresh adapters from `seed`."""
        self._build(params, keep_initial=True)
        return self._fresh_state(jax.random.key(self.cfg.seed))

    def _fresh_state(self, key: jax.Array) -> PartialState:
        if self.lora:
            trainable = self._init_adapters(jax.random.fold_in(key, ADAPTER_KEY))
        else:
            trainable, self._initial = self._initial, None  # the state owns them now
        step = jax.device_put(np.int32(0), self.device)
        return PartialState(step, trainable, jax.jit(self.tx.init, out_shardings=self.device)(trainable))

    # -- the step ---------------------------------------------------------------------------------

    def step(self, state: PartialState, batch: jax.Array) -> tuple[PartialState, StepMetrics]:
        """One update from int32 (A, mb, S+1) on the accelerator; consumes `state` (donated). Each
        micro-batch is its own pass of the streamed schedule (a streamed base crosses the link twice
        per micro-batch, and only one micro-batch's activations live), its gradients summed here."""
        self.fence.wait_all()  # the update donates every array a checkpoint being written may still read
        base = self.base().units
        weight = self._weight(batch)
        grads, loss = None, None
        for a in range(batch.shape[0]):
            window = batch[a : a + 1]
            part, g, _ = self._streamed.grads(
                base,
                window,
                self._one,
                segments=self._segments(window),
                trainable=state.trainable,
                keys=None if self._keys is None else self._keys(state.step, a),
                weight=weight,
            )
            grads = g if grads is None else self._add(grads, g)
            loss = part if loss is None else loss + part
        adapters, opt_state, step, norm, lr = self._update(
            state.trainable, state.opt_state, grads, state.step
        )
        return PartialState(step, adapters, opt_state), StepMetrics(loss, norm, lr)

    def eval_loss(self, state: PartialState, window: jax.Array) -> jax.Array:
        """Mean loss (float32 scalar) of the adapted model over int32 (B, S+1), without dropout."""
        batch = window[None]
        return self._streamed.loss(self.base().units, batch, self._segments(batch), state.trainable)

    # -- checkpoints ------------------------------------------------------------------------------

    def saved_state(self, state: PartialState) -> dict[str, Any]:
        """{"step", "params": the adapters, "opt_state": one per unit} (or their abstract form)."""
        n = self.cfg.model.num_layers
        return {
            "step": state.step,
            "params": state.trainable,
            "opt_state": split_opt_state(state.opt_state, self._clipped, n),
        }

    def abstract_saved_state(self) -> dict[str, Any]:
        """The restore target: every array straight to the accelerator."""
        shardings = jax.tree.map(lambda _: self.device, self.shapes)
        adapters = abstract_placed(self.shapes, shardings)
        opt = jax.eval_shape(self.tx.init, self.shapes)
        opt = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=self.device), opt)
        step = jax.ShapeDtypeStruct((), jnp.int32, sharding=self.device)
        return self.saved_state(PartialState(step, adapters, opt))

    def from_saved_state(self, saved: dict[str, Any]) -> PartialState:
        """A state from a restored saved form; the base is rebuilt from the config if not built."""
        saved = resolved(saved)
        template = jax.eval_shape(self.tx.init, self.shapes)
        opt_state = join_opt_state(saved["opt_state"], template, self._clipped)
        self.base()
        return PartialState(saved["step"], saved["params"], opt_state)

    def describe(self) -> str:
        """One line: what trains and where the base lives."""
        ft = self.cfg.finetune
        where = "streamed from pinned host memory" if self.streamed else "on the accelerator"
        if self.lora:
            what = f"LoRA rank {ft.lora_rank} (alpha {ft.lora_alpha:g}) on {', '.join(ft.targets)}"
            opt = self.cfg.optimizer.name
            return f"{what}: adapters and {opt} state on the accelerator; the {ft.base_dtype} base {where}"
        units = self.cfg.model.num_layers + 2
        return (
            f"{units - len(self._kept)} of {units} units train (float32 masters and "
            f"{self.cfg.optimizer.name} state on the accelerator); {len(self._kept)} frozen ({ft.freeze}) "
            f"in {ft.base_dtype}, {where}"
        )


def build_partial_trainer(
    cfg: TrainConfig, mesh: Mesh, plan: OffloadPlan, pinned_reserve: int = 0
) -> Trainer:
    """The `Trainer` of a run with a frozen part (`FinetuneConfig.partial`) whose placement is decided:
    the base's blocks streamed from `pinned_host` with `offload.params=cpu`, on the accelerator with
    `none`. `pinned_reserve`: bytes to grow the pinned pool by before the base is placed
    (`memory.pinned_pool_reservation`)."""
    streamed = cfg.offload.params == "cpu"
    built = PartialTrainer(cfg, mesh, plan, streamed=streamed, pinned_reserve=pinned_reserve)
    return Trainer(
        config=cfg,
        plan=plan,
        model=built.model,
        mesh=mesh,
        optimizer=built.tx,
        init=built.init,
        init_from_params=built.init_from_params,
        step=built.step,
        eval_loss=built.eval_loss,
        put_batch=lambda b: placement.put_train_batch(b, mesh),
        put_eval_batch=lambda b: placement.put_eval_batch(b, mesh),
        layout=built.layout,
        saved_state=built.saved_state,
        abstract_saved_state=built.abstract_saved_state,
        from_saved_state=built.from_saved_state,
        description=built.describe(),
        fence=built.fence,
    )


def schedule_plan(plan: OffloadPlan, streamed: bool) -> OffloadPlan:
    """The decided plan of a run with a frozen part as the streamed schedule reads it: what trains
    and its optimizer state on the accelerator (`Tier.DEVICE` state, so its gradients stay there),
    the base's blocks in `pinned_host` where the base is streamed, and block inputs on the
    accelerator."""
    weights = Tier.PINNED_HOST if streamed else Tier.DEVICE
    units = tuple(
        dataclasses.replace(u, weights=weights if u.kind is UnitKind.BLOCK else u.weights, state=Tier.DEVICE)
        for u in plan.units
    )
    return dataclasses.replace(plan, units=units, activations=Tier.DEVICE)
