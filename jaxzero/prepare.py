"""`python -m jaxzero.prepare --input=GLOB [--input=GLOB ...] --out=DIR [--tokenizer=PATH]`: text
files, JSONL and Parquet into the token files `data.source=tokens` trains on.

Inputs, by extension: `.jsonl` (one JSON object per line, its `--text_field` a document), `.parquet`
(the `--text_field` column; needs pyarrow), anything else a UTF-8 text file that is one document.
Globs are expanded and sorted; the documents keep that order.

Tokenizer: `--tokenizer` names a Hugging Face checkpoint directory (its `tokenizer.json`) or the file
itself, read with the `tokenizers` library, offline. Texts are encoded without special tokens and each
document is followed by the end-of-text id: `--eot_id`, else the `eos_token` of the directory's
`tokenizer_config.json`. Without `--tokenizer`, the built-in byte-level tokenizer: UTF-8 bytes (vocab
256, `model.vocab_size=256`), documents separated by NUL, as the built-in corpus is.

Output, in `--out` only: `train.bin` (and `val.bin` with the first `--val_docs` documents), uint16 ids
where the vocabulary fits, else uint32, and `prepare.json` saying what was read and how. Files are
written under temporary names and renamed when complete. A rerun with the same inputs (paths, sizes,
modification times), tokenizer and settings does nothing; with anything changed it refuses unless
`--overwrite`, and it never replaces token files that it did not write (no `prepare.json` beside them).

Documents are encoded in parallel over `--workers` processes (default: the cores), in order.
"""

from __future__ import annotations

import argparse
import collections
import glob
import hashlib
import json
import multiprocessing
import os
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from jaxzero.data import BUILTIN_SEPARATOR, BUILTIN_VOCAB_SIZE, DataError

META_NAME = "prepare.json"
OUTPUTS = ("train.bin", "val.bin", META_NAME)
# Documents per task handed to a worker: large enough to amortise the pickling, small enough that
# the progress line moves and the ordered results do not pile up in memory.
_CHUNK_DOCS = 256


@dataclass(frozen=True)
class Recipe:
    """Everything the output depends on; a rerun with an equal recipe has nothing to do."""

    inputs: list[dict[str, Any]]  # {"path", "bytes", "mtime_ns"} per file, in document order
    tokenizer: str  # "bytes", or the tokenizer.json's path
    tokenizer_sha256: str  # "" for bytes
    text_field: str
    eot_id: int
    val_docs: int


# ---------------------------------------------------------------------------------------------------
# Tokenizers
# ---------------------------------------------------------------------------------------------------


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


# ---------------------------------------------------------------------------------------------------
# Documents
# ---------------------------------------------------------------------------------------------------


def expand_inputs(patterns: Sequence[str]) -> list[Path]:
    """The files the globs match, each pattern's sorted, in pattern order, without repeats."""
    files: list[Path] = []
    for pattern in patterns:
        matched = sorted(glob.glob(pattern, recursive=True))
        if not matched:
            raise DataError(f"--input={pattern!r} matches no file.")
        for m in matched:
            p = Path(m)
            if p.is_dir():
                raise DataError(
                    f"--input={pattern!r} matches the directory {m}; give files or a glob of files."
                )
            if p not in files:
                files.append(p)
    return files


def read_documents(path: Path, text_field: str) -> Iterator[str]:
    """The documents of one input file; DataError naming the file (and line or row) on bad input."""
    try:
        if path.suffix == ".jsonl":
            with path.open("rb") as f:
                for line_no, raw in enumerate(f, 1):
                    if not raw.strip():
                        continue
                    try:
                        record = json.loads(raw)
                    except (UnicodeDecodeError, json.JSONDecodeError) as e:
                        raise DataError(f"{path}:{line_no}: not a JSON object: {e}") from e
                    text = record.get(text_field) if isinstance(record, dict) else None
                    if not isinstance(text, str):
                        keys = sorted(record) if isinstance(record, dict) else type(record).__name__
                        raise DataError(
                            f"{path}:{line_no}: no text field {text_field!r} (a string) in this record "
                            f"(it has {keys}); set --text_field."
                        )
                    yield text
        elif path.suffix == ".parquet":
            yield from _parquet_documents(path, text_field)
        else:
            data = path.read_bytes()
            try:
                yield data.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataError(f"{path}: not UTF-8 text (byte {e.start}: {e.reason}).") from e
    except OSError as e:
        raise DataError(f"{path}: cannot be read: {e.strerror or e}.") from e


