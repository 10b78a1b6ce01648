"""LoRA adapters as a `ModelParams` tree: which projections get one, their shapes and their init.

The adapters of a model are `ModelParams(embed={}, blocks=(one dict per block), head={})`; a block's
dict nests like its parameters, with one entry per adapted projection:

    {"self_attn": {"q_proj": {"lora_a": float32 (in, r), "lora_b": float32 (r, out)}, ...},
     "mlp":       {"gate_proj": {...}, "up_proj": {...}, "down_proj": {...}}}

`jaxzero.models.lora.merge_trees` puts them beside a block's frozen weights, where the Llama family's
projections apply them. PEFT stores the same matrices transposed: lora_A.weight (r, in), lora_B.weight
(out, r) (`jaxzero.interop.peft`).
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp

from jaxzero.config import FinetuneConfig
from jaxzero.models import Model, ModelParams
from jaxzero.models.lora import LoraSpec
from jaxzero.models.sizes import projection_shapes

# What a LoRA run's checkpoints name their layout (`Trainer.layout`): the adapters and their state.
LORA_LAYOUT = "lora"

# finetune.lora_targets' names -> the projection's path in a Llama block (PEFT's module names).
TARGET_PATHS: dict[str, tuple[str, str]] = {
    "q": ("self_attn", "q_proj"),
    "k": ("self_attn", "k_proj"),
    "v": ("self_attn", "v_proj"),
    "o": ("self_attn", "o_proj"),
    "gate": ("mlp", "gate_proj"),
    "up": ("mlp", "up_proj"),
    "down": ("mlp", "down_proj"),
    "qkv": ("self_attn", "qkv_proj"),  # Phi-3's fused projections (model.fused_projections)
    "gate_up": ("mlp", "gate_up_proj"),
}


def lora_spec(cfg: FinetuneConfig) -> LoraSpec:
    """The model-side rule of `cfg`'s adapters: scale alpha / r, and the dropout."""
    return LoraSpec(scale=cfg.lora_alpha / cfg.lora_rank, dropout=cfg.lora_dropout)


def block_adapter_shapes(model: Model, cfg: FinetuneConfig) -> dict[str, Any]:
    """One block's adapters as float32 `ShapeDtypeStruct`s."""
    shapes = projection_shapes(model.config)
    out: dict[str, Any] = {}
    for name in cfg.targets:
        group, proj = TARGET_PATHS[name]
        d_in, d_out = shapes[name]
        out.setdefault(group, {})[proj] = {
            "lora_a": jax.ShapeDtypeStruct((d_in, cfg.lora_rank), jnp.float32),
            "lora_b": jax.ShapeDtypeStruct((cfg.lora_rank, d_out), jnp.float32),
        }
    return out


def adapter_shapes(model: Model, cfg: FinetuneConfig) -> ModelParams:
    """Every block's adapters as `ShapeDtypeStruct`s (embed and head: empty)."""
    one = block_adapter_shapes(model, cfg)
    return ModelParams({}, tuple(one for _ in range(model.config.num_layers)), {})


def init_block_adapters(key: jax.Array, shapes: dict[str, Any]) -> dict[str, Any]:
    """One block's fresh adapters, PEFT's default init: lora_a ~ Uniform(-1/sqrt(in), 1/sqrt(in))
    (torch's kaiming_uniform_ with a=sqrt(5) over the (r, in) weight), lora_b zeros, so that the
    adapted model starts as the base. float32; each projection from its own key."""
    leaves, treedef = jax.tree.flatten(shapes, is_leaf=lambda x: isinstance(x, dict) and "lora_a" in x)
    keys = jax.random.split(key, len(leaves))

    def one(k: jax.Array, pair: dict[str, Any]) -> dict[str, jax.Array]:
        d_in = pair["lora_a"].shape[0]
        bound = 1.0 / math.sqrt(d_in)
        a = jax.random.uniform(k, pair["lora_a"].shape, jnp.float32, -bound, bound)
        return {"lora_a": a, "lora_b": jnp.zeros(pair["lora_b"].shape, jnp.float32)}

    return jax.tree.unflatten(treedef, [one(k, p) for k, p in zip(keys, leaves)])


def init_adapters(key: jax.Array, model: Model, cfg: FinetuneConfig) -> ModelParams:
    """Fresh adapters for every block (`init_block_adapters`), block i from the i-th split of `key`."""
    one = block_adapter_shapes(model, cfg)
    keys = jax.random.split(key, model.config.num_layers)
    return ModelParams({}, tuple(init_block_adapters(k, one) for k in keys), {})
