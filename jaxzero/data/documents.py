"""The documents `python -m jaxzero.prepare` reads: input globs expanded to files, and each file's
documents (a text file, one document; JSONL records' text field; a Parquet column) or fine-tuning
examples (JSONL prompt/completion or chat messages), each bad record refused naming its file and line."""

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


def read_documents(path: Path, text_field: str) -> Iterator[str]:
    """The documents of one input file; DataError naming the file (and line or row) on bad input."""
    try:
        if path.suffix == ".jsonl":
            for line_no, record in _json_lines(path):
                text = record.get(text_field)
                if not isinstance(text, str):
                    raise DataError(
                        f"{path}:{line_no}: no text field {text_field!r} (a string) in this record "
                        f"(it has {sorted(record)}); set --text_field."
                    )
                yield text
        elif path.suffix == ".parquet":
            yield from _parquet_documents(path, text_field)
        else:
            data = path.read_bytes()
            try:
                yield data.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataError(f"{path}: not UTF-8 text (byte {e.start}: {e.reason}).") from e
    except OSError as e:
        raise DataError(f"{path}: cannot be read: {e.strerror or e}.") from e


def _parquet_documents(path: Path, text_field: str) -> Iterator[str]:
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
    row = 0
    for batch in pf.iter_batches(columns=[text_field]):
        for text in batch.column(0).to_pylist():
            row += 1
            if not isinstance(text, str):
                raise DataError(f"{path}: row {row}: {text_field!r} is {text!r}, not a string.")
            yield text


@dataclass(frozen=True)
class Example:
    """One fine-tuning record: prompt and completion, or chat messages; `where` is its file:line."""

    where: str
    prompt: str = ""
    completion: str = ""
    messages: list[dict[str, str]] | None = None

    @property
    def chars(self) -> int:
        if self.messages is None:
            return len(self.prompt) + len(self.completion)
        return sum(len(m["content"]) for m in self.messages)


def read_examples(path: Path) -> Iterator[Example]:
    """The fine-tuning examples of a JSONL file; DataError naming the file and line on bad records."""
    if path.suffix != ".jsonl":
        raise DataError(f"{path}: --sft reads JSONL records (.jsonl), one example per line.")
    for line_no, record in _json_lines(path):
        where = f"{path}:{line_no}"
        if "messages" in record:
            msgs = record["messages"]
            ok = (
                isinstance(msgs, list)
                and msgs
                and all(
                    isinstance(m, dict)
                    and isinstance(m.get("role"), str)
                    and isinstance(m.get("content"), str)
                    for m in msgs
                )
            )
            if not ok or not any(m["role"] == "assistant" for m in msgs):
                raise DataError(
                    f'{where}: messages must be a list of {{"role": str, "content": str}} with at least '
                    "one assistant turn (what the loss trains)."
                )
            yield Example(where, messages=[{"role": m["role"], "content": m["content"]} for m in msgs])
        elif isinstance(record.get("prompt"), str) and isinstance(record.get("completion"), str):
            yield Example(where, prompt=record["prompt"], completion=record["completion"])
        else:
            raise DataError(
                f'{where}: a fine-tuning record holds "prompt" and "completion" strings, or '
                f'"messages"; this one has {sorted(record)}.'
            )


def _json_lines(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    with path.open("rb") as f:
        for line_no, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            try:
                record = json.loads(raw)
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                raise DataError(f"{path}:{line_no}: not a JSON object: {e}") from e
            if not isinstance(record, dict):
                raise DataError(f"{path}:{line_no}: not a JSON object but a {type(record).__name__}.")
            yield line_no, record
