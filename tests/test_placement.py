"""Where arrays live: the mesh, batch sharding, and the offload plan's tiers as shardings."""

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxzero.config import ConfigError, TrainConfig
from jaxzero.overrides import apply_overrides
from jaxzero.plan import placement, resolve_plan


def plan_of(**over):
    cfg = apply_overrides(TrainConfig(), {"offload.optimizer": "cpu", "offload.params": "cpu", **over})
    return resolve_plan(cfg)


def test_mesh_is_one_data_axis_over_every_device():
    mesh = placement.make_mesh()
    assert mesh.axis_names == (placement.DATA_AXIS,) and mesh.size == len(jax.local_devices()) == 4


def test_batches_are_split_by_rows_over_the_data_axis():
    mesh = placement.make_mesh()
    batch = np.arange(2 * 8 * 5, dtype=np.int32).reshape(2, 8, 5)  # (grad_accum, micro_batch, S+1)
    x = placement.put_train_batch(batch, mesh)
    np.testing.assert_array_equal(np.asarray(x), batch)
    assert {s.data.shape for s in x.addressable_shards} == {(2, 2, 5)}  # 8 rows over 4 devices
    ev = placement.put_eval_batch(batch[0], mesh)
    assert {s.data.shape for s in ev.addressable_shards} == {(2, 5)}
    assert placement.replicated(mesh).is_fully_replicated
    assert placement.replicated(mesh, placement.PINNED_HOST).memory_kind == "pinned_host"


def test_the_plans_tiers_become_shardings():
    plan = plan_of(**{"offload.resident_blocks": "1", "model.num_layers": "3"})
    where = placement.offload_placement(placement.make_mesh(jax.devices()[:1]), plan)
    assert where.device.memory_kind == "device" and where.pinned.memory_kind == "pinned_host"
    assert where.host.device_set == {jax.devices("cpu")[0]}  # the CPU backend
    shape = {"w": jax.ShapeDtypeStruct((8, 4), np.float32)}
    kinds = [where.written(u, shape)["w"].memory_kind for u in plan.units]
    assert kinds == ["device", "device", "pinned_host", "pinned_host", "device"]  # embed, 3 blocks, head
    assert [where.is_streamed(i) for i in range(3)] == [False, True, True]


def test_zero_shards_split_the_first_axis_when_it_divides_else_replicate():
    assert placement.shard_spec((8, 3), 4) == P("data")
    assert placement.shard_spec((6, 8), 4) == P()  # 6 rows do not split over 4 devices
    assert placement.shard_spec((), 4) == P() and placement.shard_spec((8, 3), 1) == P()
    mesh = placement.make_mesh()
    tree = {"a": np.zeros((8, 3)), "b": np.zeros((6,))}
    split = placement.zero_shardings(mesh, tree, sharded=True, memory_kind="pinned_host")
    assert split["a"].spec == P("data") and split["b"].spec == P()
    assert split["a"].memory_kind == "pinned_host"
    assert placement.zero_shardings(mesh, tree, sharded=False)["a"].spec == P()


def test_offloaded_host_state_of_one_process_is_every_row_in_pieces_per_device():
    where = placement.offload_placement(placement.make_mesh(), plan_of())  # ZeRO-3, 4 devices
    assert where.plan.zero_stage == 3 and where.num_processes == 1
    assert where.host_mesh.devices.flat[0] == jax.devices("cpu")[0]
    assert where.local_rows((8, 3)) == slice(0, 8)
    assert where.pieces((8, 3)) == [slice(0, 2), slice(2, 4), slice(4, 6), slice(6, 8)]
    assert where.pieces((6, 3)) == [slice(None)] and where.local_rows((6, 3)) == slice(None)
    stage2 = placement.offload_placement(
        placement.make_mesh(), plan_of(**{"offload.params": "none", "parallel.zero_stage": "2"})
    )
    shape = {"w": np.zeros((8, 3))}
    unit = stage2.plan.units[0]
    assert stage2.written(unit, shape)["w"].spec == P("data")  # the host writes one shard per device,
    assert stage2.whole(shape)["w"].spec == P()  # kept so; a computation gathers them whole


def test_platform_without_pinned_host_is_refused(monkeypatch):
    monkeypatch.setattr(placement, "supports_memory_kind", lambda device, memory_kind: False)
    mesh = placement.make_mesh(jax.devices()[:1])
    with pytest.raises(ConfigError, match="has no pinned_host memory .* Use offload.params=none"):
        placement.offload_placement(mesh, plan_of())


def test_host_state_needs_each_processs_devices_together_in_process_order():
    assert placement.grouped_by_process([0, 0, 1, 1]) and placement.grouped_by_process([0, 0, 0])
    assert not placement.grouped_by_process([1, 1, 0, 0])  # a reversed mesh
    assert not placement.grouped_by_process([0, 1, 0, 1])  # interleaved
