"""What trains in a run with a frozen part (`FinetuneConfig.partial`), as a `ModelParams` tree.

    finetune.method=lora    the adapters (`jaxzero.finetune.adapters`); every unit of the model is
                            frozen, kept by the base
    finetune.freeze=...     whole units in float32, the model's own parameters; the frozen units are
                            the base's, the others hold nothing there

A unit the tree leaves out is `{}`: every unit the trainer runs is `merge_trees(base unit, trainable
unit)`, and its gradient is taken with respect to the trainable part alone.
"""

from __future__ import annotations

import jax

from jaxzero.config import FinetuneConfig
from jaxzero.finetune.adapters import LORA_LAYOUT, adapter_shapes
from jaxzero.models import Model, ModelParams

# What a run with frozen units (finetune.freeze) names its checkpoints' layout: the units that train.
FROZEN_LAYOUT = "frozen"


def layout_of(ft: FinetuneConfig) -> str:
    """The checkpoint layout of a run with a frozen part."""
    return LORA_LAYOUT if ft.method == "lora" else FROZEN_LAYOUT


def trainable_shapes(model: Model, ft: FinetuneConfig) -> ModelParams:
    """The trainable tree's float32 `ShapeDtypeStruct`s (`{}` where a unit has nothing that trains)."""
    if ft.method == "lora":
        return adapter_shapes(model, ft)
    frozen = ft.frozen(model.config.num_layers)
    whole = jax.eval_shape(model.init, jax.random.key(0))
    units = whole.units()
    kept = [{} if k in frozen else u for k, u in enumerate(units)]
    return ModelParams.from_units(kept)
