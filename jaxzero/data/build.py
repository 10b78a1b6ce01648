"""`build_data`: the data pipeline a `DataConfig` describes, checked before any large file is read."""

from __future__ import annotations

from typing import Any

from jaxzero.config import DataConfig, padding_id
from jaxzero.data.batches import SyntheticData, WindowData
from jaxzero.data.eot import data_eot_id, prepared_eot_id
from jaxzero.data.packing import ExampleData
from jaxzero.data.sources import BUILTIN_VOCAB_SIZE, load_builtin_corpus, load_token_files
from jaxzero.data.types import Data, DataError, DataShard


def _check_data_config(cfg: DataConfig, vocab_size: int) -> None:
    """The cheap checks `build_data` needs, repeated from `config_checks.validate` so that direct callers
    get them."""
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


def build_data(
    cfg: DataConfig,
    vocab_size: int,
    seed: int,
    shard: DataShard = DataShard(),  # noqa: B008 (a frozen dataclass: immutable)
) -> Data:
    """The data pipeline for `cfg`, checked before any large file is read.

    vocab_size: the model's vocabulary. Token files are checked against it (every id, or a sample);
                builtin bytes need it to be >= 256; synthetic tokens are drawn from it.

    Token files with an example index (``train.idx.bin``, `jaxzero.prepare --sft`) give rows of whole
    examples (`ExampleData`, ``cfg.pack``), any other data windows (`WindowData`) or random tokens.
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
    if splits.train_starts is not None:  # fine-tuning examples, indexed: rows of whole examples
        return ExampleData(
            cfg.source,
            splits,
            val_requested=val_requested,
            pack=cfg.pack,
            pad=_pad_id(cfg, vocab_size),
            **common,
        )
    return WindowData(cfg.source, splits, val_requested=val_requested, **common)


def _pad_id(cfg: DataConfig, vocab_size: int) -> int:
    """The id that pads rows of examples: any id but the end-of-text one (`data_eot_id`, else the
    one the examples end with, ``prepare.json``), so that a row's padding is one run after its last
    example, which attention reads as part of that example's document: the example's tokens come
    before it, so its loss is unchanged, and padding is never a target. (Padding of end-of-text ids
    would make each padding token a document of its own, which cuDNN's packed attention cannot hold.)"""
    eot = data_eot_id(cfg, vocab_size, warn=False)
    if eot < 0:
        prepared = prepared_eot_id(cfg.path)
        eot = -1 if prepared is None else prepared
    return padding_id(eot)
