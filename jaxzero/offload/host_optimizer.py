"""The optimizer on the host: the fp32 masters and optimizer state never leave host RAM.

The update runs one unit at a time (embedding, each block, head), so a unit's new compute-dtype
weights can start their way back to the accelerator while the next unit updates, and so units can be
updated in the order the next forward pass needs them (`jaxzero.offload.pipeline`). For one unit:

    gradients:  read in place from `pinned_host` (a NumPy view, no copy)
    scale:      1 / (grad_accum * loss scale), times optax's clipping factor for the global norm
    update:     the fused single-pass kernels of `host_kernels` where they cover the optimizer (AdamW,
                Adam, Lion, SGD; float32 or bfloat16 moments), in place, in chunks on all cores;
                otherwise (or with `offload.fused_update=false`) the optax transformation itself,
                jitted on XLA:CPU with the state donated, one unit per call, many units at once.
                The fused update can also run in two passes (`update_weights`, then `commit`).
    way back:   the fused kernels write the new compute-dtype weights straight into `pinned_host`:
                into the previous weights' buffers for streamed blocks (recycled step to step), or
                into a staging buffer one DMA away from the accelerator for resident units

Optimizer state is one optax state per unit, kept in `ModelParams` layout (embed, blocks, head); the
fused kernels keep that state bit-compatible with optax's, so checkpoints do not care which ran.

Writing the weights into `pinned_host` directly avoids a copy per step (NumPy -> `pinned_host`, 4
bytes of memory traffic per parameter, ~9 GB/s per thread) and the CPU backend's slow cross-client
path; the optax path still places its result with one `device_put` per leaf (`place`).
"""

from __future__ import annotations

import itertools
import os
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxzero.config import OptimizerConfig
from jaxzero.models import ModelParams
from jaxzero.optim import build_optimizer, learning_rate_schedule, weight_decay_mask
from jaxzero.placement import OffloadPlacement


class HostUnit(NamedTuple):
    """One unit (embedding, a block or the head) of the offload engine's state.

    params:    float32 masters, CPU backend.
    opt_state: the unit's optax state, CPU backend.
    weights:   compute-dtype weights, accelerator memory or its `pinned_host` memory.
    """

    params: Any
    opt_state: Any
    weights: Any


class UnitUpdate(NamedTuple):
    """One unit's update, as every pass of `HostOptimizer` takes it.

    kind:  "embed", "blocks" or "head"; `block` is the block index (None for embed and head).
    unit:  its masters and optax state (consumed: updated in place) and old weights.
    grads: the unit's gradient sums as host-readable arrays (NumPy views of `pinned_host`).
    gmul:  `HostOptimizer.grad_multiplier`'s factor (averaging, loss scale and clipping in one).
    """

    kind: str
    block: int | None
    unit: HostUnit
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


class _Staging:
    """Reusable compute-dtype buffers in `pinned_host`, by shape and dtype. The fused kernels write a
    unit's new weights straight into pinned memory: streamed blocks keep them there (their buffers
    are recycled step to step), weights that live on the accelerator are one DMA away from such a
    staging buffer, which then comes back here."""

    def __init__(self, pinned):
        self._pinned = pinned
        self._free: dict[tuple[tuple[int, ...], np.dtype], list[jax.Array]] = {}
        self._lock = threading.Lock()

    def take(self, shape: tuple[int, ...], dtype: np.dtype) -> jax.Array:
        with self._lock:
            free = self._free.get((tuple(shape), np.dtype(dtype)))
            if free:
                return free.pop()
        # A new buffer: a copy of zeros, once per buffer (later steps reuse it).
        return jax.block_until_ready(jax.device_put(np.zeros(shape, dtype), self._pinned))

    def give(self, arrays: list[jax.Array]) -> None:
        with self._lock:
            for a in arrays:
                self._free.setdefault((a.shape, np.dtype(a.dtype)), []).append(a)


