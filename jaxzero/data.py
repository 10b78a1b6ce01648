"""Token data: sources, shuffled resumable training batches, and fixed validation batches.

Three sources (`DataConfig.source`), all reduced to the same shape of problem:

* ``builtin``: byte-level tokens (vocab 256) over the Python standard library's own ``.py`` source,
  read fresh on every build (about 8 MiB, well under a second). Needs no files and no downloads.
* ``tokens``: nanoGPT-format files ``DIR/train.bin`` and optionally ``DIR/val.bin``: flat arrays of
  ``uint16`` or ``uint32`` token ids, read through ``np.memmap`` so a file is never loaded whole.
  Write them with `write_tokens`.
* ``synthetic``: uniform random tokens, each sequence a pure function of (seed, step, row), for
  benchmarks.

Batching (``builtin`` and ``tokens``). The train split is cut into windows of ``seq_len + 1``
consecutive tokens at stride ``seq_len`` (window ``i`` is ``tokens[i*seq_len : i*seq_len + seq_len + 1]``,
so neighbours share one token and every token is a target exactly once). Inputs are ``w[:-1]``, targets
``w[1:]``; the model code does that split, the data module hands out whole windows. The training stream is
the endless concatenation of per-epoch permutations of the window indices, each a function of
(seed, epoch) only. A step takes the next ``batch_size`` windows of that stream, so a batch may straddle
an epoch boundary: nothing is dropped and each epoch uses every window exactly once. Batches are int32
arrays shaped ``(grad_accum, batch_size // grad_accum, seq_len + 1)``.

Resuming. The stream position is a `DataState` (epoch, cursor, num_windows), a few JSON-friendly ints
that a checkpoint stores; `Data.train_iter(state)` continues exactly where the saved iterator was, in
O(1) batches (it recomputes one permutation, it replays nothing).

Validation. `Data.val_batches(n)` returns the same ``n`` micro-batches of fixed windows on every call,
independent of the seed, so validation losses compare across steps and across runs.

Several processes. Every batch above is the *global* batch, the same whatever the process count. A
`DataShard(index, count)` makes process ``index`` of ``count`` read only its rows of it: rows
``[index * m // count, (index + 1) * m // count)`` of every micro-batch of ``m`` rows (and of every
validation batch), and only those windows' tokens are read. Concatenating the processes' batches along
the row axis gives the one-process batch; the `DataState` is the same in every process.

Usage::

    data = build_data(cfg.data, vocab_size=cfg.model.vocab_size, seed=cfg.seed)
    # several processes: build_data(..., shard=DataShard(jax.process_index(), jax.process_count()))
    log(data.describe())
    it = data.train_iter(saved_state)          # or None for a fresh run
    for step in range(steps):
        batch = next(it)                       # (grad_accum, micro / count, seq_len + 1) int32
        ...
        checkpoint["data"] = it.state.to_dict()
    val = data.val_batches(cfg.logging.eval_batches)   # (n, micro / count, seq_len + 1) int32
"""

from __future__ import annotations

import math
import os
import sys
import sysconfig
import tempfile
from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from jaxzero.config import ConfigError, DataConfig

__all__ = [
    "BUILTIN_MAX_BYTES",
    "BUILTIN_SEPARATOR",
    "BUILTIN_VOCAB_SIZE",
    "BatchIterator",
    "Data",
    "DataError",
    "DataShard",
    "DataState",
    "SyntheticData",
    "TokenSplits",
    "WindowData",
    "build_data",
    "load_builtin_corpus",
    "load_token_files",
    "write_tokens",
]

BUILTIN_VOCAB_SIZE = 256
# 8 MiB: ~8M byte tokens, plenty for a tiny model to learn Python's surface syntax, and it reads in well
# under a second from a warm page cache. The stdlib is ~10-11 MiB of .py outside tests, so the cap binds.
BUILTIN_MAX_BYTES = 8 * 1024 * 1024
# Appended after every file. NUL never occurs in Python source, so it is an unambiguous end-of-document
# token that a sampler can also stop on.
BUILTIN_SEPARATOR = b"\x00"
# Directories under the stdlib that are not "the standard library's own source": third-party packages
# (site-packages, Debian's dist-packages), the huge test suites, and IDLE.
_BUILTIN_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idlelib", "__pycache__"})

