"""Unreadable Hugging Face weights are refused before anything runs: one line naming the file and what
is wrong with it, exit 2 (the README's fault table), from `python -m jaxzero.train --model.name=hf:DIR`
and `python -m jaxzero.generate --hf=DIR` alike; nothing is written. In-process `main(argv)` calls."""

from __future__ import annotations

import dataclasses
import json
import struct
from pathlib import Path

import jax
import numpy as np
import pytest

from jaxzero.cli import generate as generate_lib
from jaxzero.cli import train as train_lib
from jaxzero.config import ModelConfig
from jaxzero.interop import export_hf
from jaxzero.models import build_model

MODEL = dataclasses.replace(ModelConfig.named("llama-tiny"), num_layers=1)


def hf_checkpoint(out: Path, max_shard_bytes: int = 2**30) -> Path:
    """A one-block llama-tiny as a transformers checkpoint (zeros: only the files matter here)."""
    shapes = jax.eval_shape(build_model(MODEL).init, jax.random.key(0))
    params = jax.tree.map(lambda s: np.zeros(s.shape, np.float32), shapes)
    export_hf(params, MODEL, out, dtype="float32", max_shard_bytes=max_shard_bytes)
    return out


def train(tmp_path: Path, ckpt: Path, capsys) -> tuple[int, str]:
    run_dir = tmp_path / "run"
    argv = [f"--model.name=hf:{ckpt}", "--steps=1", f"--run_dir={run_dir}", "--data.seq_len=16"]
    code = train_lib.main([*argv, "--data.batch_size=4", "--logging.progress=false"])
    err = capsys.readouterr().err
    assert not run_dir.exists(), "a refused run wrote its run directory"
    return code, err


def generate(ckpt: Path, capsys) -> tuple[int, str]:
    code = generate_lib.main([f"--hf={ckpt}", "--prompt=x", "--max_new_tokens=2"])
    return code, capsys.readouterr().err


def one_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.startswith("jaxzero")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_a_truncated_safetensors_file_exits_2_with_the_sizes(tmp_path, capsys):
    ckpt = hf_checkpoint(tmp_path / "hf")
    weights = ckpt / "model.safetensors"
    whole = weights.read_bytes()
    weights.write_bytes(whole[: len(whole) // 2])
    code, err = train(tmp_path, ckpt, capsys)
    line = one_line(err)
    assert code == 2, err
    assert f"{weights}: the header lists 12 tensors ending at byte {len(whole)}" in line
    assert f"the file has {len(whole) // 2} bytes" in line and "truncated" in line
    assert "download or export it again" in line
    code, err = generate(ckpt, capsys)
    assert code == 2 and f"{weights}: the header lists 12 tensors" in one_line(err)


def test_a_garbage_header_exits_2(tmp_path, capsys):
    ckpt = hf_checkpoint(tmp_path / "hf")
    weights = ckpt / "model.safetensors"
    weights.write_bytes(struct.pack("<Q", 6) + b"{nope}" + b"\0" * 64)
    code, err = train(tmp_path, ckpt, capsys)
    assert code == 2 and f"{weights}: the header is not valid UTF-8 JSON" in one_line(err)
    code, err = generate(ckpt, capsys)
    assert code == 2 and f"{weights}: the header is not valid UTF-8 JSON" in one_line(err)
    weights.write_bytes(b"<html>404</html>")  # what a failed download often saves
    code, err = train(tmp_path, ckpt, capsys)
    assert code == 2 and f"{weights}: header size field says" in one_line(err)


@pytest.mark.parametrize(
    "index, message",
    [
        ('{"weight_map": {"model.embed_tokens.weight": "model-00001-of', "not valid JSON"),
        ('{"metadata": {}}', "holds no 'weight_map' object"),
        ("[1, 2]", "holds no 'weight_map' object"),
    ],
)
def test_a_bad_index_exits_2(tmp_path, capsys, index, message):
    ckpt = hf_checkpoint(tmp_path / "hf", max_shard_bytes=2**19)
    (ckpt / "model.safetensors.index.json").write_text(index)
    code, err = train(tmp_path, ckpt, capsys)
    line = one_line(err)
    assert code == 2 and f"{ckpt / 'model.safetensors.index.json'} is not a valid index (" in line
    assert message in line
    assert "download it again" in line
    code, err = generate(ckpt, capsys)
    assert code == 2 and message in one_line(err)


def test_a_truncated_shard_exits_2(tmp_path, capsys):
    ckpt = hf_checkpoint(tmp_path / "hf", max_shard_bytes=2**19)
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    shard = ckpt / sorted(set(index["weight_map"].values()))[-1]
    shard.write_bytes(shard.read_bytes()[:-100])
    code, err = train(tmp_path, ckpt, capsys)
    assert code == 2 and f"{shard}: the header lists" in one_line(err)


def test_a_missing_checkpoint_directory_exits_2(tmp_path, capsys):
    code, err = generate(tmp_path / "nowhere", capsys)
    assert code == 2 and "does not exist" in one_line(err)
