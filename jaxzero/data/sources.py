"""Where tokens come from: the built-in corpus (byte tokens of this Python's standard library source)
and nanoGPT token files (memmapped, checked against the vocabulary, with their loss-mask files and
the index of where each fine-tuning example starts); `write_tokens` writes such a file. Synthetic
tokens have no source: `jaxzero.data.batches` draws them."""

from __future__ import annotations

import logging
import os
import sys
import sysconfig
import tempfile
from pathlib import Path
from typing import Literal

import numpy as np

from jaxzero.data.eot import PREPARE_META, prepared_meta
from jaxzero.data.types import DataError, TokenSplits

log = logging.getLogger(__name__)  # the library speaks through logging (`jaxzero.run.console`)

BUILTIN_VOCAB_SIZE = 256
# 8 MiB: ~8M byte tokens, plenty for a tiny model to learn Python's surface syntax, and quick to read
# from a warm page cache. The stdlib has more .py source than that outside tests, so the cap binds.
BUILTIN_MAX_BYTES = 8 * 1024 * 1024
# Appended after every file. NUL never occurs in Python source, so it is an unambiguous end-of-document
# token that a sampler can also stop on.
BUILTIN_SEPARATOR = b"\x00"
# Directories under the stdlib that are not "the standard library's own source": third-party packages
# (site-packages, Debian's dist-packages), the huge test suites, and IDLE.
_BUILTIN_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idlelib", "__pycache__"})

_TOKEN_DTYPES: dict[str, np.dtype] = {"uint16": np.dtype(np.uint16), "uint32": np.dtype(np.uint32)}
# The full vocab check (`data.check_tokens`, the default) takes the max of every id in chunks of this
# many tokens (a vectorised pass over the memmap, one read of the whole file). The sampled check reads
# at most _VOCAB_CHECK_TOKENS per file in _VOCAB_CHECK_CHUNKS evenly spaced chunks (head, middle,
# tail...): a bounded read whatever the file's size, and it still catches a wrong dtype or tokenizer.
_FULL_CHECK_CHUNK = 1 << 26
_VOCAB_CHECK_TOKENS = 4 * 1024 * 1024
_VOCAB_CHECK_CHUNKS = 4


def _split_tail(tokens: np.ndarray, val_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """Views ``(head, tail)`` with the last ``floor(len * val_fraction)`` tokens as the tail."""
    n_val = int(len(tokens) * val_fraction)
    return tokens[: len(tokens) - n_val], tokens[len(tokens) - n_val :]


def _builtin_source_files(root: Path) -> list[Path]:
    """The stdlib's own ``.py`` files under `root`, sorted by path relative to `root`.

    Sorting by the relative POSIX path (not the absolute one, not os.walk order) makes the corpus a
    function of the Python install's contents only.
    """
    found: list[tuple[str, Path]] = []
    # onerror=None: an unreadable directory is skipped, as the brief for this source asks.
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _BUILTIN_SKIP_DIRS and not d.startswith(".")]
        for name in filenames:
            if name.endswith(".py"):
                path = Path(dirpath) / name
                found.append((path.relative_to(root).as_posix(), path))
    found.sort(key=lambda rel_path: rel_path[0])
    return [path for _, path in found]


