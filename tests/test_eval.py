"""`python -m jaxzero.eval`: every target once, the loss of the trainer's validation path equal to the
model's loss computed directly, the same in every placement, the last line one JSON object."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_offload import TOLERANCE

from jaxzero.cli import eval as eval_lib
from jaxzero.cli import train as train_lib  # the programs: imported by their tests only
from jaxzero.data import write_tokens
from jaxzero.models import build_model
from jaxzero.numerics.objective import decode_window
from jaxzero.storage.checkpoint_masters import load_masters

SEQ = 16


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny model (float32 compute: the comparisons below are to float32's tolerance) trained 3 steps
    on token files, its run directory, and a val split of 203 tokens whose every fourth target the
    loss does not count."""
    root = tmp_path_factory.mktemp("eval")
    data = root / "tokens"
    data.mkdir()
    rng = np.random.default_rng(0)
    write_tokens(data / "train.bin", rng.integers(0, 256, 4000), "uint16")
    write_tokens(data / "val.bin", rng.integers(0, 256, 203), "uint16")
    (data / "train.mask.bin").write_bytes(np.ones(4000, np.uint8).tobytes())
    (data / "val.mask.bin").write_bytes((np.arange(203) % 4 != 0).astype(np.uint8).tobytes())
    run = root / "run"
    args = ["--data.source=tokens", f"--data.path={data}", f"--data.seq_len={SEQ}", "--data.batch_size=4",
            "--model.compute_dtype=float32"]  # fmt: skip
    code = train_lib.main(
        [*args, f"--run_dir={run}", "--steps=3", "--logging.samples=0", "--logging.tensorboard=false"]
    )
    assert code == 0
    return run, data


def direct_loss(run, data) -> tuple[float, int]:
    """The mean loss over val.bin's counted targets, from the checkpoint's masters and the model's own
    functions, each window of SEQ + 1 tokens (starting every SEQ tokens) alone: no batching, no trainer."""
    cfg, params, _ = load_masters(run)
    model = build_model(cfg.model)
    tokens = np.fromfile(data / "val.bin", np.uint16).astype(np.int32)
    counted = np.fromfile(data / "val.mask.bin", np.uint8)
    marked = np.where(counted > 0, tokens, ~tokens)
    total, count = 0.0, 0
    for start in range(0, len(tokens) - 1, SEQ):
        inputs, targets, mask = decode_window(jnp.asarray(marked[start : start + SEQ + 1][None]))
        x = model.embed(params.embed, inputs)
        for block in params.blocks:
            x = model.block(block, x)
        logits = model.head(params.head, params.embed, x).astype(jnp.float32)
        ce = -jnp.take_along_axis(jax.nn.log_softmax(logits), targets[..., None], -1)[..., 0]
        total, count = total + float(jnp.sum(ce * mask)), count + int(jnp.sum(mask))
    return total / count, count


def test_windows_hold_every_target_once():
    tokens = np.arange(1, 42)
    counted = (np.arange(41) % 3 != 0).astype(np.uint8)
    batches = list(eval_lib.eval_windows(tokens, counted, seq_len=8, rows=4, pad=0))
    assert all(b.shape == (4, 9) and b.dtype == np.int32 for b in batches)
    targets = np.concatenate([b[:, 1:].ravel() for b in batches])
    kept = targets[targets != ~0]  # padding
    ids = np.where(kept < 0, ~kept, kept)
    assert ids.tolist() == tokens[1:].tolist()  # each target once, in order
    assert int(np.sum(kept >= 0)) == int(np.sum(counted[1:]))


def test_eval_equals_the_models_loss_in_every_placement(trained, capsys):
    run, data = trained
    expected, targets = direct_loss(run, data)
    assert targets == int(np.sum(np.arange(1, 203) % 4 != 0))
    results = []
    for placement in ([], ["--offload.params=cpu", "--offload.optimizer=cpu"]):
        assert eval_lib.main([f"--run_dir={run}", f"--data.path={data}", *placement]) == 0
        last = capsys.readouterr().out.strip().splitlines()[-1]
        results.append(json.loads(last))
    rtol, atol = TOLERANCE["float32"]
    for r in results:
        assert r["tokens"] == targets and r["split"] == "val"
        assert abs(r["loss"] - expected) <= atol + rtol * expected
        assert abs(r["perplexity"] - np.exp(r["loss"])) < 1e-6 * r["perplexity"]
    # the batch's rows change nothing: each target once, whatever the batching
    assert eval_lib.main([f"--run_dir={run}", f"--data.path={data}", "--data.batch_size=8"]) == 0
    assert (
        abs(json.loads(capsys.readouterr().out.strip().splitlines()[-1])["loss"] - expected)
        <= atol + rtol * expected
    )


