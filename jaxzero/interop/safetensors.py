"""Read and write the safetensors format with NumPy only: memory-mapped reads, streamed writes.

The format (https://github.com/huggingface/safetensors), all integers little-endian:

    8 bytes    N, an unsigned 64-bit header size
    N bytes    a UTF-8 JSON object {name: {"dtype": "F32", "shape": [d0, ...], "data_offsets": [begin, end]},
               ..., "__metadata__": {str: str}} (metadata optional), padded with spaces to 8-byte alignment
    rest       the byte buffer: each tensor's C-order little-endian bytes at [begin, end) relative to the
               start of the buffer; tensors tile the buffer exactly, with no holes and no overlaps

Why not Hugging Face's `safetensors` package: jaxzero's runtime depends on NumPy and JAX only, and its
export (`jaxzero.interop.hf_io`) must stream a model far larger than RAM one tensor at a time, which
`safetensors.numpy.save_file` (a dict of whole arrays in, one file out) cannot do.

Reading maps the file with `np.memmap` and hands out read-only views: nothing is read until a tensor's
pages are touched, so opening a shard costs no RAM, whatever its size. Writing takes the full list of
(name, dtype, shape) up front, writes the header, then accepts tensors one at a time in any order, so
the caller can convert one unit of a model, write it and drop it.

Supported dtypes: F64, F32, F16, BF16 (`ml_dtypes.bfloat16`, which ships with JAX), F8_E4M3 / F8_E5M2
(`ml_dtypes`), I64, I32, I16, I8, U64, U32, U16, U8 and BOOL.
"""

from __future__ import annotations

import errno
import json
import os
import struct
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType, TracebackType
from typing import Any

import ml_dtypes
import numpy as np

# safetensors dtype code -> NumPy dtype (always little-endian: the format is little-endian only).
DTYPES: Mapping[str, np.dtype] = MappingProxyType(
    {
        "F64": np.dtype("<f8"),
        "F32": np.dtype("<f4"),
        "F16": np.dtype("<f2"),
        "BF16": np.dtype(ml_dtypes.bfloat16),
        "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
        "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
        "I64": np.dtype("<i8"),
        "I32": np.dtype("<i4"),
        "I16": np.dtype("<i2"),
        "I8": np.dtype("i1"),
        "U64": np.dtype("<u8"),
        "U32": np.dtype("<u4"),
        "U16": np.dtype("<u2"),
        "U8": np.dtype("u1"),
        "BOOL": np.dtype("?"),
    }
)

# The reference implementation refuses headers above 100 MB; a larger size field means a corrupt file
# (or not a safetensors file at all), and must not make us try to allocate gigabytes for the JSON.
MAX_HEADER_BYTES = 100_000_000
_METADATA_KEY = "__metadata__"


class SafetensorsError(ValueError):
    """A safetensors file is malformed, or a write does not match its declared plan."""


def dtype_code(dtype: Any) -> str:
    """The safetensors code ("F32", "BF16", ...) of a NumPy dtype (or anything `np.dtype` accepts)."""
    dt = np.dtype(dtype)
    # Compare after normalising byte order: ">f4" is still F32 (we byte-swap it when writing).
    native = dt.newbyteorder("<") if dt.byteorder == ">" else dt
    for code, known in DTYPES.items():
        if native == known:
            return code
    raise SafetensorsError(
        f"dtype {dt} has no safetensors code; supported NumPy dtypes: "
        f"{', '.join(f'{c}={d}' for c, d in DTYPES.items())}."
    )


