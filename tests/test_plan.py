"""The offload plan: every offload setting resolved once, and the rules everything else reads from it."""

import os

import jax
import numpy as np
import pytest

from jaxzero import plan
from jaxzero.config import ConfigError, TrainConfig
from jaxzero.data import build_data
from jaxzero.models.sizes import unit_param_counts
from jaxzero.overrides import apply_overrides, parse_args
from jaxzero.plan import Tier, TwoPass, UnitKind, UpdateMode, placement, resolve_plan
from jaxzero.planner import memory
from jaxzero.trainer import build_trainer

ZERO3 = {"offload.optimizer": "cpu", "offload.params": "cpu"}


def cfg(**over) -> TrainConfig:
    """Explicit placements (resident unless `over` says otherwise): `resolve_plan` reads no `auto`."""
    base = {"model.num_layers": "4", "offload.optimizer": "none", "offload.params": "none"}
    return apply_overrides(TrainConfig(), {**base, **over})


def test_resident_plan_keeps_everything_on_the_accelerator():
    p = resolve_plan(cfg())
    assert p.host_update is None and p.mode == "resident" and p.streamed_blocks == 0
    assert {(u.weights, u.state) for u in p.units} == {(Tier.DEVICE, Tier.DEVICE)}


def test_units_are_in_forward_order():
    p = resolve_plan(cfg(**ZERO3))
    assert [u.kind for u in p.units] == [UnitKind.EMBED, *[UnitKind.BLOCK] * 4, UnitKind.HEAD]
    assert [u.position for u in p.units] == list(range(6))
    assert [u.block for u in p.blocks] == [0, 1, 2, 3] and p.units[0].block is p.units[-1].block is None
    assert p.num_layers == 4


@pytest.mark.parametrize(
    "over, streamed, mode",
    [
        ({"offload.optimizer": "cpu"}, [False] * 4, "ZeRO-Offload"),
        (ZERO3, [True] * 4, "ZeRO-3 offload"),
        ({**ZERO3, "offload.resident_blocks": "1"}, [False, True, True, True], "ZeRO-3 offload"),
    ],
)
def test_where_weights_and_state_live(over, streamed, mode):
    p = resolve_plan(cfg(**over))
    assert p.mode == mode
    assert [p.is_streamed(i) for i in range(4)] == streamed
    assert [u.weights is Tier.PINNED_HOST for u in p.blocks] == streamed
    assert p.units[0].weights is p.units[-1].weights is Tier.DEVICE  # embedding and head
    assert {u.state for u in p.units} == {Tier.HOST}


def test_device_state_units_are_the_first_in_forward_order():
    p = resolve_plan(cfg(**ZERO3, **{"offload.device_state_units": "2"}))
    assert [u.state for u in p.units] == [Tier.DEVICE] * 2 + [Tier.HOST] * 4
    assert p.units[1].weights is Tier.DEVICE  # block 0's weights stay with its state, not streamed
    assert [p.is_streamed(i) for i in range(4)] == [False, True, True, True]
    assert p.device_state_units == 2 and [u.position for u in p.host_units] == [2, 3, 4, 5]
    assert p.host_update.two_pass.max_units == 4  # two passes are the host units' business
    assert "the first 2 on" in p.describe("adamw", "1 x cpu")


@pytest.mark.parametrize(
    "args, message",
    [
        (["--offload.optimizer=cpu", "--offload.device_state_units=6"], "must be in [-1, 5]"),
        (
            ["--offload.optimizer=none", "--offload.device_state_units=1"],
            "offload.device_state_units only applies with offload.optimizer=cpu",
        ),
        (
            ["--offload.optimizer=cpu", "--offload.update=delayed", "--offload.device_state_units=1"],
            "needs offload.update=overlapped",
        ),
    ],
)
def test_device_state_units_are_validated(args, message):
    with pytest.raises(ConfigError) as e:
        parse_args(["--model.num_layers=4", *args])
    assert message in str(e.value)


