"""The host update, unit by unit, running in the background of the accelerator's work.

After a step's gradient pass is issued, one task per unit (embedding, each block, head) waits for
that unit's gradients to land in `pinned_host` and for the global norm (computed on the accelerator),
then updates the unit on the host (`HostOptimizer.update_unit`). The step returns at once; its state
holds a `Future` per unit. The next step's forward pass waits for each unit only when it reaches it,
and the host works on units in the order that pass needs them (embedding, block 0, 1, ..., head), so
the host update of step t overlaps the forward pass of step t+1:

    accelerator   fwd t | bwd t           | fwd t+1 (block i waits for update i) | bwd t+1 ...
    host                     grads land -> | norm known: update embed, 0, 1, ... L-1, head  |

Exactness: no update is committed before the global norm of the whole gradient is known, so clipping
is optax's, and float16 overflow (a non-finite norm) skips every unit's update, as the resident
trainer does. Without clipping and without float16 the norm is not needed, and each unit's update
starts as soon as its gradients land, overlapping the backward pass of the blocks below it too.

With clipping, that wait puts the whole host update between one backward pass and the end of the
next forward pass, while the host idles during the backward pass. Two-pass updates
(`offload.two_pass_units`, adaptive by default) move work out of that window without changing a bit:
once the norm is known, a unit's first pass computes only its new compute-dtype weights (reading
masters, moments and gradients, writing 2 bytes per parameter instead of 14), which is all the
next forward pass waits for; its second pass, queued after every unit's first (and, if late, just
before the next step's work on the same unit), recomputes the same update and writes masters and
moments in place, during the next backward pass:

    accelerator   bwd t     | fwd t+1 (waits for weights i)       | bwd t+1
    host          idle      | weights 0, 1, ..., L-1, head        | state 0, 1, ...  (same bits)

The unit's gradients live until its second pass. Adaptive, the number of two-pass units (counted
from the embedding) follows the host's slack: if second passes are still running when the next
norm arrives, they would delay that step's first passes, so the count drops by as many; if none
are and the slack would fit one more, it grows by one.

With clipping, the first `offload.speculative_units` units whose gradients land (the head and the top
blocks) are updated speculatively during the backward pass, as if no clipping will apply, into
spare buffers. When the norm arrives: below `grad_clip` the speculative result is exactly the update
(the same kernel on the same numbers) and is kept, the old buffers becoming the next spare; otherwise
it is discarded and the unit is updated again with the clipping factor. The cost is one spare copy
of those units' masters and optimizer state in host RAM.

`delayed` (ZeRO-Offload's delayed parameter update, DPU) lets step t+1's forward and backward use the
weights from before update t, so update t overlaps all of step t+1. Gradients are then one update
stale: the step-(t+1) gradient is taken at the weights of update t-1. It costs a second copy of the
compute-dtype weights (accelerator memory for resident blocks, `pinned_host` for streamed ones).
"""

from __future__ import annotations

import itertools
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, NamedTuple

import jax
import numpy as np

from jaxzero.config import TrainConfig
from jaxzero.models import ModelParams
from jaxzero.offload.host_optimizer import HostOptimizer, HostUnit, UnitUpdate, host_view, release
from jaxzero.offload.timeline import StepClock


def done(value: Any) -> Future:
    """A Future already holding `value`."""
    f: Future = Future()
    f.set_result(value)
    return f


def weights_of(unit: Future) -> Future:
    """A Future of the `weights` of a Future[HostUnit]."""
    out: Future = Future()

    def relay(f: Future) -> None:
        if f.exception() is not None:
            out.set_exception(f.exception())
        else:
            out.set_result(f.result().weights)

    unit.add_done_callback(relay)
    return out


def _resolve(units: ModelParams) -> ModelParams:
    """Wait for every unit (a host sync) and return the `HostUnit`s."""
    return ModelParams(units.embed.result(), tuple(u.result() for u in units.blocks), units.head.result())


def _units(params: ModelParams, opt_state: ModelParams, weights: ModelParams) -> ModelParams:
    return ModelParams(
        done(HostUnit(params.embed, opt_state.embed, weights.embed)),
        tuple(done(HostUnit(*u)) for u in zip(params.blocks, opt_state.blocks, weights.blocks)),
        done(HostUnit(params.head, opt_state.head, weights.head)),
    )


