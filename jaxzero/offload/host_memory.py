"""Host memory as the offload engine uses it: zero-copy views of host-resident arrays, copies to the
accelerator, reusable pinned staging buffers, a pinned scalar read once, and the pinned pool's growth
at start-up.

Two kinds of host memory meet here: arrays of JAX's CPU backend (masters and optimizer state, which
the host update computes on) and the accelerator's `pinned_host` memory (compute weights of streamed
blocks, gradients, staging: what the accelerator's copy engines read and write). Both are read in
place through NumPy views; nothing here copies between them through the CPU client's slow
cross-client path.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.sharding import SingleDeviceSharding


def host_view(x: jax.Array | np.ndarray) -> np.ndarray:
    """A read-only NumPy view of an array that lives in host memory (`pinned_host` or the CPU
    backend): no copy; of a replicated array over several devices, this process's first copy.
    Waits for the array to be ready (a host sync)."""
    if isinstance(x, jax.Array) and len(x.sharding.device_set) > 1:
        if not x.is_fully_replicated:
            raise ValueError(f"host_view of a sharded array ({x.sharding}): read its shards (local_views)")
        x = x.addressable_data(0)
    with jax.transfer_guard_device_to_host("allow"):  # reading host memory in place is not a transfer
        return np.asarray(x)


def local_shards(x: jax.Array) -> list[jax.Array]:
    """This process's shards of `x` (single-device arrays sharing its buffers), in the order of its
    mesh's devices."""
    order = {d: k for k, d in enumerate(_mesh_devices(x.sharding))}
    return [s.data for s in sorted(x.addressable_shards, key=lambda s: order[s.device])]


def local_views(x: jax.Array) -> list[np.ndarray]:
    """Read-only NumPy views of this process's pieces of `x` in host memory (no copy; a host sync):
    one per local shard of a sharded array, in mesh order, or the first copy of a replicated one."""
    shards = local_shards(x)
    if x.is_fully_replicated:
        shards = shards[:1]
    with jax.transfer_guard_device_to_host("allow"):
        return [np.asarray(s) for s in shards]


def _mesh_devices(sharding: jax.sharding.Sharding) -> list[jax.Device]:
    mesh = getattr(sharding, "mesh", None)
    return list(mesh.devices.flat) if mesh is not None else sorted(sharding.device_set, key=lambda d: d.id)


def _assemble(
    shape: tuple, sharding: jax.sharding.Sharding, piece: Callable[[jax.Device, tuple], Any]
) -> jax.Array:
    """A global array of `shape` placed by `sharding`: `piece(device, index)` (NumPy or a single-device
    array) copied to each of this process's devices, in the sharding's memory kind. One explicit
    `device_put` per device: no other process is involved, and the transfer guard allows it."""
    arrays = [
        jax.device_put(piece(device, idx), SingleDeviceSharding(device, memory_kind=sharding.memory_kind))
        for device, idx in sharding.addressable_devices_indices_map(tuple(shape)).items()
    ]
    return jax.make_array_from_single_device_arrays(tuple(shape), sharding, arrays)


def copy_to(tree: Any, targets: Any) -> Any:
    """Copy every array of `tree` to the same-layout sharding of `targets` (a sharding or a tree of
    them: another memory kind of the same devices), one asynchronous copy per local shard.

    Per shard, because `jax.device_put` of an array spanning several processes to another memory
    kind runs a jitted program, which every process must then run in the same order as its other
    programs; copies issued per shard involve no other process."""
    if isinstance(targets, jax.sharding.Sharding):
        targets = jax.tree.map(lambda _: targets, tree)

    def one(x: jax.Array, target: jax.sharding.Sharding) -> jax.Array:
        if len(x.sharding.device_set) == 1:
            return jax.device_put(x, target)
        shards = {s.device: s.data for s in x.addressable_shards}
        return _assemble(x.shape, target, lambda device, _: shards[device])

    return jax.tree.map(one, tree, targets)


def global_from_local(
    local: jax.Array | np.ndarray, sharding: jax.sharding.Sharding, shape: tuple
) -> jax.Array:
    """A global array of `shape` and `sharding` from this process's block of it (`local`, a NumPy or
    host array holding the rows of this process's devices, one after the other, or all rows of a
    replicated array): one copy per local device, of its own rows. Waits for the copies (host sync)."""
    view = local if isinstance(local, np.ndarray) else host_view(local)
    on_cpu = next(iter(sharding.device_set)).platform == "cpu"
    index_map = sharding.addressable_devices_indices_map(tuple(shape))
    offset = min((idx[0].start or 0) for idx in index_map.values()) if len(shape) else 0

    def rows(device: jax.Device, idx: tuple) -> np.ndarray:
        piece = view
        if len(shape) and idx[0] != slice(None):
            piece = view[(idx[0].start or 0) - offset : idx[0].stop - offset]
        # The CPU backend may adopt a NumPy buffer instead of copying it: give it its own.
        return np.array(piece, copy=True) if on_cpu else piece

    return jax.block_until_ready(_assemble(shape, sharding, rows))


