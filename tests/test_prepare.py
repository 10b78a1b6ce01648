"""`python -m jaxzero.prepare`: text, JSONL and Parquet into token files, with the byte-level or a
Hugging Face tokenizer; reruns, refusals and errors naming the file and line."""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from subprocess_run import user_env

from jaxzero.cli.prepare import main, prepare
from jaxzero.config import DataConfig
from jaxzero.data import DataError, build_data, load_token_files

DOCS = ["def f(x):\n    return x\n", "héllo wörld", "", "the end\n"]


def write_inputs(root: Path) -> list[str]:
    """DOCS as a text file (DOCS[0]) and a JSONL file (the rest, with a blank line between)."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "a.txt").write_text(DOCS[0])
    lines = [json.dumps({"text": d, "id": i}) for i, d in enumerate(DOCS[1:])]
    (root / "b.jsonl").write_text(lines[0] + "\n\n" + "\n".join(lines[1:]) + "\n")
    return [str(root / "a.txt"), str(root / "*.jsonl")]


def test_byte_level_tokens_are_the_utf8_bytes_with_nul_between_documents(tmp_path):
    inputs = write_inputs(tmp_path / "in")
    meta = prepare(inputs, tmp_path / "out", val_docs=1, workers=1, progress=False)
    want_val = np.frombuffer(DOCS[0].encode() + b"\0", np.uint8)
    want_train = np.frombuffer(b"".join(d.encode() + b"\0" for d in DOCS[1:]), np.uint8)
    np.testing.assert_array_equal(np.fromfile(tmp_path / "out" / "val.bin", np.uint16), want_val)
    np.testing.assert_array_equal(np.fromfile(tmp_path / "out" / "train.bin", np.uint16), want_train)
    assert meta["token_dtype"] == "uint16" and meta["vocab_size"] == 256
    assert meta["train"] == {"documents": 3, "tokens": want_train.size, "loss_tokens": want_train.size}
    assert json.loads((tmp_path / "out" / "prepare.json").read_text()) == meta
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["prepare.json", "train.bin", "val.bin"]
    # and training reads it
    splits = load_token_files(
        tmp_path / "out", token_dtype="uint16", seq_len=4, val_fraction=0.0, vocab_size=256
    )
    assert splits.train.size == want_train.size and splits.val.size == want_val.size


def hf_tokenizer(root: Path, eos: str | dict | None = "<eot>") -> Path:
    """A small word-level tokenizer.json built with the tokenizers library, saved as a checkpoint
    directory would hold it (with tokenizer_config.json naming eos_token)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.WordLevelTrainer(special_tokens=["<unk>", "<eot>"])
    tok.train_from_iterator(DOCS * 3, trainer)
    root.mkdir(parents=True, exist_ok=True)
    tok.save(str(root / "tokenizer.json"))
    if eos is not None:
        (root / "tokenizer_config.json").write_text(json.dumps({"eos_token": eos}))
    return root


@pytest.mark.parametrize("workers", [1, 3])
def test_hf_tokenizer_ids_per_document_then_eos(tmp_path, workers):
    from tokenizers import Tokenizer

    inputs = write_inputs(tmp_path / "in")
    ckpt = hf_tokenizer(tmp_path / "ckpt")
    meta = prepare(inputs, tmp_path / "out", tokenizer=str(ckpt), workers=workers, progress=False)
    tok = Tokenizer.from_file(str(ckpt / "tokenizer.json"))
    eot = tok.token_to_id("<eot>")
    want = [i for d in DOCS for i in [*tok.encode(d, add_special_tokens=False).ids, eot]]
    np.testing.assert_array_equal(np.fromfile(tmp_path / "out" / "train.bin", np.uint16), want)
    assert meta["recipe"]["eot_id"] == eot and meta["vocab_size"] == tok.get_vocab_size()
    assert not (tmp_path / "out" / "val.bin").exists()


