"""An export writes only into a new or empty directory or over an earlier export of jaxzero's (its
`.jaxzero-export` marker), never over anything else, `--overwrite` or not (`jaxzero.storage.export_dir`).
`python -m jaxzero.export` in-process (`main(argv)`) on a one-step run, and the writers themselves."""

from __future__ import annotations

import dataclasses
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from jaxzero.cli import export as export_lib
from jaxzero.cli import train as train_lib
from jaxzero.config import ModelConfig, TrainConfig
from jaxzero.interop import export_hf, import_hf
from jaxzero.interop.safetensors import SafetensorsWriter
from jaxzero.models import build_model
from jaxzero.overrides import apply_overrides
from jaxzero.storage import export_dir
from jaxzero.storage.checkpoint_masters import export_orbax

MODEL = dataclasses.replace(ModelConfig.named("llama-tiny"), num_layers=1)


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """A one-step, one-block llama-tiny run with its checkpoint."""
    over = {
        "steps": "1",
        "data.seq_len": "16",
        "data.batch_size": "4",
        "model.num_layers": "1",
        "logging.progress": "false",
        "logging.samples": "0",
        "run_dir": str(tmp_path_factory.mktemp("export-dir") / "run"),
    }
    return train_lib.train(apply_overrides(TrainConfig(), over), io.StringIO())


def export(run: Path, out: Path, capsys, *extra: str) -> tuple[int, str]:
    code = export_lib.main([f"--run_dir={run}", f"--out={out}", *extra])
    return code, capsys.readouterr().err


def snapshot(directory: Path) -> dict[str, bytes]:
    """Every file under `directory`, by relative path, with its bytes."""
    files = sorted(p for p in directory.rglob("*") if p.is_file())
    return {str(p.relative_to(directory)): p.read_bytes() for p in files}


def marker(out: Path) -> dict:
    return json.loads((out / export_dir.MARKER).read_text())


def foreign(directory: Path) -> dict[str, bytes]:
    """A directory jaxzero did not write: someone's Hugging Face download."""
    directory.mkdir()
    (directory / "config.json").write_text('{"model_type": "llama", "note": "not jaxzero\'s"}\n')
    (directory / "model.safetensors").write_bytes(b"their weights")
    (directory / "sub").mkdir()
    (directory / "sub" / "notes.txt").write_text("keep me\n")
    return snapshot(directory)


# ---------------------------------------------------------------------------------------------------
# The CLI
# ---------------------------------------------------------------------------------------------------


def test_a_new_and_an_empty_directory_are_written_with_a_marker(run, tmp_path, capsys):
    code, err = export(run, tmp_path / "a" / "new", capsys)
    assert code == 0, err
    record = marker(tmp_path / "a" / "new")
    assert record["format"] == "hf" and record["dtype"] == "bfloat16"
    assert record["run_dir"] == str(run) and record["step"] == 1 and record["finished"]
    assert record["files"] == ["config.json", "model.safetensors"]
    assert sorted(p.name for p in (tmp_path / "a" / "new").iterdir()) == [
        export_dir.MARKER,
        "config.json",
        "model.safetensors",
    ]
    (tmp_path / "empty").mkdir()
    code, err = export(run, tmp_path / "empty", capsys, "--format=orbax")
    assert code == 0, err
    assert marker(tmp_path / "empty")["format"] == "orbax"
    assert not (tmp_path / "empty" / ".orbax-export").exists()
    cfg_params = jax.eval_shape(build_model(MODEL).init, jax.random.key(0))
    target = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, jax.numpy.bfloat16), cfg_params)
    restored = ocp.StandardCheckpointer().restore((tmp_path / "empty").absolute(), target)
    assert len(jax.tree.leaves(restored)) == len(jax.tree.leaves(cfg_params))


@pytest.mark.parametrize("overwrite", [[], ["--overwrite"]])
@pytest.mark.parametrize("fmt", ["hf", "orbax"])
def test_a_foreign_directory_is_refused_and_left_byte_for_byte(run, tmp_path, capsys, overwrite, fmt):
    theirs = foreign(tmp_path / "theirs")
    code, err = export(run, tmp_path / "theirs", capsys, f"--format={fmt}", *overwrite)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert f"{tmp_path / 'theirs'} is not empty and is not a jaxzero export" in lines[0]
    assert "config.json, model.safetensors, sub" in lines[0]  # what is in the way
    assert "Choose a new directory (--out), or remove what is there yourself" in lines[0]
    assert snapshot(tmp_path / "theirs") == theirs
    names = sorted(p.name for p in (tmp_path / "theirs").iterdir())
    assert names == ["config.json", "model.safetensors", "sub"]  # nothing added, not even a marker


