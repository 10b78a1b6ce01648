"""The training objective: next-token cross-entropy over a window of tokens, over the targets it counts.

Shared by the resident trainer and the offload engine so that both optimise the very same function.
A batch window is int32 `(B, S + 1)`: inputs are `[:, :-1]`, targets `[:, 1:]`. An entry may be
negative, `~id` (= -id - 1): the token `id`, read as input as usual but not counted as a target (a
prompt token of a fine-tuning example, whose prediction is not trained). A step's loss is the mean
cross-entropy over the targets it counts, over all its micro-batches (`step_weight`): micro-batches
with more counted targets weigh more, as one large batch would weigh them.

Documents: a window may hold several documents one after another, each ended by its end-of-text id
(`eot_id`); the token after an end-of-text starts the next. Unless the run asks for attention across
them (`data.cross_document_attention`), each input token attends only within its own document: its
segment id (`document_segments`) is the count of end-of-text ids before it, and the blocks attend
within equal ids. The id is fixed when a trainer is built (`document_eot`), never decided in a step.

An auxiliary loss: where the model's blocks emit statistics (`jaxzero.models.emits_stats`: a mixture
of experts' router), each micro-batch's objective is its weighted cross-entropy plus
`router_aux_loss_coef` times the model's `aux_loss` of its statistics summed over every layer
(`objective_with_aux`), as transformers adds it per forward call. The loss reported and evaluated
stays the cross-entropy (`loss_fn`).

Padding: a row of fine-tuning examples ends, after its last example's end-of-text, with a run of
`~padding_id(eot_id)` (`jaxzero.data.packing`). Those positions are what transformers' attention mask
zeroes, so they are left out of the router's statistics (`real_tokens`, `router_padding`); every other
position counts, prompt tokens that are no target included, as with transformers.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp

from jaxzero.config import ConfigError, DataConfig, padding_id
from jaxzero.models import Model, ModelParams, add_layer_stats, emits_stats, layer_input, run_block_stats


def decode_window(window: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """int32 (B, S+1) -> (inputs (B, S) int32, targets (B, S) int32, counted (B, S) bool): the ids
    with their not-a-target marks removed, and which targets the loss counts."""
    ids = jnp.where(window < 0, ~window, window)
    return ids[:, :-1], ids[:, 1:], window[:, 1:] >= 0


def document_eot(data: DataConfig, model: Model) -> int | None:
    """The end-of-text id whose documents attend only within themselves, or None for attention across
    the whole window (`data.cross_document_attention`, or `data.eot_id` < 0: no id, one stream). A
    static value for a trainer's step functions, read once when the trainer is built; raises
    ConfigError where a model of one's own has no `segments` argument to its `block`."""
    if data.cross_document_attention or data.eot_id < 0:
        return None
    params = inspect.signature(model.block).parameters.values()
    if len(params) < 3 and not any(p.kind is p.VAR_POSITIONAL for p in params):
        raise ConfigError(
            f"data.eot_id={data.eot_id} asks for attention within each document, but the model's "
            "block(params, x) takes no `segments` (jaxzero.models.base.Model.block): add it, or set "
            "data.cross_document_attention=true."
        )
    return data.eot_id


def document_segments(window: jax.Array, eot_id: int) -> jax.Array:
    """int32 (..., S+1) windows -> int32 (..., S) segment ids of their inputs: at each input position,
    how many `eot_id` tokens come strictly before it in its row (not-a-target marks read through). A
    document ends with its end-of-text; the token after it starts the next segment."""
    inputs = jnp.where(window < 0, ~window, window)[..., :-1]
    ends = (inputs == eot_id).astype(jnp.int32)
    return jnp.cumsum(ends, axis=-1, dtype=jnp.int32) - ends


def router_padding(data: DataConfig, model: Model) -> int | None:
    """The end-of-text id after which rows are padded (`real_tokens`), where the padding is left out
    of the router's statistics, or None: every position counts (a model whose blocks emit no
    statistics, or whose `block_stats` takes no `token_mask`; `data.eot_id` < 0, no end-of-text id
    to find the padding after: streams are never padded, and rows of examples run with
    `data.eot_id=-2` count theirs). A static value for a trainer's step functions, read once when the
    trainer is built."""
    if data.eot_id < 0 or not emits_stats(model):
        return None
    params = inspect.signature(model.block_stats).parameters
    takes = "token_mask" in params or any(p.kind is p.VAR_KEYWORD for p in params.values())
    return data.eot_id if takes else None


