"""`prepare` with the chat templates of the families jaxzero trains: each conversation cut into spans
that joined are transformers' `apply_chat_template` text exactly, each assistant turn counted from
after the generation prompt's header through its end-of-turn marker. The released Qwen3 and Gemma 3
templates are in tests/chat_templates/, with gpt-oss's harmony format (the released template's
system, developer, user and assistant messages without tools, rendering these conversations as it
does); the short ones are below."""

from __future__ import annotations

import datetime
import json
from pathlib import Path

import numpy as np
import pytest

from jaxzero.cli.prepare import prepare
from jaxzero.data import DataError
from jaxzero.data.chat_template import TEMPLATE_DATE, ChatTemplate

TEMPLATES = Path(__file__).parent / "chat_templates"

PHI3 = (
    "{% for message in messages %}{% if message['role'] == 'system' %}"
    "{{'<|system|>\\n' + message['content'] + '<|end|>\\n'}}{% elif message['role'] == 'user' %}"
    "{{'<|user|>\\n' + message['content'] + '<|end|>\\n'}}{% elif message['role'] == 'assistant' %}"
    "{{'<|assistant|>\\n' + message['content'] + '<|end|>\\n'}}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% else %}{{ eos_token }}{% endif %}"
)
PHI4 = (
    "{% for message in messages %}{% if (message['role'] == 'system') %}"
    "{{'<|im_start|>system<|im_sep|>' + message['content'] + '<|im_end|>'}}"
    "{% elif (message['role'] == 'user') %}"
    "{{'<|im_start|>user<|im_sep|>' + message['content'] + '<|im_end|>'}}"
    "{% elif (message['role'] == 'assistant') %}"
    "{{'<|im_start|>assistant<|im_sep|>' + message['content'] + '<|im_end|>'}}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant<|im_sep|>' }}{% endif %}"
)
OLMO2 = (
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'system' %}"
    "{{ '<|system|>\\n' + message['content'] + '\\n' }}{% elif message['role'] == 'user' %}"
    "{{ '<|user|>\\n' + message['content'] + '\\n' }}{% elif message['role'] == 'assistant' %}"
    "{% if not loop.last %}{{ '<|assistant|>\\n'  + message['content'] + eos_token + '\\n' }}"
    "{% else %}{{ '<|assistant|>\\n'  + message['content'] + eos_token }}{% endif %}{% endif %}"
    "{% if loop.last and add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}{% endfor %}"
)
# Mixtral-8x7B-Instruct's: the system message joins the first user turn; no generation prompt.
MIXTRAL = """{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set loop_messages = messages %}
{%- endif %}
{{- bos_token }}
{%- for message in loop_messages %}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{- raise_exception('After the optional system message, roles must alternate user/assistant/...') }}
    {%- endif %}
    {%- if message['role'] == 'user' %}
        {%- if loop.first and system_message is defined %}
            {{- ' [INST] ' + system_message + '\\n\\n' + message['content'] + ' [/INST]' }}
        {%- else %}
            {{- ' [INST] ' + message['content'] + ' [/INST]' }}
        {%- endif %}
    {%- elif message['role'] == 'assistant' %}
        {{- ' ' + message['content'] + eos_token}}
    {%- endif %}
{%- endfor %}
"""
# Mistral-7B-Instruct-v0.3's (without tools): the system message joins the LAST user turn, so a
# conversation that ends with an assistant turn renders without it.
MISTRAL = (
    MIXTRAL.replace("loop.first and system_message", "loop.last and system_message")
    .replace("' [INST] '", "'[INST] '")
    .replace("' [/INST]'", "'[/INST]'")
)

# Granite 3.x's format (written from its instruct models' renderings, not copied: without tools or
# documents): each turn between <|start_of_role|>ROLE<|end_of_role|> and <|end_of_text|>, a newline;
# with no system message, IBM's default one, dated by strftime_now.
GRANITE = """{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set system_message = "Knowledge Cutoff Date: April 2024.\nToday's Date: " +
        strftime_now('%B %d, %Y') + ".\nYou are Granite, developed by IBM. You are a helpful AI assistant." %}
    {%- set loop_messages = messages %}
{%- endif %}
{{- '<|start_of_role|>system<|end_of_role|>' + system_message + '<|end_of_text|>\n' }}
{%- for message in loop_messages %}
    {{- '<|start_of_role|>' + message['role'] + '<|end_of_role|>' }}
    {{- message['content'] + '<|end_of_text|>\n' }}
    {%- if loop.last and add_generation_prompt %}
        {{- '<|start_of_role|>assistant<|end_of_role|>' }}
    {%- endif %}
{%- endfor %}
"""

