"""The run directory: what a directory is before anything is written, the resume guard, atomic files."""

import json
import os
from pathlib import Path

import pytest

from jaxzero.config import ConfigError, TrainConfig
from jaxzero.overrides import apply_overrides, layer, split_args
from jaxzero.storage import run_dir as rd
from jaxzero.storage.run_dir import RunKind


def jaxzero_run(path: Path, checkpoint: bool = True, summary: bool = False, **over) -> TrainConfig:
    """A directory laid out as a jaxzero run (config.json, metrics.jsonl, maybe a checkpoint step)."""
    cfg = apply_overrides(TrainConfig(), {"steps": "10", **over})
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(cfg.to_json())
    (path / "metrics.jsonl").write_text('{"step": 1, "loss": 5.0}\n')
    if checkpoint:
        (path / "checkpoints" / "5" / "state").mkdir(parents=True)
    if summary:
        (path / "summary.json").write_text("{}")
    return cfg


def test_a_relative_run_dir_is_the_working_directorys(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert rd.locate("runs/x", "m") == tmp_path / "runs" / "x"
    default = rd.locate("", "llama-tiny")
    assert default.parent == tmp_path / "runs" and default.name.startswith("llama-tiny-")


def test_what_a_directory_is(tmp_path):
    assert rd.inspect_run_dir(tmp_path / "absent").kind is RunKind.NEW
    (tmp_path / "empty").mkdir()
    assert rd.inspect_run_dir(tmp_path / "empty").kind is RunKind.NEW
    saved = jaxzero_run(tmp_path / "resume")
    run = rd.inspect_run_dir(tmp_path / "resume")
    assert run.kind is RunKind.RESUME and run.saved == saved
    jaxzero_run(tmp_path / "stopped", checkpoint=False)
    assert rd.inspect_run_dir(tmp_path / "stopped").kind is RunKind.RESTART
    (tmp_path / "failed-early").mkdir()  # an attempt that stopped before writing its config.json
    rd.write_error(tmp_path / "failed-early", "Traceback ...")
    assert rd.inspect_run_dir(tmp_path / "failed-early").kind is RunKind.RESTART


def test_the_lock_file_a_killed_trainer_leaves_is_ours(tmp_path):
    """A trainer killed at once leaves its trainer.lock alone; one killed later leaves it in its run."""
    (tmp_path / "bare").mkdir()
    (tmp_path / "bare" / rd.LOCK_FILE).write_text('{"host": "h", "pid": 1, "started": "x"}')
    (tmp_path / "bare" / ".nfs000000000001").write_text("")  # NFS's name for it, removed while open
    assert rd.inspect_run_dir(tmp_path / "bare").kind is RunKind.NEW
    jaxzero_run(tmp_path / "stopped", checkpoint=False)
    (tmp_path / "stopped" / rd.LOCK_FILE).write_text("")
    assert rd.inspect_run_dir(tmp_path / "stopped").kind is RunKind.RESTART
    jaxzero_run(tmp_path / "resume")
    (tmp_path / "resume" / rd.LOCK_FILE).write_text("")
    assert rd.inspect_run_dir(tmp_path / "resume").kind is RunKind.RESUME


def test_hold_refuses_a_foreign_directory_before_writing_its_lock(tmp_path):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match="is not a jaxzero run"):
        rd.hold(tmp_path / "mine")
    assert sorted(p.name for p in (tmp_path / "mine").iterdir()) == ["notes.txt"]
    with rd.hold(tmp_path / "new"):
        assert rd.inspect_run_dir(tmp_path / "new").kind is RunKind.NEW  # its own lock file: still new


def test_a_run_dir_is_shown_as_typed_when_under_the_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert rd.shown(rd.locate("runs/x", "m")) == "runs/x"
    assert rd.shown(tmp_path.parent / "y") == str(tmp_path.parent / "y")


