"""The data pipeline's contracts: the `DataError` every part raises, a training stream's resumable
position (`DataState`), the rows of every global batch one process reads (`DataShard`), a source's
tokens (`TokenSplits`), and what a configured pipeline offers (`Data`, whose `train_iter` returns a
`BatchIterator`). The sources are in `jaxzero.data.sources`, the batches in `jaxzero.data.batches`."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from jaxzero.config import ConfigError


class DataError(ConfigError):
    """The data can not be used as configured; the message says what was found and how to fix it.

    A `ConfigError` subclass so that the CLI's handler for bad configs reports it the same way: a wrong
    ``data.path``, dtype or vocab is a configuration problem.
    """


@dataclass(frozen=True)
class DataState:
    """Position of a training stream: where the *next* batch starts.

    epoch:       index of the current pass over the windows (0-based). Always 0 for synthetic data.
    cursor:      windows of the current epoch's permutation already consumed, in ``[0, num_windows)``;
                 for synthetic data, the number of batches already produced (the next step); for
                 fine-tuning examples (`jaxzero.data.packing`), the examples of the epoch's rows
                 already consumed (always the start of a row).
    num_windows: windows per epoch of the data this state belongs to (fine-tuning examples: the
                 examples per epoch); 0 for synthetic data. Restoring checks it, so a checkpoint can
                 not silently continue on different data or seq_len.

    The cursor counts windows (or examples), not batches, so a run may even resume with a different
    batch size and still see every window once per epoch.
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
    is the micro-batch (``batch_size // grad_accum``) or, with a `DataShard`, this process's rows of it.

    truncated: fine-tuning examples longer than a row that the global batches this iterator produced
               held, each cut to ``seq_len + 1`` tokens (counted in every process alike); 0 for data
               without examples.
    """

    truncated: int = 0

    @property
    @abstractmethod
    def state(self) -> DataState:
        """The position before the next batch; `Data.train_iter(state)` resumes from exactly here."""

    @abstractmethod
    def __next__(self) -> np.ndarray: ...

    def __iter__(self) -> BatchIterator:
        return self


@dataclass(frozen=True)
class TokenSplits:
    """A source's tokens, split.

    train:      1-D token ids (uint8 for builtin bytes, uint16/uint32 memmap views for token files).
    val:        1-D token ids, same dtype; empty when the run has no validation split.
    vocab_size: ids are in ``[0, vocab_size)`` (for token files: the model's vocab, checked on a sample).
    origin:     where the tokens came from, for logs.
    train_counted, val_counted: uint8 per token, 0 where the token is not a target the loss counts
                (``train.mask.bin``, ``val.mask.bin``: a prompt of fine-tuning data); None: all are.
    train_starts, val_starts: uint64 offset of each fine-tuning example's first token in `train` and
                `val`, increasing from 0 (``train.idx.bin``, ``val.idx.bin``); None: a plain token stream.
    """

    train: np.ndarray
    val: np.ndarray
    vocab_size: int
    origin: str
    train_counted: np.ndarray | None = None
    val_counted: np.ndarray | None = None
    train_starts: np.ndarray | None = None
    val_starts: np.ndarray | None = None


class Data(ABC):
    """A configured data pipeline: training stream, validation batches, and the facts for logs.

    vocab_size:       token ids are in ``[0, vocab_size)``.
    seq_len:          tokens per input; every example is ``seq_len + 1`` tokens.
    batch_size:       global sequences per optimizer step.
    grad_accum:       micro-batches per step.
    micro_batch_size: ``batch_size // grad_accum``; also the batch size of validation batches.
    shard:            which part of every global batch this process reads (`DataShard`; default all).
    rows:             this process's rows of every micro-batch and validation batch, `shard.rows(...)`.
    truncated_examples: fine-tuning examples of the training split longer than a row of
                      ``seq_len + 1`` tokens, each truncated to one row every epoch; 0 for data
                      without examples.
    """

    source: str
    truncated_examples: int = 0

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
