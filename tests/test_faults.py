"""What jaxzero promises on each fault, tried as a user would: the CLI in subprocesses (one CPU device).

The directory named is the one used; nothing outside it is written; a failure leaves the last good
checkpoint usable, says what happened in one line, and rerunning the same command goes on."""

import json
import re
import shutil
import signal
import socket
import time
from pathlib import Path

import pytest
from subprocess_run import run_module, run_program

from jaxzero.cli import train as train_lib

pytestmark = pytest.mark.slow  # the CLI in subprocesses

RUN = [
    "--logging.log_every=1",
    "--logging.eval_every=0",
    "--data.seq_len=32",
    "--data.batch_size=4",
    "--model.num_layers=2",
    "--checkpoint.keep=5",
]


def cli(*args: str, cwd: Path, wait: bool = True):
    return run_module("jaxzero.train", *args, cwd=cwd, wait=wait)


def records(run_dir: Path) -> list[dict]:
    return [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]


def tree(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def no_traceback(stderr: str) -> bool:
    return "Traceback" not in stderr


def test_a_copied_run_resumes_where_it_now_is_and_the_original_is_untouched(tmp_path):
    first = cli(*RUN, "--steps=6", "--checkpoint.every=3", "--run_dir=orig", cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-2000:]
    shutil.copytree(tmp_path / "orig", tmp_path / "copy")
    before = tree(tmp_path / "orig")
    (tmp_path / "elsewhere").mkdir()
    resumed = cli("--run_dir=../copy", "--steps=9", cwd=tmp_path / "elsewhere")  # relative, another cwd
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert f"run_dir {tmp_path / 'copy'}: resuming" in resumed.stdout
    assert [r["step"] for r in records(tmp_path / "copy")][-1] == 9
    assert tree(tmp_path / "orig") == before  # not a byte of the original changed
    assert not (tmp_path / "elsewhere" / "runs").exists()


def test_the_resume_guard_holds_for_presets_too(tmp_path):
    preset = tmp_path / "p.toml"
    preset.write_text('run_dir = "r"\nsteps = 4\n[optimizer]\nlr = 3e-3\n[data]\nbatch_size = 4\n')
    first = cli(*RUN, f"--config={preset}", "--checkpoint.every=2", cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-2000:]
    config = (tmp_path / "r" / "config.json").read_text()
    changed = tmp_path / "q.toml"
    changed.write_text('run_dir = "r"\nsteps = 6\n[optimizer]\nlr = 1e-5\nwarmup_steps = 3\n')
    refused = cli(*RUN, f"--config={changed}", cwd=tmp_path)
    assert refused.returncode == 2 and no_traceback(refused.stderr)
    assert (
        f"cannot change optimizer.lr (0.003 -> 1e-05 from {changed}), optimizer.warmup_steps (20 -> 3 from "
        f"{changed})" in refused.stderr
    )
    assert f"drop optimizer.lr, optimizer.warmup_steps from {changed} (or resume" in refused.stderr
    assert (tmp_path / "r" / "config.json").read_text() == config  # untouched
    again = cli(*RUN, f"--config={preset}", "--steps=6", cwd=tmp_path)  # the same preset: resumes
    assert again.returncode == 0 and "resuming" in again.stdout, again.stderr[-2000:]


def test_directories_that_are_not_jaxzero_runs_are_never_written(tmp_path):
    foreign = tmp_path / "foreign"
    (foreign / "checkpoints" / "100").mkdir(parents=True)
    (foreign / "config.json").write_text('{"model_type": "llama"}')
    before = tree(tmp_path)
    proc = cli(*RUN, "--steps=2", f"--run_dir={foreign}", cwd=tmp_path)
    assert proc.returncode == 2 and "is not a jaxzero run" in proc.stderr and no_traceback(proc.stderr)
    assert tree(tmp_path) == before and not (tmp_path / "runs").exists()


def test_a_failure_before_training_writes_nothing_and_the_rerun_works(tmp_path):
    hf = tmp_path / "hf"  # a Hugging Face directory with a config and no weights
    hf.mkdir()
    (hf / "config.json").write_text(
        json.dumps(
            {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
             "num_attention_heads": 4, "vocab_size": 256, "max_position_embeddings": 64}
        )
    )  # fmt: skip
    proc = cli(*RUN, "--steps=2", f"--model.name=hf:{hf}", "--run_dir=r", cwd=tmp_path)
    assert proc.returncode == 2 and "has neither model.safetensors" in proc.stderr, proc.stderr[-2000:]
    assert no_traceback(proc.stderr) and not (tmp_path / "r").exists()
    refused = cli("--model.name=llama-30b", "--run_dir=r", cwd=tmp_path)  # memory: refused, with the numbers
    assert refused.returncode == 2 and "the largest named model that fits" in refused.stderr, refused.stderr
    assert not (tmp_path / "r").exists()
    ok = cli(*RUN, "--steps=2", "--run_dir=r", cwd=tmp_path)
    assert ok.returncode == 0, ok.stderr[-2000:]


def wait_for_records(run_dir: Path, count: int) -> None:
    metrics = run_dir / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and (not metrics.exists() or len(metrics.read_text().splitlines()) < count):
        time.sleep(0.2)


def test_a_second_trainer_on_a_run_dir_is_refused_at_once_and_the_first_goes_on(tmp_path):
    first = cli(*RUN, "--steps=100000", "--run_dir=r", cwd=tmp_path, wait=False)
    try:
        wait_for_records(tmp_path / "r", 2)
        config = (tmp_path / "r" / "config.json").read_text()
        second = cli(*RUN, "--steps=5", "--run_dir=r", cwd=tmp_path)
        first.send_signal(signal.SIGTERM)  # the first stops as it would have: a checkpoint, exit 3
        out, err = first.communicate(timeout=120)
    finally:
        first.kill()
    assert second.returncode == 2 and second.stdout == "", second.stdout[-2000:]  # before any work
    lines = second.stderr.strip().splitlines()
    assert len(lines) == 1 and re.fullmatch(
        rf"jaxzero: config error: run_dir {re.escape(str(tmp_path / 'r'))} is in use by the trainer started "
        rf"\d{{4}}-\d\d-\d\dT\d\d:\d\d:\d\dZ on host {re.escape(socket.gethostname())}, pid {first.pid}; "
        r"wait for it to end or pass another --run_dir\.",
        lines[0],
    ), lines
    assert first.returncode == 3 and "preempted: SIGTERM: saved a checkpoint" in err, err[-2000:]
    assert (tmp_path / "r" / "config.json").read_text() == config
    assert not (tmp_path / "r" / "previous-attempts").exists()
    steps = [r["step"] for r in records(tmp_path / "r")]
    assert steps == list(range(1, len(steps) + 1))  # one trainer's records, none interleaved
    assert sorted(p.name for p in (tmp_path / "r").iterdir()) == [
        "checkpoints", "config.json", "metrics.jsonl", "tensorboard"
    ]  # fmt: skip


def test_a_save_the_file_system_does_not_permit_ends_the_run_within_seconds(tmp_path):
    """EPERM where Orbax creates the save's directory, and a thread the failure leaves waiting for ever:
    one line naming the checkpoint and the cause, exit 1, and the process ends within seconds."""
    args = [*RUN, "--steps=4", "--checkpoint.every=2", "--run_dir=r"]
    proc = run_program("checkpoint_dir_not_permitted.py", *args, cwd=tmp_path, wait=False)
    try:
        line = proc.stderr.readline()  # the error, printed once the run has failed
        proc.wait(timeout=30)  # then the end, within seconds; without the bounded exit, never
    finally:
        proc.kill()
    rest = proc.stderr.read()
    assert proc.returncode == 1 and rest == "", rest[-2000:]
    assert line.startswith("jaxzero: checkpoint error: could not write checkpoint 2 to"), line
    assert "Operation not permitted (errno 1). Nothing half-written is left" in line


def test_a_run_killed_before_its_first_checkpoint_starts_over_on_rerun(tmp_path):
    args = [*RUN, "--steps=100000", "--run_dir=r"]
    proc = cli(*args, cwd=tmp_path, wait=False)
    metrics = tmp_path / "r" / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and (not metrics.exists() or len(metrics.read_text().splitlines()) < 3):
        time.sleep(0.2)
    proc.kill()
    proc.wait()
    partial = metrics.read_text()
    assert f'"pid": {proc.pid}' in (tmp_path / "r" / "trainer.lock").read_text()  # its lock died with it
    rerun = cli(*args[:-2], "--steps=3", "--run_dir=r", cwd=tmp_path)
    assert rerun.returncode == 0 and "starting over" in rerun.stdout, rerun.stderr[-2000:]
    assert not (tmp_path / "r" / "trainer.lock").exists()  # released by the rerun as it ended
    kept = list((tmp_path / "r" / "previous-attempts").glob("*/metrics.jsonl"))
    assert len(kept) == 1 and kept[0].read_text() == partial  # kept aside, not deleted
    assert [r["step"] for r in records(tmp_path / "r")] == [1, 2, 3]


def test_a_full_disk_stops_the_run_with_one_line_and_the_rerun_resumes(tmp_path):
    args = [*RUN, "--steps=8", "--checkpoint.every=2", "--run_dir=r"]
    proc = run_program("disk_fills_up.py", *args, cwd=tmp_path)
    assert proc.returncode == 1, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    # warned as checkpoint 2 was written (time to free space), then the save of 4 refused: two lines
    assert len(lines) == 2, lines
    assert lines[0].startswith("jaxzero: warning: checkpoint 2 is written, but the next one will not fit")
    assert lines[1].startswith("jaxzero: checkpoint error: not enough free space"), lines
    checkpoints = tmp_path / "r" / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["2"]  # the good one, nothing half-written
    rerun = cli(*args, cwd=tmp_path)  # the disk has room again
    assert rerun.returncode == 0 and "resumed from" in rerun.stdout, rerun.stderr[-2000:]
    assert [r["step"] for r in records(tmp_path / "r")] == list(range(1, 9))


def test_a_save_that_fails_in_the_background_is_one_line_naming_it(tmp_path):
    """ENOSPC inside Orbax's background commit of checkpoint 4: one line on stderr naming checkpoint 4
    and the cause, the writers' tracebacks in error.log, checkpoint 2 intact, the rerun resumes."""
    args = [*RUN, "--steps=8", "--checkpoint.every=2", "--run_dir=r"]
    proc = run_program("write_fails_in_background.py", *args, cwd=tmp_path)
    assert proc.returncode == 1, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    assert "checkpoint error: could not write checkpoint 4 to" in lines[0]
    assert "No space left on device (errno 28)" in lines[0] and "error.log" in lines[0]
    assert "OSError: [Errno 28]" in (tmp_path / "r" / "error.log").read_text()
    assert sorted(p.name for p in (tmp_path / "r" / "checkpoints").iterdir()) == ["2"]
    rerun = cli(*args, cwd=tmp_path)
    assert rerun.returncode == 0 and "resumed from" in rerun.stdout, rerun.stderr[-2000:]
    assert [r["step"] for r in records(tmp_path / "r")] == list(range(1, 9))


@pytest.mark.parametrize("presses", [1, 2])
def test_ctrl_c_saves_like_sigterm_and_a_second_stops_at_once(tmp_path, presses):
    proc = cli(*RUN, "--steps=100000", "--run_dir=r", cwd=tmp_path, wait=False)
    metrics = tmp_path / "r" / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and (not metrics.exists() or len(metrics.read_text().splitlines()) < 3):
        time.sleep(0.2)
    for _ in range(presses):
        proc.send_signal(signal.SIGINT)
        time.sleep(0.01)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-2000:]
    assert no_traceback(err), err[-3000:]
    if presses == 1:
        assert "interrupted: Ctrl-C: saved a checkpoint at step" in err
        resumed = cli("--run_dir=r", "--steps=" + str(len(records(tmp_path / "r")) + 1), cwd=tmp_path)
        assert resumed.returncode == 0 and "resumed from" in resumed.stdout, resumed.stderr[-2000:]
    else:
        assert "stopped at once" in err


def test_bad_input_is_refused_before_anything_is_written(tmp_path, monkeypatch, capsys):
    for args, message in [
        (["--optimizer.lr=inf"], "optimizer.lr=inf must be a finite number"),
        (["--optimizer.eps=-1"], "optimizer.eps=-1.0 must be > 0"),
        (["--steps", "10"], "cannot parse argument '--steps'"),
    ]:  # in-process: a refusal comes before any backend starts, as in the CLI's own process
        monkeypatch.chdir(tmp_path)
        assert train_lib.main([*args, "--run_dir=r"]) == 2
        err = capsys.readouterr().err
        assert message in err and no_traceback(err) and err.count("\n") == 1, err
    assert not (tmp_path / "r").exists()
    assert train_lib.main(["--help"]) == 0
    assert "--optimizer.lr  (float, default 0.003)" in capsys.readouterr().out
