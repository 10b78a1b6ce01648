"""The model of a run with a frozen part as plain float32 weights: the frozen units as they were
trained (narrowed, then widened back), with LoRA's adapters merged in (kernel + (alpha / r) *
lora_a @ lora_b), or beside the units `finetune.freeze` left to train.

What sampling, evaluation and a merged export of a LoRA checkpoint read, one unit at a time
(`merged_units`), in the layout of a full run's masters.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxzero.config import TrainConfig
from jaxzero.deferred import Deferred
from jaxzero.finetune.adapters import lora_spec
from jaxzero.finetune.base import narrow_block, narrow_unit
from jaxzero.finetune.trainable import base_positions
from jaxzero.models import ModelParams, build_model, init_keys
from jaxzero.models.lora import dequantize


def widen(unit: Any) -> Any:
    """A unit in storage form as float32: int8 kernels times their scales, "kernel_scale" dropped."""
    if not isinstance(unit, dict):
        return unit.astype(jnp.float32)
    if "kernel_scale" in unit:
        rest = {k: widen(v) for k, v in unit.items() if k not in ("kernel", "kernel_scale")}
        return {"kernel": dequantize(unit["kernel"], unit["kernel_scale"], jnp.float32), **rest}
    return {k: widen(v) for k, v in unit.items()}


def merge_block(block: Any, adapters: Any, scale: float) -> Any:
    """A float32 block with its adapters merged: each adapted kernel + scale * lora_a @ lora_b."""
    out = dict(block)
    for name, sub in adapters.items():
        if "lora_a" in sub:
            delta = jnp.matmul(sub["lora_a"], sub["lora_b"], precision=jax.lax.Precision.HIGHEST)
            out[name] = {**block[name], "kernel": block[name]["kernel"] + jnp.float32(scale) * delta}
        else:
            out[name] = merge_block(block[name], sub, scale)
    return out


def merged_units(
    cfg: TrainConfig, trainable_of: Callable[[int], Any], base: ModelParams | None = None
) -> ModelParams:
    """The model of a run of `cfg` with a frozen part, each unit a `Deferred` made (as float32 NumPy)
    when resolved: under LoRA, the base as trained with block i's adapters merged in; under
    `finetune.freeze`, the units that trained as they are and the frozen ones as trained (narrowed and
    widened). `trainable_of(k)`: what trains of the unit at position k (embedding 0, block i at 1 + i,
    head L + 1), `{}` where nothing does; `base`: float32 units (NumPy or `Deferred`) before
    narrowing, default `cfg.model.init_from`'s or the model's init from `cfg.seed`."""
    model = build_model(cfg.model)
    ft = cfg.finetune
    n = cfg.model.num_layers
    scale = lora_spec(ft).scale if ft.method == "lora" else 0.0
    kept = base_positions(ft, cfg.model)
    if base is None and cfg.model.init_from:
        from jaxzero.interop.hf_io import load_hf_by_unit  # the HF reader only where it is used

        base = load_hf_by_unit(cfg.model, cfg.model.init_from)
    k_embed, k_blocks, k_head = init_keys(jax.random.key(cfg.seed), n)
    shapes = jax.eval_shape(model.init, jax.random.key(0))
    inits = [lambda: model.init_embed(k_embed), *(partial(model.init_block, k) for k in k_blocks)]
    inits.append(lambda: model.init_head(k_head))
    units = None if base is None else [base.embed, *base.blocks, base.head]

    def unit(k: int, shape: Any) -> Deferred:
        def read():
            if k not in kept:  # a unit that trained: its saved float32 weights
                return (_numpy(trainable_of(k)),)
            u = units[k] if units is not None else inits[k]()
            u = u.load() if isinstance(u, Deferred) else u
            if 0 < k <= n:
                merged = merge_block(widen(narrow_block(u, ft.base_dtype)), trainable_of(k), scale)
            else:
                merged = widen(narrow_unit(u, ft.base_dtype))
            return (_numpy(merged),)

        return Deferred(read, 0, shape)

    all_shapes = [shapes.embed, *shapes.blocks, shapes.head]
    made = [unit(k, s) for k, s in enumerate(all_shapes)]
    return ModelParams(made[0], tuple(made[1:-1]), made[-1])


def _numpy(tree: Any) -> Any:
    return jax.tree.map(lambda x: np.asarray(x, np.float32), tree)