def test_eot_id_from_the_config_dict_or_the_flag_or_an_error(tmp_path):
    inputs = write_inputs(tmp_path / "in")
    dict_eos = hf_tokenizer(tmp_path / "a", eos={"content": "<eot>", "special": True})
    assert (
        prepare(inputs, tmp_path / "o1", tokenizer=str(dict_eos), workers=1, progress=False)["recipe"][
            "eot_id"
        ]
        == 1
    )
    none = hf_tokenizer(tmp_path / "b", eos=None)
    with pytest.raises(DataError, match=r"no end-of-text id .*Pass --eot_id=N"):
        prepare(inputs, tmp_path / "o2", tokenizer=str(none), workers=1, progress=False)
    assert not (tmp_path / "o2").exists()  # refused before anything was written
    meta = prepare(inputs, tmp_path / "o3", tokenizer=str(none / "tokenizer.json"), eot_id=0, progress=False)
    assert meta["recipe"]["eot_id"] == 0
    with pytest.raises(DataError, match=r"--eot_id=999 is outside the tokenizer's vocabulary"):
        prepare(inputs, tmp_path / "o4", tokenizer=str(none), eot_id=999, progress=False)
    with pytest.raises(DataError, match=r"no tokenizer file at .*nowhere"):
        prepare(inputs, tmp_path / "o5", tokenizer=str(tmp_path / "nowhere"), progress=False)


def test_parquet_column(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"body": DOCS, "n": list(range(len(DOCS)))}), tmp_path / "d.parquet")
    prepare([str(tmp_path / "d.parquet")], tmp_path / "out", text_field="body", workers=1, progress=False)
    want = np.frombuffer(b"".join(d.encode() + b"\0" for d in DOCS), np.uint8)
    np.testing.assert_array_equal(np.fromfile(tmp_path / "out" / "train.bin", np.uint16), want)
    with pytest.raises(DataError, match=r"d\.parquet: no column 'text' \(it has \['body', 'n'\]\)"):
        prepare([str(tmp_path / "d.parquet")], tmp_path / "out2", progress=False)


def test_bad_inputs_name_the_file_and_line(tmp_path):
    (tmp_path / "ok.jsonl").write_text('{"text": "a"}\n')
    (tmp_path / "field.jsonl").write_text('{"text": "a"}\n{"body": "b"}\n')
    (tmp_path / "json.jsonl").write_text('{"text": "a"}\n{"text": \n')
    (tmp_path / "bytes.txt").write_bytes(b"ok\xff")
    cases = [
        (
            "field.jsonl",
            r"field\.jsonl:2: no text field 'text' \(a string\) in this record \(it has \['body'\]\)",
        ),
        ("json.jsonl", r"json\.jsonl:2: not a JSON object"),
        ("bytes.txt", r"bytes\.txt: not UTF-8 text \(byte 2"),
        ("missing*.txt", r"--input='.*missing\*\.txt' matches no file"),
    ]
    for name, match in cases:
        with pytest.raises(DataError, match=match):
            prepare(
                [str(tmp_path / "ok.jsonl"), str(tmp_path / name)],
                tmp_path / "out",
                workers=1,
                progress=False,
            )
        assert (
            not any(p.suffix == ".bin" for p in (tmp_path / "out").glob("*"))
            if (tmp_path / "out").exists()
            else True
        )
    # empty inputs: nothing to train on (an empty file, a blank record)
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "blank.jsonl").write_text('{"text": ""}\n')
    with pytest.raises(DataError, match=r"the inputs hold no text: 2 document\(s\), every one empty"):
        prepare(
            [str(tmp_path / "empty.txt"), str(tmp_path / "blank.jsonl")], tmp_path / "none", progress=False
        )
    assert not (tmp_path / "none").exists()
    # no partial files left behind either
    assert not [p for p in tmp_path.rglob("*.partial")]
    if os.getuid() != 0:  # root reads anything
        locked = tmp_path / "locked.txt"
        locked.write_text("x")
        locked.chmod(0)
        with pytest.raises(DataError, match=r"locked\.txt: cannot be read"):
            prepare([str(locked)], tmp_path / "out", progress=False)


