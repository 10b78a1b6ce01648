"""The per-block streaming schedule: forward, loss, and a rematerialised backward, one block at a time.

Compute-dtype weights of streamed blocks live in the accelerator's `pinned_host` memory. Units whose
state the accelerator keeps and updates pass their float32 masters as their weights: every compiled
unit casts its weights to the compute dtype before it gathers and uses them, which is the resident
trainer's arithmetic and costs one unit's compute-dtype copy while it runs. One step:

    forward   x = embed(tokens); for i in 0..L-1: fetch block i+1 (async); save x; x = block_i(x)
    head      loss and dL/dx for every micro-batch
    backward  for i in L-1..0: fetch block i-1 (async); recompute block_i from its saved input and
              backpropagate; block i's gradients leave for `pinned_host` at once; its input is freed
    embed     gradient of the embedding lookup (plus the tied head's share)

With `offload.activations=cpu` the saved block inputs wait in `pinned_host` instead: each leaves by an
asynchronous copy as soon as its block has been issued, and comes back one block ahead of the
backward pass that recomputes from it, so accelerator memory holds two block inputs, not L.

Each unit is its own small jitted function, compiled once: one compiled block forward and one block
backward serve every layer, so compile time does not grow with depth. The Python loop only issues
asynchronous work: a copy is issued `prefetch` accesses ahead of the compute that needs it, so it
overlaps the previous block's compute (JAX orders each compute after its inputs' copies), and each
block's gradient copy to the host overlaps the next block's backward.

What trains is the schedule's parameter (`jaxzero.offload.trains`): every parameter of each unit
(the offload engine), or a frozen part merged with a trainable one in each program (LoRA and
`finetune.freeze`, one micro-batch per pass: `grads_per_micro_batch`), where gradients are formed
only for what trains and the activations, and below the lowest block that trains no input is saved
and no backward runs.

Micro-batches are processed layer-major: every micro-batch passes block i before block i+1 starts,
so weights cross the link twice per optimizer step however large `grad_accum` is, and a block's
gradient is summed over micro-batches in float32 on the accelerator before it leaves.

Documents: where each document of a row attends only within itself, the caller passes the batch's
segment ids, int32 (A, mb, S) (`objective.document_segments`, made once per step, not per block) to
`loss` and `grads`, which hand them to every block forward and backward beside its activations; the
block programs are then compiled with that extra input (once each, as without it).

An auxiliary loss (experts' load balancing, `jaxzero.models.emits_stats`) is a function of ALL
layers' statistics summed: each block forward also returns its layer's (per micro-batch, a few
hundred bytes), the forward pass adds them, `aux_grad` turns the sum into the loss and its cotangent,
and every block backward takes that cotangent beside dy: exact, with no second forward pass (with a
coefficient of 0, the cross-entropy's backward alone); the rows' padding counts in none where `grads`
is given a token mask (`objective.real_tokens`). Dense models' programs have none of it.

Exactness: with one micro-batch, a block's gradient leaves in the compute dtype; that is exactly the
value the resident trainer upcasts (the gradient of `astype` is an upcast), so sending it narrow
loses nothing. With several micro-batches the float32 sum leaves, as the resident trainer keeps it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from jaxzero.models import Model, ModelParams, emits_stats, layer_input, run_block
from jaxzero.models.sizes import ties_output
from jaxzero.numerics import objective
from jaxzero.offload.host_memory import copy_to
from jaxzero.offload.timeline import StepClock, span
from jaxzero.offload.trains import EVERY, FrozenPart, WholeUnits
from jaxzero.plan import Tier
from jaxzero.plan.placement import DEVICE, PINNED_HOST, OffloadPlacement, batch_rows_sharding, replicated


def _f32(tree: Any) -> Any:
    return jax.tree.map(lambda x: x.astype(jnp.float32), tree)


def _sq_norm(tree: Any) -> jax.Array:
    """Sum of squares of all leaves, in float32 (one unit's share of the global norm; 0 where nothing
    of the unit trains)."""
    leaves = jax.tree.leaves(tree)
    if not leaves:
        return jnp.zeros((), jnp.float32)
    return sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in leaves)


def _accumulate(fn, xs: Sequence[jax.Array], init: Any):
    """Sum `fn(*x)`'s first output (a pytree, upcast to float32) over the leading axis of `xs`, and
    stack its second output. One micro-batch at a time, so only one micro-batch's activations live."""

    def body(acc, x):
        g, out = fn(*x)
        return jax.tree.map(lambda a, b: a + b.astype(jnp.float32), acc, g), out

    return jax.lax.scan(body, init, xs)


