"""A checkpoint's chat template, rendered as transformers renders it, and cut into the spans a loss mask
counts (assistant turns) or leaves out (everything around them)."""

from __future__ import annotations

import datetime
import functools
import hashlib
import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, NoReturn

from jaxzero.data.documents import REASONING_KEYS
from jaxzero.data.types import DataError

# The date a template's `strftime_now` prints (gpt-oss's system message, Llama 3.2's): token files
# must not depend on the day they were prepared, so every preparation sees this one.
TEMPLATE_DATE = datetime.datetime(2026, 1, 1)

# Stand-ins for one assistant turn's content: private-use characters, which no template writes and
# `trim` keeps. Their first and last characters all differ, so a content that begins or ends like one
# of them cannot hide its edges from the other.
_SENTINELS = ("\ue000\ue001", "\ue002\ue003")

# A rendering of messages, with or without the generation prompt, the record's tools bound.
Render = Callable[..., str]

# The special tokens of tokenizer_config.json a rendering is given, as transformers gives them.
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token")

# Names a template argument cannot take: the variables every rendering is given (an argument would
# replace them), and apply_chat_template's own parameters (transformers never passes them to the template).
_RESERVED = {
    **dict.fromkeys(
        ("messages", "add_generation_prompt", *SPECIAL_TOKENS, "raise_exception", "strftime_now"),
        "a variable jaxzero gives every rendering itself",
    ),
    "tools": 'a variable each rendering is given from its record (a record\'s "tools")',
    "documents": "a variable jaxzero gives every rendering as None (it renders no documents)",
    **dict.fromkeys(
        (
            "conversation",
            "chat_template",
            "continue_final_message",
            "tokenize",
            "sanitize_control_tokens",
            "padding",
            "truncation",
            "max_length",
            "return_tensors",
            "return_dict",
            "return_assistant_tokens_mask",
            "tokenizer_kwargs",
        ),
        "a parameter of transformers' apply_chat_template, which never reaches the template",
    ),
}


def parse_template_args(pairs: Sequence[str]) -> dict[str, Any]:
    """`--template_arg KEY=VALUE` strings as the template's keyword arguments: VALUE as JSON where it
    parses (`false`, `3`, `"high"`), else the string itself. DataError for a malformed pair, a name
    given twice or one `check_template_args` refuses."""
    args: dict[str, Any] = {}
    for pair in pairs:
        key, eq, text = pair.partition("=")
        if not eq or not key.isidentifier():
            raise DataError(
                f"--template_arg {pair!r} is not KEY=VALUE with KEY a template variable's name (letters, "
                "digits and _, not starting with a digit): write e.g. --template_arg enable_thinking=false."
            )
        if key in args:
            raise DataError(
                f"--template_arg {key} is given twice ({args[key]!r} and {text!r}): give each name once."
            )
        try:  # NaN and Infinity, which Python's json reads, are no JSON: taken as strings
            args[key] = json.loads(text, parse_constant=_no_constant)
        except ValueError:
            args[key] = text
    return check_template_args(args)


def _no_constant(name: str) -> NoReturn:
    raise ValueError(name)


def check_template_args(args: Mapping[str, Any]) -> dict[str, Any]:
    """`args` as a plain dict, checked: names a template can read that no rendering is given anyway
    (`_RESERVED`), values that JSON holds (prepare.json records them). DataError naming the value and
    the fix otherwise."""
    for key, value in args.items():
        if not isinstance(key, str) or not key.isidentifier():
            raise DataError(
                f"template argument {key!r}: a name must be a template variable's (letters, digits and _, "
                "not starting with a digit)."
            )
        if key in _RESERVED:
            raise DataError(
                f"template argument {key}={value!r}: {key!r} is {_RESERVED[key]}, so it cannot be given "
                "as a template argument: leave it out (the arguments a template reads beside these, such "
                "as Qwen3's enable_thinking or gpt-oss's reasoning_effort, are the ones to give)."
            )
        try:
            json.dumps(value, allow_nan=False)
        except (TypeError, ValueError) as e:
            raise DataError(
                f"template argument {key}={value!r} is not a JSON value ({e}): give a string, number, "
                "boolean, null, list or object."
            ) from e
    return dict(args)


