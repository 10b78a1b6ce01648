"""The Orbax export is a complete artifact: `model.json` beside the parameters, read by
`jaxzero.from_export` (Orbax and Hugging Face exports alike) and by `--model.name=orbax:DIR`, and the
parameters readable by plain Orbax (V0's restore, the V1 API's load) without jaxzero."""

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from subprocess_run import REPO, run_module, user_env

import jaxzero
from jaxzero.config import ConfigError, ModelConfig
from jaxzero.finetune import provenance
from jaxzero.interop import export_hf, from_export, load_by_unit
from jaxzero.models import build_model, forward
from jaxzero.overrides import parse_args
from jaxzero.storage import checkpoint_masters, export_dir, orbax_export
from jaxzero.storage.checkpoint_masters import export_orbax

MODEL = ModelConfig(num_layers=2, compute_dtype="float32", attention_impl="xla")
TOKENS = np.random.default_rng(0).integers(0, MODEL.vocab_size, (2, 12), dtype=np.int32)


@pytest.fixture(scope="module")
def params():
    return jax.tree.map(np.asarray, build_model(MODEL).init(jax.random.key(3)))


@pytest.fixture(scope="module")
def exported(params, tmp_path_factory):
    """An Orbax export of `params`, float32 and bfloat16, at export/x-orbax and export/x-bf16."""
    root = tmp_path_factory.mktemp("orbax")
    export_orbax(params, MODEL, root / "export" / "x-orbax", "float32")
    export_orbax(params, MODEL, root / "export" / "x-bf16", "bfloat16")
    return root


def test_the_export_writes_its_model_beside_the_parameters(exported):
    out = exported / "export" / "x-bf16"
    record = json.loads((out / "model.json").read_text())
    assert record["format"] == "jaxzero-orbax-export" and record["format_version"] == 1
    assert record["dtype"] == "bfloat16"
    assert record["model"] == {k: v for k, v in MODEL.__dict__.items() if k != "init_from"}
    marker = json.loads((out / export_dir.MARKER).read_text())
    assert "model.json" in marker["files"] and marker["finished"]  # the export's own, replaced with it
    assert not (out / ".orbax-export").exists()
    assert provenance.ORBAX_MODEL_FILE == orbax_export.MODEL_FILE
    cfg, dtype = orbax_export.read_model(out)
    assert dtype == "bfloat16" and cfg == ModelConfig(**{**record["model"], "name": f"orbax:{out}"})


def test_from_export_returns_the_model_and_its_parameters(exported, params):
    model, got = jaxzero.from_export(exported / "export" / "x-orbax")
    assert model.config.compute_dtype == "float32" and model.config.num_layers == 2
    assert {x.dtype for x in jax.tree.leaves(got)} == {np.dtype(np.float32)}
    for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(params), strict=True):
        np.testing.assert_array_equal(x, y)
    _, narrow = from_export(exported / "export" / "x-bf16")  # stored bfloat16, returned float32
    for x, y in zip(jax.tree.leaves(narrow), jax.tree.leaves(params), strict=True):
        np.testing.assert_array_equal(x, y.astype(jax.numpy.bfloat16).astype(np.float32))


def test_an_export_is_read_one_unit_at_a_time_and_checked_first(exported, params):
    out = exported / "export" / "x-orbax"
    lazy = load_by_unit(MODEL, out)
    assert all(type(u).__name__ == "Deferred" for u in lazy.units())
    np.testing.assert_array_equal(
        lazy.blocks[1].load()["mlp"]["up_proj"]["kernel"], params.blocks[1]["mlp"]["up_proj"]["kernel"]
    )
    with pytest.raises(ConfigError, match=r"model.num_layers: run config has 3, export has 2"):
        load_by_unit(ModelConfig(num_layers=3, compute_dtype="float32"), out)
    # the run's own choices may differ
    load_by_unit(ModelConfig(num_layers=2, compute_dtype="bfloat16", max_seq_len=64), out)


def test_orbax_names_the_export_as_hf_names_a_checkpoint(exported):
    out = exported / "export" / "x-orbax"
    cfg = parse_args([f"--model.name=orbax:{out}", "--model.num_kv_heads=2"])
    assert cfg.model.init_from == str(out) and cfg.model.name == f"orbax:{out}"
    assert cfg.model.num_layers == 2
    assert cfg.model.compute_dtype == ModelConfig().compute_dtype  # a run's choice, as for hf:DIR


def test_orbax_of_what_is_no_export_is_refused_in_one_line(exported, tmp_path):
    hf = tmp_path / "hf"
    export_hf(from_export(exported / "export" / "x-orbax")[1], MODEL, hf, dtype="float32")
    (tmp_path / "empty").mkdir()
    for where, hint in [(tmp_path / "empty", ""), (hf, f"use model.name=hf:{hf}"), (tmp_path / "none", "")]:
        with pytest.raises(ConfigError) as e:
            parse_args([f"--model.name=orbax:{where}"])
        assert "\n" not in str(e.value) and hint in str(e.value)
    proc = run_module(
        "jaxzero.train", f"--model.name=orbax:{tmp_path / 'empty'}", "--run_dir=ft", "--steps=1", cwd=tmp_path
    )
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert "holds no model.json, so it is not an Orbax export" in lines[0]
    assert not (tmp_path / "ft").exists()  # before any work
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "model.json").write_text(json.dumps({"format": "jaxzero-orbax-export", "format_version": 9}))
    with pytest.raises(ConfigError, match="version 9; this jaxzero reads"):
        parse_args([f"--model.name=orbax:{bad}"])