def test_a_file_is_refused(run, tmp_path, capsys):
    (tmp_path / "f").write_text("x")
    code, err = export(run, tmp_path / "f", capsys, "--overwrite")
    assert code == 2 and "is a file, not a directory" in err and (tmp_path / "f").read_text() == "x"


def test_an_earlier_export_is_refused_without_overwrite_and_replaced_with_it(run, tmp_path, capsys):
    out = tmp_path / "out"
    assert export(run, out, capsys)[0] == 0
    (out / "tokenizer.json").write_text("{}")  # put beside the export by hand: never jaxzero's to delete
    before = snapshot(out)
    code, err = export(run, out, capsys, "--dtype=float32")
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert f"{out} holds an earlier jaxzero export (hf bfloat16 of step 1 of {run}, written " in err
    assert "pass overwrite=True (--overwrite) to replace it, or choose a new directory (--out)" in err
    assert snapshot(out) == before
    code, err = export(run, out, capsys, "--dtype=float32", "--overwrite")
    assert code == 0, err
    assert marker(out)["dtype"] == "float32"
    assert (out / "tokenizer.json").read_text() == "{}"
    assert len((out / "model.safetensors").read_bytes()) > len(before["model.safetensors"])  # float32 now
    # Another format replaces the earlier one's files, and only those.
    code, err = export(run, out, capsys, "--format=orbax", "--overwrite")
    assert code == 0, err
    names = sorted(p.name for p in out.iterdir())
    assert "config.json" not in names and "model.safetensors" not in names
    assert {"tokenizer.json", export_dir.MARKER, "_CHECKPOINT_METADATA"} <= set(names)
    assert sorted(marker(out)["files"]) == sorted(set(names) - {"tokenizer.json", export_dir.MARKER})


def test_a_killed_export_is_replaced_by_rerunning_the_command(run, tmp_path, capsys):
    out = tmp_path / "out"
    assert export(run, out, capsys, "--format=orbax")[0] == 0
    record = marker(out)
    (out / export_dir.MARKER).write_text(json.dumps({**record, "finished": None}))  # as if killed
    (out / "_METADATA").unlink()
    code, err = export(run, out, capsys, "--format=orbax")  # no --overwrite: it never finished
    assert code == 0 and "holds an unfinished export (killed midway): replacing it" in err
    assert marker(out)["finished"] and (out / "_METADATA").is_file()


# ---------------------------------------------------------------------------------------------------
# The writers: shards, failures, killed exports
# ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def params():
    shapes = jax.eval_shape(build_model(MODEL).init, jax.random.key(0))
    rng = np.random.default_rng(0)
    return jax.tree.map(lambda s: rng.normal(size=s.shape).astype(np.float32), shapes)


def test_fewer_shards_leave_no_stale_shard(params, tmp_path):
    out = tmp_path / "ckpt"
    paths = export_hf(params, MODEL, out, dtype="float32", max_shard_bytes=2**19)
    assert len(paths) > 3 and marker(out)["files"] == sorted(p.name for p in paths)
    export_hf(params, MODEL, out, overwrite=True)
    assert sorted(p.name for p in out.iterdir()) == [export_dir.MARKER, "config.json", "model.safetensors"]