class ChatTemplate:
    """A checkpoint's Jinja chat template, rendered as transformers' apply_chat_template renders it
    (sandboxed, trim_blocks and lstrip_blocks, `raise_exception`, `tojson`, the special tokens), with
    `strftime_now` at `TEMPLATE_DATE`, and `arguments` passed to every rendering as
    `apply_chat_template(..., **arguments)` passes them (Qwen3's `enable_thinking`, gpt-oss's
    `reasoning_effort`), checked by `check_template_args`."""

    def __init__(
        self, source: str, special: dict[str, str], arguments: Mapping[str, Any] | None = None
    ) -> None:
        self.arguments = check_template_args(arguments or {})
        try:
            import jinja2.ext  # optional (jaxzero[prepare]): only chat-formatted fine-tuning data needs it
            from jinja2.sandbox import ImmutableSandboxedEnvironment  # with the line above
        except ImportError as e:
            raise DataError("rendering a chat template needs jinja2: pip install 'jaxzero[prepare]'.") from e

        def raise_exception(message: str) -> None:
            raise jinja2.exceptions.TemplateError(message)

        env = ImmutableSandboxedEnvironment(
            trim_blocks=True,
            lstrip_blocks=True,
            extensions=[jinja2.ext.loopcontrols, _generation_tag(jinja2)],
        )
        env.filters["tojson"] = lambda x, indent=None, **kw: json.dumps(
            x, ensure_ascii=False, indent=indent, **kw
        )
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = TEMPLATE_DATE.strftime
        self.template = env.from_string(source)
        self.special = special
        self.source = source
        self._errors = (jinja2.exceptions.TemplateError,)

    def __reduce__(self) -> Any:  # workers rebuild it from the source
        return (ChatTemplate, (self.source, self.special, self.arguments))

    def sha256(self) -> str:
        """A digest of everything a rendering depends on: the source, the special tokens it is given
        and the date `strftime_now` prints (the arguments are recorded beside it, `Recipe`)."""
        key = json.dumps([self.source, self.special, TEMPLATE_DATE.isoformat()], sort_keys=True)
        return hashlib.sha256(key.encode()).hexdigest()

    @classmethod
    def of(cls, tokenizer_json: Path, arguments: Mapping[str, Any] | None = None) -> ChatTemplate | None:
        """The template of the tokenizer_config.json beside `tokenizer_json`, given `arguments` at every
        rendering, or None without one."""
        config = tokenizer_json.parent / "tokenizer_config.json"
        if not config.is_file():
            return None
        d = json.loads(config.read_text())
        source = d.get("chat_template")
        if isinstance(source, list):  # [{"name": "default", "template": ...}, ...]
            source = next((t["template"] for t in source if t.get("name") == "default"), None)
        if not isinstance(source, str):
            return None
        special = {}
        for key in SPECIAL_TOKENS:
            v = d.get(key)
            v = v.get("content") if isinstance(v, dict) else v
            if isinstance(v, str):
                special[key] = v
        return cls(source, special, arguments)

    def render(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = False,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        """The template's text of `messages`, given `tools` (function schemas) and no documents, as
        transformers' apply_chat_template gives them (None where there are none)."""
        return self.template.render(
            messages=messages,
            tools=tools,
            documents=None,
            add_generation_prompt=add_generation_prompt,
            **self.special,
            **self.arguments,
        )

    def spans(
        self, messages: list[dict[str, Any]], where: str, tools: list[dict[str, Any]] | None = None
    ) -> list[tuple[str, int]]:
        """The rendered conversation cut into (text, counted) spans, which joined are its rendering: each
        assistant turn counted (1) from after the generation prompt's header through its end-of-turn
        marker, the text around it not (0). Templates that render the conversation turn by turn are cut
        where each turn's rendering ends (`_by_prefixes`); the others (a last turn rendered unlike an
        earlier one: Qwen3, gpt-oss, Phi-3) inside the one full rendering (`_located`). An assistant
        turn's function calls (`tool_calls`) are counted with it; `tools`, the record's function
        schemas, are given to every rendering."""
        render = functools.partial(self.render, tools=tools)
        try:
            cut = self._by_prefixes(messages, render)
            cut = cut if cut is not None else self._located(messages, where, render)
        except self._errors as e:
            raise DataError(
                f"{where}: the chat template refused this conversation, or the part of it before an "
                f"assistant turn (each turn is counted after the rendering of the messages before it; "
                f"a conversation that opens with an assistant turn has none): {e}"
            ) from e
        _check_reasoning(messages, cut, where)
        return cut

    def _by_prefixes(self, messages: list[dict[str, Any]], render: Render) -> list[tuple[str, int]] | None:
        """A turn's span is what rendering it adds after the conversation before it with the generation
        prompt, so the prompt's header stays uncounted; None where a rendering is not a prefix of the
        later ones."""
        spans: list[tuple[str, int]] = []
        done = ""
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            before = render(messages[:i], add_generation_prompt=True)
            through = render(messages[: i + 1])
            if not (before.startswith(done) and through.startswith(before)):
                return None
            spans += [(before[len(done) :], 0), (through[len(before) :], 1)]
            done = through
        full = render(messages)
        if not full.startswith(done):
            return None
        return [(t, c) for t, c in spans + [(full[len(done) :], 0)] if t]

    def _located(self, messages: list[dict[str, Any]], where: str, render: Render) -> list[tuple[str, int]]:
        """Each assistant turn found in the one full rendering: its content where the rendering changes
        when the content is replaced by a sentinel, its start after the first generation-prompt header
        after the message before it (else the last before the content; where only the header's beginning
        is written between the two, at the content; without a header: after the
        conversation before it, or where the message before it ends), its end after the end-of-turn
        marker the template writes after the content (as the last turn, or followed by another
        generation prompt) that the rendering goes on with."""
        full = render(messages)
        spans: list[tuple[str, int]] = []
        done = 0
        for k, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            # the header: what the generation prompt writes where the conversation before ends (Phi-3's
            # writes it instead of the end-of-text that rendering ends with otherwise)
            prompt = render(messages[:k], add_generation_prompt=True)
            context = render(messages[:k])
            at = len(context) if prompt.startswith(context) else _common_prefix(prompt, context)
            header = prompt[_token_edge(prompt, at) :]
            variants = [render(_replaced(messages, k, s)) for s in _SENTINELS]
            first = min(_common_prefix(full, v) for v in variants)  # where the content starts
            # and where it ends (an empty content where it starts: the suffixes may match into the header)
            last = max(len(full) - min(_common_suffix(full, v) for v in variants), first)
            if header:
                # the first header after the message before (gpt-oss writes a turn's reasoning under a
                # header of its own before the content's), else the last one before the content
                prev = self._end_of(messages, k - 1, full, render) if k else -1
                if done <= prev <= first:
                    start = full.find(header, prev, first)
                else:
                    start = full.rfind(header, done, first)
                if start >= 0:
                    start += len(header)
                elif done <= prev < first and header.startswith(full[prev:first]):
                    # the part of the header written for a turn before the last: Qwen3 with
                    # enable_thinking=false writes its empty think block only after the generation prompt
                    start = first
                else:
                    _refuse(where, f"message {k} (assistant) is not after a generation prompt {header!r}")
            elif full.startswith(prompt) and done <= len(prompt) <= first:
                start = len(prompt)
            elif k and done <= (start := self._end_of(messages, k - 1, full, render)) <= first:
                pass  # no header (Mistral's) and a context rendered otherwise: after the message before
            else:
                _refuse(where, f"the rendering does not begin with the conversation before message {k}")
            markers = [
                e for e in self._end_markers(messages[:k], m, header, render) if full.startswith(e, last)
            ]
            if not markers or last < start:
                _refuse(
                    where, f"message {k} (assistant) is not followed by an end-of-turn the template writes"
                )
            end = last + max(map(len, markers))
            spans += [(full[done:start], 0), (full[start:end], 1)]
            done = end
        return [(t, c) for t, c in spans + [(full[done:], 0)] if t]

    def _end_of(self, messages: list[dict[str, Any]], j: int, full: str, render: Render) -> int:
        """Where message `j` ends in `full`, the rendering of `messages`: after its content (where the
        rendering changes when the content is replaced by a sentinel) and the text the template writes
        after it as the last message; -1 where `full` does not go on with that text."""
        variants = [render(_replaced(messages, j, s)) for s in _SENTINELS]
        last = len(full) - min(_common_suffix(full, v) for v in variants)
        text = render(_replaced(messages[: j + 1], j, _SENTINELS[0]))
        at = text.rfind(_SENTINELS[0])
        after = text[at + len(_SENTINELS[0]) :]
        return last + len(after) if at >= 0 and full.startswith(after, last) else -1

    def _end_markers(
        self, context: list[dict[str, Any]], message: dict[str, Any], header: str, render: Render
    ) -> list[str]:
        """What the template writes after the content of the assistant turn `message` (its function
        calls, its end of turn) that follows `context`: as the conversation's last message, and
        followed by the generation prompt (`header`, taken off); after a sentinel content, and after
        the turn's own where the template writes it as given (what follows may depend on it: Qwen3
        writes a newline before a function call only after content)."""
        plain = {k: v for k, v in message.items() if k not in REASONING_KEYS}
        content = plain.get("content") or ""
        markers = []
        for prompt in (False, True):
            text = render([*context, {**plain, "content": _SENTINELS[0]}], add_generation_prompt=prompt)
            at = text.rfind(_SENTINELS[0])
            afters = [text[at + len(_SENTINELS[0]) :]] if at >= 0 else []
            own = render([*context, plain], add_generation_prompt=prompt)
            at = _common_prefix(own, text)
            if own.startswith(content, at):
                afters.append(own[at + len(content) :])
            for after in afters:
                if prompt and header:
                    if not after.endswith(header):
                        continue
                    after = after[: -len(header)]
                markers.append(after)
        return markers


def _generation_tag(jinja2: Any) -> type:
    """transformers' `{% generation %}...{% endgeneration %}` block (its tracker of assistant tokens),
    rendering its body as transformers does: templates written for assistant masks render unchanged."""

    class Generation(jinja2.ext.Extension):
        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            return caller()

    return Generation


def _replaced(messages: list[dict[str, Any]], k: int, content: str) -> list[dict[str, Any]]:
    """`messages` with message `k`'s content replaced."""
    return [{**m, "content": content} if i == k else m for i, m in enumerate(messages)]


def _common_prefix(a: str, b: str) -> int:
    """The length of the longest common prefix of `a` and `b` (a binary search over slice compares)."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _common_suffix(a: str, b: str) -> int:
    """The length of the longest common suffix of `a` and `b`."""
    return _common_prefix(a[::-1], b[::-1])


def _token_edge(text: str, at: int) -> int:
    """`at`, moved back to the start of the special token (`<...>`, `[...]`) it falls inside: two
    renderings that part inside one (`<|end|>` and `<|assistant|>` share `<|`) part at its start."""
    for opening, closing in (("<", ">"), ("[", "]")):
        start = text.rfind(opening, 0, at)
        if start >= 0 and closing not in text[start:at]:
            at = start
    return at


def _refuse(where: str, why: str) -> NoReturn:
    raise DataError(
        f"{where}: the chat template's rendering of this conversation cannot be cut into its assistant "
        f"turns ({why}); write prompt/completion records instead."
    )


def _check_reasoning(messages: list[dict[str, Any]], cut: list[tuple[str, int]], where: str) -> None:
    """A turn's reasoning (`reasoning_content`, `thinking`) that the template writes is counted with
    its turn; DataError where it is written outside it (the loss would not train it)."""
    counted = [t for t, c in cut if c]
    turns = [m for m in messages if m["role"] == "assistant"]
    text = "".join(t for t, _ in cut)
    for n, m in enumerate(turns):
        for key in REASONING_KEYS:
            reasoning = m.get(key, "").strip()
            if reasoning and reasoning in text and (n >= len(counted) or reasoning not in counted[n]):
                raise DataError(
                    f"{where}: assistant turn {n}'s {key!r} is written by the chat template outside the "
                    f"text the turn's loss counts, so training would not learn it: leave {key!r} out of "
                    "the record, or write the reasoning into the content as the template expects it."
                )
