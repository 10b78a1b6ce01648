"""Token data: sources, shuffled resumable training batches, and fixed validation batches.

Three sources (`DataConfig.source`), all reduced to the same shape of problem:

* ``builtin``: byte-level tokens (vocab 256) over the Python standard library's own ``.py`` source,
  read fresh on every build (at most 8 MiB). Needs no files and no downloads.
* ``tokens``: nanoGPT-format files ``DIR/train.bin`` and optionally ``DIR/val.bin``: flat arrays of
  ``uint16`` or ``uint32`` token ids, read through ``np.memmap`` so a file is never loaded whole.
  Write them with `write_tokens`.
* ``synthetic``: uniform random tokens, each sequence a pure function of (seed, step, row), for
  benchmarks.

Batching (``builtin`` and ``tokens``). The train split is cut into windows of ``seq_len + 1``
consecutive tokens at stride ``seq_len`` (window ``i`` is ``tokens[i*seq_len : i*seq_len + seq_len + 1]``,
so neighbours share one token and every token is a target exactly once). Inputs are ``w[:-1]``, targets
``w[1:]``; the model code does that split, the data package hands out whole windows. The training stream is
the endless concatenation of per-epoch permutations of the window indices, each a function of
(seed, epoch) only. A step takes the next ``batch_size`` windows of that stream, so a batch may straddle
an epoch boundary: nothing is dropped and each epoch uses every window exactly once. Batches are int32
arrays shaped ``(grad_accum, batch_size // grad_accum, seq_len + 1)``.

Resuming. The stream position is a `DataState` (epoch, cursor, num_windows), a few JSON-friendly ints
that a checkpoint stores; `Data.train_iter(state)` continues exactly where the saved iterator was, in
O(1) batches (it recomputes one permutation, it replays nothing).

Fine-tuning examples. Token files with an example index (``train.idx.bin``, written by
``python -m jaxzero.prepare --sft``) are batched as rows of whole examples instead of windows: packed
best fit (``data.pack``, the default) or one per row, padded with the end-of-text id marked
not-a-target, an example longer than a row truncated (`Data.truncated_examples`,
`BatchIterator.truncated`); `jaxzero.data.packing` has the rules. Fine-tuning files prepared before the
index existed are read as windows, with a warning. `resolve_eot_id` says which id ends a document.

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

The package: `types` (DataError, DataState, DataShard, TokenSplits, the Data and BatchIterator
interfaces), `sources` (the built-in corpus, token files with their loss masks and example indexes,
`write_tokens`), `eot` (`resolve_eot_id`), `batches` (the window and synthetic streams), `packing`
(rows of whole fine-tuning examples), `build` (`build_data`). Preparing token files from
text, for `python -m jaxzero.prepare`: `documents` (the readers), `chat_template`, `encoding` (the
parallel encoder); this module does not import them.
"""

from jaxzero.data.batches import SyntheticData, WindowData
from jaxzero.data.build import build_data
from jaxzero.data.eot import resolve_eot_id
from jaxzero.data.packing import ExampleData
from jaxzero.data.sources import (
    BUILTIN_MAX_BYTES,
    BUILTIN_SEPARATOR,
    BUILTIN_VOCAB_SIZE,
    load_builtin_corpus,
    load_token_files,
    write_tokens,
)
from jaxzero.data.types import BatchIterator, Data, DataError, DataShard, DataState, TokenSplits

__all__ = [
    "BUILTIN_MAX_BYTES",
    "BUILTIN_SEPARATOR",
    "BUILTIN_VOCAB_SIZE",
    "BatchIterator",
    "Data",
    "DataError",
    "DataShard",
    "DataState",
    "ExampleData",
    "SyntheticData",
    "TokenSplits",
    "WindowData",
    "build_data",
    "load_builtin_corpus",
    "load_token_files",
    "resolve_eot_id",
    "write_tokens",
]
