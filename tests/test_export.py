"""Export a training run (Hugging Face safetensors or Orbax) and fine-tune from a Hugging Face export."""

import dataclasses
import json

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
import torch
import transformers
from subprocess_run import run_module

from jaxzero.models import build_model, forward
from jaxzero.storage.checkpoint_masters import load_masters

pytestmark = pytest.mark.slow  # trains through the CLI, then exports

RUN = [
    "--steps=6",
    "--logging.log_every=3",
    "--data.seq_len=32",
    "--data.batch_size=4",
    "--model.num_layers=2",
    "--model.compute_dtype=float32",
]


run = run_module


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    cwd = tmp_path_factory.mktemp("export")
    for name in ("llama-tiny", "gpt2-tiny"):
        proc = run("jaxzero.train", *RUN, f"--model.name={name}", f"--run_dir={name}", cwd=cwd)
        assert proc.returncode == 0, proc.stderr[-3000:]
    return cwd


@pytest.mark.parametrize("name", ["llama-tiny", "gpt2-tiny"])
def test_hf_export_loads_in_transformers_with_matching_logits(trained, name):
    out = trained / f"{name}-hf"
    proc = run("jaxzero.export", f"--run_dir={name}", f"--out={out}", "--dtype=float32", cwd=trained)
    assert proc.returncode == 0, proc.stderr[-3000:]
    cfg, params, step = load_masters(trained / name)
    assert step == 6
    tokens = np.random.default_rng(0).integers(0, cfg.model.vocab_size, (2, 16), dtype=np.int32)
    model_cfg = dataclasses.replace(cfg.model, attention_impl="xla")
    with jax.default_matmul_precision("highest"):
        ours = np.asarray(forward(build_model(model_cfg), params, tokens))
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = hf(torch.from_numpy(tokens.astype(np.int64))).logits.numpy()
    assert np.linalg.norm(ours - theirs) / np.linalg.norm(theirs) < 1e-4


def test_hf_export_reads_the_checkpoint_one_unit_at_a_time(trained, tmp_path, monkeypatch):
    """`masters_by_unit` defers every unit; the export reads each only when it writes it, so host RAM
    holds one unit of the masters at a time, and the files equal an export of the whole masters."""
    from jaxzero.interop import export_hf
    from jaxzero.storage import checkpoint_masters

    cfg, lazy, step = checkpoint_masters.masters_by_unit(trained / "llama-tiny")
    units = lazy.units()
    assert step == 6 and all(type(u).__name__ == "Deferred" for u in units)
    events: list[str] = []
    read = checkpoint_masters._read_numpy
    monkeypatch.setattr(
        checkpoint_masters,
        "_read_numpy",
        lambda path, shapes: (events.append(path.name), read(path, shapes))[1],
    )
    write = export_hf.__globals__["SafetensorsWriter"].write
    monkeypatch.setattr(
        export_hf.__globals__["SafetensorsWriter"],
        "write",
        lambda self, name, a: (events.append("write"), write(self, name, a))[1],
    )
    export_hf(lazy, cfg.model, tmp_path / "lazy", dtype="float32")
    reads = [e for e in events if e != "write"]
    assert reads == ["embed", "block_0000", "block_0001", "head"]
    assert all("write" in events[events.index(a) : events.index(b)] for a, b in zip(reads, reads[1:]))
    monkeypatch.undo()
    _, whole, _ = load_masters(trained / "llama-tiny")
    export_hf(whole, cfg.model, tmp_path / "whole", dtype="float32")
    for f in ("model.safetensors", "config.json"):
        assert (tmp_path / "lazy" / f).read_bytes() == (tmp_path / "whole" / f).read_bytes()


def test_orbax_export_holds_params_only_in_the_requested_dtype(trained):
    out = trained / "llama-orbax"
    proc = run("jaxzero.export", "--run_dir=llama-tiny", f"--out={out}", "--format=orbax", cwd=trained)
    assert proc.returncode == 0, proc.stderr[-3000:]
    _, params, _ = load_masters(trained / "llama-tiny")
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, jax.numpy.bfloat16), params)
    tree = ocp.StandardCheckpointer().restore(out, target)
    leaves = jax.tree.leaves(tree)
    assert {np.asarray(x).dtype for x in leaves} == {np.dtype(jax.numpy.bfloat16)}
    assert len(leaves) == len(jax.tree.leaves(params))  # no optimizer state
    for x, y in zip(leaves, jax.tree.leaves(params)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y).astype(jax.numpy.bfloat16))


def test_finetune_from_hf_export_starts_from_its_weights(trained):
    out = trained / "llama-for-finetune"
    assert (
        run(
            "jaxzero.export", "--run_dir=llama-tiny", f"--out={out}", "--dtype=float32", cwd=trained
        ).returncode
        == 0
    )
    proc = run(
        "jaxzero.train",
        f"--model.name=hf:{out}",
        "--model.compute_dtype=float32",
        "--steps=1",
        "--data.seq_len=32",
        "--data.batch_size=4",
        "--optimizer.lr=1e-12",
        "--optimizer.warmup_steps=0",
        "--run_dir=ft",
        cwd=trained,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "initialised from the Hugging Face checkpoint" in proc.stdout
    saved = json.loads((trained / "ft" / "config.json").read_text())["model"]
    assert saved["init_from"] == str(out) and saved["num_layers"] == 2
    _, before, _ = load_masters(trained / "llama-tiny")
    _, after, _ = load_masters(trained / "ft")
    for x, y in zip(jax.tree.leaves(before), jax.tree.leaves(after)):
        np.testing.assert_allclose(y, x, rtol=0, atol=1e-6)  # one step at lr 1e-12 moves nothing visible


def test_export_errors(trained, tmp_path):
    proc = run("jaxzero.export", f"--run_dir={tmp_path}", f"--out={tmp_path / 'x'}", cwd=trained)
    assert proc.returncode == 2 and "holds no checkpoint" in proc.stderr
    proc = run("jaxzero.export", "--run_dir=llama-tiny", f"--out={tmp_path / 'y'}", "--step=3", cwd=trained)
    assert proc.returncode == 2 and "has no checkpoint 3 to read; it has checkpoints [6]" in proc.stderr
