"""Rows of whole fine-tuning examples (`jaxzero.data.packing`) and the end-of-text id (`jaxzero.data.eot`).

The token sets here are made by hand: example ``k``'s tokens are ``1000 * (k + 1) + j`` for its ``j``-th
token, then the end-of-text id, so every token of a row says which example it belongs to and where.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from jaxzero.config import DataConfig, ModelConfig, TrainConfig
from jaxzero.data import (
    DataError,
    DataShard,
    DataState,
    ExampleData,
    WindowData,
    build_data,
    packing,
    resolve_eot_id,
    write_tokens,
)
from jaxzero.data.packing import best_fit_rows

EOT = 7
PAD = 0  # the padding's id: not the end-of-text one, so a row's padding is one document
VOCAB = 1 << 20
SEQ = 15  # rows of 16 tokens


def _example(k: int, n: int) -> np.ndarray:
    return np.append(1000 * (k + 1) + np.arange(n - 1), EOT)


def _write_split(root: Path, split: str, lengths: list[int], first: int = 0, index: bool = True) -> None:
    """Examples `first`, `first + 1`, ... of `lengths` tokens as `split`.bin with its mask (the second
    half of each example counted) and, with `index`, its example index."""
    examples = [_example(first + k, n) for k, n in enumerate(lengths)]
    write_tokens(root / f"{split}.bin", np.concatenate(examples), "uint32")
    marks = np.concatenate([np.arange(n) >= n // 2 for n in lengths]).astype(np.uint8)
    (root / f"{split}.mask.bin").write_bytes(marks.tobytes())
    if index:
        starts = np.cumsum([0, *lengths[:-1]]).astype(np.uint64)
        (root / f"{split}.idx.bin").write_bytes(starts.tobytes())


def _sft_dir(root: Path, lengths: list[int], val: list[int] | None = None, index: bool = True) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    _write_split(root, "train", lengths, index=index)
    if val:
        _write_split(root, "val", val, first=len(lengths), index=index)
    (root / "prepare.json").write_text(json.dumps({"recipe": {"eot_id": EOT}}))
    return root


def _lengths(n: int, seed: int = 0, top: int = SEQ + 1) -> list[int]:
    return np.random.default_rng(seed).integers(2, top + 1, n).tolist()


def _cfg(path: Path | str = "", **kw: object) -> DataConfig:
    base: dict[str, object] = dict(
        source="tokens", path=str(path), token_dtype="uint32", seq_len=SEQ, batch_size=4, val_fraction=0.0
    )
    base.update(kw)
    return DataConfig(**base)  # type: ignore[arg-type]


def _rows(batch: np.ndarray) -> np.ndarray:
    return batch.reshape(-1, batch.shape[-1])


def _parse(row: np.ndarray, lengths: list[int], first: int = 0) -> list[int]:
    """The examples of a row, checked: whole examples (or one cut to the row, alone), each starting
    at the row start or right after an end-of-text token, its first token and its uncounted tokens
    marked, then only padding (``~PAD``). `first`: the number of the split's first example."""
    ids = np.where(row < 0, ~row, row)
    found, at = [], 0
    while at < len(row) and not (row[at] < 0 and ids[at] == PAD):
        k = int(ids[at]) // 1000 - 1 - first
        assert at == 0 or ids[at - 1] == EOT, "an example starts mid-example"
        n = min(lengths[k], len(row))
        np.testing.assert_array_equal(ids[at : at + n], _example(k + first, lengths[k])[:n])
        counted = row[at : at + n] >= 0
        want = np.arange(lengths[k])[:n] >= lengths[k] // 2
        want[0] = False  # an example's first token is never a target
        np.testing.assert_array_equal(counted, want)
        assert n == lengths[k] or (at == 0 and n == len(row)), "a truncated example shares its row"
        found.append(k)
        at += n
    np.testing.assert_array_equal(row[at:], ~PAD)  # padding: not the eot, not a target
    return found


def _take(it: Iterator[np.ndarray], n: int) -> list[np.ndarray]:
    return [next(it) for _ in range(n)]


