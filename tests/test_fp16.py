"""float16 with dynamic loss scaling: DeepSpeed's scale rules, skipped steps, offload == resident."""

import jax
import numpy as np
import pytest

from jaxzero.config import FP16Config, TrainConfig
from jaxzero.data import build_data
from jaxzero.numerics.loss_scale import init_loss_scale, update_loss_scale
from jaxzero.numerics.optim import learning_rate_schedule
from jaxzero.overrides import apply_overrides
from jaxzero.plan import placement
from jaxzero.storage.checkpoint import Checkpointer
from jaxzero.storage.checkpoint_layout import make_meta
from jaxzero.trainer import build_trainer


class DeepSpeedDynamicLossScaler:
    """The oracle: DeepSpeed's `DynamicLossScaler.update_scale` rules (deepspeed/runtime/fp16/
    loss_scaler.py), restated in plain Python with its variable names, scale factor 2, and no
    error at the minimum scale (jaxzero's trainer raises that itself)."""

    def __init__(self, init_scale, scale_window, min_scale, delayed_shift, consecutive_hysteresis):
        self.cur_scale = init_scale
        self.cur_iter = 0
        self.last_overflow_iter = -1
        self.scale_window = scale_window
        self.min_scale = min_scale
        self.delayed_shift = delayed_shift
        self.cur_hysteresis = delayed_shift
        self.consecutive_hysteresis = consecutive_hysteresis

    def update_scale(self, overflow: bool) -> None:
        if overflow:
            if self.delayed_shift == 1 or self.cur_hysteresis == 1:
                self.cur_scale = max(self.cur_scale / 2.0, self.min_scale)
            else:
                self.cur_hysteresis -= 1
            self.last_overflow_iter = self.cur_iter
        else:
            if self.consecutive_hysteresis:
                self.cur_hysteresis = self.delayed_shift
            stable_interval = (self.cur_iter - self.last_overflow_iter) - 1
            if stable_interval > 0 and stable_interval % self.scale_window == 0:
                if not self.consecutive_hysteresis:
                    self.cur_hysteresis = self.delayed_shift
                self.cur_scale *= 2.0
        self.cur_iter += 1


@pytest.mark.parametrize("hysteresis", [1, 2, 3])
@pytest.mark.parametrize("consecutive", [False, True])
@pytest.mark.parametrize("window", [1, 3, 7])
def test_loss_scale_follows_deepspeed_rules(hysteresis, consecutive, window):
    cfg = FP16Config(
        initial_scale_power=10,
        loss_scale_window=window,
        hysteresis=hysteresis,
        consecutive_hysteresis=consecutive,
        min_loss_scale=4.0,
    )
    oracle = DeepSpeedDynamicLossScaler(2.0**10, window, 4.0, hysteresis, consecutive)
    update = jax.jit(lambda s, o: update_loss_scale(s, o, cfg))
    state = init_loss_scale(cfg)
    rng = np.random.default_rng(hysteresis * 100 + window * 10 + consecutive)
    # Bursts of overflows and stable stretches, long enough to hit the minimum and to grow again.
    flags = [bool(x) for x in (rng.random(300) < np.repeat(rng.random(30), 10))]
    for overflow in flags:
        oracle.update_scale(overflow)
        state = update(state, np.bool_(overflow))
        got = jax.device_get(state)
        assert float(got.scale) == oracle.cur_scale
        assert int(got.cur_hysteresis) == oracle.cur_hysteresis
        assert int(got.last_overflow_iter) == oracle.last_overflow_iter
        assert int(got.cur_iter) == oracle.cur_iter


def fp16_cfg(**over) -> TrainConfig:
    base = {
        "model.compute_dtype": "float16",
        "model.num_layers": "2",
        "data.seq_len": "32",
        "data.batch_size": "4",
        "steps": "10",
        "optimizer.warmup_steps": "0",
        "optimizer.lr": "1e-2",
        "fp16.initial_scale_power": "40",
        "fp16.hysteresis": "2",
        "fp16.loss_scale_window": "4",
    }
    return apply_overrides(TrainConfig(), {**base, **over})