def test_reruns_are_idempotent_and_never_replace_what_they_did_not_write(tmp_path, capsys):
    inputs = write_inputs(tmp_path / "in")
    out = tmp_path / "out"
    prepare(inputs, out, workers=1, progress=False)
    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    assert main([f"--input={i}" for i in inputs] + [f"--out={out}", "--workers=1"]) == 0
    assert "up to date" in capsys.readouterr().err
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == before
    # a changed input: refused without --overwrite, redone with it
    (tmp_path / "in" / "a.txt").write_text("changed\n")
    assert main([f"--input={i}" for i in inputs] + [f"--out={out}"]) == 2
    assert "pass --overwrite" in capsys.readouterr().err
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == before
    meta = prepare(inputs, out, overwrite=True, workers=1, progress=False)
    assert meta["train"]["tokens"] == len(b"changed\n") + 1 + sum(len(d.encode()) + 1 for d in DOCS[1:])
    # token files someone else wrote are never replaced, --overwrite or not
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "train.bin").write_bytes(b"\1\0")
    with pytest.raises(
        DataError, match=r"without a prepare\.json: token files jaxzero\.prepare did not write"
    ):
        prepare(inputs, theirs, overwrite=True, progress=False)
    assert (theirs / "train.bin").read_bytes() == b"\1\0"


def test_out_is_new_empty_or_an_earlier_preparation(tmp_path, capsys):
    """prepare writes into a directory only where it is new, empty or its own earlier output, as an
    export: into a run directory it made the run unresumable ('not made by jaxzero: prepare.json,
    train.bin'). A killed preparation's unfinished files are no obstacle: they are removed."""
    inputs = write_inputs(tmp_path / "in")
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text("{}")
    (run / "metrics.jsonl").write_text("")
    before = {p.name: p.read_bytes() for p in run.iterdir()}
    assert main([f"--input={i}" for i in inputs] + [f"--out={run}", "--overwrite"]) == 2
    err = capsys.readouterr().err
    assert "is not empty and is not a jaxzero.prepare output (it holds config.json, metrics.jsonl" in err
    assert {p.name: p.read_bytes() for p in run.iterdir()} == before
    killed = tmp_path / "killed"
    killed.mkdir()
    (killed / ".train.bin.999999999.partial").write_bytes(b"half")  # no such process
    prepare(inputs, killed, workers=1, progress=False)
    assert sorted(p.name for p in killed.iterdir()) == ["prepare.json", "train.bin"]
    (tmp_path / "empty").mkdir()
    prepare(inputs, tmp_path / "empty", workers=1, progress=False)
    (killed / "README.md").write_text("mine")  # beside an earlier preparation: kept, and no obstacle
    prepare(inputs, killed, workers=1, progress=False, overwrite=True)
    assert (killed / "README.md").read_text() == "mine"


def test_prepared_bytes_train_the_builtin_sized_model(tmp_path):
    """The printed command's settings read the files: windows of the prepared tokens, in range."""
    inputs = write_inputs(tmp_path / "in")
    (tmp_path / "in" / "c.txt").write_text(DOCS[0] * 20)
    meta = prepare(
        [*inputs, *inputs, str(tmp_path / "in" / "c.txt")], tmp_path / "out", val_docs=2, progress=False
    )
    assert (
        meta["train"]["documents"] + meta["val"]["documents"] == len(DOCS) + 1
    )  # a repeated file is read once
    data = build_data(
        DataConfig(source="tokens", path=str(tmp_path / "out"), seq_len=8, batch_size=2),
        vocab_size=256,
        seed=0,
    )
    batch = next(data.train_iter())
    assert batch.shape == (1, 2, 9) and batch.max() < 256


# -------------------------------------------------------------------------------------------------
# Fine-tuning examples with loss masks
# -------------------------------------------------------------------------------------------------

# A ChatML-style template, as Qwen2.5's: each turn "<|im_start|>role\ncontent<|im_end|>\n".
CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>' + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
CHAT = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "hi there"},
    {"role": "assistant", "content": "hello"},
    {"role": "user", "content": "bye"},
    {"role": "assistant", "content": "see you"},
]