@dataclass(frozen=True)
class TensorInfo:
    """One tensor's header entry. `begin`/`end` are byte offsets into the data buffer (after the header)."""

    name: str
    dtype: str  # safetensors code, e.g. "BF16"
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def np_dtype(self) -> np.dtype:
        """The NumPy dtype of the stored elements."""
        return DTYPES[self.dtype]

    @property
    def nbytes(self) -> int:
        """Bytes the tensor occupies in the file (`end - begin`)."""
        return self.end - self.begin


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _parse_header(path: Path, raw: bytes, buffer_size: int) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """Validate the JSON header of `path` against its `buffer_size` data bytes; (tensors, metadata)."""
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SafetensorsError(
            f"{path}: the header is not valid UTF-8 JSON ({e}): the file is corrupt or not safetensors; "
            "download or export it again."
        ) from e
    if not isinstance(header, dict):
        raise SafetensorsError(f"{path}: the header is a JSON {type(header).__name__}, expected an object.")

    metadata = header.pop(_METADATA_KEY, None) or {}
    if not isinstance(metadata, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        raise SafetensorsError(f"{path}: __metadata__ must map strings to strings, got {metadata!r}.")

    tensors: dict[str, TensorInfo] = {}
    for name, entry in header.items():
        if not isinstance(entry, dict) or not {"dtype", "shape", "data_offsets"} <= set(entry):
            raise SafetensorsError(
                f"{path}: header entry {name!r} = {entry!r} must be an object with the keys "
                "dtype, shape and data_offsets."
            )
        code, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
        if code not in DTYPES:
            raise SafetensorsError(
                f"{path}: tensor {name!r} has dtype {code!r}; supported: {', '.join(DTYPES)}."
            )
        if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
            raise SafetensorsError(f"{path}: tensor {name!r} has shape {shape!r}, not a list of ints >= 0.")
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(type(o) is int for o in offsets)
            or not 0 <= offsets[0] <= offsets[1]
        ):
            raise SafetensorsError(
                f"{path}: tensor {name!r} has data_offsets {offsets!r}, "
                "not [begin, end] with 0 <= begin <= end."
            )
        begin, end = offsets
        expected = _numel(shape) * DTYPES[code].itemsize
        if end - begin != expected:
            raise SafetensorsError(
                f"{path}: tensor {name!r} ({code}, shape {shape}) needs {expected} bytes but its "
                f"data_offsets {offsets} span {end - begin}; the header is corrupt."
            )
        tensors[name] = TensorInfo(name, code, tuple(shape), begin, end)

    # A header whose tensors reach past the end of the file: the usual sign of a download or copy cut
    # short, so the message gives the whole file's sizes, which the user can compare with the source's.
    cut = sorted((t for t in tensors.values() if t.end > buffer_size), key=lambda t: t.begin)
    if cut:
        data_start = 8 + len(raw)
        last = max(t.end for t in tensors.values())
        raise SafetensorsError(
            f"{path}: the header lists {len(tensors)} tensors ending at byte {data_start + last}, but the "
            f"file has {data_start + buffer_size} bytes (tensor {cut[0].name!r} ends at data offset "
            f"{cut[0].end} but the file holds only {buffer_size} data bytes after its header): the file is "
            "truncated, an incomplete download or copy; download or export it again."
        )

    # The spec requires the tensors to tile the buffer exactly; a hole or an overlap means a corrupt
    # header (and an overlap would let two names alias the same bytes).
    pos = 0
    for info in sorted(tensors.values(), key=lambda t: (t.begin, t.end)):
        if info.begin != pos:
            what = "overlaps the previous tensor" if info.begin < pos else f"leaves a hole at {pos}"
            raise SafetensorsError(
                f"{path}: tensor {info.name!r} starts at data offset {info.begin} and {what}; "
                "safetensors requires tensors to tile the data buffer exactly."
            )
        pos = info.end
    if pos != buffer_size:
        raise SafetensorsError(
            f"{path}: the tensors cover {pos} data bytes but the file holds {buffer_size} after its header "
            "(trailing bytes): the file is corrupt."
        )
    return tensors, dict(metadata)


