"""`prepare --sft --template_arg KEY=VALUE`: the chat template's keyword arguments, passed to every
rendering as transformers' `apply_chat_template(..., KEY=VALUE)` passes them (Qwen3's
`enable_thinking`, gpt-oss's `reasoning_effort`), recorded in prepare.json, and refused before any
encoding where they cannot reach a template."""

from __future__ import annotations

import json
import pickle
import re
from pathlib import Path

import pytest
from test_chat_templates import (  # noqa: F401 (fixed_date: a fixture)
    CONV,
    FAMILIES,
    family_checkpoint,
    fixed_date,
    prepared_conversation,
)

from jaxzero.cli.prepare import main, prepare
from jaxzero.data import DataError
from jaxzero.data.chat_template import ChatTemplate, parse_template_args

# Per case: the family, its arguments, the counted text of CONV's three assistant turns, and of
# CONV[:3]'s one. Qwen3 without thinking writes the empty think block in the generation prompt, so
# the last turn counts only what the model emits after it; gpt-oss's effort is written in the system
# message.
CASES = {
    "qwen3-no-thinking": (
        "qwen3",
        {"enable_thinking": False},
        ["hello<|im_end|>\n", "see you<|im_end|>\n", "yes<|im_end|>\n"],
        ["hello<|im_end|>\n"],
    ),
    "gpt-oss-high": (
        "gpt-oss",
        {"reasoning_effort": "high"},
        FAMILIES["gpt-oss"][2],
        ["<|channel|>final<|message|>hello<|return|>"],
    ),
}


def hf_tokenizer(ckpt: Path, family: str):
    transformers = pytest.importorskip("transformers")
    source, special, _ = FAMILIES[family]
    return transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(ckpt / "tokenizer.json"), chat_template=source, **special
    )


@pytest.mark.usefixtures("fixed_date")
@pytest.mark.parametrize("case", sorted(CASES))
def test_spans_join_to_apply_chat_template_text_with_the_arguments(tmp_path, case):
    family, args, counted, one_turn = CASES[case]
    source, special, _ = FAMILIES[family]
    hf = hf_tokenizer(family_checkpoint(tmp_path / "ckpt", family), family)
    template = ChatTemplate(source, special, args)
    for conv, want in ((CONV, counted), (CONV[:3], one_turn)):
        spans = template.spans(conv, "chat.jsonl:1")
        text = hf.apply_chat_template(conv, tokenize=False, **args)
        assert "".join(t for t, _ in spans) == text
        assert [t for t, c in spans if c] == want
    # the generation prompt's renderings too, which the arguments change
    prompt = hf.apply_chat_template(CONV[:6], tokenize=False, add_generation_prompt=True, **args)
    assert template.render(CONV[:6], add_generation_prompt=True) == prompt
    assert prompt != hf.apply_chat_template(CONV[:6], tokenize=False, add_generation_prompt=True)
    if family == "qwen3":
        assert prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    else:
        assert "\nReasoning: high\n" in text


def test_the_arguments_reach_worker_processes():
    source, special, _ = FAMILIES["qwen3"]
    template = pickle.loads(pickle.dumps(ChatTemplate(source, special, {"enable_thinking": False})))
    assert template.arguments == {"enable_thinking": False}
    assert template.render(CONV[:2], add_generation_prompt=True).endswith("<think>\n\n</think>\n\n")


@pytest.mark.usefixtures("fixed_date")
@pytest.mark.parametrize(("case", "workers"), [("qwen3-no-thinking", 2), ("gpt-oss-high", 1)])
def test_prepare_writes_apply_chat_template_tokens_and_records_the_arguments(tmp_path, case, workers):
    """Through `prepare` (in worker processes too): the tokens of transformers' text with the
    arguments, the counted ones each turn's, and prepare.json's recipe holding the arguments."""
    family, args, counted, _ = CASES[case]
    meta, ids, marks, tok, text = prepared_conversation(tmp_path, family, workers, args)
    assert ids[:-1].tolist() == tok.encode(text, add_special_tokens=False).ids and ids[-1] == 0
    want = [i for t in counted for i in tok.encode(t, add_special_tokens=False).ids]
    assert ids[marks == 1].tolist() == want
    assert meta["recipe"]["chat_template_args"] == args
    assert json.loads((tmp_path / "out" / "prepare.json").read_text()) == meta


def test_changed_arguments_are_not_up_to_date(tmp_path, capsys):
    """The arguments change the rendering, so a preparation with others is another preparation:
    refused without --overwrite, redone with it; one without arguments records none."""
    pytest.importorskip("transformers")
    ckpt = family_checkpoint(tmp_path / "ckpt", "gpt-oss")
    (tmp_path / "chat.jsonl").write_text(json.dumps({"messages": CONV}) + "\n")
    args = ([str(tmp_path / "chat.jsonl")], tmp_path / "out")
    kw = {"tokenizer": str(ckpt), "sft": True, "workers": 1}
    high = prepare(*args, **kw, template_args={"reasoning_effort": "high"}, progress=False)
    prepare(*args, **kw, template_args={"reasoning_effort": "high"})
    assert "up to date" in capsys.readouterr().err
    for other in ({"reasoning_effort": "low"}, {}, {"reasoning_effort": "high", "model_identity": "x"}):
        with pytest.raises(DataError, match="other inputs or settings .* pass --overwrite"):
            prepare(*args, **kw, template_args=other, progress=False)
    low = prepare(*args, **kw, template_args={"reasoning_effort": "low"}, overwrite=True, progress=False)
    assert low["recipe"]["chat_template_args"] == {"reasoning_effort": "low"}
    assert high["recipe"]["chat_template_args"] == {"reasoning_effort": "high"}
    none = prepare(*args, **kw, overwrite=True, progress=False)
    assert "chat_template_args" not in none["recipe"]
    prepare(*args, **kw)  # a prepare.json without the field: no arguments, up to date
    assert "up to date" in capsys.readouterr().err


