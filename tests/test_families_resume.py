"""Resumed == uninterrupted for the 2026 families' blocks on the offload engine (blocks streamed, the
update on the host): Qwen3's q/k norms, Gemma 3's per-layer kinds, a mixture of experts and Granite
MoE's scalars with its load-balancing loss. A run saved
after two steps and restored by a new trainer goes on bit for bit as the run that never stopped."""

import jax
import numpy as np
import pytest
from test_nnx_model import batches, steps
from test_offload import GEMMA3, GRANITE_MOE, MODES, MOE, QWEN3, STEPS, tiny

from jaxzero.plan import placement
from jaxzero.storage.state_io import restore_state, save_state
from jaxzero.trainer import build_trainer

FAMILIES = {"qwen3": QWEN3, "gemma3": GEMMA3, "moe": MOE, "granitemoe": GRANITE_MOE}


def _trainer(cfg):
    return build_trainer(cfg, placement.make_mesh(jax.devices()[:1]))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_resumed_run_equals_the_uninterrupted_one(family, tmp_path):
    cfg = tiny("llama", "float32", **FAMILIES[family], **MODES["zero3-offload"])
    todo = batches(cfg, STEPS)
    trainer = _trainer(cfg)
    whole, losses, _ = steps(trainer, trainer.init(jax.random.key(cfg.seed)), todo)

    trainer = _trainer(cfg)
    state, before, _ = steps(trainer, trainer.init(jax.random.key(cfg.seed)), todo[:2])
    save_state(trainer, state, tmp_path / "run", step=2)
    resumed = _trainer(cfg)
    state, step, _ = restore_state(resumed, tmp_path / "run")
    state, after, _ = steps(resumed, state, todo[2:])
    assert step == 2
    np.testing.assert_array_equal(np.concatenate([before, after]), losses)
    for a, b in zip(
        jax.tree.leaves(jax.device_get(state.params)), jax.tree.leaves(jax.device_get(whole.params))
    ):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(
        jax.tree.leaves(jax.device_get(state.opt_state)), jax.tree.leaves(jax.device_get(whole.opt_state))
    ):
        np.testing.assert_array_equal(a, b)