@pytest.mark.parametrize(
    "layout, message",
    [
        ("file", "is a file"),
        ("foreign", "is not a jaxzero run"),
        ("foreign-config", "is not a jaxzero run"),
        ("extra-file", "not made by jaxzero: notes.txt"),
        ("a-config-of-its-own", "not made by jaxzero: config.json"),  # a user's own config.json
        ("loose-metrics", "not made by jaxzero: metrics.jsonl"),
        ("junk-in-checkpoints", r"it holds checkpoints; no jaxzero config.json"),
        ("a-log-of-its-own", "not made by jaxzero: error.log"),  # a user's own error.log
        ("config-garbled", r"holds jaxzero checkpoints \(\[4\]\) but its config.json is not a readable"),
        ("config-removed", r"holds jaxzero checkpoints \(\[4\]\) but its config.json is missing"),
        ("finished", "already holds a run, finished without checkpoints .checkpoint.enabled=false."),
        ("finished-checkpoints-removed", "already holds a run, finished, whose checkpoints are gone"),
    ],
)
def test_directories_jaxzero_never_writes_into(tmp_path, layout, message):
    path = tmp_path / "d"
    if layout == "file":
        path.write_text("x")
    elif layout == "foreign":
        (path / "checkpoints" / "100").mkdir(parents=True)
        (path / "data.csv").write_text("a,b\n")
    elif layout == "foreign-config":  # a Hugging Face config.json and a checkpoints/100: not ours
        (path / "checkpoints" / "100").mkdir(parents=True)
        (path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    elif layout == "extra-file":
        jaxzero_run(path)
        (path / "notes.txt").write_text("mine")
    elif layout == "a-config-of-its-own":
        path.mkdir()
        (path / "config.json").write_text('{"a": 1}')
    elif layout == "loose-metrics":
        path.mkdir()
        (path / "metrics.jsonl").write_text('{"step": 1}\n')
    elif layout == "junk-in-checkpoints":
        (path / "checkpoints" / "junk").mkdir(parents=True)
    elif layout in ("config-garbled", "config-removed"):  # a checkpointed run whose config.json broke
        jaxzero_run(path)
        (path / "checkpoints" / "4" / "meta").mkdir(parents=True)
        (path / "checkpoints" / "4" / "meta" / "metadata").write_text("{}")
        if layout == "config-garbled":
            (path / "config.json").write_text("{garbled")
        else:
            (path / "config.json").unlink()
    elif layout == "a-log-of-its-own":
        path.mkdir()
        (path / "error.log").write_text("precious\n")
    elif layout == "finished-checkpoints-removed":  # saved with checkpoints on; the user removed them
        jaxzero_run(path, checkpoint=False, summary=True)
        (path / "checkpoints").mkdir()
    else:
        jaxzero_run(path, checkpoint=False, summary=True, **{"checkpoint.enabled": "false"})
    before = sorted(str(p) for p in tmp_path.rglob("*"))
    with pytest.raises(ConfigError, match=message):
        rd.inspect_run_dir(path)
    assert sorted(str(p) for p in tmp_path.rglob("*")) == before  # nothing written


def test_a_run_dir_that_cannot_be_created_is_refused_before_anything(tmp_path):
    (tmp_path / "a-file").write_text("mine")
    with pytest.raises(ConfigError, match=r"cannot be created: .*a-file' is a file"):
        rd.inspect_run_dir(tmp_path / "a-file" / "run")
    if os.geteuid() != 0:  # root may write anywhere
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        with pytest.raises(ConfigError, match="cannot be created in .*locked'.*Permission denied"):
            rd.inspect_run_dir(locked / "run")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"] + (["locked"] if os.geteuid() else [])


def test_input_paths_are_saved_absolute_and_compared_resolved(tmp_path, monkeypatch):
    """A run started with a relative data.path finds its data from any working directory; the guard
    compares where paths point, not how they were spelled."""
    monkeypatch.chdir(tmp_path)
    cfg = rd.resolve_paths(apply_overrides(TrainConfig(), {"data.source": "tokens", "data.path": "data"}))
    assert cfg.data.path == str(tmp_path / "data")
    saved = jaxzero_run(tmp_path / "r", **{"data.source": "tokens", "data.path": str(tmp_path / "data")})
    same = apply_overrides(saved, {"data.path": "./data/"})
    assert rd.check_resume(same, saved, tmp_path / "r").data.path == str(tmp_path / "data")
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")  # the same spelling now names another directory
    with pytest.raises(ConfigError, match=r"cannot change data.path"):
        rd.check_resume(same, saved, tmp_path / "r")
    assert rd.check_resume(saved, saved, tmp_path / "r") is not None  # the saved absolute path holds


def test_the_resume_guard_names_every_changed_setting(tmp_path):
    saved = jaxzero_run(tmp_path / "r")
    other = apply_overrides(saved, {"optimizer.lr": "1e-5", "data.batch_size": "4", "steps": "20"})
    with pytest.raises(ConfigError, match=r"cannot change data.batch_size \(16 -> 4\), optimizer.lr"):
        rd.check_resume(other, saved, tmp_path / "r")
    allowed = apply_overrides(
        saved,
        {
            "steps": "20",
            "logging.log_every": "1",
            "offload.optimizer": "cpu",
            "run_dir": "/elsewhere",
            "parallel.zero_stage": "3",  # checkpoints restore at any stage and device count
            "parallel.timeout_s": "900",
        },
    )
    assert rd.check_resume(allowed, saved, tmp_path / "r").offload.optimizer == "cpu"


def test_the_resume_guard_names_the_preset_that_set_a_key(tmp_path):
    """A preset given again on resume applies on top of the saved config: the key it changed is named
    with the file, so that the user edits the preset, not the command line."""
    saved = jaxzero_run(tmp_path / "r", **{"optimizer.lr": "1e-4"})
    (tmp_path / "x.toml").write_text("[optimizer]\nlr = 3e-4\n")
    layered = layer(saved, split_args([f"--config={tmp_path / 'x.toml'}", "--data.batch_size=4"]))
    with pytest.raises(ConfigError) as refused:
        rd.check_resume(layered.config, saved, tmp_path / "r", layered.sources)
    message = str(refused.value)
    assert "cannot change data.batch_size (16 -> 4), optimizer.lr (0.0001 -> 0.0003 from " in message
    assert f"0.0003 from {tmp_path / 'x.toml'}). Only steps" in message  # the command line's: no file
    assert f"drop optimizer.lr from {tmp_path / 'x.toml'} (or resume without it)" in message


def test_a_resume_that_extends_steps_keeps_the_schedule(tmp_path):
    saved = jaxzero_run(tmp_path / "r")  # steps=10, decay_steps=0: the schedule spans 10 steps
    longer = rd.check_resume(apply_overrides(saved, {"steps": "30"}), saved, tmp_path / "r")
    assert longer.steps == 30 and longer.optimizer.decay_steps == 10 and longer.schedule_steps == 10
    stretched = apply_overrides(saved, {"steps": "30", "optimizer.decay_steps": "30"})
    assert rd.check_resume(stretched, saved, tmp_path / "r").schedule_steps == 30
    same = rd.check_resume(saved, saved, tmp_path / "r")
    assert same.optimizer.decay_steps == 0


def test_a_stopped_attempt_is_set_aside_not_deleted(tmp_path):
    path = tmp_path / "r"
    jaxzero_run(path, checkpoint=False)
    (path / "checkpoints").mkdir()
    kept = rd.set_aside_attempt(path)
    assert kept.parent == path / "previous-attempts"
    assert (kept / "metrics.jsonl").read_text() == '{"step": 1, "loss": 5.0}\n' and (
        kept / "config.json"
    ).exists()
    assert sorted(p.name for p in path.iterdir()) == ["previous-attempts"]
    assert rd.inspect_run_dir(path).kind is RunKind.NEW


def test_atomic_writes_leave_the_old_file_or_the_new(tmp_path, monkeypatch):
    f = tmp_path / "config.json"
    rd.write_atomic(f, "old")
    monkeypatch.setattr(os, "replace", lambda a, b: (_ for _ in ()).throw(OSError(28, "No space left")))
    with pytest.raises(OSError):
        rd.write_atomic(f, "new")
    assert f.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["config.json"]


def test_metrics_past_the_restored_step_are_dropped(tmp_path):
    f = tmp_path / "metrics.jsonl"
    f.write_text("".join(json.dumps({"step": s}) + "\n" for s in (1, 5, 10, 15)))
    rd.truncate_metrics(f, 10)
    assert [json.loads(ln)["step"] for ln in f.read_text().splitlines()] == [1, 5, 10]


def test_a_record_cut_off_by_a_kill_is_dropped_and_a_foreign_line_is_refused(tmp_path):
    f = tmp_path / "metrics.jsonl"
    f.write_text("".join(json.dumps({"step": s}) + "\n" for s in (1, 5)) + '{"step": 10, "lo')
    rd.truncate_metrics(f, 10)
    assert f.read_text() == '{"step": 1}\n{"step": 5}\n'
    f.write_text('{"step": 1}\nnot json\n{"step": 5}\n')
    with pytest.raises(ConfigError, match=r"line 2, is not a metrics record"):
        rd.truncate_metrics(f, 10)
    assert f.read_text() == '{"step": 1}\nnot json\n{"step": 5}\n'  # left as it was
