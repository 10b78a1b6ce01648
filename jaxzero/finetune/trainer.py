"""The LoRA trainer: adapters and their optimizer state on the accelerator, a frozen base beside them.

One step, per micro-batch (each its own forward and rematerialised backward pass):

    x = embed(tokens)                                   frozen embedding, on the accelerator
    for i in 0..L-1:  save x; x = block_i(base_i + adapters_i, x)       base_i streamed or resident
    loss, dx = head(x)                                  frozen head
    for i in L-1..0:  dx, g_i = vjp of block_i at its saved input, w.r.t. (adapters_i, x) only
    adapters, opt_state = optax update (global-norm clipping, the configured optimizer)

The gradient is taken with respect to the adapters and the activations only: the base's weight
gradients are never formed (6 x base params x tokens of work per step: forward, recomputation, input
gradients). Each block program is compiled once and serves every layer; a streamed base block is
copied one block ahead of the pass that needs it (`FrozenBase.blocks_in`).

The loss is the resident trainer's (`jaxzero.objective`: the mean cross-entropy over the step's
counted targets, micro-batches weighted by their targets). Dropout on the adapters' inputs takes a key
per step, micro-batch and block, the same in a block's forward pass and its recomputation.

A checkpoint holds what trains: the adapters, their optimizer state (one per unit, as every trainer
saves it) and the step; the base is rebuilt from the config (`model.init_from`, else `seed`).
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
from jaxzero.finetune.adapters import LORA_LAYOUT, adapter_shapes, init_adapters, lora_spec
from jaxzero.finetune.base import FrozenBase, narrow_block, narrow_unit
from jaxzero.models import ModelParams, build_model, init_keys
from jaxzero.models.lora import merge_trees
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


class LoraState(NamedTuple):
    """The LoRA trainer's state (a pytree on the accelerator).

    step:      int32 scalar, updates applied so far.
    adapters:  float32 `ModelParams` of the adapters (`jaxzero.finetune.adapters`).
    opt_state: the optax state of `Trainer.optimizer` over the adapters.
    """

    step: jax.Array
    adapters: ModelParams
    opt_state: Any


class LoraTrainer:
    """The programs and the frozen base of one LoRA run on one device; see the module docstring."""

    def __init__(self, cfg: TrainConfig, mesh: Mesh, streamed: bool, pinned_reserve: int = 0):
        if mesh.size != 1:
            raise ConfigError(
                f"finetune.method=lora trains on one device; the mesh has {mesh.size}. Run it on one "
                "GPU (CUDA_VISIBLE_DEVICES=0), or use finetune.method=full on several."
            )
        ft = cfg.finetune
        self.cfg = cfg
        self.model = dataclasses.replace(build_model(cfg.model), lora=lora_spec(ft))
        self.tx = build_optimizer(cfg.optimizer, cfg.schedule_steps)
        self.schedule = learning_rate_schedule(cfg.optimizer, cfg.schedule_steps)
        self.streamed = streamed
        device = mesh.devices.flat[0]
        self.device = SingleDeviceSharding(device, memory_kind=placement.DEVICE)
        self.home = (
            SingleDeviceSharding(device, memory_kind=placement.PINNED_HOST) if streamed else self.device
        )
        self.shapes = adapter_shapes(self.model, ft)
        self._clipped = cfg.optimizer.grad_clip > 0
        self._eot = document_eot(cfg.data, self.model)
        self._dropout = ft.lora_dropout > 0
        self._base: FrozenBase | None = None
        self._reserve = pinned_reserve if streamed else 0  # pinned pool grown once, before the base
        self.fence = WriteFence()  # a checkpoint being written from a state's arrays (`jaxzero.write_fence`)
        model, dtype = self.model, ft.base_dtype

        def block(w: Any, a: Any, x: jax.Array, seg: jax.Array | None, key: jax.Array) -> jax.Array:
            return model.block(merge_trees(w, a), x, seg, key if self._dropout else None)

        def block_vjp(w, a, x, seg, key, dy):
            _, pullback = jax.vjp(lambda a_, x_: block(w, a_, x_, seg, key), a, x)
            da, dx = pullback(dy)
            return dx, da

        def head(hw: Any, ew: Any, x: jax.Array, window: jax.Array, weight: jax.Array):
            return jax.value_and_grad(lambda x_: head_loss(model, hw, ew, x_, window, weight))(x)

        def update(adapters, opt_state, grads, step):
            updates, opt_state = self.tx.update(grads, opt_state, adapters)
            lr = jnp.asarray(self.schedule(step), jnp.float32)
            return optax.apply_updates(adapters, updates), opt_state, step + 1, global_norm(grads), lr

        self._embed = jax.jit(model.embed)
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
        self._init_block = jax.jit(
            lambda k: narrow_block(model.init_block(k), dtype), out_shardings=self.device
        )
        self._init_adapters = jax.jit(lambda k: init_adapters(k, model, ft), out_shardings=self.device)
        # Evaluation: no dropout, no gradient.
        self._eval_block = jax.jit(lambda w, a, x, seg: model.block(merge_trees(w, a), x, seg))
        self._eval_head = jax.jit(
            lambda hw, ew, x, window: head_loss(
                model, hw, ew, x, window, 1.0 / jnp.maximum(counted_targets(window), 1)
            )
        )

    # -- the base ---------------------------------------------------------------------------------

    def base(self) -> FrozenBase:
        """The frozen base, built from the config on first use (`model.init_from`, else `seed`)."""
        if self._base is None and self._reserve:
            reserve_pinned(self._reserve, self.home)  # the pool grows now, in one region
            self._reserve = 0
        if self._base is None:
            if self.cfg.model.init_from:
                from jaxzero.interop.hf_io import load_hf_by_unit  # the HF reader only where it is used

                self.set_base(load_hf_by_unit(self.cfg.model, self.cfg.model.init_from))
            else:
                self._base = self._fresh_base(jax.random.key(self.cfg.seed))
        return self._base

    def _fresh_base(self, key: jax.Array) -> FrozenBase:
        """The model's `init(key)` narrowed unit by unit (one float32 block at a time)."""
        k_embed, k_blocks, k_head = init_keys(key, self.cfg.model.num_layers)
        embed = self._narrow_unit(self.model.init_embed(k_embed))
        head = self._narrow_unit(self.model.init_head(k_head))
        blocks = tuple(self._placed(self._init_block(k)) for k in k_blocks)
        return FrozenBase(ModelParams(embed, blocks, head), self.streamed, self.device)

    def set_base(self, params: ModelParams) -> None:
        """The base from float32 units (NumPy or `Deferred`, read one at a time), narrowed."""
        if self._reserve:
            reserve_pinned(self._reserve, self.home)
            self._reserve = 0
        unit = lambda u: self._narrow_unit(jax.device_put(resolved(u), self.device))  # noqa: E731
        blocks = tuple(
            self._placed(self._narrow_block(jax.device_put(resolved(b), self.device))) for b in params.blocks
        )
        self._base = FrozenBase(
            ModelParams(unit(params.embed), blocks, unit(params.head)), self.streamed, self.device
        )

    def _placed(self, block: Any) -> Any:
        """A narrowed block in its home: the accelerator, or `pinned_host` (its accelerator copy freed)."""
        return block if not self.streamed else jax.device_put(block, self.home)

    # -- state ------------------------------------------------------------------------------------

    def init(self, key: jax.Array) -> LoraState:
        """Fresh adapters from `key` (the adapted model starts as the base) and their optimizer state.
        The base is the model's own init from `seed` (or `model.init_from`'s weights), whatever `key`
        is: a checkpoint holds no base, so every later reader rebuilds it from the config."""
        self.base()
        return self._fresh_state(key)

    def init_from_params(self, params: ModelParams) -> LoraState:
        """The base from float32 host units (a Hugging Face import: `Deferred` units), fresh adapters."""
        self.set_base(params)
        return self._fresh_state(jax.random.key(self.cfg.seed))

    def _fresh_state(self, key: jax.Array) -> LoraState:
        adapters = self._init_adapters(jax.random.fold_in(key, ADAPTER_KEY))
        step = jax.device_put(np.int32(0), self.device)
        return LoraState(step, adapters, jax.jit(self.tx.init, out_shardings=self.device)(adapters))

    # -- the step ---------------------------------------------------------------------------------

    def step(self, state: LoraState, batch: jax.Array) -> tuple[LoraState, StepMetrics]:
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
            x = self._embed(units.embed, decode_window(window)[0])
            # One stream of blocks for both passes: the last block turns from forward to backward
            # without a second copy, and the backward's first copies overlap the head.
            blocks = base.blocks_in([*range(n), *reversed(range(n))])
            saved = []
            for i in range(n):
                saved.append(x)
                x = self._block(next(blocks), state.adapters.blocks[i], x, segments, keys[i])
            part, dx = self._head(units.head, units.embed, x, window, weight)
            block_grads: list[Any] = [None] * n
            for i in reversed(range(n)):
                dx, block_grads[i] = self._block_vjp(
                    next(blocks), state.adapters.blocks[i], saved[i], segments, keys[i], dx
                )
                saved[i] = None  # the input is freed once its block's backward pass is issued
            g = ModelParams({}, tuple(block_grads), {})
            grads = g if grads is None else self._add(grads, g)
            loss = part if loss is None else loss + part
        adapters, opt_state, step, norm, lr = self._update(state.adapters, state.opt_state, grads, state.step)
        return LoraState(step, adapters, opt_state), StepMetrics(loss, norm, lr)

    def eval_loss(self, state: LoraState, window: jax.Array) -> jax.Array:
        """Mean loss (float32 scalar) of the adapted model over int32 (B, S+1), without dropout."""
        base = self.base()
        units = base.units
        x = self._embed(units.embed, decode_window(window)[0])
        segments = self._segments(window)
        for i, w in enumerate(base.blocks_in(range(len(units.blocks)))):
            x = self._eval_block(w, state.adapters.blocks[i], x, segments)
        return self._eval_head(units.head, units.embed, x, window)

    # -- checkpoints ------------------------------------------------------------------------------

    def saved_state(self, state: LoraState) -> dict[str, Any]:
        """{"step", "params": the adapters, "opt_state": one per unit} (or their abstract form)."""
        n = self.cfg.model.num_layers
        return {
            "step": state.step,
            "params": state.adapters,
            "opt_state": split_opt_state(state.opt_state, self._clipped, n),
        }

    def abstract_saved_state(self) -> dict[str, Any]:
        """The restore target: every array straight to the accelerator."""
        shardings = jax.tree.map(lambda _: self.device, self.shapes)
        adapters = abstract_placed(self.shapes, shardings)
        opt = jax.eval_shape(self.tx.init, self.shapes)
        opt = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=self.device), opt)
        step = jax.ShapeDtypeStruct((), jnp.int32, sharding=self.device)
        return self.saved_state(LoraState(step, adapters, opt))

    def from_saved_state(self, saved: dict[str, Any]) -> LoraState:
        """A state from a restored saved form; the base is rebuilt from the config if not built."""
        saved = resolved(saved)
        template = jax.eval_shape(self.tx.init, self.shapes)
        opt_state = join_opt_state(saved["opt_state"], template, self._clipped)
        self.base()
        return LoraState(saved["step"], saved["params"], opt_state)

    def describe(self) -> str:
        """One line: what trains and where the base lives."""
        ft = self.cfg.finetune
        where = "streamed from pinned host memory" if self.streamed else "on the accelerator"
        return (
            f"LoRA rank {ft.lora_rank} (alpha {ft.lora_alpha:g}) on {', '.join(ft.targets)}: adapters and "
            f"{self.cfg.optimizer.name} state on the accelerator; the frozen {ft.base_dtype} base {where}"
        )


def build_lora_trainer(cfg: TrainConfig, mesh: Mesh, plan: OffloadPlan, pinned_reserve: int = 0) -> Trainer:
    """The `Trainer` of a `finetune.method=lora` run whose placement is decided: the base streamed
    from `pinned_host` with `offload.params=cpu`, on the accelerator with `none`. `pinned_reserve`:
    bytes to grow the pinned pool by before the base is placed (`memory.pinned_pool_reservation`)."""
    lora = LoraTrainer(cfg, mesh, streamed=cfg.offload.params == "cpu", pinned_reserve=pinned_reserve)
    return Trainer(
        config=cfg,
        plan=plan,
        model=lora.model,
        mesh=mesh,
        optimizer=lora.tx,
        init=lora.init,
        init_from_params=lora.init_from_params,
        step=lora.step,
        eval_loss=lora.eval_loss,
        put_batch=lambda b: placement.put_train_batch(b, mesh),
        put_eval_batch=lambda b: placement.put_eval_batch(b, mesh),
        layout=LORA_LAYOUT,
        saved_state=lora.saved_state,
        abstract_saved_state=lora.abstract_saved_state,
        from_saved_state=lora.from_saved_state,
        description=lora.describe(),
        fence=lora.fence,
    )