class HostOptimizer:
    """The configured optimizer applied on the host, one unit at a time.

    masters:   float32 `ModelParams` on `placement.host_device`.
    opt_state: `ModelParams`-shaped tuple of per-unit optax states, on the host device.
    grads:     per unit, gradient *sums* over `grad_accum` micro-batches of `scale * loss`, in
               `pinned_host` (compute dtype or float32); the update divides by both.
    """

    def __init__(
        self,
        cfg: OptimizerConfig,
        total_steps: int,
        masters_shape: ModelParams,
        compute_dtype: jnp.dtype,
        placement: OffloadPlacement,
        grad_accum: int,
        *,
        fused: bool = True,
        threads: int | None = None,
    ):
        self.placement = placement
        self.compute_dtype = jnp.dtype(compute_dtype)
        self.grad_accum = grad_accum
        self.max_norm = cfg.grad_clip
        self.schedule = learning_rate_schedule(cfg, total_steps)
        mask = weight_decay_mask(masters_shape, cfg.decay_norms_biases_embeddings)
        self._decay = ModelParams(
            embed=jax.tree.map(lambda m: cfg.weight_decay if m else 0.0, mask.embed),
            blocks=jax.tree.map(lambda m: cfg.weight_decay if m else 0.0, mask.blocks[0]),
            head=jax.tree.map(lambda m: cfg.weight_decay if m else 0.0, mask.head),
        )
        self.tx = ModelParams(
            embed=build_optimizer(cfg, total_steps, clip=False, mask=mask.embed),
            blocks=build_optimizer(cfg, total_steps, clip=False, mask=mask.blocks[0]),  # blocks share one
            head=build_optimizer(cfg, total_steps, clip=False, mask=mask.head),
        )
        # Gradients of one micro-batch leave in the compute dtype, sums of several in float32.
        grad_dtype = self.compute_dtype if grad_accum == 1 else jnp.float32
        self.rule = None
        if fused:
            from jaxzero.offload import host_kernels as hk

            self.rule = hk.FusedRule.of(cfg, self.compute_dtype, [grad_dtype, jnp.float32])
        self.threads = threads or os.cpu_count() or 1
        self.pool = PriorityPool(self.threads, "jaxzero-host-update")
        self._io = ThreadPoolExecutor(self.threads, thread_name_prefix="jaxzero-writeback")
        self._staging = _Staging(placement.pinned)
        if self.rule is not None:  # compile (or load) the kernels while the model initialises
            from jaxzero.offload import host_kernels as hk

            moment = jnp.dtype(cfg.state_dtype)
            # Block gradients arrive in `grad_dtype`, embedding and head gradients in float32.
            self.warmed_up = [
                self._io.submit(hk.warm_up, self.rule, g, moment, self.compute_dtype)
                for g in dict.fromkeys([np.dtype(grad_dtype), np.dtype(jnp.float32)])
            ]
        host = placement.host

        def make_update(tx: optax.GradientTransformation):
            def update(masters, opt_state, grads, gmul):
                g = jax.tree.map(lambda x: x.astype(jnp.float32) * gmul, grads)
                updates, opt_state = tx.update(g, opt_state, masters)
                masters = optax.apply_updates(masters, updates)
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
        self._zeros_like = jax.jit(lambda t: jax.tree.map(jnp.zeros_like, t), out_shardings=host)
        self._lr = jax.jit(lambda step: jnp.asarray(self.schedule(step), jnp.float32))

    @property
    def fused(self) -> bool:
        """Whether updates run as the fused host kernels (else as optax on XLA:CPU)."""
        return self.rule is not None

    # -- state ---------------------------------------------------------------------------------------

    def init(self, masters: ModelParams) -> ModelParams:
        """Per-unit optimizer state for host-resident float32 masters, created on the host."""
        return ModelParams(
            embed=self._init.embed(masters.embed),
            blocks=tuple(self._init.blocks(b) for b in masters.blocks),
            head=self._init.head(masters.head),
        )

    def init_unit(self, kind: str, masters: Any) -> Any:
        """One unit's optimizer state for its float32 masters (`kind`: embed, blocks or head), on the
        host device."""
        return getattr(self._init, kind)(masters)

    def compute_weights(self, masters: ModelParams) -> ModelParams:
        """The compute-dtype weights of `masters`, placed per `placement` (used at init and restore)."""
        futures = ModelParams(
            embed=self._io.submit(place, self._cast(masters.embed), self.placement.device),
            blocks=tuple(
                self._io.submit(place, self._cast(b), self.target(i)) for i, b in enumerate(masters.blocks)
            ),
            head=self._io.submit(place, self._cast(masters.head), self.placement.device),
        )
        return jax.tree.map(lambda f: f.result(), futures, is_leaf=lambda x: isinstance(x, Future))

    def target(self, block: int | None):
        """Where a unit's compute weights live: `pinned_host` for streamed blocks, else the device.
        `block` is the block index, None for the embedding and the head."""
        if block is not None and self.placement.is_streamed(block):
            return self.placement.pinned
        return self.placement.device

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
        Returns the updated unit with its new weights placed per `placement`.
        """
        if self.rule is None:
            release(recycle)
            return self._optax_update(u, priority)
        count = _count(u.unit.opt_state)  # host sync (a scalar already on the host)
        weights = self._fused(u, count, priority, "full", recycle=recycle)
        return HostUnit(u.unit.params, _advance(u.unit.opt_state, count), weights)

    def update_weights(self, u: UnitUpdate, priority: Any, recycle: Any = None) -> Any:
        """The first pass of a two-pass update (fused kernels only): the unit's new compute-dtype
        weights, placed, reading but not writing its masters and state (p, m, v, g read; only the
        weights written: 16 of the 28 bytes per parameter of a whole AdamW update). `commit` with the
        same `u` applies the update itself later. Arguments as `update_unit`."""
        count = _count(u.unit.opt_state)
        return self._fused(u, count, priority, "weights", recycle=recycle)

    def commit(self, u: UnitUpdate, priority: Any, weights: Any) -> HostUnit:
        """The second pass of a two-pass update: masters and state updated in place with the same
        arithmetic as `update_weights(u, ...)` (so the same bits as `update_unit`); `weights` are
        its result."""
        count = _count(u.unit.opt_state)
        self._fused(u, count, priority, "state")
        return HostUnit(u.unit.params, _advance(u.unit.opt_state, count), weights)

    def _optax_update(self, u: UnitUpdate, priority: Any) -> HostUnit:
        update = getattr(self._update, u.kind)
        g = jax.device_put(u.grads, self.placement.host)  # NumPy views -> CPU backend
        gm = jax.device_put(np.float32(u.gmul), self.placement.host)
        # Ordered with the other units' work; the XLA:CPU call itself uses XLA's own threads.
        run = lambda: jax.block_until_ready(update(u.unit.params, u.unit.opt_state, g, gm))  # noqa: E731
        params, opt_state, weights = self.pool.submit(priority, run).result()  # host sync
        return HostUnit(params, opt_state, place(weights, self.target(u.block)))

    def _fused(self, u: UnitUpdate, count: int, priority: Any, pass_: str, into=None, recycle=None) -> Any:
        """One pass (`host_kernels.PASSES`) of the fused kernels over every leaf of `unit`, chunked
        onto the pool. `into` = (params, opt_state) for the `out` pass. Returns the new weights,
        placed (None for the `state` pass)."""
        from jaxzero.offload import host_kernels as hk

        rule = self.rule
        p_leaves, treedef = jax.tree.flatten(u.unit.params)
        g_leaves = treedef.flatten_up_to(u.grads)

        def moments(opt_state):
            return [treedef.flatten_up_to(optax.tree_utils.tree_get(opt_state, n)) for n in rule.moments()]

        m_leaves = moments(u.unit.opt_state)
        if into is not None:
            out_p, out_m = treedef.flatten_up_to(into[0]), moments(into[1])
        decay = treedef.flatten_up_to(getattr(self._decay, u.kind))
        # The rate on the host device: a NumPy scalar would go to the default device, the accelerator,
        # and reading it back would wait behind the whole queued backward pass.
        lr = host_view(self._lr(jax.device_put(np.int32(count), self.placement.host)))  # host sync
        kernel = rule.kernel(count, float(lr), u.gmul, pass_)
        target = self.target(u.block)
        streamed = target.memory_kind == "pinned_host"
        dst = None
        if pass_ != "state":
            if streamed and recycle is not None:
                dst = treedef.flatten_up_to(recycle)  # the old weights' pinned buffers, written in place
            else:
                release(recycle)  # accelerator weights (freed before the new ones arrive), or none
                dst = [self._staging.take(p.shape, self.compute_dtype) for p in p_leaves]
        work = []
        for k, p in enumerate(p_leaves):
            views = [hk.writable_view(p)] + [hk.writable_view(m[k]) for m in m_leaves]
            views += [hk.readable_view(g_leaves[k]), None if dst is None else hk.writable_view(dst[k])]
            outs = None
            if into is not None:
                outs = [hk.writable_view(out_p[k])] + [hk.writable_view(m[k]) for m in out_m]
            for s in hk.chunks(p.size):
                args = [None if v is None else v[s] for v in views]
                out = None if outs is None else [o[s] for o in outs]
                work.append(self.pool.submit(priority, partial(kernel, out=out), *args, decay[k]))
        for f in work:
            f.result()  # host sync: this pass over the unit is done
        if dst is None:
            return None
        weights = jax.tree.unflatten(treedef, dst)
        if streamed:
            return weights
        # Accelerator weights: one DMA from the pinned staging buffers (a host sync: they are reused).
        weights = jax.block_until_ready(jax.device_put(weights, target))
        self._staging.give(dst)
        return weights

    # -- speculative updates -------------------------------------------------------------------------

    def spare(self, unit: HostUnit) -> tuple[Any, Any]:
        """Fresh buffers shaped like `unit`'s params and optimizer state (on the host device), for a
        speculative update to write into."""
        return self._zeros_like((unit.params, unit.opt_state))

    def speculate(self, u: UnitUpdate, priority: Any, into: tuple[Any, Any], recycle: Any = None) -> HostUnit:
        """`update_unit` into `into` (from `spare`), leaving the unit's masters and state as they
        were: the update this unit gets if the gradient turns out not to need clipping. The caller
        keeps whichever it needs."""
        count = _count(u.unit.opt_state)
        weights = self._fused(u, count, priority, "out", into, recycle)
        return HostUnit(into[0], _advance(into[1], count), weights)

    def lr(self, step: jax.Array) -> jax.Array:
        """The learning rate of update number `step` (int32 scalar, on the device it lives on)."""
        return self._lr(step)


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
    return jax.tree.map(lambda x: jax.device_put(new_count, x.sharding) if _is_count(x) else x, opt_state)


def release(tree: Any) -> None:
    """Release buffers now rather than when Python drops the last reference (their memory is reused).
    Deletion waits for pending reads."""
    for x in jax.tree.leaves(tree):
        x.delete()


def place(unit_host: Any, target) -> Any:
    """Copy a pytree of host arrays (CPU backend or NumPy) to `target`: a NumPy view (no copy), then
    one `device_put` per leaf, never the CPU client's slow cross-client path. Waits until the copies
    are done (a host sync). The result never shares memory with the source, so the source may be
    reused or updated in place."""
    views = jax.tree.map(host_view, unit_host)
    if next(iter(target.device_set)).platform == "cpu":
        # The CPU backend may adopt a suitably aligned NumPy buffer instead of copying it; the result
        # must own its memory (the source is a master updated in place, or a reused buffer).
        views = jax.tree.map(lambda v: np.array(v, copy=True), views)
    return jax.block_until_ready(jax.device_put(views, target))


def host_view(x: jax.Array | np.ndarray) -> np.ndarray:
    """A read-only NumPy view of an array that lives in host memory (`pinned_host` or the CPU
    backend): no copy. Waits for the array to be ready (a host sync)."""
    with jax.transfer_guard_device_to_host("allow"):  # reading host memory in place is not a transfer
        return np.asarray(x)
