"""What a streamed pass trains of each unit (`StreamedModel`'s parameter, chosen when it is built).

    every parameter (`EVERY`)    a unit is its weights, cast to the compute dtype and gathered whole
                                 by each program; its gradient is taken with respect to all of them
                                 and leaves reduce-scattered, one shard per device
    a frozen part (`FrozenPart`) a unit is a pair (frozen, trainable): the frozen part in its storage
                                 form (streamed or resident), the trainable part on the accelerator,
                                 merged as the model reads them (`models.lora.merge_trees`, the model's
                                 layers casting and dequantising); its gradient is taken with respect
                                 to the trainable part alone, where it is made (one device)

Below `lowest_block` nothing trains: the pass saves no input there and runs no backward. Where the
embedding does not train, its lookup's gradient is never formed.

A run with a frozen part hands the engine what trains as a `FrozenTrains` (built by
`jaxzero.finetune.part`): the model, the trainable tree's shapes and starting values, the frozen
base, the dropout keys; the engine keeps its own state, update and checkpoint form over that tree.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import jax
import jax.numpy as jnp
from jax.sharding import Sharding

from jaxzero.models import Model, ModelParams
from jaxzero.models.layers import cast_tree
from jaxzero.models.lora import merge_trees
from jaxzero.plan import OffloadPlan, Tier, UnitKind


@dataclass(frozen=True)
class WholeUnits:
    """Every parameter of a unit trains: the full run's units."""

    lowest_block: int = 0
    embed: bool = True

    def unit(self, weights: Any, trainable: Any) -> Any:
        """The unit a program receives: its weights (there is no separate trainable part)."""
        return weights

    def split(self, unit: Any, compute: jnp.dtype, whole: Any) -> tuple[Any, Any]:
        """(nothing fixed, the weights in the compute dtype, whole): constraining the weights to whole
        arrays all-gathers their shards (float32 masters are cast first, so the gather moves the
        narrow copy)."""
        return None, jax.lax.with_sharding_constraint(cast_tree(unit, compute), whole)

    @staticmethod
    def join(fixed: Any, trainable: Any) -> Any:
        """The weights the model reads."""
        return trainable

    @staticmethod
    def scatter(g: Any, sharding: Any) -> Any:
        """Gradient sums constrained to one shard per device: a reduce-scatter."""
        return jax.lax.with_sharding_constraint(g, sharding)

    def copy_target(self, split_block: Any) -> Any:
        """Where a streamed block is copied: `split_block`, a block's shardings in device memory."""
        return split_block


@dataclass(frozen=True)
class FrozenPart:
    """A unit is (frozen, trainable), on one device; see the module docstring.

    lowest_block: the first block whose backward pass matters (`FinetuneConfig.lowest_trainable_block`).
    embed:        whether the embedding has a trainable part.
    device:       where a streamed frozen block is copied (the accelerator's memory).
    """

    lowest_block: int
    embed: bool
    device: Sharding

    def unit(self, weights: Any, trainable: Any) -> Any:
        """The unit a program receives: the pair (frozen weights, trainable part)."""
        return weights, trainable

    def split(self, unit: Any, compute: jnp.dtype, whole: Any) -> tuple[Any, Any]:
        """(the frozen part, the trainable part), as they are: the model's layers cast them."""
        return unit

    @staticmethod
    def join(fixed: Any, trainable: Any) -> Any:
        """The unit's weights as the model reads them: the trainable leaves beside the frozen ones."""
        return merge_trees(fixed, trainable)

    @staticmethod
    def scatter(g: Any, sharding: Any) -> Any:
        """One device: the gradient stays where it is made."""
        return g

    def copy_target(self, split_block: Any) -> Any:
        """Where a streamed frozen block is copied (its storage form has its own leaves: an int8
        kernel's scale)."""
        return self.device


EVERY = WholeUnits()


class FrozenTrains(Protocol):
    """What trains of a run with a frozen part, as an engine builds from it (one device).

    model:        the model the passes run (with its LoRA adapters' spec, where there are some).
    shapes:       float32 `ShapeDtypeStruct`s of the trainable tree, a `ModelParams` (`{}` where a
                  unit has nothing that trains): the engine's masters, gradients and optimizer state.
    device:       the accelerator's memory, where every array of the state lives.
    schedule:     the streamed schedule's parameter (`FrozenPart`).
    streamed:     whether the base's blocks live in `pinned_host` (copied in per use).
    dropout_keys: (step int32 scalar, micro-batch a) -> block i's dropout keys in row i, (L, 1);
                  None without dropout.
    layout:       the checkpoints' layout name; description: the run's one-line `strategy`.
    """

    model: Model
    shapes: ModelParams
    device: Sharding
    schedule: FrozenPart
    streamed: bool
    dropout_keys: Callable[[jax.Array, int], jax.Array] | None
    layout: str
    description: str

    def base_units(self) -> ModelParams:
        """The frozen units in storage form (`{}` where a unit trains whole), built on first use."""
        ...

    def fresh(self, key: jax.Array) -> ModelParams:
        """What trains at its start, on `device`, from `key` (the base built from the config)."""
        ...

    def fresh_from(self, params: ModelParams) -> ModelParams:
        """What trains at its start, the base built from float32 host units `params`."""
        ...


def frozen_part_plan(plan: OffloadPlan, streamed: bool) -> OffloadPlan:
    """The decided plan of a run with a frozen part as the streamed schedule reads it: what trains
    and its optimizer state on the accelerator (`Tier.DEVICE` state, so its gradients stay there),
    the base's blocks in `pinned_host` where the base is `streamed`, and block inputs on the
    accelerator."""
    weights = Tier.PINNED_HOST if streamed else Tier.DEVICE
    units = tuple(
        dataclasses.replace(u, weights=weights if u.kind is UnitKind.BLOCK else u.weights, state=Tier.DEVICE)
        for u in plan.units
    )
    return dataclasses.replace(plan, units=units, activations=Tier.DEVICE)
