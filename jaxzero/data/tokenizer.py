"""Text to token ids and back: the built-in byte-level tokenizer, a Hugging Face `tokenizer.json`
through the `tokenizers` library (offline), and the tokenizer a run's data was prepared with.

`jaxzero.prepare` writes `prepare.json` beside the token files it makes; its recipe names the
tokenizer and the end-of-text id, so decoding (`python -m jaxzero.generate`, the samples at the end of
a run) uses the same ones.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from jaxzero.config import ConfigError, TrainConfig
from jaxzero.data.sources import BUILTIN_SEPARATOR, BUILTIN_VOCAB_SIZE
from jaxzero.data.types import DataError

# The recipe `jaxzero.prepare` writes beside its token files.
META_NAME = "prepare.json"


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255 (the built-in corpus's tokenizer)."""

    vocab_size = BUILTIN_VOCAB_SIZE
    eot_id = BUILTIN_SEPARATOR[0]

    def encode(self, texts: Sequence[str]) -> list[np.ndarray]:
        return [np.frombuffer(t.encode("utf-8"), np.uint8) for t in texts]


class HFTokenizer:
    """A `tokenizer.json` through the `tokenizers` library; no special tokens added."""

    def __init__(self, path: Path) -> None:
        try:
            from tokenizers import Tokenizer  # optional (jaxzero[prepare]): only --tokenizer needs it
        except ImportError as e:
            raise DataError(
                "--tokenizer needs the `tokenizers` library: pip install 'jaxzero[prepare]' "
                "(or pip install tokenizers); without --tokenizer the built-in byte-level one is used."
            ) from e
        try:
            self.tok = Tokenizer.from_file(str(path))
        except Exception as e:  # the library raises its own Exception type for a bad file
            raise DataError(f"{path} is not a tokenizer.json the tokenizers library reads: {e}") from e
        self.vocab_size = self.tok.get_vocab_size(with_added_tokens=True)

    def encode(self, texts: Sequence[str]) -> list[np.ndarray]:
        return [
            np.asarray(e.ids, np.uint32) for e in self.tok.encode_batch(list(texts), add_special_tokens=False)
        ]


def tokenizer_file(path: str) -> Path:
    """The tokenizer.json of a checkpoint directory, or `path` itself; DataError if there is none."""
    p = Path(path)
    file = p / "tokenizer.json" if p.is_dir() else p
    if not file.is_file():
        raise DataError(
            f"--tokenizer={path}: no tokenizer file at {file}. Pass a Hugging Face checkpoint directory "
            "holding tokenizer.json, or the tokenizer.json itself."
        )
    return file


def default_eot_id(file: Path, tok: HFTokenizer) -> int:
    """The id of `eos_token` in the tokenizer_config.json beside `file`; DataError naming the fix."""
    config = file.parent / "tokenizer_config.json"
    eos = None
    if config.is_file():
        try:
            eos = json.loads(config.read_text()).get("eos_token")
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise DataError(f"{config} is not valid JSON: {e}") from e
    if isinstance(eos, dict):  # {"content": "</s>", ...}
        eos = eos.get("content")
    token_id = tok.tok.token_to_id(eos) if isinstance(eos, str) else None
    if token_id is None:
        raise DataError(
            f"no end-of-text id for {file}: {config} names no eos_token in the vocabulary "
            f"(eos_token={eos!r}). Pass --eot_id=N."
        )
    return token_id


class TextCodec:
    """Text to ids and back with a run's tokenizer, and the id that ends a document."""

    def __init__(self, tokenizer: ByteTokenizer | HFTokenizer, stop_id: int | None) -> None:
        self.tokenizer, self.stop_id = tokenizer, stop_id

    def encode(self, text: str) -> list[int]:
        return [int(i) for i in self.tokenizer.encode([text])[0]]

    def decode(self, ids: Sequence[int]) -> str:
        if isinstance(self.tokenizer, ByteTokenizer):
            # A model's vocabulary may be wider than the bytes it trained on, and an id past them is no
            # byte: each is written as U+FFFD, as a byte that is no UTF-8 is.
            text, run = [], bytearray()
            for i in ids:
                if 0 <= i < 256:
                    run.append(i)
                    continue
                text += [bytes(run).decode("utf-8", errors="replace"), "\ufffd"]
                run.clear()
            return "".join([*text, bytes(run).decode("utf-8", errors="replace")])
        return self.tokenizer.tok.decode(list(ids))


def codec_for(cfg: TrainConfig, tokenizer: str | None = None) -> TextCodec:
    """The tokenizer a run's data was made with (module docstring), or `tokenizer` (a checkpoint
    directory or tokenizer.json) when given. ConfigError when neither says which."""
    if tokenizer:
        file = tokenizer_file(tokenizer)
        tok = HFTokenizer(file)
        try:
            stop: int | None = default_eot_id(file, tok)
        except DataError:
            stop = None
        return TextCodec(tok, stop)
    d = cfg.data
    if d.source == "builtin":
        return TextCodec(ByteTokenizer(), BUILTIN_SEPARATOR[0])
    meta_path = Path(d.path) / META_NAME
    if d.source == "tokens" and meta_path.is_file():
        recipe = json.loads(meta_path.read_text())["recipe"]
        if recipe["tokenizer"] == "bytes":
            return TextCodec(ByteTokenizer(), recipe["eot_id"])
        return TextCodec(HFTokenizer(tokenizer_file(recipe["tokenizer"])), recipe["eot_id"])
    raise ConfigError(
        f"no tokenizer is known for data.source={d.source} (data.path={d.path!r} has no {META_NAME}); "
        "pass --tokenizer=DIR (a checkpoint directory with tokenizer.json) or the tokenizer.json."
    )
