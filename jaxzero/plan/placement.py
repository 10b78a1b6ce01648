"""Where every array lives: the device mesh, ZeRO sharding, batch sharding and memory kinds, decided
in one place.

One mesh axis, `data`, spans every device of every process. Batches are split over it by rows. What
else is split over it is the ZeRO stage's (`OffloadPlan.zero_stage`): an array that is sharded keeps
one slice of its first axis on each device (`shard_spec`), DeepSpeed's partition without the
flattening, so that a checkpoint keeps every array's own shape and restores on any device count.
An array whose first axis does not divide by the device count is replicated instead.

Which tier holds each unit's arrays is the offload plan's decision (`jaxzero.plan`); this module turns
tiers into shardings and memory kinds (`device` for accelerator memory, `pinned_host` for host RAM the
accelerator can DMA, the CPU backend for host-resident state), here and nowhere else; models and the
training loop never name them.
"""

from __future__ import annotations

import socket
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

from jaxzero.config import ConfigError, ModelConfig
from jaxzero.models.sizes import unit_param_shapes
from jaxzero.plan import OffloadPlan, Tier, UnitPlan

DATA_AXIS = "data"
HOST_AXIS = "processes"
DEVICE = "device"
PINNED_HOST = "pinned_host"


def make_mesh(devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A 1-D mesh named `data` over `devices` (default: every device of every process), ordered by
    process, so that each process's devices hold one contiguous block of every sharded axis (its
    host state is that block). Raises ConfigError if processes hold different device counts.

    Axis types are Auto (not JAX 0.10's Explicit default of `jax.make_mesh`) so that jitted code
    relies on sharding propagation from the in/out shardings given here.
    """
    devices = sorted(devices if devices is not None else jax.devices(), key=lambda d: (d.process_index, d.id))
    per_process: dict[int, int] = {}
    for d in devices:
        per_process[d.process_index] = per_process.get(d.process_index, 0) + 1
    if len(set(per_process.values())) > 1:
        raise ConfigError(
            f"every process must drive the same number of devices; got {per_process} devices per "
            "process. Give each process the same number of GPUs (CUDA_VISIBLE_DEVICES)."
        )
    return Mesh(np.array(devices), (DATA_AXIS,))


def process_count(mesh: Mesh) -> int:
    """How many processes drive the devices of `mesh`."""
    return len({d.process_index for d in mesh.devices.flat})


def processes_on_this_host(mesh: Mesh) -> int:
    """How many processes of `mesh` run on this process's host (they share its RAM): 1 for one
    process; otherwise every process's host name is gathered (a collective: every process of the
    mesh must call this, from its main thread)."""
    if process_count(mesh) == 1:
        return 1
    name = np.frombuffer(socket.gethostname().encode().ljust(64, b"\0")[:64], np.uint8)
    names = np.asarray(multihost_utils.process_allgather(name)).reshape(-1, 64)
    return int(np.sum(np.all(names == name, axis=1)))


def shard_spec(shape: Sequence[int], num_devices: int) -> P:
    """ZeRO's partition of one array of global `shape` over `num_devices`: its first axis split over
    `data` when it divides evenly, else the whole array on every device (scalars included)."""
    if num_devices > 1 and len(shape) > 0 and shape[0] % num_devices == 0:
        return P(DATA_AXIS)
    return P()


def whole_params(shapes: Any, num_devices: int) -> tuple[int, int, int]:
    """Parameters of the (embedding, one block, head) of `shapes` (a `ModelParams` of arrays or
    `ShapeDtypeStruct`s) in arrays `shard_spec` keeps whole on `num_devices` devices."""

    def count(tree: Any) -> int:
        leaves = jax.tree.leaves(tree)
        return sum(int(np.prod(np.shape(x))) for x in leaves if shard_spec(np.shape(x), num_devices) == P())

    if num_devices == 1:
        return (0, 0, 0)
    return count(shapes.embed), count(shapes.blocks[0]), count(shapes.head)


def whole_params_of(model: ModelConfig, num_devices: int) -> tuple[int, int, int]:
    """`whole_params` of the model `model` configures, from its shapes alone
    (`models.sizes.unit_param_shapes`): no JAX, so it serves before JAX starts."""
    if num_devices == 1:
        return (0, 0, 0)
    units = unit_param_shapes(model)
    return tuple(
        sum(int(np.prod(shape)) for shape in unit if shard_spec(shape, num_devices) == P()) for unit in units
    )


def zero_shardings(mesh: Mesh, shapes: Any, sharded: bool, memory_kind: str = DEVICE) -> Any:
    """A tree of shardings for a tree of arrays (or `ShapeDtypeStruct`s) of these global shapes:
    each leaf split by `shard_spec` if `sharded`, else replicated, in `memory_kind`."""

    def one(x: Any) -> NamedSharding:
        spec = shard_spec(np.shape(x), mesh.size) if sharded else P()
        return NamedSharding(mesh, spec, memory_kind=memory_kind)

    return jax.tree.map(one, shapes)


def host_mesh(mesh: Mesh) -> Mesh:
    """One CPU-backend device per process of `mesh` (its first local one), on the axis `processes`:
    where a checkpoint sees host-resident state, each process holding its own block."""
    cpus: dict[int, jax.Device] = {}
    for d in sorted(jax.devices("cpu"), key=lambda d: (d.process_index, d.id)):
        cpus.setdefault(d.process_index, d)
    processes = sorted({d.process_index for d in mesh.devices.flat})
    return Mesh(np.array([cpus[p] for p in processes]), (HOST_AXIS,))


def train_batch_sharding(mesh: Mesh) -> NamedSharding:
    """int32 (grad_accum, micro_batch, seq_len + 1): micro-batch rows split over `data`."""
    return NamedSharding(mesh, P(None, DATA_AXIS, None))


def eval_batch_sharding(mesh: Mesh) -> NamedSharding:
    """int32 (batch, seq_len + 1): rows split over `data`."""
    return NamedSharding(mesh, P(DATA_AXIS, None))


def replicated(mesh: Mesh, memory_kind: str = DEVICE) -> NamedSharding:
    """Every device holds a full copy, in `memory_kind`."""
    return NamedSharding(mesh, P(), memory_kind=memory_kind)


def supports_memory_kind(device: jax.Device, memory_kind: str) -> bool:
    """Whether `device` exposes memory of `memory_kind` (e.g. `pinned_host`)."""
    return memory_kind in {m.kind for m in device.addressable_memories()}


def put_train_batch(batch: np.ndarray, mesh: Mesh) -> jax.Array:
    """Host int32 (A, mb, S+1) -> a global array sharded over `data` (one transfer per device shard)."""
    return jax.make_array_from_process_local_data(train_batch_sharding(mesh), batch)


def put_eval_batch(batch: np.ndarray, mesh: Mesh) -> jax.Array:
    """Host int32 (B, S+1) -> a global array sharded over `data`."""
    return jax.make_array_from_process_local_data(eval_batch_sharding(mesh), batch)


# ---------------------------------------------------------------------------------------------------
# Offload placement: which memory holds each part of the training state.
# ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class OffloadPlacement:
    """The shardings of the offload engine's arrays over the data mesh, for the tiers the offload
    plan (`jaxzero.plan`) gives each unit. Shapes are global; `shard_spec` splits them.

    - fp32 masters and optimizer state (`Tier.HOST`): arrays of this process's CPU backend (`host`),
      holding the process's block of each array (`local_rows`): its devices' shards, one after the
      other (ZeRO stage >= 1), or the whole array. The host optimizer computes on them in place; they
      never cross the link, so they need no pinned (DMA-able) memory. A checkpoint sees them as one
      global array over `host_mesh` (`saved`).
    - gradients: `pinned_host` of each device, one shard per device, DMA'd there as each block's
      backward ends (reduce-scattered first), then read by the host optimizer without a copy.
    - compute-dtype weights: written by the host as one shard per device (`written`): into
      `pinned_host` for streamed blocks (`Tier.PINNED_HOST`), copied in per use; for units on the
      accelerator (`Tier.DEVICE`) copied there once per update. They stay one shard per device at
      every ZeRO stage, and each computation all-gathers what it uses: collectives are issued by the
      thread that issues the computations, in the same order in every process (the host update's
      threads run in no fixed order, so an all-gather issued there could deadlock two processes).
    """

    mesh: Mesh
    host_device: jax.Device
    plan: OffloadPlan

    @property
    def num_devices(self) -> int:
        return self.mesh.size

    @cached_property
    def host_mesh(self) -> Mesh:
        return host_mesh(self.mesh)

    @property
    def num_processes(self) -> int:
        return self.host_mesh.size

    @property
    def device(self) -> NamedSharding:
        """Replicated accelerator memory (scalars: the step, the loss scale)."""
        return NamedSharding(self.mesh, P(), memory_kind=DEVICE)

    @property
    def pinned(self) -> NamedSharding:
        """Replicated `pinned_host` memory (scalars read by the host: the norm, the loss scale)."""
        return NamedSharding(self.mesh, P(), memory_kind=PINNED_HOST)

    @property
    def pool(self) -> NamedSharding:
        """`pinned_host` split over every device: a flat byte array in each device's pinned pool."""
        return NamedSharding(self.mesh, P(DATA_AXIS), memory_kind=PINNED_HOST)

    @property
    def host(self) -> SingleDeviceSharding:
        """This process's host arrays (the CPU backend)."""
        return SingleDeviceSharding(self.host_device)

    # -- per array ---------------------------------------------------------------------------------

    def is_sharded(self, shape: Sequence[int]) -> bool:
        """Whether a state array of global `shape` is split over the devices (else every device and
        every process holds all of it)."""
        return self.plan.shards_state and shard_spec(shape, self.num_devices) != P()

    def local_rows(self, shape: Sequence[int]) -> slice:
        """The rows (first axis) of an array of global `shape` that this process's host state holds."""
        if not self.is_sharded(shape):
            return slice(None)
        rows = shape[0] // self.num_processes
        position = [d.process_index for d in self.host_mesh.devices.flat].index(jax.process_index())
        return slice(position * rows, (position + 1) * rows)

    def pieces(self, shape: Sequence[int]) -> list[slice]:
        """The rows, within this process's block, of each of its devices' shards of a sharded array
        of global `shape` (in the mesh's device order); one slice of all rows if it is replicated."""
        if not self.is_sharded(shape):
            return [slice(None)]
        rows = shape[0] // self.num_devices
        local = len(self.local_devices)
        return [slice(j * rows, (j + 1) * rows) for j in range(local)]

    @cached_property
    def local_devices(self) -> list[jax.Device]:
        """This process's devices of the mesh, in mesh order."""
        return [d for d in self.mesh.devices.flat if d.process_index == jax.process_index()]

    # -- per tree ----------------------------------------------------------------------------------

    def split(self, shapes: Any, memory_kind: str) -> Any:
        """One shard per device of each array of these global shapes (`shard_spec`), in
        `memory_kind`: what the host reads and writes (gradients, weights, their staging in
        `pinned_host`) and the accelerator copies in and out (in `device` memory)."""
        return zero_shardings(self.mesh, shapes, self.plan.shards_state, memory_kind)

    def written(self, unit: UnitPlan, shapes: Any) -> Any:
        """Where `unit`'s compute-dtype weights live: one shard per device, as the host writes them,
        in the unit's weights tier (`pinned_host` for streamed blocks, accelerator memory otherwise)."""
        return self.split(shapes, PINNED_HOST if unit.weights is Tier.PINNED_HOST else DEVICE)

    def whole(self, shapes: Any) -> Any:
        """Whole arrays on every device: what a computation all-gathers the weights' shards into."""
        return zero_shardings(self.mesh, shapes, False, DEVICE)

    def saved(self, shapes: Any) -> Any:
        """How a checkpoint sees host state of these global shapes: one block per process, over
        `host_mesh` (sharded arrays), or whole in every process."""
        mesh = self.host_mesh

        def one(x: Any) -> NamedSharding:
            return NamedSharding(mesh, P(HOST_AXIS) if self.is_sharded(np.shape(x)) else P())

        return jax.tree.map(one, shapes)

    def is_streamed(self, block: int) -> bool:
        """Whether block `block`'s weights live in pinned host memory and are copied in per use."""
        return self.plan.is_streamed(block)