@jax.tree_util.register_pytree_node_class
class OffloadState:
    """Training state of the offload engine (a pytree; flattening it waits for pending updates).

    step:       int32 scalar: optimizer updates applied (host device; the accelerator under float16,
                where it depends on the overflow check made there).
    units:      `ModelParams` of `Future[HostUnit]`: the newest update of each unit, maybe still
                running on the host. Its params are float32 masters in host RAM (CPU backend), its
                opt_state the unit's optax state there, its weights the compute-dtype weights
                (embed/head and resident blocks in accelerator memory, streamed blocks in the
                accelerator's pinned_host memory).
    in_use:     `ModelParams` of `Future`s of the weights the next gradient pass reads: the newest
                (`units`' own) or, under the delayed update, those of the update before.
    loss_scale: float16 training's `LossScaleState` (accelerator); None otherwise.

    `params`, `opt_state` and `weights` read the resolved units (host sync).
    """

    def __init__(self, step: jax.Array, units: ModelParams, in_use: ModelParams, loss_scale: Any = None):
        self.step, self.units, self.in_use, self.loss_scale = step, units, in_use, loss_scale

    @classmethod
    def of(cls, step, params, opt_state, weights, loss_scale=None) -> OffloadState:
        units = _units(params, opt_state, weights)
        return cls(step, units, jax.tree.map(weights_of, units, is_leaf=_is_future), loss_scale)

    def resolved(self) -> HostUnit:
        """Waits for every unit (a host sync); their params, opt_state and weights, each in
        `ModelParams` layout."""
        units = _resolve(self.units)
        return HostUnit(*(jax.tree.map(lambda u, k=k: u[k], units, is_leaf=_is_unit) for k in range(3)))

    @property
    def params(self) -> ModelParams:
        return self.resolved().params

    @property
    def opt_state(self) -> ModelParams:
        return self.resolved().opt_state

    @property
    def weights(self) -> ModelParams:
        return self.resolved().weights

    def tree_flatten(self):
        return (self.step, *self.resolved(), self.loss_scale), None

    @classmethod
    def tree_unflatten(cls, _aux, children):
        return cls.of(*children)


def _is_future(x: Any) -> bool:
    return isinstance(x, Future)


def _is_unit(x: Any) -> bool:
    return isinstance(x, HostUnit)


def _waits_for_norm(cfg: TrainConfig) -> bool:
    """Whether units wait for the global norm before their update can start, with the fused kernels
    doing the update: where speculation and two-pass updates apply. Clipping makes units wait;
    float16 too but its update is optax's (`host_kernels.FusedRule.of`); the delayed update is off
    the critical path anyway."""
    o = cfg.offload
    fused = o.fused_update and cfg.model.compute_dtype != "float16"
    return cfg.optimizer.grad_clip > 0 and o.update == "overlapped" and fused


def speculative_units(cfg: TrainConfig) -> int:
    """How many units a run updates speculatively: `offload.speculative_units` where speculation
    applies (`_waits_for_norm`), else 0. The memory plan counts the spares with this same rule."""
    return cfg.offload.speculative_units if _waits_for_norm(cfg) else 0


def two_pass_units(cfg: TrainConfig) -> int:
    """The most units (in forward order: embedding, blocks, head) a run updates in two passes:
    `offload.two_pass_units` (-1, adaptive: up to every unit) where units wait for the norm
    (`_waits_for_norm`), else 0. The memory plan counts their gradients' longer life with this same
    rule."""
    units = cfg.model.num_layers + 2
    n = cfg.offload.two_pass_units
    return (units if n < 0 else min(n, units)) if _waits_for_norm(cfg) else 0


def first_units(k: int, num_layers: int) -> tuple[int, int, int]:
    """How many of the embedding, the blocks and the head are among the first `k` units in forward
    order (embedding at position 0, block i at 1 + i, head last): the units a two-pass count of `k`
    covers (`UpdatePipeline` compares positions with `k`; the memory plan counts their gradients)."""
    k = max(0, k)
    return min(k, 1), max(0, min(k - 1, num_layers)), int(k >= num_layers + 2)


