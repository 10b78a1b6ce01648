"""Checkpoints: exact resume after SIGKILL (also mid-save), preemption, corruption and mismatches."""

import contextlib
import dataclasses
import json
import logging
import os
import pty
import select
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from subprocess_run import run_module, run_program, user_env

from jaxzero.config import CheckpointError, TrainConfig, in_flight_bytes
from jaxzero.overrides import apply_overrides
from jaxzero.plan import placement
from jaxzero.primitives.deferred import resolved
from jaxzero.primitives.write_fence import WriteFence
from jaxzero.storage import checkpoint as checkpoint_lib
from jaxzero.storage.checkpoint import Checkpointer
from jaxzero.storage.checkpoint_disk import CheckpointWriteError, ensure_disk_room
from jaxzero.storage.checkpoint_layout import largest_array_bytes, make_meta, state_bytes
from jaxzero.storage.checkpoint_masters import read_saved_state
from jaxzero.storage.state_io import restore_state, save_state
from jaxzero.trainer import build_trainer

RUN = [
    "--steps=12",
    "--logging.log_every=1",
    "--logging.eval_every=0",
    "--data.seq_len=32",
    "--data.batch_size=4",
    "--model.num_layers=2",
    "--checkpoint.every=4",
    "--checkpoint.keep=5",
]
MODES = {"resident": [], "zero3-offload": ["--offload.optimizer=cpu", "--offload.params=cpu"]}


def cli(*args: str, cwd: Path, env_extra: dict | None = None, wait: bool = True):
    return run_module("jaxzero.train", *args, cwd=cwd, env_extra=env_extra, wait=wait)


def losses(run_dir: Path) -> dict[int, float]:
    recs = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in recs}


def final_params(run_dir: Path, step: int) -> list[np.ndarray]:
    """The saved masters of checkpoint `step`, read back as NumPy (no placement needed to compare)."""
    tree = read_saved_state(run_dir / "checkpoints" / str(step))
    return [np.asarray(x) for x in jax.tree.leaves(tree["params"])]


