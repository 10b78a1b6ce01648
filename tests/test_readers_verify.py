"""The programs that read a run's checkpoint (`python -m jaxzero.export`, `eval`, `generate`) check its
files against the checksums its save wrote before they read it, as a resume does: a changed byte that
still decodes is refused, naming the file and the checkpoint, with nothing written;
`--checkpoint.verify=false` reads it unchecked."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from jaxzero.cli import eval as eval_lib
from jaxzero.cli import export as export_lib
from jaxzero.cli import generate as gen_lib
from jaxzero.cli import train as train_lib  # the programs: imported by their tests only
from jaxzero.data import write_tokens
from jaxzero.storage.checkpoint_masters import load_masters, read_saved_state

SEQ = 16


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A tiny run with checkpoints 2 and 4 (on the built-in corpus: `generate` knows its tokenizer), a
    copy of it whose checkpoint 4 has one byte changed inside a master's array data (the file still
    decodes, to another value), the token files `eval` reads, and the changed file's path."""
    root = tmp_path_factory.mktemp("verify")
    data = root / "tokens"
    data.mkdir()
    rng = np.random.default_rng(0)
    write_tokens(data / "train.bin", rng.integers(0, 256, 4000), "uint16")
    write_tokens(data / "val.bin", rng.integers(0, 256, 200), "uint16")
    run = root / "run"
    args = [f"--data.seq_len={SEQ}", "--data.batch_size=4", "--model.num_layers=1", "--steps=4",
            "--checkpoint.every=2", "--logging.samples=0", "--logging.tensorboard=false",
            f"--run_dir={run}"]  # fmt: skip
    assert train_lib.main(args) == 0
    damaged = root / "damaged"
    shutil.copytree(run, damaged)
    _, masters, _ = load_masters(run)
    kernel = np.asarray(masters.blocks[0]["self_attn"]["q_proj"]["kernel"], np.float32)
    first = kernel.tobytes()[:64]  # its first 16 values, stored as raw float32
    state = damaged / "checkpoints" / "4" / "state"
    holding = [f for f in state.rglob("*") if f.is_file() and first in f.read_bytes()]
    assert len(holding) == 1, holding
    data_bytes = bytearray(holding[0].read_bytes())
    data_bytes[data_bytes.index(first) + 2] ^= 0x10  # the first value's third byte
    holding[0].write_bytes(data_bytes)
    unchecked = read_saved_state(damaged / "checkpoints" / "4")["params"]  # it decodes, to another kernel
    assert not np.array_equal(unchecked.blocks[0]["self_attn"]["q_proj"]["kernel"], kernel)
    return run, damaged, data, holding[0].relative_to(damaged / "checkpoints" / "4").as_posix()


def refused(err: str, damaged: Path, changed: str) -> bool:
    """Whether `err` names the checkpoint and the changed file, and says how to go on."""
    return (
        f"{damaged}/checkpoints/4 could not be read as saved" in err
        and changed in err
        and "--step=N (this run has [2])" in err
        and "--checkpoint.verify=false" in err
        and "Traceback" not in err
    )


def test_export_refuses_a_changed_checkpoint_before_writing(runs, tmp_path, capsys):
    run, damaged, _, changed = runs
    for merge_free_format in ("hf", "orbax"):
        out = tmp_path / merge_free_format
        code = export_lib.main([f"--run_dir={damaged}", f"--out={out}", f"--format={merge_free_format}"])
        err = capsys.readouterr().err
        assert code == 2 and refused(err, damaged, changed), err
        assert not out.exists()  # nothing written
    # An earlier checkpoint of it, and the same checkpoint unchanged, export as before.
    assert export_lib.main([f"--run_dir={damaged}", f"--out={tmp_path / 'two'}", "--step=2"]) == 0
    assert export_lib.main([f"--run_dir={run}", f"--out={tmp_path / 'four'}"]) == 0
    # Unchecked: exported as it reads.
    out = tmp_path / "unchecked"
    assert export_lib.main([f"--run_dir={damaged}", f"--out={out}", "--checkpoint.verify=false"]) == 0
    assert (out / "model.safetensors").is_file()
    assert (out / "model.safetensors").read_bytes() != (tmp_path / "four" / "model.safetensors").read_bytes()
    assert export_lib.main([f"--run_dir={run}", f"--out={tmp_path / 'x'}", "--checkpoint.verify=maybe"]) == 2
    assert "is not a boolean" in capsys.readouterr().err and not (tmp_path / "x").exists()


def test_eval_refuses_a_changed_checkpoint(runs, capsys):
    run, damaged, data, changed = runs
    assert eval_lib.main([f"--run_dir={damaged}", f"--data.path={data}"]) == 2
    captured = capsys.readouterr()
    assert refused(captured.err, damaged, changed), captured.err
    assert "loss" not in captured.out
    assert eval_lib.main([f"--run_dir={damaged}", f"--data.path={data}", "--checkpoint.verify=false"]) == 0
    assert eval_lib.main([f"--run_dir={damaged}", f"--data.path={data}", "--step=2"]) == 0


def test_generate_refuses_a_changed_checkpoint(runs, capsys):
    run, damaged, _, changed = runs
    prompt = ["--prompt=ab", "--max_new_tokens=2"]
    assert gen_lib.main([f"--run_dir={damaged}", *prompt]) == 2
    captured = capsys.readouterr()
    assert refused(captured.err, damaged, changed), captured.err
    assert "---" not in captured.out  # nothing generated
    assert gen_lib.main([f"--run_dir={damaged}", *prompt, "--checkpoint.verify=false"]) == 0
    assert gen_lib.main([f"--run_dir={run}", *prompt]) == 0
