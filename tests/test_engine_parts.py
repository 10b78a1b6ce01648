"""The trainers' named parts, each used alone: the timings over a fake clock, the loss-scaling
strategies, the state's initialisation, and the checkpoint adapters (a state to its saved form and
back), of the offload engine and of the resident trainer."""

import jax
import numpy as np
import pytest

from jaxzero.config import TrainConfig
from jaxzero.numerics.loss_scale import init_loss_scale
from jaxzero.offload.breakdown import StepTimings
from jaxzero.offload.checkpointing import CheckpointAdapter
from jaxzero.offload.context import EngineContext, build_engine_context
from jaxzero.offload.disk import DiskStats
from jaxzero.offload.pipeline import UpdateCounts
from jaxzero.offload.state_init import StateInit
from jaxzero.offload.step import DynamicLossScale, NoLossScale
from jaxzero.overrides import apply_overrides
from jaxzero.plan import placement, resolve_plan
from jaxzero.primitives.deferred import resolved
from jaxzero.resident import ResidentCheckpoint, ResidentInit, build_resident_context
from jaxzero.state import BREAKDOWN, BREAKDOWN_TIMES


def tiny(**over: str) -> TrainConfig:
    return apply_overrides(
        TrainConfig(),
        {
            "model.name": "llama-tiny",
            "model.num_layers": "2",
            "model.compute_dtype": "float32",
            "data.seq_len": "16",
            "data.batch_size": "2",
            "data.grad_accum": "1",
            "offload.optimizer": "none",
            "offload.params": "none",
            "steps": "2",
            **over,
        },
    )


def one_device() -> jax.sharding.Mesh:
    return placement.make_mesh(jax.devices()[:1])


class FakeClock:
    def __init__(self, totals: dict[str, float]):
        self.totals, self.walls = totals, []

    def summary(self, wall: float) -> dict[str, float]:
        self.walls.append(wall)
        return dict(self.totals)


class FakePipeline:
    def take_counts(self) -> UpdateCounts:
        return UpdateCounts(two_passed=6)


class FakeDisk:
    def take_stats(self) -> DiskStats:
        return DiskStats(read_bytes=3 * 10**9, written_bytes=10**9, read_s=2.0, write_s=1.0, wait_s=0.5)


def test_timings_are_per_step_and_keyed_as_the_breakdown():
    times = {k.key: 2.0 * i for i, k in enumerate(BREAKDOWN_TIMES)}
    clock = FakeClock(times)
    got = StepTimings(clock, FakePipeline(), FakeDisk())(10.0, 2)
    assert clock.walls == [10.0]
    assert list(got) == [k.key for k in BREAKDOWN]
    assert {k: got[k] for k in times} == {k: v / 2 for k, v in times.items()}
    assert got["two_pass_units"] == 3
    assert (got["disk_read_s"], got["disk_write_s"], got["wait_disk_s"], got["disk_gb"]) == (1, 0.5, 0.25, 2)
    # Without a disk tier its keys are zeros; no steps counts as one.
    alone = StepTimings(FakeClock(times), FakePipeline())(10.0, 0)
    assert alone["two_pass_units"] == 6 and alone["disk_gb"] == alone["disk_read_s"] == 0


def test_loss_scaling_strategies_advance_the_step_count():
    cfg = tiny(**{"offload.optimizer": "cpu"})  # the weights stay on the accelerator
    where = placement.offload_placement(one_device(), resolve_plan(cfg))
    plain = NoLossScale(where)
    step, scale, metrics = plain.advance(_State(np.int32(3)), 1.5, 0.25, 0.1)
    assert int(step) == 4 and scale is None and float(plain.scale_of(None)) == 1.0
    assert metrics.loss_scale is None
    dynamic = DynamicLossScale(cfg.fp16)
    ls = init_loss_scale(cfg.fp16)
    state = _State(np.int32(3), ls)
    assert float(dynamic.scale_of(state)) == float(ls.scale)
    step, _, metrics = dynamic.advance(state, 1.5, np.float32(0.25), 0.1)
    assert int(step) == 4 and not bool(metrics.skipped)
    step, next_ls, metrics = dynamic.advance(state, 1.5, np.float32(np.inf), 0.1)
    assert int(step) == 3 and bool(metrics.skipped)
    assert float(next_ls.scale) <= float(ls.scale)


