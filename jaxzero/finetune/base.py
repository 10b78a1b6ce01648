"""The frozen base of a LoRA run: every unit in its storage dtype, resident or streamed per use.

A base unit is the model's unit with its weights narrowed once (`finetune.base_dtype`):

    bfloat16 / float32   every leaf in that dtype
    int8                 each block's projection kernels int8 (in, out) with a float32 "kernel_scale"
                         (out,) beside them (`jaxzero.models.lora`), weight-only, per output channel;
                         norm scales (and biases) bfloat16; embedding and head bfloat16

Blocks live in accelerator memory (`resident`) or in `pinned_host` memory, copied to the accelerator
one block ahead of the pass that needs it by the streamed schedule every engine shares
(`jaxzero.offload.streaming`); the embedding and head always stay on the accelerator. The base holds
no masters, no optimizer state and sends no gradients anywhere.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any

import jax
from jax.sharding import Sharding

from jaxzero.config import TrainConfig
from jaxzero.models import Model, ModelParams, init_keys
from jaxzero.models.lora import quantize_kernel, storage_dtype
from jaxzero.offload.host_memory import reserve_pinned
from jaxzero.primitives.deferred import Deferred, resolved

KERNEL = "kernel"


def narrow_block(block: Any, base_dtype: str) -> Any:
    """One block's float32 weights in storage form (the module docstring); traced."""
    dtype = storage_dtype(base_dtype)

    def walk(tree: Any) -> Any:
        out = {}
        for name, value in tree.items():
            if isinstance(value, dict):
                out[name] = walk(value)
            elif name == KERNEL and base_dtype == "int8":
                out[name], out["kernel_scale"] = quantize_kernel(value)
            else:
                out[name] = value.astype(dtype)
        return out

    return walk(block)


def narrow_unit(unit: Any, base_dtype: str) -> Any:
    """The embedding or head in storage form (never quantised); traced."""
    return jax.tree.map(lambda x: x.astype(storage_dtype(base_dtype)), unit)


def source_units(cfg: TrainConfig, model: Model) -> ModelParams:
    """The model's float32 units before narrowing, as the config names them, each a `Deferred` read
    (or drawn) when resolved: `model.init_from`'s weights, else the model's own init from `seed` (so a
    base rebuilt from a checkpoint's config is the one that trained)."""
    if cfg.model.init_from:
        from jaxzero.interop.exports import load_by_unit  # the export's reader only where it is used

        return load_by_unit(cfg.model, cfg.model.init_from)
    k_embed, k_blocks, k_head = init_keys(jax.random.key(cfg.seed), cfg.model.num_layers)

    def drawn(init: Any, key: jax.Array) -> Deferred:
        return Deferred(partial(_one, init, key), 0, None)

    blocks = tuple(drawn(model.init_block, k) for k in k_blocks)
    return ModelParams(drawn(model.init_embed, k_embed), blocks, drawn(model.init_head, k_head))


def _one(init: Any, key: jax.Array) -> tuple[Any]:
    """`init(key)` as a `Deferred`'s read: a one-item tuple."""
    return (init(key),)


@dataclass(frozen=True)
class FrozenBase:
    """A base in storage form: `units` (embedding and head on the accelerator; blocks on the
    accelerator or in `pinned_host`, copied in per use by the streamed schedule's prefetch,
    `jaxzero.offload.streaming.stream_blocks`), and whether its blocks are streamed."""

    units: ModelParams
    streamed: bool


class BaseBuilder:
    """Builds the frozen base of a run on one device, from float32 units, one unit at a time.

    kept:           the units the base holds (embedding 0, block i at 1 + i, head L + 1).
    base_dtype:     `finetune.base_dtype` (the storage form, the module docstring).
    device:         the accelerator's memory; `home`: where a narrowed block lives (the accelerator,
                    or `pinned_host` where `streamed`).
    pinned_reserve: bytes to grow the pinned pool by, once, before the first base is placed.
    keeps_trainable: whether the units that train start from the source's (`finetune.freeze`), so
                    that a fresh state takes them as they are.
    """

    def __init__(
        self,
        kept: frozenset[int],
        base_dtype: str,
        *,
        device: Sharding,
        home: Sharding,
        streamed: bool,
        pinned_reserve: int,
        keeps_trainable: bool,
    ):
        self.kept, self.device, self.home, self.streamed = kept, device, home, streamed
        self._reserve = pinned_reserve if streamed else 0
        self._keeps_trainable = keeps_trainable
        self._narrow_block = jax.jit(partial(narrow_block, base_dtype=base_dtype), out_shardings=device)
        self._narrow_unit = jax.jit(partial(narrow_unit, base_dtype=base_dtype), out_shardings=device)

    def build(self, source: ModelParams, keep_initial: bool) -> tuple[FrozenBase, ModelParams | None]:
        """The base from float32 units (NumPy, arrays or `Deferred`, read one at a time): each unit it
        keeps narrowed and placed; with `keep_initial` and `keeps_trainable`, also the units that
        train as they are, on the accelerator (the starting point of a fresh state), else None."""
        if self._reserve:
            reserve_pinned(self._reserve, self.home)  # the pool grows now, in one region
            self._reserve = 0
        initial_too = keep_initial and self._keeps_trainable
        units = source.units()
        last = len(units) - 1
        stored, initial = [], []
        for k, u in enumerate(units):
            kept = k in self.kept
            if not kept and not initial_too:
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
        base = FrozenBase(ModelParams.from_units(stored), self.streamed)
        return base, ModelParams.from_units(initial) if initial_too else None

    def _placed(self, block: Any) -> Any:
        """A narrowed block in its home: the accelerator, or `pinned_host` (its accelerator copy freed)."""
        return block if not self.streamed else jax.device_put(block, self.home)
