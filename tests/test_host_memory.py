"""Host memory helpers of the offload engine: views, copies that own their memory, staging, scalars."""

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import jax
import numpy as np

from jaxzero.config import TrainConfig
from jaxzero.offload import host_kernels, host_memory
from jaxzero.overrides import apply_overrides
from jaxzero.plan import placement, resolve_plan


def where() -> placement.OffloadPlacement:
    cfg = apply_overrides(TrainConfig(), {"offload.optimizer": "cpu", "offload.params": "cpu"})
    return placement.offload_placement(placement.make_mesh(jax.devices()[:1]), resolve_plan(cfg))


def test_the_shared_norm_is_read_on_the_host_once(monkeypatch):
    """Every unit task waits for the same norm; one of them takes the NumPy view of its pinned buffer
    (XLA's plugin does not count views of one buffer from several threads safely), the rest get the
    same value."""
    reads = []

    def slow_view(x):
        reads.append(threading.get_ident())
        time.sleep(0.05)  # the norm landing while every task waits for it
        return np.asarray(x)

    monkeypatch.setattr(host_memory, "host_view", slow_view)
    norm = host_memory.HostScalar(jax.device_put(np.float32(7.5), where().pinned))
    with ThreadPoolExecutor(16) as pool:
        values = list(pool.map(lambda _: norm.get(), range(32)))
    assert len(reads) == 1 and values == [np.float32(7.5)] * 32


def test_place_copies_never_share_memory_with_the_source():
    """`place` copies host arrays to a target; the host update later writes the source in place
    (masters, reused buffers), which must not change the copy. On the CPU backend the target is host
    memory too, where a copy could otherwise adopt the source's buffer."""
    src = jax.device_put(np.arange(1024, dtype=np.float32), where().host)
    out = host_memory.place({"w": src}, {"w": where().device}, {"w": src})
    host_kernels.writable_view(src)[:] = 0.0  # an in-place update of the source, as the kernels do
    assert out["w"].sharding.memory_kind == "device"
    np.testing.assert_array_equal(np.asarray(out["w"]), np.arange(1024, dtype=np.float32))


def test_a_writable_view_waits_for_the_computation_that_writes_the_array():
    """The kernels write through views of arrays a jitted computation may still be writing (a unit's
    fresh optimizer state, made by its jitted `init`): the view waits, so that the computation
    cannot overwrite what is written through it."""

    @jax.jit
    def slow_zeros(x):  # a few hundred milliseconds on the CPU backend, then zeros
        y = jax.lax.fori_loop(0, 100, lambda _, y: jax.numpy.sin(y @ y.T) * 1e-9, x)
        return y[:, 0] * 0.0  # depends on the loop (XLA keeps x * 0: NaN * 0 is NaN)

    x = jax.device_put(np.ones((400, 400), np.float32), where().host)
    slow_zeros(x).block_until_ready()  # compiled
    out = slow_zeros(x)  # dispatched, still running
    host_kernels.writable_view(out)[:] = 7.0
    np.testing.assert_array_equal(np.asarray(out), np.full(400, 7.0, np.float32))


def test_pinned_staging_reuses_given_back_buffers():
    staging, pinned = host_memory.PinnedStaging(), where().pinned
    a = staging.take((4, 8), np.float32, pinned)
    assert a.sharding.memory_kind == "pinned_host" and a.shape == (4, 8)
    staging.give([a])
    assert staging.take((4, 8), np.float32, pinned) is a  # the same buffer back
    b = staging.take((4, 8), np.float32, pinned)  # none left: a new one
    assert b is not a
    assert staging.take((8, 4), np.float32, pinned).shape == (8, 4)  # another shape: its own buffers


def test_a_global_array_is_made_from_this_process_block_one_shard_per_device():
    """Sharded: each of the 4 devices gets its own rows of the block; replicated: all of it."""
    mesh = placement.make_mesh(jax.devices())
    block = np.arange(8 * 3, dtype=np.float32).reshape(8, 3)
    split = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"), memory_kind="pinned_host")
    x = host_memory.global_from_local(block, split, (8, 3))
    assert [s.data.shape for s in x.addressable_shards] == [(2, 3)] * 4
    np.testing.assert_array_equal(np.concatenate(host_memory.local_views(x)), block)
    whole = placement.replicated(mesh, "pinned_host")
    y = host_memory.global_from_local(block, whole, (8, 3))
    assert len(host_memory.local_shards(y)) == 4 and len(host_memory.local_views(y)) == 1
    np.testing.assert_array_equal(host_memory.local_views(y)[0], block)


def test_reserving_the_pinned_pool_leaves_nothing_allocated():
    nbytes = 3 << 20
    host_memory.reserve_pinned(nbytes, where().pool)
    assert not [a for a in jax.live_arrays() if a.nbytes == nbytes]
