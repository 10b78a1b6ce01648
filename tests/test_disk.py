"""The disk tier (`offload.optimizer=disk`): units whose masters and optimizer state live in files,
read into host RAM for each update and written back.

The host update of a unit read from disk is the same fused kernel on the same numbers as the update
of a unit kept in host RAM, so runs with and without disk units agree bit for bit (losses, norms,
validation loss, and every saved master and moment); a run restored from a checkpoint matches the
uninterrupted one bit for bit too.
"""

import json
import os
import threading
import time
import tracemalloc
from pathlib import Path

import jax
import numpy as np
import pytest
from subprocess_run import run_module
from test_offload import run, tiny

from jaxzero.config import ConfigError
from jaxzero.data import build_data
from jaxzero.models import build_model
from jaxzero.offload.disk import DiskStore
from jaxzero.plan import Tier, placement, resolve_plan
from jaxzero.primitives.deferred import resolved
from jaxzero.storage.state_io import restore_state, save_state
from jaxzero.trainer import build_trainer

HOST = {"offload.optimizer": "cpu", "offload.params": "cpu"}
CASES = {
    # the last three units (two blocks and the head) on disk, streamed weights
    "zero3-disk3": ({"offload.params": "cpu", "offload.disk_units": "3"}, "float32"),
    # every unit on disk, weights resident (ZeRO-Offload), bf16 moments
    "zero-offload-all-disk": ({"offload.params": "none", "optimizer.state_dtype": "bfloat16"}, "float32"),
    # the embedding's state on the accelerator, the head's on disk, the blocks' in host RAM
    "three-tiers": (
        {"offload.params": "cpu", "offload.device_state_units": "1", "offload.disk_units": "1"},
        "float32",
    ),
    # bf16 compute: bf16 block gradients
    "zero3-disk2-bf16": (
        {"offload.params": "cpu", "offload.disk_units": "2", "data.grad_accum": "1"},
        "bfloat16",
    ),
}


def saved_leaves(trainer, state) -> list[np.ndarray]:
    """Every saved array, the disk units' read (`saved_state` defers them to the checkpoint writer)."""
    return [np.array(x) for x in jax.tree.leaves(resolved(trainer.saved_state(state)))]


@pytest.mark.parametrize("case", list(CASES))
def test_disk_units_train_bitwise_like_host_units(case, tmp_path):
    over, dtype = CASES[case]
    disk = tiny("llama", dtype, **{**over, "offload.optimizer": "disk", "offload.disk_path": str(tmp_path)})
    host_over = {k: v for k, v in over.items() if not k.startswith("offload.disk")}
    host = tiny("llama", dtype, **{**host_over, "offload.optimizer": "cpu"})
    plan = resolve_plan(disk)
    expected = {"zero3-disk3": 3, "zero-offload-all-disk": 5, "three-tiers": 1, "zero3-disk2-bf16": 2}[case]
    assert len(plan.disk_units) == expected
    assert [u.position for u in plan.disk_units] == list(range(5 - expected, 5))  # the last ones
    ref_trainer, ref_state, ref_losses, ref_norms, ref_val = run(host, guard=True)
    trainer, state, losses, norms, val = run(disk, guard=True)
    assert (ref_norms > 0.5).all(), "clipping must be active"
    np.testing.assert_array_equal(losses, ref_losses)
    np.testing.assert_array_equal(norms, ref_norms)
    assert val == ref_val
    for a, b in zip(saved_leaves(trainer, state), saved_leaves(ref_trainer, ref_state)):
        np.testing.assert_array_equal(a, b)
    # Each step read every disk unit's state once and wrote it back once.
    stats = trainer.timings(1.0, 1)
    (workdir,) = tmp_path.iterdir()
    files = sorted(workdir.iterdir())
    assert len(files) == expected
    size = sum(f.stat().st_size for f in files)
    assert stats["disk_gb"] * 1e9 == 2 * size * disk.steps + size  # and the first write, at init
    # The disk units' masters and state are not in host RAM between steps.
    units = state.units.units()
    for u, unit in zip(plan.units, units):
        params = unit.result().params
        assert (type(params).__name__ == "OnDisk") == (u.state is Tier.DISK)
    trainer.close()
    assert list(tmp_path.iterdir()) == []  # its working directory, and only that, is gone


