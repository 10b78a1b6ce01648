"""Which frozen base a run with a frozen part trained against, and whether it is still the same.

Its checkpoints hold no base: every reader rebuilds it from the config, from `seed` (the same every
time) or from `model.init_from`'s files, which may change after training (a new download, another
fine-tune saved over them). A checkpoint of such a run records a fingerprint of those files
(`base_record`), and resuming, evaluating or exporting it checks that the files still match
(`check_base`): adapters or units trained against other weights are refused, not silently combined.

The fingerprint reads little: each weight file's name, size, and first and last MiB (its header, and
weights at both ends), so it is cheap at every save and for a 140 GB checkpoint.
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path
from typing import Any

from jaxzero.config import CheckpointError, TrainConfig

SAMPLE = 1 << 20  # bytes read at each end of each file
ORBAX_MODEL_FILE = "model.json"  # what marks an Orbax export (`jaxzero.storage.orbax_export.MODEL_FILE`)


def base_record(cfg: TrainConfig) -> dict[str, str] | None:
    """{"init_from", "fingerprint"} of a run with a frozen part whose base comes from files; None
    otherwise (a base drawn from `seed` is rebuilt the same every time)."""
    if not (cfg.finetune.partial and cfg.model.init_from):
        return None
    path = Path(cfg.model.init_from).absolute()
    return {"init_from": str(path), "fingerprint": fingerprint(path)}


def fingerprint(path: Path) -> str:
    """A hex digest of the weight files of a checkpoint directory (the module docstring): a Hugging
    Face checkpoint's safetensors files, or every file of an Orbax export (known by its `model.json`,
    `jaxzero.storage.orbax_export`) but its marker."""
    if (path / ORBAX_MODEL_FILE).is_file():
        files = sorted(f for f in path.rglob("*") if f.is_file() and not f.name.startswith(".jaxzero-export"))
    else:
        files = sorted(path.glob("*.safetensors"))
    stats = tuple((str(f.relative_to(path)), f.stat().st_size, f.stat().st_mtime_ns) for f in files)
    return _digest(str(path), stats)


@functools.lru_cache(maxsize=8)
def _digest(path: str, stats: tuple[tuple[str, int, int], ...]) -> str:
    """`fingerprint`'s reads, once per state of the files (names, sizes, modification times)."""
    h = hashlib.sha256()
    for name, size, _ in stats:
        h.update(f"{name}:{size}".encode())
        with open(Path(path) / name, "rb") as f:
            h.update(f.read(SAMPLE))
            if size > SAMPLE:
                f.seek(max(SAMPLE, size - SAMPLE))
                h.update(f.read(SAMPLE))
    return h.hexdigest()


def check_base(meta: dict[str, Any], what: str) -> None:
    """CheckpointError where checkpoint metadata `meta` records a base (`base_record`) whose files are
    gone or changed; `what` names the checkpoint in the message."""
    record = meta.get("base")
    if not record:
        return
    path = Path(record["init_from"])
    if not path.is_dir():
        raise CheckpointError(
            f"{what} was trained over the frozen base {path}, which is no longer there: restore it there "
            "(the checkpoint holds only what trained, not the base)."
        )
    if fingerprint(path) != record["fingerprint"]:
        raise CheckpointError(
            f"{what} was trained over the frozen base {path}, whose files have changed since (another "
            "download or checkpoint saved there): what trained fits those weights only. Restore the "
            "original files, or start a new run over these."
        )