_TOKEN_DTYPES: dict[str, np.dtype] = {"uint16": np.dtype(np.uint16), "uint32": np.dtype(np.uint32)}
# The full vocab check (`data.check_tokens`, the default) takes the max of every id in chunks of this
# many tokens (a vectorised pass over the memmap: seconds for a 10 GB file). The sampled check reads
# at most _VOCAB_CHECK_TOKENS per file in _VOCAB_CHECK_CHUNKS evenly spaced chunks (head, middle,
# tail...): milliseconds, and it still catches a wrong dtype or tokenizer.
_FULL_CHECK_CHUNK = 1 << 26
_VOCAB_CHECK_TOKENS = 4 * 1024 * 1024
_VOCAB_CHECK_CHUNKS = 4

# Stream tags fed to SeedSequence so the data RNG streams never coincide with each other for any seed.
_TAG_TRAIN_ORDER = 0x6A7A_0001
_TAG_SYNTHETIC_TRAIN = 0x6A7A_0002
_TAG_SYNTHETIC_VAL = 0x6A7A_0003
# Fractional part of the golden ratio: a Weyl sequence k * phi (mod 1) spreads validation windows evenly
# over the whole split, and any prefix of it is spread evenly too.
_GOLDEN_FRACTION = (math.sqrt(5.0) - 1.0) / 2.0


class DataError(ConfigError):
    """The data can not be used as configured; the message says what was found and how to fix it.

    A `ConfigError` subclass so that the CLI's handler for bad configs reports it the same way: a wrong
    ``data.path``, dtype or vocab is a configuration problem.
    """


