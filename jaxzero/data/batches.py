"""Batches: the resumable, shuffled window stream over a token array and its fixed validation windows
(`WindowData`, `WindowIterator`), and uniform random tokens (`SyntheticData`, `SyntheticIterator`); the
order, resume and sharding rules are `jaxzero.data`'s docstring. A token a loss mask leaves out is
handed out as ``~id`` (`jaxzero.numerics.objective`)."""

from __future__ import annotations

import math

import numpy as np

from jaxzero.data.types import BatchIterator, Data, DataError, DataShard, DataState, TokenSplits

# Stream tags fed to SeedSequence so the data RNG streams never coincide with each other for any seed.
_TAG_TRAIN_ORDER = 0x6A7A_0001
_TAG_SYNTHETIC_TRAIN = 0x6A7A_0002
_TAG_SYNTHETIC_VAL = 0x6A7A_0003
# Fractional part of the golden ratio: a Weyl sequence k * phi (mod 1) spreads validation windows evenly
# over the whole split, and any prefix of it is spread evenly too.
_GOLDEN_FRACTION = (math.sqrt(5.0) - 1.0) / 2.0


def _num_windows(num_tokens: int, seq_len: int) -> int:
    """Windows of ``seq_len + 1`` tokens at stride ``seq_len`` that fit in `num_tokens`."""
    return max(0, (num_tokens - 1) // seq_len)


def _gather_windows(
    tokens: np.ndarray, window_ids: np.ndarray, seq_len: int, counted: np.ndarray | None = None
) -> np.ndarray:
    """Window ``tokens[i*seq_len : i*seq_len + seq_len + 1]`` per id ``i``: ``(len(ids), seq_len + 1)`` int32,
    each token that `counted` marks 0 written as ``~id`` (not a target; `jaxzero.numerics.objective`).

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


def seed_entropy(seed: int) -> int:
    """`seed` as the non-negative int SeedSequence needs (configs allow any int, JAX accepts negatives)."""
    return seed % (1 << 64)


def weyl_stride(count: int) -> int:
    """The stride of the validation order over `count` items (windows, or rows of examples): ``k *
    stride % count`` for k = 0, 1, ... is a permutation (the stride is coprime to `count`) whose every
    prefix spreads over the whole split, not just its first documents."""
    stride = max(1, round(count * _GOLDEN_FRACTION))
    while count and math.gcd(stride, count) != 1:
        stride += 1
    return stride


def _epoch_permutation(seed: int, epoch: int, num_windows: int) -> np.ndarray:
    """Window order of one epoch: a permutation of ``range(num_windows)`` (int64) from (seed, epoch) only."""
    rng = np.random.default_rng(np.random.SeedSequence([_TAG_TRAIN_ORDER, seed_entropy(seed), epoch]))
    return rng.permutation(num_windows)


class WindowIterator(BatchIterator):
    """Shuffled training batches of windows of a 1-D token array; the order is `jaxzero.data`'s docstring.

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
        entropy = [_TAG_SYNTHETIC_TRAIN, seed_entropy(self._seed), self._step]
        batch = np.empty((*self._row_ids.shape, self._seq_len + 1), dtype=np.int32)
        for index, row in np.ndenumerate(self._row_ids):
            rng = np.random.default_rng(np.random.SeedSequence([*entropy, int(row)]))
            batch[index] = rng.integers(0, self._vocab_size, size=self._seq_len + 1, dtype=np.int32)
        self._step += 1
        return batch


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
        shard: DataShard = DataShard(),  # noqa: B008 (a frozen dataclass: immutable)
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
        self._val_stride = weyl_stride(self.num_val_windows)

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