class SafetensorsReader(Mapping[str, np.ndarray]):
    """A read-only, memory-mapped view of one safetensors file; a Mapping from name to array.

    `reader[name]` is a read-only NumPy view of the mapped file in the stored dtype and shape (no bytes
    are read until used; copy with `np.array(...)` or `.astype(...)` to own the data). The header is
    fully validated on open. Use as a context manager, or call `close()`; views handed out keep the
    mapping alive after `close()`, which only drops the reader's own reference.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"safetensors file {str(self.path)!r} does not exist.")
        file_size = self.path.stat().st_size
        if file_size < 8:
            raise SafetensorsError(
                f"{self.path}: {file_size} bytes is too short for a safetensors file (the 8-byte header "
                "size alone is missing): the file is truncated or not safetensors."
            )
        with open(self.path, "rb") as f:
            (header_size,) = struct.unpack("<Q", f.read(8))
            if header_size > MAX_HEADER_BYTES or 8 + header_size > file_size:
                raise SafetensorsError(
                    f"{self.path}: header size field says {header_size} bytes but the file has {file_size} "
                    f"bytes (and headers are at most {MAX_HEADER_BYTES}): the file is truncated, corrupt or "
                    "not a safetensors file."
                )
            raw = f.read(header_size)
        if not raw.startswith(b"{"):
            raise SafetensorsError(
                f"{self.path}: the header does not start with '{{' (got {raw[:16]!r}): "
                "not a safetensors file."
            )
        self.data_start = 8 + header_size
        buffer_size = file_size - self.data_start
        tensors, metadata = _parse_header(self.path, raw, buffer_size)
        self.tensors: Mapping[str, TensorInfo] = MappingProxyType(tensors)
        self.metadata: Mapping[str, str] = MappingProxyType(metadata)
        # One mapping of the whole data buffer; tensors are zero-copy views of it. np.memmap cannot map
        # zero bytes, so a file of only empty tensors gets no mapping.
        self._mm: np.memmap | None = None
        if buffer_size:
            self._mm = np.memmap(
                self.path, dtype=np.uint8, mode="r", offset=self.data_start, shape=(buffer_size,)
            )

    def __getitem__(self, name: str) -> np.ndarray:
        try:
            info = self.tensors[name]
        except KeyError:
            raise KeyError(
                f"{self.path}: no tensor named {name!r} ({len(self.tensors)} tensors in the file)."
            ) from None
        if info.nbytes == 0:
            empty = np.zeros(info.shape, info.np_dtype)
            empty.flags.writeable = False  # read-only like every other tensor of the file
            return empty
        if self._mm is None:
            raise SafetensorsError(f"{self.path}: the reader is closed.")
        # .view() on a uint8 slice whose begin is not a multiple of the itemsize gives an unaligned array:
        # NumPy handles it correctly (slower); writers that sort by itemsize, like ours, avoid it.
        return self._mm[info.begin : info.end].view(info.np_dtype).reshape(info.shape)

    def __iter__(self) -> Iterator[str]:
        return iter(self.tensors)

    def __len__(self) -> int:
        return len(self.tensors)

    def close(self) -> None:
        """Drop the reader's mapping (arrays already handed out stay valid)."""
        self._mm = None

    def __enter__(self) -> SafetensorsReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def load_file(path: str | os.PathLike[str]) -> dict[str, np.ndarray]:
    """{name: read-only memory-mapped array} of every tensor of `path` (no data is read up front)."""
    with SafetensorsReader(path) as reader:
        return {name: reader[name] for name in reader}


@dataclass(frozen=True)
class TensorSpec:
    """A tensor the writer will receive: its name, NumPy dtype and shape."""

    name: str
    dtype: np.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return _numel(self.shape) * np.dtype(self.dtype).itemsize


def _reserve(fd: int, size: int) -> None:
    """Allocate `size` bytes for the open file `fd`, so that a full disk fails now, before any tensor is
    converted, rather than hours into an export. Filesystems without fallocate get a sparse file."""
    if hasattr(os, "posix_fallocate"):
        try:
            os.posix_fallocate(fd, 0, size)
            return
        except OSError as e:
            if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                raise
    os.ftruncate(fd, size)


