"""Tests for jaxzero.data: sources, batching, determinism, resume, validation batches, error messages.

Most tests use token files holding ``arange`` ids, so a window's first token is its start offset and
"this window is a real slice of the stream" is a plain equality check.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from jaxzero import data as data_mod
from jaxzero.config import ConfigError, DataConfig
from jaxzero.data import (
    BUILTIN_MAX_BYTES,
    BUILTIN_SEPARATOR,
    DataError,
    DataShard,
    DataState,
    batches,
    build_data,
    load_builtin_corpus,
    load_token_files,
    sources,
    write_tokens,
)

BIG_VOCAB = 1 << 20  # the arange-token tests need ids beyond uint16 in places


def _cfg(path: Path | str = "", **kw: object) -> DataConfig:
    base: dict[str, object] = dict(
        source="tokens",
        path=str(path),
        token_dtype="uint32",
        seq_len=8,
        batch_size=4,
        grad_accum=1,
        val_fraction=0.0,
    )
    base.update(kw)
    return DataConfig(**base)  # type: ignore[arg-type]


def _arange_dir(tmp_path: Path, n_train: int, n_val: int = 0, dtype: str = "uint32") -> Path:
    """A token dir whose train.bin is arange(n_train) and val.bin (if n_val) continues the count."""
    write_tokens(tmp_path / "train.bin", np.arange(n_train), dtype)  # type: ignore[arg-type]
    if n_val:
        write_tokens(tmp_path / "val.bin", np.arange(n_train, n_train + n_val), dtype)  # type: ignore[arg-type]
    return tmp_path


def _take(it: data_mod.BatchIterator, n: int) -> list[np.ndarray]:
    return [next(it) for _ in range(n)]


def _starts(batch: np.ndarray) -> np.ndarray:
    """Window start offsets of an arange-token batch, in stream order (flattening grad_accum)."""
    return batch.reshape(-1, batch.shape[-1])[:, 0].astype(np.int64)


def _assert_real_windows(batch: np.ndarray, seq_len: int, offset: int = 0) -> None:
    """Every row is arange(start, start + seq_len + 1) with start on the stride grid."""
    rows = batch.reshape(-1, seq_len + 1).astype(np.int64)
    expected = rows[:, :1] + np.arange(seq_len + 1)
    np.testing.assert_array_equal(rows, expected)
    assert np.all((rows[:, 0] - offset) % seq_len == 0)


# ---------------------------------------------------------------------------------------------------
# Sources
# ---------------------------------------------------------------------------------------------------


def test_builtin_corpus_is_bytes_nonempty_and_deterministic() -> None:
    a = load_builtin_corpus(0.05)
    b = load_builtin_corpus(0.05)
    assert a.vocab_size == 256
    assert a.train.dtype == np.uint8 and a.train.ndim == 1 and a.val.ndim == 1
    assert len(a.train) > 1_000_000 and len(a.val) > 50_000
    assert len(a.train) + len(a.val) <= BUILTIN_MAX_BYTES
    assert len(a.val) == int((len(a.train) + len(a.val)) * 0.05)
    np.testing.assert_array_equal(a.train, b.train)
    np.testing.assert_array_equal(a.val, b.val)
    assert a.origin == b.origin
    # Files are separated, and the text really is Python source.
    assert np.count_nonzero(a.train == BUILTIN_SEPARATOR[0]) > 10
    assert b"def " in a.train[:200_000].tobytes() and b"import " in a.train[:200_000].tobytes()


def test_builtin_build_data_batches() -> None:
    data = build_data(DataConfig(source="builtin", seq_len=32, batch_size=8, grad_accum=2), 256, seed=0)
    assert data.vocab_size == 256 and "builtin" in data.describe() and "\n" not in data.describe()
    batch = next(data.train_iter())
    assert batch.shape == (2, 4, 33) and batch.dtype == np.int32
    assert batch.min() >= 0 and batch.max() < 256
    val = data.val_batches(3)
    assert val.shape == (3, 4, 33) and val.dtype == np.int32


@pytest.mark.parametrize("dtype,top", [("uint16", 65_535), ("uint32", 4_000_000_000)])
def test_token_files_round_trip_through_memmap(tmp_path: Path, dtype: str, top: int) -> None:
    tokens = np.random.default_rng(0).integers(0, top + 1, size=5_000, dtype=np.int64)
    tokens[0] = top
    write_tokens(tmp_path / "train.bin", tokens, dtype)  # type: ignore[arg-type]
    assert (tmp_path / "train.bin").stat().st_size == 5_000 * np.dtype(dtype).itemsize
    assert [p.name for p in tmp_path.iterdir()] == ["train.bin"]  # no temporary file left behind
    splits = load_token_files(
        tmp_path,
        token_dtype=dtype,
        seq_len=8,
        val_fraction=0.1,  # type: ignore[arg-type]
        vocab_size=top + 1,
    )
    assert isinstance(splits.train, np.memmap) and isinstance(splits.val, np.memmap)
    assert splits.train.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(np.concatenate([splits.train, splits.val]), tokens)
    assert len(splits.val) == 500


def test_val_bin_present_vs_absent(tmp_path: Path) -> None:
    absent = load_token_files(
        _arange_dir(tmp_path / "a", 1_000),
        token_dtype="uint32",
        seq_len=8,
        val_fraction=0.2,
        vocab_size=BIG_VOCAB,
    )
    np.testing.assert_array_equal(absent.train, np.arange(800))
    np.testing.assert_array_equal(absent.val, np.arange(800, 1_000))
    present = load_token_files(
        _arange_dir(tmp_path / "p", 1_000, n_val=300),
        token_dtype="uint32",
        seq_len=8,
        val_fraction=0.2,
        vocab_size=BIG_VOCAB,
    )
    np.testing.assert_array_equal(present.train, np.arange(1_000))  # val_fraction ignored with val.bin
    np.testing.assert_array_equal(present.val, np.arange(1_000, 1_300))


def test_no_validation_when_val_fraction_zero_and_no_val_bin(tmp_path: Path) -> None:
    data = build_data(_cfg(_arange_dir(tmp_path, 200)), BIG_VOCAB, seed=0)
    assert data.max_val_batches == 0
    assert data.val_batches(4).shape == (0, 4, 9)
    assert "no validation split" in data.describe()


# ---------------------------------------------------------------------------------------------------
# Training batches
# ---------------------------------------------------------------------------------------------------


def test_batch_shape_dtype_and_windows_are_real_slices(tmp_path: Path) -> None:
    data = build_data(
        _cfg(_arange_dir(tmp_path, 2_001), seq_len=16, batch_size=12, grad_accum=3), BIG_VOCAB, seed=0
    )
    assert data.batch_shape == (3, 4, 17)
    for batch in _take(data.train_iter(), 20):
        assert batch.shape == (3, 4, 17) and batch.dtype == np.int32
        inputs, targets = batch[..., :-1], batch[..., 1:]
        np.testing.assert_array_equal(targets[..., :-1], inputs[..., 1:])
        np.testing.assert_array_equal(targets, inputs + 1)  # arange: each target is the next token
        _assert_real_windows(batch, 16)
        assert batch.max() < 2_001


def test_same_seed_same_batches_different_seed_different_order(tmp_path: Path) -> None:
    d = _arange_dir(tmp_path, 4_001)
    a = _take(build_data(_cfg(d), BIG_VOCAB, seed=3).train_iter(), 10)
    b = _take(build_data(_cfg(d), BIG_VOCAB, seed=3).train_iter(), 10)
    c = _take(build_data(_cfg(d), BIG_VOCAB, seed=4).train_iter(), 10)
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(x, y)
    assert any(not np.array_equal(x, z) for x, z in zip(a, c, strict=True))


def test_grad_accum_only_reshapes_the_global_batch(tmp_path: Path) -> None:
    d = _arange_dir(tmp_path, 4_001)
    flat = _take(build_data(_cfg(d, batch_size=8), BIG_VOCAB, seed=1).train_iter(), 5)
    accum = _take(build_data(_cfg(d, batch_size=8, grad_accum=4), BIG_VOCAB, seed=1).train_iter(), 5)
    for x, y in zip(flat, accum, strict=True):
        assert x.shape == (1, 8, 9) and y.shape == (4, 2, 9)
        np.testing.assert_array_equal(x.reshape(8, 9), y.reshape(8, 9))


@pytest.mark.parametrize("num_windows,batch_size", [(32, 8), (30, 8), (5, 8)])
def test_each_epoch_covers_every_window_exactly_once(
    tmp_path: Path, num_windows: int, batch_size: int
) -> None:
    seq_len = 8
    d = _arange_dir(tmp_path, num_windows * seq_len + 1)
    data = build_data(
        _cfg(d, batch_size=batch_size, grad_accum=batch_size // 4 if batch_size >= 4 else 1),
        BIG_VOCAB,
        seed=0,
    )
    assert data.num_train_windows == num_windows
    epochs = 3
    n_batches = -(-epochs * num_windows // batch_size)
    it = data.train_iter()
    starts = np.concatenate([_starts(b) for b in _take(it, n_batches)])[: epochs * num_windows]
    per_epoch = (starts // seq_len).reshape(epochs, num_windows)
    for order in per_epoch:
        np.testing.assert_array_equal(np.sort(order), np.arange(num_windows))
    assert not np.array_equal(per_epoch[0], per_epoch[1])  # reshuffled per epoch
    assert it.state.epoch == (n_batches * batch_size) // num_windows


# ---------------------------------------------------------------------------------------------------
# Resume
# ---------------------------------------------------------------------------------------------------


def _through_json(state: DataState) -> DataState:
    return DataState.from_dict(json.loads(json.dumps(state.to_dict())))


@pytest.mark.parametrize("k", [0, 1, 3, 4, 6, 11])
def test_resume_matches_uninterrupted_stream(tmp_path: Path, k: int) -> None:
    # 30 windows, 8 per batch: epochs end mid-batch at 3.75, 7.5, 11.25 batches, so the m=6 batches after
    # every k cross at least one epoch boundary.
    d = _arange_dir(tmp_path, 30 * 8 + 1)
    data = build_data(_cfg(d, batch_size=8, grad_accum=2), BIG_VOCAB, seed=7)
    reference = _take(data.train_iter(), k + 6)
    it = data.train_iter()
    _take(it, k)
    saved = _through_json(it.state)
    assert saved == it.state
    resumed = build_data(_cfg(d, batch_size=8, grad_accum=2), BIG_VOCAB, seed=7).train_iter(saved)
    assert resumed.state == saved
    for x, y in zip(_take(resumed, 6), reference[k:], strict=True):
        np.testing.assert_array_equal(x, y)


def test_resume_with_another_batch_size_continues_the_window_stream(tmp_path: Path) -> None:
    # The cursor counts windows, so halving the batch size after a restart keeps the same window order.
    d = _arange_dir(tmp_path, 30 * 8 + 1)
    reference = np.concatenate(
        [_starts(b) for b in _take(build_data(_cfg(d, batch_size=8), BIG_VOCAB, seed=2).train_iter(), 8)]
    )
    it = build_data(_cfg(d, batch_size=8), BIG_VOCAB, seed=2).train_iter()
    _take(it, 3)
    smaller = build_data(_cfg(d, batch_size=4), BIG_VOCAB, seed=2).train_iter(_through_json(it.state))
    resumed = np.concatenate([_starts(b) for b in _take(smaller, 10)])
    np.testing.assert_array_equal(resumed, reference[24:64])


def test_state_is_position_before_next_batch(tmp_path: Path) -> None:
    data = build_data(_cfg(_arange_dir(tmp_path, 30 * 8 + 1), batch_size=8), BIG_VOCAB, seed=0)
    it = data.train_iter()
    assert it.state == DataState(epoch=0, cursor=0, num_windows=30)
    _take(it, 3)
    assert it.state == DataState(epoch=0, cursor=24, num_windows=30)
    next(it)
    assert it.state == DataState(epoch=1, cursor=2, num_windows=30)


def test_resume_on_changed_data_is_refused(tmp_path: Path) -> None:
    data = build_data(_cfg(_arange_dir(tmp_path, 30 * 8 + 1), batch_size=8), BIG_VOCAB, seed=0)
    with pytest.raises(DataError, match=r"for 31 windows per epoch, but this data has 30"):
        data.train_iter(DataState(epoch=0, cursor=0, num_windows=31))
    synthetic = build_data(_cfg(source="synthetic"), 100, seed=0)
    with pytest.raises(DataError, match="not data.source=synthetic"):
        synthetic.train_iter(DataState(epoch=1, cursor=2, num_windows=30))


def test_data_state_validation() -> None:
    assert DataState.from_dict({"epoch": 2, "cursor": 5, "num_windows": 9}) == DataState(2, 5, 9)
    with pytest.raises(DataError, match="exactly the keys"):
        DataState.from_dict({"epoch": 2, "cursor": 5})
    with pytest.raises(DataError, match="cursor=9 must be < num_windows=9"):
        DataState(epoch=0, cursor=9, num_windows=9)
    with pytest.raises(DataError, match="non-negative integer"):
        DataState(epoch=-1, cursor=0, num_windows=9)
    with pytest.raises(DataError, match="non-negative integer"):
        DataState.from_dict({"epoch": True, "cursor": 0, "num_windows": 9})


# ---------------------------------------------------------------------------------------------------
# Validation batches
# ---------------------------------------------------------------------------------------------------


def test_val_batches_fixed_spread_and_from_the_val_split(tmp_path: Path) -> None:
    d = _arange_dir(tmp_path, 1_000, n_val=50 * 8 + 1)
    a = build_data(_cfg(d), BIG_VOCAB, seed=0)
    b = build_data(_cfg(d), BIG_VOCAB, seed=99)
    assert a.max_val_batches == 50 // 4
    v = a.val_batches(6)
    assert v.shape == (6, 4, 9) and v.dtype == np.int32
    np.testing.assert_array_equal(v, a.val_batches(6))  # same every call
    np.testing.assert_array_equal(v, b.val_batches(6))  # and for every seed
    np.testing.assert_array_equal(v[:2], a.val_batches(2))  # first n batches: a prefix
    _assert_real_windows(v, 8, offset=1_000)
    assert v.min() >= 1_000  # only validation tokens
    starts = _starts(v.reshape(1, -1, 9))
    assert len(np.unique(starts)) == len(starts)  # distinct windows
    assert starts.max() - starts.min() > 300  # spread over the split, not just its head
    everything = a.val_batches(1_000)
    assert everything.shape == (12, 4, 9)  # capped at the distinct batches available
    assert len(np.unique(_starts(everything.reshape(1, -1, 9)))) == 48


# ---------------------------------------------------------------------------------------------------
# Synthetic
# ---------------------------------------------------------------------------------------------------


def test_synthetic_shapes_range_determinism_and_resume() -> None:
    cfg = _cfg(source="synthetic", seq_len=16, batch_size=8, grad_accum=2)
    data = build_data(cfg, 50, seed=5)
    assert data.max_val_batches is None and "synthetic" in data.describe()
    ref = _take(data.train_iter(), 8)
    for batch in ref:
        assert batch.shape == (2, 4, 17) and batch.dtype == np.int32
        assert batch.min() >= 0 and batch.max() < 50
    assert len(np.unique(np.concatenate(ref))) == 50
    again = _take(build_data(cfg, 50, seed=5).train_iter(), 8)
    other = _take(build_data(cfg, 50, seed=6).train_iter(), 8)
    for x, y, z in zip(ref, again, other, strict=True):
        np.testing.assert_array_equal(x, y)
        assert not np.array_equal(x, z)
    it = data.train_iter()
    _take(it, 3)
    assert it.state == DataState(epoch=0, cursor=3, num_windows=0)
    for x, y in zip(_take(data.train_iter(_through_json(it.state)), 5), ref[3:], strict=True):
        np.testing.assert_array_equal(x, y)
    val = data.val_batches(3)
    assert val.shape == (3, 4, 17)
    np.testing.assert_array_equal(val, build_data(cfg, 50, seed=6).val_batches(3))
    np.testing.assert_array_equal(val[:1], data.val_batches(1))


# ---------------------------------------------------------------------------------------------------
# Several processes: each reads its rows of the global batch
# ---------------------------------------------------------------------------------------------------


def _sharded(cfg: DataConfig, vocab: int, seed: int, count: int) -> list[data_mod.Data]:
    return [build_data(cfg, vocab, seed, shard=DataShard(i, count)) for i in range(count)]


def _assert_shards_make_the_batches(cfg: DataConfig, vocab: int, count: int, steps: int = 5) -> None:
    """The processes' batches, concatenated along the rows, are the one-process batches, from the start
    and after a resume mid-stream, for training and validation; every process holds the same state."""
    whole = build_data(cfg, vocab, seed=3)
    parts = _sharded(cfg, vocab, 3, count)
    rows = cfg.batch_size // cfg.grad_accum // count
    assert all(p.batch_shape == (cfg.grad_accum, rows, cfg.seq_len + 1) for p in parts)
    it, iters = whole.train_iter(), [p.train_iter() for p in parts]
    for _ in range(steps):
        reference, batches = next(it), [next(i) for i in iters]
        assert all(b.shape == parts[0].batch_shape for b in batches)
        np.testing.assert_array_equal(np.concatenate(batches, axis=1), reference)
        assert {i.state for i in iters} == {it.state}  # the same resume state in every process
    # Resume every process from the saved position: the next global batches continue as one process's.
    saved = _through_json(it.state)
    after = _take(whole.train_iter(saved), 3)
    resumed = [_take(p.train_iter(saved), 3) for p in parts]
    for step in range(3):
        np.testing.assert_array_equal(np.concatenate([r[step] for r in resumed], axis=1), after[step])
    val = whole.val_batches(3)
    np.testing.assert_array_equal(np.concatenate([p.val_batches(3) for p in parts], axis=1), val)


@pytest.mark.parametrize("count", [2, 4])
def test_process_shards_of_token_batches_make_the_global_batch(tmp_path: Path, count: int) -> None:
    # 30 windows per epoch and 8 per batch: the resumed batches cross epoch boundaries.
    d = _arange_dir(tmp_path, 30 * 8 + 1, n_val=20 * 8 + 1)
    _assert_shards_make_the_batches(_cfg(d, batch_size=8, grad_accum=2), BIG_VOCAB, count)


def test_process_shards_of_builtin_batches_make_the_global_batch() -> None:
    cfg = DataConfig(source="builtin", seq_len=16, batch_size=8, grad_accum=2)
    _assert_shards_make_the_batches(cfg, 256, 2, steps=2)


@pytest.mark.parametrize("count", [2, 4])
def test_process_shards_of_synthetic_batches_make_the_global_batch(count: int) -> None:
    cfg = _cfg(source="synthetic", seq_len=16, batch_size=8, grad_accum=2)
    _assert_shards_make_the_batches(cfg, 50, count)


def test_a_process_reads_only_its_own_windows(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    d = _arange_dir(tmp_path, 30 * 8 + 1, n_val=20 * 8 + 1)
    cfg = _cfg(d, batch_size=8, grad_accum=2)
    ids = next(build_data(cfg, BIG_VOCAB, seed=0).train_iter())[:, :, 0] // 8  # (2, 4) window ids
    read: list[int] = []
    gather = batches._gather_windows
    monkeypatch.setattr(
        batches, "_gather_windows", lambda t, w, s, c=None: read.extend(w.tolist()) or gather(t, w, s, c)
    )
    data = build_data(cfg, BIG_VOCAB, seed=0, shard=DataShard(1, 2))
    next(data.train_iter())
    assert read == ids[:, 2:].reshape(-1).tolist()  # rows 2:4 of each micro-batch, nothing else
    read.clear()
    assert data.val_batches(2).shape == (2, 2, 9) and len(read) == 4


def test_grad_accum_only_reshapes_the_synthetic_global_batch() -> None:
    flat = next(build_data(_cfg(source="synthetic", batch_size=8), 50, seed=1).train_iter())
    accum = next(build_data(_cfg(source="synthetic", batch_size=8, grad_accum=4), 50, seed=1).train_iter())
    np.testing.assert_array_equal(flat.reshape(8, 9), accum.reshape(8, 9))


def test_a_micro_batch_that_does_not_split_over_the_processes_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"= 6 sequences cannot be split evenly over 4 processes.*e\.g\. 8"):
        build_data(_cfg(source="synthetic", batch_size=12, grad_accum=2), 50, 0, shard=DataShard(0, 4))
    with pytest.raises(DataError, match=r"0 <= index < count"):
        DataShard(2, 2)
    with pytest.raises(DataError, match=r"must be an integer"):
        DataShard(0, 2.0)  # type: ignore[arg-type]
    assert "process 1 of 2" in build_data(_cfg(source="synthetic"), 50, 0, shard=DataShard(1, 2)).describe()


# ---------------------------------------------------------------------------------------------------
# Error paths: each names the problem, shows the values, and says how to fix it.
# ---------------------------------------------------------------------------------------------------


def test_missing_directory_lists_parent(tmp_path: Path) -> None:
    (tmp_path / "shakespeare").mkdir()
    with pytest.raises(DataError, match=r"does not exist.*shakespeare/.*train\.bin") as e:
        build_data(_cfg(tmp_path / "shakespear"), BIG_VOCAB, seed=0)
    assert "shakespear'" in str(e.value)
    assert isinstance(e.value, ConfigError)


def test_path_is_a_file(tmp_path: Path) -> None:
    _arange_dir(tmp_path, 100)
    with pytest.raises(DataError, match=r"is a file; data.path must be the directory"):
        build_data(_cfg(tmp_path / "train.bin"), BIG_VOCAB, seed=0)


def test_missing_train_bin_lists_directory(tmp_path: Path) -> None:
    (tmp_path / "train.txt").write_text("hello")
    (tmp_path / "val.bin").write_bytes(b"\0" * 40)
    with pytest.raises(DataError, match=r"train\.bin' not found; .* holds: train\.txt, val\.bin\."):
        build_data(_cfg(tmp_path), BIG_VOCAB, seed=0)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(DataError, match=r"holds: \(nothing: it is empty\)"):
        build_data(_cfg(empty), BIG_VOCAB, seed=0)


def test_tokens_source_needs_path() -> None:
    with pytest.raises(DataError, match="data.source=tokens needs data.path=DIR"):
        build_data(_cfg(""), BIG_VOCAB, seed=0)


def test_size_not_multiple_of_dtype(tmp_path: Path) -> None:
    write_tokens(tmp_path / "train.bin", np.arange(101), "uint16")  # 202 bytes: uint16 yes, uint32 no
    with pytest.raises(DataError, match=r"202 bytes, not a multiple of 4 .*set data.token_dtype=uint16"):
        build_data(_cfg(tmp_path, token_dtype="uint32"), BIG_VOCAB, seed=0)
    (tmp_path / "train.bin").write_bytes(b"\1" * 201)
    with pytest.raises(DataError, match=r"201 bytes, not a multiple of 2 .*fits neither uint16 nor uint32"):
        build_data(_cfg(tmp_path, token_dtype="uint16"), BIG_VOCAB, seed=0)


def test_too_short_for_one_sequence(tmp_path: Path) -> None:
    _arange_dir(tmp_path, 8)
    with pytest.raises(DataError, match=r"holds 8 uint32 tokens, leaving 8 .* data.seq_len\+1 = 9"):
        build_data(_cfg(tmp_path), BIG_VOCAB, seed=0)
    _arange_dir(tmp_path, 10)
    with pytest.raises(DataError, match=r"leaving 8 for training after holding out its last 2"):
        build_data(_cfg(tmp_path, val_fraction=0.2), BIG_VOCAB, seed=0)
    _arange_dir(tmp_path, 100, n_val=5)
    with pytest.raises(DataError, match=r"val\.bin' holds 5 uint32 tokens.*delete val\.bin"):
        build_data(_cfg(tmp_path), BIG_VOCAB, seed=0)


def test_fewer_windows_than_a_micro_batch(tmp_path: Path) -> None:
    _arange_dir(tmp_path, 3 * 8 + 1)  # 3 windows
    with pytest.raises(
        DataError,
        match=r"3 windows .* one micro-batch of data.batch_size/data.grad_accum = "
        r"4/1 = 4 sequences",
    ):
        build_data(_cfg(tmp_path), BIG_VOCAB, seed=0)
    assert build_data(_cfg(tmp_path, batch_size=6, grad_accum=2), BIG_VOCAB, seed=0).num_train_windows == 3


def test_validation_split_smaller_than_a_batch(tmp_path: Path) -> None:
    _arange_dir(tmp_path, 400)  # tail of 0.05 * 400 = 20 tokens = 2 windows < 4
    with pytest.raises(DataError, match=r"validation split has 20 tokens = 2 windows.*data.val_fraction=0"):
        build_data(_cfg(tmp_path, val_fraction=0.05), BIG_VOCAB, seed=0)


def test_token_id_not_below_vocab(tmp_path: Path) -> None:
    tokens = np.zeros(1_000, dtype=np.int64)
    tokens[123] = 70_000
    write_tokens(tmp_path / "train.bin", tokens, "uint32")
    with pytest.raises(DataError, match=r"token id 70000 at position 123 is >= model.vocab_size=50304"):
        build_data(_cfg(tmp_path), 50_304, seed=0)
    assert build_data(_cfg(tmp_path), 70_001, seed=0).vocab_size == 70_001


def test_vocab_check_is_bounded_but_samples_the_tail(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With data.check_tokens=false the check reads a bounded sample, the tail included."""
    monkeypatch.setattr(sources, "_VOCAB_CHECK_TOKENS", 400)  # 4 chunks of 100 over 10,000 tokens
    tokens = np.zeros(10_000, dtype=np.int64)
    tokens[-1] = 999
    write_tokens(tmp_path / "train.bin", tokens, "uint16")
    with pytest.raises(DataError, match=r"token id 999 at position 9,999"):
        build_data(_cfg(tmp_path, token_dtype="uint16", check_tokens=False), 500, seed=0)
    tokens[-1], tokens[5_000] = 0, 999  # between sampled chunks: not read, by design
    write_tokens(tmp_path / "train.bin", tokens, "uint16")
    build_data(_cfg(tmp_path, token_dtype="uint16", check_tokens=False), 500, seed=0)


