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
import jax.numpy as jnp

from jaxzero.config import TrainConfig
from jaxzero.deferred import Deferred
from jaxzero.models import Model, ModelParams, init_keys
from jaxzero.models.lora import quantize_kernel

KERNEL = "kernel"


def storage_dtype(base_dtype: str) -> jnp.dtype:
    """The dtype of a base's non-quantised leaves: bfloat16 for int8 bases."""
    return jnp.dtype(jnp.float32 if base_dtype == "float32" else jnp.bfloat16)


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
        from jaxzero.interop.hf_io import load_hf_by_unit  # the HF reader only where it is used

        return load_hf_by_unit(cfg.model, cfg.model.init_from)
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
