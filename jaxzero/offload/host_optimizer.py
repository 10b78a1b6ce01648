"""The optimizer on the host: the fp32 masters and optimizer state never leave host RAM.

The update runs one unit at a time (embedding, each block, head), so a unit's new compute-dtype
weights can start their way back to the accelerator while the next unit updates, and so units can be
updated in the order the next forward pass needs them (`jaxzero.offload.pipeline`). For one unit:

    gradients:  read in place from `pinned_host` (a NumPy view, no copy)
    scale:      1 / (grad_accum * loss scale), times optax's clipping factor for the global norm
    update:     the fused single-pass kernels of `host_kernels` where they cover the optimizer (AdamW,
                Adam, Lion, SGD; float32 or bfloat16 moments), in place, in chunks on all cores;
                otherwise (or with `offload.fused_update=false`, or a researcher's own optax
                transformation) the optax transformation itself, jitted on XLA:CPU with the state
                donated, one unit per call, many units at once.
                The fused update can also run in two passes (`update_weights`, then `commit`).
    way back:   the fused kernels write the new compute-dtype weights straight into `pinned_host`:
                into the previous weights' buffers for streamed blocks (recycled step to step), or
                into a staging buffer one DMA away from the accelerator for resident units

Optimizer state is one optax state per unit, kept in `ModelParams` layout (embed, blocks, head); the
fused kernels keep that state bit-compatible with optax's, so checkpoints do not care which ran.

Writing the weights into `pinned_host` directly avoids a copy per step (NumPy -> `pinned_host`) and
the CPU backend's slow cross-client path; the optax path still places its result with one
`device_put` per leaf (`host_memory.place`).
"""

from __future__ import annotations

import itertools
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxzero.config import OptimizerConfig
from jaxzero.models import ModelParams
from jaxzero.numerics.optim import reported_rate, scaled_update, unit_optimizers, weight_decay_mask
from jaxzero.offload import host_kernels as hk
from jaxzero.offload.host_kernels import Pass
from jaxzero.offload.host_memory import PinnedStaging, copy_to, host_view, local_shards, place, release
from jaxzero.offload.timeline import span
from jaxzero.plan import Tier, UnitKind, UnitPlan
from jaxzero.plan.placement import PINNED_HOST, OffloadPlacement


class HostUnit(NamedTuple):
    """One unit (embedding, a block or the head) of the offload engine's state.

    params:    float32 masters, CPU backend: this process's block of each (`OffloadPlacement.local_rows`).
    opt_state: the unit's optax state, CPU backend, in the same blocks.
    weights:   compute-dtype weights, global arrays over the mesh in accelerator memory or its
               `pinned_host` memory (`OffloadPlacement.written`).
    """

    params: Any
    opt_state: Any
    weights: Any


class UnitUpdate(NamedTuple):
    """One unit's update, as every pass of `HostOptimizer` takes it.

    unit:   which unit it is (kind, block index, position) and where its arrays live.
    arrays: its masters and optax state (consumed: updated in place) and old weights.
    grads:  the unit's gradient sums as host-readable arrays: per leaf, a list of NumPy views of
            `pinned_host`, one per piece of the process's block (`OffloadPlacement.pieces`).
    gmul:   `HostOptimizer.grad_multiplier`'s factor (averaging, loss scale and clipping in one).
    """

    unit: UnitPlan
    arrays: HostUnit
    grads: Any
    gmul: np.float32


class PriorityPool:
    """Threads that run submitted functions lowest priority first (ties: first come, first served).

    The host update's work items are prioritised by the position of their unit in the next forward
    pass, so whatever the order gradients arrive in, the embedding and block 0 finish first."""

    def __init__(self, threads: int, name: str):
        self._queue: queue.PriorityQueue = queue.PriorityQueue()
        self._seq = itertools.count()
        for k in range(threads):
            threading.Thread(target=self._work, name=f"{name}-{k}", daemon=True).start()

    def submit(self, priority: Any, fn: Callable[..., Any], *args: Any) -> Future:
        """Run `fn(*args)` on the pool; `priority` is any comparable value (lowest runs first)."""
        fut: Future = Future()
        self._queue.put((priority, next(self._seq), fn, args, fut))
        return fut

    def _work(self) -> None:
        while True:
            _, _, fn, args, fut = self._queue.get()
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn(*args))
            except BaseException as e:  # handed to whoever waits on the future
                fut.set_exception(e)


