"""Fine-tuning examples as rows (`ExampleData`, `ExampleIterator`): token files whose ``*.idx.bin``
says where each example starts (``python -m jaxzero.prepare --sft`` writes it) are batched in rows of
whole examples, never a window that cuts one.

Rows. A row holds ``seq_len + 1`` tokens: whole examples one after another, then padding. With
``data.pack=true`` each row takes as many examples as best fit (`best_fit_rows`: best-fit decreasing, as
TRL's ``bfd`` packing), with ``data.pack=false`` one. An example longer than a row is cut to the row,
which it fills alone (`Data.truncated_examples` per epoch, `BatchIterator.truncated` as they pass).
Every example ends with the end-of-text id; the padding is another id marked not-a-target (``~pad``,
`jaxzero.numerics.objective`): it counts no loss, and attention reads it as the tail of the row's last
example, after that example's tokens, so the example's loss is unchanged. An example's first token
is marked not-a-target too: nothing of its example precedes it, as at
the start of a row (so a packed example's loss is its loss alone).

Order. Each epoch shuffles the examples (a function of seed and epoch only) and cuts the permutation
into blocks of `PACK_BLOCK_EXAMPLES`; each block is packed on its own and its rows shuffled (seed, epoch,
block). The training stream is the epochs' rows one after another; a step takes the next
``batch_size`` rows, so a batch may straddle an epoch. The `DataState` cursor counts the examples of
the epoch's rows already taken (always the start of a row), so a restore recomputes one block and
continues exactly; ``num_windows`` holds the examples per epoch. A block is packed when the stream
reaches it: host memory is 24 bytes per example (its offset, its length, the epoch's permutation)
and one or two blocks' rows.

Validation packs the validation examples in file order the same way, without shuffling, and takes rows
in the spread order of windows (`jaxzero.data.batches.weyl_stride`), the same for every seed.
Process shards (`DataShard`) read only their rows of each micro-batch, as with windows.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Iterator

import numpy as np

from jaxzero.data.batches import seed_entropy, weyl_stride
from jaxzero.data.types import BatchIterator, Data, DataError, DataShard, DataState, TokenSplits

log = logging.getLogger(__name__)  # the library speaks through logging (`jaxzero.run.console`)

# Examples packed together: the permutation is cut into blocks of this many, each packed alone, so the
# cost of packing is paid as the stream reaches a block and rows mix examples of one block only (TRL
# packs the batches of `datasets.map`, 1000 examples by default, the same way).
PACK_BLOCK_EXAMPLES = 1000
# Stream tags fed to SeedSequence, continuing `jaxzero.data.batches`' so no two streams coincide.
_TAG_EXAMPLE_ORDER = 0x6A7A_0004
_TAG_ROW_ORDER = 0x6A7A_0005


def best_fit_rows(lengths: np.ndarray, capacity: int) -> list[np.ndarray]:
    """Best-fit decreasing: examples of `lengths` (tokens, each >= 1; longer than `capacity` counts as
    `capacity`) into rows of `capacity` tokens. Longest first (ties in index order), each goes to the
    row with the least room that holds it (ties: the earliest row), else to a new row. Returns each
    row's example indexes (int64), in the order they were placed; deterministic."""
    sizes = np.minimum(np.asarray(lengths, np.int64), capacity)
    rows: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (room left, row) of rows with room, sorted
    for i in np.argsort(-sizes, kind="stable").tolist():
        size = int(sizes[i])
        j = bisect.bisect_left(free, (size, -1))  # the least room >= size, earliest row first
        if j == len(free):
            row, room = len(rows), capacity - size
            rows.append([i])
        else:
            room, row = free.pop(j)
            room -= size
            rows[row].append(i)
        if room:  # a full row takes nothing more (every example has a token)
            bisect.insort(free, (room, row))
    return [np.asarray(r, np.int64) for r in rows]


def _block_rows(
    ids: np.ndarray, lengths: np.ndarray, capacity: int, pack: bool, rng: np.random.Generator | None
) -> tuple[np.ndarray, np.ndarray]:
    """The rows of one block of examples `ids`: (the ids in row order, int64 bounds: row r is
    ``ids[bounds[r]:bounds[r + 1]]``). Packed best fit with `pack` and then shuffled by `rng` (None:
    in packing order), else one example per row in `ids`' order."""
    if not pack:
        return ids, np.arange(len(ids) + 1, dtype=np.int64)
    rows = [ids[r] for r in best_fit_rows(lengths[ids], capacity)]
    if rng is not None:
        rows = [rows[k] for k in rng.permutation(len(rows)).tolist()]
    bounds = np.zeros(len(rows) + 1, np.int64)
    np.cumsum([len(r) for r in rows], out=bounds[1:])
    return np.concatenate(rows), bounds