def resolve(unit: Any, position: int) -> Any:
    """A unit's weights: the value itself, or the result of a `Future` of it (a host sync: waits for
    the host update that produces them). `position`: the unit's in the forward pass, for the trace."""
    if not isinstance(unit, Future):
        return unit
    with span("wait_update", position):
        return unit.result()


def stream_blocks(
    blocks: Sequence[Any],
    order: Sequence[int],
    is_streamed: Callable[[int], bool],
    target: Any,
    depth: int,
    on_copy: Callable[[Any], Any] | None = None,
) -> Iterator[Any]:
    """Yield the accelerator copy of `blocks[i]` for each i in `order`, keeping up to `depth` further
    copies in flight: the one block prefetch of every engine. Blocks `is_streamed` says live in
    `pinned_host` are copied; resident blocks are yielded as they are; a block accessed twice in a
    row (the last block, where the forward pass turns into the backward pass) is reused, not copied
    again. A block may be a `Future` of its weights (still being updated on the host): it is waited
    for when its copy is issued, not before.

    Each copy is an asynchronous `device_put` from `pinned_host` to `target` (a tree of shardings in
    `device` memory: each device copies in its own shard), passed to `on_copy` as it is issued; the
    previous copy is released (and its accelerator memory freed) once the consumer moves on.
    """
    inflight: deque[Any] = deque()
    issued = 0
    last: tuple[int, Any] | None = None  # (block index, accelerator copy) of the newest issued access

    def issue() -> None:
        nonlocal issued, last
        i = order[issued]
        if last is not None and last[0] == i:
            w = last[1]
        elif is_streamed(i):
            weights = resolve(blocks[i], 1 + i)
            with span("h2d weights", 1 + i):
                w = copy_to(weights, target)  # async host -> accelerator DMA
            if on_copy is not None:
                on_copy(w)
        else:
            w = resolve(blocks[i], 1 + i)
        inflight.append(w)
        last = (i, w)
        issued += 1

    for k in range(len(order)):
        while issued < min(len(order), k + 1 + depth):
            issue()
        yield inflight.popleft()
    last = None