@pytest.mark.parametrize(
    "over, max_units, adaptive",
    [
        ({}, 6, True),  # the default (-1): adaptive, up to every unit
        ({"offload.two_pass_units": "0"}, 0, False),
        ({"offload.two_pass_units": "3"}, 3, False),
        ({"offload.two_pass_units": "99"}, 6, False),  # at most every unit
        ({"optimizer.grad_clip": "0"}, 0, False),  # nothing waits for the norm: nothing to move
        ({"offload.update": "delayed"}, 0, False),  # off the critical path already
        ({"offload.fused_update": "false"}, 0, False),  # two passes are a fused-kernel feature
        ({"model.compute_dtype": "float16"}, 0, False),  # float16's update is optax's
    ],
)
def test_two_pass_policy_is_resolved_once(over, max_units, adaptive):
    p = resolve_plan(cfg(**ZERO3, **over))
    assert p.host_update.two_pass == TwoPass(max_units=max_units, adaptive=adaptive)


def test_host_update_policy():
    h = resolve_plan(cfg(**ZERO3)).host_update
    assert (h.mode, h.fused, h.waits_for_norm, h.skips_nonfinite) == (
        UpdateMode.OVERLAPPED,
        True,
        True,
        False,
    )
    assert h.threads == max(1, len(os.sched_getaffinity(0)) - 1)  # one core left to the dispatching thread
    assert resolve_plan(cfg(**ZERO3, **{"offload.host_threads": "3"})).host_update.threads == 3
    fp16 = resolve_plan(cfg(**ZERO3, **{"model.compute_dtype": "float16", "optimizer.grad_clip": "0"}))
    h16 = fp16.host_update
    assert not h16.fused and h16.waits_for_norm and h16.skips_nonfinite
    assert not resolve_plan(cfg(**ZERO3, **{"optimizer.grad_clip": "0"})).host_update.waits_for_norm


def test_gradients_leave_in_the_compute_dtype_with_one_micro_batch():
    assert resolve_plan(cfg(**ZERO3, **{"data.grad_accum": "1"})).grad_dtype == "bfloat16"
    assert resolve_plan(cfg(**ZERO3, **{"data.grad_accum": "2"})).grad_dtype == "float32"


def test_two_pass_units_are_the_first_in_forward_order_for_the_memory_plan_too():
    """The pipeline updates a unit in two passes when its position is below the step's count; the
    memory plan counts the kept gradients of the units below the plan's maximum: the same units."""
    base = {"model.name": "llama-7b", "data.seq_len": "2048", "data.batch_size": "8", **ZERO3}
    e, b, h = unit_param_counts(cfg(**base).model)
    grad_bytes = {UnitKind.EMBED: 4 * e, UnitKind.BLOCK: 2 * b, UnitKind.HEAD: 4 * h}  # bf16 blocks
    for k in (0, 1, 2, 5, 33, 34, 99):
        c = cfg(**base, **{"offload.two_pass_units": str(k)})
        p = resolve_plan(c)
        first = [u for u in p.units if u.position < k]
        assert memory.plan_memory(c, p).two_pass_grads == sum(grad_bytes[u.kind] for u in first)


def test_the_log_line_says_what_the_plan_does():
    p = resolve_plan(cfg(**ZERO3, **{"offload.resident_blocks": "1"}))
    line = p.describe("adamw", "TFRT_CPU_0")
    assert line.startswith("ZeRO-3 offload: fp32 masters and adamw state in host RAM")
    assert "fused kernels, overlapped, two-pass updates adaptive, up to 6 units" in line
    assert "3/4 blocks streamed" in line and line.endswith("weights on TFRT_CPU_0")
    assert resolve_plan(cfg()).describe("adamw", "4 device(s)").startswith("resident:")


def test_an_optimizer_without_fused_kernels_trains_with_the_default_offload_settings(monkeypatch):
    """An optimizer the fused kernels do not implement runs as optax on XLA:CPU; the default settings
    (adaptive two-pass updates) then resolve to none, instead of asking the pipeline for a fused-only
    feature."""
    monkeypatch.setattr(plan, "FUSED_OPTIMIZERS", ("adamw", "adam", "sgd"))  # as if lion had no kernel
    c = cfg(**ZERO3, **{"optimizer.name": "lion", "optimizer.lr": "1e-4", "steps": "2", "data.seq_len": "32"})
    p = resolve_plan(c)
    assert not p.host_update.fused and p.host_update.two_pass.max_units == 0
    trainer = build_trainer(c, placement.make_mesh(jax.devices()[:1]))
    state = trainer.init(jax.random.key(0))
    batches = build_data(c.data, c.model.vocab_size, c.seed).train_iter()
    for _ in range(2):
        state, m = trainer.step(state, trainer.put_batch(next(batches)))
        assert np.isfinite(float(m.loss))
