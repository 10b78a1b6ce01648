"""`python -m jaxzero.train` end to end on the tiny model, as a user runs it (a subprocess, one device)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from subprocess_run import REPO, run_module, user_env

from jaxzero.cli import train as train_lib

pytestmark = pytest.mark.slow  # end to end: `python -m jaxzero.train` in subprocesses

TINY = [
    "--steps=30",
    "--logging.log_every=5",
    "--logging.eval_every=15",
    "--data.seq_len=64",
    "--data.batch_size=8",
    "--model.num_layers=2",
]


def train(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return run_module("jaxzero.train", *args, cwd=cwd)


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def first_run(tmp_path_factory):
    cwd = tmp_path_factory.mktemp("cli")
    proc = train(*TINY, "--run_dir=a", cwd=cwd)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return cwd, proc


def test_trains_and_writes_run_dir(first_run):
    cwd, proc = first_run
    run_dir = cwd / "a"
    cfg = json.loads((run_dir / "config.json").read_text())
    assert (
        cfg["steps"] == 30
        and cfg["run_dir"] == str(run_dir.absolute())  # a relative run_dir, resolved where it was given
        and cfg["offload"]
        == {
            "params": "auto",  # as the user wrote it: the planner's decision is not saved over it
            "optimizer": "auto",
            "resident_blocks": 0,
            "device_state_units": -1,
            "activations": "none",
            "update": "overlapped",
            "two_pass_units": -1,
            "fused_update": True,
            "disk_units": -1,
            "disk_path": "",
            "host_threads": 0,
        }
    )
    recs = records(run_dir)
    assert [r["step"] for r in recs] == [1, 5, 10, 15, 20, 25, 30]
    for key in ("step", "loss", "lr", "grad_norm", "tokens_per_s", "tflops", "mfu", "host_rss_gib"):
        assert key in recs[-1], key
    assert recs[-1]["tokens_per_s"] > 0 and recs[-1]["mfu"] is None  # no known peak for a CPU
    assert "val_loss" in recs[3] and "val_loss" in recs[-1] and "val_loss" not in recs[2]
    assert recs[-1]["loss"] < recs[0]["loss"] - 1.0, "loss must fall visibly"
    assert "step 30 | loss" in proc.stdout
    # An obvious plan is one line, in the words of the device that runs.
    assert "jaxzero: plan: resident (decided" in proc.stdout and "machine (" not in proc.stdout
    assert "GPU" not in proc.stdout


def test_same_seed_same_losses_and_offload_agrees(first_run):
    cwd, _ = first_run
    again = train(*TINY, "--run_dir=b", cwd=cwd)
    assert again.returncode == 0, again.stderr[-3000:]
    assert [r["loss"] for r in records(cwd / "a")] == [r["loss"] for r in records(cwd / "b")]
    off = train(*TINY, "--run_dir=c", "--offload.optimizer=cpu", "--offload.params=cpu", cwd=cwd)
    assert off.returncode == 0, off.stderr[-3000:]
    assert "ZeRO-3 offload" in off.stdout
    a, c = records(cwd / "a"), records(cwd / "c")
    assert abs(a[-1]["loss"] - c[-1]["loss"]) < 0.05  # bf16, same math in different programs
    # The offload engine reports where each step's time went, in the log line and the records.
    breakdown = ["step_s", "gpu_compute_s", "h2d_s", "d2h_s", "host_update_s", "wait_weights_s"]
    for key in breakdown + ["gpu_idle_s", "host_idle_s"]:
        assert c[-1][key] >= 0, key
    assert c[-1]["gpu_compute_s"] > 0 and c[-1]["host_update_s"] > 0
    assert all(k not in a[-1] for k in breakdown)  # the resident trainer has no host update to time
    assert "host update" in off.stdout and "CPU compute" in off.stdout  # the real device: CPU here


def test_refuses_to_overwrite_and_reports_bad_config(first_run, monkeypatch, capsys):
    cwd, _ = first_run
    before = (cwd / "a" / "metrics.jsonl").read_text()
    # A checkpointed, finished run again: there is nothing left to do (said before any checkpoint is
    # read), and nothing is lost.
    proc = train("--run_dir=a", cwd=cwd)
    assert proc.returncode == 0 and "nothing to do: the run is at step" in proc.stdout, proc.stderr[-2000:]
    assert (cwd / "a" / "metrics.jsonl").read_text() == before
    # A run without checkpoints is never overwritten.
    proc = train(*TINY, "--checkpoint.enabled=false", "--run_dir=nock", cwd=cwd)
    assert proc.returncode == 0, proc.stderr[-2000:]
    before = (cwd / "nock" / "metrics.jsonl").read_text()
    assert train_lib.main([*TINY, f"--run_dir={cwd / 'nock'}"]) == 2
    assert "already holds a run" in capsys.readouterr().err
    assert (cwd / "nock" / "metrics.jsonl").read_text() == before
    # Refusals come before any backend starts: in-process, as in the CLI's own process.
    monkeypatch.chdir(cwd)
    assert train_lib.main(["--optimizer.learning_rate=1"]) == 2
    assert "unknown config key 'optimizer.learning_rate'" in capsys.readouterr().err
    assert train_lib.main(["--data.source=tokens", "--data.path=/nonexistent"]) == 2
    assert "/nonexistent" in capsys.readouterr().err


def test_nan_loss_stops_with_a_clear_error(tmp_path):
    proc = train(
        *TINY,
        "--steps=10",
        "--optimizer.lr=1e6",
        "--optimizer.warmup_steps=0",
        "--optimizer.grad_clip=0",
        "--model.compute_dtype=float32",
        "--run_dir=nan",
        cwd=tmp_path,
    )
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "loss became nan" in proc.stderr and "Try a lower optimizer.lr" in proc.stderr
    assert (tmp_path / "nan" / "metrics.jsonl").exists()


def test_readme_library_example_runs():
    """The README's library example, verbatim but for the step count, trains and lowers the loss."""
    readme = (REPO / "README.md").read_text()
    code = readme.split("## Library API")[1].split("```python")[1].split("```")[0]
    code = code.replace('"--steps=100"', '"--steps=12"')
    proc = subprocess.run(
        [sys.executable, "-c", code], env=user_env(), capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "StepMetrics(loss=" in proc.stdout
