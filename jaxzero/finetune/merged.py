"""The model of a run with a frozen part as plain float32 weights: the frozen units as they were
trained (narrowed, then widened back), with LoRA's adapters merged in (kernel + (alpha / r) *
lora_a @ lora_b), or beside the units `finetune.freeze` left to train.

What sampling, evaluation and a merged export of a LoRA checkpoint read, one unit at a time
(`merged_units`), in the layout of a full run's masters. A merged export merges into the base the user
gave (`model.init_from`'s weights at their own precision, not the `finetune.base_dtype` copy that
trained); a base drawn from the seed was given by no one, and is merged into as trained (`merged_into`).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxzero.config import FinetuneConfig, TrainConfig
from jaxzero.finetune.adapters import lora_spec
from jaxzero.finetune.base import narrow_block, narrow_unit, source_units
from jaxzero.models import ModelParams, build_model
from jaxzero.models.lora import dequantize
from jaxzero.primitives.deferred import Deferred, is_deferred


def widen(unit: Any) -> Any:
    """A unit in storage form as float32: int8 kernels times their scales, "kernel_scale" dropped."""
    if not isinstance(unit, dict):
        return unit.astype(jnp.float32)
    if "kernel_scale" in unit:
        rest = {k: widen(v) for k, v in unit.items() if k not in ("kernel", "kernel_scale")}
        return {"kernel": dequantize(unit["kernel"], unit["kernel_scale"], jnp.float32), **rest}
    return {k: widen(v) for k, v in unit.items()}


def merge_block(block: Any, adapters: Any, scale: float, label: str = "block") -> Any:
    """A block with its adapters merged: each adapted kernel (float32, or one that float32 promotes)
    + scale * lora_a @ lora_b, in float32; the other entries as they are. ValueError, naming `label`
    and the path, for an adapter without its projection or of the wrong shape."""
    out = dict(block)
    for name, sub in adapters.items():
        if name not in block or not isinstance(block[name], dict):
            raise ValueError(
                f"{label}: adapters at {name!r} have no projection in the base (it holds {sorted(block)})."
            )
        if "lora_a" not in sub:
            out[name] = merge_block(block[name], sub, scale, f"{label}/{name}")
            continue
        kernel, a, b = block[name]["kernel"], sub["lora_a"], sub["lora_b"]
        if a.ndim != 2 or b.ndim != 2 or (a.shape[0], b.shape[1]) != kernel.shape or a.shape[1] != b.shape[0]:
            raise ValueError(
                f"{label}/{name}: lora_a {a.shape} @ lora_b {b.shape} does not make the kernel's shape "
                f"{kernel.shape} (lora_a is (in, r), lora_b (r, out))."
            )
        delta = jnp.matmul(a, b, precision=jax.lax.Precision.HIGHEST)
        out[name] = {**block[name], "kernel": kernel + jnp.float32(scale) * delta}
    return out


def merged_params(base: ModelParams, adapters: ModelParams, ft: FinetuneConfig) -> ModelParams:
    """A llama-family base with LoRA adapters folded in: a plain model that computes what the adapted
    one does (without dropout), for `export_hf`.

    base: its block kernels float32 or bfloat16, or int8 (in, out) with a float32 "kernel_scale" (out,)
        (`jaxzero.models.lora.quantize_kernel`); NumPy or jax arrays, or a block a `Deferred` (its merge
        is then deferred too, so that `export_hf` holds one block at a time).
    adapters: ModelParams(embed={}, blocks=(one dict per block), head={}) of lora_a (in, r) and lora_b
        (r, out) (`jaxzero.finetune.adapters`); ft: their lora_alpha and lora_rank.

    Each adapted kernel becomes float32 kernel + (lora_alpha / lora_rank) * lora_a @ lora_b (`merge_block`),
    an int8 kernel dequantised in float32 first; every int8 kernel is dequantised and loses its
    "kernel_scale", so the result has exactly a plain model's parameters. Other leaves are returned as
    given. ValueError names adapters without a projection or of the wrong shape."""
    if adapters.embed or adapters.head:
        raise ValueError(
            f"adapters hold embedding or head entries (embed keys {sorted(adapters.embed)}, head keys "
            f"{sorted(adapters.head)}): LoRA adapters here are the blocks' projections only."
        )
    if len(adapters.blocks) != len(base.blocks):
        raise ValueError(
            f"adapters have {len(adapters.blocks)} blocks, the base has {len(base.blocks)}: merge adapters "
            "trained on this base."
        )
    scale = lora_spec(ft).scale
    blocks: list[Any] = []
    for i, (block, extra) in enumerate(zip(base.blocks, adapters.blocks)):
        if is_deferred(block):
            read = partial(_merged_read, block, extra, scale, f"block {i}")
            blocks.append(Deferred(read, 0, _merged_shapes(block.shapes, extra)))
        else:
            blocks.append(_merged_on_host(block, extra, scale, f"block {i}"))
    return ModelParams(base.embed, tuple(blocks), base.head)


def _merged_on_host(block: Any, adapters: Any, scale: float, label: str) -> Any:
    """`merge_block` of a block whose int8 projections are dequantised first, as host arrays."""
    host = _dequantized(jax.device_get(block))
    return jax.device_get(merge_block(host, jax.device_get(adapters), scale, label))


def _merged_read(block: Deferred, adapters: Any, scale: float, label: str) -> tuple[Any]:
    """`_merged_on_host` of a deferred block, read now: a `Deferred`'s read result."""
    return (_merged_on_host(block.load(), adapters, scale, label),)


