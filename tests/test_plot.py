"""`python -m jaxzero.plot`: figures of real tiny runs (one resident, one offloaded, overlaid), its
refusals (exit code 2, naming the path), and that it writes into --out only."""

import io
import shutil
import sys

import matplotlib.image
import numpy as np
import pytest

from jaxzero.cli import plot
from jaxzero.cli import train as train_lib
from jaxzero.config import ConfigError, TrainConfig
from jaxzero.overrides import apply_overrides
from jaxzero.storage.run_dir import inspect_run_dir

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
TINY = {
    "steps": "4",
    "data.seq_len": "16",
    "data.batch_size": "4",
    "model.num_layers": "1",
    "logging.log_every": "1",
    "logging.eval_every": "2",
    "logging.eval_batches": "1",
    "logging.progress": "false",
    "logging.samples": "0",
    "checkpoint.enabled": "false",
}
OFFLOAD = {"offload.params": "cpu", "offload.optimizer": "cpu"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two finished runs: resident (a higher learning rate: its loss differs) and offloaded."""
    root = tmp_path_factory.mktemp("plot")
    resident = train_lib.train(
        apply_overrides(TrainConfig(), {**TINY, "optimizer.lr": "1e-2", "run_dir": str(root / "resident")}),
        io.StringIO(),
    )
    offloaded = train_lib.train(
        apply_overrides(TrainConfig(), {**TINY, **OFFLOAD, "run_dir": str(root / "offloaded")}), io.StringIO()
    )
    return resident, offloaded


def files(root) -> dict:
    """Every file under `root` with its size and modification time."""
    return {p: (p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*") if p.is_file()}


def check_png(path) -> None:
    assert path.read_bytes()[:8] == PNG_SIGNATURE, path
    image = matplotlib.image.imread(path)
    assert image.shape[0] > 100 and image.shape[1] > 100, image.shape
    colours = np.unique(image.reshape(-1, image.shape[-1]), axis=0)
    assert len(colours) > 10, f"{path} is (nearly) blank"


def copy_run(src, dst):
    """A run directory holding `src`'s metrics.jsonl and config.json, to spoil without harm."""
    dst.mkdir()
    for name in ("metrics.jsonl", "config.json"):
        shutil.copy(src / name, dst / name)
    return dst


def test_two_runs_overlaid_into_the_first_runs_plots(runs, tmp_path, monkeypatch, capsys):
    resident, offloaded = runs
    monkeypatch.chdir(tmp_path)
    before = files(resident.parent)
    assert plot.main([str(offloaded), str(resident)]) == 0
    out = offloaded / "plots"
    printed = capsys.readouterr().out
    for name in ("loss.png", "throughput.png", "breakdown.png"):
        check_png(out / name)
        assert str(out / name) in printed
    assert "breakdown.png leaves out resident" in printed
    after = files(resident.parent)
    assert {p: v for p, v in after.items() if p.parent != out} == before, "written outside --out"
    assert sorted(p.name for p in out.iterdir()) == ["breakdown.png", "loss.png", "throughput.png"]
    assert list(tmp_path.iterdir()) == [], "written into the working directory"
    # Plotting again overwrites its own figures.
    assert plot.main([str(offloaded), str(resident)]) == 0
    # The figures leave the run directory a jaxzero run: judged on its run (finished without
    # checkpoints here), not refused as holding files of another origin.
    with pytest.raises(ConfigError, match="finished without checkpoints"):
        inspect_run_dir(offloaded)


def test_no_breakdown_without_an_offloaded_run_and_a_truncated_last_line(runs, tmp_path, capsys):
    resident, _ = runs
    run = copy_run(resident, tmp_path / "killed")
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 5, "loss": 2.')  # a run killed mid-write
    out = tmp_path / "figures"
    assert plot.main([str(run), f"--out={out}"]) == 0
    captured = capsys.readouterr()
    assert "no breakdown.png" in captured.out and "truncated last line" in captured.err
    assert sorted(p.name for p in out.iterdir()) == ["loss.png", "throughput.png"]
    check_png(out / "loss.png")


def test_unreadable_runs_are_refused_naming_the_path(runs, tmp_path, capsys):
    resident, _ = runs
    missing = tmp_path / "nope"
    assert plot.main([str(resident), str(missing)]) == 2
    assert f"run directory {str(missing)!r} does not exist" in capsys.readouterr().err

    empty = tmp_path / "empty"
    empty.mkdir()
    assert plot.main([str(empty)]) == 2
    assert f"{empty / 'metrics.jsonl'} does not exist" in capsys.readouterr().err

    bad = copy_run(resident, tmp_path / "bad")
    lines = (bad / "metrics.jsonl").read_text().splitlines()
    lines[1] = lines[1][:-5]  # a line cut short in the middle of the file: not a killed run's tail
    (bad / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    assert plot.main([str(bad)]) == 2
    assert f"{bad / 'metrics.jsonl'}:2 is not JSON" in capsys.readouterr().err
    assert not (resident / "plots").exists() and not (bad / "plots").exists(), "wrote despite the errors"


def test_an_out_directory_with_other_files_is_refused(runs, tmp_path, capsys):
    resident, _ = runs
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    assert plot.main([str(resident), f"--out={out}"]) == 2
    assert "holds files jaxzero.plot did not write (notes.txt)" in capsys.readouterr().err
    assert [p.name for p in out.iterdir()] == ["notes.txt"]
    assert plot.main([str(resident), f"--out={tmp_path / 'no' / 'such'}"]) == 2
    assert "parent directory does not exist" in capsys.readouterr().err
    assert not (tmp_path / "no").exists()


def test_an_out_directory_that_cannot_be_written_is_one_line(runs, tmp_path, monkeypatch, capsys):
    resident, _ = runs

    def read_only(out):
        raise OSError(30, "Read-only file system", str(out))

    monkeypatch.setattr(plot, "prepare_out", read_only)
    assert plot.main([str(resident), f"--out={tmp_path / 'ro'}"]) == 2
    assert "cannot write the figures into" in capsys.readouterr().err
    monkeypatch.undo()

    def full(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(plot, "plot_loss", full)
    assert plot.main([str(resident), f"--out={tmp_path / 'full'}"]) == 2
    assert "No space left on device" in capsys.readouterr().err


def test_without_matplotlib_it_says_what_to_install(runs, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    assert plot.main([str(runs[0])]) == 2
    assert "pip install 'jaxzero[plot]'" in capsys.readouterr().err