def test_prompt_completion_marks_the_completion_and_its_end(tmp_path):
    records = [{"prompt": "Q: 2+2?", "completion": " 4"}, {"prompt": "", "completion": "é"}]
    (tmp_path / "ft.jsonl").write_text("\n".join(json.dumps(r) for r in records))
    meta = prepare([str(tmp_path / "ft.jsonl")], tmp_path / "out", sft=True, workers=1, progress=False)
    ids = np.fromfile(tmp_path / "out" / "train.bin", np.uint16)
    marks = np.fromfile(tmp_path / "out" / "train.mask.bin", np.uint8)
    want_ids, want_marks = [], []
    for r in records:
        p, c = r["prompt"].encode(), r["completion"].encode()
        want_ids += [*p, *c, 0]
        want_marks += [0] * len(p) + [1] * (len(c) + 1)
    np.testing.assert_array_equal(ids, want_ids)
    np.testing.assert_array_equal(marks, want_marks)
    assert meta["train"] == {"documents": 2, "tokens": len(want_ids), "loss_tokens": sum(want_marks)}
    # training reads the marks with the tokens: unmarked tokens come as ~id
    splits = load_token_files(
        tmp_path / "out", token_dtype="uint16", seq_len=4, val_fraction=0.0, vocab_size=256
    )
    np.testing.assert_array_equal(splits.train_counted, want_marks)


def test_the_example_index_says_where_each_example_starts(tmp_path, capsys):
    """`train.idx.bin` and `val.idx.bin`: uint64 offsets of each example's first token; the token and
    mask files are as before. A preparation made before the index is made again, not left as it was."""
    records = [{"prompt": "Q" * (i + 1), "completion": "A" * (2 * i + 1)} for i in range(7)]
    (tmp_path / "ft.jsonl").write_text("\n".join(json.dumps(r) for r in records))
    args = ([str(tmp_path / "ft.jsonl")], tmp_path / "out")
    meta = prepare(*args, sft=True, val_docs=2, workers=1, progress=False)
    sizes = [3 * i + 3 for i in range(7)]  # prompt, completion, end-of-text
    for split, part in (("val", sizes[:2]), ("train", sizes[2:])):
        starts = np.fromfile(tmp_path / "out" / f"{split}.idx.bin", np.uint64)
        np.testing.assert_array_equal(starts, np.cumsum([0, *part[:-1]]))
        assert meta[split]["documents"] == len(starts)
        ids = np.fromfile(tmp_path / "out" / f"{split}.bin", np.uint16)
        assert ids.size == sum(part) and (ids[starts[1:].astype(np.int64) - 1] == 0).all()  # eot before each
    before = {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()}
    for split in ("train", "val"):
        (tmp_path / "out" / f"{split}.idx.bin").unlink()
    prepare(*args, sft=True, val_docs=2, workers=1, progress=False)  # no --overwrite needed
    assert {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()} == before
    prepare(*args, sft=True, val_docs=2, workers=1)
    assert "up to date" in capsys.readouterr().err


def test_chat_messages_render_as_transformers_does_and_mark_the_assistant_turns(tmp_path):
    transformers = pytest.importorskip("transformers")
    ckpt = hf_tokenizer(tmp_path / "ckpt")
    config = json.loads((ckpt / "tokenizer_config.json").read_text())
    (ckpt / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": CHATML}))
    (tmp_path / "chat.jsonl").write_text(json.dumps({"messages": CHAT}) + "\n")
    prepare([str(tmp_path / "chat.jsonl")], tmp_path / "out", tokenizer=str(ckpt), sft=True, progress=False)
    ids = np.fromfile(tmp_path / "out" / "train.bin", np.uint16)
    marks = np.fromfile(tmp_path / "out" / "train.mask.bin", np.uint8)

    hf = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(ckpt / "tokenizer.json"), chat_template=CHATML
    )
    text = hf.apply_chat_template(CHAT, tokenize=False)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(ckpt / "tokenizer.json"))
    assert tok.decode(ids[:-1].tolist(), skip_special_tokens=False) == tok.decode(
        tok.encode(text, add_special_tokens=False).ids, skip_special_tokens=False
    )
    assert ids[-1] == tok.token_to_id("<eot>") and marks[-1] == 0
    counted = tok.decode(ids[marks == 1].tolist())
    assert counted.split() == tok.decode(tok.encode("hello <|im_end|> see you <|im_end|>").ids).split()


