"""A LoRA run's model as plain float32 weights: the frozen base as it was trained (narrowed, then
widened back) with each adapter merged in, kernel + (alpha / r) * lora_a @ lora_b.

What sampling, evaluation and a merged export of a LoRA checkpoint read, one unit at a time
(`merged_units`), in the layout of a full run's masters.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxzero.config import TrainConfig
from jaxzero.deferred import Deferred
from jaxzero.finetune.adapters import lora_spec
from jaxzero.finetune.base import narrow_block, narrow_unit
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
    cfg: TrainConfig, adapters_of: Callable[[int], Any], base: ModelParams | None = None
) -> ModelParams:
    """The merged model of a LoRA run of `cfg`, each unit a `Deferred` made (as float32 NumPy) when
    resolved. `adapters_of(i)`: block i's adapters; `base`: float32 units (NumPy or `Deferred`) of
    the base before narrowing, default `cfg.model.init_from`'s or the model's init from `cfg.seed`."""
    model = build_model(cfg.model)
    ft = cfg.finetune
    scale = lora_spec(ft).scale
    if base is None and cfg.model.init_from:
        from jaxzero.interop.hf_io import load_hf_by_unit  # the HF reader only where it is used

        base = load_hf_by_unit(cfg.model, cfg.model.init_from)
    k_embed, k_blocks, k_head = init_keys(jax.random.key(cfg.seed), cfg.model.num_layers)
    shapes = jax.eval_shape(model.init, jax.random.key(0))

    def source(unit: Any, init: Callable[[], Any]) -> Any:
        if base is None:
            return init()
        return unit.load() if isinstance(unit, Deferred) else unit

    def edge(i: int, shape: Any) -> Deferred:
        init = (lambda: model.init_embed(k_embed)) if i == 0 else (lambda: model.init_head(k_head))
        units = None if base is None else (base.embed if i == 0 else base.head)

        def read():
            return (_numpy(widen(narrow_unit(source(units, init), ft.base_dtype))),)

        return Deferred(read, 0, shape)

    def block(i: int, shape: Any) -> Deferred:
        def read():
            w = source(None if base is None else base.blocks[i], lambda: model.init_block(k_blocks[i]))
            return (_numpy(merge_block(widen(narrow_block(w, ft.base_dtype)), adapters_of(i), scale)),)

        return Deferred(read, 0, shape)

    blocks = tuple(block(i, s) for i, s in enumerate(shapes.blocks))
    return ModelParams(edge(0, shapes.embed), blocks, edge(1, shapes.head))


def _numpy(tree: Any) -> Any:
    return jax.tree.map(lambda x: np.asarray(x, np.float32), tree)