def _dequantized(tree: Any) -> Any:
    """`tree` with each int8 projection in float32 (`widen`'s rule, "kernel_scale" dropped); every
    other entry the same object."""
    if not isinstance(tree, dict):
        return tree
    if "kernel_scale" in tree:
        return widen({"kernel": tree["kernel"], "kernel_scale": tree["kernel_scale"]}) | {
            k: v for k, v in tree.items() if k not in ("kernel", "kernel_scale")
        }
    return {k: _dequantized(v) for k, v in tree.items()}


def _merged_shapes(shapes: Any, adapters: Any) -> Any:
    """The shapes `_merged_on_host` gives for a block of shapes `shapes` (a Deferred block's)."""

    def walk(tree: Any, extra: Any) -> Any:
        if not isinstance(tree, dict):
            return tree
        if "kernel" in tree and (extra or "kernel_scale" in tree):
            out = {k: v for k, v in tree.items() if k != "kernel_scale"}
            out["kernel"] = jax.ShapeDtypeStruct(tuple(tree["kernel"].shape), np.float32)
            return out
        return {k: walk(v, extra.get(k, {})) for k, v in tree.items()}

    return walk(shapes, adapters)


def merged_into(cfg: TrainConfig) -> str:
    """Which base an export of a run of `cfg` with a frozen part holds (`merged_units`'
    `base_as_given`: LoRA's merged base, `finetune.freeze`'s frozen units), in words, for its message."""
    if cfg.model.init_from:
        return f"the base read from {cfg.model.init_from} (model.init_from), at the precision of its files"
    dtype = cfg.finetune.base_dtype
    return f"the base initialised from seed {cfg.seed}, as trained (finetune.base_dtype={dtype})"


def merged_units(
    cfg: TrainConfig,
    trainable_of: Callable[[int], Any],
    base: ModelParams | None = None,
    *,
    base_as_given: bool = False,
) -> ModelParams:
    """The model of a run of `cfg` with a frozen part, each unit a `Deferred` made (as float32 NumPy)
    when resolved: under LoRA, the base as trained with block i's adapters merged in; under
    `finetune.freeze`, the units that trained as they are and the frozen ones as trained (narrowed and
    widened). `trainable_of(k)`: what trains of the unit at position k (embedding 0, block i at 1 + i,
    head L + 1), `{}` where nothing does; `base`: float32 units (NumPy or `Deferred`) before
    narrowing, default `cfg.model.init_from`'s or the model's init from `cfg.seed`. `base_as_given`
    (a merged export): the frozen units of an `init_from` base as read, float32, not narrowed to
    `finetune.base_dtype`; a base drawn from the seed stays as trained (`merged_into`)."""
    model = build_model(cfg.model)
    ft = cfg.finetune
    n = cfg.model.num_layers
    scale = lora_spec(ft).scale if ft.method == "lora" else 0.0
    kept = ft.base_positions(cfg.model.num_layers)
    source = base if base is not None else source_units(cfg, model)
    # The base the user gave as read (float32 holds any file's dtype exactly), or narrowed as trained.
    as_read = base_as_given and bool(cfg.model.init_from)
    units = source.units()
    shapes = jax.eval_shape(model.init, jax.random.key(0))

    def unit(k: int, shape: Any) -> Deferred:
        def read():
            if k not in kept:  # a unit that trained: its saved float32 weights
                return (_numpy(trainable_of(k)),)
            u = units[k].load() if isinstance(units[k], Deferred) else units[k]
            if 0 < k <= n:
                block = widen(u if as_read else narrow_block(u, ft.base_dtype))
                merged = merge_block(block, trainable_of(k), scale)
            else:
                merged = widen(u if as_read else narrow_unit(u, ft.base_dtype))
            return (_numpy(merged),)

        return Deferred(read, 0, shape)

    all_shapes = shapes.units()
    made = [unit(k, s) for k, s in enumerate(all_shapes)]
    return ModelParams.from_units(made)


def _numpy(tree: Any) -> Any:
    return jax.tree.map(lambda x: np.asarray(x, np.float32), tree)