@dataclass(frozen=True, eq=False)
class UnitPrograms:
    """The per-unit computations the streaming schedule issues, each a pure function of its arrays
    (`StreamedModel` jits each once: one compiled block forward and one block backward serve every
    layer). A unit arrives as `trains` holds it (`jaxzero.offload.trains`): the full run's weights in
    their storage placement and dtype, each computation casting them to `compute` and all-gathering
    them; or a (frozen, trainable) pair merged as the model reads it. Gradients are taken with respect
    to what trains and the activations only. Activations keep micro-batch rows split over the mesh
    (`rows`); gradient sums leave reduce-scattered to one shard per device.

    whole:          per unit kind, the shardings of whole weights (`OffloadPlacement.whole`).
    grad_on_device: per unit kind, the shardings a gradient leaves the backward pass in.
    tied:           the head reads the embedding (its gradient gets the head's share).
    grad_accum:     micro-batches per step (A).
    trains:         what trains of each unit (`WholeUnits` or `FrozenPart`).
    stats:          the blocks emit an auxiliary loss's statistics (`jaxzero.models.emits_stats`).
    """

    model: Model
    whole: ModelParams
    grad_on_device: ModelParams
    mesh: Mesh
    compute: jnp.dtype
    tied: bool
    grad_accum: int
    trains: WholeUnits | FrozenPart = EVERY
    stats: bool = False

    def weights(self, unit: Any, whole_sharding: Any) -> Any:
        """The weights the model reads of `unit` (the compute-dtype weights gathered whole, or the
        frozen and trainable parts merged)."""
        return self.trains.join(*self.trains.split(unit, self.compute, whole_sharding))

    def rows(self, x: jax.Array) -> jax.Array:
        """Activations: micro-batch rows split over the devices."""
        return jax.lax.with_sharding_constraint(x, batch_rows_sharding(self.mesh, x.ndim))

    def embed(self, embed_w: Any, batch: jax.Array) -> jax.Array:
        """(A, mb, S+1) int32 -> (A, mb, S, D) activations."""
        m, embed_w = self.model, self.weights(embed_w, self.whole.embed)
        return self.rows(jax.lax.map(lambda w: m.embed(embed_w, objective.decode_window(w)[0]), batch))

    def block_fwd(
        self,
        w: Any,
        x: jax.Array,
        segments: jax.Array | None = None,
        keys: jax.Array | None = None,
        layer: Any = None,
        token_mask: jax.Array | None = None,
    ) -> jax.Array:
        """(A, mb, S, D) -> the same, through one block; attention within `segments` (int32
        (A, mb, S)) where given; dropout from `keys` ((A,) keys, one per micro-batch) where given;
        `layer`: the block's per-layer input (`jaxzero.models.layer_input`), an argument of the one
        program, or None. With `stats`: (y, the layer's statistics per micro-batch, leaves (A, ...)),
        over the tokens of `token_mask` (bool (A, mb, S)) where given."""
        m, w, stats = self.model, self.weights(w, self.whole.blocks), self.stats
        out = jax.lax.map(lambda a: _block(m, w, *a, layer, stats), (x, segments, keys, token_mask))
        return (self.rows(out[0]), out[1]) if stats else self.rows(out)

    def head_loss(self, head_w: Any, embed_w: Any, x: jax.Array, batch: jax.Array) -> jax.Array:
        """Float32 scalar: the step's mean over its counted targets."""
        m = self.model
        head_w, embed_w = self.weights(head_w, self.whole.head), self.weights(embed_w, self.whole.embed)
        weight = objective.step_weight(batch)
        losses = jax.lax.map(
            lambda a: objective.head_loss(m, head_w, embed_w, a[0], a[1], weight), (x, batch)
        )
        return jnp.mean(losses)

    def head_grad(
        self,
        head_w: Any,
        embed_w: Any,
        x: jax.Array,
        batch: jax.Array,
        loss_scale: jax.Array,
        weight: jax.Array | None = None,
    ) -> Any:
        """-> loss, d(loss_scale * L_a)/dx_a per micro-batch (each micro-batch's weighted loss,
        `objective.step_weight`, differentiated on its own, as the resident trainer does; `weight`,
        a float32 scalar, in its place where given), float32 head (and tied-embedding) gradient sums
        over micro-batches with respect to what trains, the head's squared norm."""
        m, tied, t = self.model, self.tied, self.trains
        fixed_h, head_w = t.split(head_w, self.compute, self.whole.head)
        fixed_e, embed_w = t.split(embed_w, self.compute, self.whole.embed)
        weight = objective.step_weight(batch) if weight is None else weight

        def one(xa, wa):
            def f(hw, ew, xa):
                return objective.head_loss(m, t.join(fixed_h, hw), t.join(fixed_e, ew), xa, wa, weight)

            loss, vjp = jax.vjp(f, head_w, embed_w, xa)
            g_head, g_embed, dx = vjp(loss_scale)  # the cotangent of the loss: 1, or float16's scale
            return (loss, _f32(g_head), _f32(g_embed) if tied else None), dx

        zeros = (
            jnp.zeros((), jnp.float32),
            _f32(jax.tree.map(jnp.zeros_like, head_w)),
            _f32(jax.tree.map(jnp.zeros_like, embed_w)) if tied else None,
        )
        (loss, g_head, g_embed), dx = _accumulate(one, (x, batch), zeros)
        g_head = t.scatter(g_head, self.grad_on_device.head)
        if g_embed is not None:
            g_embed = t.scatter(g_embed, self.grad_on_device.embed)
        return loss / x.shape[0], self.rows(dx), g_head, g_embed, _sq_norm(g_head)

    def aux_grad(
        self, total: Any, loss_scale: jax.Array, aux_weight: float = 1.0
    ) -> tuple[jax.Array, Any]:
        """Statistics summed over the layers (leaves (A, ...)) -> (mean over micro-batches of
        aux_weight * aux_a, float32; the cotangent loss_scale * coef * aux_weight * d aux_a / d
        total_a, or None where `router_aux_loss_coef` is 0)."""
        coef = self.model.config.router_aux_loss_coef
        aux, vjp = jax.vjp(jax.vmap(self.model.aux_loss), total)
        mean = jnp.sum(aux) * aux_weight / aux.shape[0]
        if coef == 0:
            return mean, None
        (g,) = vjp(jnp.broadcast_to(loss_scale * coef * aux_weight, aux.shape).astype(aux.dtype))
        return mean, g

    def block_bwd(
        self,
        w: Any,
        x: jax.Array,
        dy: jax.Array,
        segments: jax.Array | None = None,
        keys: jax.Array | None = None,
        layer: Any = None,
        d_stats: Any = None,
        token_mask: jax.Array | None = None,
    ) -> tuple[jax.Array, Any, jax.Array]:
        """Recompute block(w, x_a) and backpropagate dy_a for each micro-batch -> (dx, dw, |dw|^2),
        dw with respect to what trains; `segments`, `keys` and `token_mask` where given, as in the
        forward pass (`block_fwd`); `d_stats` (leaves (A, ...), `aux_grad`) the cotangent of the
        block's statistics where given."""
        m, t = self.model, self.trains
        fixed, w = t.split(w, self.compute, self.whole.blocks)
        stats = d_stats is not None

        def one(xa, dya, d_stats_a, *inputs_a):  # inputs_a: the micro-batch's segments, key, mask
            _, vjp = jax.vjp(lambda wb, xb: _block(m, t.join(fixed, wb), xb, *inputs_a, layer, stats), w, xa)
            return vjp((dya, d_stats_a) if stats else dya)

        per_batch = (x, dy, d_stats, segments, keys, token_mask)
        if x.shape[0] == 1:  # exact in the compute dtype; see the module docstring
            g, dx = one(*(jax.tree.map(lambda u: u[0], v) for v in per_batch))
            g = t.scatter(g, self.grad_on_device.blocks)
            return self.rows(dx[None]), g, _sq_norm(g)
        g, dx = _accumulate(one, per_batch, _f32(jax.tree.map(jnp.zeros_like, w)))
        g = t.scatter(g, self.grad_on_device.blocks)
        return self.rows(dx), g, _sq_norm(g)

    def embed_grad(
        self, embed_w: Any, batch: jax.Array, dx: jax.Array, g_from_head: Any
    ) -> tuple[Any, jax.Array]:
        """The embedding's float32 gradient sum with respect to what trains (plus the tied head's
        share) and its squared norm."""
        m, t = self.model, self.trains
        fixed, embed_w = t.split(embed_w, self.compute, self.whole.embed)

        def one(wa, dxa):
            _, vjp = jax.vjp(lambda ew: m.embed(t.join(fixed, ew), objective.decode_window(wa)[0]), embed_w)
            return vjp(dxa)[0], None

        g, _ = _accumulate(one, (batch, dx), _f32(jax.tree.map(jnp.zeros_like, embed_w)))
        g = t.scatter(g, self.grad_on_device.embed)
        if g_from_head is not None:
            g = jax.tree.map(jnp.add, g, g_from_head)
        return g, _sq_norm(g)

    def global_norm(self, sq_norms: list[jax.Array], loss_scale: jax.Array) -> jax.Array:
        """The norm of the mean gradient: of the sums / (A * loss_scale)."""
        return jnp.sqrt(sum(sq_norms[1:], sq_norms[0])) / (jnp.float32(self.grad_accum) * loss_scale)