def test_a_restored_disk_run_matches_the_uninterrupted_one(tmp_path):
    disk = {"offload.optimizer": "disk", "offload.params": "cpu", "offload.disk_units": "2"}
    cfg = tiny("llama", "float32", **disk, **{"offload.disk_path": str(tmp_path / "work")})
    mesh = placement.make_mesh(jax.devices()[:1])
    data = build_data(cfg.data, cfg.model.vocab_size, cfg.seed)
    batches = list(zip(range(cfg.steps), data.train_iter()))
    whole = build_trainer(cfg, mesh)
    state = whole.init(jax.random.key(0))
    for _, b in batches:
        state, _ = whole.step(state, whole.put_batch(b))
    expected = saved_leaves(whole, state)
    first = build_trainer(cfg, mesh)
    state = first.init(jax.random.key(0))
    for _, b in batches[:2]:
        state, _ = first.step(state, first.put_batch(b))
    save_state(first, state, tmp_path / "run", 2)
    first.close()
    second = build_trainer(cfg, mesh)
    state, step, _ = restore_state(second, tmp_path / "run")
    assert step == 2
    for _, b in batches[2:]:
        state, _ = second.step(state, second.put_batch(b))
    for a, b in zip(saved_leaves(second, state), expected):
        np.testing.assert_array_equal(a, b)
    whole.close()
    second.close()


def test_the_store_reads_in_order_and_writes_back(tmp_path):
    store = DiskStore(tmp_path, positions=[3, 4], slots=1, threads=2)
    trees = {
        p: (np.arange(10_000, dtype=np.float32) * p, {"m": np.full((7, 3), p, np.float32)}) for p in (3, 4)
    }
    for p, t in trees.items():
        store.create(p, t)
    for step in range(3):
        store.schedule()
        for p in (3, 4):
            params, state = store.take(p)
            np.testing.assert_array_equal(params, trees[p][0] + step)
            params += 1  # updated in place, as the host kernels do
            store.put(p)
    for p in (3, 4):
        np.testing.assert_array_equal(store.read(p)[0], trees[p][0] + 3)
        np.testing.assert_array_equal(store.read(p)[1]["m"], trees[p][1]["m"])
    stats = store.take_stats()
    size = sum(f.stat().st_size for f in store.directory.iterdir())
    assert stats.read_bytes == 3 * size and stats.written_bytes == 4 * size  # and the creation
    mine = store.directory
    (tmp_path / "user-file").write_text("not the store's")
    store.close()
    assert not mine.exists() and (tmp_path / "user-file").exists()
    # A disk_path that did not exist: created, and removed with the store where nothing else is there.
    made = DiskStore(tmp_path / "new" / "deeper", positions=[1], slots=1)
    made.close()
    assert not (tmp_path / "new").exists()
    kept = DiskStore(tmp_path / "new" / "deeper", positions=[1], slots=1)
    (tmp_path / "new" / "mine.txt").write_text("a user's")
    kept.close()
    assert sorted(p.name for p in (tmp_path / "new").iterdir()) == ["mine.txt"]


def test_a_failed_read_fails_the_update_that_needs_it(tmp_path):
    store = DiskStore(tmp_path, positions=[1], slots=2)
    store.create(1, (np.ones(100, np.float32),))
    os.remove(next(store.directory.iterdir()))
    store.schedule()
    with pytest.raises(FileNotFoundError):
        store.take(1)
    store.close()


def test_closing_the_store_fails_the_updates_still_waiting_instead_of_hanging(tmp_path):
    # As the training loop's `finally` does after an error: the store closes while a step's disk
    # updates are in flight (one slot: the others wait for it, or for reads the close cancels).
    store = DiskStore(tmp_path, positions=[0, 1, 2, 3], slots=1, threads=2)
    for p in range(4):
        store.create(p, (np.full(1000, p, np.float32),))
    store.schedule()
    taken, outcome = threading.Event(), {}

    def update(p: int) -> None:  # as `UpdatePipeline._run_from_disk`: take, update, put
        try:
            store.take(p)
            taken.set()
            time.sleep(0.2)
            store.put(p)
            outcome[p] = "written"
        except RuntimeError as e:
            outcome[p] = str(e)

    threads = [threading.Thread(target=update, args=(p,), daemon=True) for p in range(4)]
    for t in threads:
        t.start()
    assert taken.wait(10)
    store.close()
    for t in threads:
        t.join(10)
    assert not any(t.is_alive() for t in threads), f"updates still waiting after the close: {outcome}"
    assert all("is closed" in outcome[p] for p in range(4)), outcome