def _parquet_documents(path: Path, text_field: str) -> Iterator[str]:
    try:
        import pyarrow.parquet as pq  # optional (jaxzero[prepare]): only Parquet inputs need it
    except ImportError as e:
        raise DataError(
            f"{path}: reading Parquet needs pyarrow: pip install 'jaxzero[prepare]' (or pip install pyarrow)."
        ) from e
    try:
        pf = pq.ParquetFile(path)
    except Exception as e:  # pyarrow's ArrowInvalid and friends
        raise DataError(f"{path}: not a Parquet file pyarrow reads: {e}") from e
    if text_field not in pf.schema_arrow.names:
        raise DataError(
            f"{path}: no column {text_field!r} (it has {pf.schema_arrow.names}); set --text_field."
        )
    row = 0
    for batch in pf.iter_batches(columns=[text_field]):
        for text in batch.column(0).to_pylist():
            row += 1
            if not isinstance(text, str):
                raise DataError(f"{path}: row {row}: {text_field!r} is {text!r}, not a string.")
            yield text


def _chunks(files: Sequence[Path], text_field: str) -> Iterator[list[str]]:
    chunk: list[str] = []
    for path in files:
        for doc in read_documents(path, text_field):
            chunk.append(doc)
            if len(chunk) == _CHUNK_DOCS:
                yield chunk
                chunk = []
    if chunk:
        yield chunk


# Each worker process holds one tokenizer, built by the pool's initializer.
_WORKER_TOKENIZER: ByteTokenizer | HFTokenizer | None = None


def _init_worker(tokenizer: str) -> None:
    global _WORKER_TOKENIZER
    os.environ["TOKENIZERS_PARALLELISM"] = (
        "false"  # one thread per worker process: the processes are the parallelism
    )
    _WORKER_TOKENIZER = ByteTokenizer() if tokenizer == "bytes" else HFTokenizer(Path(tokenizer))


def _encode_chunk(texts: list[str]) -> list[np.ndarray]:
    assert _WORKER_TOKENIZER is not None
    return _WORKER_TOKENIZER.encode(texts)


def _in_order(
    pool: Any, chunks: Iterator[list[str]], ahead: int
) -> Iterator[tuple[list[str], list[np.ndarray]]]:
    """(texts, ids) of each chunk, in input order, with at most `ahead` chunks read and not yet
    written: the inputs are never read into memory whole."""
    pending: collections.deque[tuple[list[str], Any]] = collections.deque()
    for chunk in chunks:
        pending.append((chunk, pool.apply_async(_encode_chunk, (chunk,))))
        if len(pending) >= ahead:
            texts, result = pending.popleft()
            yield texts, result.get()
    while pending:
        texts, result = pending.popleft()
        yield texts, result.get()


