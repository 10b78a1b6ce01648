"""Where every array lives: the device mesh, batch sharding and memory kinds, decided in one place.

Batches are sharded over the `data` axis of all local devices; model state is replicated over it.
Which tier holds each unit's arrays is the offload plan's decision (`jaxzero.plan`); this module turns
tiers into shardings and memory kinds (`device` for accelerator memory, `pinned_host` for host RAM the
accelerator can DMA, the CPU backend for host-resident state), here and nowhere else; models and the
training loop never name them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

from jaxzero.config import ConfigError
from jaxzero.plan import OffloadPlan, Tier, UnitPlan

DATA_AXIS = "data"
DEVICE = "device"
PINNED_HOST = "pinned_host"


def make_mesh(devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A 1-D mesh named `data` over `devices` (default: all local devices).

    Axis types are Auto (not JAX 0.10's Explicit default of `jax.make_mesh`) so that jitted code
    relies on sharding propagation from the in/out shardings given here.
    """
    devices = list(devices) if devices is not None else jax.local_devices()
    return Mesh(np.array(devices), (DATA_AXIS,))


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
    """The shardings of the offload engine's arrays on one accelerator, for the tiers the offload
    plan (`jaxzero.plan`) gives each unit.

    - fp32 masters and optimizer state (`Tier.HOST`): arrays of the CPU backend (`host`). The host
      optimizer computes on them in place at full CPU speed; they never cross the link, so they need
      no pinned (DMA-able) memory and do not count against XLA's pinned host pool.
    - compute-dtype weights: accelerator memory (`device`, `Tier.DEVICE`: the embedding, the head,
      resident blocks) or the accelerator's `pinned_host` memory (`pinned`, `Tier.PINNED_HOST`:
      streamed blocks, copied to the accelerator one block at a time).
    - gradients: `pinned`, DMA'd there as each block's backward ends, then read by the host
      optimizer without a copy.
    """

    accelerator: jax.Device
    host_device: jax.Device
    plan: OffloadPlan

    @property
    def device(self) -> SingleDeviceSharding:
        return SingleDeviceSharding(self.accelerator, memory_kind=DEVICE)

    @property
    def pinned(self) -> SingleDeviceSharding:
        return SingleDeviceSharding(self.accelerator, memory_kind=PINNED_HOST)

    @property
    def host(self) -> SingleDeviceSharding:
        return SingleDeviceSharding(self.host_device)

    def tier(self, tier: Tier) -> SingleDeviceSharding:
        """The sharding of an array kept in `tier`."""
        return {Tier.DEVICE: self.device, Tier.PINNED_HOST: self.pinned, Tier.HOST: self.host}[tier]

    def weights(self, unit: UnitPlan) -> SingleDeviceSharding:
        """Where `unit`'s compute-dtype weights live."""
        return self.tier(unit.weights)

    def is_streamed(self, block: int) -> bool:
        """Whether block `block`'s weights live in pinned host memory and are copied in per use."""
        return self.plan.is_streamed(block)


def offload_placement(mesh: Mesh, plan: OffloadPlan) -> OffloadPlacement:
    """The placement of `plan` on the single device of `mesh`, whose host is the CPU backend's first
    device. Raises ConfigError for a mesh of several devices or a device without `pinned_host`."""
    if mesh.size != 1:
        raise ConfigError(
            f"host offload runs on one accelerator, but the data mesh has {mesh.size} devices "
            f"({[str(d) for d in mesh.devices.flat]}). Run with one visible device "
            "(e.g. CUDA_VISIBLE_DEVICES=0), or use offload.params=none offload.optimizer=none."
        )
    accelerator = mesh.devices.flat[0]
    if not supports_memory_kind(accelerator, PINNED_HOST):
        memory_kinds = sorted(m.kind for m in accelerator.addressable_memories())
        raise ConfigError(
            f"device {accelerator} ({accelerator.platform}) has no pinned_host memory (it has "
            f"{memory_kinds}), "
            "so weights and gradients cannot be kept in host memory. Use offload.params=none "
            "offload.optimizer=none on this platform."
        )
    return OffloadPlacement(accelerator, jax.devices("cpu")[0], plan)