# ---------------------------------------------------------------------------------------------------
# Best fit
# ---------------------------------------------------------------------------------------------------


def _first_fit(lengths: np.ndarray, capacity: int) -> int:
    """Rows first fit (in the given order, each to the first row with room) needs."""
    rooms: list[int] = []
    for n in np.minimum(lengths, capacity).tolist():
        for r, room in enumerate(rooms):
            if room >= n:
                rooms[r] -= n
                break
        else:
            rooms.append(capacity - n)
    return len(rooms)


@pytest.mark.parametrize("seed", range(20))
def test_best_fit_places_every_example_whole_and_fills_rows_at_least_as_first_fit(seed: int) -> None:
    rng = np.random.default_rng(seed)
    capacity = int(rng.integers(8, 64))
    lengths = rng.integers(1, capacity + 8, int(rng.integers(1, 300)))
    rows = best_fit_rows(lengths, capacity)
    placed = np.concatenate(rows)
    np.testing.assert_array_equal(np.sort(placed), np.arange(len(lengths)))  # every example once
    assert all(np.minimum(lengths[r], capacity).sum() <= capacity for r in rows)  # whole, never split
    assert all(len(r) == 1 for r in rows if lengths[r].max() >= capacity)  # a full one alone
    assert len(rows) <= _first_fit(lengths, capacity)
    assert len(rows) >= -(-np.minimum(lengths, capacity).sum() // capacity)
    again = best_fit_rows(lengths, capacity)
    assert all(np.array_equal(a, b) for a, b in zip(rows, again, strict=True))


def test_best_fit_takes_the_row_with_least_room() -> None:
    # 6 opens row 0 (room 4), 5 opens row 1 (room 5), 4 goes to row 0 (least room that holds it).
    rows = best_fit_rows(np.array([4, 6, 5]), 10)
    assert [r.tolist() for r in rows] == [[1, 0], [2]]


# ---------------------------------------------------------------------------------------------------
# Training rows
# ---------------------------------------------------------------------------------------------------


def test_packed_rows_are_whole_examples_each_once_per_epoch_and_fill_rows(tmp_path: Path) -> None:
    lengths = _lengths(60) + [40, 17]  # two longer than a row of 16
    data = build_data(_cfg(_sft_dir(tmp_path, lengths)), VOCAB, seed=3)
    assert isinstance(data, ExampleData) and data.truncated_examples == 2
    assert "2 longer than a row, truncated" in data.describe()
    it = data.train_iter()
    order = [k for b in _take(it, 12) for row in _rows(b) for k in _parse(row, lengths)]
    assert sorted(order[: len(lengths)]) == list(range(len(lengths)))  # epoch 0: every example once
    assert order[len(lengths) :] and it.state.epoch >= 1
    assert sorted(order[len(lengths) :]) != order[len(lengths) :]  # epoch 1 shuffled again
    # epoch 0 (one block): fewer rows than examples, and no more than first fit in the shuffled order
    ids0, bounds = data.train_iter()._block(0, 0)
    assert len(bounds) - 1 <= _first_fit(np.asarray(lengths)[ids0], SEQ + 1)
    assert len(bounds) - 1 < len(lengths)


def test_same_seed_same_rows_other_seed_other_rows(tmp_path: Path) -> None:
    d = _sft_dir(tmp_path, _lengths(50))
    a = _take(build_data(_cfg(d), VOCAB, seed=1).train_iter(), 5)
    b = _take(build_data(_cfg(d), VOCAB, seed=1).train_iter(), 5)
    c = _take(build_data(_cfg(d), VOCAB, seed=2).train_iter(), 5)
    assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
    assert not all(np.array_equal(x, z) for x, z in zip(a, c, strict=True))


@pytest.mark.parametrize("pack", [True, False])
@pytest.mark.parametrize("k", [0, 1, 3, 5, 9])
def test_resume_matches_the_uninterrupted_stream(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, pack: bool, k: int
) -> None:
    # Blocks of 7 examples: the 6 batches after every k cross blocks and epochs.
    monkeypatch.setattr(packing, "PACK_BLOCK_EXAMPLES", 7)
    cfg = _cfg(_sft_dir(tmp_path, _lengths(30, seed=4)), batch_size=8, grad_accum=2, pack=pack)
    reference = _take(build_data(cfg, VOCAB, seed=7).train_iter(), k + 6)
    it = build_data(cfg, VOCAB, seed=7).train_iter()
    _take(it, k)
    saved = DataState.from_dict(json.loads(json.dumps(it.state.to_dict())))
    assert saved.num_windows == 30
    resumed = build_data(cfg, VOCAB, seed=7).train_iter(saved)
    assert resumed.state == saved
    for x, y in zip(_take(resumed, 6), reference[k:], strict=True):
        np.testing.assert_array_equal(x, y)


def test_resume_on_other_examples_or_packing_is_refused(tmp_path: Path) -> None:
    lengths = _lengths(40, seed=5)
    data = build_data(_cfg(_sft_dir(tmp_path, lengths)), VOCAB, seed=0)
    with pytest.raises(DataError, match=r"for 41 windows or examples per epoch, but this data has 40"):
        data.train_iter(DataState(epoch=0, cursor=0, num_windows=41))
    ids, bounds = data.train_iter()._block(0, 0)
    inside = next(c for c in range(1, 40) if c not in bounds.tolist())
    with pytest.raises(DataError, match="not at the start of a row"):
        data.train_iter(DataState(epoch=0, cursor=inside, num_windows=40))


def test_one_example_per_row_without_packing(tmp_path: Path) -> None:
    lengths = _lengths(11, seed=6) + [30]
    data = build_data(_cfg(_sft_dir(tmp_path, lengths), pack=False), VOCAB, seed=0)
    it = data.train_iter()
    batches = _take(it, 3)  # 12 examples, 4 rows a batch: one epoch
    order = [_parse(row, lengths) for b in batches for row in _rows(b)]
    assert all(len(o) == 1 for o in order)
    assert sorted(o[0] for o in order) == list(range(12))
    assert it.truncated == data.truncated_examples == 1 and it.state == DataState(1, 0, 12)


@pytest.mark.parametrize("pack", [True, False])
def test_the_padding_the_rows_end_with_is_what_the_router_statistics_leave_out(
    tmp_path: Path, pack: bool
) -> None:
    """`objective.real_tokens` of the rows the data makes is False exactly at each row's padding:
    every example's tokens count (their prompts, an example cut to fill its row), as transformers'
    attention mask keeps them for a mixture of experts' load-balancing loss."""
    import jax.numpy as jnp

    from jaxzero.numerics.objective import real_tokens

    lengths = _lengths(24, seed=3, top=SEQ + 6)  # some cut to the row
    data = build_data(_cfg(_sft_dir(tmp_path, lengths), pack=pack), VOCAB, seed=0)
    rows = np.concatenate([_rows(b) for b in _take(data.train_iter(), 6)])
    real = np.asarray(real_tokens(jnp.asarray(rows), EOT))
    for row, counts in zip(rows, real):
        used = sum(min(lengths[k], len(row)) for k in _parse(row, lengths))
        np.testing.assert_array_equal(counts, np.arange(SEQ) < used)
    assert not real.all() and real.all(axis=1).any() and real[:, 0].all()


def test_truncated_examples_are_counted_as_they_pass(tmp_path: Path) -> None:
    lengths = [20, 3, 3, 33, 5, 16, 17, 2]  # 20, 33, 17 longer than 16
    data = build_data(_cfg(_sft_dir(tmp_path, lengths), batch_size=2), VOCAB, seed=0)
    assert data.truncated_examples == 3
    it = data.train_iter()
    seen = 0
    while it.state.epoch == 0:
        batch = next(it)
        seen += sum(lengths[k] > SEQ + 1 for row in _rows(batch) for k in _parse(row, lengths))
        assert it.truncated == seen
    assert seen >= 3


@pytest.mark.parametrize("count", [2, 4])
def test_process_shards_make_the_global_rows(tmp_path: Path, count: int) -> None:
    cfg = _cfg(_sft_dir(tmp_path, _lengths(50, seed=8), val=_lengths(30, seed=9)), batch_size=8, grad_accum=2)
    whole = build_data(cfg, VOCAB, seed=3)
    parts = [build_data(cfg, VOCAB, 3, shard=DataShard(i, count)) for i in range(count)]
    it, iters = whole.train_iter(), [p.train_iter() for p in parts]
    for _ in range(5):
        reference, batches = next(it), [next(i) for i in iters]
        np.testing.assert_array_equal(np.concatenate(batches, axis=1), reference)
        assert {i.state for i in iters} == {it.state} and {i.truncated for i in iters} == {it.truncated}
    np.testing.assert_array_equal(
        np.concatenate([p.val_batches(3) for p in parts], axis=1), whole.val_batches(3)
    )


def test_validation_rows_are_fixed_whole_examples(tmp_path: Path) -> None:
    val = _lengths(40, seed=10)
    d = _sft_dir(tmp_path, _lengths(20), val=val)
    a, b = build_data(_cfg(d), VOCAB, seed=0), build_data(_cfg(d), VOCAB, seed=9)
    v = a.val_batches(3)
    assert v.shape == (3, 4, SEQ + 1) and v.dtype == np.int32
    np.testing.assert_array_equal(v, b.val_batches(3))  # the same for every seed
    np.testing.assert_array_equal(v[:1], a.val_batches(1))  # a prefix
    found = [k for row in _rows(a.val_batches(100)) for k in _parse(row, val, first=20)]
    assert len(found) == len(set(found))  # distinct rows
    assert a.max_val_batches == a.val_batches(100).shape[0]


def test_without_val_bin_the_last_examples_are_held_out(tmp_path: Path) -> None:
    lengths = _lengths(40, seed=11)
    data = build_data(_cfg(_sft_dir(tmp_path, lengths), val_fraction=0.25), VOCAB, seed=0)
    assert data.num_train_examples == 30
    held = [k for row in _rows(data.val_batches(100)) for k in _parse(row, lengths[30:], first=30)]
    assert set(held) <= set(range(10))


class _Caught(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture
def warnings_of_data() -> Iterator[list[str]]:
    """The warnings `jaxzero.data` logs (caught on its own logger: `jaxzero` may not propagate)."""
    caught, logger = _Caught(), logging.getLogger("jaxzero.data")
    logger.addHandler(caught)
    try:
        yield caught.messages
    finally:
        logger.removeHandler(caught)


def test_a_directory_prepared_without_the_index_trains_on_windows_with_a_warning(
    tmp_path: Path, warnings_of_data: list[str]
) -> None:
    lengths = _lengths(30)
    data = build_data(_cfg(_sft_dir(tmp_path, lengths, index=False)), VOCAB, seed=0)
    assert isinstance(data, WindowData)
    assert len(warnings_of_data) == 1 and "Rerun jaxzero.prepare --sft" in warnings_of_data[0]
    batch = next(data.train_iter())
    assert batch.shape == (1, 4, SEQ + 1) and (batch < 0).any()  # the loss masks still apply


def test_an_index_that_does_not_match_its_tokens_is_refused(tmp_path: Path) -> None:
    d = _sft_dir(tmp_path, _lengths(10))
    (d / "train.idx.bin").write_bytes(np.array([0, 5, 3], np.uint64).tobytes())
    with pytest.raises(DataError, match=r"train\.idx\.bin' is not an index"):
        build_data(_cfg(d), VOCAB, seed=0)


# ---------------------------------------------------------------------------------------------------
# The end-of-text id
# ---------------------------------------------------------------------------------------------------


def _train_cfg(vocab: int, **data: object) -> TrainConfig:
    return TrainConfig(model=ModelConfig(vocab_size=vocab), data=DataConfig(**data))  # type: ignore[arg-type]


def test_resolve_eot_id(tmp_path: Path, warnings_of_data: list[str]) -> None:
    prepared = _sft_dir(tmp_path / "prepared", [3, 4])
    nanogpt = tmp_path / "nanogpt"
    write_tokens(nanogpt / "train.bin", np.arange(100), "uint16")
    assert resolve_eot_id(_train_cfg(256, eot_id=5)) == 5  # given: as is
    assert resolve_eot_id(_train_cfg(256, eot_id=-2, source="tokens", path=str(prepared))) == -2
    assert resolve_eot_id(_train_cfg(VOCAB, source="tokens", path=str(prepared))) == EOT
    for vocab in (50257, 50304):
        assert resolve_eot_id(_train_cfg(vocab, source="tokens", path=str(nanogpt))) == 50256
    assert resolve_eot_id(_train_cfg(256)) == -2  # the built-in corpus
    assert resolve_eot_id(_train_cfg(256, source="synthetic")) == -2
    assert not warnings_of_data
    assert resolve_eot_id(_train_cfg(1000, source="tokens", path=str(nanogpt))) == -2
    assert len(warnings_of_data) == 1 and "attention will cross document boundaries" in warnings_of_data[0]
    assert "--data.eot_id=ID" in warnings_of_data[0]
    # a data.path that does not exist: no warning (the data check says what is wrong, next)
    assert resolve_eot_id(_train_cfg(1000, source="tokens", path=str(tmp_path / "absent"))) == -2
    assert len(warnings_of_data) == 1
    (prepared / "prepare.json").write_text("{")
    with pytest.raises(DataError, match="prepare.json is not the JSON"):
        resolve_eot_id(_train_cfg(256, source="tokens", path=str(prepared)))
    with pytest.raises(DataError, match="data.eot_id=-3"):
        resolve_eot_id(dataclasses.replace(_train_cfg(256), data=DataConfig(eot_id=-3)))


def test_padding_is_never_the_end_of_text(tmp_path: Path) -> None:
    d = _sft_dir(tmp_path, [5, 6, 7, 8])
    assert build_data(_cfg(d), VOCAB, seed=0).pad == PAD  # type: ignore[attr-defined]
    assert build_data(_cfg(d, eot_id=-2), VOCAB, seed=0).pad == PAD  # type: ignore[attr-defined]
    assert build_data(_cfg(d, eot_id=0), VOCAB, seed=0).pad == 1  # type: ignore[attr-defined]


def test_examples_whose_every_target_is_past_the_row_are_refused(tmp_path: Path, caplog) -> None:
    """Every example's counted half starts past a row of data.seq_len + 1 = 16 tokens: each step would
    count no loss (`loss -`, `val_loss 0.0000`, exit 0): refused at start with the lengths."""
    with pytest.raises(DataError, match=r"no fine-tuning example of the training split has a target .* "
                       r"16 tokens: the examples are 40 to 40 tokens long \(median 40\), 6 of them"):
        build_data(_cfg(_sft_dir(tmp_path / "long", [40] * 6)), VOCAB, seed=0)
    # Some keep a target: trained, with a warning naming how many train nothing.
    with caplog.at_level(logging.WARNING, logger="jaxzero"):
        build_data(_cfg(_sft_dir(tmp_path / "mixed", [40, 8, 40, 9, 10, 40])), VOCAB, seed=0)
    assert "3 of the 6 fine-tuning examples of the training split have no target" in caplog.text
    # The validation split alike, where it is read.
    with pytest.raises(DataError, match=r"of the validation split has a target"):
        build_data(_cfg(_sft_dir(tmp_path / "val", [8] * 6, val=[40] * 4)), VOCAB, seed=0)


def test_examples_with_targets_counts_within_the_row() -> None:
    """A target at the row's last position counts; one just past it does not; the first token never."""
    counted = np.zeros(40, np.uint8)
    counted[[15, 16 + 16, 20]] = 1  # example 0 (0..15): position 15; example 1 (16..39): 16 and 4
    starts, lengths = np.array([0, 16]), np.array([16, 24])
    kept = packing._examples_with_targets
    np.testing.assert_array_equal(kept(counted, starts, lengths, 16), [True, True])
    counted[[15, 20]] = 0  # left: example 1's position 16, past its row of 16
    np.testing.assert_array_equal(kept(counted, starts, lengths, 16), [False, False])
    counted[16] = 1  # example 1's first token: never a target
    np.testing.assert_array_equal(kept(counted, starts, lengths, 16), [False, False])
