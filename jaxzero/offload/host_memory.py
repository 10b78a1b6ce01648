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
from typing import Any

import jax
import numpy as np


def host_view(x: jax.Array | np.ndarray) -> np.ndarray:
    """A read-only NumPy view of an array that lives in host memory (`pinned_host` or the CPU
    backend): no copy. Waits for the array to be ready (a host sync)."""
    with jax.transfer_guard_device_to_host("allow"):  # reading host memory in place is not a transfer
        return np.asarray(x)


def release(tree: Any) -> None:
    """Release buffers now rather than when Python drops the last reference (their memory is reused).
    Deletion waits for pending reads."""
    for x in jax.tree.leaves(tree):
        x.delete()


def place(unit_host: Any, target: jax.sharding.Sharding) -> Any:
    """Copy a pytree of host arrays (CPU backend or NumPy) to `target`: a NumPy view (no copy), then
    one `device_put` per leaf. Waits until the copies are done (a host sync). The result never
    shares memory with the source, so the source may be reused or updated in place."""
    views = jax.tree.map(host_view, unit_host)
    if next(iter(target.device_set)).platform == "cpu":
        # The CPU backend may adopt a suitably aligned NumPy buffer instead of copying it; the result
        # must own its memory (the source is a master updated in place, or a reused buffer).
        views = jax.tree.map(lambda v: np.array(v, copy=True), views)
    return jax.block_until_ready(jax.device_put(views, target))


class PinnedStaging:
    """Reusable compute-dtype buffers in `pinned_host`, by shape and dtype. The fused kernels write a
    unit's new weights straight into pinned memory; weights that live on the accelerator are one DMA
    away from such a staging buffer, which then comes back here."""

    def __init__(self, pinned: jax.sharding.Sharding):
        self._pinned = pinned
        self._free: dict[tuple[tuple[int, ...], np.dtype], list[jax.Array]] = {}
        self._lock = threading.Lock()

    def take(self, shape: tuple[int, ...], dtype: np.dtype) -> jax.Array:
        """A `pinned_host` buffer of `shape` and `dtype`, reused if one was given back."""
        with self._lock:
            free = self._free.get((tuple(shape), np.dtype(dtype)))
            if free:
                return free.pop()
        # A new buffer: a copy of zeros, once per buffer (later steps reuse it).
        return jax.block_until_ready(jax.device_put(np.zeros(shape, dtype), self._pinned))

    def give(self, arrays: list[jax.Array]) -> None:
        """Return buffers for reuse; nothing may read them any more."""
        with self._lock:
            for a in arrays:
                self._free.setdefault((a.shape, np.dtype(a.dtype)), []).append(a)


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
    """Allocate and free `nbytes` in the accelerator's pinned pool, so that the pool grows now, at
    start-up, not inside a step (`jaxzero.memory.pinned_pool_reservation`). Raises RuntimeError with
    what to check if the memory cannot be had."""
    try:
        # A copy of zero pages into the pool (seconds; no host RAM besides the pool's own).
        reserved = jax.device_put(np.zeros(nbytes, np.uint8), pinned)
        jax.block_until_ready(reserved).delete()  # host sync
    except RuntimeError as e:  # XLA's allocation errors are RuntimeErrors
        raise RuntimeError(
            f"could not allocate the {nbytes / 2**30:.1f} GiB of pinned (page-locked) host memory this "
            f"offloaded run needs: {e}. Check the locked-memory limit (`ulimit -l` should be "
            "unlimited) and free host RAM, raise XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB, or lower "
            "offload.two_pass_units (two-pass units keep their gradients pinned longer)."
        ) from e