CONV = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "hi there"},
    {"role": "assistant", "content": "hello"},
    {"role": "user", "content": "and now"},
    {"role": "assistant", "content": "see you"},
    {"role": "user", "content": "once more"},
    {"role": "assistant", "content": "yes"},
]

# Per family: its template, special tokens, and the counted text of CONV's three assistant turns.
FAMILIES = {
    "qwen3": (
        (TEMPLATES / "qwen3.jinja").read_text(),
        {"eos_token": "<|im_end|>"},
        ["hello<|im_end|>\n", "see you<|im_end|>\n", "<think>\n\n</think>\n\nyes<|im_end|>\n"],
    ),
    "gemma3": (
        (TEMPLATES / "gemma3.jinja").read_text(),
        {"bos_token": "<bos>", "eos_token": "<eos>"},
        ["hello<end_of_turn>\n", "see you<end_of_turn>\n", "yes<end_of_turn>\n"],
    ),
    "gpt-oss": (
        (TEMPLATES / "harmony.jinja").read_text(),
        {"eos_token": "<|return|>"},
        [
            f"<|channel|>final<|message|>{a}{end}"
            for a, end in (("hello", "<|end|>"), ("see you", "<|end|>"), ("yes", "<|return|>"))
        ],
    ),
    "mixtral": (
        MIXTRAL,
        {"bos_token": "<s>", "eos_token": "</s>"},
        [" hello</s>", " see you</s>", " yes</s>"],
    ),
    "mistral": (
        MISTRAL,
        {"bos_token": "<s>", "eos_token": "</s>"},
        [" hello</s>", " see you</s>", " yes</s>"],
    ),
    "phi3": (
        PHI3,
        {"eos_token": "<|endoftext|>"},
        ["hello<|end|>\n", "see you<|end|>\n", "yes<|end|>\n<|endoftext|>"],
    ),
    "phi4": (PHI4, {"eos_token": "<|im_end|>"}, ["hello<|im_end|>", "see you<|im_end|>", "yes<|im_end|>"]),
    "olmo2": (
        OLMO2,
        {"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>"},
        ["hello<|endoftext|>", "see you<|endoftext|>", "yes<|endoftext|>"],
    ),
    "granite": (
        GRANITE,
        {"eos_token": "<|end_of_text|>"},
        ["hello<|end_of_text|>\n", "see you<|end_of_text|>\n", "yes<|end_of_text|>\n"],
    ),
}

# The markers each family's template writes, as the family's tokenizer holds them: one token each.
MARKERS = [
    "<|im_start|>",
    "<|im_end|>",
    "<|im_sep|>",
    "<bos>",
    "<eos>",
    "<start_of_turn>",
    "<end_of_turn>",
    "<|start|>",
    "<|end|>",
    "<|message|>",
    "<|channel|>",
    "<|return|>",
    "<s>",
    "</s>",
    "[INST]",
    "[/INST]",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|endoftext|>",
    "<think>",
    "</think>",
    "<|start_of_role|>",
    "<|end_of_role|>",
    "<|end_of_text|>",
]


@pytest.fixture
def fixed_date(monkeypatch):
    """transformers' `strftime_now` at jaxzero's TEMPLATE_DATE, so renderings compare whatever the day."""
    utils = pytest.importorskip("transformers.utils.chat_template_utils")

    class Fixed(datetime.datetime):
        @classmethod
        def now(cls, tz=None):
            return TEMPLATE_DATE

    monkeypatch.setattr(utils, "datetime", Fixed)


def transformers_text(source: str, special: dict[str, str], messages: list[dict[str, str]]) -> str:
    from transformers.utils.chat_template_utils import render_jinja_template

    return render_jinja_template([messages], chat_template=source, **special)[0][0]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_spans_join_to_transformers_text_and_count_each_turn_through_its_end(family, fixed_date):
    source, special, counted = FAMILIES[family]
    spans = ChatTemplate(source, special).spans(CONV, "chat.jsonl:1")
    assert "".join(t for t, _ in spans) == transformers_text(source, special, CONV)
    assert [t for t, c in spans if c] == counted


def test_granite_writes_its_dated_system_message_where_none_is_given(fixed_date):
    source, special, counted = FAMILIES["granite"]
    spans = ChatTemplate(source, special).spans(CONV[1:], "chat.jsonl:1")
    text = "".join(t for t, _ in spans)
    assert text == transformers_text(source, special, CONV[1:])
    assert f"Today's Date: {TEMPLATE_DATE.strftime('%B %d, %Y')}." in text
    assert [t for t, c in spans if c] == counted