class Submitted(NamedTuple):
    """One step's host update, as `ModelParams` of Futures: `units` of the updated `HostUnit`s,
    `weights` of their new compute-dtype weights (these resolve first under a two-pass update)."""

    units: ModelParams
    weights: ModelParams


class UpdatePipeline:
    """Submits each step's per-unit host updates; see the module docstring."""

    def __init__(
        self,
        host: HostOptimizer,
        num_layers: int,
        *,
        needs_norm: bool,
        skip_nonfinite: bool,
        delayed: bool,
        speculative_units: int,
        two_pass_units: int,
        adaptive_two_pass: bool,
        clock: StepClock,
    ):
        self.host = host
        self.delayed = delayed
        # `speculative_units` and `two_pass_units` are the effective counts (the functions above).
        # Both write through the fused kernels, and only pay where units wait for the norm.
        if (speculative_units or two_pass_units) and not (needs_norm and host.fused and not delayed):
            raise ValueError(
                "speculative and two-pass updates need the norm wait, the fused kernels and no delay"
            )
        self.speculative_units = speculative_units
        # Two-pass updates: the first `two_pass_now` units of each step, at most `two_pass_units`.
        # Adaptive, the count follows the host's slack: second passes still running when the next
        # norm arrives sit on the critical path (fewer next step); none running and slack to spare:
        # one more (`_two_pass_count`).
        self.two_pass_units = self.two_pass_now = two_pass_units
        self.adaptive_two_pass = adaptive_two_pass and two_pass_units > 0
        self._second_passes_running = 0
        self._two_pass_of_step: dict[int, int] = {}
        self._second_pass_ends: dict[int, list[float]] = {}  # by step: when each second pass ended
        # Buffers for speculative updates, by unit kind (blocks share one shape), at most
        # `speculative_units` in all.
        self._spares: dict[str, list[tuple[Any, Any]]] = {"embed": [], "blocks": [], "head": []}
        self._lock = threading.Lock()
        self.committed = self.rolled_back = 0  # speculative updates kept / recomputed, since the last read
        self.two_passed = 0  # units updated in two passes, since the last read
        self.needs_norm = needs_norm  # clipping or float16: wait for the global norm before updating
        self.skip_nonfinite = skip_nonfinite  # float16: a non-finite norm means overflow, skip the step
        self.clock = clock
        # Host work is ordered by step and position in the forward pass (`_Order`).
        self._steps = itertools.count()
        # One waiting thread per unit and step: they mostly wait (gradients, norm, the previous
        # update); the work itself runs on the host optimizer's prioritised pool. A unit's task
        # lives into the next step while its second pass runs: two steps' worth of threads.
        self._tasks = ThreadPoolExecutor(2 * (num_layers + 2), thread_name_prefix="jaxzero-unit")

    def submit(
        self,
        units: ModelParams,
        used: ModelParams,
        grads: ModelParams,
        norm: jax.Array,
        scale: jax.Array,
    ) -> Submitted:
        """Start the update of every unit; returns its Futures at once.

        units: the units' previous `Future[HostUnit]`s (their masters and state are consumed).
        used:  the weights the gradient pass read (futures, already resolved): handed to the update
               once the unit's gradients have landed (the pass is then done with them), which writes
               the new weights into their pinned buffers (or frees them).
        grads: per-unit gradient sums in `pinned_host`; norm, scale: float32 scalars on the
               accelerator (the global norm of the mean gradient; the loss scale used).
        """
        pinned = self.host.placement.pinned
        # Two scalars to host memory, asynchronously; the first task to need each reads it (`HostScalar`).
        norm_h = HostScalar(jax.device_put(norm, pinned))
        # Only float16 has a loss scale; reading a copy of it would wait behind the gradients' copies.
        scale_h = HostScalar(jax.device_put(scale, pinned)) if self.skip_nonfinite else None
        step = next(self._steps)
        L = len(grads.blocks)
        jobs = [("embed", None, units.embed, used.embed, grads.embed)]
        jobs += [("blocks", i, units.blocks[i], used.blocks[i], grads.blocks[i]) for i in range(L)]
        jobs += [("head", None, units.head, used.head, grads.head)]
        tickets = itertools.count()  # the first `speculative_units` gradients to land may speculate
        out, weights = [], []
        for position, job in enumerate(jobs):
            w: Future = Future()
            order = _Order(step, position)
            out.append(self._tasks.submit(self._task, *job, order, w, norm_h, scale_h, tickets))
            weights.append(w)
        return Submitted(
            ModelParams(out[0], tuple(out[1:-1]), out[-1]),
            ModelParams(weights[0], tuple(weights[1:-1]), weights[-1]),
        )

    def take_counts(self) -> tuple[int, int, int]:
        """Speculative updates kept and recomputed, and two-pass updates, since the last call."""
        with self._lock:
            out = (self.committed, self.rolled_back, self.two_passed)
            self.committed = self.rolled_back = self.two_passed = 0
        return out

    def _speculate(self, kind, block, unit: HostUnit, g, order, scale_h, tickets, used) -> HostUnit | None:
        """While the backward pass still runs, update this unit as if no clipping will apply, into
        spare buffers (the unit itself untouched; its new weights into `used`'s buffers). None if this
        unit does not speculate."""
        evict = None
        with self._lock:
            if next(tickets) >= self.speculative_units:
                return None
            spare = self._spares[kind].pop() if self._spares[kind] else None
            if spare is None and sum(map(len, self._spares.values())) >= self.speculative_units:
                # Spares of another shape only: free one, so the bound holds.
                evict = next(v for v in self._spares.values() if v).pop()
        if evict is not None:
            release(evict)
        if spare is None:
            spare = self.host.spare(unit)  # rarely: afterwards the replaced state becomes the spare
        gmul = self.host.grad_multiplier(None, _scale(scale_h))
        return self.host.speculate(UnitUpdate(kind, block, unit, g, gmul), order.first, spare, recycle=used)

    def _task(self, *args) -> HostUnit:
        """`_run`, making sure the weights Future never waits forever: it gets `_run`'s error."""
        weights: Future = args[-4]
        try:
            return self._run(*args)
        except BaseException as e:
            if not weights.done():
                weights.set_exception(e)
            raise

    def _run(
        self,
        kind,
        block,
        prev: Future,
        used: Future,
        grads,
        order: _Order,
        weights: Future,
        norm_h,
        scale_h,
        tickets,
    ) -> HostUnit:
        unit = prev.result()  # the unit's previous update (in the overlapped mode it is done already)
        g = jax.tree.map(host_view, grads)  # host sync: waits for this unit's gradients to land
        # The weights the pass read are done with once its gradients landed. Overlapped, the new
        # weights are written into their buffers. Delayed, the unit's newest weights are read by the
        # next pass (they stay); older ones are recycled.
        stale = used.result() is not unit.weights
        recycle = used.result() if stale or not self.delayed else None
        spec = None
        if self.speculative_units:
            start = time.perf_counter()
            spec = self._speculate(kind, block, unit, g, order, scale_h, tickets, recycle)
            if spec is not None:
                self.clock.updated(start, time.perf_counter())
                recycle = spec.weights
        norm = norm_h.get() if self.needs_norm else None  # host sync: the whole backward pass
        if spec is not None:
            if (not self.skip_nonfinite or np.isfinite(norm)) and self.host.unclipped(norm):
                # Exactly the update the unit would get now: keep it; the old state is the next spare.
                with self._lock:
                    self._spares[kind].append((unit.params, unit.opt_state))
                    self.committed += 1
                weights.set_result(spec.weights)
                return spec
            with self._lock:  # clipping (or overflow) applies after all: recompute below
                self._spares[kind].append((spec.params, spec.opt_state))
                self.rolled_back += 1
        if self.skip_nonfinite and not np.isfinite(norm):
            if stale:
                release(used.result())
            weights.set_result(unit.weights)
            return unit  # float16 overflow: this step changes nothing
        update = UnitUpdate(kind, block, unit, g, self.host.grad_multiplier(norm, _scale(scale_h)))
        start = time.perf_counter()
        if spec is None and order.position < self._two_pass_count(order.step, start):
            # Two passes: the new weights now (the next forward pass waits for them), the masters and
            # state later, during the next backward pass (same bits; `_Order.second`).
            with self._lock:
                self._second_passes_running += 1
            try:
                new_weights = self.host.update_weights(update, order.first, recycle)
                self.clock.updated(start, time.perf_counter())
                weights.set_result(new_weights)
                start = time.perf_counter()
                new = self.host.commit(update, order.second, new_weights)
                with self._lock:
                    self.two_passed += 1
                    self._second_pass_ends.setdefault(order.step, []).append(time.perf_counter())
            finally:
                with self._lock:
                    self._second_passes_running -= 1
        else:
            new = self.host.update_unit(update, order.first, recycle)
            weights.set_result(new.weights)
        self.clock.updated(start, time.perf_counter())
        return new

    def _two_pass_count(self, step: int, now: float) -> int:
        """How many units of `step` update in two passes, decided once per step by its first unit
        past the norm, at time `now` (called only there, so the previous step's second passes still
        running are exactly those late for this step).

        Adaptive: each late second pass costs one unit. With none late, one more unit only if the
        slack since the last one ended would fit another (1.5 times the mean interval between the
        previous step's second passes). Adding a unit on any slack at all (the rule before) lets a
        count that just fits step up to one that does not, putting a late pass on every other
        step's critical path."""
        with self._lock:
            if step not in self._two_pass_of_step:
                if self.adaptive_two_pass and step > 0:
                    late = self._second_passes_running
                    k = self.two_pass_now - late if late else self.two_pass_now + self._room(step - 1, now)
                    self.two_pass_now = max(0, min(self.two_pass_units, k))
                self._two_pass_of_step = _recent(self._two_pass_of_step, step)
                self._second_pass_ends = _recent(self._second_pass_ends, step)
                self._two_pass_of_step[step] = self.two_pass_now
            return self._two_pass_of_step[step]

    def _room(self, step: int, now: float) -> int:
        """1 if one more second pass, as long as `step`'s took on average, would have ended by `now`,
        else 0 (under the lock). With fewer than two of them to measure by, 1: the count is then
        low, and may swing by one unit where the host fits only one or two."""
        ends = self._second_pass_ends.get(step, [])
        if len(ends) < 2:
            return 1
        interval = (max(ends) - min(ends)) / (len(ends) - 1)
        return int(now - max(ends) >= 1.5 * interval)