# ---------------------------------------------------------------------------------------------------
# Resumable position
# ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DataState:
    """Position of a training stream: where the *next* batch starts.

    epoch:       index of the current pass over the windows (0-based). Always 0 for synthetic data.
    cursor:      windows of the current epoch's permutation already consumed, in ``[0, num_windows)``;
                 for synthetic data, the number of batches already produced (the next step).
    num_windows: windows per epoch of the data this state belongs to; 0 for synthetic data. Restoring
                 checks it, so a checkpoint can not silently continue on different data or seq_len.

    The cursor counts windows, not batches, so a run may even resume with a different batch size and
    still see every window once per epoch.
    """

    epoch: int
    cursor: int
    num_windows: int

    def __post_init__(self) -> None:
        for name in ("epoch", "cursor", "num_windows"):
            v = getattr(self, name)
            # bool is an int subclass; a JSON true/false here means a corrupted checkpoint.
            if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < 0:
                raise DataError(f"DataState.{name}={v!r} must be a non-negative integer.")
        if self.num_windows and self.cursor >= self.num_windows:
            raise DataError(
                f"DataState.cursor={self.cursor} must be < num_windows={self.num_windows}: a finished "
                "epoch is stored as (epoch + 1, cursor 0)."
            )

    def to_dict(self) -> dict[str, int]:
        """Plain ints, for JSON or a checkpoint's metadata."""
        return {"epoch": int(self.epoch), "cursor": int(self.cursor), "num_windows": int(self.num_windows)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> DataState:
        """Inverse of `to_dict`. Missing or extra keys raise `DataError`."""
        keys = {"epoch", "cursor", "num_windows"}
        if set(d) != keys:
            raise DataError(f"a saved data state needs exactly the keys {sorted(keys)}; got {sorted(d)}.")
        return cls(epoch=d["epoch"], cursor=d["cursor"], num_windows=d["num_windows"])


@dataclass(frozen=True)
class DataShard:
    """The part of every global batch one process reads: process `index` of `count`.

    Of each micro-batch of ``m`` rows (and each validation batch) the process reads rows
    ``[index * m // count, (index + 1) * m // count)``, in order: the rows its devices hold of the
    batch sharded over the data axis, which JAX's `make_array_from_process_local_data` expects. The
    default, ``DataShard(0, 1)``, is the whole batch. A multi-process run uses
    ``DataShard(jax.process_index(), jax.process_count())``.
    """

    index: int = 0
    count: int = 1

    def __post_init__(self) -> None:
        for name in ("index", "count"):
            v = getattr(self, name)
            if not isinstance(v, (int, np.integer)) or isinstance(v, bool):
                raise DataError(f"DataShard.{name}={v!r} must be an integer.")
        if self.count < 1 or not 0 <= self.index < self.count:
            raise DataError(
                f"DataShard(index={self.index}, count={self.count}) needs count >= 1 and "
                "0 <= index < count (the process index and the process count)."
            )

    def rows(self, micro_batch_size: int) -> slice:
        """This process's rows of a micro-batch of `micro_batch_size` rows. Raises DataError when
        they cannot be split evenly over `count` processes."""
        if micro_batch_size % self.count:
            fits = -(-micro_batch_size // self.count) * self.count  # the next multiple up
            raise DataError(
                f"a micro-batch of data.batch_size / data.grad_accum = {micro_batch_size} sequences "
                f"cannot be split evenly over {self.count} processes (each reads its own rows of every "
                f"micro-batch). Make data.batch_size / data.grad_accum a multiple of {self.count}, e.g. "
                f"{fits} sequences per micro-batch (data.batch_size = {fits} x data.grad_accum)."
            )
        size = micro_batch_size // self.count
        return slice(self.index * size, (self.index + 1) * size)

    def describe(self) -> str:
        """'' for the whole batch, else which part of it this process reads, for logs."""
        return "" if self.count == 1 else f", process {self.index} of {self.count} reads its rows"


class BatchIterator(Iterator[np.ndarray]):
    """An endless iterator of training batches ``(grad_accum, rows, seq_len + 1)`` int32, where `rows`
    is the micro-batch (``batch_size // grad_accum``) or, with a `DataShard`, this process's rows of it."""

    @property
    @abstractmethod
    def state(self) -> DataState:
        """The position before the next batch; `Data.train_iter(state)` resumes from exactly here."""

    @abstractmethod
    def __next__(self) -> np.ndarray: ...

    def __iter__(self) -> BatchIterator:
        return self


# ---------------------------------------------------------------------------------------------------
# Token sources
# ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TokenSplits:
    """A source's tokens, split.

    train:      1-D token ids (uint8 for builtin bytes, uint16/uint32 memmap views for token files).
    val:        1-D token ids, same dtype; empty when the run has no validation split.
    vocab_size: ids are in ``[0, vocab_size)`` (for token files: the model's vocab, checked on a sample).
    origin:     where the tokens came from, for logs.
    train_counted, val_counted: uint8 per token, 0 where the token is not a target the loss counts
                (``train.mask.bin``, ``val.mask.bin``: a prompt of fine-tuning data); None: all are.
    """

    train: np.ndarray
    val: np.ndarray
    vocab_size: int
    origin: str
    train_counted: np.ndarray | None = None
    val_counted: np.ndarray | None = None


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


def load_token_files(
    path: str | os.PathLike[str],
    *,
    token_dtype: Literal["uint16", "uint32"],
    seq_len: int,
    val_fraction: float,
    vocab_size: int,
    check_all: bool = True,
) -> TokenSplits:
    """Memmap nanoGPT token files ``path/train.bin`` and, if present, ``path/val.bin``.

    Everything cheap is checked before any token is read: the directory and files exist, byte sizes are
    multiples of the dtype size, and each split holds at least one window of ``seq_len + 1`` tokens. Then
    every token id (`check_all`), or a bounded sample of each file, is checked against `vocab_size`.
    Without ``val.bin`` the last `val_fraction` of ``train.bin`` is validation. Returned arrays are
    memmap views (never loaded whole).
    """
    if token_dtype not in _TOKEN_DTYPES:
        raise DataError(f"data.token_dtype={token_dtype!r} is not one of {list(_TOKEN_DTYPES)}.")
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
    if has_val_file and (train_marks is None) != (val_marks is None):
        have, lack = ("train", "val") if val_marks is None else ("val", "train")
        raise DataError(
            f"{str(directory)!r} holds {have}.mask.bin but no {lack}.mask.bin: both splits mark the "
            "targets the loss counts, or neither does. Rerun jaxzero.prepare, or remove the one."
        )

    train_file = _open_token_file(train_path, token_dtype)
    _check_token_ids(train_file, vocab_size, train_path, token_dtype, check_all)
    marked = " with loss masks" if train_marks is not None else ""
    if has_val_file:
        val = _open_token_file(val_path, token_dtype)
        _check_token_ids(val, vocab_size, val_path, token_dtype, check_all)
        train = train_file[:]
        origin = f"{str(directory)!r} train.bin + val.bin ({token_dtype}{marked})"
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
    )


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


# ---------------------------------------------------------------------------------------------------
# Window batching
# ---------------------------------------------------------------------------------------------------


def _num_windows(num_tokens: int, seq_len: int) -> int:
    """Windows of ``seq_len + 1`` tokens at stride ``seq_len`` that fit in `num_tokens`."""
    return max(0, (num_tokens - 1) // seq_len)


def _gather_windows(
    tokens: np.ndarray, window_ids: np.ndarray, seq_len: int, counted: np.ndarray | None = None
) -> np.ndarray:
    """Window ``tokens[i*seq_len : i*seq_len + seq_len + 1]`` per id ``i``: ``(len(ids), seq_len + 1)`` int32,
    each token that `counted` marks 0 written as ``~id`` (not a target; `jaxzero.objective`).

    One contiguous slice copy per window: on a memmap that is a sequential read per window, faster than
    a single 2-D fancy-index gather.
    """
    out = np.empty((len(window_ids), seq_len + 1), dtype=np.int32)
    for row, window in enumerate(window_ids.tolist()):
        start = window * seq_len
        out[row] = tokens[start : start + seq_len + 1]
        if counted is not None:
            keep = counted[start : start + seq_len + 1].astype(bool)
            np.invert(out[row], out=out[row], where=~keep)
    return out


def _seed_entropy(seed: int) -> int:
    """`seed` as the non-negative int SeedSequence needs (configs allow any int, JAX accepts negatives)."""
    return seed % (1 << 64)


def _epoch_permutation(seed: int, epoch: int, num_windows: int) -> np.ndarray:
    """Window order of one epoch: a permutation of ``range(num_windows)`` (int64) from (seed, epoch) only."""
    rng = np.random.default_rng(np.random.SeedSequence([_TAG_TRAIN_ORDER, _seed_entropy(seed), epoch]))
    return rng.permutation(num_windows)


class WindowIterator(BatchIterator):
    """Shuffled training batches of windows of a 1-D token array; see the module docstring for the order.

    rows: the rows of each micro-batch this process reads (`DataShard.rows`); the stream position
          advances by the whole global batch, so the state is the same in every process.

    Host cost per batch: one int64 permutation slice and one contiguous slice copy per row read. Memory:
    one or two epoch permutations of ``8 * num_windows`` bytes (70 MB for 9B tokens at seq_len 1024).
    """

    def __init__(
        self,
        tokens: np.ndarray,
        *,
        seq_len: int,
        batch_size: int,
        grad_accum: int,
        seed: int,
        state: DataState,
        rows: slice = slice(None),
        counted: np.ndarray | None = None,
    ) -> None:
        self._tokens = tokens
        self._counted = counted
        self._rows = rows
        self._seq_len = seq_len
        self._batch_size = batch_size
        self._grad_accum = grad_accum
        self._seed = seed
        self._num_windows = _num_windows(len(tokens), seq_len)
        if state.num_windows != self._num_windows:
            raise DataError(
                f"the saved data state is for {state.num_windows:,} windows per epoch, but this data has "
                f"{self._num_windows:,} (training tokens or data.seq_len changed since the checkpoint). "
                "Resume with the original data and data.seq_len, or start a fresh run_dir."
            )
        self._epoch = state.epoch
        self._cursor = state.cursor
        # A batch needs at most two epochs' permutations unless the epoch is shorter than a batch.
        self._permutations: dict[int, np.ndarray] = {}

    @property
    def state(self) -> DataState:
        return DataState(epoch=self._epoch, cursor=self._cursor, num_windows=self._num_windows)

    def _permutation(self, epoch: int) -> np.ndarray:
        perm = self._permutations.get(epoch)
        if perm is None:
            # Keep only the epochs still ahead: the stream never goes back.
            self._permutations = {e: p for e, p in self._permutations.items() if e >= self._epoch}
            perm = _epoch_permutation(self._seed, epoch, self._num_windows)
            self._permutations[epoch] = perm
        return perm

    def __next__(self) -> np.ndarray:
        window_ids = np.empty(self._batch_size, dtype=np.int64)
        filled, epoch, cursor = 0, self._epoch, self._cursor
        while filled < self._batch_size:  # more than two rounds only if an epoch is shorter than a batch
            take = min(self._batch_size - filled, self._num_windows - cursor)
            window_ids[filled : filled + take] = self._permutation(epoch)[cursor : cursor + take]
            filled += take
            cursor += take
            if cursor == self._num_windows:
                epoch, cursor = epoch + 1, 0
        # The global batch's window ids, then only this process's rows of each micro-batch are read.
        mine = window_ids.reshape(self._grad_accum, -1)[:, self._rows]
        batch = _gather_windows(self._tokens, mine.reshape(-1), self._seq_len, self._counted)
        self._epoch, self._cursor = epoch, cursor
        return batch.reshape(self._grad_accum, -1, self._seq_len + 1)


class SyntheticIterator(BatchIterator):
    """Uniform random batches; the state's cursor is the step. Each sequence is a pure function of
    (seed, step, its row in the global batch), so a process draws only its own rows (`rows`, as in
    `WindowIterator`) and the global batch does not depend on the process count or `grad_accum`."""

    def __init__(
        self,
        *,
        vocab_size: int,
        seq_len: int,
        batch_size: int,
        grad_accum: int,
        seed: int,
        state: DataState,
        rows: slice = slice(None),
    ) -> None:
        if state.num_windows != 0 or state.epoch != 0:
            raise DataError(
                f"the saved data state {state.to_dict()} is from a file-backed source, not "
                "data.source=synthetic; resume with the original data.source or start a fresh run_dir."
            )
        micro = batch_size // grad_accum
        # Row numbers in the global batch, micro-batch after micro-batch: (grad_accum, rows read).
        self._row_ids = np.arange(batch_size).reshape(grad_accum, micro)[:, rows]
        self._seq_len = seq_len
        self._vocab_size = vocab_size
        self._seed = seed
        self._step = state.cursor

    @property
    def state(self) -> DataState:
        return DataState(epoch=0, cursor=self._step, num_windows=0)

    def __next__(self) -> np.ndarray:
        entropy = [_TAG_SYNTHETIC_TRAIN, _seed_entropy(self._seed), self._step]
        batch = np.empty((*self._row_ids.shape, self._seq_len + 1), dtype=np.int32)
        for index, row in np.ndenumerate(self._row_ids):
            rng = np.random.default_rng(np.random.SeedSequence([*entropy, int(row)]))
            batch[index] = rng.integers(0, self._vocab_size, size=self._seq_len + 1, dtype=np.int32)
        self._step += 1
        return batch


# ---------------------------------------------------------------------------------------------------
# Data objects and the builder
# ---------------------------------------------------------------------------------------------------


class Data(ABC):
    """A configured data pipeline: training stream, validation batches, and the facts for logs.

    vocab_size:       token ids are in ``[0, vocab_size)``.
    seq_len:          tokens per input; every example is ``seq_len + 1`` tokens.
    batch_size:       global sequences per optimizer step.
    grad_accum:       micro-batches per step.
    micro_batch_size: ``batch_size // grad_accum``; also the batch size of validation batches.
    shard:            which part of every global batch this process reads (`DataShard`; default all).
    rows:             this process's rows of every micro-batch and validation batch, `shard.rows(...)`.
    """

    source: str

    def __init__(
        self,
        *,
        vocab_size: int,
        seq_len: int,
        batch_size: int,
        grad_accum: int,
        seed: int,
        shard: DataShard = DataShard(),
    ) -> None:
        self.vocab_size = vocab_size
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.grad_accum = grad_accum
        self.micro_batch_size = batch_size // grad_accum
        self.seed = seed
        self.shard = shard
        self.rows = shard.rows(self.micro_batch_size)  # raises DataError if they cannot split evenly

    @property
    def batch_shape(self) -> tuple[int, int, int]:
        """Shape of every training batch this process gets: ``(grad_accum, rows, seq_len + 1)``, with
        ``rows = micro_batch_size // shard.count``."""
        return (self.grad_accum, self.rows.stop - self.rows.start, self.seq_len + 1)

    @abstractmethod
    def train_iter(self, state: DataState | None = None) -> BatchIterator:
        """An endless iterator of int32 batches `batch_shape`, this process's rows of the global
        batches from `state` (None: the start). The state is the same in every process."""

    @abstractmethod
    def val_batches(self, n: int) -> np.ndarray:
        """The first `n` validation batches, int32 ``(n', rows, seq_len + 1)``: this process's rows of
        each (``rows = micro_batch_size // shard.count``).

        The same windows on every call and for every seed; ``n' = min(n, max_val_batches)``.
        """

    @property
    @abstractmethod
    def max_val_batches(self) -> int | None:
        """How many distinct validation batches exist (0: no validation split; None: unbounded)."""

    @abstractmethod
    def describe(self) -> str:
        """One line for logs: source, token and window counts, batch layout."""

    def _layout(self) -> str:
        return (
            f"seq_len {self.seq_len}, batch {self.batch_size} = {self.grad_accum} x "
            f"{self.micro_batch_size}{self.shard.describe()}, seed {self.seed}"
        )


class WindowData(Data):
    """`builtin` or `tokens` data: windows over a train and a validation token array."""

    def __init__(
        self,
        source: str,
        splits: TokenSplits,
        *,
        seq_len: int,
        batch_size: int,
        grad_accum: int,
        seed: int,
        val_requested: bool,
        shard: DataShard = DataShard(),
    ) -> None:
        super().__init__(
            vocab_size=splits.vocab_size,
            seq_len=seq_len,
            batch_size=batch_size,
            grad_accum=grad_accum,
            seed=seed,
            shard=shard,
        )
        self.source = source
        self.splits = splits
        self.num_train_windows = _num_windows(len(splits.train), seq_len)
        self.num_val_windows = _num_windows(len(splits.val), seq_len)
        micro = self.micro_batch_size
        if self.num_train_windows < micro:
            raise DataError(
                f"the training split has {len(splits.train):,} tokens = {self.num_train_windows:,} windows "
                f"of data.seq_len+1 = {seq_len + 1} (stride {seq_len}), fewer than one micro-batch of "
                f"data.batch_size/data.grad_accum = {batch_size}/{grad_accum} = {micro} sequences. Lower "
                "data.batch_size or data.seq_len, raise data.grad_accum, or use more data."
            )
        if val_requested and self.num_val_windows < micro:
            raise DataError(
                f"the validation split has {len(splits.val):,} tokens = {self.num_val_windows:,} windows of "
                f"data.seq_len+1 = {seq_len + 1}, fewer than one validation batch of {micro} sequences "
                f"(the micro-batch). Raise data.val_fraction, provide a longer val.bin, lower "
                "data.batch_size or data.seq_len, or set data.val_fraction=0 to train without validation."
            )
        # Validation window order: a Weyl sequence with a stride coprime to the window count is a
        # permutation whose every prefix spreads over the whole split (not just its first documents).
        stride = max(1, round(self.num_val_windows * _GOLDEN_FRACTION))
        while self.num_val_windows and math.gcd(stride, self.num_val_windows) != 1:
            stride += 1
        self._val_stride = stride

    @property
    def max_val_batches(self) -> int:
        return self.num_val_windows // self.micro_batch_size

    def train_iter(self, state: DataState | None = None) -> WindowIterator:
        if state is None:
            state = DataState(epoch=0, cursor=0, num_windows=self.num_train_windows)
        return WindowIterator(
            self.splits.train,
            seq_len=self.seq_len,
            batch_size=self.batch_size,
            grad_accum=self.grad_accum,
            seed=self.seed,
            state=state,
            rows=self.rows,
            counted=self.splits.train_counted,
        )

    def val_batches(self, n: int) -> np.ndarray:
        if n < 0:
            raise DataError(f"val_batches(n={n}) needs n >= 0.")
        count = min(n, self.max_val_batches) * self.micro_batch_size
        # Python ints: k * stride can exceed int64 for huge splits; count is small (eval batches).
        ids = np.array([(k * self._val_stride) % self.num_val_windows for k in range(count)], dtype=np.int64)
        mine = ids.reshape(-1, self.micro_batch_size)[:, self.rows]  # only this process's windows are read
        windows = _gather_windows(self.splits.val, mine.reshape(-1), self.seq_len, self.splits.val_counted)
        return windows.reshape(-1, self.rows.stop - self.rows.start, self.seq_len + 1)

    def describe(self) -> str:
        s = self.splits
        val = (
            f"val {len(s.val):,} tokens = {self.num_val_windows:,} windows"
            if self.num_val_windows
            else "no validation split"
        )
        return (
            f"data: {self.source} from {s.origin}, vocab {s.vocab_size} | train {len(s.train):,} tokens "
            f"= {self.num_train_windows:,} windows, {val} | {self._layout()}"
        )


class SyntheticData(Data):
    """`synthetic` data: uniform random tokens, no files, any number of steps."""

    source = "synthetic"

    @property
    def max_val_batches(self) -> None:
        return None

    def train_iter(self, state: DataState | None = None) -> SyntheticIterator:
        if state is None:
            state = DataState(epoch=0, cursor=0, num_windows=0)
        return SyntheticIterator(
            vocab_size=self.vocab_size,
            seq_len=self.seq_len,
            batch_size=self.batch_size,
            grad_accum=self.grad_accum,
            seed=self.seed,
            state=state,
            rows=self.rows,
        )

    def val_batches(self, n: int) -> np.ndarray:
        if n < 0:
            raise DataError(f"val_batches(n={n}) needs n >= 0.")
        rows = range(self.micro_batch_size)[self.rows]
        out = np.empty((n, len(rows), self.seq_len + 1), dtype=np.int32)
        # Seed-independent and one stream per (batch, row), so val_batches(2) is a prefix of
        # val_batches(4) and a process draws only its own rows.
        for i in range(n):
            for j, row in enumerate(rows):
                rng = np.random.default_rng(np.random.SeedSequence([_TAG_SYNTHETIC_VAL, i, row]))
                out[i, j] = rng.integers(0, self.vocab_size, size=self.seq_len + 1, dtype=np.int32)
        return out

    def describe(self) -> str:
        return f"data: synthetic uniform random tokens, vocab {self.vocab_size}, unbounded | {self._layout()}"


def _check_data_config(cfg: DataConfig, vocab_size: int) -> None:
    """The cheap checks `build_data` needs, repeated from `config.validate` so direct callers get them."""
    if cfg.source not in ("builtin", "tokens", "synthetic"):
        raise DataError(f"data.source={cfg.source!r} is not one of ['builtin', 'tokens', 'synthetic'].")
    if cfg.seq_len < 2:
        raise DataError(f"data.seq_len={cfg.seq_len} must be >= 2.")
    if cfg.grad_accum < 1 or cfg.batch_size < 1 or cfg.batch_size % cfg.grad_accum:
        raise DataError(
            f"data.batch_size={cfg.batch_size} must be a positive multiple of "
            f"data.grad_accum={cfg.grad_accum} (itself >= 1)."
        )
    if not 0.0 <= cfg.val_fraction < 0.5:
        raise DataError(f"data.val_fraction={cfg.val_fraction} must be in [0, 0.5).")
    if vocab_size < 1:
        raise DataError(f"model.vocab_size={vocab_size} must be >= 1.")
    if cfg.source == "builtin" and vocab_size < BUILTIN_VOCAB_SIZE:
        raise DataError(
            f"data.source=builtin yields byte tokens 0..255, but model.vocab_size={vocab_size}; "
            f"set model.vocab_size >= {BUILTIN_VOCAB_SIZE}."
        )
    if cfg.source == "tokens" and not cfg.path:
        raise DataError(
            "data.source=tokens needs data.path=DIR, a directory holding train.bin "
            "(nanoGPT format: a flat array of uint16 or uint32 token ids)."
        )


def build_data(cfg: DataConfig, vocab_size: int, seed: int, shard: DataShard = DataShard()) -> Data:
    """The data pipeline for `cfg`, checked before any large file is read.

    vocab_size: the model's vocabulary. Token files are checked against it (every id, or a sample);
                builtin bytes need it to be >= 256; synthetic tokens are drawn from it.
    seed:       sets the per-epoch shuffle (and the synthetic stream); validation ignores it.
    shard:      the part of every global batch this process reads (default: all of it); a micro-batch
                that cannot be split evenly over `shard.count` processes is a DataError (a ConfigError).
    """
    _check_data_config(cfg, vocab_size)
    shard.rows(cfg.batch_size // cfg.grad_accum)  # refused before any file is read
    common: dict[str, Any] = dict(
        seq_len=cfg.seq_len, batch_size=cfg.batch_size, grad_accum=cfg.grad_accum, seed=seed, shard=shard
    )
    if cfg.source == "synthetic":
        return SyntheticData(vocab_size=vocab_size, **common)
    if cfg.source == "builtin":
        splits = load_builtin_corpus(cfg.val_fraction)
    else:
        splits = load_token_files(
            cfg.path,
            token_dtype=cfg.token_dtype,
            seq_len=cfg.seq_len,
            val_fraction=cfg.val_fraction,
            vocab_size=vocab_size,
            check_all=cfg.check_tokens,
        )
    # Validation is wanted when a val.bin exists (then splits.val is non-empty) or a tail was asked for;
    # only data.val_fraction=0 without val.bin means "no validation".
    val_requested = cfg.val_fraction > 0 or len(splits.val) > 0
    return WindowData(cfg.source, splits, val_requested=val_requested, **common)