class SafetensorsWriter:
    """Writes one safetensors file from a declared plan, one tensor at a time, in any order.

        specs = [TensorSpec("w", np.dtype(np.float32), (4, 8)), ...]
        with SafetensorsWriter(path, specs, metadata={"format": "pt"}) as w:
            for name, array in produce():   # one tensor in RAM at a time
                w.write(name, array)

    The header (offsets included) is written on construction; each `write` seeks to its tensor's slot.
    Tensors are laid out in decreasing itemsize, then plan order, so that every tensor is aligned to its
    itemsize (the header is padded to 8 bytes). The file is written as `<path>.partial` and renamed to
    `path` only when every planned tensor was written and `close()` succeeds; an exception inside the
    `with` block, or a missing tensor, deletes the partial file, so `path` never holds a half-written
    file.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        specs: Sequence[TensorSpec],
        metadata: Mapping[str, str] | None = None,
    ) -> None:
        self.path = Path(path)
        self._partial = self.path.with_name(self.path.name + ".partial")
        names = [s.name for s in specs]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise SafetensorsError(f"{self.path}: tensor names planned more than once: {dupes}.")
        if _METADATA_KEY in names:
            raise SafetensorsError(f"{self.path}: {_METADATA_KEY!r} is reserved and cannot name a tensor.")
        metadata = dict(metadata or {})
        bad = {k: v for k, v in metadata.items() if not (isinstance(k, str) and isinstance(v, str))}
        if bad:
            raise SafetensorsError(f"{self.path}: metadata must map str to str; offending entries: {bad!r}.")

        order = sorted(range(len(specs)), key=lambda i: (-np.dtype(specs[i].dtype).itemsize, i))
        header: dict[str, Any] = {}
        if metadata:
            header[_METADATA_KEY] = metadata
        self._slots: dict[str, tuple[TensorSpec, str, int]] = {}
        pos = 0
        for i in order:
            spec = specs[i]
            code = dtype_code(spec.dtype)
            shape = tuple(int(d) for d in spec.shape)
            header[spec.name] = {
                "dtype": code,
                "shape": list(shape),
                "data_offsets": [pos, pos + spec.nbytes],
            }
            self._slots[spec.name] = (spec, code, pos)
            pos += spec.nbytes
        self.data_size = pos
        raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
        raw += b" " * (-len(raw) % 8)  # the spec's 8-byte alignment of the data buffer
        self._data_start = 8 + len(raw)
        self._written: set[str] = set()

        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self._partial, "wb")  # closed by close() or abort()
        try:
            self._file.write(struct.pack("<Q", len(raw)))
            self._file.write(raw)
            self._file.flush()
            _reserve(self._file.fileno(), self._data_start + self.data_size)
        except BaseException:
            self.abort()
            raise

    def write(self, name: str, array: np.ndarray) -> None:
        """Write planned tensor `name`; `array` must have exactly the planned dtype and shape."""
        if name not in self._slots:
            raise SafetensorsError(f"{self.path}: tensor {name!r} was not in the plan given to the writer.")
        if name in self._written:
            raise SafetensorsError(f"{self.path}: tensor {name!r} was already written.")
        spec, code, offset = self._slots[name]
        array = np.asarray(array)
        if array.shape != tuple(spec.shape) or dtype_code(array.dtype) != code:
            raise SafetensorsError(
                f"{self.path}: tensor {name!r} was planned as {code} {tuple(spec.shape)} but got "
                f"{array.dtype} {array.shape}; cast/reshape it before writing."
            )
        if array.dtype.byteorder == ">":
            array = array.astype(array.dtype.newbyteorder("<"))
        array = np.ascontiguousarray(array)  # a no-op for C-contiguous arrays
        self._file.seek(self._data_start + offset)
        if array.size:
            # A uint8 view exposes the buffer protocol for every dtype (ml_dtypes' included) without a copy.
            self._file.write(array.reshape(-1).view(np.uint8).data)
        self._written.add(name)

    def close(self) -> Path:
        """Finish the file and move it into place; raises (and deletes it) if a planned tensor is missing."""
        if self._file.closed:
            return self.path
        missing = [n for n in self._slots if n not in self._written]
        if missing:
            self.abort()
            raise SafetensorsError(
                f"{self.path}: closed before these planned tensors were written: {missing}; "
                "nothing was saved."
            )
        try:
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
            os.replace(self._partial, self.path)
        except BaseException:
            self.abort()
            raise
        return self.path

    def abort(self) -> None:
        """Close and delete the partial file (the target path is left untouched)."""
        if not self._file.closed:
            self._file.close()
        self._partial.unlink(missing_ok=True)

    def __enter__(self) -> SafetensorsWriter:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


def save_file(
    tensors: Mapping[str, np.ndarray],
    path: str | os.PathLike[str],
    metadata: Mapping[str, str] | None = None,
) -> Path:
    """Write a dict of arrays to `path` (a convenience over `SafetensorsWriter` for small files)."""
    arrays = {name: np.asarray(a) for name, a in tensors.items()}
    specs = [TensorSpec(n, a.dtype, a.shape) for n, a in arrays.items()]
    with SafetensorsWriter(path, specs, metadata) as writer:
        for name, a in arrays.items():
            writer.write(name, a)
    return writer.path