def real_tokens(window: jax.Array, eot_id: int) -> jax.Array:
    """int32 (..., S+1) windows -> bool (..., S): which inputs are tokens, False for a row's padding
    (transformers' attention mask). The padding is the run of `~padding_id(eot_id)` entries that ends
    the row right after an end-of-text id (marked or not); a row without one (a window of a stream, an
    example cut to the row) has none. Made once per step, as the segment ids are."""
    pad = ~padding_id(eot_id)
    ids = jnp.where(window < 0, ~window, window)
    # Entries from which every entry to the end of the row is padding: the row's padded tail.
    tail = jnp.flip(jnp.cumprod(jnp.flip(window == pad, -1), axis=-1, dtype=jnp.int32), -1)
    before = window.shape[-1] - 1 - jnp.sum(tail, axis=-1, keepdims=True)  # the entry before the tail
    after_eot = jnp.take_along_axis(ids, jnp.maximum(before, 0), axis=-1) == eot_id
    padding = (tail == 1) & after_eot & (before >= 0)
    return ~padding[..., :-1]


def per_step(
    fn: Callable[..., jax.Array], eot_id: int | None
) -> Callable[[jax.Array], jax.Array | None]:
    """`fn(batch, eot_id=eot_id)` (`document_segments`, `real_tokens`) as the one small program a
    step runs on its batch, whose output every block reads; where `eot_id` is None (no documents to
    keep apart, no padding to leave out), a function of the batch that returns None."""
    return _absent if eot_id is None else jax.jit(partial(fn, eot_id=eot_id))


def _absent(batch: jax.Array) -> None:
    """No per-step input: attention across each whole row, every position in the statistics."""
    return None


def counted_targets(batch: jax.Array) -> jax.Array:
    """int32 scalar: targets the loss counts in int32 (..., S+1) windows (all of them without marks)."""
    return jnp.sum(batch[..., 1:] >= 0, dtype=jnp.int32)


def step_weight(batch: jax.Array) -> jax.Array:
    """float32 scalar weight of each micro-batch's summed cross-entropy in int32 (A, mb, S+1): A over
    the step's counted targets (at least 1), so that the mean over the A micro-batches of their
    weighted sums is the step's mean loss. Without marks: 1 / (mb * S), each micro-batch's mean."""
    return jnp.float32(batch.shape[0]) / jnp.maximum(counted_targets(batch), 1).astype(jnp.float32)


def cross_entropy_sum(logits: jax.Array, targets: jax.Array, counted: jax.Array) -> jax.Array:
    """Summed next-token cross-entropy of the counted targets: logits float32 (B, S, V), targets int32
    (B, S), counted bool (B, S) -> float32 scalar. Computed in float32 with a stable log-sum-exp."""
    logits = logits.astype(jnp.float32)
    lse = jax.nn.logsumexp(logits, axis=-1)
    picked = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    return jnp.sum(jnp.where(counted, lse - picked, 0.0))


# The head's float32 logits and their gradient take 8 bytes per token and vocabulary entry. Past this
# many bytes for one micro-batch the loss runs over equal pieces of each sequence, each piece's logits
# made (and, differentiated, remade in the backward pass) alone: long sequences are not bounded by them.
HEAD_LOGITS_BYTES = 8 * 2**30