# ---------------------------------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------------------------------


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _check_outputs(out: Path, recipe: Recipe, overwrite: bool) -> bool:
    """True when `out` already holds this recipe's output. Raises DataError where writing would replace
    files this tool did not write, or an earlier preparation without `--overwrite`."""
    meta_path = out / META_NAME
    ours = [name for name in OUTPUTS if (out / name).exists()]
    if not ours:
        return False
    if not meta_path.is_file():
        raise DataError(
            f"{out} already holds {', '.join(ours)} without a {META_NAME}: token files jaxzero.prepare "
            "did not write. Choose another --out; nothing was changed."
        )
    try:
        meta = json.loads(meta_path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DataError(f"{meta_path} is not valid JSON ({e}); move it away or choose another --out.") from e
    if meta.get("recipe") == json.loads(json.dumps(asdict(recipe))):
        return True
    if not overwrite:
        raise DataError(
            f"{out} holds a preparation of other inputs or settings ({META_NAME}); pass --overwrite to "
            "replace it, or choose another --out."
        )
    return False


class _Progress:
    """One stderr line, rewritten at most twice a second."""

    def __init__(self) -> None:
        self.start = self.last = time.monotonic()
        self.docs = self.tokens = self.chars = 0

    def add(self, texts: list[str], ids: list[np.ndarray]) -> None:
        self.docs += len(texts)
        self.chars += sum(len(t) for t in texts)
        self.tokens += sum(a.size + 1 for a in ids)
        now = time.monotonic()
        if now - self.last >= 0.5:
            self.last = now
            self.show("\r")

    def show(self, lead: str) -> None:
        s = max(time.monotonic() - self.start, 1e-9)
        print(
            f"{lead}jaxzero.prepare: {self.docs:,} documents, {self.tokens:,} tokens "
            f"({self.chars / s / 1e6:.1f} M characters/s)",
            end="",
            file=sys.stderr,
            flush=True,
        )


def prepare(
    inputs: Sequence[str],
    out: str | os.PathLike[str],
    *,
    tokenizer: str | None = None,
    text_field: str = "text",
    eot_id: int | None = None,
    val_docs: int = 0,
    workers: int = 0,
    overwrite: bool = False,
    progress: bool = True,
) -> dict[str, Any]:
    """Tokenize `inputs` (globs) into `out`/train.bin (and val.bin); returns what prepare.json holds.

    Everything is checked before a token is written: the globs match files, the tokenizer and its
    end-of-text id exist, `out` holds nothing this would wrongly replace. `workers` processes encode
    (0: one per core). See the module docstring for formats and files.
    """
    files = expand_inputs(inputs)
    if val_docs < 0:
        raise DataError(f"--val_docs={val_docs} must be >= 0.")
    if tokenizer is None:
        tok: ByteTokenizer | HFTokenizer = ByteTokenizer()
        tok_name, tok_sha = "bytes", ""
        eot = tok.eot_id if eot_id is None else eot_id
    else:
        file = tokenizer_file(tokenizer)
        tok = HFTokenizer(file)
        tok_name, tok_sha = str(file.resolve()), _sha256(file)
        eot = default_eot_id(file, tok) if eot_id is None else eot_id
    if not 0 <= eot < tok.vocab_size:
        raise DataError(f"--eot_id={eot} is outside the tokenizer's vocabulary of {tok.vocab_size}.")
    stats = [f.stat() for f in files]
    recipe = Recipe(
        inputs=[
            {"path": str(f.resolve()), "bytes": st.st_size, "mtime_ns": st.st_mtime_ns}
            for f, st in zip(files, stats)
        ],
        tokenizer=tok_name,
        tokenizer_sha256=tok_sha,
        text_field=text_field,
        eot_id=int(eot),
        val_docs=val_docs,
    )
    out_dir = Path(out)
    if out_dir.exists() and not out_dir.is_dir():
        raise DataError(f"--out={out_dir} is a file, not a directory.")
    if _check_outputs(out_dir, recipe, overwrite):
        meta = json.loads((out_dir / META_NAME).read_text())
        if progress:
            print(
                f"jaxzero.prepare: {out_dir} is up to date ({META_NAME} matches); nothing to do.",
                file=sys.stderr,
            )
        return meta
    out_dir.mkdir(parents=True, exist_ok=True)

    dtype = np.dtype(np.uint16 if tok.vocab_size <= 1 << 16 else np.uint32)
    eot_arr = np.asarray([eot], dtype)
    temps = {name: out_dir / f".{name}.{os.getpid()}.partial" for name in ("train.bin", "val.bin")}
    counts = {"train.bin": [0, 0], "val.bin": [0, 0]}  # documents, tokens
    shown = _Progress() if progress else None
    workers = workers or os.cpu_count() or 1
    try:
        with temps["train.bin"].open("wb") as train_f, temps["val.bin"].open("wb") as val_f:
            chunks = _chunks(files, text_field)
            if workers == 1:
                _init_worker(tok_name)
                results: Iterator[tuple[list[str], list[np.ndarray]]] = (
                    (c, _encode_chunk(c)) for c in chunks
                )
                pool = None
            else:
                # fork: the parent has not started JAX (this module does not import it)
                pool = multiprocessing.get_context("fork").Pool(
                    workers, initializer=_init_worker, initargs=(tok_name,)
                )
                results = _in_order(pool, chunks, 4 * workers)
            try:
                for texts, ids in results:
                    for doc in ids:
                        name = "val.bin" if counts["val.bin"][0] < val_docs else "train.bin"
                        f = val_f if name == "val.bin" else train_f
                        f.write(doc.astype(dtype, copy=False).tobytes())
                        f.write(eot_arr.tobytes())
                        counts[name][0] += 1
                        counts[name][1] += doc.size + 1
                    if shown:
                        shown.add(texts, ids)
            finally:
                if pool is not None:
                    pool.terminate()
        if counts["train.bin"][0] == 0:
            raise DataError(
                f"no training documents: the inputs hold {counts['val.bin'][0]} documents and --val_docs="
                f"{val_docs} took them all."
            )
        meta = {
            "recipe": asdict(recipe),
            "vocab_size": tok.vocab_size,
            "token_dtype": dtype.name,
            "train": {"documents": counts["train.bin"][0], "tokens": counts["train.bin"][1]},
            "val": {"documents": counts["val.bin"][0], "tokens": counts["val.bin"][1]},
        }
        os.replace(temps["train.bin"], out_dir / "train.bin")
        if val_docs:
            os.replace(temps["val.bin"], out_dir / "val.bin")
        else:
            temps["val.bin"].unlink()
            if overwrite:
                (out_dir / "val.bin").unlink(missing_ok=True)  # an earlier preparation's, ours
        fd, tmp = tempfile.mkstemp(dir=out_dir, prefix=f".{META_NAME}.", suffix=".partial")
        with os.fdopen(fd, "w") as f:
            json.dump(meta, f, indent=1)
        os.chmod(tmp, 0o644)  # mkstemp's 0600 would hide it from the group that reads the token files
        os.replace(tmp, out_dir / META_NAME)
    finally:
        for t in temps.values():
            t.unlink(missing_ok=True)
        if shown:
            shown.show("\r")
            print(file=sys.stderr)
    return meta


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m jaxzero.prepare",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--input", action="append", required=True, help="a file or glob; repeat for more")
    ap.add_argument("--out", required=True, help="the directory for train.bin, val.bin and prepare.json")
    ap.add_argument(
        "--tokenizer", default=None, help="HF checkpoint directory or tokenizer.json (default: bytes)"
    )
    ap.add_argument("--text_field", default="text", help="JSONL key / Parquet column of the text")
    ap.add_argument("--eot_id", type=int, default=None, help="end-of-text id (default: the tokenizer's eos)")
    ap.add_argument("--val_docs", type=int, default=0, help="the first N documents go to val.bin")
    ap.add_argument("--workers", type=int, default=0, help="encoding processes (0: one per core)")
    ap.add_argument("--overwrite", action="store_true", help="replace an earlier preparation in --out")
    args = ap.parse_args(argv)
    try:
        meta = prepare(
            args.input,
            args.out,
            tokenizer=args.tokenizer,
            text_field=args.text_field,
            eot_id=args.eot_id,
            val_docs=args.val_docs,
            workers=args.workers,
            overwrite=args.overwrite,
        )
    except DataError as e:
        print(f"jaxzero.prepare: error: {e}", file=sys.stderr)
        return 2
    t = meta["train"]
    print(
        f"jaxzero.prepare: {args.out}: {t['documents']:,} documents, {t['tokens']:,} tokens in train.bin"
        + (f", {meta['val']['tokens']:,} in val.bin" if meta["val"]["documents"] else "")
        + f" ({meta['token_dtype']}, vocabulary {meta['vocab_size']:,}).\n"
        f"Train on it: python -m jaxzero.train --data.source=tokens --data.path={args.out} "
        f"--data.token_dtype={meta['token_dtype']} --model.vocab_size={meta['vocab_size']} (or a model whose "
        "vocabulary holds it)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