class StreamedModel:
    """Loss and gradients of a model whose blocks are fetched per use. Built once; holds compiled units.

    Weights are a `ModelParams` placed by `placement` (embed/head on the accelerator, blocks on the
    accelerator or in `pinned_host`). With `trains=EVERY` they are the compute-dtype weights (or
    float32 masters), whole or one shard per device; each computation all-gathers the weights it
    uses, and gradients leave it reduce-scattered to one shard per device (`OffloadPlacement.split`).
    With a `FrozenPart` they are the frozen units in storage form, and each pass also takes the
    `trainable` part (a `ModelParams` on the accelerator, `{}` where a unit has none), merged with its
    frozen unit in each program. Batches are int32 (A, mb, S+1) on the accelerator, rows split over
    the mesh; activations stay split the same way.
    """

    def __init__(
        self,
        model: Model,
        placement: OffloadPlacement,
        grad_accum: int,
        prefetch: int = 1,
        trains: WholeUnits | FrozenPart = EVERY,
    ):
        self.model, self.placement, self.prefetch, self.trains = model, placement, prefetch, trains
        self.num_layers = model.config.num_layers
        self.tied = ties_output(model.config)
        self.accum = grad_accum
        shapes = jax.eval_shape(model.init, jax.random.key(0))  # global shapes
        self._to_host = _by_unit(shapes, lambda t: placement.split(t, PINNED_HOST))  # where gradients land
        # Units updated on the accelerator (`Tier.DEVICE` state) keep their gradients there.
        self._stays = [u.state is Tier.DEVICE for u in placement.plan.units]
        # A streamed block's accelerator copy.
        self._copy_in = trains.copy_target(placement.split(shapes.blocks[0], DEVICE))
        self.offloads_activations = placement.plan.offloads_activations
        # Gradients leave a backward pass split over the devices, in device memory.
        self.programs = programs = UnitPrograms(
            model=model,
            whole=_by_unit(shapes, placement.whole),
            grad_on_device=_by_unit(shapes, lambda t: placement.split(t, DEVICE)),
            mesh=placement.mesh,
            compute=jnp.dtype(placement.plan.compute_dtype),
            tied=self.tied,
            grad_accum=grad_accum,
            trains=trains,
            stats=emits_stats(model),
        )
        self.stats = programs.stats
        # Each jitted once, here: every call of a unit kind reuses its compiled program.
        self._embed = jax.jit(programs.embed)
        self._block_fwd = jax.jit(programs.block_fwd)
        self._head_loss = jax.jit(programs.head_loss)
        self._head_grad = jax.jit(programs.head_grad)
        self._aux_grad = jax.jit(programs.aux_grad, static_argnames=("aux_weight",))  # a Python float
        # The incoming gradient is consumed here: donating it lets the outgoing one reuse its memory.
        self._block_bwd = jax.jit(programs.block_bwd, donate_argnums=(2,))
        self._embed_grad = jax.jit(programs.embed_grad)
        self._global_norm = jax.jit(programs.global_norm)
        self._add = jax.jit(lambda a, b: jax.tree.map(jnp.add, a, b), donate_argnums=(0,))
        self._micro_weight = jax.jit(lambda b: objective.step_weight(b) / b.shape[0])
        # Each block's per-layer input (None for models without one), made once, on every device.
        everywhere = replicated(placement.mesh)
        self._layers = [jax.device_put(layer_input(model, i), everywhere) for i in range(self.num_layers)]

    def loss(
        self,
        weights: ModelParams,
        batch: jax.Array,
        segments: jax.Array | None = None,
        trainable: ModelParams | None = None,
    ) -> jax.Array:
        """Mean loss over int32 (A, mb, S+1) with weights streamed once through; float32 scalar.
        Units of `weights` may be `Future`s (see `stream_blocks`). `segments`: int32 (A, mb, S), each
        document attending within itself, or None (attention across each row). `trainable`: what
        trains beside a frozen part (`FrozenPart`), else None."""
        unit, tr = self.trains.unit, _trainable_or_none(trainable, self.num_layers)
        embed_w = unit(resolve(weights.embed, 0), tr.embed)
        x = self._embed(embed_w, batch)
        blocks = stream_blocks(
            weights.blocks, range(self.num_layers), self.placement.is_streamed, self._copy_in, self.prefetch
        )
        for i, w in enumerate(blocks):
            x = self._block_fwd(unit(w, tr.blocks[i]), x, segments, None, self._layers[i])
            if self.stats:  # the loss evaluated is the cross-entropy: the statistics are not read
                x = x[0]
        head_w = unit(resolve(weights.head, self.num_layers + 1), tr.head)
        return self._head_loss(head_w, embed_w, x, batch)

    def grads(
        self,
        weights: ModelParams,
        batch: jax.Array,
        loss_scale: jax.Array,
        clock: StepClock | None = None,
        segments: jax.Array | None = None,
        *,
        trainable: ModelParams | None = None,
        keys: jax.Array | None = None,
        weight: jax.Array | None = None,
        aux_weight: float = 1.0,
        token_mask: jax.Array | None = None,
    ) -> tuple[jax.Array, ModelParams, jax.Array, jax.Array | None]:
        """Loss, gradients, their global norm and the auxiliary loss over int32 (A, mb, S+1);
        gradients land in `pinned_host` (those of units whose state is on the accelerator stay there,
        one shard per device).

        Block gradients are summed over the A micro-batches (compute dtype if A == 1, float32 if A > 1);
        embed and head gradients are float32 sums. `loss_scale` (float32 scalar on the accelerator)
        multiplies the loss: 1, or float16's loss scale. Divide by A * loss_scale for the mean
        gradient (the host optimizer does). The norm (float32 scalar on the accelerator) is the L2
        norm of the mean gradient, computed on the accelerator from each unit's gradient before it
        leaves.

        Units of `weights` may be `Future`s of their weights (`stream_blocks`): each is waited for only
        when the pass reaches it. `clock`, if given, records when each copy and computation finished.
        `segments`: int32 (A, mb, S), each document attending within itself, or None (attention across
        each row); every block's forward and backward reads the same array.

        With a `FrozenPart`: `trainable` is what trains beside it, and the gradients have its
        structure; below the lowest block that trains no input is saved and no backward runs (those
        blocks' gradients are `{}`), nor the embedding's where it does not train. `keys`: dropout
        keys, (L, A) (block i's forward and backward read row i), or None. `weight`: the float32
        weight of each micro-batch's summed cross-entropy, where a caller passes the step's batch one
        micro-batch at a time (default `objective.step_weight(batch)`).

        Where blocks emit statistics (`stats`), each micro-batch's objective adds coef * `aux_weight`
        * its auxiliary loss, and the fourth value is the mean over micro-batches of `aux_weight` *
        aux (float32 scalar on the accelerator); else None, over the tokens of `token_mask` (bool
        (A, mb, S), False at the rows' padding: `objective.real_tokens`) where given.
        """
        clock = clock or StepClock.off()
        unit, tr = self.trains.unit, _trainable_or_none(trainable, self.num_layers)
        num_layers, low = self.num_layers, self.trains.lowest_block
        order = [*range(num_layers), *reversed(range(low, num_layers))]
        streamed = self.placement.is_streamed
        fetched = stream_blocks(
            weights.blocks, order, streamed, self._copy_in, self.prefetch, on_copy=clock.copied
        )
        keys = [None] * num_layers if keys is None else keys
        with clock.waiting():
            embed_w = unit(resolve(weights.embed, 0), tr.embed)
        x = clock.computed(self._embed(embed_w, batch))
        saved: list[jax.Array | None] = []
        rows = batch_rows_sharding(self.placement.mesh, x.ndim)
        away = rows.with_memory_kind(PINNED_HOST) if self.offloads_activations else None
        total = None  # the statistics summed over the blocks so far (`stats`)
        for i in range(num_layers):
            with clock.waiting():
                w = unit(next(fetched), tr.blocks[i])
            y = clock.computed(self._block_fwd(w, x, segments, keys[i], self._layers[i], token_mask))
            if self.stats:
                y, layer_stats = y
                total = layer_stats if total is None else self._add(total, layer_stats)
            # The block input is all the backward pass keeps: here, or in pinned_host (async DMA,
            # issued after the block that reads it, so it overlaps that block). The last block's
            # stays: the backward pass starts with it. Below the lowest block that trains, nothing.
            if i < low:
                saved.append(None)
            elif away is None or i == num_layers - 1:
                saved.append(x)
            else:
                with span("d2h activation", 1 + i):
                    saved.append(copy_to(x, away))
            x = y
        with clock.waiting():
            head_w = unit(resolve(weights.head, num_layers + 1), tr.head)
        loss, dx, g_head, g_embed_head, sq_head = self._head_grad(
            head_w, embed_w, x, batch, loss_scale, weight
        )
        clock.computed(loss)
        aux, d_stats = (None, None)
        if self.stats:
            aux, d_stats = self._aux_grad(total, loss_scale, aux_weight=aux_weight)
        del x
        to_host = self._to_host
        block_grads: list[Any] = [{}] * low + [None] * (num_layers - low)  # nothing trains below `low`
        sq = [sq_head]
        x_next = _back(saved, num_layers - 1, rows) if low < num_layers else None
        for i in reversed(range(low, num_layers)):
            w = unit(next(fetched), tr.blocks[i])
            x_i, x_next = x_next, _back(saved, i - 1, rows) if i > low else None  # one block ahead of its use
            dx, g, sq_i = self._block_bwd(w, x_i, dx, segments, keys[i], self._layers[i], d_stats, token_mask)
            del x_i
            clock.computed(sq_i)
            sq.append(sq_i)
            saved[i] = None
            block_grads[i] = self._leave(1 + i, g, to_host.blocks, clock)  # the DMA overlaps block i-1
        if self.trains.embed:
            g_embed, sq_embed = self._embed_grad(embed_w, batch, dx, g_embed_head)
            clock.computed(sq_embed)
            sq.append(sq_embed)
        else:  # the embedding has nothing that trains: its lookup's gradient is never formed
            g_embed = {}
        grads = ModelParams(
            embed=self._leave(0, g_embed, to_host.embed, clock),
            blocks=tuple(block_grads),
            head=self._leave(num_layers + 1, g_head, to_host.head, clock),
        )
        return loss, grads, self._global_norm(sq, loss_scale), aux

    def grads_per_micro_batch(
        self,
        weights: ModelParams,
        batch: jax.Array,
        loss_scale: jax.Array,
        *,
        trainable: ModelParams,
        segments: Callable[[jax.Array], jax.Array | None],
        keys: Callable[[int], jax.Array | None],
        token_mask: Callable[[jax.Array], jax.Array | None],
    ) -> tuple[jax.Array, ModelParams, jax.Array | None]:
        """Loss and gradient of what trains beside a frozen part (`FrozenPart`) over int32
        (A, mb, S+1), one pass of the schedule per micro-batch: only one micro-batch's activations
        live (a streamed base crosses the link twice per micro-batch). Each micro-batch's summed
        cross-entropy is weighted by the step's counted targets (`objective.step_weight`), so the
        loss (float32 scalar) and the gradients (float32, added on the accelerator) are the step's
        means. `segments(window)`, `keys(a)`, `token_mask(window)`: micro-batch a's segment ids,
        dropout keys and statistics' token mask (or None). The third value: the mean auxiliary loss
        over the micro-batches (each pass's weighted by 1/A, as its objective's share is), or None."""
        weight = self._micro_weight(batch)
        aux_weight = 1.0 / batch.shape[0]
        grads, loss, aux = None, None, None
        for a in range(batch.shape[0]):
            window = batch[a : a + 1]
            part, g, _, aux_part = self.grads(
                weights,
                window,
                loss_scale,
                segments=segments(window),
                trainable=trainable,
                keys=keys(a),
                weight=weight,
                aux_weight=aux_weight,
                token_mask=token_mask(window),
            )
            grads = g if grads is None else self._add(grads, g)
            loss = part if loss is None else loss + part
            if aux_part is not None:
                aux = aux_part if aux is None else aux + aux_part
        return loss, grads, aux

    def _leave(self, position: int, g: Any, target: Any, clock: StepClock) -> Any:
        """A unit's gradient: an async DMA to `target` in pinned_host, or kept on the accelerator
        where its state is updated there."""
        if self._stays[position]:
            return g
        with span("d2h grad", position):
            return clock.sent(copy_to(g, target))


def _block(model: Model, w: Any, x: jax.Array, segments: Any, key: Any, mask: Any, layer: Any, stats: bool):
    """`run_block` with the inputs a micro-batch has (a model of one's own may take fewer)."""
    return run_block(model, w, x, segments, layer, dropout_key=key, stats=stats, token_mask=mask)


def _trainable_or_none(trainable: ModelParams | None, num_layers: int) -> ModelParams:
    """`trainable`, or None for every unit (the full run, whose units are their weights)."""
    if trainable is not None:
        return trainable
    return ModelParams(None, (None,) * num_layers, None)


def _back(saved: list[jax.Array | None], i: int, rows: Any) -> jax.Array:
    """Block i's saved input on the accelerator: as it is, or an async copy back from pinned_host to
    `rows` (the activations' sharding in device memory)."""
    x = saved[i]
    if x.sharding.memory_kind != PINNED_HOST:
        return x
    with span("h2d activation", 1 + i):
        return copy_to(x, rows)


def _by_unit(shapes: ModelParams, f: Callable[[Any], Any]) -> ModelParams:
    """`f` of each unit kind's shapes (the first block's for every block): per kind, not per block."""
    return ModelParams(f(shapes.embed), f(shapes.blocks[0]), f(shapes.head))
