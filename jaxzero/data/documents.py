"""The documents `python -m jaxzero.prepare` reads: input globs expanded to files, each file cut into
spans that processes read on their own (`spans`), and each span's documents (a text file, one document;
JSONL records' text field; a Parquet column) or fine-tuning examples (JSONL prompt/completion or chat
messages), each bad record refused naming its file and line."""

from __future__ import annotations

import glob
import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jaxzero.data.types import DataError


def expand_inputs(patterns: Sequence[str]) -> list[Path]:
    """The files the globs match, each pattern's sorted, in pattern order, without repeats."""
    files: list[Path] = []
    for pattern in patterns:
        matched = sorted(glob.glob(pattern, recursive=True))
        if not matched:
            raise DataError(f"--input={pattern!r} matches no file.")
        for m in matched:
            p = Path(m)
            if p.is_dir():
                raise DataError(
                    f"--input={pattern!r} matches the directory {m}; give files or a glob of files."
                )
            if p not in files:
                files.append(p)
    return files


# Bytes of JSONL per span: enough to keep an encoding process busy for a while, few enough that the
# progress line moves and the spans read ahead of the writer stay small in memory.
_SPAN_BYTES = 1 << 20


@dataclass(frozen=True)
class Span:
    """A piece of one input file that a process reads and encodes alone, small to send: JSONL lines
    `[start, end)` by byte offset, `first` the number of the first (for messages); a Parquet file's row
    group `start`, `first` the number of its first row; a text file whole (`start = end = first = 0`)."""

    path: Path
    start: int = 0
    end: int = 0
    first: int = 0


def spans(path: Path, text_field: str, sft: bool) -> Iterator[Span]:
    """The spans of one input file, in order (a JSONL file is read through once to cut it at line
    ends). A file that cannot be read, a Parquet file without the column, or `sft` of anything but
    JSONL: DataError naming the file."""
    if sft and path.suffix != ".jsonl":
        raise DataError(f"{path}: --sft reads JSONL records (.jsonl), one example per line.")
    try:
        if path.suffix == ".jsonl":
            with path.open("rb") as f:
                start, line = 0, 1
                while block := f.read(_SPAN_BYTES):
                    if not block.endswith(b"\n"):
                        block += f.readline()  # the rest of the last line, so that lines stay whole
                    yield Span(path, start, start + len(block), line)
                    start, line = start + len(block), line + block.count(b"\n")
        elif path.suffix == ".parquet":
            first = 1
            for group, rows in enumerate(_parquet_row_groups(path, text_field)):
                yield Span(path, group, group, first)
                first += rows
        else:
            with path.open("rb"):  # readable: the error here, in order, not in a worker
                yield Span(path)
    except OSError as e:
        raise DataError(f"{path}: cannot be read: {e.strerror or e}.") from e


def read_documents(span: Span, text_field: str) -> Iterator[str]:
    """The documents of one span; DataError naming the file (and line or row) on bad input."""
    path = span.path
    try:
        if path.suffix == ".jsonl":
            for line_no, record in _json_lines(span):
                text = record.get(text_field)
                if not isinstance(text, str):
                    raise DataError(
                        f"{path}:{line_no}: no text field {text_field!r} (a string) in this record "
                        f"(it has {sorted(record)}); set --text_field."
                    )
                yield text
        elif path.suffix == ".parquet":
            yield from _parquet_documents(span, text_field)
        else:
            data = path.read_bytes()
            try:
                yield data.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataError(f"{path}: not UTF-8 text (byte {e.start}: {e.reason}).") from e
    except OSError as e:
        raise DataError(f"{path}: cannot be read: {e.strerror or e}.") from e


def _parquet_file(path: Path, text_field: str) -> Any:
    try:
        import pyarrow.parquet as pq  # optional (jaxzero[prepare]): only Parquet inputs need it
    except ImportError as e:
        raise DataError(
            f"{path}: reading Parquet needs pyarrow: pip install 'jaxzero[prepare]' (or pip install pyarrow)."
        ) from e
    try:
        pf = pq.ParquetFile(path)
    except Exception as e:  # pyarrow's ArrowInvalid and friends
        raise DataError(f"{path}: not a Parquet file pyarrow reads: {e}") from e
    if text_field not in pf.schema_arrow.names:
        raise DataError(
            f"{path}: no column {text_field!r} (it has {pf.schema_arrow.names}); set --text_field."
        )
    return pf


def _parquet_row_groups(path: Path, text_field: str) -> list[int]:
    """The rows of each row group of a Parquet file holding the column `text_field`."""
    meta = _parquet_file(path, text_field).metadata
    return [meta.row_group(g).num_rows for g in range(meta.num_row_groups)]