# Plain Orbax, in a process that cannot import jaxzero: V0's restore and the V1 API's load.
PLAIN = """
import sys
sys.modules["jaxzero"] = None  # jaxzero is not importable here, whatever the environment installs
try:
    import jaxzero
    raise SystemExit("jaxzero imported")
except ImportError:
    pass
import json
import numpy as np
import orbax.checkpoint as ocp
import orbax.checkpoint.experimental.v1 as v1
out, path = sys.argv[1], sys.argv[2]
trees = {
    "v0": ocp.PyTreeCheckpointer().restore(path),
    "standard": ocp.StandardCheckpointer().restore(path),
    "v1": v1.load(path),
}
for name, tree in trees.items():
    flat, dtypes = {}, {}
    def walk(prefix, node):
        if isinstance(node, dict):
            for k, v in node.items():
                walk(prefix + "/" + k, v)
        elif isinstance(node, list):
            for i, v in enumerate(node):
                walk(prefix + "/" + str(i), v)
        else:
            flat[prefix] = np.asarray(node).astype(np.float32)
            dtypes[prefix] = str(np.asarray(node).dtype)
    walk("", tree)
    np.savez(f"{out}/{name}.npz", **flat)
    with open(f"{out}/{name}.json", "w") as f:
        json.dump(dtypes, f)
print(json.dumps(sorted(trees)))
"""


