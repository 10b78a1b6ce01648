"""The Trainer contract as research code uses it: build with keyword overrides, step, evaluate, then
save and restore (`jaxzero.storage.state_io`), export (`jaxzero.interop.state_export`); batches
checked; the same ownership rule in every mode."""

import io
import json

import jax
import numpy as np
import pytest

from jaxzero import build_data, build_trainer, export_state, restore_state, save_state
from jaxzero.cli.train import train
from jaxzero.config import CheckpointError, ConfigError
from jaxzero.interop import import_hf
from jaxzero.plan import placement
from jaxzero.storage import run_dir as run_dir_lib

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


def test_keyword_overrides_set_keys_and_leave_a_checkpoint_s_shape_to_the_config_builders():
    """`build_trainer(**overrides)` sets keys as the config reads them (the engine layer reads no file of
    Hugging Face's): an `hf:DIR` model name is refused, saying which builder reads its shape."""
    with pytest.raises(ConfigError, match=r"jaxzero.apply_overrides\(cfg, \{'model.name': 'hf:DIR'\}\)"):
        build_trainer(model__name="hf:/no/such/checkpoint")


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
    path = save_state(trainer, state, tmp_path, step=3, data_state=batches.state)
    assert path == tmp_path / "checkpoints" / "3" and (path / "checksums.json").is_file()
    losses = []
    for _ in range(3):
        state, m = trainer.step(state, trainer.put_batch(next(batches)))
        losses.append(float(m.loss))

    again = build(mode)
    restored, step, data_state = restore_state(again, tmp_path)
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


def test_a_saved_directory_is_a_run_the_cli_resumes(tmp_path):
    """`save_state` writes the run's config.json beside the checkpoint: `python -m jaxzero.train
    --run_dir=DIR` (here `train`) resumes it. A saved step, another run's directory, and a foreign one
    are refused; `restore_state` of what is not there names what is, and creates nothing."""
    trainer = build("resident")
    data = build_data(trainer.config.data, trainer.config.model.vocab_size, 0)
    batches = data.train_iter()
    state = trainer.init(jax.random.key(0))
    state, _ = trainer.step(state, trainer.put_batch(next(batches)))
    run = tmp_path / "run"
    save_state(trainer, state, run, step=1, data_state=batches.state)
    assert run_dir_lib.inspect_run_dir(run).kind is run_dir_lib.RunKind.RESUME
    with pytest.raises(ValueError, match="checkpoints/1 exists already"):
        save_state(trainer, state, run, step=1)
    other = build_trainer(mesh=trainer.mesh, **{**TINY, "data__batch_size": 8})
    with pytest.raises(ConfigError, match=r"data.batch_size \(4 -> 8\)"):
        save_state(other, other.init(jax.random.key(0)), run, step=2)
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match="is not a jaxzero run"):
        save_state(trainer, state, tmp_path / "mine", step=1)
    assert sorted(p.name for p in (tmp_path / "mine").iterdir()) == ["notes.txt"]

    with pytest.raises(
        CheckpointError, match=r"checkpoints has no checkpoint 5 to restore; it has checkpoints \[1\]"
    ):
        restore_state(trainer, run, step=5)
    with pytest.raises(CheckpointError, match=r"/absent' does not exist: name a jaxzero run's directory"):
        restore_state(trainer, tmp_path / "absent")
    assert not (tmp_path / "absent").exists()
    (tmp_path / "empty").mkdir()
    with pytest.raises(
        CheckpointError,
        match=r"/checkpoints holds no checkpoint to restore; train with checkpoint.enabled=true",
    ):
        restore_state(trainer, tmp_path / "empty")

    # A home-relative directory names the same place for both (save_state expands it; so must restore).
    home = tmp_path / "home"
    home.mkdir()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HOME", str(home))
        save_state(trainer, state, "~/runs/x", step=1)
        assert restore_state(trainer, "~/runs/x")[1] == 1
    assert (home / "runs" / "x" / "checkpoints" / "1").is_dir()

    console = io.StringIO()
    train(run_dir_lib.read_saved_config(run), console=console)  # the CLI's loop, on the saved config
    out = console.getvalue()
    assert f"resumed from {run / 'checkpoints' / '1'}" in out, out
    assert run_dir_lib.saved_steps(run)[-1] == TINY["steps"]


def test_export_writes_what_import_reads_back_and_replaces_only_when_asked(tmp_path):
    trainer = build("resident")
    state = trainer.init(jax.random.key(0))
    export_state(trainer, state, tmp_path / "hf", dtype="float32")
    _, params = import_hf(tmp_path / "hf")
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(jax.device_get(state.params))):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(FileExistsError, match="pass overwrite=True"):
        export_state(trainer, state, tmp_path / "hf")
    export_state(trainer, state, tmp_path / "hf", overwrite=True)  # bfloat16 now
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["dtype"] == "bfloat16"

    export_state(trainer, state, tmp_path / "orbax", format="orbax")
    with pytest.raises(FileExistsError, match="pass overwrite=True"):
        export_state(trainer, state, tmp_path / "orbax", format="orbax")
    export_state(trainer, state, tmp_path / "orbax", format="orbax", overwrite=True)
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="is not a jaxzero export"):
        export_state(trainer, state, tmp_path / "mine", format="orbax", overwrite=True)
    assert sorted(p.name for p in (tmp_path / "mine").iterdir()) == ["notes.txt"]


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
def test_a_step_consumes_its_state_in_every_mode(tmp_path, mode):
    trainer = build(mode)
    state = trainer.init(jax.random.key(0))
    new, _ = trainer.step(state, trainer.put_batch(np.zeros((1, 4, 17), np.int32)))
    with pytest.raises(RuntimeError, match="deleted|consumed by trainer.step"):
        jax.device_get(state.params)
    jax.device_get(new.params)  # the returned state is the live one
    consumed = "this training state was consumed by trainer.step: use the state that step returned"
    with pytest.raises(RuntimeError, match=consumed):
        trainer.step(state, trainer.put_batch(np.zeros((1, 4, 17), np.int32)))
    with pytest.raises(RuntimeError, match=consumed):
        trainer.evaluate(state, [np.zeros((4, 17), np.int32)])
    with pytest.raises(RuntimeError, match=consumed):
        save_state(trainer, state, tmp_path / "run", step=1)
    with pytest.raises(RuntimeError, match=consumed):
        export_state(trainer, state, tmp_path / "hf")
    assert not (tmp_path / "run").exists() and not (tmp_path / "hf").exists()