def load_builtin_corpus(val_fraction: float, max_bytes: int = BUILTIN_MAX_BYTES) -> TokenSplits:
    """Byte tokens (uint8, vocab 256) of this Python's standard library source, capped at `max_bytes`.

    Files (see `_BUILTIN_SKIP_DIRS` for what is left out) are read in sorted relative-path order, each
    followed by `BUILTIN_SEPARATOR`, and the concatenation is cut at exactly `max_bytes` (or is shorter if
    the stdlib is). Unreadable files are skipped. Deterministic for a given Python install. The last
    `val_fraction` of the bytes is the validation split.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    if not root.is_dir():
        raise DataError(
            f"data.source=builtin reads the Python standard library, but {str(root)!r} (sysconfig's stdlib "
            "path) is not a directory in this install; use data.source=tokens or data.source=synthetic."
        )
    parts: list[bytes] = []
    total = 0
    num_files = 0
    for path in _builtin_source_files(root):
        if total >= max_bytes:
            break
        try:
            content = path.read_bytes()
        except OSError:
            continue
        parts.append(content)
        parts.append(BUILTIN_SEPARATOR)
        total += len(content) + len(BUILTIN_SEPARATOR)
        num_files += 1
    corpus = b"".join(parts)[:max_bytes]
    if not corpus:
        raise DataError(
            f"data.source=builtin found no readable .py files under {str(root)!r}; use data.source=tokens "
            "or data.source=synthetic."
        )
    # frombuffer over immutable bytes gives a read-only array: batches copy out of it, nothing writes.
    tokens = np.frombuffer(corpus, dtype=np.uint8)
    train, val = _split_tail(tokens, val_fraction)
    version = ".".join(str(v) for v in sys.version_info[:3])
    origin = f"Python {version} stdlib source bytes ({num_files} files, {len(tokens) / 2**20:.1f} MiB)"
    return TokenSplits(train=train, val=val, vocab_size=BUILTIN_VOCAB_SIZE, origin=origin)


def _listing(directory: Path, limit: int = 20) -> str:
    """A short, sorted listing of `directory` for error messages (subdirectories end in '/')."""
    try:
        entries = sorted(p.name + ("/" if p.is_dir() else "") for p in directory.iterdir())
    except OSError as e:
        return f"(can not list it: {e.strerror})"
    if not entries:
        return "(nothing: it is empty)"
    shown = ", ".join(entries[:limit])
    return shown + (f", ... and {len(entries) - limit} more" if len(entries) > limit else "")


def _check_token_file_size(path: Path, token_dtype: str) -> int:
    """Number of tokens in `path`, after checking its byte size fits `token_dtype`."""
    size = path.stat().st_size
    itemsize = _TOKEN_DTYPES[token_dtype].itemsize
    if size % itemsize:
        if token_dtype == "uint32" and size % 2 == 0:
            hint = "it may hold uint16 tokens: set data.token_dtype=uint16."
        else:
            hint = (
                "an odd byte count fits neither uint16 nor uint32: the file is truncated or is not a "
                "flat token array (write one with jaxzero.data.write_tokens)."
            )
        raise DataError(
            f"{str(path)!r} has {size:,} bytes, not a multiple of {itemsize} "
            f"(data.token_dtype={token_dtype}); {hint}"
        )
    return size // itemsize


def _check_token_ids(tokens: np.ndarray, vocab_size: int, path: Path, token_dtype: str, full: bool) -> None:
    """Raise if a token id is ``>= vocab_size``: over every token (`full`), else over a bounded sample of
    at most `_VOCAB_CHECK_TOKENS` tokens."""
    n = len(tokens)
    if full or n <= _VOCAB_CHECK_TOKENS:
        chunk = min(n, _FULL_CHECK_CHUNK) if full else n
        offsets = list(range(0, n, chunk))
    else:
        chunk = _VOCAB_CHECK_TOKENS // _VOCAB_CHECK_CHUNKS
        offsets = [int(o) for o in np.linspace(0, n - chunk, _VOCAB_CHECK_CHUNKS)]
    for off in offsets:
        part = np.asarray(tokens[off : off + chunk])
        if part.size == 0:
            continue
        top = int(part.max())
        if top >= vocab_size:
            first = off + int(np.argmax(part >= vocab_size))
            # uint16 ids read as uint32 fuse in pairs into huge ids, so that is the likely mistake then;
            # the reverse (uint32 read as uint16) gives small ids, every other one 0, which no cheap check
            # can tell from real data.
            dtype_hint = (
                " or, if the file was written as uint16, set data.token_dtype=uint16"
                if token_dtype == "uint32"
                else ""
            )
            raise DataError(
                f"{str(path)!r}: token id {int(tokens[first])} at position {first:,} is >= "
                f"model.vocab_size={vocab_size} (largest id in that chunk: {top}). Set model.vocab_size "
                f"to at least {top + 1} (the tokenizer's vocab, e.g. 50304 for GPT-2 BPE){dtype_hint}."
            )


def _open_token_file(path: Path, token_dtype: str) -> np.ndarray:
    """A read-only 1-D memmap of `path` (size already checked, non-empty)."""
    return np.memmap(path, dtype=_TOKEN_DTYPES[token_dtype], mode="r")


def token_dtype_of(directory: Path, token_dtype: str) -> str:
    """The dtype of the token files in `directory`: `token_dtype` ("uint16", "uint32"), or for "auto"
    the one its ``prepare.json`` records (jaxzero.prepare writes uint32 for a vocabulary over 65,536: Llama 3,
    Qwen), else (no file, or one that records none) uint16, nanoGPT's. DataError where `token_dtype`
    contradicts ``prepare.json``: read as the other dtype, every id would be garbage."""
    if token_dtype not in ("auto", *_TOKEN_DTYPES):
        raise DataError(f"data.token_dtype={token_dtype!r} is not one of {['auto', *_TOKEN_DTYPES]}.")
    meta = directory / PREPARE_META
    prepared = prepared_meta(directory)
    recorded = None if prepared is None else prepared.get("token_dtype")
    if prepared is not None:
        if recorded is not None and recorded not in _TOKEN_DTYPES:
            raise DataError(
                f"{meta} records token_dtype={recorded!r}, not one of {list(_TOKEN_DTYPES)}; rerun "
                "jaxzero.prepare, or remove the file and pass --data.token_dtype."
            )
    if token_dtype == "auto":
        return recorded or "uint16"
    if recorded is not None and recorded != token_dtype:
        raise DataError(
            f"data.token_dtype={token_dtype} contradicts {meta}, which says its token files hold "
            f"{recorded}: drop --data.token_dtype (its default, auto, reads {PREPARE_META}) or set it to "
            f"{recorded}."
        )
    return token_dtype


def load_token_files(
    path: str | os.PathLike[str],
    *,
    token_dtype: Literal["auto", "uint16", "uint32"],
    seq_len: int,
    val_fraction: float,
    vocab_size: int,
    check_all: bool = True,
) -> TokenSplits:
    """Memmap nanoGPT token files ``path/train.bin`` and, if present, ``path/val.bin``, of
    `token_dtype` ("auto": `token_dtype_of`).

    Everything cheap is checked before any token is read: the directory and files exist, byte sizes are
    multiples of the dtype size, and each split holds at least one window of ``seq_len + 1`` tokens. Then
    every token id (`check_all`), or a bounded sample of each file, is checked against `vocab_size`.
    Without ``val.bin`` the last `val_fraction` of ``train.bin`` is validation (of its examples, where
    ``train.idx.bin`` indexes them). Loss masks (``*.mask.bin``) and example indexes (``*.idx.bin``,
    read whole) come with their token files. Returned token arrays are memmap views (never loaded whole).
    """
    directory = Path(path)
    if not directory.exists():
        parent = directory.parent
        where = (
            f"its parent {str(parent)!r} holds: {_listing(parent)}"
            if parent.is_dir()
            else f"nor does its parent {str(parent)!r}"
        )
        raise DataError(
            f"data.path={str(directory)!r} does not exist ({where}). Point data.path at the directory "
            "holding train.bin (and optionally val.bin): flat uint16/uint32 token arrays, as written by "
            "jaxzero.data.write_tokens or nanoGPT's prepare.py."
        )
    if not directory.is_dir():
        raise DataError(
            f"data.path={str(directory)!r} is a file; data.path must be the directory holding train.bin "
            f"(and optionally val.bin), e.g. data.path={str(directory.parent)!r}."
        )
    train_path, val_path = directory / "train.bin", directory / "val.bin"
    if not train_path.is_file():
        raise DataError(
            f"{str(train_path)!r} not found; {str(directory)!r} holds: {_listing(directory)}. "
            "data.source=tokens needs DIR/train.bin (and optionally DIR/val.bin), flat arrays of "
            "uint16/uint32 token ids; write them with jaxzero.data.write_tokens."
        )
    token_dtype = token_dtype_of(directory, token_dtype)
    has_val_file = val_path.is_file()
    n_train_file = _check_token_file_size(train_path, token_dtype)
    n_val_file = _check_token_file_size(val_path, token_dtype) if has_val_file else 0

    # Lengths of the splits, from sizes alone, so a too-short file fails before anything is mapped.
    n_held_out = 0 if has_val_file else int(n_train_file * val_fraction)
    n_train = n_train_file - n_held_out
    if n_train < seq_len + 1:
        held = (
            f" after holding out its last {n_held_out:,} for validation (data.val_fraction={val_fraction})"
            if n_held_out
            else ""
        )
        raise DataError(
            f"{str(train_path)!r} holds {n_train_file:,} {token_dtype} tokens, leaving {n_train:,} for "
            f"training{held}, but one sequence needs data.seq_len+1 = {seq_len + 1}. Use more data or "
            "lower data.seq_len."
        )
    if has_val_file and n_val_file < seq_len + 1:
        raise DataError(
            f"{str(val_path)!r} holds {n_val_file:,} {token_dtype} tokens, but one sequence needs "
            f"data.seq_len+1 = {seq_len + 1}. Write a longer val.bin, lower data.seq_len, or delete "
            "val.bin to hold out the tail of train.bin instead."
        )

    train_marks = _open_marks(directory / "train.mask.bin", n_train_file)
    val_marks = _open_marks(directory / "val.mask.bin", n_val_file) if has_val_file else None
    if has_val_file:
        _both_or_neither(
            directory, "mask", train_marks, val_marks, "mark the targets the loss counts",
            "Rerun jaxzero.prepare, or remove the one.",
        )  # fmt: skip
    train_starts = _open_starts(directory / "train.idx.bin", n_train_file)
    val_starts = _open_starts(directory / "val.idx.bin", n_val_file) if has_val_file else None
    if has_val_file:
        _both_or_neither(
            directory, "idx", train_starts, val_starts, "index their fine-tuning examples",
            "Rerun jaxzero.prepare --sft.",
        )  # fmt: skip
    if train_marks is not None and train_starts is None:
        log.warning(
            "warning: %r holds fine-tuning examples prepared without train.idx.bin (where each example "
            "starts): training reads windows that cross examples instead of packing whole examples into "
            "rows. Rerun jaxzero.prepare --sft on it to pack them.",
            str(directory),
        )

    train_file = _open_token_file(train_path, token_dtype)
    _check_token_ids(train_file, vocab_size, train_path, token_dtype, check_all)
    marked = " with loss masks" if train_marks is not None else ""
    if has_val_file:
        val = _open_token_file(val_path, token_dtype)
        _check_token_ids(val, vocab_size, val_path, token_dtype, check_all)
        train = train_file[:]
        origin = f"{str(directory)!r} train.bin + val.bin ({token_dtype}{marked})"
    elif train_starts is not None:  # whole examples: the last val_fraction of them
        held = int(len(train_starts) * val_fraction)
        cut = int(train_starts[len(train_starts) - held]) if held else n_train_file
        train, val = train_file[:cut], train_file[cut:]
        if train_marks is not None:
            train_marks, val_marks = train_marks[:cut], train_marks[cut:]
        train_starts, val_starts = (
            train_starts[: len(train_starts) - held],
            train_starts[len(train_starts) - held :],
        )
        val_starts = val_starts - np.uint64(cut)
        origin = (
            f"{str(directory)!r} train.bin ({token_dtype}{marked}), last {val_fraction:g} of its examples "
            "held out"
        )
    else:
        train, val = _split_tail(train_file, val_fraction)
        if train_marks is not None:
            train_marks, val_marks = _split_tail(train_marks, val_fraction)
        origin = f"{str(directory)!r} train.bin ({token_dtype}{marked}), last {val_fraction:g} held out"
    return TokenSplits(
        train=train,
        val=val,
        vocab_size=vocab_size,
        origin=origin,
        train_counted=train_marks,
        val_counted=val_marks,
        train_starts=train_starts,
        val_starts=val_starts,
    )


def _both_or_neither(
    directory: Path, kind: str, train: np.ndarray | None, val: np.ndarray | None, what: str, fix: str
) -> None:
    """Raise DataError where one split has its ``*.{kind}.bin`` file and the other does not."""
    if (train is None) != (val is None):
        have, lack = ("train", "val") if val is None else ("val", "train")
        raise DataError(
            f"{str(directory)!r} holds {have}.{kind}.bin but no {lack}.{kind}.bin: both splits {what}, "
            f"or neither does. {fix}"
        )


def open_split(
    directory: str, token_dtype: str, vocab_size: int, split: str | None
) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None, str, Path]:
    """(token ids, loss mask or None, example starts or None, the split's name, its file) of one split
    of a token set, memory-mapped and checked as `load_token_files` checks them: `split`'s ``.bin``
    whole, by default ``val.bin`` where there is one, else ``train.bin``. What an evaluation reads."""
    root = Path(directory)
    if not directory or not (root / "train.bin").is_file():
        raise DataError(
            f"--data.path={directory!r} holds no train.bin: give the directory of the token files to "
            "evaluate on (python -m jaxzero.prepare writes them)."
        )
    token_dtype = token_dtype_of(root, token_dtype)
    split = split or ("val" if (root / "val.bin").is_file() else "train")
    path = root / f"{split}.bin"
    if not path.is_file():
        raise DataError(f"{path} does not exist: --split=train evaluates on train.bin.")
    n = _check_token_file_size(path, token_dtype)
    if n < 2:
        raise DataError(f"{path} holds {n} token(s): evaluating needs at least one target.")
    tokens = _open_token_file(path, token_dtype)
    _check_token_ids(tokens, vocab_size, path, token_dtype, full=True)
    counted = _open_marks(root / f"{split}.mask.bin", n)
    return tokens, counted, _open_starts(root / f"{split}.idx.bin", n), split, path


def _open_marks(path: Path, num_tokens: int) -> np.ndarray | None:
    """The uint8 memmap of a token file's loss mask (1: a target the loss counts), or None if absent."""
    if not path.is_file():
        return None
    size = path.stat().st_size
    if size != num_tokens:
        raise DataError(
            f"{str(path)!r} holds {size:,} bytes, one per token, but its token file holds {num_tokens:,} "
            "tokens: they were not written together. Rerun jaxzero.prepare."
        )
    return np.memmap(path, dtype=np.uint8, mode="r") if size else np.zeros(0, np.uint8)


def _open_starts(path: Path, num_tokens: int) -> np.ndarray | None:
    """The uint64 example start offsets of a token file's index (``*.idx.bin``), checked to start at 0
    and increase within the file, read whole (8 bytes per example); None if absent."""
    if not path.is_file():
        return None
    size = path.stat().st_size
    starts = np.fromfile(path, dtype=np.uint64) if size % 8 == 0 else np.zeros(0, np.uint64)
    empty_ok = num_tokens == 0 and size == 0
    ordered = (
        starts.size > 0
        and starts[0] == 0
        and bool(np.all(starts[1:] > starts[:-1]))
        and int(starts[-1]) < num_tokens
    )
    if not (empty_ok or ordered):
        raise DataError(
            f"{str(path)!r} is not an index of its token file's {num_tokens:,} tokens (uint64 offsets of "
            "each example's first token, from 0, increasing): they were not written together. Rerun "
            "jaxzero.prepare --sft."
        )
    return starts


def write_tokens(
    path: str | os.PathLike[str], tokens: np.ndarray | list[int], dtype: Literal["uint16", "uint32"]
) -> Path:
    """Write a 1-D sequence of token ids as a flat nanoGPT ``.bin`` file; returns the path.

    To prepare data for ``data.source=tokens``, tokenize the training text into one id array (with the
    tokenizer's end-of-text id between documents), then::

        write_tokens("data/mycorpus/train.bin", train_ids, "uint16")   # ids < 65536, else "uint32"
        write_tokens("data/mycorpus/val.bin", val_ids, "uint16")       # optional

    and train with ``--data.source=tokens --data.path=data/mycorpus --data.token_dtype=uint16``.
    Ids must be integers in the dtype's range. Parent directories are created. The file is written to
    a temporary name and renamed, so an interrupted write never leaves a truncated ``.bin`` behind.
    """
    if dtype not in _TOKEN_DTYPES:
        raise DataError(f"write_tokens dtype={dtype!r} is not one of {list(_TOKEN_DTYPES)}.")
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise DataError(f"write_tokens needs a 1-D token array; got shape {arr.shape}.")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise DataError(f"write_tokens needs integer token ids; got dtype {arr.dtype}.")
    np_dtype = _TOKEN_DTYPES[dtype]
    if arr.size:
        lo, hi = int(arr.min()), int(arr.max())
        limit = int(np.iinfo(np_dtype).max)
        if lo < 0 or hi > limit:
            hint = " (use dtype='uint32')" if dtype == "uint16" and lo >= 0 else ""
            raise DataError(f"write_tokens: ids span [{lo}, {hi}], outside {dtype}'s [0, {limit}]{hint}.")
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            arr.astype(np_dtype, copy=False).tofile(f)
        os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return out