def _parquet_documents(span: Span, text_field: str) -> Iterator[str]:
    path, pf = span.path, _parquet_file(span.path, text_field)
    row = span.first - 1
    for batch in pf.iter_batches(columns=[text_field], row_groups=[span.start]):
        for text in batch.column(0).to_pylist():
            row += 1
            if not isinstance(text, str):
                raise DataError(f"{path}: row {row}: {text_field!r} is {text!r}, not a string.")
            yield text


# A message's reasoning, passed to the chat template as the checkpoints' templates read it: Qwen3's
# `reasoning_content`, gpt-oss's `thinking` (each template decides where, and whether, it is written).
REASONING_KEYS = ("reasoning_content", "thinking")


@dataclass(frozen=True)
class Example:
    """One fine-tuning record: prompt and completion, or chat messages; `where` is its file:line."""

    where: str
    prompt: str = ""
    completion: str = ""
    messages: list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None  # the record's function schemas, given to the template

    @property
    def chars(self) -> int:
        if self.messages is None:
            return len(self.prompt) + len(self.completion)
        return sum(len(m["content"] or "") for m in self.messages)


def read_examples(span: Span) -> Iterator[Example]:
    """The fine-tuning examples of a span of a JSONL file; DataError naming the file and line on bad
    records."""
    path = span.path
    for line_no, record in _json_lines(span):
        where = f"{path}:{line_no}"
        if "messages" in record:
            messages, tools = _chat(record, where)
            yield Example(where, messages=messages, tools=tools)
        elif isinstance(record.get("prompt"), str) and isinstance(record.get("completion"), str):
            yield Example(where, prompt=record["prompt"], completion=record["completion"])
        else:
            raise DataError(
                f'{where}: a fine-tuning record holds "prompt" and "completion" strings, or '
                f'"messages"; this one has {sorted(record)}.'
            )


# What a message passes to the chat template beside its role and content: its reasoning, the
# function calls of an assistant turn, and a tool message's call id and function name.
_CALL_KEYS = {"tool_calls": list, "tool_call_id": str, "name": str}


def _chat(record: dict[str, Any], where: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """A messages record's messages (the keys a template reads kept) and its "tools" (None without);
    DataError naming the record and the fix where they are malformed."""
    msgs = record["messages"]

    def content_ok(m: dict[str, Any]) -> bool:  # a turn that calls functions may have no content
        return isinstance(m.get("content"), str) or (m.get("content") is None and bool(m.get("tool_calls")))

    ok = (
        isinstance(msgs, list)
        and msgs
        and all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in msgs)
    )
    if not ok or not all(content_ok(m) for m in msgs) or not any(m["role"] == "assistant" for m in msgs):
        raise DataError(
            f'{where}: messages must be a list of {{"role": str, "content": str}} with at least '
            'one assistant turn (what the loss trains); an assistant turn with "tool_calls" may have '
            '"content": null.'
        )
    for i, m in enumerate(msgs):
        for key in REASONING_KEYS:
            if key in m and not isinstance(m[key], str):
                raise DataError(f"{where}: message {i}'s {key!r} must be a string, not {m[key]!r}.")
        for key, kind in _CALL_KEYS.items():
            if key in m and not isinstance(m[key], kind):
                raise DataError(f"{where}: message {i}'s {key!r} must be a {kind.__name__}, not {m[key]!r}.")
        if "tool_calls" in m and not all(isinstance(c, dict) for c in m["tool_calls"]):
            raise DataError(
                f'{where}: message {i}\'s "tool_calls" must be a list of objects (e.g. {{"type": "function", '
                f'"function": {{"name": ..., "arguments": {{...}}}}}}), not {m["tool_calls"]!r}.'
            )
    tools = record.get("tools")
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise DataError(
            f'{where}: "tools" must be a list of function schemas (JSON objects, as transformers\' '
            f"apply_chat_template takes them), not {tools!r}."
        )
    kept = ("role", "content", *REASONING_KEYS, *_CALL_KEYS)
    return [{k: m[k] for k in kept if k in m} for m in msgs], tools


def _json_lines(span: Span) -> Iterator[tuple[int, dict[str, Any]]]:
    path = span.path
    with path.open("rb") as f:
        f.seek(span.start)
        lines = f.read(span.end - span.start).split(b"\n")  # as a file's lines: "\r" is no line end
    for line_no, raw in enumerate(lines, span.first):
        if not raw.strip():
            continue
        try:
            record = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise DataError(f"{path}:{line_no}: not a JSON object: {e}") from e
        if not isinstance(record, dict):
            raise DataError(f"{path}:{line_no}: not a JSON object but a {type(record).__name__}.")
        yield line_no, record
