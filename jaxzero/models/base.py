"""What every model family is: `ModelParams` (embed, blocks, head) and the `Model` protocol of pure
functions over them, with the helpers that every family shares (per-unit init keys, the plain forward).

Models know nothing of memory kinds or devices.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol

import jax

from jaxzero.config import ModelConfig
from jaxzero.models.layers import split_init_keys


class ModelParams(NamedTuple):
    """Parameters of one model, a pytree. All leaves float32 masters unless cast by the caller.

    embed:  pytree of the token (and, for gpt2, position) embedding.
    blocks: tuple of `num_layers` pytrees with identical structure, shapes and dtypes.
    head:   pytree of the final norm and, when untied, the output projection.
    """

    embed: Any
    blocks: tuple[Any, ...]
    head: Any

    def units(self) -> list[Any]:
        """The units in forward order, `[embed, *blocks, head]`: index i is the plan's unit position i."""
        return [self.embed, *self.blocks, self.head]

    @classmethod
    def from_units(cls, units: list[Any] | tuple[Any, ...]) -> ModelParams:
        """`units`' inverse: `[embed, *blocks, head]` (at least two entries) as a `ModelParams`."""
        return cls(units[0], tuple(units[1:-1]), units[-1])


# One block's key/value cache for generation: keys and values (B, length, kv heads, head_dim).
KVCache = tuple[jax.Array, jax.Array]


class Model(Protocol):
    """What every model family provides. All functions are pure and jit-able.

    A family whose layers share one parameter structure but not one computation (Gemma 3's local and
    global layers) also has `layer_input(i)`, a small pytree of arrays for block i, which `block` and
    `block_step` then take as their `layer` argument (`layer_input` below).

    A family whose blocks feed an auxiliary loss (a mixture of experts' load-balancing loss) says so
    with `emits_stats = True` and has two more functions: `block_stats(block_params, x, segments,
    dropout_key[, layer], token_mask=None)` -> (`block`'s output, this layer's statistics: a small
    pytree of float32 arrays, added leaf-wise over layers), and `aux_loss(stats)` -> the unweighted
    float32 loss of the statistics summed over ALL layers of one micro-batch. `token_mask`, bool
    (B, S) or None, is False at the rows' padding, which counts in no statistics (transformers'
    attention mask); a `block_stats` without the argument counts every position. Training adds
    `config.router_aux_loss_coef` times `aux_loss` to each micro-batch's cross-entropy (`emits_stats`
    below); `block` stays the plain form."""

    config: ModelConfig

    def init(self, key: jax.Array) -> ModelParams:
        """Fresh float32 parameters from a PRNG key."""
        ...

    def init_embed(self, key: jax.Array) -> Any:
        """The embedding unit of `init`, from the embed key of `init_keys`."""
        ...

    def init_block(self, key: jax.Array) -> Any:
        """One block of `init`, from that block's key of `init_keys`."""
        ...

    def init_head(self, key: jax.Array) -> Any:
        """The head unit of `init`, from the head key of `init_keys`."""
        ...

    def embed(self, embed_params: Any, tokens: jax.Array) -> jax.Array:
        """tokens int32 (B, S) -> activations (B, S, D) in the compute dtype."""
        ...

    def block(self, block_params: Any, x: jax.Array, segments: jax.Array | None = None) -> jax.Array:
        """One transformer block: (B, S, D) -> (B, S, D), causal. Params may be float32 or compute dtype.
        `segments` int32 (B, S) or None: a token attends only to earlier tokens of its own segment
        (document). Only document-aware training passes it (`run_block`): a model of one's own may
        leave the argument out when trained with `data.cross_document_attention=true`."""
        ...

    def head(self, head_params: Any, embed_params: Any, x: jax.Array) -> jax.Array:
        """Final norm and projection: (B, S, D) -> logits (B, S, V) float32. Tied heads read embed_params."""
        ...

    def init_cache(self, batch: int, length: int) -> KVCache:
        """One block's empty key/value cache for `length` positions, in the compute dtype."""
        ...

    def embed_step(self, embed_params: Any, tokens: jax.Array, pos: jax.Array) -> jax.Array:
        """`embed` of int32 tokens (B, S) at positions pos .. pos+S-1 (int32 scalar)."""
        ...

    def block_step(
        self, block_params: Any, x: jax.Array, cache: KVCache, pos: jax.Array
    ) -> tuple[jax.Array, KVCache]:
        """`block` at positions pos .. pos+S-1 over the cache of the positions before -> (y, cache)."""
        ...


