"""The trainer of a run with a frozen part: LoRA adapters over a frozen base (`finetune.method=lora`),
or the units `finetune.freeze` leaves trainable. What trains, with its optimizer state, lives on the
accelerator; the frozen units (the base) beside it, resident or streamed (`jaxzero.finetune.base`).

One step, per micro-batch (each its own forward and rematerialised backward pass); every unit is
`merge_trees(base unit, trainable unit)` (`jaxzero.finetune.trainable`):

    x = embed(tokens)
    for i in 0..L-1:  save x; x = block_i(base_i + trainable_i, x)      base_i streamed or resident
    loss, dx = head(x)                    and the head's (and a tied embedding's) trainable gradient
    for i in L-1..lowest:  dx, g_i = vjp of block_i at its saved input, w.r.t. (trainable_i, x)
    embedding's gradient where it trains
    trainable, opt_state = optax update (global-norm clipping, the configured optimizer)

Gradients are taken with respect to what trains and the activations only: a frozen unit's weight
gradient is never formed, and below the lowest unit that trains no backward pass runs at all. Each
block program is compiled once and serves every layer; a streamed base block is copied one block
ahead of the pass that needs it (`FrozenBase.blocks_in`).

The loss is the resident trainer's (`jaxzero.objective`: the mean cross-entropy over the step's
counted targets, micro-batches weighted by their targets). Dropout on the adapters' inputs takes a key
per step, micro-batch and block, the same in a block's forward pass and its recomputation.

A checkpoint holds what trains, its optimizer state (one per unit, as every trainer saves it) and the
step; the base is rebuilt from the config (`model.init_from`, else `seed`).
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, SingleDeviceSharding

from jaxzero import placement
from jaxzero.config import ConfigError, TrainConfig
from jaxzero.deferred import resolved
from jaxzero.finetune.adapters import init_adapters, lora_spec
from jaxzero.finetune.base import FrozenBase, narrow_block, narrow_unit, source_units
from jaxzero.finetune.trainable import base_positions, layout_of, lowest_trainable_block, trainable_shapes
from jaxzero.models import ModelParams, build_model
from jaxzero.models.lora import merge_trees
from jaxzero.models.sizes import ties_output
from jaxzero.objective import (
    counted_targets,
    decode_window,
    document_eot,
    document_segments,
    head_loss,
    step_weight,
)
from jaxzero.offload.host_memory import reserve_pinned
from jaxzero.optim import (
    build_optimizer,
    global_norm,
    join_opt_state,
    learning_rate_schedule,
    split_opt_state,
)
from jaxzero.plan import OffloadPlan
from jaxzero.state import StepMetrics, Trainer, abstract_placed
from jaxzero.write_fence import WriteFence

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

    def __init__(self, cfg: TrainConfig, mesh: Mesh, streamed: bool, pinned_reserve: int = 0):
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
        self._kept = base_positions(ft, cfg.model)  # the units the base holds
        self._lowest = lowest_trainable_block(ft, cfg.model)
        self._embed_trains = bool(self.shapes.embed)
        # The head reads the embedding only when tied (gpt2 always is): only then does it send it a
        # gradient (else a zero (V, D) float32 array would be made and added).
        self._head_reads_embed = ties_output(cfg.model)
        self._clipped = cfg.optimizer.grad_clip > 0
        self._eot = document_eot(cfg.data, self.model)
        self._dropout = self.lora and ft.lora_dropout > 0
        self._base: FrozenBase | None = None
        self._initial: ModelParams | None = None  # under freeze: the trainable units' starting values
        self._reserve = pinned_reserve if streamed else 0  # pinned pool grown once, before the base
        self.fence = WriteFence()  # a checkpoint being written from a state's arrays (`jaxzero.write_fence`)
        model, dtype = self.model, ft.base_dtype

        def block(w: Any, a: Any, x: jax.Array, seg: jax.Array | None, key: jax.Array) -> jax.Array:
            if self._dropout:  # only LoRA's blocks take a dropout key
                return model.block(merge_trees(w, a), x, seg, key)
            return model.block(merge_trees(w, a), x, seg)

        def block_vjp(w, a, x, seg, key, dy):
            _, pullback = jax.vjp(lambda a_, x_: block(w, a_, x_, seg, key), a, x)
            da, dx = pullback(dy)
            return dx, da

        def head(hw: Any, th: Any, ew: Any, te: Any, x: jax.Array, window: jax.Array, weight: jax.Array):
            def loss(th_, te_, x_):
                return head_loss(model, merge_trees(hw, th_), merge_trees(ew, te_), x_, window, weight)

            return jax.value_and_grad(loss, argnums=(0, 1, 2))(th, te, x)

        def embed(ew: Any, te: Any, inputs: jax.Array) -> jax.Array:
            return model.embed(merge_trees(ew, te), inputs)

        def embed_vjp(ew: Any, te: Any, inputs: jax.Array, dx: jax.Array) -> Any:
            return jax.vjp(lambda te_: embed(ew, te_, inputs), te)[1](dx)[0]

        def update(adapters, opt_state, grads, step):
            updates, opt_state = self.tx.update(grads, opt_state, adapters)
            lr = jnp.asarray(self.schedule(step), jnp.float32)
            return optax.apply_updates(adapters, updates), opt_state, step + 1, global_norm(grads), lr

        self._embed = jax.jit(embed)
        self._embed_vjp = jax.jit(embed_vjp)
        self._block = jax.jit(block)
        self._block_vjp = jax.jit(block_vjp)
        self._head = jax.jit(head)
        # One placement for every state, fresh or updated: the update compiles once.
        self._update = jax.jit(update, donate_argnums=(0, 1, 3), out_shardings=self.device)
        self._add = jax.jit(lambda a, b: jax.tree.map(jnp.add, a, b), donate_argnums=(0,))
        self._segments = jax.jit(lambda w: None if self._eot is None else document_segments(w, self._eot))
        self._weight = jax.jit(lambda b: step_weight(b) / b.shape[0])
        self._narrow_block = jax.jit(partial(narrow_block, base_dtype=dtype), out_shardings=self.device)
        self._narrow_unit = jax.jit(partial(narrow_unit, base_dtype=dtype), out_shardings=self.device)
        self._init_adapters = jax.jit(lambda k: init_adapters(k, model, ft), out_shardings=self.device)
        # Evaluation: no dropout, no gradient.
        self._eval_block = jax.jit(lambda w, a, x, seg: model.block(merge_trees(w, a), x, seg))
        self._eval_head = jax.jit(
            lambda hw, th, ew, te, x, window: head_loss(
                model,
                merge_trees(hw, th),
                merge_trees(ew, te),
                x,
                window,
                1.0 / jnp.maximum(counted_targets(window), 1),
            )
        )

    # -- the base ---------------------------------------------------------------------------------

    def base(self) -> FrozenBase:
        """The frozen base, built from the config on first use (`model.init_from`, else `seed`)."""
        if self._base is None:
            self._build(source_units(self.cfg, self.model), keep_initial=False)
        return self._base

    def _build(self, source: ModelParams, keep_initial: bool) -> None:
        """The base from float32 units (NumPy, arrays or `Deferred`, read one at a time): each unit it
        keeps narrowed and placed; under `freeze`, with `keep_initial`, the units that train kept as
        they are, on the accelerator, as the starting point of a fresh state."""
        self._base = None  # an earlier base goes before this one is placed
        if self._reserve:
            reserve_pinned(self._reserve, self.home)  # the pool grows now, in one region
            self._reserve = 0
        units = source.units()
        last = len(units) - 1
        stored, initial = [], []
        for k, u in enumerate(units):
            kept = k in self._kept
            if not kept and not (keep_initial and not self.lora):
                stored.append({})
                initial.append({})
                continue
            on_device = jax.device_put(resolved(u), self.device)
            if not kept:
                stored.append({})
                initial.append(on_device)
            elif 0 < k < last:
                stored.append(self._placed(self._narrow_block(on_device)))
                initial.append({})
            else:
                stored.append(self._narrow_unit(on_device))
                initial.append({})
            del on_device
        self._base = FrozenBase(ModelParams.from_units(stored), self.streamed, self.device)
        if keep_initial and not self.lora:
            self._initial = ModelParams.from_units(initial)

    def _placed(self, block: Any) -> Any:
        """A narrowed block in its home: the accelerator, or `pinned_host` (its accelerator copy freed)."""
        return block if not self.streamed else jax.device_put(block, self.home)

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
        """One update from int32 (A, mb, S+1) on the accelerator; consumes `state` (donated)."""
        self.fence.wait_all()  # the update donates every array a checkpoint being written may still read
        base = self.base()
        units = base.units
        n = len(units.blocks)
        weight = self._weight(batch)
        key = jax.random.fold_in(jax.random.key(self.cfg.seed ^ DROPOUT_KEY), state.step)
        grads, loss = None, None
        for a in range(batch.shape[0]):
            window = batch[a]
            segments = self._segments(window)
            keys = jax.random.split(jax.random.fold_in(key, a), n)
            inputs = decode_window(window)[0]
            tr = state.trainable
            x = self._embed(units.embed, tr.embed, inputs)
            # One stream of blocks for both passes: the last block turns from forward to backward
            # without a second copy, and the backward's first copies overlap the head. Below the
            # lowest block that matters nothing trains: no input is saved there, no backward runs.
            low = self._lowest
            blocks = base.blocks_in([*range(n), *range(n - 1, low - 1, -1)])
            saved: list[Any] = []
            for i in range(n):
                saved.append(x if i >= low else None)
                x = self._block(next(blocks), tr.blocks[i], x, segments, keys[i])
            te = tr.embed if self._head_reads_embed else {}
            part, (g_head, g_embed, dx) = self._head(units.head, tr.head, units.embed, te, x, window, weight)

            block_grads: list[Any] = [{}] * low + [None] * (n - low)  # nothing trains below `low`
            for i in reversed(range(low, n)):
                dx, block_grads[i] = self._block_vjp(
                    next(blocks), tr.blocks[i], saved[i], segments, keys[i], dx
                )
                saved[i] = None  # the input is freed once its block's backward pass is issued
            if self._embed_trains:
                g_lookup = self._embed_vjp(units.embed, tr.embed, inputs, dx)
                g_embed = self._add(g_lookup, g_embed) if self._head_reads_embed else g_lookup
            g = ModelParams(g_embed, tuple(block_grads), g_head)
            grads = g if grads is None else self._add(grads, g)
            loss = part if loss is None else loss + part
        adapters, opt_state, step, norm, lr = self._update(
            state.trainable, state.opt_state, grads, state.step
        )
        return PartialState(step, adapters, opt_state), StepMetrics(loss, norm, lr)

    def eval_loss(self, state: PartialState, window: jax.Array) -> jax.Array:
        """Mean loss (float32 scalar) of the adapted model over int32 (B, S+1), without dropout."""
        base = self.base()
        units = base.units
        tr = state.trainable
        x = self._embed(units.embed, tr.embed, decode_window(window)[0])
        segments = self._segments(window)
        for i, w in enumerate(base.blocks_in(range(len(units.blocks)))):
            x = self._eval_block(w, tr.blocks[i], x, segments)
        return self._eval_head(units.head, tr.head, units.embed, tr.embed, x, window)

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
    built = PartialTrainer(cfg, mesh, streamed=cfg.offload.params == "cpu", pinned_reserve=pinned_reserve)
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
