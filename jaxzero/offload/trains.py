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
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Sharding

from jaxzero.models.layers import cast_tree
from jaxzero.models.lora import merge_trees


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
