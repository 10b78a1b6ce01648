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
next forward pass, while the host idles during the backward pass. Two-pass updates move work out of
that window without changing a bit: once the norm is known, a unit's first pass computes only its
new compute-dtype weights (reading masters, moments and gradients, writing 2 bytes per parameter
instead of 14), which is all the next forward pass waits for; its second pass, queued after every
unit's first (and, if late, just before the next step's work on the same unit), recomputes the same
update and writes masters and moments in place, during the next backward pass:

    accelerator   bwd t     | fwd t+1 (waits for weights i)       | bwd t+1
    host          idle      | weights 0, 1, ..., L-1, head        | state 0, 1, ...  (same bits)

The unit's gradients live until its second pass. How many units (from the embedding) take two
passes each step is `TwoPassCounter`'s (`jaxzero.offload.two_pass`).

The delayed update (ZeRO-Offload's DPU) lets step t+1's forward and backward read the weights from
before update t, so update t overlaps all of step t+1. Gradients are then one update stale. It costs
a second copy of the compute-dtype weights.

Which of these apply is the offload plan's decision (`jaxzero.plan.HostUpdate`).

Determinism: timings decide only when, on which thread and into which buffers the host works (how
many units take two passes: `TwoPassCounter`), never what it computes: a two-pass update is the
one-pass update's bits, and the host kernels are elementwise (`host_kernels`). The global norm is
summed on the accelerator, in unit order (`jaxzero.offload.streaming`). So the host side is
reproducible as it is, and `--determinism` (XLA's deterministic GPU kernels,
`jaxzero.planner.runtime.request_determinism`) pins nothing here.
"""

from __future__ import annotations

import itertools
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, NamedTuple

import jax
import numpy as np

from jaxzero.models import ModelParams
from jaxzero.offload.disk import DiskStore
from jaxzero.offload.host_memory import HostScalar, copy_to, local_views, release
from jaxzero.offload.host_optimizer import HostOptimizer, HostUnit, UnitUpdate
from jaxzero.offload.timeline import StepClock, span
from jaxzero.offload.two_pass import TwoPassCounter
from jaxzero.plan import HostUpdate, OffloadPlan, Tier, UnitPlan, UpdateMode
from jaxzero.primitives.write_fence import WriteFence


class Submitted(NamedTuple):
    """One step's host update, as `ModelParams` of Futures: `units` of the updated `HostUnit`s,
    `weights` of their new compute-dtype weights (these resolve first under a two-pass update)."""

    units: ModelParams
    weights: ModelParams


class UpdateCounts(NamedTuple):
    """Host-update events since the last reading."""

    two_passed: int  # units updated in two passes


class QueueSlot(NamedTuple):
    """Where one unit's host work of one step queues on the host pool (lowest priority first). A
    step's updates (or first passes) go in forward order; a two-pass update's second pass goes right
    before the next step's work on the same unit, which is the first thing that needs it: after every
    first pass of its own step, and, if it is late, ahead of the next step's first passes only from
    its unit on."""

    step: int
    position: int  # in the next forward pass: embedding 0, block i at 1 + i, head last

    @property
    def update_priority(self) -> tuple[int, int, int]:
        """Of the update, or a two-pass update's first pass."""
        return (self.step, self.position, 1)

    @property
    def second_pass_priority(self) -> tuple[int, int, int]:
        """Of a two-pass update's second pass."""
        return (self.step + 1, self.position, 0)


class _StepInputs(NamedTuple):
    """What every unit task of one step shares."""

    step: int
    norm: HostScalar  # the global norm of the mean gradient (float32)
    scale: HostScalar | None  # float16's loss scale; None: the gradients carry none


class UnitJob(NamedTuple):
    """One unit's host update in one step."""

    unit: UnitPlan
    previous: Future  # Future[HostUnit]: the unit's previous update (its masters and state are consumed)
    read: Future  # the weights the gradient pass read (resolved): done with once the gradients landed
    grads: Any  # the unit's gradient sums in `pinned_host`
    weights: Future  # receives the new weights as soon as they exist
    shared: _StepInputs

    @property
    def slot(self) -> QueueSlot:
        return QueueSlot(self.shared.step, self.unit.position)


class UpdatePipeline:
    """Submits each step's per-unit host updates; see the module docstring."""

    def __init__(
        self,
        host: HostOptimizer,
        plan: OffloadPlan,
        clock: StepClock,
        disk: DiskStore | None = None,
        fence: WriteFence | None = None,
    ):
        policy: HostUpdate | None = plan.host_update
        if policy is None:
            raise ValueError("the plan keeps every unit's state on the accelerator: no host update")
        self.host = host
        self.plan = plan
        self.policy = policy
        self.clock = clock
        self.disk = disk  # where the disk units' state is read from and written back to
        # A checkpoint being written from the units' arrays: each unit's update passes it first (the unit
        # written, or copied for the writer; else the update waits).
        self.fence = fence if fence is not None else WriteFence()
        self.two_pass = TwoPassCounter(policy.two_pass)
        # Units whose state is on the accelerator come first in forward order and are not the host's:
        # the two-pass count starts at the first host unit.
        self._first_host = plan.device_state_units
        self._lock = threading.Lock()
        self._counts = UpdateCounts(0)  # since the last `take_counts`
        self._steps = itertools.count()
        # One waiting thread per unit and step: they mostly wait (gradients, norm, the previous
        # update); the work itself runs on the host optimizer's prioritised pool. A unit's task
        # lives into the next step while its second pass runs: two steps' worth of threads.
        self._tasks = ThreadPoolExecutor(2 * len(plan.units), thread_name_prefix="jaxzero-unit")

    def submit(
        self,
        units: ModelParams,
        read: ModelParams,
        grads: ModelParams,
        norm: jax.Array,
        scale: jax.Array,
    ) -> Submitted:
        """Start the update of every unit whose state lives in host RAM; returns its Futures at once
        (None in place of the units the accelerator updates).

        units: the units' previous `Future[HostUnit]`s (their masters and state are consumed).
        read:  the weights the gradient pass read (futures, already resolved): handed to the update
               once the unit's gradients have landed (the pass is then done with them), which writes
               the new weights into their pinned buffers (or frees them).
        grads: per-unit gradient sums in `pinned_host`; norm, scale: float32 scalars on the
               accelerator (the global norm of the mean gradient; the loss scale used).
        """
        pinned = self.host.placement.pinned
        shared = _StepInputs(
            step=next(self._steps),
            # Copied to host memory asynchronously; the first task to need it reads it (`HostScalar`).
            norm=HostScalar(copy_to(norm, pinned)),
            # Only float16 has a loss scale; reading a copy of it would wait behind the gradients' copies.
            scale=HostScalar(copy_to(scale, pinned)) if self.policy.skips_nonfinite else None,
        )
        jobs: list[UnitJob | None] = [
            UnitJob(unit=u, previous=prev, read=r, grads=g, weights=Future(), shared=shared)
            if u.state in (Tier.HOST, Tier.DISK)
            else None
            for u, prev, r, g in zip(self.plan.units, units.units(), read.units(), grads.units())
        ]
        if self.disk is not None:  # their reads start now, during the backward pass, in update order
            self.disk.schedule()
        tasks = [None if job is None else self._tasks.submit(self._task, job) for job in jobs]
        weights = [None if job is None else job.weights for job in jobs]
        return Submitted(ModelParams.from_units(tasks), ModelParams.from_units(weights))

    def take_counts(self) -> UpdateCounts:
        """Two-pass updates since the last call."""
        with self._lock:
            out, self._counts = self._counts, UpdateCounts(0)
        return out

    def _count(self, **more: int) -> None:
        with self._lock:
            self._counts = self._counts._replace(**{k: getattr(self._counts, k) + v for k, v in more.items()})

    def _task(self, job: UnitJob) -> HostUnit:
        """`_run`, making sure the weights Future never waits forever: it gets `_run`'s error."""
        try:
            with span("wait_checkpoint", job.unit.position):
                self.fence.release(job.unit.position)  # host sync with a checkpoint writer, during a save
            return self._run(job)
        except BaseException as e:
            if not job.weights.done():
                job.weights.set_exception(e)
            raise

    def _run(self, job: UnitJob) -> HostUnit:
        if job.unit.state is Tier.DISK:
            return self._run_from_disk(job)
        policy, slot = self.policy, job.slot
        arrays = job.previous.result()  # the previous update (in the overlapped mode it is done)
        self.host.prepare(arrays)  # before the norm: the update's rate
        with span("wait_grads", slot.position):
            g = jax.tree.map(local_views, job.grads)  # host sync: waits for this unit's gradients to land
        # The weights the pass read are done with once its gradients landed. Overlapped, the new
        # weights are written into their buffers. Delayed, the unit's newest weights are read by the
        # next pass (they stay); older ones are recycled.
        read = job.read.result()
        stale = read is not arrays.weights
        recycle = read if stale or policy.mode is not UpdateMode.DELAYED else None
        with span("wait_norm", slot.position):
            norm = job.shared.norm.get() if policy.waits_for_norm else None  # host sync: the backward pass
        if policy.skips_nonfinite and not np.isfinite(norm):
            if stale:
                release(read)
            job.weights.set_result(arrays.weights)
            return arrays  # float16 overflow: this step changes nothing
        update = UnitUpdate(job.unit, arrays, g, self.host.grad_multiplier(norm, _scale(job.shared.scale)))
        start = time.perf_counter()
        if slot.position - self._first_host < self.two_pass.units(slot.step, start):
            return self._two_passes(job, update, recycle, start)
        with span("host_update", slot.position):
            new = self.host.update_unit(update, slot.update_priority, recycle)
        job.weights.set_result(new.weights)
        self.clock.updated(start, time.perf_counter())
        return new

    def _run_from_disk(self, job: UnitJob) -> HostUnit:
        """A disk unit's update: one pass over its state as read from disk (`DiskStore.take`; the
        read was scheduled with the step), written back in the background. No second pass: it would
        hold the state in RAM, or read it again."""
        policy, position = self.policy, job.unit.position
        spilled = job.previous.result()  # masters and state: OnDisk; weights: the newest
        with span("wait_grads", position):
            g = jax.tree.map(local_views, job.grads)  # host sync: waits for this unit's gradients to land
        read = job.read.result()
        stale = read is not spilled.weights
        recycle = read if stale or policy.mode is not UpdateMode.DELAYED else None
        with span("wait_norm", position):
            norm = job.shared.norm.get() if policy.waits_for_norm else None  # host sync: the backward pass
        params, opt_state = self.disk.take(position)  # waits for its read
        if policy.skips_nonfinite and not np.isfinite(norm):
            self.disk.give_back(position)  # float16 overflow: this step changes nothing
            if stale:
                release(read)
            job.weights.set_result(spilled.weights)
            return spilled
        gmul = self.host.grad_multiplier(norm, _scale(job.shared.scale))
        update = UnitUpdate(job.unit, HostUnit(params, opt_state, spilled.weights), g, gmul)
        start = time.perf_counter()
        with span("host_update", position):
            new = self.host.update_unit(update, job.slot.update_priority, recycle)
        self.disk.put(position)  # masters and state updated in place in the buffer: written back
        self.clock.updated(start, time.perf_counter())
        job.weights.set_result(new.weights)
        return HostUnit(spilled.params, spilled.opt_state, new.weights)

    def _two_passes(self, job: UnitJob, update: UnitUpdate, recycle: Any, start: float) -> HostUnit:
        """The new weights now (the next forward pass waits for them), the masters and state later,
        during the next backward pass (same bits; `QueueSlot.second_pass_priority`). Each pass's
        time goes to the clock; the wait between them does not."""
        self.two_pass.begin()
        ended = None
        try:
            with span("host_update", job.unit.position, "pass=weights"):
                weights = self.host.update_weights(update, job.slot.update_priority, recycle)
            self.clock.updated(start, time.perf_counter())
            job.weights.set_result(weights)
            start = time.perf_counter()
            with span("host_update", job.unit.position, "pass=state"):
                new = self.host.commit(update, job.slot.second_pass_priority, weights)
            ended = time.perf_counter()
            self._count(two_passed=1)
        finally:
            self.two_pass.end(job.slot.step, ended)
        self.clock.updated(start, time.perf_counter())
        return new


def _scale(scale: HostScalar | None) -> np.float32:
    """The loss scale the gradients carry: float16's (a host sync on its copy), else 1."""
    return np.float32(1.0) if scale is None else scale.get()