def test_vocab_check_reads_every_token_by_default(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sources, "_VOCAB_CHECK_TOKENS", 400)
    monkeypatch.setattr(sources, "_FULL_CHECK_CHUNK", 1_000)  # several chunks over 10,000 tokens
    tokens = np.zeros(10_000, dtype=np.int64)
    tokens[5_000] = 999  # where the sample does not look
    write_tokens(tmp_path / "train.bin", tokens, "uint16")
    with pytest.raises(DataError, match=r"token id 999 at position 5,000"):
        build_data(_cfg(tmp_path, token_dtype="uint16"), 500, seed=0)


def test_wrong_dtype_shows_as_huge_ids(tmp_path: Path) -> None:
    write_tokens(tmp_path / "train.bin", np.arange(1, 401), "uint16")  # read as uint32: pairs fuse
    with pytest.raises(DataError, match=r"set data.token_dtype=uint16"):
        build_data(_cfg(tmp_path, token_dtype="uint32"), 50_304, seed=0)


def test_builtin_needs_byte_vocab() -> None:
    with pytest.raises(DataError, match=r"byte tokens 0\.\.255, but model.vocab_size=100"):
        build_data(DataConfig(source="builtin"), 100, seed=0)


def test_write_tokens_rejects_bad_input(tmp_path: Path) -> None:
    msg = r"ids span \[0, 70000\], outside uint16's \[0, 65535\] \(use dtype='uint32'\)"
    with pytest.raises(DataError, match=msg):
        write_tokens(tmp_path / "x.bin", [0, 70_000], "uint16")
    with pytest.raises(DataError, match="1-D"):
        write_tokens(tmp_path / "x.bin", np.zeros((2, 2), dtype=np.int64), "uint16")
    with pytest.raises(DataError, match="integer"):
        write_tokens(tmp_path / "x.bin", np.zeros(3), "uint16")
    assert not (tmp_path / "x.bin").exists()