def head_pieces(rows: int, seq_len: int, vocab_size: int) -> int:
    """The pieces each sequence's head loss runs in (`head_loss`): the fewest dividing `seq_len` whose
    logits and gradient for `rows` sequences fit `HEAD_LOGITS_BYTES` (1 for the usual shapes)."""
    for n in range(1, seq_len + 1):
        if seq_len % n == 0 and rows * (seq_len // n) * vocab_size * 8 <= HEAD_LOGITS_BYTES:
            return n
    return seq_len


def head_loss(
    model: Model, head_w: Any, embed_w: Any, x: jax.Array, window: jax.Array, weight: jax.Array
) -> jax.Array:
    """`weight` times the summed next-token cross-entropy of `model.head` on hidden states x (B, S, D)
    over the counted targets of the int32 window (B, S+1) -> float32 scalar. In `head_pieces` pieces
    along S where the logits would be too large (the pieces' sums added), with the head's weights
    taken in float32 so that their gradient sums over the pieces in float32."""
    _, targets, counted = decode_window(window)
    rows, seq_len, width = x.shape
    n = head_pieces(rows, seq_len, model.config.vocab_size)
    if n == 1:
        return weight * cross_entropy_sum(model.head(head_w, embed_w, x), targets, counted)
    head_w, embed_w = jax.tree.map(lambda a: a.astype(jnp.float32), (head_w, embed_w))
    xs = x.reshape(rows, n, seq_len // n, width).swapaxes(0, 1)
    ts = targets.reshape(rows, n, seq_len // n).swapaxes(0, 1)
    cs = counted.reshape(rows, n, seq_len // n).swapaxes(0, 1)

    @jax.checkpoint  # the backward pass remakes one piece's logits at a time
    def piece(hw: Any, ew: Any, xp: jax.Array, tp: jax.Array, cp: jax.Array) -> jax.Array:
        return cross_entropy_sum(model.head(hw, ew, xp), tp, cp)

    return weight * jnp.sum(jax.lax.map(lambda a: piece(head_w, embed_w, *a), (xs, ts, cs)))


def remat_block(model: Model):
    """The block function rematerialised in the backward pass: only its input activation is saved.

    `prevent_cse` stays on so XLA cannot merge the recomputation with the forward pass.
    """
    return jax.checkpoint(model.block, policy=jax.checkpoint_policies.nothing_saveable)


def loss_fn(
    model: Model,
    params: ModelParams,
    window: jax.Array,
    weight: jax.Array | None = None,
    eot_id: int | None = None,
) -> jax.Array:
    """float32 scalar: `weight` times the summed cross-entropy of the counted targets of int32 window
    (B, S+1), `params` of any dtype (blocks cast to the compute dtype). `weight` None: the mean over
    the window's counted targets. `eot_id` (static; `document_eot`): each document attends within
    itself, its segments made once here for every block; None: attention across the window."""
    inputs, _, _ = decode_window(window)
    if weight is None:
        weight = 1.0 / jnp.maximum(counted_targets(window), 1).astype(jnp.float32)
    segments = None if eot_id is None else document_segments(window, eot_id)
    block = remat_block(model)
    x = model.embed(params.embed, inputs)
    for i, p in enumerate(params.blocks):
        layer = layer_input(model, i)
        if layer is not None:
            x = block(p, x, segments, None, layer)
        else:
            x = block(p, x) if segments is None else block(p, x, segments)
    return head_loss(model, params.head, params.embed, x, window, weight)


def objective_with_aux(
    model: Model,
    params: ModelParams,
    window: jax.Array,
    weight: jax.Array | None = None,
    eot_id: int | None = None,
    token_mask: jax.Array | None = None,
) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    """For a model whose blocks emit statistics (`jaxzero.models.emits_stats`): (the objective, (the
    cross-entropy term, the auxiliary loss)), float32 scalars: `loss_fn`'s weighted cross-entropy of
    int32 window (B, S+1) plus `model.config.router_aux_loss_coef` times `model.aux_loss` of the
    blocks' statistics summed over the layers (unweighted, the second of the pair), over the tokens of
    `token_mask` (bool (B, S), `real_tokens`: the rows' padding left out) where given, else over
    every position. Blocks are rematerialised as in `loss_fn`."""
    inputs, _, _ = decode_window(window)
    if weight is None:
        weight = 1.0 / jnp.maximum(counted_targets(window), 1).astype(jnp.float32)
    segments = None if eot_id is None else document_segments(window, eot_id)
    block = jax.checkpoint(
        lambda p, x, s, layer, m: run_block_stats(model, p, x, s, None, layer, token_mask=m),
        policy=jax.checkpoint_policies.nothing_saveable,
    )
    x = model.embed(params.embed, inputs)
    total = None
    for i, p in enumerate(params.blocks):
        x, stats = block(p, x, segments, layer_input(model, i), token_mask)
        total = stats if total is None else add_layer_stats(total, stats)
    ce = head_loss(model, params.head, params.embed, x, window, weight)
    aux = model.aux_loss(total)
    coef = model.config.router_aux_loss_coef
    # A zero weight adds nothing, not 0 * aux: the gradients are the cross-entropy's alone.
    return (ce if coef == 0 else ce + coef * aux), (ce, aux)