def test_a_failed_export_removes_what_it_wrote(params, tmp_path, monkeypatch):
    write = SafetensorsWriter.write
    calls = []

    def failing(self, name, array):  # the disk fills up after the first tensors
        calls.append(name)
        if len(calls) > 3:
            raise OSError(28, "No space left on device")
        write(self, name, array)

    monkeypatch.setattr(SafetensorsWriter, "write", failing)
    with pytest.raises(OSError, match="No space left"):
        export_hf(params, MODEL, tmp_path / "made" / "new", max_shard_bytes=2**19)
    assert not (tmp_path / "made").exists()  # the directories it made go too
    (tmp_path / "empty").mkdir()
    calls.clear()
    with pytest.raises(OSError):
        export_hf(params, MODEL, tmp_path / "empty", max_shard_bytes=2**19)
    assert list((tmp_path / "empty").iterdir()) == []
    monkeypatch.undo()
    export_hf(params, MODEL, tmp_path / "earlier")
    (tmp_path / "earlier" / "tokenizer.json").write_text("{}")
    monkeypatch.setattr(SafetensorsWriter, "write", failing)
    calls.clear()
    with pytest.raises(OSError):
        export_hf(params, MODEL, tmp_path / "earlier", overwrite=True)
    # The earlier export is gone (--overwrite), the unfinished marker stays beside the user's file...
    assert sorted(p.name for p in (tmp_path / "earlier").iterdir()) == [export_dir.MARKER, "tokenizer.json"]
    assert marker(tmp_path / "earlier")["finished"] is None
    monkeypatch.undo()
    export_hf(params, MODEL, tmp_path / "earlier")  # ...so that a rerun replaces it, even without overwrite
    assert marker(tmp_path / "earlier")["finished"]


def test_a_killed_export_is_replaced_by_the_rerun(params, tmp_path):
    out = tmp_path / "killed"
    out.mkdir()
    # What a SIGKILL during the second shard leaves: the marker unfinished, a shard, a partial one.
    record = {"format": "hf", "dtype": "bfloat16", "started": "then", "finished": None}
    files = ["config.json", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    (out / export_dir.MARKER).write_text(json.dumps({**record, "files": files}))
    (out / files[1]).write_bytes(b"shard 1")
    (out / (files[2] + ".partial")).write_bytes(b"half of shard 2")
    paths = export_hf(params, MODEL, out, dtype="float32")
    assert sorted(p.name for p in out.iterdir()) == [export_dir.MARKER, "config.json", "model.safetensors"]
    _, back = import_hf(out)
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(params)):
        np.testing.assert_array_equal(a, b)
    assert [p.name for p in paths] == ["config.json", "model.safetensors"]


def test_a_marker_cannot_name_files_outside_its_directory(params, tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("mine")
    out = tmp_path / "out"
    out.mkdir()
    record = {"format": "hf", "finished": "then", "files": ["../victim.txt", str(victim), "config.json"]}
    (out / export_dir.MARKER).write_text(json.dumps(record))
    export_hf(params, MODEL, out, overwrite=True)
    assert victim.read_text() == "mine"


def test_an_unreadable_marker_is_refused(params, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / export_dir.MARKER).write_text("{not json")
    (out / "config.json").write_text("{}")
    with pytest.raises(export_dir.ExportRefused, match=r"\.jaxzero-export cannot be read"):
        export_orbax(params, MODEL, out, "float32", overwrite=True)
    assert (out / "config.json").read_text() == "{}"


HOLDER = """
import sys, time
from pathlib import Path
from jaxzero.storage.run_lock import lock_export_dir
lock = lock_export_dir(Path(sys.argv[1]))
print("held", flush=True)
time.sleep(120)
"""


def test_one_export_writes_into_a_directory_at_a_time(params, run, tmp_path, capsys):
    """Two exports to one --out at once: the second is refused naming the first (one reported success
    while the directory held only the marker); the first's lock goes with it, and nothing is left."""
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(out)], stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        refused = rf"in use by the export started .* pid {holder.pid};"
        with pytest.raises(export_dir.ExportRefused, match=refused):
            export_hf(params, MODEL, out)
        assert [p.name for p in out.iterdir()] == [".jaxzero-export.lock"]  # the holder's, untouched
        code, err = export(run, out, capsys)
        assert code == 2 and f"pid {holder.pid}" in err and len(err.strip().splitlines()) == 1, err
    finally:
        holder.kill()
        holder.wait()
    export_hf(params, MODEL, out)  # the holder gone (killed: the kernel dropped its lock), written
    assert sorted(p.name for p in out.iterdir()) == [export_dir.MARKER, "config.json", "model.safetensors"]
    # In one process too: an export inside another's writing of the same directory is refused.
    with export_dir.writing(tmp_path / "same", format="hf", dtype="float32", files=[], overwrite=False) as w:
        with pytest.raises(export_dir.ExportRefused, match="in use by the export"):
            export_hf(params, MODEL, tmp_path / "same")
        w.finish([])
    assert [p.name for p in (tmp_path / "same").iterdir()] == [export_dir.MARKER]
