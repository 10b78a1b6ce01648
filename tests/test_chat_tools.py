"""Function calling in `prepare --sft`: a record's "tools" reach every rendering of the chat template as
transformers' apply_chat_template(..., tools=...) gives them, an assistant turn's "tool_calls" are
counted with the turn (what the model learns to emit), tool results are not. Cut against transformers'
own rendering with the released Qwen3 template (tests/chat_templates/, rendered in one piece) and a
ChatML template with tools written here (rendered turn by turn)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from jaxzero.cli.prepare import prepare
from jaxzero.data import DataError
from jaxzero.data.chat_template import ChatTemplate

QWEN3 = (Path(__file__).parent / "chat_templates" / "qwen3.jinja").read_text()
QWEN3_SPECIAL = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}

# ChatML with tools in the system message, each call a JSON object in <tool_call> tags, the tool
# results in a user turn: written for this test (Qwen2.5's layout), rendered turn by turn.
CHATML_TOOLS = """{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}# Tools
<tools>{% for tool in tools %}
{{ tool | tojson }}{% endfor %}
</tools><|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'user' or (message.role == 'system' and not loop.first) -%}
<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% elif message.role == 'assistant' %}<|im_start|>assistant
{% if message.content %}{{ message.content }}{% endif %}
{%- for call in message.tool_calls or [] %}{% if message.content or not loop.first %}
{% endif %}<tool_call>
{{ {"name": call.function.name, "arguments": call.function.arguments} | tojson }}
</tool_call>{% endfor %}<|im_end|>
{% elif message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city now",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]


def call(city: str) -> dict:
    return {"type": "function", "function": {"name": "get_weather", "arguments": {"city": city}}}


# Two calls at once with no content, their results, an answer; a new question, a call after content,
# its result, the last answer.
CONV = [
    {"role": "system", "content": "You are helpful."},
    {"role": "user", "content": "Weather in Paris and Oslo?"},
    {"role": "assistant", "content": "", "tool_calls": [call("Paris"), call("Oslo")]},
    {"role": "tool", "content": "18C", "name": "get_weather"},
    {"role": "tool", "content": "9C", "name": "get_weather"},
    {"role": "assistant", "content": "Paris is 18C, Oslo 9C."},
    {"role": "user", "content": "Thanks! And Rome?"},
    {"role": "assistant", "content": "Let me check.", "tool_calls": [call("Rome")]},
    {"role": "tool", "content": "21C", "name": "get_weather"},
    {"role": "assistant", "content": "Rome is 21C."},
]
NULL_CONTENT = [dict(m, content=None) if m["content"] == "" else m for m in CONV]

PARIS_OSLO = (
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call><|im_end|>\n'
)
ROME = '\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call><|im_end|>\n'
QWEN3_COUNTED = [
    PARIS_OSLO,
    "Paris is 18C, Oslo 9C.<|im_end|>\n",
    "Let me check." + ROME,
    "<think>\n\n</think>\n\nRome is 21C.<|im_end|>\n",
]


def transformers_text(source: str, special: dict[str, str], messages: list[dict], tools: list | None) -> str:
    from transformers.utils.chat_template_utils import render_jinja_template

    return render_jinja_template([messages], chat_template=source, tools=tools, **special)[0][0]


@pytest.mark.parametrize("conv", [CONV, NULL_CONTENT], ids=["empty", "null"])
def test_qwen3_counts_each_turns_function_calls_and_gives_the_template_the_tools(conv):
    pytest.importorskip("transformers")
    spans = ChatTemplate(QWEN3, QWEN3_SPECIAL).spans(conv, "calls.jsonl:1", TOOLS)
    text = "".join(t for t, _ in spans)
    assert text == transformers_text(QWEN3, QWEN3_SPECIAL, conv, TOOLS)
    assert '"description": "The weather in a city now"' in text  # the tools, in the system message
    assert [t for t, c in spans if c] == QWEN3_COUNTED
    assert not any("<tool_response>" in t for t, c in spans if c)


def test_a_template_rendered_turn_by_turn_counts_the_calls_too():
    pytest.importorskip("transformers")
    spans = ChatTemplate(CHATML_TOOLS, {}).spans(NULL_CONTENT, "calls.jsonl:1", TOOLS)
    assert "".join(t for t, _ in spans) == transformers_text(CHATML_TOOLS, {}, NULL_CONTENT, TOOLS)
    paris, oslo, rome = (
        f'<tool_call>\n{{"name": "get_weather", "arguments": {{"city": "{c}"}}}}\n</tool_call>'
        for c in ("Paris", "Oslo", "Rome")
    )
    assert [t for t, c in spans if c] == [
        paris + oslo + "<|im_end|>\n",  # this template's whitespace control drops the newline between
        "Paris is 18C, Oslo 9C.<|im_end|>\n",
        "Let me check." + rome + "<|im_end|>\n",
        "Rome is 21C.<|im_end|>\n",
    ]


def test_without_tools_the_template_sees_none_as_transformers_gives_it():
    """transformers gives `tools=None` and `documents=None` to every rendering: a template that tests
    `tools is not none` renders as it does (an undefined `tools` would pass that test)."""
    pytest.importorskip("transformers")
    source = (
        "{% if tools is not none %}TOOLS {% endif %}{% if documents is none %}no documents {% endif %}"
        + (
            "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant: {% endif %}"
        )
    )
    conv = CONV[1:2] + [{"role": "assistant", "content": "Sunny."}]
    spans = ChatTemplate(source, {}).spans(conv, "calls.jsonl:1")
    assert (
        "".join(t for t, _ in spans)
        == transformers_text(source, {}, conv, None)
        == ("no documents user: Weather in Paris and Oslo?\nassistant: Sunny.\n")
    )


def checkpoint(root: Path) -> Path:
    """A word-level tokenizer holding the ChatML markers as special tokens, with Qwen3's template."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    text = ChatTemplate(QWEN3, QWEN3_SPECIAL).render(CONV, tools=TOOLS)
    tok.train_from_iterator([text], trainers.WordLevelTrainer(special_tokens=["<unk>"]))
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<think>", "</think>"])
    root.mkdir(parents=True)
    tok.save(str(root / "tokenizer.json"))
    (root / "tokenizer_config.json").write_text(json.dumps({**QWEN3_SPECIAL, "chat_template": QWEN3}))
    return root


def test_prepare_writes_transformers_tokens_of_a_record_with_tools(tmp_path):
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer

    ckpt = checkpoint(tmp_path / "ckpt")
    (tmp_path / "calls.jsonl").write_text(json.dumps({"messages": NULL_CONTENT, "tools": TOOLS}) + "\n")
    out = tmp_path / "out"
    prepare([str(tmp_path / "calls.jsonl")], out, tokenizer=str(ckpt), sft=True, eot_id=0, progress=False)
    ids = np.fromfile(out / "train.bin", np.uint16)
    marks = np.fromfile(out / "train.mask.bin", np.uint8)
    hf = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(ckpt / "tokenizer.json"), chat_template=QWEN3, **QWEN3_SPECIAL
    )
    text = hf.apply_chat_template(NULL_CONTENT, tools=TOOLS, tokenize=False)
    tok = Tokenizer.from_file(str(ckpt / "tokenizer.json"))
    assert ids[:-1].tolist() == tok.encode(text, add_special_tokens=False).ids and ids[-1] == 0
    want = [i for t in QWEN3_COUNTED for i in tok.encode(t, add_special_tokens=False).ids]
    assert ids[marks == 1].tolist() == want


@pytest.mark.parametrize(
    ("record", "message"),
    [
        ({"tools": {"name": "f"}}, r'calls\.jsonl:1: "tools" must be a list of function schemas'),
        (
            {"tools": ["get_weather"]},
            r'"tools" must be a list of function schemas .* not \[\'get_weather\'\]',
        ),
        ({"calls": "f"}, r"message 2's 'tool_calls' must be a list, not 'f'"),
        ({"calls": ["f"]}, r'message 2\'s "tool_calls" must be a list of objects \(e\.g\.'),
        ({"null_without_calls": True}, r'an assistant turn with "tool_calls" may have "content": null'),
        ({"call_id": 7}, r"message 3's 'tool_call_id' must be a str, not 7"),
    ],
)
def test_malformed_function_calling_records_are_refused_naming_the_record(tmp_path, record, message):
    conv = [dict(m) for m in NULL_CONTENT]
    if "calls" in record:
        conv[2]["tool_calls"] = record["calls"]
    if record.get("null_without_calls"):
        conv[5]["content"] = None
    if "call_id" in record:
        conv[3]["tool_call_id"] = record["call_id"]
    line = {"messages": conv, **({"tools": record["tools"]} if "tools" in record else {})}
    (tmp_path / "calls.jsonl").write_text(json.dumps(line) + "\n")
    ckpt = checkpoint(tmp_path / "ckpt")
    with pytest.raises(DataError, match=message):
        prepare(
            [str(tmp_path / "calls.jsonl")], tmp_path / "out", tokenizer=str(ckpt), sft=True, eot_id=0,
            progress=False,
        )  # fmt: skip
    assert not (tmp_path / "out" / "train.bin").exists()
