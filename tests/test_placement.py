"""Where arrays live: the mesh, batch sharding, and the offload plan's tiers as shardings."""

import jax
import numpy as np
import pytest

from jaxzero import placement
from jaxzero.config import ConfigError, TrainConfig
from jaxzero.overrides import apply_overrides
from jaxzero.plan import Tier, resolve_plan


def plan_of(**over):
    cfg = apply_overrides(TrainConfig(), {"offload.optimizer": "cpu", "offload.params": "cpu", **over})
    return resolve_plan(cfg)


def test_mesh_is_one_data_axis_over_every_local_device():
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
    assert where.tier(Tier.DEVICE).memory_kind == "device"
    assert where.tier(Tier.PINNED_HOST).memory_kind == "pinned_host"
    assert where.tier(Tier.HOST).device_set == {jax.devices("cpu")[0]}  # the CPU backend
    kinds = [where.weights(u).memory_kind for u in plan.units]
    assert kinds == ["device", "device", "pinned_host", "pinned_host", "device"]  # embed, 3 blocks, head
    assert [where.is_streamed(i) for i in range(3)] == [False, True, True]


def test_platform_without_pinned_host_is_refused(monkeypatch):
    monkeypatch.setattr(placement, "supports_memory_kind", lambda device, memory_kind: False)
    mesh = placement.make_mesh(jax.devices()[:1])
    with pytest.raises(ConfigError, match="has no pinned_host memory .* Use offload.params=none"):
        placement.offload_placement(mesh, plan_of())