def test_a_changed_chat_template_is_not_up_to_date(tmp_path, capsys):
    """The chat template decides which tokens count, so prepare.json records it: the same inputs and
    tokenizer.json with another template in tokenizer_config.json are another preparation."""
    pytest.importorskip("transformers")
    ckpt = hf_tokenizer(tmp_path / "ckpt")
    config = json.loads((ckpt / "tokenizer_config.json").read_text())
    (ckpt / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": CHATML}))
    (tmp_path / "chat.jsonl").write_text(json.dumps({"messages": CHAT}) + "\n")
    args = ([str(tmp_path / "chat.jsonl")], tmp_path / "out")
    meta = prepare(*args, tokenizer=str(ckpt), sft=True, workers=1, progress=False)
    assert len(meta["recipe"]["chat_template_sha256"]) == 64
    prepare(*args, tokenizer=str(ckpt), sft=True, workers=1)
    assert "up to date" in capsys.readouterr().err
    other = CHATML.replace("<|im_start|>", "<|im_start|> ")
    (ckpt / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": other}))
    with pytest.raises(DataError, match="pass --overwrite"):
        prepare(*args, tokenizer=str(ckpt), sft=True, workers=1, progress=False)
    assert (
        "chat_template_sha256"
        not in prepare(write_inputs(tmp_path / "in"), tmp_path / "plain", workers=1, progress=False)["recipe"]
    )


def test_bad_fine_tuning_records_name_the_line(tmp_path):
    cases = [
        ('{"prompt": "a"}', r"ft\.jsonl:1: a fine-tuning record holds \"prompt\" and \"completion\""),
        (
            '{"messages": [{"role": "user", "content": "x"}]}',
            r"ft\.jsonl:1: messages must be .* one assistant",
        ),
        ('{"messages": "nope"}', r"ft\.jsonl:1: messages must be a list"),
        (
            '{"messages": [{"role": "assistant", "content": "x", "thinking": 3}]}',
            r"ft\.jsonl:1: message 0's 'thinking' must be a string, not 3",
        ),
    ]
    for line, match in cases:
        (tmp_path / "ft.jsonl").write_text(line + "\n")
        with pytest.raises(DataError, match=match):
            prepare([str(tmp_path / "ft.jsonl")], tmp_path / "out", sft=True, workers=1, progress=False)
    (tmp_path / "chat.jsonl").write_text(json.dumps({"messages": CHAT}) + "\n")
    with pytest.raises(
        DataError, match=r"chat\.jsonl:1: a messages record needs the tokenizer's chat_template"
    ):
        prepare([str(tmp_path / "chat.jsonl")], tmp_path / "out", sft=True, workers=1, progress=False)
    with pytest.raises(DataError, match=r"--sft reads JSONL records"):
        prepare([str(write_inputs(tmp_path / "in")[0])], tmp_path / "out", sft=True, progress=False)
    assert not (tmp_path / "out").exists()


def _train_on_examples(tmp_path, records, val_docs: int, console, over: dict[str, str]) -> list[dict]:
    """`prepare --sft` of `records`, then a 1-block model trained on them in-process (one record per
    step, `over` on top); the metrics records."""
    from jaxzero.cli import train as train_lib
    from jaxzero.config import TrainConfig
    from jaxzero.overrides import apply_overrides

    (tmp_path / "ft.jsonl").write_text("\n".join(json.dumps(r) for r in records))
    prepare([str(tmp_path / "ft.jsonl")], tmp_path / "data", sft=True, val_docs=val_docs, progress=False)
    settings = {
        "data.source": "tokens",
        "data.path": str(tmp_path / "data"),
        "data.batch_size": "4",
        "model.num_layers": "1",
        "logging.log_every": "1",
        "logging.progress": "false",
        "run_dir": str(tmp_path / "run"),
        **over,
    }
    path = train_lib.train(apply_overrides(TrainConfig(), settings), console)
    return [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]


def test_fine_tuning_end_to_end_counts_the_completions_in_the_metrics(tmp_path):
    """prepare --sft, then train on it in-process: metrics.jsonl counts the step's loss targets and
    its masked ones, and they add up to the step's tokens."""
    rng = np.random.default_rng(0)
    records = [
        {"prompt": f"Q{i}: " + "x" * int(rng.integers(5, 40)), "completion": f" A{i}."} for i in range(200)
    ]
    recs = _train_on_examples(tmp_path, records, 40, io.StringIO(), {"steps": "4", "data.seq_len": "32"})
    steps = [r for r in recs if "loss_tokens" in r]
    assert len(steps) == 4
    for r in steps:
        assert r["loss_tokens"] + r["masked_tokens"] == 4 * 32
        assert 0 < r["loss_tokens"] < 4 * 32 / 2  # completions are the short part of each example
    assert "val_loss" in recs[-1]


def test_a_step_whose_every_target_is_masked_logs_no_loss(tmp_path):
    """Long prompts (but every fourth), one-token completions and short rows: a long example is cut
    before its completion, so some steps count no target. Their record holds `loss: null` (a mean over
    no targets is no loss, not 0.0) and the console says why."""
    records = [{"prompt": f"Q{i}: " + "x" * 60 * bool(i % 4), "completion": "y"} for i in range(40)]
    console = io.StringIO()
    over = {"steps": "8", "data.seq_len": "8", "logging.samples": "0", "checkpoint.enabled": "false"}
    recs = _train_on_examples(tmp_path, records, 4, console, over)
    empty = [r for r in recs if r["loss_tokens"] == 0]
    assert empty and len(empty) < len(recs), [r["loss_tokens"] for r in recs]
    assert all(r["loss"] is None for r in empty)
    assert all(isinstance(r["loss"], float) for r in recs if r["loss_tokens"])
    assert f"step {empty[0]['step']} | loss - (every target masked) |" in console.getvalue()


def test_loss_masks_that_do_not_match_their_token_files_are_refused(tmp_path):
    (tmp_path / "ft.jsonl").write_text(
        "\n".join(json.dumps({"prompt": "ab" * 9, "completion": "c"}) for _ in range(9))
    )
    prepare([str(tmp_path / "ft.jsonl")], tmp_path / "d", sft=True, val_docs=3, workers=1, progress=False)
    kwargs = dict(token_dtype="uint16", seq_len=4, val_fraction=0.0, vocab_size=256)
    load_token_files(tmp_path / "d", **kwargs)
    mask = tmp_path / "d" / "train.mask.bin"
    mask.write_bytes(mask.read_bytes()[:-1])
    with pytest.raises(
        DataError, match=r"train\.mask\.bin' holds 119 bytes, one per token, but its token file holds 120"
    ):
        load_token_files(tmp_path / "d", **kwargs)
    mask.unlink()
    with pytest.raises(DataError, match=r"holds val\.mask\.bin but no train\.mask\.bin"):
        load_token_files(tmp_path / "d", **kwargs)


class _Stream(io.StringIO):
    def __init__(self, tty: bool):
        super().__init__()
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


@pytest.mark.parametrize("tty", [True, False])
def test_progress_is_not_printed_twice(tty, monkeypatch):
    """On a terminal the progress line is rewritten and erased at the end (the summary says the same);
    in a log, a line every 30 s and nothing at the end."""
    from jaxzero.cli.prepare import _Progress

    clock = iter([0.0, 1.0, 31.0, 32.0, 70.0])
    monkeypatch.setattr("jaxzero.cli.prepare.time.monotonic", lambda: next(clock))
    stream = _Stream(tty)
    shown = _Progress(stream)
    for _ in range(2):
        shown.add(1, 3, 3)
    shown.close()
    out = stream.getvalue()
    if tty:
        assert out.count("jaxzero.prepare: ") == 2 and out.endswith("\r") and "\n" not in out
    else:
        assert out == "jaxzero.prepare: 2 documents, 6 tokens (0.0 M characters/s)\n"


def test_negative_workers_are_refused_in_one_line(tmp_path, capsys):
    inputs = write_inputs(tmp_path / "in")
    assert main([f"--input={i}" for i in inputs] + [f"--out={tmp_path / 'out'}", "--workers=-3"]) == 2
    err = capsys.readouterr().err
    assert "--workers=-3: give a number of encoding processes" in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()


@pytest.mark.slow  # a subprocess with worker processes, a few seconds of encoding
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_a_stop_signal_ends_it_at_once_in_one_line_and_leaves_nothing(tmp_path, signum):
    """Ctrl-C at a terminal reaches the program and its encoding workers (one process group), as the
    SIGHUP of a closed terminal does; SIGTERM from a service manager reaches the program alone. Each
    way: one line, exit 128 + the signal, within seconds, its workers gone and no unfinished file left
    (it printed a traceback per process, sometimes ran on for minutes with the pool's terminate stuck
    on a full pipe, and a SIGTERM left its `.partial` files)."""
    big = tmp_path / "in"
    big.mkdir()
    line = json.dumps({"text": "the quick brown fox jumps over the lazy dog " * 40})
    (big / "docs.jsonl").write_text("\n".join([line] * 60_000) + "\n")
    out = tmp_path / "out"
    proc = subprocess.Popen(
        [sys.executable, "-m", "jaxzero.prepare", f"--input={big}/docs.jsonl", f"--out={out}", "--workers=2"],
        env=user_env(),
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group, as a terminal's foreground job
        # as at a terminal: a pytest-xdist worker ignores SIGINT, and its children would inherit that
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.default_int_handler),
    )
    deadline = time.time() + 120
    while time.time() < deadline and not (out.is_dir() and any(p.stat().st_size for p in out.iterdir())):
        time.sleep(0.05)
    assert proc.poll() is None, proc.communicate()[1]
    if signum != signal.SIGTERM:
        os.killpg(proc.pid, signum)  # Ctrl-C, a closed terminal: the whole foreground group
    else:
        os.kill(proc.pid, signum)  # the program alone: its workers are its to end
    sent = time.time()
    try:
        _, err = proc.communicate(timeout=60)
        # no worker outlives the program (multiprocessing's resource tracker ends on its own, just after)
        left, gone = True, time.time() + 10
        while left and time.time() < gone:
            try:
                os.killpg(proc.pid, 0)
                time.sleep(0.05)
            except ProcessLookupError:
                left = False
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # whatever is left of the group, should it hang
    assert proc.returncode == 128 + signum, err
    assert time.time() - sent < 20
    how = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
    assert err.splitlines() == [
        f"jaxzero.prepare: interrupted ({how}): nothing of this preparation is left in {out}."
    ], err
    assert not left
    assert not out.exists() or list(out.iterdir()) == []


def test_spans_encoded_by_workers_come_back_in_order_and_errors_name_their_line(tmp_path, monkeypatch):
    """Inputs cut into many small spans (64 bytes of JSONL lines each) encode, over 3 workers, to the
    bytes one process writes; a bad record is named by its line in the file, and of two the first."""
    monkeypatch.setattr("jaxzero.data.documents._SPAN_BYTES", 64)  # cut in this process, read by workers
    lines = [json.dumps({"text": f"document {i} " + "x" * (i % 13)}) for i in range(200)]
    (tmp_path / "d.jsonl").write_text("\n".join(lines[:50]) + "\n\n" + "\n".join(lines[50:]))  # blank line 51
    one = prepare([str(tmp_path / "d.jsonl")], tmp_path / "one", val_docs=7, workers=1, progress=False)
    three = prepare([str(tmp_path / "d.jsonl")], tmp_path / "three", val_docs=7, workers=3, progress=False)
    assert one["train"] == three["train"] and one["val"] == three["val"]
    for name in ("train.bin", "val.bin"):
        assert (tmp_path / "one" / name).read_bytes() == (tmp_path / "three" / name).read_bytes()
    want = b"".join(json.loads(line)["text"].encode() + b"\0" for line in lines)
    assert (tmp_path / "one" / "val.bin").read_bytes() + (tmp_path / "one" / "train.bin").read_bytes() == (
        np.frombuffer(want, np.uint8).astype(np.uint16).tobytes()
    )
    bad = lines[:120] + ['{"body": 1}'] + lines[120:150] + ["not json"] + lines[150:]
    (tmp_path / "bad.jsonl").write_text("\n".join(bad) + "\n")
    with pytest.raises(DataError, match=r"bad\.jsonl:121: no text field 'text'"):
        prepare([str(tmp_path / "bad.jsonl")], tmp_path / "bad", workers=3, progress=False)


def test_a_worker_that_dies_is_an_error_naming_it():
    """A worker killed from outside (the kernel's OOM killer) ends the preparation with a line that says
    so, instead of waiting for its result forever."""
    import signal as signals

    from jaxzero.data.documents import Span
    from jaxzero.data.encoding import _Workers

    workers = _Workers()
    try:
        workers.start(1, "text", ("bytes", 0, False, None))
        os.kill(workers.procs[0].pid, signals.SIGKILL)
        workers.procs[0].join()
        workers.send(0, 0, Span(Path("nowhere.txt")))
        with pytest.raises(
            DataError, match=r"an encoding process \(pid \d+\) ended without its result \(exit code -9"
        ):
            workers.receive()
    finally:
        workers.kill()