def test_qwen3_keeps_the_last_turns_reasoning_and_drops_the_earlier(fixed_date):
    source, special, _ = FAMILIES["qwen3"]
    conv = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "<think>\nskip\n</think>\n\nhello"},
        {"role": "user", "content": "and now"},
        {"role": "assistant", "content": "<think>\nkeep\n</think>\n\nyes"},
    ]
    spans = ChatTemplate(source, special).spans(conv, "chat.jsonl:1")
    assert "".join(t for t, _ in spans) == transformers_text(source, special, conv)
    assert [t for t, c in spans if c] == ["hello<|im_end|>\n", "<think>\nkeep\n</think>\n\nyes<|im_end|>\n"]


def test_qwen3_reasoning_content_is_counted_with_its_turn(fixed_date):
    """A record's `reasoning_content` reaches Qwen3's template as transformers passes it: the last
    turn's is written in its think block and counted with the turn; an earlier turn's is dropped."""
    source, special, _ = FAMILIES["qwen3"]
    conv = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello", "reasoning_content": "skip"},
        {"role": "user", "content": "and now"},
        {"role": "assistant", "content": "yes", "reasoning_content": "keep"},
    ]
    spans = ChatTemplate(source, special).spans(conv, "chat.jsonl:1")
    assert "".join(t for t, _ in spans) == transformers_text(source, special, conv)
    assert [t for t, c in spans if c] == ["hello<|im_end|>\n", "<think>\nkeep\n</think>\n\nyes<|im_end|>\n"]


def test_gpt_oss_thinking_is_counted_with_its_last_turn(fixed_date):
    """gpt-oss's `thinking`: the last turn's is written as an analysis message after the generation
    prompt's header, so it is counted with the turn; an earlier turn's is dropped by the template."""
    source, special, _ = FAMILIES["gpt-oss"]
    conv = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello", "thinking": "skip"},
        {"role": "user", "content": "and now"},
        {"role": "assistant", "content": "yes", "thinking": "keep"},
    ]
    spans = ChatTemplate(source, special).spans(conv, "chat.jsonl:1")
    text = "".join(t for t, _ in spans)
    assert text == transformers_text(source, special, conv) and "skip" not in text
    last = [t for t, c in spans if c][-1]
    analysis = "<|channel|>analysis<|message|>keep<|end|>"
    assert last == analysis + "<|start|>assistant<|channel|>final<|message|>yes<|return|>"


def test_reasoning_a_template_writes_outside_the_counted_turn_is_refused():
    """A template that writes the reasoning before the assistant's header (as a message of its own)
    would leave it out of the loss: refused, naming the record and what to do."""
    source = (
        "{%- for m in messages -%}"
        "{%- if m.thinking is defined -%}<|think|>{{ m.thinking }}<|end|>{%- endif -%}"
        "<|{{ m.role }}|>{{ m.content }}<|end|>"
        "{%- endfor -%}{%- if add_generation_prompt -%}<|assistant|>{%- endif -%}"
    )
    conv = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yes", "thinking": "hmm"}]
    with pytest.raises(
        DataError, match=r"chat\.jsonl:1: assistant turn 0's 'thinking' is written .* outside"
    ):
        ChatTemplate(source, {}).spans(conv, "chat.jsonl:1")
    spans = ChatTemplate(source, {}).spans(conv[:1] + [{"role": "assistant", "content": "yes"}], "x")
    assert [t for t, c in spans if c] == ["yes<|end|>"]


def test_gemma3_counts_the_trimmed_content_and_folds_the_system_message_into_the_first_turn(fixed_date):
    source, special, _ = FAMILIES["gemma3"]
    conv = [*CONV[:2], {"role": "assistant", "content": "  hello \n"}, *CONV[3:5]]
    spans = ChatTemplate(source, special).spans(conv, "chat.jsonl:1")
    assert "".join(t for t, _ in spans) == transformers_text(source, special, conv)
    assert spans[0] == (
        "<bos><start_of_turn>user\nbe brief\n\nhi there<end_of_turn>\n<start_of_turn>model\n",
        0,
    )
    assert [t for t, c in spans if c] == ["hello<end_of_turn>\n", "see you<end_of_turn>\n"]


def test_a_template_with_generation_blocks_renders_as_transformers_does(fixed_date):
    """`{% generation %}` (transformers' assistant-mask blocks) renders its body: the spans are the
    same as without the blocks."""
    source, special, counted = FAMILIES["phi4"]
    marked = source.replace(
        "{{'<|im_start|>assistant<|im_sep|>' + message['content'] + '<|im_end|>'}}",
        "{{'<|im_start|>assistant<|im_sep|>'}}{% generation %}{{ message['content'] + '<|im_end|>' }}"
        "{% endgeneration %}",
    )
    assert marked != source
    spans = ChatTemplate(marked, special).spans(CONV, "chat.jsonl:1")
    assert "".join(t for t, _ in spans) == transformers_text(marked, special, CONV)
    assert spans == ChatTemplate(source, special).spans(CONV, "chat.jsonl:1")