def zeros(shape: tuple, dtype: np.dtype, sharding: jax.sharding.Sharding) -> jax.Array:
    """A global array of zeros, each device's shard made where it lives (a host sync)."""

    def shard(device: jax.Device, idx: tuple) -> np.ndarray:
        return np.zeros([len(range(*i.indices(n))) for i, n in zip(idx, shape)], dtype)

    return jax.block_until_ready(_assemble(shape, sharding, shard))


def release(tree: Any) -> None:
    """Release buffers now rather than when Python drops the last reference (their memory is reused).
    Deletion waits for pending reads."""
    for x in jax.tree.leaves(tree):
        x.delete()


def place(unit_host: Any, targets: Any, shapes: Any) -> Any:
    """Copy a pytree of this process's host blocks (CPU backend or NumPy; see `global_from_local`) to
    global arrays of `shapes` (a tree of arrays or `ShapeDtypeStruct`s) placed by `targets` (a tree of
    shardings): one `device_put` per local device and leaf. Waits until the copies are done (a host
    sync). The result never shares memory with the source, so the source may be reused or updated
    in place."""
    return jax.tree.map(lambda x, t, s: global_from_local(x, t, np.shape(s)), unit_host, targets, shapes)


class PinnedStaging:
    """Reusable compute-dtype buffers in `pinned_host`, by shape and dtype. The fused kernels write a
    unit's new weights straight into pinned memory; weights that live on the accelerator are one DMA
    away from such a staging buffer, which then comes back here."""

    def __init__(self) -> None:
        self._free: dict[tuple[Any, ...], list[jax.Array]] = {}
        self._lock = threading.Lock()

    def take(self, shape: tuple[int, ...], dtype: np.dtype, sharding: jax.sharding.Sharding) -> jax.Array:
        """A `pinned_host` array of global `shape` and `dtype` placed by `sharding`, reused if one
        was given back."""
        with self._lock:
            free = self._free.get((tuple(shape), np.dtype(dtype), sharding))
            if free:
                return free.pop()
        return zeros(shape, np.dtype(dtype), sharding)  # once per buffer: later steps reuse it

    def give(self, arrays: list[jax.Array]) -> None:
        """Return buffers for reuse; nothing may read them any more."""
        with self._lock:
            for a in arrays:
                self._free.setdefault((a.shape, np.dtype(a.dtype), a.sharding), []).append(a)


class HostScalar:
    """A float32 scalar in `pinned_host`, read on the host once, by whichever thread asks first (a
    host sync: it waits for the value); the others get the same NumPy scalar.

    Once, because a NumPy view of a pinned buffer takes an external reference through XLA's plugin
    API, which records it without a lock: views of one buffer taken by many threads at once can
    corrupt its reference count (an abort when the buffer is freed)."""

    def __init__(self, x: jax.Array):
        self._x, self._lock, self._value = x, threading.Lock(), None

    def get(self) -> np.float32:
        with self._lock:
            if self._value is None:
                self._value = np.float32(host_view(self._x))  # host sync
                self._x = None  # its buffer can go
            return self._value


def reserve_pinned(nbytes: int, pinned: jax.sharding.Sharding) -> None:
    """Allocate and free `nbytes` in this process's pinned pool (split over its devices), so that the
    pool grows now, at start-up, not inside a step (`jaxzero.planner.memory.pinned_pool_reservation`).
    `pinned`: a `pinned_host` sharding whose first axis splits over every device. Raises
    RuntimeError with what to check if the memory cannot be had."""
    local = len(pinned.addressable_devices)
    per_device = -(-nbytes // local)
    try:
        # Zero pages copied into the pool (seconds; no host RAM besides the pool's own).
        reserved = zeros((per_device * len(pinned.device_set),), np.uint8, pinned)
        reserved.delete()
    except RuntimeError as e:  # XLA's allocation errors are RuntimeErrors
        raise RuntimeError(
            f"could not allocate the {nbytes / 2**30:.1f} GiB of pinned (page-locked) host memory this "
            f"offloaded run needs: {e}. Check the locked-memory limit (`ulimit -l` should be "
            "unlimited) and free host RAM, raise XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB, or lower "
            "offload.two_pass_units (two-pass units keep their gradients pinned longer)."
        ) from e
