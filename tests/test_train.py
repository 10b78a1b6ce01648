"""The training program's pieces in-process: configuring a resume, the summary, the causes it names."""

import errno
import gc
import io
import json
import os
import threading
import warnings
from pathlib import Path

import jax.numpy as jnp
import pytest

from jaxzero.cli import train as train_lib
from jaxzero.config import ConfigError, TrainConfig
from jaxzero.overrides import apply_overrides
from jaxzero.run import loop, stopping
from jaxzero.run.nonfinite import nonfinite_cause
from jaxzero.run.start import Start
from jaxzero.state import StepMetrics
from jaxzero.storage.run_lock import LOCK_FILE

TINY = {
    "steps": "3",
    "data.seq_len": "16",
    "data.batch_size": "4",
    "model.num_layers": "1",
    "logging.log_every": "1",
    "logging.progress": "false",
}


def tiny(tmp_path, **over) -> TrainConfig:
    return apply_overrides(TrainConfig(), {**TINY, "run_dir": str(tmp_path / "r"), **over})


def test_a_run_ends_with_its_summary_and_a_finished_run_has_nothing_to_do(tmp_path):
    console = io.StringIO()
    path = train_lib.train(tiny(tmp_path), console)
    summary = json.loads((path / "summary.json").read_text())
    assert summary["status"] == "complete" and summary["steps"] == 3
    assert summary["checkpoint"] == str(path / "checkpoints" / "3")
    out = console.getvalue()
    assert f"run_dir {path}: a new run" in out and "jaxzero: done: step 3" in out
    assert "python -m jaxzero.export --run_dir=" in out
    again = io.StringIO()
    train_lib.train(train_lib.configure([f"--run_dir={path}"]).config, again)
    assert "nothing to do: the run is at step 3 and steps=3" in again.getvalue()
    # Fewer steps than the run has: said before any trainer is built or checkpoint read.
    fewer = io.StringIO()
    train_lib.train(train_lib.configure([f"--run_dir={path}", "--steps=2"]).config, fewer)
    assert (
        fewer.getvalue()
        .strip()
        .splitlines()[-1]
        .startswith("jaxzero: nothing to do: the run is at step 3 and steps=2")
    )
    assert "warmup" not in fewer.getvalue() and "plan:" not in fewer.getvalue()


def test_the_loop_settles_the_heap_once_after_its_first_step_and_unsettles_it_at_the_end(
    tmp_path, monkeypatch
):
    """What lives for the whole run is exempted from Python's full collections once, after the first
    step (compiled by then): those passes hold the GIL and stall the host update's threads. When the
    run ends it is collectable again: a second run in the process (a notebook) leaks nothing of it."""
    frozen = []
    settle = loop.settle_heap
    monkeypatch.setattr(loop, "settle_heap", lambda: (settle(), frozen.append(gc.get_freeze_count())))
    try:
        train_lib.train(
            tiny(tmp_path, **{"offload.optimizer": "cpu", "offload.params": "cpu"}), io.StringIO()
        )
        assert len(frozen) == 1 and frozen[0] > 1000  # the modules, the compiled steps, the run's objects
        assert gc.get_freeze_count() == 0
    finally:
        gc.unfreeze()


def test_configure_resumes_from_the_saved_config_and_refuses_malformed_arguments(tmp_path):
    path = train_lib.train(tiny(tmp_path, **{"optimizer.lr": "1e-3"}), io.StringIO())
    cfg = train_lib.configure([f"--run_dir={path}", "--steps=5"]).config
    assert cfg.optimizer.lr == 1e-3 and cfg.steps == 5 and cfg.model.num_layers == 1  # the saved run's
    with pytest.raises(ConfigError, match="cannot parse argument '--steps'"):
        train_lib.configure([f"--run_dir={path}", "--steps", "10"])


def test_a_resume_says_what_the_schedule_does(tmp_path):
    path = train_lib.train(tiny(tmp_path, **{"optimizer.warmup_steps": "0"}), io.StringIO())  # 3-step decay
    kept = io.StringIO()
    train_lib.train(train_lib.configure([f"--run_dir={path}", "--steps=4"]).config, kept)
    assert "steps 3 -> 4: the learning-rate schedule keeps the 3 steps it started with" in kept.getvalue()
    lrs = [json.loads(ln)["lr"] for ln in (path / "metrics.jsonl").read_text().splitlines()]
    assert lrs[3] == pytest.approx(3e-3 * 0.1)  # held at the old schedule's end (lr x min_lr_ratio)
    changed = io.StringIO()
    train_lib.train(
        train_lib.configure([f"--run_dir={path}", "--steps=6", "--optimizer.decay_steps=6"]).config, changed
    )
    assert "the learning-rate schedule changes length from 3 to 6 steps" in changed.getvalue()
    lrs = [json.loads(ln)["lr"] for ln in (path / "metrics.jsonl").read_text().splitlines()]
    assert lrs[4] > 3e-3 * 0.1  # step 5 of a 6-step cosine is above its floor


