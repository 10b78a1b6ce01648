"""What trains in a run with a frozen part (`FinetuneConfig.partial`), as the engine builds from it:
`TrainableOverBase`, the engines' `jaxzero.offload.trains.FrozenTrains`.

The engine is the one a run that trains every unit gets (`jaxzero.resident`: its state, update and
checkpoint form over the trainable tree, `jaxzero.finetune.trainable`; the offload engine's streamed
schedule for the passes, `jaxzero.offload.streaming`). What is the run's own is here: the model with
its adapters, the trainable tree's starting values, the frozen base (`jaxzero.finetune.base`), the
adapters' dropout keys (a key per step, micro-batch and block, the same in a block's forward pass and
its recomputation).

A checkpoint holds what trains, its optimizer state and the step; the base is rebuilt from the config
(`model.init_from`, else `seed`).
"""

from __future__ import annotations

import dataclasses

import jax
from jax.sharding import Mesh, SingleDeviceSharding

from jaxzero.config import ConfigError, TrainConfig
from jaxzero.finetune.adapters import init_adapters, lora_spec
from jaxzero.finetune.base import BaseBuilder, FrozenBase, source_units
from jaxzero.finetune.trainable import layout_of, trainable_shapes
from jaxzero.models import ModelParams, build_model
from jaxzero.offload.trains import FrozenPart
from jaxzero.plan import placement

ADAPTER_KEY = 0x10A  # folded into the run's key for the adapters' init, so the base keeps the model's keys
DROPOUT_KEY = 0xD0  # folded into the run's key for the adapters' dropout


class TrainableOverBase:
    """What trains of `cfg`'s run with a frozen part, over its frozen base, on the first device of
    `mesh` (a `jaxzero.offload.trains.FrozenTrains`): the base's blocks in `pinned_host` with
    `offload.params=cpu` (copied in per use), on the accelerator with `none`. `pinned_reserve`: bytes
    to grow the pinned pool by before the base is placed (`memory.pinned_pool_reservation`).
    Allocates nothing and compiles nothing: the base is built on first use."""

    def __init__(self, cfg: TrainConfig, mesh: Mesh, pinned_reserve: int = 0):
        ft = cfg.finetune
        what = "finetune.method=lora" if ft.method == "lora" else "finetune.freeze"
        if mesh.size != 1:
            raise ConfigError(
                f"{what} trains on one device; the mesh has {mesh.size}. Run it on one GPU "
                "(CUDA_VISIBLE_DEVICES=0), or train every unit (finetune.method=full) on several."
            )
        self.cfg = cfg
        self.lora = ft.method == "lora"
        model = build_model(cfg.model)
        self.model = dataclasses.replace(model, lora=lora_spec(ft)) if self.lora else model
        self.streamed = cfg.offload.params == "cpu"
        device = mesh.devices.flat[0]
        self.device = SingleDeviceSharding(device, memory_kind=placement.DEVICE)
        home = (
            SingleDeviceSharding(device, memory_kind=placement.PINNED_HOST) if self.streamed else self.device
        )
        self.shapes = trainable_shapes(self.model, ft)
        self.layout = layout_of(ft)
        self._kept = ft.base_positions(cfg.model.num_layers)  # the units the base holds
        self._builder = BaseBuilder(
            self._kept,
            ft.base_dtype,
            device=self.device,
            home=home,
            streamed=self.streamed,
            pinned_reserve=pinned_reserve,
            keeps_trainable=not self.lora,
        )
        self._base: FrozenBase | None = None
        self._initial: ModelParams | None = None  # under freeze: the trainable units' starting values
        low = ft.lowest_trainable_block(cfg.model.num_layers)
        self.schedule = FrozenPart(lowest_block=low, embed=bool(self.shapes.embed), device=self.device)
        model, layers = self.model, cfg.model.num_layers

        def keys(step: jax.Array, a: int) -> jax.Array:
            """Micro-batch `a`'s dropout keys of `step`, (L, 1): block i's forward and its recomputation
            read row i."""
            key = jax.random.fold_in(jax.random.key(cfg.seed ^ DROPOUT_KEY), step)
            return jax.random.split(jax.random.fold_in(key, a), layers)[:, None]

        self.dropout_keys = jax.jit(keys) if self.lora and ft.lora_dropout > 0 else None
        self._init_adapters = jax.jit(lambda k: init_adapters(k, model, ft), out_shardings=self.device)
        self.description = self._describe()

    # -- the base ---------------------------------------------------------------------------------

    def base(self) -> FrozenBase:
        """The frozen base, built from the config on first use (`model.init_from`, else `seed`)."""
        if self._base is None:
            self._build(source_units(self.cfg, self.model), keep_initial=False)
        return self._base

    def base_units(self) -> ModelParams:
        """The frozen base's units in storage form (`base`)."""
        return self.base().units

    def _build(self, source: ModelParams, keep_initial: bool) -> None:
        """The base from float32 units (`BaseBuilder.build`); under `freeze`, with `keep_initial`,
        the units that train as the source has them, the starting point of a fresh state."""
        self._base = None  # an earlier base goes before this one is placed
        self._base, initial = self._builder.build(source, keep_initial)
        if initial is not None:
            self._initial = initial

    # -- what trains at its start -----------------------------------------------------------------

    def fresh(self, key: jax.Array) -> ModelParams:
        """LoRA adapters from `key` (the adapted model starts as the base), or the units that train
        as the model starts them. The base (and a freeze's starting units) is the model's own init
        from `seed` (or `model.init_from`'s weights), whatever `key` is: a checkpoint holds no base,
        so every later reader rebuilds it from the config."""
        self._build(source_units(self.cfg, self.model), keep_initial=True)
        return self._starting(key)

    def fresh_from(self, params: ModelParams) -> ModelParams:
        """The base (and a freeze's starting units) from float32 host units (a Hugging Face import:
        `Deferred` units), fresh adapters from `seed`."""
        self._build(params, keep_initial=True)
        return self._starting(jax.random.key(self.cfg.seed))

    def _starting(self, key: jax.Array) -> ModelParams:
        if self.lora:
            return self._init_adapters(jax.random.fold_in(key, ADAPTER_KEY))
        trainable, self._initial = self._initial, None  # the state owns them now
        return trainable

    def _describe(self) -> str:
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