def test_a_templates_date_is_fixed_not_the_day_prepare_ran():
    source, special, _ = FAMILIES["gpt-oss"]
    text = ChatTemplate(source, special).render(CONV)
    assert f"Current date: {TEMPLATE_DATE:%Y-%m-%d}\n" in text


def test_a_conversation_the_template_cannot_be_cut_in_is_refused_in_one_line():
    # a template that leaves out every assistant turn but the last: the earlier ones are not there to count
    source = FAMILIES["phi4"][0].replace(
        "{% elif (message['role'] == 'assistant') %}",
        "{% elif (message['role'] == 'assistant' and loop.last) %}",
    )
    with pytest.raises(
        DataError, match=r"^chat\.jsonl:3: .* cannot be cut .* write prompt/completion records"
    ):
        ChatTemplate(source, {}).spans(CONV, "chat.jsonl:3")
    with pytest.raises(DataError, match=r"^chat\.jsonl:4: the chat template refused .* must alternate"):
        ChatTemplate(MIXTRAL, {}).spans([CONV[0], CONV[2], CONV[1]], "chat.jsonl:4")
    with pytest.raises(DataError, match=r"^chat\.jsonl:5: .* opens with an assistant turn .* no element 0"):
        ChatTemplate(FAMILIES["qwen3"][0], {}).spans(CONV[2:], "chat.jsonl:5")


def family_checkpoint(root: Path, family: str) -> Path:
    """A word-level tokenizer.json that holds the family's markers as special tokens, with the family's
    template and special tokens in tokenizer_config.json, as a checkpoint directory holds them."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    source, special, _ = FAMILIES[family]
    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(
        [ChatTemplate(source, special).render(CONV)], trainers.WordLevelTrainer(special_tokens=["<unk>"])
    )
    tok.add_special_tokens(MARKERS)
    root.mkdir(parents=True, exist_ok=True)
    tok.save(str(root / "tokenizer.json"))
    (root / "tokenizer_config.json").write_text(json.dumps({**special, "chat_template": source}))
    return root


def prepared_conversation(tmp_path: Path, family: str, workers: int, template_args: dict | None = None):
    """`prepare --sft` of CONV with `family`'s template (given `template_args`) in `workers` processes:
    (prepare.json's dict, the token ids, the loss marks, the tokenizer, transformers'
    apply_chat_template text of CONV with the same arguments)."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer  # the prepare extra's, as jaxzero.data.tokenizer imports it

    source, special, _ = FAMILIES[family]
    ckpt = family_checkpoint(tmp_path / "ckpt", family)
    (tmp_path / "chat.jsonl").write_text(json.dumps({"messages": CONV}) + "\n")
    given = {} if template_args is None else {"template_args": template_args}
    out = tmp_path / "out"
    meta = prepare(
        [str(tmp_path / "chat.jsonl")], out, tokenizer=str(ckpt), sft=True, workers=workers, eot_id=0,
        progress=False, **given,
    )  # fmt: skip
    ids = np.fromfile(out / "train.bin", np.uint16)
    marks = np.fromfile(out / "train.mask.bin", np.uint8)
    hf = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(ckpt / "tokenizer.json"), chat_template=source, **special
    )
    text = hf.apply_chat_template(CONV, tokenize=False, **(template_args or {}))
    return meta, ids, marks, Tokenizer.from_file(str(ckpt / "tokenizer.json")), text


@pytest.mark.parametrize(("family", "workers"), [(f, 1) for f in sorted(FAMILIES)] + [("qwen3", 2)])
def test_prepare_writes_transformers_tokens_and_counts_the_assistant_turns(
    tmp_path, family, workers, fixed_date
):
    """Through `prepare` (in worker processes too): the tokens are those of transformers'
    apply_chat_template text, then the end-of-text id; the counted ones are each turn's, in order."""
    meta, ids, marks, tok, text = prepared_conversation(tmp_path, family, workers)
    assert ids[:-1].tolist() == tok.encode(text, add_special_tokens=False).ids and ids[-1] == 0
    want = [i for t in FAMILIES[family][2] for i in tok.encode(t, add_special_tokens=False).ids]
    assert ids[marks == 1].tolist() == want and marks[-1] == 0
    assert meta["train"]["loss_tokens"] == len(want)