@pytest.mark.slow  # the CLI in subprocesses
@pytest.mark.parametrize("mode", list(MODES))
def test_sigkill_mid_save_then_resume_is_bitwise(tmp_path, mode):
    args = [*RUN, *MODES[mode]]
    full = cli(*args, "--run_dir=full", cwd=tmp_path)
    assert full.returncode == 0, full.stderr[-3000:]
    # Killed by SIGKILL right after the save of step 8 starts: the write may or may not be committed.
    killed = run_program("kill_after_save.py", "8", *args, "--run_dir=killed", cwd=tmp_path)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    resumed = cli("--run_dir=killed", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout
    a, b = losses(tmp_path / "full"), losses(tmp_path / "killed")
    assert sorted(a) == sorted(b) == list(range(1, 13))
    assert a == b  # bitwise: JSON floats printed to 6 significant digits, and the parameters below
    for x, y in zip(final_params(tmp_path / "full", 12), final_params(tmp_path / "killed", 12), strict=True):
        np.testing.assert_array_equal(x, y)


@pytest.mark.slow  # the CLI in subprocesses
def test_sigterm_saves_at_a_step_boundary_and_exits_3(tmp_path):
    proc = cli(*RUN, "--steps=100000", "--checkpoint.every=0", "--run_dir=pre", cwd=tmp_path, wait=False)
    metrics = tmp_path / "pre" / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 3, err[-3000:]
    assert "preempted: SIGTERM: saved a checkpoint at step" in err
    saved = sorted(int(p.name) for p in (tmp_path / "pre" / "checkpoints").iterdir() if p.name.isdigit())
    assert len(saved) == 1 and saved[0] >= 3
    resumed = cli("--run_dir=pre", "--steps=" + str(saved[0] + 2), cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert max(losses(tmp_path / "pre")) == saved[0] + 2


@pytest.mark.slow  # the CLI in a subprocess, on a terminal of its own
def test_a_closed_terminal_saves_at_a_step_boundary_and_exits_3(tmp_path):
    """SIGHUP as a closed terminal sends it (a dropped SSH session): the run's terminal goes away
    under it, and it stops after the step with a checkpoint and exit 3, as for SIGTERM (it was killed
    with nothing saved), though every write to that terminal now fails."""
    pid, terminal = pty.fork()
    if pid == 0:  # the child: the run, its stdout and stderr the terminal, its session's leader
        env = user_env()
        os.chdir(tmp_path)
        argv = [sys.executable, "-m", "jaxzero.train", *RUN, "--steps=100000", "--checkpoint.every=0"]
        os.execve(sys.executable, [*argv, "--run_dir=hup"], env)
    metrics = tmp_path / "hup" / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
        if select.select([terminal], [], [], 0.2)[0]:  # drain it, as a terminal shows what it is sent
            with contextlib.suppress(OSError):
                os.read(terminal, 65536)
    os.close(terminal)  # the terminal closes: the kernel sends its session's leader SIGHUP
    deadline = time.time() + 120
    while (ended := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.time() < deadline:
        time.sleep(0.2)
    assert ended[0] == pid, "the run did not end after SIGHUP"
    assert os.waitstatus_to_exitcode(ended[1]) == 3
    saved = sorted(int(p.name) for p in (tmp_path / "hup" / "checkpoints").iterdir() if p.name.isdigit())
    assert len(saved) == 1 and saved[0] >= 3
    resumed = cli("--run_dir=hup", "--steps=" + str(saved[0] + 2), cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert max(losses(tmp_path / "hup")) == saved[0] + 2


def _du(directory: Path) -> int:
    return sum(f.stat().st_size for f in directory.rglob("*") if f.is_file())


@contextlib.contextmanager
def small_disk(path: Path, size: int):
    """A tmpfs of `size` bytes at `path` (root only: skipped elsewhere)."""
    path.mkdir()
    mount = ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)]
    mounted = subprocess.run(mount, capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=True)


@pytest.mark.slow  # the CLI in subprocesses, on a file system of its own
@pytest.mark.parametrize("async_save", ["true", "false"])
def test_saves_keep_within_the_disk_the_plan_counts(tmp_path, async_save):
    """checkpoint.keep=1 needs room for 2 checkpoints at once (the kept one and the one being
    written): on a disk holding 2 and not 3, saves every 3 steps and a final save right behind one
    (step 7) complete, though each checkpoint commits slowly. The room for a save was counted while
    the previous one was still committing, its files and the checkpoint it supersedes both on disk:
    3 checkpoints at once, and the final save refused. keep=2 needs 3: refused at start."""
    args = [*RUN, "--steps=7", "--checkpoint.every=3", "--checkpoint.keep=1"]
    args.append(f"--checkpoint.async_save={async_save}")
    probe = cli(*args, "--steps=3", "--run_dir=probe", cwd=tmp_path)
    assert probe.returncode == 0, probe.stderr[-3000:]
    size = _du(tmp_path / "probe" / "checkpoints" / "3")
    with small_disk(tmp_path / "disk", 2 * size + size // 2 + (1 << 20)) as disk:
        run = run_program("slow_commits.py", *args, f"--run_dir={disk / 'run'}", cwd=tmp_path)
        assert run.returncode == 0, run.stderr[-3000:]
        assert sorted(p.name for p in (disk / "run" / "checkpoints").iterdir()) == ["7"]
        refused = cli(*args, "--checkpoint.keep=2", f"--run_dir={disk / 'keep2'}", cwd=tmp_path)
        assert refused.returncode != 0 and "not enough free space" in refused.stderr, refused.stderr[-3000:]
        saved = disk / "keep2" / "checkpoints"
        assert not saved.exists() or not any(saved.iterdir())


@pytest.mark.slow  # the CLI in subprocesses
def test_corrupt_latest_checkpoint_falls_back_to_previous(tmp_path):
    run = cli(*RUN, "--run_dir=c", cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    latest = tmp_path / "c" / "checkpoints" / "12" / "state"
    for data in (f for f in latest.glob("block_*/**/*") if f.is_file() and f.parent.name == "d"):
        data.write_bytes(data.read_bytes()[:10])  # the blocks' array data, every metadata file intact
    # The programs that read one checkpoint name it and the others; nothing written.
    export = run_module("jaxzero.export", "--run_dir=c", "--out=ex", cwd=tmp_path)
    assert export.returncode == 2, export.stderr[-3000:]
    assert (
        "checkpoints/12 could not be read" in export.stderr
        and "--step=N (this run has [4, 8])" in export.stderr
    )
    assert "Traceback" not in export.stderr and not (tmp_path / "ex").exists()
    # A resume that skips the checksums fails on reading it, and says how to fall back.
    unchecked = cli("--run_dir=c", "--steps=14", "--checkpoint.verify=false", cwd=tmp_path)
    assert unchecked.returncode == 2, unchecked.stderr[-3000:]
    assert "checkpoints/12 could not be read" in unchecked.stderr
    assert "--checkpoint.verify=true" in unchecked.stderr
    for f in latest.rglob("*"):
        if f.is_file() and f.stat().st_size > 64 and "metadata" not in f.name:
            f.write_bytes(f.read_bytes()[: f.stat().st_size // 3])  # truncate the array data
    again = cli("--run_dir=c", "--steps=14", cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "checkpoints/12 is unreadable" in again.stderr and "trying the previous one" in again.stderr
    assert "resumed from" in again.stdout and again.stdout.count("checkpoints/8") >= 1


@pytest.mark.slow  # the CLI in subprocesses
def test_resume_refuses_a_different_run(tmp_path):
    run = cli(*RUN, "--steps=4", "--run_dir=r", cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    other = cli("--run_dir=r", "--model.hidden_size=64", cwd=tmp_path)
    assert other.returncode == 2
    assert "cannot change model.hidden_size (128 -> 64)" in other.stderr


def tiny(**over) -> TrainConfig:
    return apply_overrides(
        TrainConfig(), {"model.num_layers": "2", "data.seq_len": "32", "data.batch_size": "4", **over}
    )


def test_restore_places_offloaded_state_on_the_host_and_rejects_mismatches(tmp_path):
    mesh = placement.make_mesh(jax.devices()[:1])
    cfg = tiny(**{"offload.optimizer": "cpu", "offload.params": "cpu"})
    trainer = build_trainer(cfg, mesh)
    state = trainer.init(jax.random.key(0))
    ckpt = Checkpointer(tmp_path, cfg.checkpoint)
    saved = trainer.saved_state(state)
    ckpt.save(1, saved, make_meta(1, {"epoch": 0, "cursor": 4, "num_windows": 9}, cfg, trainer.layout, saved))
    ckpt.wait()
    restored = ckpt.restore(1, trainer.abstract_saved_state(), trainer.layout, cfg)
    new = trainer.from_saved_state(restored.state)
    host = jax.devices("cpu")[0]
    assert all(x.devices() == {host} for x in jax.tree.leaves((new.params, new.opt_state)))
    assert {x.sharding.memory_kind for x in jax.tree.leaves(new.weights.blocks)} == {"pinned_host"}
    for x, y in zip(
        jax.tree.leaves(jax.device_get(state.params)), jax.tree.leaves(jax.device_get(new.params))
    ):
        np.testing.assert_array_equal(x, y)

    wider = tiny(**{"offload.optimizer": "cpu", "offload.params": "cpu", "model.intermediate_size": "512"})
    other = build_trainer(wider, mesh)
    with pytest.raises(
        CheckpointError, match=r"does not match this run's model .*model.intermediate_size=384"
    ):
        ckpt.restore(1, other.abstract_saved_state(), other.layout, wider)
    ckpt.close()


def test_a_checkpoint_with_arrays_this_run_lacks_is_a_mismatch_and_stays_where_it_is(tmp_path):
    # A float16 run's checkpoint (its loss scale's arrays) resumed as float32: this run's state has
    # no such arrays. Reported as another run's checkpoint, not set aside as unreadable.
    mesh = placement.make_mesh(jax.devices()[:1])
    half = tiny(**{"offload.optimizer": "cpu", "model.compute_dtype": "float16"})
    trainer = build_trainer(half, mesh)
    save_state(trainer, trainer.init(jax.random.key(0)), tmp_path, step=1)
    full = tiny(**{"offload.optimizer": "cpu", "model.compute_dtype": "float32"})
    with pytest.raises(
        CheckpointError, match=r"loss_scale.*in the checkpoint, not in this run's state.*compute_dtype"
    ):
        restore_state(build_trainer(full, mesh), tmp_path)
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["1"]
    assert not (tmp_path / "checkpoints-unreadable").exists()


def run_steps(trainer, state, first: int, last: int, cfg: TrainConfig):
    """Steps first..last on fixed random batches (batch k depends only on k)."""
    losses = []
    for k in range(first, last + 1):
        d = cfg.data
        batch = np.random.default_rng(k).integers(0, cfg.model.vocab_size, (1, d.batch_size, d.seq_len + 1))
        state, m = trainer.step(state, trainer.put_batch(batch.astype(np.int32)))
        losses.append(float(jax.device_get(m.loss)))
    return state, losses


@pytest.mark.parametrize(
    "saved_by, resumed_by",
    [("resident", "offload"), ("offload", "resident"), ("mixed", "offload"), ("resident", "mixed")],
)
def test_changing_plans_resumes_under_the_other_trainer(tmp_path, saved_by, resumed_by):
    """Saved by one trainer after 3 steps, resumed by the other for 3 more: equal to 6 uninterrupted
    resident steps (float32 compute, the offload == resident tolerances of test_offload.py)."""
    mesh = placement.make_mesh(jax.devices()[:1])
    offload = {"offload.optimizer": "cpu", "offload.params": "cpu"}
    cfgs = {
        "resident": tiny(**{"model.compute_dtype": "float32"}),
        "offload": tiny(**{"model.compute_dtype": "float32", **offload}),
        # the embedding and block 0 with their state on the accelerator, the rest on the host
        "mixed": tiny(**{"model.compute_dtype": "float32", **offload, "offload.device_state_units": "2"}),
    }
    ref = build_trainer(cfgs["resident"], mesh)
    ref_state, ref_losses = run_steps(ref, ref.init(jax.random.key(0)), 1, 6, cfgs["resident"])

    first = build_trainer(cfgs[saved_by], mesh)
    state, losses = run_steps(first, first.init(jax.random.key(0)), 1, 3, cfgs[saved_by])
    ckpt = Checkpointer(tmp_path, cfgs[saved_by].checkpoint)
    saved = first.saved_state(state)
    meta = make_meta(3, {"epoch": 0, "cursor": 0, "num_windows": 1}, cfgs[saved_by], first.layout, saved)
    ckpt.save(3, saved, meta)
    ckpt.wait()
    second = build_trainer(cfgs[resumed_by], mesh)
    restored = ckpt.restore_latest(second.abstract_saved_state(), second.layout, cfgs[resumed_by])
    ckpt.close()
    state, more = run_steps(second, second.from_saved_state(restored.state), 4, 6, cfgs[resumed_by])
    np.testing.assert_allclose(losses + more, ref_losses, atol=1e-5, rtol=0)
    params, ref_params = jax.device_get(state.params), jax.device_get(ref_state.params)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(ref_params)):
        assert np.linalg.norm(a - b) / np.linalg.norm(b) < 2e-5


def copied(tree):
    """NumPy copies of every array of `tree` (`np.asarray` of a host array is a view of it)."""
    return jax.tree.map(lambda x: np.array(x, copy=True), jax.device_get(resolved(tree)))


MIXED = {"offload.optimizer": "cpu", "offload.params": "cpu", "offload.device_state_units": "2"}


def test_a_save_writes_one_part_at_a_time_and_restores_each_unit_where_it_lives(tmp_path, monkeypatch):
    """A save writes the scalars, then each unit in forward order, one Orbax PyTree each, releasing
    each unit at the fence once written; the restore puts the accelerator-updated units straight back
    on the accelerator and the others on the host, bit for bit, and each part reads back alone."""
    writes: list[str] = []
    handed: list[int] = []  # the array objects Orbax was given
    save = ocp.PyTreeCheckpointHandler.save

    def recording(self, directory, args):
        writes.append(Path(directory).name)
        handed.extend(id(x) for x in jax.tree.leaves(args.item) if isinstance(x, jax.Array))
        return save(self, directory, args=args)

    monkeypatch.setattr(ocp.PyTreeCheckpointHandler, "save", recording)
    mesh = placement.make_mesh(jax.devices()[:1])
    cfg = tiny(**{"model.compute_dtype": "float32", **MIXED, "checkpoint.async_save": "false"})
    trainer = build_trainer(cfg, mesh)
    state, _ = run_steps(trainer, trainer.init(jax.random.key(0)), 1, 2, cfg)
    ckpt = Checkpointer(tmp_path, cfg.checkpoint)
    saved = trainer.saved_state(state)
    released: list[int] = []
    fence = WriteFence()
    fence.written = lambda position, w=fence.written: (released.append(position), w(position))
    ckpt.save(
        2, saved, make_meta(2, {"epoch": 0, "cursor": 0, "num_windows": 1}, cfg, trainer.layout, saved), fence
    )
    assert not fence.pending()  # a blocking save returns committed
    assert writes == ["scalars", "embed", "block_0000", "block_0001", "head"]
    # Orbax gets handles of its own: the host copy JAX caches on an accelerator array Orbax reads goes
    # with the part once written, not with the trainer's state.
    own = {id(x) for x in jax.tree.leaves(saved) if isinstance(x, jax.Array)}
    assert handed and not own & set(handed)
    assert released == [0, 1, 2, 3]
    block = ocp.PyTreeCheckpointer().restore(tmp_path / "checkpoints" / "2" / "state" / "block_0001")
    for a, b in zip(
        jax.tree.leaves(block["params"]), jax.tree.leaves(jax.device_get(state.params.blocks[1]))
    ):
        np.testing.assert_array_equal(a, b)

    ckpt.close()
    abstract = trainer.abstract_saved_state()
    ckpt = Checkpointer(tmp_path, cfg.checkpoint, largest_array=largest_array_bytes(abstract))
    restored = trainer.from_saved_state(ckpt.restore(2, abstract, trainer.layout, cfg).state)
    ckpt.close()
    # the embedding and block 0 restored straight to the accelerator's placement, block 1 to the host's
    saved_params = abstract["params"]
    targets = [jax.tree.leaves(t)[0].sharding for t in (saved_params.embed, saved_params.blocks[1])]
    assert targets[0].memory_kind == "device" and isinstance(targets[1], jax.sharding.NamedSharding)
    assert targets[1].mesh.axis_names == (placement.HOST_AXIS,)
    on_device = [jax.tree.leaves(t)[0].sharding for t in (restored.params.embed, restored.params.blocks[0])]
    assert all(isinstance(s, jax.sharding.NamedSharding) and s.memory_kind == "device" for s in on_device)
    host = jax.tree.leaves(restored.params.blocks[1])[0].sharding
    assert isinstance(host, jax.sharding.SingleDeviceSharding)
    for tree in ("params", "opt_state"):
        before, after = jax.device_get(getattr(state, tree)), jax.device_get(getattr(restored, tree))
        for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after), strict=True):
            np.testing.assert_array_equal(a, b)


# the embedding's state on the accelerator, the blocks' in host RAM, the head's on disk
THREE_TIERS = {
    **MIXED,
    "offload.optimizer": "disk",
    "offload.device_state_units": "1",
    "offload.disk_units": "1",
}


@pytest.mark.parametrize("layout", ["resident", "mixed", "three-tiers"])
@pytest.mark.parametrize("room", ["copies", "waits"])
def test_training_goes_on_during_an_asynchronous_save_and_the_checkpoint_is_the_saved_step(
    tmp_path, monkeypatch, layout, room
):
    """An asynchronous save returns at once and steps run while it writes (slowed here to 0.3 s a
    part, so that they overlap), updating the arrays it writes from in place. A unit the writer has
    not written is copied into the checkpoint buffer before its update (`copies`: the offloaded
    host and disk units; the accelerator's wait), or, with no room, its update waits (`waits`): either
    way the checkpoint holds step 2's state exactly, and a resume from it equals the uninterrupted
    run bitwise."""
    save = ocp.PyTreeCheckpointHandler.save
    monkeypatch.setattr(
        ocp.PyTreeCheckpointHandler,
        "save",
        lambda self, directory, args: (time.sleep(0.3), save(self, directory, args=args)),
    )
    copies: list[int] = []
    copy_part = checkpoint_lib._copy_part
    if room == "waits":
        monkeypatch.setattr(checkpoint_lib, "_copy_part", lambda parts, position: False)
    else:
        monkeypatch.setattr(
            checkpoint_lib,
            "_copy_part",
            lambda parts, position: copy_part(parts, position) and (copies.append(position) or True),
        )
    mesh = placement.make_mesh(jax.devices()[:1])
    tiers = {
        "resident": {},
        "mixed": MIXED,
        "three-tiers": {**THREE_TIERS, "offload.disk_path": str(tmp_path)},
    }
    cfg = tiny(**{"model.compute_dtype": "float32", **tiers[layout]})
    trainer = build_trainer(cfg, mesh)
    state, _ = run_steps(trainer, trainer.init(jax.random.key(0)), 1, 2, cfg)
    expected = copied(trainer.saved_state(state))  # host arrays change in place: copies
    ckpt = Checkpointer(tmp_path, cfg.checkpoint)
    saved = trainer.saved_state(state)
    ckpt.save(
        2,
        saved,
        make_meta(2, {"epoch": 0, "cursor": 0, "num_windows": 1}, cfg, trainer.layout, saved),
        trainer.fence,
    )
    assert trainer.fence.pending()  # returned before writing (a blocking save returns with none pending)
    state, _ = run_steps(trainer, state, 3, 4, cfg)  # updates in place while the save writes
    if room == "waits" or layout == "resident":  # the resident step updates every unit at once
        assert trainer.fence.take_blocked_seconds() > 0.3  # its updates waited for the writer
    else:  # the host and disk units were copied for the writer (on a GPU the accelerator's wait)
        host_units = [u.position for u in trainer.plan.units if u.state.value != "device"]
        assert set(host_units) <= set(copies), (copies, host_units)
    ckpt.wait()
    final = copied(trainer.saved_state(state))
    written = read_saved_state(tmp_path / "checkpoints" / "2")
    for a, b in zip(jax.tree.leaves(expected), jax.tree.leaves(written), strict=True):
        np.testing.assert_array_equal(a, b)
    assert any(not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(final), jax.tree.leaves(written)))

    resumed = build_trainer(cfg, mesh)
    abstract = resumed.abstract_saved_state()
    restored = resumed.from_saved_state(ckpt.restore(2, abstract, resumed.layout, cfg).state)
    ckpt.close()
    again, _ = run_steps(resumed, restored, 3, 4, cfg)
    for a, b in zip(jax.tree.leaves(final), jax.tree.leaves(copied(resumed.saved_state(again)))):
        np.testing.assert_array_equal(a, b)
    trainer.close()
    resumed.close()


# A model whose saved state (0.7 GB) is 11 times the checkpoint buffer (64 MiB), with every tier in
# use: the embedding and two blocks' state on the accelerator, four units' on disk, the rest in RAM.
RSS_RUN = [
    "--model.num_layers=16",
    "--model.hidden_size=512",
    "--model.intermediate_size=1536",
    "--model.num_heads=8",
    "--model.num_kv_heads=8",
    "--model.vocab_size=4096",
    "--data.seq_len=32",
    "--data.batch_size=2",
    "--checkpoint.buffer_gib=0.0625",
    "--offload.optimizer=disk",
    "--offload.params=cpu",
    "--offload.device_state_units=3",
    "--offload.disk_units=4",
]


@pytest.mark.slow  # fresh processes, measured
def test_a_save_and_a_restore_take_the_buffer_and_one_unit_of_host_ram_whatever_the_state(tmp_path):
    """Measured in fresh processes (`tests/programs/checkpoint_rss.py`, peak RSS), not mocked: a
    blocking save, an asynchronous save while steps run (against the same steps without one), and a
    restore into a state the trainer can step (against a fresh state's RSS) each add at most what the
    plan counts for them (`memory.checkpoint_bytes`: the buffer, one unit, Orbax's working memory),
    a fraction of the state."""
    from jaxzero.planner.calibration import SAVE_WORKING_BYTES

    run = [*RSS_RUN, f"--offload.disk_path={tmp_path / 'disk'}"]

    def measure(mode: str, run_dir: str = "run") -> dict:
        proc = run_program("checkpoint_rss.py", mode, str(tmp_path / run_dir), *run, cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return json.loads(proc.stdout.strip().splitlines()[-1])

    blocking = measure("blocking")
    bound = blocking["buffer"] + blocking["unit"] + SAVE_WORKING_BYTES
    assert blocking["state"] > 10 * blocking["buffer"] and bound < blocking["state"] / 2
    assert blocking["save"] <= bound, blocking
    fresh, restored = measure("init"), measure("restore")
    assert restored["restore"] - fresh["init"] <= bound, (restored, fresh)
    background = measure("async", "run-async")
    assert background["save"] <= bound, background


def test_a_run_whose_checkpoints_cannot_fit_the_disk_is_refused_before_training(tmp_path, monkeypatch):
    """With checkpoint.keep=K a run holds K checkpoints and the one being written at once: the room for
    that many (less what its checkpoints there take already) is checked before training, with the
    numbers and the setting that needs less."""
    cfg = apply_overrides(TrainConfig(), {"checkpoint.keep": "2"}).checkpoint
    size = 10 * 2**20
    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10**12, 0, 25 * 2**20))
    ensure_disk_room(tmp_path / "checkpoints", size, cfg, saves=1)  # one: 10 MiB
    ensure_disk_room(tmp_path / "checkpoints", size, cfg, saves=2)  # two: 20 MiB
    with pytest.raises(
        CheckpointWriteError, match=r"3 of 10\.0 MiB at once .* checkpoint.keep=2 .*25\.0 MiB"
    ):
        ensure_disk_room(tmp_path / "checkpoints", size, cfg, saves=5)
    (tmp_path / "checkpoints" / "4").mkdir(parents=True)  # a checkpoint of the run already there
    (tmp_path / "checkpoints" / "4" / "data").write_bytes(bytes(size))
    ensure_disk_room(tmp_path / "checkpoints", size, cfg, saves=5)  # 30 MiB less its 10


def test_a_save_short_of_room_deletes_what_it_supersedes_first_and_the_one_before_warns(
    tmp_path, monkeypatch, caplog
):
    """On a disk that holds 2.5 checkpoints, checkpoint.keep=2: the third save would not fit beside the
    two kept ones, so the older (which the retention deletes once the save commits) goes first, never
    the newest. With keep=1, where other files fill the disk while a save is written, the save warns
    that the next will not fit, while there is time to free space."""
    cfg = tiny()
    trainer = build_trainer(cfg)
    state, _ = run_steps(trainer, trainer.init(jax.random.key(0)), 1, 1, cfg)
    saved = trainer.saved_state(state)
    size = state_bytes(saved)
    meta = make_meta(1, {"epoch": 0, "cursor": 0, "num_windows": 1}, cfg, trainer.layout, saved)
    capacity, others = [0], [0]

    def disk_usage(path):  # a disk of `capacity` bytes holding the checkpoints and `others`' files
        used = _du(tmp_path / "checkpoints") if (tmp_path / "checkpoints").exists() else 0
        if (tmp_path / "checkpoints" / "2").exists():
            used += others[0]
        return shutil._ntuple_diskusage(capacity[0], used, max(capacity[0] - used, 0))

    monkeypatch.setattr(shutil, "disk_usage", disk_usage)
    keep2 = dataclasses.replace(cfg.checkpoint, keep=2, async_save=False)
    ckpt = Checkpointer(tmp_path, keep2)
    capacity[0] = int(3.5 * size)
    ckpt.save(1, saved, meta)
    ckpt.save(2, saved, meta)
    written = _du(tmp_path / "checkpoints" / "2")
    capacity[0] = _du(tmp_path / "checkpoints") + written // 2
    with caplog.at_level(logging.WARNING, logger="jaxzero"):
        ckpt.save(3, saved, meta)
    assert ckpt.steps() == [2, 3]
    assert "Deleting checkpoint 1 now, before checkpoint 3 is written" in caplog.text
    ckpt.close()

    shutil.rmtree(tmp_path / "checkpoints")
    caplog.clear()
    keep1 = dataclasses.replace(cfg.checkpoint, keep=1, async_save=False)
    ckpt = Checkpointer(tmp_path, keep1)
    capacity[0] = 10 * size
    ckpt.save(1, saved, meta)
    capacity[0], others[0] = written + size + size // 5, size // 2  # someone else's files arrive
    with caplog.at_level(logging.WARNING, logger="jaxzero"):
        ckpt.save(2, saved, meta)  # the kept one and this one fit; then the next does not
    assert ckpt.steps() == [2]
    assert "checkpoint 2 is written, but the next one will not fit" in caplog.text
    with pytest.raises(CheckpointWriteError, match="not enough free space for checkpoint 3"):
        ckpt.save(3, saved, meta)  # the newest is never deleted early: refused, checkpoint 2 kept
    assert ckpt.steps() == [2]
    ckpt.close()


def test_resume_on_a_different_device_count(tmp_path):
    """Resident state saved from a 4-device mesh restores onto 1 device, exactly."""
    cfg = tiny()
    four = build_trainer(cfg, placement.make_mesh(jax.devices()))
    state, _ = run_steps(four, four.init(jax.random.key(0)), 1, 2, cfg)
    ckpt = Checkpointer(tmp_path, cfg.checkpoint)
    saved = four.saved_state(state)
    ckpt.save(2, saved, make_meta(2, {"epoch": 0, "cursor": 0, "num_windows": 1}, cfg, four.layout, saved))
    ckpt.wait()
    one = build_trainer(cfg, placement.make_mesh(jax.devices()[:1]))
    restored = one.from_saved_state(ckpt.restore(2, one.abstract_saved_state(), one.layout, cfg).state)
    ckpt.close()
    assert all(len(x.devices()) == 1 for x in jax.tree.leaves(restored.params))
    for a, b in zip(jax.tree.leaves(jax.device_get(state)), jax.tree.leaves(jax.device_get(restored))):
        np.testing.assert_array_equal(a, b)


def test_keep_last_n_and_every_k(tmp_path):
    cfg = tiny(**{"checkpoint.keep": "2", "checkpoint.keep_every": "4", "checkpoint.async_save": "false"})
    trainer = build_trainer(cfg, placement.make_mesh(jax.devices()[:1]))
    saved = trainer.saved_state(trainer.init(jax.random.key(0)))
    ckpt = Checkpointer(tmp_path, cfg.checkpoint)
    for step in range(1, 10):
        ckpt.save(
            step, saved, make_meta(step, {"epoch": 0, "cursor": 0, "num_windows": 1}, cfg, "resident", saved)
        )
    ckpt.wait()
    assert ckpt.steps() == [4, 8, 9]  # the newest two, and every 4th
    ckpt.close()


META = {"epoch": 0, "cursor": 0, "num_windows": 1}


def two_checkpoints(tmp_path, **over):
    """A trainer, and checkpoints 1 and 2 of its state (distinct masters) under `tmp_path`."""
    cfg = tiny(**over)
    trainer = build_trainer(cfg, placement.make_mesh(jax.devices()[:1]))
    state = trainer.init(jax.random.key(0))
    ckpt = Checkpointer(tmp_path, cfg.checkpoint)
    for step in (1, 2):
        saved = trainer.saved_state(state)
        ckpt.save(step, saved, make_meta(step, META, cfg, trainer.layout, saved))
        state, _ = run_steps(trainer, state, step, step, cfg)
    ckpt.wait()
    return cfg, trainer, ckpt


def flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    path.write_bytes(data)


@pytest.mark.parametrize("async_save", ["true", "false"])
def test_changed_bytes_are_caught_and_the_previous_checkpoint_used(tmp_path, async_save):
    cfg, trainer, ckpt = two_checkpoints(tmp_path, **{"checkpoint.async_save": async_save})
    assert (ckpt.directory / "2" / "checksums.json").is_file()  # written with the commit
    biggest = max(
        (ckpt.directory / "2" / "state").rglob("*"), key=lambda p: p.stat().st_size if p.is_file() else 0
    )
    flip_a_byte(biggest)
    restored = ckpt.restore_latest(trainer.abstract_saved_state(), trainer.layout, cfg)
    assert restored.step == 1
    assert ckpt.steps() == [1] and (tmp_path / "checkpoints-unreadable" / "2").is_dir()  # set aside
    ckpt.close()


def test_saves_in_quick_succession_each_get_their_checksums(tmp_path):
    """Asynchronous saves issued back to back, before the previous ones are committed: every
    checkpoint still carries its own checksums.json, and each restores."""
    cfg = tiny(**{"checkpoint.keep": "10"})
    trainer = build_trainer(cfg, placement.make_mesh(jax.devices()[:1]))
    saved = trainer.saved_state(trainer.init(jax.random.key(0)))
    ckpt = Checkpointer(tmp_path, cfg.checkpoint)
    for step in range(1, 9):
        ckpt.save(step, saved, make_meta(step, META, cfg, trainer.layout, saved))
    ckpt.wait()
    assert ckpt.steps() == list(range(1, 9))
    missing = [s for s in ckpt.steps() if not (ckpt.directory / str(s) / "checksums.json").is_file()]
    assert missing == []
    for step in ckpt.steps():
        assert ckpt.restore(step, trainer.abstract_saved_state(), trainer.layout, cfg).step == step
    ckpt.close()


def test_every_part_of_a_checkpoint_falls_back_the_same_way(tmp_path, caplog):
    cfg, trainer, ckpt = two_checkpoints(tmp_path)
    (ckpt.directory / "2" / "meta" / "metadata").unlink()  # the metadata gone
    restored = ckpt.restore_latest(trainer.abstract_saved_state(), trainer.layout, cfg)
    assert restored.step == 1 and "unreadable metadata" in caplog.text

    # A data-loader state the data cannot take: the checkpoint is set aside too.
    def bad_loader(meta):
        raise ValueError("data_state.cursor=-1 must be >= 0")

    with pytest.raises(CheckpointError, match=r"no checkpoint .* could be restored \(steps \[1\]"):
        ckpt.restore_latest(trainer.abstract_saved_state(), trainer.layout, cfg, check_meta=bad_loader)
    assert sorted(p.name for p in (tmp_path / "checkpoints-unreadable").iterdir()) == ["1", "2"]
    ckpt.close()


def test_an_array_larger_than_what_a_save_keeps_in_flight_is_saved_and_restored(tmp_path):
    """Orbax writes an array whole and refused one over the save's in-flight limit (gpt-oss-20b's
    2.3 GB float32 embedding against 1 GiB: "Requested more bytes than we reserved space for"). With
    the smallest buffer (8 MiB in flight) a 10 MB embedding, on the accelerator and on the host, is
    saved and restored bit for bit."""
    for name, over in (("resident", {}), ("host", {"offload.optimizer": "cpu", "offload.params": "cpu"})):
        cfg = tiny(**{"checkpoint.buffer_gib": "0.015625", "model.vocab_size": "20000", **over})
        trainer = build_trainer(cfg, placement.make_mesh(jax.devices()[:1]))
        state = trainer.init(jax.random.key(0))
        saved = trainer.saved_state(state)
        assert largest_array_bytes(saved) > in_flight_bytes(cfg.checkpoint), name
        ckpt = Checkpointer(tmp_path / name, cfg.checkpoint)
        ckpt.save(1, saved, make_meta(1, META, cfg, trainer.layout, saved))
        ckpt.close()
        abstract = trainer.abstract_saved_state()
        ckpt = Checkpointer(tmp_path / name, cfg.checkpoint, largest_array=largest_array_bytes(abstract))
        restored = trainer.from_saved_state(ckpt.restore(1, abstract, trainer.layout, cfg).state)
        ckpt.close()
        for tree in ("params", "opt_state"):
            before, after = jax.device_get(getattr(state, tree)), jax.device_get(getattr(restored, tree))
            for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after), strict=True):
                np.testing.assert_array_equal(a, b)


def test_a_save_that_fails_is_one_error_and_leaves_nothing_half_written(tmp_path, monkeypatch):
    cfg, trainer, ckpt = two_checkpoints(tmp_path)
    saved = trainer.saved_state(trainer.init(jax.random.key(0)))

    def disk_full(step, *args, **kwargs):  # as Orbax fails: a half-written step, a long error
        (ckpt.directory / f"{step}.orbax-checkpoint-tmp").mkdir()
        raise ValueError(
            'RESOURCE_EXHAUSTED: Error writing "params" in OCDBT database: Failed to write 4681728 bytes '
            "to file 4: No space left on device [os_error_code='28']"
        )

    monkeypatch.setattr(ckpt.manager, "save", disk_full)
    with pytest.raises(
        CheckpointWriteError, match=r"could not write checkpoint 3 to .*No space left on device"
    ):
        ckpt.save(3, saved, make_meta(3, META, cfg, trainer.layout, saved))
    assert sorted(p.name for p in ckpt.directory.iterdir()) == ["1", "2"]  # the half-written one removed
    monkeypatch.undo()
    assert ckpt.restore_latest(trainer.abstract_saved_state(), trainer.layout, cfg).step == 2
    ckpt.close()


def test_a_background_save_that_failed_is_reported_at_the_next_check(tmp_path, monkeypatch):
    """A background save that fails part-way opens the fence (training never waits for it again),
    leaves nothing half-written, and is raised by the next `check` with its cause."""
    cfg, trainer, ckpt = two_checkpoints(tmp_path)
    ckpt.check()  # nothing failed
    save = ocp.PyTreeCheckpointHandler.save

    def failing(self, directory, args):
        if Path(directory).name == "block_0001":
            raise OSError(13, "Permission denied")
        return save(self, directory, args=args)

    monkeypatch.setattr(ocp.PyTreeCheckpointHandler, "save", failing)
    state = trainer.init(jax.random.key(0))
    saved = trainer.saved_state(state)
    ckpt.save(3, saved, make_meta(3, META, cfg, trainer.layout, saved), trainer.fence)
    trainer.fence.wait_all()  # opened by the failure, not held
    deadline = time.time() + 60
    while ckpt._writing is not None and not ckpt._writing.done() and time.time() < deadline:
        time.sleep(0.05)
    with pytest.raises(CheckpointWriteError, match=r"checkpoint 3 .*Permission denied \(errno 13\)"):
        ckpt.check()
    monkeypatch.undo()
    assert ckpt.steps() == [1, 2] and not list(ckpt.directory.glob("*tmp*"))
    ckpt.close()


def test_a_checkpoint_that_cannot_fit_is_refused_before_writing(tmp_path, monkeypatch):
    cfg, trainer, ckpt = two_checkpoints(tmp_path)
    saved = trainer.saved_state(trainer.init(jax.random.key(0)))
    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10**9, 10**9, 1000))
    with pytest.raises(
        CheckpointWriteError, match=r"not enough free space for checkpoint 3 .* 0\.0 MiB is free"
    ):
        ckpt.save(3, saved, make_meta(3, META, cfg, trainer.layout, saved))
    monkeypatch.undo()
    assert ckpt.steps() == [1, 2]
    ckpt.close()