def _lengths(tokens: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """int64 tokens of each example whose first token is at `starts` in `tokens`."""
    return np.diff(np.append(starts.astype(np.int64), len(tokens)))


def _examples_with_targets(
    counted: np.ndarray | None, starts: np.ndarray, lengths: np.ndarray, width: int
) -> np.ndarray:
    """bool per example: whether it keeps a target the loss counts within its row, at positions
    1 .. min(length, width) - 1 of the example (its first token has nothing before it; the rest of a
    longer example is cut). Read in blocks of at most ~4M mask bytes."""
    kept = np.minimum(lengths, width)
    if counted is None:  # every token is a target
        return kept >= 2
    out = np.zeros(len(starts), bool)
    offsets = np.arange(1, width, dtype=np.int64)
    block = max(1, (4 << 20) // width)
    last = max(len(counted) - 1, 0)
    for a in range(0, len(starts), block):
        s, k = starts[a : a + block].astype(np.int64), kept[a : a + block]
        index = s[:, None] + offsets[None, :]
        inside = offsets[None, :] < k[:, None]
        marks = np.asarray(counted[np.minimum(index, last).ravel()]).reshape(index.shape)
        out[a : a + block] = np.any((marks != 0) & inside, axis=1)
    return out


def _check_targets(split: str, counted: np.ndarray | None, starts: np.ndarray, lengths: np.ndarray,
                   width: int) -> None:
    """DataError where no example of `split` keeps a target within a row (every step would count no
    loss: `loss -`, `val_loss 0`), with the examples' lengths; a warning where some do not."""
    has = _examples_with_targets(counted, starts, lengths, width)
    n, none = len(has), int(np.count_nonzero(~has))
    if not none:
        return
    longer = int(np.count_nonzero(lengths > width))
    sizes = (
        f"the examples are {int(lengths.min()):,} to {int(lengths.max()):,} tokens long (median "
        f"{int(np.median(lengths)):,}), {longer:,} of them longer than a row"
    )
    if none == n:
        raise DataError(
            f"no fine-tuning example of the {split} split has a target the loss counts within a row of "
            f"data.seq_len + 1 = {width} tokens: {sizes}, and every target lies past the row's end. Raise "
            "data.seq_len, or prepare shorter examples."
        )
    log.warning(
        f"warning: {none:,} of the {n:,} fine-tuning examples of the {split} split have no target the loss "
        f"counts within a row of data.seq_len + 1 = {width} tokens ({sizes}): they train nothing."
    )


def _gather_rows(
    tokens: np.ndarray,
    counted: np.ndarray | None,
    starts: np.ndarray,
    lengths: np.ndarray,
    rows: list[np.ndarray],
    width: int,
    pad: int,
) -> np.ndarray:
    """int32 ``(len(rows), width)``: each row's examples (ids into `starts`), each cut to `width`, one
    after another, then ``~pad``; a token `counted` marks 0, and each example's first, as ``~id``."""
    out = np.full((len(rows), width), ~pad, dtype=np.int32)
    for k, row in enumerate(rows):
        at = 0
        for example in row.tolist():
            start, n = int(starts[example]), min(int(lengths[example]), width)
            piece = out[k, at : at + n]
            piece[:] = tokens[start : start + n]
            if counted is not None:
                np.invert(piece, out=piece, where=~counted[start : start + n].astype(bool))
            if piece[0] >= 0:
                piece[0] = ~piece[0]
            at += n
    return out


class ExampleIterator(BatchIterator):
    """Training batches of rows of whole examples; the order, resume and sharding rules are the module
    docstring's. `lengths`: int64 tokens of each training example (`splits.train_starts`' spans);
    `rows`: the rows of each micro-batch this process reads (`DataShard.rows`)."""

    def __init__(
        self,
        splits: TokenSplits,
        lengths: np.ndarray,
        *,
        seq_len: int,
        batch_size: int,
        grad_accum: int,
        seed: int,
        pack: bool,
        pad: int,
        state: DataState,
        rows: slice = slice(None),
    ) -> None:
        assert splits.train_starts is not None
        self._tokens, self._counted, self._starts = splits.train, splits.train_counted, splits.train_starts
        self._lengths = lengths
        self._n = len(self._lengths)
        self._width, self._pack, self._pad, self._seed = seq_len + 1, pack, pad, seed
        self._batch_size, self._grad_accum, self._rows = batch_size, grad_accum, rows
        self.truncated = 0
        if state.num_windows != self._n:
            raise DataError(
                f"the saved data state is for {state.num_windows:,} windows or examples per epoch, but this "
                f"data has {self._n:,} fine-tuning examples (the training data changed since the checkpoint, "
                "or it was prepared again with an example index). Resume with the original data, or start "
                "a fresh run_dir."
            )
        self._permutations: dict[int, np.ndarray] = {}
        self._blocks: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = {}
        block, within = divmod(state.cursor, PACK_BLOCK_EXAMPLES)
        bounds = self._block(state.epoch, block)[1]
        row = int(np.searchsorted(bounds, within))
        if bounds[row] != within:
            raise DataError(
                f"the saved data state {state.to_dict()} is not at the start of a row of these examples: "
                "data.seq_len, data.pack or the seed changed since the checkpoint. Resume with the "
                "original settings, or start a fresh run_dir."
            )
        self._epoch, self._block_index, self._row, self._cursor = state.epoch, block, row, state.cursor

    @property
    def state(self) -> DataState:
        return DataState(epoch=self._epoch, cursor=self._cursor, num_windows=self._n)

    def _block(self, epoch: int, block: int) -> tuple[np.ndarray, np.ndarray]:
        """Block `block` of epoch `epoch`'s rows (`_block_rows`), kept until the stream passes it."""
        key = (epoch, block)
        if key not in self._blocks:
            perm = self._permutations.get(epoch)
            if perm is None:
                perm = np.random.default_rng(
                    np.random.SeedSequence([_TAG_EXAMPLE_ORDER, seed_entropy(self._seed), epoch])
                ).permutation(self._n)
                self._permutations = {e: p for e, p in self._permutations.items() if e >= epoch}
                self._permutations[epoch] = perm
            ids = perm[block * PACK_BLOCK_EXAMPLES : (block + 1) * PACK_BLOCK_EXAMPLES]
            rng = np.random.default_rng(
                np.random.SeedSequence([_TAG_ROW_ORDER, seed_entropy(self._seed), epoch, block])
            )
            self._blocks = {k: v for k, v in self._blocks.items() if k >= key}  # the stream never goes back
            self._blocks[key] = _block_rows(ids, self._lengths, self._width, self._pack, rng)
        return self._blocks[key]

    def __next__(self) -> np.ndarray:
        chosen: list[np.ndarray] = []
        epoch, block, row = self._epoch, self._block_index, self._row
        while len(chosen) < self._batch_size:
            ids, bounds = self._block(epoch, block)
            chosen.append(ids[bounds[row] : bounds[row + 1]])
            row += 1
            if row == len(bounds) - 1:
                block, row = block + 1, 0
                if block * PACK_BLOCK_EXAMPLES >= self._n:
                    epoch, block = epoch + 1, 0
        cursor = block * PACK_BLOCK_EXAMPLES + (int(self._block(epoch, block)[1][row]) if row else 0)
        self.truncated += int(sum(np.count_nonzero(self._lengths[r] > self._width) for r in chosen))
        # The global batch's rows, then only this process's rows of each micro-batch are read.
        micro = self._batch_size // self._grad_accum
        mine = [chosen[a * micro + i] for a in range(self._grad_accum) for i in range(micro)[self._rows]]
        batch = _gather_rows(
            self._tokens, self._counted, self._starts, self._lengths, mine, self._width, self._pad
        )
        self._epoch, self._block_index, self._row, self._cursor = epoch, block, row, cursor
        return batch.reshape(self._grad_accum, -1, self._width)


def every_example_rows(
    tokens: np.ndarray, counted: np.ndarray | None, starts: np.ndarray, seq_len: int, pack: bool, pad: int
) -> Iterator[np.ndarray]:
    """int32 (rows, seq_len + 1) arrays of rows holding every example of a split once, in file order,
    block by block (`PACK_BLOCK_EXAMPLES`), packed best fit with `pack`, else one per row, as
    training's rows are made (an example longer than a row cut to it): what an evaluation reads.
    `starts`: each example's first token in `tokens` (the split's ``*.idx.bin``)."""
    lengths, width = _lengths(tokens, starts), seq_len + 1
    for first in range(0, len(lengths), PACK_BLOCK_EXAMPLES):
        ids = np.arange(first, min(first + PACK_BLOCK_EXAMPLES, len(lengths)))
        ids, bounds = _block_rows(ids, lengths, width, pack, None)
        rows = [ids[a:b] for a, b in zip(bounds[:-1].tolist(), bounds[1:].tolist(), strict=True)]
        yield _gather_rows(tokens, counted, starts, lengths, rows, width, pad)


class ExampleData(Data):
    """`tokens` data with an example index: rows of whole fine-tuning examples (module docstring).

    pack: best-fit packing (``data.pack``), else one example per row.
    pad:  the id the padding repeats (marked not-a-target): never the end-of-text id.
    """

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
        pack: bool,
        pad: int,
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
        if splits.train_starts is None or (splits.val_starts is None and len(splits.val)):
            raise DataError("ExampleData needs the example index of every split (TokenSplits.*_starts).")
        self.source, self.splits, self.pack, self.pad = source, splits, pack, pad
        width = seq_len + 1
        self._train_lengths = _lengths(splits.train, splits.train_starts)
        self.num_train_examples = len(self._train_lengths)
        self.truncated_examples = int(np.count_nonzero(self._train_lengths > width))
        _check_targets("training", splits.train_counted, splits.train_starts, self._train_lengths, width)
        micro = self.micro_batch_size
        if self.num_train_examples < micro:
            raise DataError(
                f"the training split holds {self.num_train_examples:,} fine-tuning examples, fewer than the "
                f"rows of one micro-batch of data.batch_size/data.grad_accum = {batch_size}/{grad_accum} = "
                f"{micro}. Lower data.batch_size, raise data.grad_accum, or use more examples."
            )
        # Validation rows: every block of the validation examples in file order, packed, not shuffled.
        self._val_lengths = np.zeros(0, np.int64)
        self._val_rows: list[np.ndarray] = []
        if splits.val_starts is not None and len(splits.val):
            self._val_lengths = _lengths(splits.val, splits.val_starts)
            if val_requested:
                _check_targets("validation", splits.val_counted, splits.val_starts, self._val_lengths, width)
            for first in range(0, len(self._val_lengths), PACK_BLOCK_EXAMPLES):
                ids = np.arange(first, min(first + PACK_BLOCK_EXAMPLES, len(self._val_lengths)))
                ids, bounds = _block_rows(ids, self._val_lengths, width, pack, None)
                self._val_rows += [ids[a:b] for a, b in zip(bounds[:-1].tolist(), bounds[1:].tolist())]
        if val_requested and len(self._val_rows) < micro:
            raise DataError(
                f"the validation split holds {len(self._val_lengths):,} fine-tuning examples = "
                f"{len(self._val_rows):,} rows of data.seq_len+1 = {width}, fewer than one validation batch "
                f"of {micro} rows (the micro-batch). Raise data.val_fraction, prepare more --val_docs, lower "
                "data.batch_size, or set data.val_fraction=0 to train without validation."
            )
        self._val_stride = weyl_stride(len(self._val_rows))

    @property
    def max_val_batches(self) -> int:
        return len(self._val_rows) // self.micro_batch_size

    def train_iter(self, state: DataState | None = None) -> ExampleIterator:
        if state is None:
            state = DataState(epoch=0, cursor=0, num_windows=self.num_train_examples)
        return ExampleIterator(
            self.splits,
            self._train_lengths,
            seq_len=self.seq_len,
            batch_size=self.batch_size,
            grad_accum=self.grad_accum,
            seed=self.seed,
            pack=self.pack,
            pad=self.pad,
            state=state,
            rows=self.rows,
        )

    def val_batches(self, n: int) -> np.ndarray:
        if n < 0:
            raise DataError(f"val_batches(n={n}) needs n >= 0.")
        micro, width = self.micro_batch_size, self.seq_len + 1
        count = min(n, self.max_val_batches) * micro
        if not count:  # also where the split has no examples (then it has no index either)
            return np.zeros((0, self.rows.stop - self.rows.start, width), np.int32)
        # Python ints: k * stride can exceed int64 for huge splits; count is small (eval batches).
        order = [(k * self._val_stride) % len(self._val_rows) for k in range(count)]
        mine = [self._val_rows[order[b + i]] for b in range(0, count, micro) for i in range(micro)[self.rows]]
        s = self.splits
        assert s.val_starts is not None  # ExampleData checks it
        rows = _gather_rows(s.val, s.val_counted, s.val_starts, self._val_lengths, mine, width, self.pad)
        return rows.reshape(-1, self.rows.stop - self.rows.start, width)

    def describe(self) -> str:
        s = self.splits
        how = "packed whole, best fit," if self.pack else "one per row, padded,"
        val = (
            f"val {len(self._val_lengths):,} examples = {len(self._val_rows):,} rows"
            if self._val_rows
            else "no validation split"
        )
        return (
            f"data: {self.source} from {s.origin}, vocab {s.vocab_size} | train {self.num_train_examples:,} "
            f"fine-tuning examples ({len(s.train):,} tokens) {how} in rows of {self.seq_len + 1}; "
            f"{self.truncated_examples:,} longer than a row, truncated | {val} | {self._layout()}"
        )