def batch_rows_sharding(mesh: Mesh, ndim: int) -> NamedSharding:
    """Activations (A, mb, ...) of `ndim` dimensions: micro-batch rows split over `data`."""
    return NamedSharding(mesh, P(None, DATA_AXIS, *([None] * (ndim - 2))))


def grouped_by_process(order: Sequence[int]) -> bool:
    """Whether devices of these process indices (in mesh order) come one process after the other, in
    process order, each process's devices contiguous."""
    runs = [p for k, p in enumerate(order) if k == 0 or p != order[k - 1]]
    return runs == sorted(set(order))


def offload_placement(mesh: Mesh, plan: OffloadPlan) -> OffloadPlacement:
    """The placement of `plan` on `mesh`, whose hosts are each process's CPU backend. Raises
    ConfigError for a device without `pinned_host` memory, or a mesh whose devices are not grouped by
    process (each process's host state is one block of rows: its devices must be contiguous)."""
    order = [d.process_index for d in mesh.devices.flat]
    if not grouped_by_process(order):
        raise ConfigError(
            f"the mesh's devices are not grouped by process in process order (processes {order}); "
            "host-resident state keeps one block of rows per process. Build it with "
            "jaxzero.plan.placement.make_mesh(devices), which orders them."
        )
    accelerator = mesh.local_devices[0]
    if not supports_memory_kind(accelerator, PINNED_HOST):
        memory_kinds = sorted(m.kind for m in accelerator.addressable_memories())
        raise ConfigError(
            f"device {accelerator} ({accelerator.platform}) has no pinned_host memory (it has "
            f"{memory_kinds}), "
            "so weights and gradients cannot be kept in host memory. Use offload.params=none "
            "offload.optimizer=none on this platform."
        )
    return OffloadPlacement(mesh, jax.local_devices(backend="cpu")[0], plan)