def test_values_are_json_where_they_parse_else_strings():
    pairs = [
        "enable_thinking=false",
        "n=3",
        "x=0.5",
        'name="quoted"',
        "reasoning_effort=high",
        "empty=",
        "tools_list=[1, 2]",
        "nan=NaN",
        "eq=a=b",
        "nothing=null",
    ]
    assert parse_template_args(pairs) == {
        "enable_thinking": False,
        "n": 3,
        "x": 0.5,
        "name": "quoted",
        "reasoning_effort": "high",
        "empty": "",
        "tools_list": [1, 2],
        "nan": "NaN",
        "eq": "a=b",
        "nothing": None,
    }


def test_bad_template_arguments_are_refused_before_anything_is_written(tmp_path, capsys):
    """Each refusal names the argument and the fix, exits 2 and leaves --out unmade."""
    pytest.importorskip("transformers")
    ckpt = family_checkpoint(tmp_path / "ckpt", "qwen3")
    plain = family_checkpoint(tmp_path / "plain", "qwen3")
    (plain / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    (tmp_path / "chat.jsonl").write_text(json.dumps({"messages": CONV}) + "\n")
    base = [f"--input={tmp_path / 'chat.jsonl'}", f"--out={tmp_path / 'out'}", "--workers=1"]
    sft = [*base, "--sft", f"--tokenizer={ckpt}"]
    cases = [
        ([*sft, "--template_arg", "enable_thinking"], r"'enable_thinking' is not KEY=VALUE .* e\.g\."),
        ([*sft, "--template_arg", "=false"], r"'=false' is not KEY=VALUE"),
        ([*sft, "--template_arg", "1x=2"], r"'1x=2' is not KEY=VALUE"),
        ([*sft, "--template_arg", "a=1", "--template_arg", "a=2"], r"a is given twice \(1 and '2'\)"),
        ([*sft, "--template_arg", "messages=[]"], r"messages=\[\]: 'messages' is a variable jaxzero gives"),
        ([*sft, "--template_arg", "add_generation_prompt=true"], r"'add_generation_prompt' is a variable"),
        ([*sft, "--template_arg", "eos_token=x"], r"eos_token='x': 'eos_token' is a variable .* leave it"),
        (
            [*sft, "--template_arg", "tools=[]"],
            r"'tools' is a variable each rendering is given from its record \(a record's \"tools\"\)",
        ),
        ([*sft, "--template_arg", "tokenize=false"], r"'tokenize' is a parameter of transformers'"),
        (
            [*base, f"--tokenizer={ckpt}", "--template_arg", "enable_thinking=false"],
            r"enable_thinking=false is given to a chat template, which only --sft uses .* add --sft",
        ),
        (
            [*base, "--sft", "--template_arg", "enable_thinking=false"],
            r"enable_thinking=false needs a chat template, .* byte tokenizer .* pass --tokenizer=DIR",
        ),
        (
            [*base, "--sft", f"--tokenizer={plain}", "--template_arg", 'reasoning_effort="high"'],
            r"reasoning_effort=\"high\" needs a chat template, and .*plain/tokenizer_config\.json has no "
            r"chat_template",
        ),
    ]
    for argv, match in cases:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith("jaxzero.prepare: error: ") and re.search(match, err), err
        assert not (tmp_path / "out").exists()
    with pytest.raises(DataError, match=r"add_generation_prompt=True: .* is a variable jaxzero gives"):
        ChatTemplate(FAMILIES["qwen3"][0], {}, {"add_generation_prompt": True})
    with pytest.raises(DataError, match=r"x=\{1, 2\} is not a JSON value"):
        ChatTemplate(FAMILIES["qwen3"][0], {}, {"x": {1, 2}})


def test_qwen3_without_thinking_refuses_a_last_turn_with_reasoning():
    """Qwen3 with enable_thinking=false writes a last turn's reasoning where its generation prompt
    writes the empty think block: no header is left to count the turn after, so it is refused."""
    source, special, _ = FAMILIES["qwen3"]
    conv = [*CONV[1:4], {"role": "assistant", "content": "yes", "reasoning_content": "keep"}]
    template = ChatTemplate(source, special, {"enable_thinking": False})
    with pytest.raises(
        DataError, match=r"^chat\.jsonl:2: .*message 3 \(assistant\) is not after a generation"
    ):
        template.spans(conv, "chat.jsonl:2")
    assert [t for t, c in template.spans(conv[:3], "x") if c] == ["hello<|im_end|>\n"]
