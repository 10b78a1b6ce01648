"""A checkpoint's chat template, rendered as transformers renders it, and cut into the spans a loss mask
counts (assistant turns) or leaves out (everything around them)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from jaxzero.data.types import DataError


class ChatTemplate:
    """A checkpoint's Jinja chat template, rendered as transformers' apply_chat_template renders it
    (sandboxed, trim_blocks and lstrip_blocks, `raise_exception`, `tojson`, the special tokens)."""

    def __init__(self, source: str, special: dict[str, str]) -> None:
        try:
            import jinja2.ext  # optional (jaxzero[prepare]): only chat-formatted fine-tuning data needs it
            from jinja2.sandbox import ImmutableSandboxedEnvironment  # with the line above
        except ImportError as e:
            raise DataError("rendering a chat template needs jinja2: pip install 'jaxzero[prepare]'.") from e

        def raise_exception(message: str) -> None:
            raise jinja2.exceptions.TemplateError(message)

        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
        )
        env.filters["tojson"] = lambda x, indent=None, **kw: json.dumps(
            x, ensure_ascii=False, indent=indent, **kw
        )
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: time.strftime(fmt)
        self.template = env.from_string(source)
        self.special = special
        self.source = source

    def __reduce__(self) -> Any:  # workers rebuild it from the source
        return (ChatTemplate, (self.source, self.special))

    @classmethod
    def of(cls, tokenizer_json: Path) -> ChatTemplate | None:
        """The template of the tokenizer_config.json beside `tokenizer_json`, or None without one."""
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
        for key in ("bos_token", "eos_token", "unk_token", "pad_token"):
            v = d.get(key)
            v = v.get("content") if isinstance(v, dict) else v
            if isinstance(v, str):
                special[key] = v
        return cls(source, special)

    def render(self, messages: list[dict[str, str]], add_generation_prompt: bool = False) -> str:
        return self.template.render(
            messages=messages, add_generation_prompt=add_generation_prompt, **self.special
        )

    def spans(self, messages: list[dict[str, str]], where: str) -> list[tuple[str, int]]:
        """The rendered conversation cut into (text, counted) spans: each assistant turn counted (1),
        the text around it not (0). A turn's span is what rendering it adds after the conversation
        before it with the generation prompt, so the prompt's header stays uncounted."""
        spans: list[tuple[str, int]] = []
        done = ""
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            before = self.render(messages[:i], add_generation_prompt=True)
            through = self.render(messages[: i + 1])
            if not (before.startswith(done) and through.startswith(before)):
                raise DataError(
                    f"{where}: the chat template does not render this conversation turn by turn "
                    "(an earlier rendering is not a prefix of a later one), so its assistant turns "
                    "cannot be told apart; write prompt/completion records instead."
                )
            spans += [(before[len(done) :], 0), (through[len(before) :], 1)]
            done = through
        rest = self.render(messages)[len(done) :]
        return [(t, c) for t, c in spans + [(rest, 0)] if t]