def test_token_dtype_auto_reads_what_prepare_json_records(tmp_path: Path) -> None:
    """uint32 token files (`jaxzero.prepare` for a vocabulary over 65,536) are read as uint32 when
    data.token_dtype is not given (it read them as uint16: twice the tokens, every id garbage); without
    a prepare.json, as uint16 (nanoGPT's files)."""
    ids = np.arange(70_000, 70_000 + 4_000)  # ids above uint16's range, as a Llama 3 vocabulary has
    prepared = tmp_path / "prepared"
    prepared.mkdir()
    write_tokens(prepared / "train.bin", ids, "uint32")
    (prepared / "prepare.json").write_text(json.dumps({"recipe": {"eot_id": 1}, "token_dtype": "uint32"}))
    splits = load_token_files(prepared, token_dtype="auto", seq_len=8, val_fraction=0.0, vocab_size=BIG_VOCAB)
    assert splits.train.dtype == np.uint32 and np.array_equal(splits.train, ids)
    data = build_data(_cfg(prepared, token_dtype="auto"), BIG_VOCAB, seed=0)
    assert int(next(data.train_iter()).min()) >= 70_000  # real ids, not halves of uint32 words

    nanogpt = tmp_path / "nanogpt"
    nanogpt.mkdir()
    write_tokens(nanogpt / "train.bin", np.arange(4_000), "uint16")
    splits = load_token_files(nanogpt, token_dtype="auto", seq_len=8, val_fraction=0.0, vocab_size=BIG_VOCAB)
    assert splits.train.dtype == np.uint16 and len(splits.train) == 4_000
    assert DataConfig().token_dtype == "auto"


def test_token_dtype_contradicting_prepare_json_is_refused(tmp_path: Path) -> None:
    write_tokens(tmp_path / "train.bin", np.arange(70_000, 74_000), "uint32")
    (tmp_path / "prepare.json").write_text(json.dumps({"recipe": {"eot_id": 1}, "token_dtype": "uint32"}))
    with pytest.raises(DataError, match=r"data.token_dtype=uint16 contradicts .*prepare.json.* hold uint32"):
        build_data(_cfg(tmp_path, token_dtype="uint16"), BIG_VOCAB, seed=0)
    build_data(_cfg(tmp_path, token_dtype="uint32"), BIG_VOCAB, seed=0)  # agreeing with it: read
    (tmp_path / "prepare.json").write_text(json.dumps({"token_dtype": "int8"}))
    with pytest.raises(DataError, match=r"records token_dtype='int8'"):
        build_data(_cfg(tmp_path, token_dtype="auto"), BIG_VOCAB, seed=0)
