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
    way back:   the new compute-dtype weights `device_put` to where the weights live

Optimizer state is one optax state per unit, kept in `ModelParams` layout (embed, blocks, head); the
fused kernels keep that state bit-compatible with optax's, so checkpoints do not care which ran.

The way back avoids the CPU backend's slow cross-client path: the compute-dtype result is a NumPy
array `device_put` from the unit's own thread, the fast path measured in `shared/design/measurements.md`.
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


class PriorityPool:
    """Threads that run submitted functions lowest priority first (ties: first come, first served).

    The host update's work items are prioritised by the position of their unit in the next forward
    pass, so whatever the order gradients arrive in, the embedding and block 0 finish first."""

    def __init__(self, threads: int, name: str):
        self._queue: queue.PriorityQueue = queue.PriorityQueue()
        self._seq = itertools.count()
        for k in range(threads):
            threading.Thread(target=self._work, name=f"{name}-{k}", daemon=True).start()

    def submit(self, priority: int, fn: Callable[..., Any], *args: Any) -> Future:
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


class _Buffers:
    """Reusable NumPy buffers for the compute-dtype results, so that each step does not fault in
    fresh pages (large allocations are fresh `mmap`s)."""

    def __init__(self):
        self._free: dict[tuple[int, np.dtype], list[np.ndarray]] = {}
        self._lock = threading.Lock()

    def take(self, n: int, dtype: np.dtype) -> np.ndarray:
        with self._lock:
            free = self._free.get((n, np.dtype(dtype)))
            if free:
                return free.pop()
        return np.empty(n, dtype)

    def give(self, arrays: list[np.ndarray]) -> None:
        with self._lock:
            for a in arrays:
                self._free.setdefault((a.size, a.dtype), []).append(a)


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
        self._buffers = _Buffers()
        if self.rule is not None:  # compile (or load) the kernel while the model initialises
            from jaxzero.offload import host_kernels as hk

            moment = jnp.dtype(cfg.state_dtype)
            self._io.submit(hk.warm_up, self.rule, grad_dtype, moment, self.compute_dtype)
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

    def update_unit(
        self, kind: str, block: int | None, unit: HostUnit, grads: Any, gmul: np.float32, priority: int
    ) -> HostUnit:
        """One optimizer step of one unit. Blocking; call it from a worker thread.

        kind:   "embed", "blocks" or "head"; `block` is the block index (None for embed and head).
        unit:   its masters and optax state (consumed: updated in place) and old weights (the caller
                has released them).
        grads:  the unit's gradient sums as host-readable arrays (NumPy views of `pinned_host`).
        gmul:   `grad_multiplier`'s factor.
        Returns the updated unit with its new weights placed per `placement`.
        """
        if self.rule is None:
            return self._optax_update(kind, block, unit, grads, gmul, priority)
        return self._fused_update(kind, block, unit, grads, gmul, priority)

    def _optax_update(self, kind, block, unit: HostUnit, grads, gmul, priority) -> HostUnit:
        update = getattr(self._update, kind)
        g = jax.device_put(grads, self.placement.host)  # NumPy views -> CPU backend
        gm = jax.device_put(np.float32(gmul), self.placement.host)
        # Ordered with the other units' work; the XLA:CPU call itself uses XLA's own threads.
        run = lambda: jax.block_until_ready(update(unit.params, unit.opt_state, g, gm))  # noqa: E731
        params, opt_state, weights = self.pool.submit(priority, run).result()  # host sync
        return HostUnit(params, opt_state, place(weights, self.target(block)))

    def _fused_update(self, kind, block, unit: HostUnit, grads, gmul, priority, into=None) -> HostUnit:
        """The fused kernels on every leaf, in place, or into `into` = (params, opt_state) of the
        same structure (a speculative update: `unit` is left untouched). Returns the updated unit
        with its new weights placed."""
        from jaxzero.offload import host_kernels as hk

        rule = self.rule
        p_leaves, treedef = jax.tree.flatten(unit.params)
        g_leaves = treedef.flatten_up_to(grads)

        def moments(opt_state):
            return [treedef.flatten_up_to(optax.tree_utils.tree_get(opt_state, n)) for n in rule.moments()]

        m_leaves = moments(unit.opt_state)
        if into is not None:
            out_p, out_m = treedef.flatten_up_to(into[0]), moments(into[1])
        decay = treedef.flatten_up_to(getattr(self._decay, kind))
        count = _count(unit.opt_state)  # host sync (a scalar already on the host)
        # The rate on the host device: a NumPy scalar would go to the default device, the accelerator,
        # and reading it back would wait behind the whole queued backward pass.
        lr = host_view(self._lr(jax.device_put(np.int32(count), self.placement.host)))  # host sync
        kernel = rule.kernel(count, float(lr), gmul)
        w_dtype = hk.bits_dtype(np.dtype(self.compute_dtype))
        outs = [self._buffers.take(p.size, w_dtype) for p in p_leaves]
        work = []
        for k, p in enumerate(p_leaves):
            views = [hk.writable_view(p)] + [hk.writable_view(m[k]) for m in m_leaves]
            views += [hk.readable_view(g_leaves[k]), outs[k]]
            dst = None
            if into is not None:
                dst = [hk.writable_view(out_p[k])] + [hk.writable_view(m[k]) for m in out_m]
            for s in hk.chunks(p.size):
                out = None if dst is None else [d[s] for d in dst]
                work.append(
                    self.pool.submit(priority, partial(kernel, out=out), *[v[s] for v in views], decay[k])
                )
        for f in work:
            f.result()  # host sync: this unit's update is done
        new_params, new_state = (unit.params, unit.opt_state) if into is None else into
        # The step counts of the new state: `count` plus one (new scalars, one per count leaf).
        new_count = np.int32(min(count + 1, np.iinfo(np.int32).max))  # saturating, as optax's
        new_state = jax.tree.map(
            lambda x: jax.device_put(new_count, x.sharding) if _is_count(x) else x, new_state
        )
        w_np = [o.view(self.compute_dtype).reshape(p.shape) for o, p in zip(outs, p_leaves)]
        weights = place(jax.tree.unflatten(treedef, w_np), self.target(block))
        # `place` copied and has finished reading them; reuse them unless a backend adopted one.
        if all(w.unsafe_buffer_pointer() != o.ctypes.data for w, o in zip(jax.tree.leaves(weights), outs)):
            self._buffers.give(outs)
        return HostUnit(new_params, new_state, weights)

    # -- speculative updates -------------------------------------------------------------------------

    @property
    def can_speculate(self) -> bool:
        """Speculative updates need the fused kernels (they write into separate buffers)."""
        return self.rule is not None

    def spare(self, unit: HostUnit) -> tuple[Any, Any]:
        """Fresh buffers shaped like `unit`'s params and optimizer state (on the host device), for a
        speculative update to write into."""
        return self._zeros_like((unit.params, unit.opt_state))

    def speculate(
        self,
        kind: str,
        block: int | None,
        unit: HostUnit,
        grads: Any,
        gmul: np.float32,
        priority: int,
        into: tuple[Any, Any],
    ) -> HostUnit:
        """`update_unit` into `into` (from `spare`), leaving `unit` as it was: the update this unit
        gets if the gradient turns out not to need clipping. The caller keeps whichever it needs."""
        return self._fused_update(kind, block, unit, grads, gmul, priority, into=into)

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
