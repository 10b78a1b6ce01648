"""The Trainer contract as research code uses it: build with keyword overrides, step, evaluate, save,
restore, export; batches checked; the same ownership rule in every mode."""

import jax
import numpy as np
import pytest

from jaxzero import build_data, build_trainer, placement
from jaxzero.interop import import_hf

MODES = {"resident": {}, "zero3-offload": {"offload__optimizer": "cpu", "offload__params": "cpu"}}
TINY = {
    "model__num_layers": 2,
    "model__compute_dtype": "float32",
    "data__seq_len": 16,
    "data__batch_size": 4,
    "steps": 6,
}


def build(mode: str):
    return build_trainer(mesh=placement.make_mesh(jax.devices()[:1]), **TINY, **MODES[mode])


@pytest.mark.parametrize("mode", list(MODES))
def test_save_and_restore_continue_exactly(tmp_path, mode):
    """Three steps, save, three more; against restore after three in a new trainer, three more: the same
    losses and masters bit for bit (the `python -m jaxzero.train` checkpoint format)."""
    trainer = build(mode)
    assert trainer.config.model.num_layers == 2 and trainer.config.steps == 6  # the keyword overrides
    data = build_data(trainer.config.data, trainer.config.model.vocab_size, 0)
    batches = data.train_iter()
    state = trainer.init(jax.random.key(0))
    for _ in range(3):
        state, _ = trainer.step(state, trainer.put_batch(next(batches)))
    path = trainer.save(state, tmp_path, step=3, data_state=batches.state)
    assert path == tmp_path / "checkpoints" / "3" and (path / "checksums.json").is_file()
    losses = []
    for _ in range(3):
        state, m = trainer.step(state, trainer.put_batch(next(batches)))
        losses.append(float(m.loss))

    again = build(mode)
    restored, step, data_state = again.restore(tmp_path)
    assert step == 3
    resumed = data.train_iter(data_state)
    more = []
    for _ in range(3):
        restored, m = again.step(restored, again.put_batch(next(resumed)))
        more.append(float(m.loss))
    assert more == losses
    for a, b in zip(
        jax.tree.leaves(jax.device_get(restored.params)), jax.tree.leaves(jax.device_get(state.params))
    ):
        np.testing.assert_array_equal(a, b)
    assert (
        abs(again.evaluate(restored, data.val_batches(2)) - trainer.evaluate(state, data.val_batches(2))) == 0
    )


def test_export_writes_what_import_reads_back(tmp_path):
    trainer = build("resident")
    state = trainer.init(jax.random.key(0))
    trainer.export(state, tmp_path / "hf", dtype="float32")
    _, params = import_hf(tmp_path / "hf")
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(jax.device_get(state.params))):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("mode", list(MODES))
def test_batches_are_checked_with_a_clear_error(mode):
    trainer = build(mode)
    good = np.zeros((1, 4, 17), np.int32)
    trainer.put_batch(good)
    with pytest.raises(ValueError, match=r"must be int32 \(1, 4, 17\) for this config; got int32 \(4, 17\)"):
        trainer.put_batch(good[0])  # 2-D: the micro-batch axis is missing
    with pytest.raises(ValueError, match="an integer dtype; got float32"):
        trainer.put_batch(good.astype(np.float32))
    bad = good.copy()
    bad[0, 1, 3] = 256
    with pytest.raises(ValueError, match=r"ids in \[0, 256\], outside \[0, model.vocab_size=256\)"):
        trainer.put_batch(bad)
    with pytest.raises(ValueError, match=r"must be int32 \(N, 17\)"):
        trainer.put_eval_batch(np.zeros((4, 9), np.int32))  # a wrong seq_len


@pytest.mark.parametrize("mode", list(MODES))
def test_a_step_consumes_its_state_in_every_mode(mode):
    trainer = build(mode)
    state = trainer.init(jax.random.key(0))
    new, _ = trainer.step(state, trainer.put_batch(np.zeros((1, 4, 17), np.int32)))
    with pytest.raises(RuntimeError, match="deleted|consumed by trainer.step"):
        jax.device_get(state.params)
    jax.device_get(new.params)  # the returned state is the live one
