"""A researcher's own model and optax transformation (`build_trainer(cfg, model=..., optimizer=...)`),
checked when a trainer is built against what the rest of jaxzero reads from the config.

The memory planner counts bytes from `cfg.model`'s shape and `cfg.optimizer`'s state before any model
exists (`jaxzero.planner.memory`), and the engines read `model.config` (layers, vocabulary, tied embeddings).
So a model of one's own comes with the `cfg.model` that describes it: `model.config` is `cfg.model`,
and the model has as many blocks, and as many parameters in its embedding, in each block and in its
head, as `jaxzero.models.sizes.unit_param_counts(cfg.model)` counts. A transformation of one's own
keeps at most the optimizer state per parameter that `cfg.optimizer` describes
(`memory.optimizer_state_bytes`). Both checks trace abstractly (`jax.eval_shape`): nothing is allocated.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np
import optax

from jaxzero.config import ConfigError, ModelConfig, TrainConfig
from jaxzero.models import Model, ModelParams, build_model
from jaxzero.models.sizes import param_count, unit_param_counts
from jaxzero.planner.memory import optimizer_state_bytes

# The `model.*` keys that make up a model's shape, which a model of one's own is described by.
SHAPE_KEYS = (
    "family, vocab_size, hidden_size, num_layers, num_heads, num_kv_heads, head_size, intermediate_size, "
    "max_seq_len (gpt2's position table), tie_embeddings, attention_bias, qk_norm, qk_norm_scope, post_norm, "
    "fused_projections"
)


def model_of(cfg: ModelConfig, model: Model | None) -> Model:
    """`model` once `check_model` passes it, or jaxzero's own `build_model(cfg)` where None."""
    if model is None:
        return build_model(cfg)
    check_model(cfg, model)
    return model


def check_model(cfg: ModelConfig, model: Model) -> None:
    """Raise ConfigError unless `model` is what `cfg` describes: `model.config == cfg`, and
    `model.init` makes float32 `ModelParams` with `cfg.num_layers` blocks of one structure and, per
    unit (embedding, one block, head), the parameters `unit_param_counts(cfg)` counts. A model
    given `moe_impl="auto"` passes where the run's decision grouped its experts as the machine's
    (the model decides by its backend when traced, as the decision did for the machine)."""
    given = getattr(model, "config", None)
    if isinstance(given, ModelConfig) and given.moe_impl == "auto":
        given = dataclasses.replace(given, moe_impl=cfg.moe_impl)
    if given != cfg:
        raise ConfigError(
            "the model passed to build_trainer must carry the trainer's cfg.model as its `config` (the "
            "engines read num_layers, vocab_size and tie_embeddings from it, the memory planner its "
            "shape): build it from cfg.model, after any override."
        )
    shapes = jax.eval_shape(model.init, jax.random.key(0))
    if not isinstance(shapes, ModelParams):
        raise ConfigError(
            f"the model's init returned {type(shapes).__name__}, not ModelParams(embed, blocks, head) "
            "(the block protocol: jaxzero.models.base.Model)."
        )
    if len(shapes.blocks) != cfg.num_layers:
        raise ConfigError(
            f"the model has {len(shapes.blocks)} blocks but model.num_layers={cfg.num_layers}: the "
            "memory planner counts cfg.model's shape; describe the model with it."
        )
    first = _layout(shapes.blocks[0])
    if any(_layout(b) != first for b in shapes.blocks[1:]):
        raise ConfigError(
            "the model's blocks differ in structure, shapes or dtypes: the engines compile one block "
            "function for every block, so every block's parameters must be alike."
        )
    narrow = sorted({str(x.dtype) for x in jax.tree.leaves(shapes) if x.dtype != np.float32})
    if narrow:
        raise ConfigError(
            f"the model's init made {', '.join(narrow)} parameters: the trainers keep float32 masters "
            "(init makes them float32; the blocks cast to the compute dtype themselves)."
        )
    have = tuple(_count(u) for u in (shapes.embed, shapes.blocks[0], shapes.head))
    counted = unit_param_counts(cfg)
    if have != counted:
        raise ConfigError(
            f"the model has {_units(have)} parameters in its embedding, each block and its head, but "
            f"cfg.model ({cfg.name}) describes {_units(counted)}: the memory planner counts cfg.model's "
            f"shape, so describe the model with it (model.{SHAPE_KEYS.replace(', ', ', model.')}: "
            "jaxzero.models.sizes.unit_param_shapes lists the arrays it counts per unit)."
        )


def check_optimizer(cfg: TrainConfig, tx: optax.GradientTransformation, masters_shape: ModelParams) -> None:
    """Raise ConfigError where `tx`'s state over the float32 masters (`masters_shape`, global
    `ShapeDtypeStruct`s) holds more bytes than the memory planner counts for `cfg.optimizer`."""
    state = jax.eval_shape(tx.init, masters_shape)
    held = sum(x.size * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(state) if x.ndim)  # not counts
    params = param_count(cfg.model)
    per = optimizer_state_bytes(cfg)
    if held > per * params:
        o = cfg.optimizer
        raise ConfigError(
            f"the optimizer passed to build_trainer keeps {held / params:.3g} bytes of state per "
            f"parameter, more than the {per} the memory planner counts for optimizer.name={o.name} with "
            f"optimizer.state_dtype={o.state_dtype}: describe its state with those keys (adamw or adam: "
            "two arrays per parameter; lion, or sgd with optimizer.momentum > 0: one; sgd without: none)."
        )


def _layout(tree: Any) -> tuple[Any, list[tuple[tuple[int, ...], Any]]]:
    return jax.tree.structure(tree), [(x.shape, x.dtype) for x in jax.tree.leaves(tree)]


def _count(tree: Any) -> int:
    return sum(int(np.prod(x.shape, dtype=np.int64)) for x in jax.tree.leaves(tree))


def _units(counts: tuple[int, ...]) -> str:
    return " / ".join(f"{n:,}" for n in counts)