class HostOptimizer:
    """The configured optimizer applied on the host, one unit at a time.

    masters:   float32 `ModelParams` on `placement.host` (the CPU backend), this process's block of
               each array (`masters_shape` holds the global shapes).
    opt_state: `ModelParams`-shaped tuple of per-unit optax states, on the host device.
    grads:     per unit, gradient *sums* over `grad_accum` micro-batches of `scale * loss`, in
               `pinned_host` (`plan.grad_dtype` for blocks, float32 for embedding and head); the
               update divides by both.
    weights:   the compute-dtype weights it writes, where `placement.written` puts each unit.
    custom:    a researcher's own transformation, applied to each unit alone in place of the named
               one (the plan's host update must be optax's: the fused kernels are the named ones').
    updates:   the updates the run makes (its `steps`), when more than the schedule spans (a resume
               that extends `steps` keeps its schedule): the kernels they need are compiled at start.
    Whether the fused kernels or optax on XLA:CPU run, and on how many threads, is the offload
    plan's (`placement.plan.host_update`).
    """

    def __init__(
        self,
        cfg: OptimizerConfig,
        total_steps: int,
        masters_shape: ModelParams,
        placement: OffloadPlacement,
        grad_accum: int,
        *,
        custom: optax.GradientTransformation | None = None,
        updates: int = 0,
    ):
        plan = placement.plan
        update = plan.host_update
        if update is None:
            raise ValueError(
                "the plan keeps every unit's state on the accelerator: nothing to update on the host"
            )
        if custom is not None and update.fused:
            raise ValueError(
                "the fused host kernels implement only the named optimizers: a plan for an optax "
                "transformation of one's own updates on optax's path (`context.optax_host_update`)"
            )
        self.placement = placement
        self.masters_shape = masters_shape
        self.compute_dtype = jnp.dtype(plan.compute_dtype)
        self.grad_accum = grad_accum
        self.max_norm = cfg.grad_clip
        self.schedule = reported_rate(cfg, total_steps, custom)
        mask = weight_decay_mask(masters_shape, cfg.decay_norms_biases_embeddings)
        self._decay = ModelParams(
            embed=jax.tree.map(lambda m: cfg.weight_decay if m else 0.0, mask.embed),
            blocks=jax.tree.map(lambda m: cfg.weight_decay if m else 0.0, mask.blocks[0]),
            head=jax.tree.map(lambda m: cfg.weight_decay if m else 0.0, mask.head),
        )
        self.tx = unit_optimizers(cfg, total_steps, masters_shape, custom)
        self.rule = hk.FusedRule.of(cfg) if update.fused else None
        self.threads = update.threads
        self.pool = PriorityPool(self.threads, "jaxzero-host-update")
        self._io = ThreadPoolExecutor(self.threads, thread_name_prefix="jaxzero-writeback")
        self._staging = PinnedStaging()
        self.warmed_up: list[Future] = []
        if self.rule is not None:  # compile (or load) the kernels while the model initialises
            moment = jnp.dtype(cfg.state_dtype)
            # Block gradients arrive in `plan.grad_dtype`, embedding and head gradients in float32.
            grad_dtypes = dict.fromkeys([np.dtype(jnp.dtype(plan.grad_dtype)), np.dtype(jnp.float32)])
            # Every kernel the run reaches: to its last update (a resume may run past the schedule).
            counts = self.rule.kernel_counts(0, max(total_steps, updates, 1) - 1)
            self.warmed_up = [
                self._io.submit(hk.warm_up, self.rule, g, moment, self.compute_dtype, counts=counts)
                for g in grad_dtypes
            ]
        host = placement.host

        def make_update(tx: optax.GradientTransformation):
            def update(masters, opt_state, grads, gmul):
                masters, opt_state = scaled_update(tx, masters, opt_state, grads, gmul)
                weights = jax.tree.map(lambda p: p.astype(self.compute_dtype), masters)
                return masters, opt_state, weights

            # Masters and state are updated in place (donated); everything runs on the host device.
            return jax.jit(update, donate_argnums=(0, 1), out_shardings=host)

        self._update = ModelParams(
            embed=make_update(self.tx.embed),
            blocks=make_update(self.tx.blocks),
            head=make_update(self.tx.head),
        )
        self._init = ModelParams(
            embed=jax.jit(self.tx.embed.init, out_shardings=host),
            blocks=jax.jit(self.tx.blocks.init, out_shardings=host),
            head=jax.jit(self.tx.head.init, out_shardings=host),
        )
        self._cast = jax.jit(
            lambda p: jax.tree.map(lambda x: x.astype(self.compute_dtype), p), out_shardings=host
        )
        self._lr = jax.jit(lambda step: jnp.asarray(self.schedule(step), jnp.float32))
        self._rates: dict[int, float] = {}  # update number -> its rate, the last few
        self._rates_lock = threading.Lock()

    def shapes_of(self, unit: UnitPlan) -> Any:
        """The global shapes (`ShapeDtypeStruct`s of the float32 masters) of `unit`'s arrays."""
        s = self.masters_shape
        return {UnitKind.EMBED: s.embed, UnitKind.BLOCK: s.blocks[unit.block or 0], UnitKind.HEAD: s.head}[
            unit.kind
        ]

    @property
    def fused(self) -> bool:
        """Whether updates run as the fused host kernels (else as optax on XLA:CPU)."""
        return self.rule is not None

    # -- state ---------------------------------------------------------------------------------------

    def init(self, masters: ModelParams) -> ModelParams:
        """Per-unit optimizer state for host-resident float32 masters, created on the host (None for a
        unit whose state the plan keeps on the accelerator)."""
        fresh = ModelParams(self._init.embed, self._init.blocks, self._init.head)
        return self._per_host_unit(lambda unit, m: getattr(fresh, unit.kind.value)(m), masters)

    def state_shapes(self) -> ModelParams:
        """Every unit's optimizer-state shapes (global `ShapeDtypeStruct`s), wherever it lives."""
        i = self._init
        return jax.eval_shape(
            lambda m: ModelParams(i.embed(m.embed), tuple(i.blocks(b) for b in m.blocks), i.head(m.head)),
            self.masters_shape,
        )

    def init_unit(self, unit: UnitPlan, masters: Any) -> Any:
        """Fresh optimizer state of one host-updated unit from its host masters (CPU backend)."""
        return getattr(self._init, unit.kind.value)(masters)

    def place_weights(self, unit: UnitPlan, masters: Any) -> Future:
        """A Future of `unit`'s compute-dtype weights cast from its host masters and placed per
        `placement.written` (cast and copied on a background thread)."""
        shapes = self.shapes_of(unit)
        return self._io.submit(
            lambda: place(self._cast(masters), self.placement.written(unit, shapes), shapes)
        )

    def _per_host_unit(self, fn: Callable[[UnitPlan, Any], Any], tree: ModelParams) -> ModelParams:
        """`fn(unit, tree's unit)` for each unit the host updates (state in host RAM or on disk), None
        for the others."""
        units = self.placement.plan.units
        out = [fn(u, x) if u.state in (Tier.HOST, Tier.DISK) else None for u, x in zip(units, tree.units())]
        return ModelParams.from_units(out)

    # -- the update ----------------------------------------------------------------------------------

    def grad_multiplier(self, norm: np.float32 | None, scale: np.float32) -> np.float32:
        """The factor taking gradient sums to the clipped mean gradient: 1 / (grad_accum * scale),
        then optax's `clip_by_global_norm` rule (x / norm * max_norm when norm >= max_norm).
        `norm=None`: the factor if no clipping applies."""
        f32 = np.float32
        gmul = f32(1.0) / f32(self.grad_accum) / f32(scale)
        if norm is not None and not self.unclipped(norm):
            gmul = gmul / f32(norm) * f32(self.max_norm)
        return f32(gmul)

    def unclipped(self, norm: np.float32) -> bool:
        """Whether optax's rule leaves a gradient of global norm `norm` as it is (False for NaN)."""
        return self.max_norm <= 0 or bool(np.float32(norm) < np.float32(self.max_norm))

    def update_unit(self, u: UnitUpdate, priority: Any, recycle: Any = None) -> HostUnit:
        """One optimizer step of one unit. Blocking; call it from a worker thread.

        priority: orders this work among the other units' on the host pool (lowest first).
        recycle:  compute-dtype weights no longer read by anyone (the caller hands them over): their
                  `pinned_host` buffers receive the new weights; accelerator ones are freed first.
        Returns the updated unit with its new weights placed per `placement.written`.
        """
        if self.rule is None:
            release(recycle)
            return self._optax_update(u, priority)
        count = _count(u.arrays.opt_state)  # host sync (a scalar already on the host)
        weights = self._fused(u, count, priority, Pass.FULL, recycle=recycle)
        return HostUnit(u.arrays.params, _advance(u.arrays.opt_state, count), weights)

    def update_weights(self, u: UnitUpdate, priority: Any, recycle: Any = None) -> Any:
        """The first pass of a two-pass update (fused kernels only): the unit's new compute-dtype
        weights, placed, reading but not writing its masters and state (p, m, v, g read; only the
        weights written: 16 of the 28 bytes per parameter of a whole AdamW update). `commit` with the
        same `u` applies the update itself later. Arguments as `update_unit`."""
        count = _count(u.arrays.opt_state)
        return self._fused(u, count, priority, Pass.WEIGHTS, recycle=recycle)

    def commit(self, u: UnitUpdate, priority: Any, weights: Any) -> HostUnit:
        """The second pass of a two-pass update: masters and state updated in place with the same
        arithmetic as `update_weights(u, ...)` (so the same bits as `update_unit`); `weights` are
        its result."""
        count = _count(u.arrays.opt_state)
        self._fused(u, count, priority, Pass.STATE)
        return HostUnit(u.arrays.params, _advance(u.arrays.opt_state, count), weights)

    def _optax_update(self, u: UnitUpdate, priority: Any) -> HostUnit:
        update = getattr(self._update, u.unit.kind.value)
        # NumPy views of the process's pieces -> its block on the CPU backend
        local = jax.tree.map(lambda v: np.concatenate(v) if len(v) > 1 else v[0], u.grads, is_leaf=_is_pieces)
        g = jax.device_put(local, self.placement.host)
        gm = jax.device_put(np.float32(u.gmul), self.placement.host)
        # Ordered with the other units' work; the XLA:CPU call itself uses XLA's own threads.
        run = lambda: jax.block_until_ready(update(u.arrays.params, u.arrays.opt_state, g, gm))  # noqa: E731
        params, opt_state, weights = self.pool.submit(priority, run).result()  # host sync
        shapes = self.shapes_of(u.unit)
        with span("h2d new weights", u.unit.position):  # placed, waited for
            weights = place(weights, self.placement.written(u.unit, shapes), shapes)
        return HostUnit(params, opt_state, weights)

    def _fused(self, u: UnitUpdate, count: int, priority: Any, pass_: Pass, recycle=None) -> Any:
        """One pass of the fused kernels over every leaf of `u.arrays`, chunked onto the pool. Returns
        the new weights, placed (None for `STATE`)."""
        rule = self.rule
        p_leaves, treedef = jax.tree.flatten(u.arrays.params)
        shapes = self.shapes_of(u.unit)
        shape_leaves = [np.shape(x) for x in treedef.flatten_up_to(shapes)]
        g_leaves = treedef.flatten_up_to(u.grads)

        opt_state = u.arrays.opt_state
        m_leaves = [treedef.flatten_up_to(optax.tree_utils.tree_get(opt_state, n)) for n in rule.moments()]
        decay = treedef.flatten_up_to(getattr(self._decay, u.unit.kind.value))
        kernel = rule.kernel(count, self.rate(count), u.gmul, pass_)
        streamed = u.unit.weights is Tier.PINNED_HOST
        dst = None
        if pass_ is not Pass.STATE:
            if streamed and recycle is not None:
                dst = treedef.flatten_up_to(recycle)  # the old weights' pinned buffers, written in place
            else:
                release(recycle)  # accelerator weights (freed before the new ones arrive), or none
                staging = treedef.flatten_up_to(self.placement.split(shapes, PINNED_HOST))
                dst = [self._staging.take(sh, self.compute_dtype, t) for sh, t in zip(shape_leaves, staging)]
        work, copies = [], []
        for k, p in enumerate(p_leaves):
            # The process's block of this array, piece by piece: one piece per local device's shard
            # (gradient and weights shards), or one piece of all rows for a replicated array.
            pieces = self.placement.pieces(shape_leaves[k])
            row = int(np.prod(shape_leaves[k][1:], dtype=np.int64)) if shape_leaves[k] else 1
            full = [hk.writable_view(p)] + [hk.writable_view(m[k]) for m in m_leaves]
            out_shards = None if dst is None else [hk.writable_view(x) for x in local_shards(dst[k])]
            if out_shards is not None and len(out_shards) > len(pieces):  # replicated: one copy written
                copies.append((out_shards[0], out_shards[1:]))
            for j, rows in enumerate(pieces):
                lo, hi = (0, full[0].size) if rows == slice(None) else (rows.start * row, rows.stop * row)
                views = [v[lo:hi] for v in full]
                views += [hk.readable_view(g_leaves[k][j]), None if out_shards is None else out_shards[j]]
                for s in hk.chunks(hi - lo):
                    args = [None if v is None else v[s] for v in views]
                    work.append(self.pool.submit(priority, kernel, *args, decay[k]))
        for f in work:
            f.result()  # host sync: this pass over the unit is done
        for first, others in copies:  # every device's copy of a replicated array gets the same bits
            for other in others:
                np.copyto(other, first)
        if dst is None:
            return None
        weights = jax.tree.unflatten(treedef, dst)
        if streamed:
            return weights
        # Accelerator weights: one DMA per device from the pinned staging buffers (a host sync: they
        # are reused); they stay one shard per device (`OffloadPlacement.written`).
        with span("h2d new weights", u.unit.position):
            weights = jax.block_until_ready(copy_to(weights, self.placement.written(u.unit, shapes)))
        self._staging.give(dst)
        return weights

    def rate(self, count: int) -> float:
        """The learning rate of update number `count`, as float32 arithmetic on the host device gives
        it. Computed once per count (every unit of a step shares it), so that the units' updates do
        not each run the schedule on XLA:CPU once the norm is known, where their threads contend for
        the GIL with the kernels' workers. A host sync the first time."""
        with self._rates_lock:
            if count not in self._rates:
                # The rate on the host device: a NumPy scalar would go to the default device, the
                # accelerator, and reading it back would wait behind the whole queued backward pass.
                step = jax.device_put(np.int32(count), self.placement.host)
                self._rates = {c: r for c, r in self._rates.items() if c >= count - 2}
                self._rates[count] = float(host_view(self._lr(step)))  # host sync
            return self._rates[count]

    def prepare(self, unit: HostUnit) -> None:
        """Compute what `unit`'s next update needs and does not depend on its gradients (its rate),
        ahead of them: the pipeline calls it while the backward pass runs. Nothing under optax's
        path, whose jitted update computes its own."""
        if self.rule is not None:
            self.rate(_count(unit.opt_state))  # host sync (the count: a scalar already on the host)

    def lr(self, step: jax.Array) -> jax.Array:
        """The learning rate of update number `step` (int32 scalar, on the device it lives on)."""
        return self._lr(step)


def _is_pieces(x: Any) -> bool:
    return isinstance(x, list)


def _count(opt_state: Any) -> int:
    """Updates applied so far: optax's int32 step count (every count in these states agrees)."""
    for x in jax.tree.leaves(opt_state):
        if _is_count(x):
            return int(host_view(x))
    raise ValueError("this optimizer state holds no step count")


def _is_count(x: jax.Array) -> bool:
    return x.ndim == 0 and x.dtype == np.int32


def _advance(opt_state: Any, count: int) -> Any:
    """`opt_state` with its step counts at `count` + 1 (new scalars; saturating, as optax's)."""
    new_count = np.int32(min(count + 1, np.iinfo(np.int32).max))

    def advance(x: Any) -> Any:
        if not _is_count(x):
            return x
        if isinstance(x, np.ndarray):  # a disk unit's state, in its host buffer: written in place
            x[...] = new_count
            return x
        return jax.device_put(new_count, x.sharding)

    return jax.tree.map(advance, opt_state)