class _State:  # what the strategies read of an `OffloadState`
    def __init__(self, step, loss_scale=None):
        self.step, self.loss_scale = step, loss_scale


ROUND_TRIPS = {
    "host": {"offload.optimizer": "cpu"},
    # the embedding's state on the accelerator, the head's on disk, the block's in host RAM
    "three-tiers": {
        "offload.optimizer": "disk",
        "offload.device_state_units": "1",
        "offload.disk_units": "1",
    },
}


@pytest.mark.parametrize("case", list(ROUND_TRIPS))
def test_offload_state_to_its_saved_form_and_back(case, tmp_path):
    """The checkpoint adapter alone: a fresh state to its saved form and back (through a new
    context, as a resume builds it) keeps every master and moment; the saved form matches the
    restore target's shapes."""
    mesh = one_device()

    def context(name: str) -> EngineContext:
        cfg = tiny(
            **ROUND_TRIPS[case], **{"offload.params": "cpu", "offload.disk_path": str(tmp_path / name)}
        )
        return build_engine_context(cfg, mesh, resolve_plan(cfg))

    ctx, other = context("saved"), context("restored")
    start = StateInit(ctx)
    state = start.init(jax.random.key(0))
    saved = resolved(CheckpointAdapter(ctx, start).saved_state(state))  # disk units read now
    expected = [np.array(x) for x in jax.tree.leaves(saved)]
    adapter = CheckpointAdapter(other, StateInit(other))
    target = adapter.abstract_saved_state()
    shapes = lambda tree: jax.tree.map(lambda x: (x.shape, x.dtype), tree)  # noqa: E731
    assert shapes(saved) == shapes(target)
    # What a restore hands back: the saved values, placed as the target says.
    back = adapter.from_saved_state(
        jax.tree.map(lambda x, t: jax.device_put(np.asarray(x), t.sharding), saved, target)
    )
    assert int(jax.device_get(back.step)) == 0
    for a, b in zip(jax.tree.leaves(resolved(adapter.saved_state(back))), expected):
        np.testing.assert_array_equal(np.asarray(a), b)
    for c in (ctx, other):
        if c.disk is not None:
            c.disk.close()


def test_offload_state_from_given_masters_is_the_fresh_state():
    """State initialisation alone: the masters `init` makes, handed to `init_from_params`, give
    the same masters and optimizer state."""
    cfg = tiny(**{"offload.optimizer": "cpu", "offload.params": "cpu"})
    ctx = build_engine_context(cfg, one_device(), resolve_plan(cfg))
    start = StateInit(ctx)
    fresh = start.init(jax.random.key(0))
    masters = jax.device_get(fresh.params)
    again = start.init_from_params(masters)
    for a, b in zip(
        jax.tree.leaves(jax.device_get(again.resolved()[:2])), jax.tree.leaves(fresh.resolved()[:2])
    ):
        np.testing.assert_array_equal(a, np.asarray(b))


def test_resident_state_to_its_saved_form_and_back():
    cfg = tiny(**{"optimizer.grad_clip": "1.0"})
    ctx = build_resident_context(cfg, one_device(), resolve_plan(cfg))
    state = ResidentInit(ctx).init(jax.random.key(0))
    adapter = ResidentCheckpoint(ctx)
    saved = adapter.saved_state(state)
    target = adapter.abstract_saved_state()
    assert jax.tree.structure(saved) == jax.tree.structure(target)
    back = adapter.from_saved_state(saved)
    assert jax.tree.structure(back) == jax.tree.structure(state)
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(state)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