def _recent(by_step: dict[int, Any], step: int) -> dict[int, Any]:
    """`by_step`'s entries of the last three steps up to `step` (older ones are never read again)."""
    return {s: v for s, v in by_step.items() if s > step - 3}


class _Order(NamedTuple):
    """Where a unit's host work queues on the pool (lowest first). A step's first passes (or whole
    updates) go in forward order; a two-pass update's second pass goes right before the next step's
    work on the same unit, which is the first thing that needs it: after every first pass of its
    own step, and, if it is late, ahead of the next step's first passes only from its unit on."""

    step: int
    position: int  # in the next forward pass: embedding 0, block i at 1 + i, head last

    @property
    def first(self) -> tuple[int, int, int]:
        return (self.step, self.position, 1)

    @property
    def second(self) -> tuple[int, int, int]:
        return (self.step + 1, self.position, 0)


def _scale(scale_h: HostScalar | None) -> np.float32:
    """The loss scale the gradients carry: float16's (a host sync on its copy), else 1."""
    return np.float32(1.0) if scale_h is None else scale_h.get()


class HostScalar:
    """A float32 scalar in `pinned_host`, read on the host once, by whichever unit task asks first
    (a host sync: it waits for the value); the others get the same NumPy scalar.

    Why once: a NumPy view of a pinned buffer takes an external reference through XLA's plugin API,
    which appends it to a list without a lock (`PJRT_Buffer_IncreaseExternalReferenceCount`). Every
    unit task used to read the shared norm at the moment it landed, so their references raced on
    that list; one run on the H200 box aborted when the norm's buffer was freed with a reference
    still counted ("Non-zero type 1 hold on destruction"), most likely from that race."""

    def __init__(self, x: jax.Array):
        self._x, self._lock, self._value = x, threading.Lock(), None

    def get(self) -> np.float32:
        with self._lock:
            if self._value is None:
                self._value = np.float32(host_view(self._x))  # host sync
                self._x = None  # its buffer can go
            return self._value