def test_no_validation_split_means_no_val_loss_and_no_warning(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # NumPy's mean of nothing would warn
        path = train_lib.train(tiny(tmp_path, **{"data.val_fraction": "0"}), io.StringIO())
    records = [json.loads(ln) for ln in (path / "metrics.jsonl").read_text().splitlines()]
    assert all("val_loss" not in r for r in records)


def test_a_default_run_dir_says_how_to_resume_it_at_the_start_and_when_stopped(tmp_path, monkeypatch):
    """Without --run_dir the run goes to runs/<model>-<UTC time>: rerunning the same command would start
    another run, so the start and the stop name the argument that resumes this one (and it does)."""
    monkeypatch.chdir(tmp_path)
    layered = train_lib.configure([f"--{k}={v}" for k, v in TINY.items()])
    name = Path(layered.config.run_dir).name
    monkeypatch.setattr(stopping._STOP, "reason", "SIGTERM")  # as if it came during step 1
    console = io.StringIO()
    with pytest.raises(train_lib.Preempted) as stopped:
        train_lib.train(layered.config, console, layered.deepspeed, layered.sources)
    hint = f"to resume it: add --run_dir=runs/{name}"
    assert console.getvalue().splitlines()[0] == f"jaxzero: run_dir runs/{name} (new); {hint}"
    checkpoints = tmp_path / "runs" / name / "checkpoints"
    saved = f"SIGTERM: saved a checkpoint at step 1 in {checkpoints}"
    assert str(stopped.value) == f"{saved}; {hint} to the command."
    monkeypatch.setattr(stopping._STOP, "reason", None)
    again = train_lib.configure([f"--run_dir=runs/{name}"])
    resumed = io.StringIO()
    train_lib.train(again.config, resumed, again.deepspeed, again.sources)
    assert f"resumed from {checkpoints / '1'}" in resumed.getvalue()
    assert "to resume it" not in resumed.getvalue()  # a run_dir named is resumed by the same command


def test_a_read_only_run_dir_is_one_line_and_exit_2_before_any_work(tmp_path, monkeypatch, capsys):
    run = tmp_path / "r"
    run.mkdir()
    real = os.open

    def read_only(path, *args, **kwargs):  # a directory on a read-only file system (root ignores chmod)
        if os.fspath(path).endswith(LOCK_FILE):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), os.fspath(path))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(os, "open", read_only)
    code = train_lib.main([f"--run_dir={run}", "--steps=2"])
    out, err = capsys.readouterr()
    assert code == 2 and err.splitlines() == [
        f"jaxzero: config error: run_dir {run} cannot be written: Read-only file system (errno 30, EROFS). "
        "Pass a --run_dir on a file system you can write to, or make it writable."
    ]
    assert out == "" and list(run.iterdir()) == []  # before the model, the data or the plan


def metrics(lr: float, norm: float) -> StepMetrics:
    return StepMetrics(jnp.float32(float("nan")), jnp.float32(norm), jnp.float32(lr))


def test_a_non_finite_loss_is_blamed_on_what_the_facts_point_to(tmp_path):
    cfg = tiny(tmp_path, **{"data.source": "tokens", "data.path": "d", "data.check_tokens": "false"})
    fresh = Start(None, 1, None, None)
    first = nonfinite_cause(cfg, 1, metrics(0.0, float("nan")), fresh, [])
    assert "no update had changed the freshly initialised weights" in first
    assert "data.check_tokens=false" in first  # the unchecked data is the suspect, not lr
    resumed = Start(None, 41, None, 40)
    after_restore = nonfinite_cause(cfg, 41, metrics(1e-3, float("nan")), resumed, [])
    assert (
        "first step after restoring checkpoint 40" in after_restore
        and "checkpoints/40 aside" in after_restore
    )
    diverged = nonfinite_cause(cfg, 47, metrics(3e-3, 1e6), fresh, [2.0, 80.0, 9e4])
    assert (
        "diverged after 46 updates at lr 0.003" in diverged
        and "recent gradient norms 2, 80, 9e+04" in diverged
    )
    assert "Try a lower optimizer.lr (now 0.003)" in diverged


def test_background_errors_the_log_cannot_take_are_one_line_on_stderr(tmp_path, capfd):
    """A full disk fails the save and the error log alike: the dozens of reports Orbax's threads
    make then are summed up in one line, not printed one traceback each."""
    log = train_lib.BackgroundErrorLog(tmp_path / "no-such-dir")  # every write fails (OSError)
    log.install()
    try:
        for k in range(30):
            t = threading.Thread(target=lambda k=k: (_ for _ in ()).throw(OSError(28, f"no room {k}")))
            t.start()
            t.join()
    finally:
        log.uninstall()
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert "30 error report(s) of background threads could not be written to" in err[0]
    assert "OSError: [Errno 28] no room 0" in err[0]


def test_the_printed_commands_paste_into_a_shell(tmp_path):
    """The finished run's "train further", "export" and samples' "generate" commands name a run_dir
    with a space as one shell argument (they broke at the space when pasted)."""
    import shlex

    out = io.StringIO()
    run_dir = tmp_path / "my runs" / "first"
    loop.train(tiny(tmp_path, run_dir=str(run_dir)), out)
    lines = [ln for ln in out.getvalue().splitlines() if "python -m jaxzero." in ln]
    assert len(lines) == 3, out.getvalue()  # train further, export, and the samples' generate
    for line in lines:
        command = "python -m " + line.partition("python -m ")[2].removesuffix("):")
        assert f"--run_dir={run_dir}" in shlex.split(command), line