def test_plain_orbax_reads_the_export_without_jaxzero(exported, params, tmp_path):
    env = {k: v for k, v in user_env().items() if k != "PYTHONPATH"}  # the repository not on the path
    proc = subprocess.run(
        [sys.executable, "-c", PLAIN, str(tmp_path), str(exported / "export" / "x-bf16")],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    want = {
        "/" + "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path): np.asarray(x)
        for path, x in jax.tree_util.tree_flatten_with_path(
            {"embed": params.embed, "blocks": list(params.blocks), "head": params.head}
        )[0]
    }
    for name in ("v0", "standard", "v1"):
        got = np.load(tmp_path / f"{name}.npz")
        dtypes = json.loads((tmp_path / f"{name}.json").read_text())
        assert sorted(got.files) == sorted(want) and set(dtypes.values()) == {"bfloat16"}, name
        for k, x in want.items():
            bf16 = x.astype(jax.numpy.bfloat16).astype(np.float32)
            np.testing.assert_array_equal(got[k], bf16, err_msg=f"{name} {k}")


def doc_lines() -> str:
    """The code block of docs/models.md that loads an export and runs it."""
    text = (REPO / "docs" / "models.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    block = next(b for b in blocks if "from_export(" in b)
    assert len(block.strip().splitlines()) == 5
    return block


def test_the_five_lines_in_the_docs_load_and_run_an_export(exported, params):
    code = doc_lines() + "np.save('logits.npy', np.asarray(logits))\n"
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=exported,
        env=user_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    logits = np.load(exported / "logits.npy")
    want = forward(build_model(MODEL), params, np.array([[1, 2, 3]], np.int32))
    assert logits.shape == (1, 3, MODEL.vocab_size) and logits.dtype == np.float32
    np.testing.assert_allclose(logits, want, rtol=1e-5, atol=1e-5)


# A tiny Llama trained through the CLI, exported both ways as float32.
RUN = ["--steps=4", "--data.seq_len=32", "--data.batch_size=4", "--model.num_layers=2"]
FLOAT32 = ["--model.compute_dtype=float32", "--model.attention_impl=xla"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    cwd = tmp_path_factory.mktemp("trained")
    proc = run_module("jaxzero.train", *RUN, *FLOAT32, "--run_dir=run", cwd=cwd)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for fmt in ("hf", "orbax"):
        args = [f"--format={fmt}", "--dtype=float32"]
        proc = run_module("jaxzero.export", "--run_dir=run", f"--out={fmt}", *args, cwd=cwd)
        assert proc.returncode == 0, proc.stderr[-3000:]
    return cwd


@pytest.mark.slow
def test_the_orbax_exports_logits_equal_the_hf_exports_in_transformers(trained):
    import torch
    import transformers

    model, params = from_export(trained / "orbax")
    assert model.config.compute_dtype == "float32"
    with jax.default_matmul_precision("highest"):
        ours = np.asarray(forward(model, params, TOKENS))
    hf = transformers.AutoModelForCausalLM.from_pretrained(trained / "hf", dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = hf(torch.from_numpy(TOKENS.astype(np.int64))).logits.numpy()
    assert np.linalg.norm(ours - theirs) / np.linalg.norm(theirs) < 1e-4
    # from_export reads the HF export too: the same weights, the same logits
    hf_model, hf_params = from_export(trained / "hf", compute_dtype="float32")
    for x, y in zip(jax.tree.leaves(hf_params), jax.tree.leaves(params), strict=True):
        np.testing.assert_array_equal(x, y)
    with jax.default_matmul_precision("highest"):
        np.testing.assert_allclose(
            np.asarray(forward(hf_model, hf_params, TOKENS)), ours, rtol=1e-5, atol=1e-5
        )


@pytest.mark.slow
def test_a_finetune_from_the_orbax_export_starts_at_the_hf_exports_loss(trained):
    first = {}
    for fmt in ("hf", "orbax"):
        args = [*RUN[1:], *FLOAT32, "--steps=1", "--logging.log_every=1", f"--run_dir=ft-{fmt}"]
        proc = run_module("jaxzero.train", f"--model.name={fmt}:{trained / fmt}", *args, cwd=trained)
        assert proc.returncode == 0, proc.stderr[-3000:]
        what = {"hf": "Hugging Face checkpoint", "orbax": "Orbax export"}[fmt]
        assert f"initialised from the {what} {trained / fmt}" in proc.stdout
        saved = json.loads((trained / f"ft-{fmt}" / "config.json").read_text())["model"]
        assert saved["init_from"] == str(trained / fmt) and saved["num_layers"] == 2
        records = [
            json.loads(line) for line in (trained / f"ft-{fmt}" / "metrics.jsonl").read_text().splitlines()
        ]
        first[fmt] = next(r["loss"] for r in records if r.get("step") == 1)
    np.testing.assert_allclose(first["orbax"], first["hf"], rtol=1e-6, atol=0)


def test_a_frozen_base_from_an_orbax_export_is_fingerprinted_by_its_files(exported, tmp_path):
    """A LoRA run over `orbax:DIR` records its base's fingerprint; a changed array file changes it."""
    out = tmp_path / "base"
    shutil.copytree(exported / "export" / "x-orbax", out)
    before = provenance.fingerprint(out)
    (out / export_dir.MARKER).write_text((out / export_dir.MARKER).read_text())  # not a weight file
    assert provenance.fingerprint(out) == before
    data = max((p for p in (out / "d").iterdir() if p.is_file()), key=lambda p: p.stat().st_size)
    data.write_bytes(data.read_bytes()[:-1] + bytes([data.read_bytes()[-1] ^ 1]))
    assert provenance.fingerprint(out) != before


def test_a_gpt2_export_reads_back_as_written(tmp_path):
    cfg = ModelConfig.named("gpt2-tiny", num_layers=1, max_seq_len=64)
    written = jax.tree.map(np.asarray, build_model(cfg).init(jax.random.key(1)))
    export_orbax(written, cfg, tmp_path / "gpt2", "float32")
    model, got = from_export(tmp_path / "gpt2")
    assert model.config.family == "gpt2" and model.config.max_seq_len == 64
    for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(written), strict=True):
        np.testing.assert_array_equal(x, y)
    with pytest.raises(ConfigError, match="model.max_seq_len: run config has 128, export has 64"):
        load_by_unit(ModelConfig.named("gpt2-tiny", num_layers=1, max_seq_len=128), tmp_path / "gpt2")


def test_an_unfinished_or_earlier_orbax_export_is_refused_saying_what_to_do(exported, tmp_path):
    out = tmp_path / "killed"
    shutil.copytree(exported / "export" / "x-orbax", out)
    record = json.loads((out / export_dir.MARKER).read_text())
    (out / export_dir.MARKER).write_text(json.dumps({**record, "finished": None}))
    with pytest.raises(ConfigError, match="did not finish .* run the export again"):
        parse_args([f"--model.name=orbax:{out}"])
    (out / export_dir.MARKER).write_text(json.dumps(record))
    (out / "model.json").unlink()  # what an export of an earlier jaxzero holds
    with pytest.raises(ConfigError, match="an Orbax checkpoint without one .*: export it again"):
        from_export(out)


def test_model_json_moves_into_place_after_the_parameters(params, tmp_path, monkeypatch):
    """An export killed while its files move up leaves no model.json over missing parameters."""
    moved: list[str] = []
    replace = checkpoint_masters.os.replace
    monkeypatch.setattr(
        checkpoint_masters.os, "replace", lambda a, b: (moved.append(Path(b).name), replace(a, b))
    )
    export_orbax(params, MODEL, tmp_path / "out", "float32")
    entries = [m for m in moved if not m.startswith(".jaxzero-export")]
    assert entries[-1] == "model.json" and len(entries) > 1


def test_the_planner_reads_an_orbax_export_as_train_does(exported, tmp_path, capsys):
    from jaxzero.cli.plan import main as plan_main  # a program: its messages on stderr

    out = exported / "export" / "x-orbax"
    assert plan_main([f"--model.name=orbax:{out}", "--data.seq_len=32", "--data.batch_size=4"]) == 0
    assert capsys.readouterr().out.startswith(f"plan for orbax:{out}: ")
    assert plan_main([f"--model.name=orbax:{tmp_path}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "holds no model.json, so it is not an Orbax export" in err[0]