def test_an_unwritable_disk_path_is_a_clear_error(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(ConfigError, match="offload.disk_path"):  # bad input: the CLI exits 2
        DiskStore(blocker / "sub", positions=[1], slots=1)


@pytest.mark.parametrize(
    "over, message",
    [
        ({"offload.optimizer": "cpu", "offload.disk_units": "2"}, "only apply with offload.optimizer=disk"),
        ({"offload.optimizer": "disk", "offload.disk_units": "0"}, "keeps no unit on disk"),
        ({"offload.optimizer": "disk", "offload.fused_update": "false"}, "needs the fused host kernels"),
        ({"offload.optimizer": "disk", "offload.disk_units": "-2"}, "must be >= -1"),
    ],
)
def test_wrong_disk_settings_are_refused(over, message, tmp_path):
    cfg = tiny("llama", "float32", **{"offload.params": "cpu", "offload.disk_path": str(tmp_path), **over})
    with pytest.raises(ConfigError, match=message):
        build_trainer(cfg, placement.make_mesh(jax.devices()[:1]))


@pytest.mark.slow
def test_cli_disk_run_keeps_its_working_state_in_the_run_directory_and_removes_it(tmp_path):
    run_dir = tmp_path / "run"
    result = run_module(
        "jaxzero.train", "--model.name=llama-tiny", "--model.num_layers=2", "--data.seq_len=32",
        "--data.batch_size=4", "--steps=6", "--checkpoint.every=3", "--logging.log_every=3",
        "--offload.optimizer=disk", "--offload.params=cpu", "--offload.disk_units=2",
        f"--run_dir={run_dir}", cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "on local disk" in result.stdout
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if "disk_gb" in r]
    assert train and all(r["disk_gb"] > 0 for r in train)
    assert not (run_dir / "offload-state").exists()  # the working directory, and the one made for it
    assert sorted(Path(run_dir / "checkpoints").iterdir())
    # What a killed run leaves (its working directory) does not make the run look foreign: it resumes.
    left = run_dir / "offload-state" / "jaxzero-working-state-0123456789ab"
    left.mkdir(parents=True)
    (left / "unit-00003.bin").write_bytes(b"\0" * 64)
    again = run_module("jaxzero.train", f"--run_dir={run_dir}", "--steps=8", cwd=tmp_path)
    assert again.returncode == 0 and "resumed from" in again.stdout, again.stderr[-2000:]


def test_a_checkpoints_masters_load_into_every_tier_one_unit_at_a_time(tmp_path):
    """`init_from_params` (how an HF checkpoint starts a run) puts each unit where the plan keeps it,
    the accelerator's, the host's and the disk's, and trains bit for bit as the trainer without the
    disk tier started from the same masters. It copies one unit at a time, dropping each source once
    placed: the load of a model sized to its host RAM must not hold two copies of every master (an 8B
    load did, and died)."""
    size = {"model.hidden_size": "512", "model.intermediate_size": "2048", "steps": "2"}
    over = {**CASES["three-tiers"][0], **size}
    disk = tiny(
        "llama", "float32", **{**over, "offload.optimizer": "disk", "offload.disk_path": str(tmp_path)}
    )
    host = tiny("llama", "float32", **{**HOST, **size, "offload.device_state_units": "1"})  # no disk
    masters = jax.device_get(build_model(disk.model).init(jax.random.key(3)))
    units = masters.units()
    total = sum(x.nbytes for x in jax.tree.leaves(masters))
    largest = max(sum(x.nbytes for x in jax.tree.leaves(u)) for u in units)
    assert largest < 0.4 * total  # else one unit at a time and all at once look alike
    mesh = placement.make_mesh(jax.devices()[:1])
    results = []
    for cfg in (disk, host):
        trainer = build_trainer(cfg, mesh)
        tracemalloc.start()
        try:
            state = trainer.init_from_params(jax.tree.map(np.array, masters))  # its only reference
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        # The copy passed in and about one unit more (the disk tier's write buffers included: 1.5x
        # here); every master copied at once while the sources lived peaked at 2.4x.
        assert peak < 1.6 * total, (peak / 2**20, total / 2**20, largest / 2**20)
        for a, b in zip(
            jax.tree.leaves(resolved(trainer.saved_state(state)["params"])), jax.tree.leaves(masters)
        ):
            np.testing.assert_array_equal(np.asarray(a), b)
        data = build_data(cfg.data, cfg.model.vocab_size, cfg.seed)
        batches = data.train_iter()
        losses = []
        for _ in range(cfg.steps):
            state, m = trainer.step(state, trainer.put_batch(next(batches)))
            losses.append(float(jax.device_get(m.loss)))
        results.append((losses, saved_leaves(trainer, state)))
        trainer.close()
    (disk_losses, disk_saved), (host_losses, host_saved) = results
    assert disk_losses == host_losses
    for a, b in zip(disk_saved, host_saved):
        np.testing.assert_array_equal(a, b)
    assert list(tmp_path.iterdir()) == []