def test_eval_refuses_in_one_line(trained, tmp_path, capsys):
    run, data = trained
    assert eval_lib.main([f"--run_dir={run}", f"--data.path={tmp_path}"]) == 2
    assert "holds no train.bin" in capsys.readouterr().err
    assert eval_lib.main([f"--run_dir={tmp_path}", f"--data.path={data}"]) == 2
    assert "holds no checkpoint to evaluate" in capsys.readouterr().err
    assert eval_lib.main([f"--run_dir={run}", f"--data.path={data}", "--step=99"]) == 2
    assert "has no checkpoint 99" in capsys.readouterr().err
    # Another model than the checkpoint's: refused before any work (its weights would not fit it).
    for other in ("--model.hidden_size=64", "--model.num_layers=1", "--model.vocab_size=512"):
        assert eval_lib.main([f"--run_dir={run}", f"--data.path={data}", other]) == 2
        err = capsys.readouterr().err
        assert "is evaluated as the model it trained: it cannot change model." in err, err


def test_eval_of_the_exported_hugging_face_checkpoint_equals_the_runs(trained, tmp_path, capsys):
    from jaxzero.cli import export as export_lib  # the program: imported by its test only

    run, data = trained
    out = tmp_path / "hf"
    for size in ("0", "nan", "inf"):  # no shard size: refused before anything is read or written
        assert export_lib.main([f"--run_dir={run}", f"--out={out}", f"--max_shard_gb={size}"]) == 2
        assert "is no file size" in capsys.readouterr().err and not out.exists()
    assert export_lib.main([f"--run_dir={run}", f"--out={out}", "--dtype=float32"]) == 0
    capsys.readouterr()
    assert (
        eval_lib.main(
            [f"--hf={out}", f"--data.path={data}", f"--data.seq_len={SEQ}", "--model.compute_dtype=float32"]
        )
        == 0
    )
    from_hf = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    expected, targets = direct_loss(run, data)
    rtol, atol = TOLERANCE["float32"]
    assert from_hf["tokens"] == targets and abs(from_hf["loss"] - expected) <= atol + rtol * expected


def test_fine_tuning_examples_packed_or_one_per_row_evaluate_alike(tmp_path, capsys):
    """With attention inside each example, packing examples into rows changes nothing of their loss:
    the eval of a fine-tuning set packed best fit equals one example per row, every target once."""
    from jaxzero.cli import prepare as prepare_lib  # the program: imported by its test only

    rng = np.random.default_rng(1)
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta"]

    def text(low: int, high: int) -> str:
        return " ".join(rng.choice(words, rng.integers(low, high)))

    records = [{"prompt": text(2, 9), "completion": text(1, 6)} for _ in range(120)]
    jsonl = tmp_path / "sft.jsonl"
    jsonl.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    data = tmp_path / "sft"
    assert prepare_lib.main([f"--input={jsonl}", f"--out={data}", "--sft", "--val_docs=40"]) == 0
    assert (data / "val.idx.bin").is_file()
    run = tmp_path / "run"
    train = ["--data.source=tokens", f"--data.path={data}", "--data.seq_len=64", "--data.batch_size=4",
             "--model.compute_dtype=float32", f"--run_dir={run}", "--steps=2", "--logging.samples=0",
             "--logging.tensorboard=false"]  # fmt: skip
    assert train_lib.main(train) == 0
    capsys.readouterr()
    results = []
    for pack in ("true", "false"):
        assert eval_lib.main([f"--run_dir={run}", f"--data.path={data}", f"--data.pack={pack}"]) == 0
        results.append(json.loads(capsys.readouterr().out.strip().splitlines()[-1]))
    packed, alone = results
    rtol, atol = TOLERANCE["float32"]
    assert packed["tokens"] == alone["tokens"] > 0
    assert abs(packed["loss"] - alone["loss"]) <= atol + rtol * alone["loss"]


def test_ctrl_c_is_one_line_and_exit_130(tmp_path, capsys, monkeypatch):
    """Ctrl-C during an evaluation: one line, exit 130 (it printed a raw KeyboardInterrupt traceback)."""

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(eval_lib, "_config", interrupted)  # reading the weights, say
    assert eval_lib.main([f"--hf={tmp_path}"]) == 130
    err = capsys.readouterr().err
    assert err.strip() == "jaxzero: eval: interrupted (Ctrl-C); nothing was written.", err