def init_keys(key: jax.Array, num_layers: int) -> tuple[jax.Array, tuple[jax.Array, ...], jax.Array]:
    """(embed key, one key per block, head key): how `Model.init` consumes `key`, so that a caller
    initialising one unit at a time (e.g. straight into host memory) reproduces `init(key)` exactly."""
    k_embed, k_blocks, k_head = split_init_keys(key, num_layers)
    return k_embed, tuple(k_blocks[i] for i in range(num_layers)), k_head


def init_params(model: Model, key: jax.Array) -> ModelParams:
    """`Model.init` for every family: each unit from its own key of `init_keys`."""
    k_embed, k_blocks, k_head = init_keys(key, model.config.num_layers)
    blocks = tuple(model.init_block(k) for k in k_blocks)
    return ModelParams(embed=model.init_embed(k_embed), blocks=blocks, head=model.init_head(k_head))


def layer_input(model: Model, i: int) -> Any:
    """Block i's per-layer input, or None: what differs between layers of one parameter structure
    (Gemma 3's local and global layers: rotary frequencies and window), a small pytree of arrays that
    the one compiled block program takes beside the weights, from `model.layer_input(i)` where the
    model has one. Models without it (Llama, GPT-2, one's own) take none."""
    get = getattr(model, "layer_input", None)
    return None if get is None else get(i)


def emits_stats(model: Model) -> bool:
    """Whether `model`'s blocks emit the statistics of an auxiliary loss (`Model`'s docstring:
    `block_stats`, `aux_loss`), read once when a step function is built: the engines then sum each
    micro-batch's statistics over the layers and add `model.config.router_aux_loss_coef` times
    `aux_loss` of the sum to its objective. Models without `emits_stats` (dense ones, one's own) emit
    none and their step functions are built as before."""
    return bool(getattr(model, "emits_stats", False))


def add_layer_stats(a: Any, b: Any) -> Any:
    """Two layers' (or layer sums') statistics added leaf-wise: the statistics of both."""
    return jax.tree.map(lambda u, v: u + v, a, b)


def run_block_stats(
    model: Model,
    block_params: Any,
    x: jax.Array,
    segments: jax.Array | None = None,
    dropout_key: jax.Array | None = None,
    layer: Any = None,
    *,
    token_mask: jax.Array | None = None,
) -> tuple[jax.Array, Any]:
    """`model.block_stats`: (the block's output (B, S, D), its layer's statistics), with the
    per-layer input `layer` where the model has one, over the tokens of `token_mask` (bool (B, S))
    where given (a model without the argument is never given one: `objective.router_padding`)."""
    masked = {} if token_mask is None else {"token_mask": token_mask}
    if layer is not None:
        return model.block_stats(block_params, x, segments, dropout_key, layer, **masked)
    return model.block_stats(block_params, x, segments, dropout_key, **masked)


def run_block(
    model: Model,
    block_params: Any,
    x: jax.Array,
    segments: jax.Array | None = None,
    layer: Any = None,
    *,
    dropout_key: jax.Array | None = None,
    stats: bool = False,
    token_mask: jax.Array | None = None,
) -> Any:
    """`model.block(block_params, x)`, within `segments` (int32 (B, S)) where they are given, with
    the adapters' `dropout_key` where given, for the layer whose `layer_input` is `layer` where there
    is one; without them the block is called as the protocol's first form, so models without the
    arguments (one's own) still run. With `stats`: `run_block_stats`, (y, the layer's statistics),
    over the tokens of `token_mask` (bool (B, S)) where given."""
    if stats:
        return run_block_stats(model, block_params, x, segments, dropout_key, layer, token_mask=token_mask)
    if layer is not None:
        return model.block(block_params, x, segments, dropout_key, layer)
    if dropout_key is not None:
        return model.block(block_params, x, segments, dropout_key)
    if segments is None:
        return model.block(block_params, x)
    return model.block(block_params, x, segments)


def forward(
    model: Model, params: ModelParams, tokens: jax.Array, segments: jax.Array | None = None
) -> jax.Array:
    """Logits (B, S, V) float32 for int32 tokens (B, S), all blocks in sequence (no remat); attention
    within `segments` (int32 (B, S)) where given."""
    x = model.embed(params.embed, tokens)
    for i, p in enumerate(params.blocks):
        x = run_block(model, p, x, segments, layer_input(model, i))
    return model.head(params.head, params.embed, x)