def run(cfg: TrainConfig, steps: int = 10):
    trainer = build_trainer(cfg, placement.make_mesh(jax.devices()[:1]))
    batches = build_data(cfg.data, cfg.model.vocab_size, cfg.seed).train_iter()
    state = trainer.init(jax.random.key(0))
    trace = []
    for _ in range(steps):
        before = jax.device_get(state.params)
        state, m = trainer.step(state, trainer.put_batch(next(batches)))
        m = jax.device_get(m)
        after = jax.device_get(state.params)
        unchanged = all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after)))
        trace.append(
            (
                float(m.loss),
                float(m.loss_scale),
                bool(m.skipped),
                int(jax.device_get(state.step)),
                unchanged,
                float(m.lr),
            )
        )
    return trainer, state, trace


OFFLOAD_MODES = {
    "resident": {},
    "zero3-offload": {"offload.optimizer": "cpu", "offload.params": "cpu"},
    # units updated on the accelerator skip overflowing steps as the host's do
    "zero3-mixed": {"offload.optimizer": "cpu", "offload.params": "cpu", "offload.device_state_units": "2"},
}


@pytest.mark.parametrize("mode", list(OFFLOAD_MODES))
def test_overflowing_steps_are_skipped_and_training_goes_on(mode):
    """An initial scale of 2**40 makes the first float16 backward passes overflow (inf gradients):
    those steps change nothing but the scale, which evolves exactly by DeepSpeed's rules; once it is
    low enough, steps apply and the loss falls."""
    cfg = fp16_cfg(**OFFLOAD_MODES[mode])
    _, _, trace = run(cfg, steps=40)
    oracle = DeepSpeedDynamicLossScaler(2.0**40, 4, 1.0, 2, False)
    schedule = learning_rate_schedule(cfg.optimizer, cfg.steps)
    applied = 0
    for _, scale, skipped, step, unchanged, lr in trace:
        assert scale == oracle.cur_scale  # the scale this step used
        oracle.update_scale(skipped)
        assert lr == pytest.approx(float(schedule(applied)), rel=1e-6)  # the schedule counts updates only
        if skipped:
            assert unchanged and step == applied  # no update, no step count; the batch is consumed
        else:
            applied += 1
            assert not unchanged and step == applied
    skipped = [t[2] for t in trace]
    assert skipped[0] and skipped[1] and not all(skipped), skipped
    first_ok = skipped.index(False)
    assert trace[-1][0] < trace[first_ok][0] - 0.5, "training goes on and the loss falls"


@pytest.mark.parametrize("mode", ["zero3-offload", "zero3-mixed"])
def test_offload_matches_resident_in_float16(mode):
    """Same skipped steps, same scales; losses and parameters within float16 tolerance (10 bits of
    mantissa: losses within 1e-2, parameters within 2e-2 relative).

    At lr 3e-3, not the shared 1e-2: there the first few updates amplify any rounding difference about
    tenfold per step, so even two resident runs differing only in `data.grad_accum` end 1.5% apart and
    the comparison would measure that chaos, not the offload."""
    lr = {"optimizer.lr": "3e-3"}
    _, ref, ref_trace = run(fp16_cfg(**lr), steps=30)
    _, off, off_trace = run(fp16_cfg(**lr, **OFFLOAD_MODES[mode]), steps=30)
    assert [t[1:4] for t in off_trace] == [t[1:4] for t in ref_trace]
    np.testing.assert_allclose([t[0] for t in off_trace], [t[0] for t in ref_trace], atol=1e-2, rtol=0)
    for a, b in zip(jax.tree.leaves(jax.device_get(off.params)), jax.tree.leaves(jax.device_get(ref.params))):
        assert np.linalg.norm(a - b) / np.linalg.norm(b) < 2e-2


def test_loss_scale_state_is_checkpointed(tmp_path):
    cfg = fp16_cfg()
    trainer, state, _ = run(cfg, steps=5)
    ckpt = Checkpointer(tmp_path, cfg.checkpoint)
    saved = trainer.saved_state(state)
    ckpt.save(5, saved, make_meta(5, {"epoch": 0, "cursor": 0, "num_windows": 1}, cfg, trainer.layout, saved))
    ckpt.wait()
    restored = trainer.from_saved_state(
        ckpt.restore(5, trainer.abstract_saved_state(), trainer.layout, cfg).state
    )
    ckpt.close()
    assert jax.device_get(restored.loss_scale) == jax.device_get(state.loss_scale)
    assert float(restored.loss_scale.scale) < 2.0**40  # it moved, and the move was saved
