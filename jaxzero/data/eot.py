"""The end-of-text id of a run's data: the token that ends each document and each fine-tuning example
in the token stream (`DataConfig.eot_id`), so that attention can stay inside a document.

`resolve_eot_id` turns the configured value into an id, or `NO_EOT` (one stream, no documents):

* an id ``>= 0``, or `NO_EOT` (-2), is taken as given;
* `FROM_DATA` (-1, the default) asks the data: the ``eot_id`` that ``prepare.json`` records beside
  token files `jaxzero.prepare` wrote; for nanoGPT ``.bin`` files without one, GPT-2's 50256 where
  the model's vocabulary is GPT-2's (50257, or 50304 padded); the built-in corpus and synthetic data
  have none (`NO_EOT`); other token files have none either, with a warning that attention will cross
  their document boundaries.

The built-in corpus ends every file with a NUL byte (`jaxzero.data.sources.BUILTIN_SEPARATOR`), so its
files are documents that id 0 could separate; it resolves to `NO_EOT` all the same, so that the default
run attends over its whole window as it always has (``--data.eot_id=0`` separates its files).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from jaxzero.config import DataConfig, TrainConfig
from jaxzero.data.types import DataError

log = logging.getLogger(__name__)  # the library speaks through logging (`jaxzero.run.console`)

# The recipe `jaxzero.prepare` writes beside its token files (`jaxzero.data.tokenizer.META_NAME`).
PREPARE_META = "prepare.json"
FROM_DATA = -1  # data.eot_id: the one the data says
NO_EOT = -2  # data.eot_id: none, the token stream is one document
# GPT-2's <|endoftext|>, which nanoGPT's prepare scripts write between documents, and its vocabulary
# sizes: the tokenizer's own and nanoGPT's padding to a multiple of 64.
GPT2_EOT_ID = 50256
GPT2_VOCAB_SIZES = (50257, 50304)


def prepared_meta(directory: str | Path) -> dict | None:
    """The ``prepare.json`` in `directory` (what `jaxzero.prepare` recorded of its token files), or
    None where there is none; DataError where it is not the JSON object prepare writes."""
    path = Path(directory) / PREPARE_META
    if not path.is_file():
        return None
    try:
        meta = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DataError(f"{path} is not the JSON jaxzero.prepare writes ({e}); rerun jaxzero.prepare.") from e
    if not isinstance(meta, dict):
        raise DataError(f"{path} is not the JSON object jaxzero.prepare writes; rerun jaxzero.prepare.")
    return meta


def prepared_eot_id(directory: str | Path) -> int | None:
    """The ``eot_id`` of the ``prepare.json`` in `directory`, or None where it has none. DataError
    if the file is there but does not say (not JSON, or no ``recipe.eot_id`` integer)."""
    meta = prepared_meta(directory)
    if meta is None:
        return None
    path = Path(directory) / PREPARE_META
    recipe = meta.get("recipe", {})
    eot = recipe.get("eot_id") if isinstance(recipe, dict) else None
    if not isinstance(eot, int) or isinstance(eot, bool) or eot < 0:
        raise DataError(
            f"{path} records no end-of-text id (recipe.eot_id={eot!r}); rerun jaxzero.prepare, or pass "
            "--data.eot_id=ID."
        )
    return eot


def data_eot_id(cfg: DataConfig, vocab_size: int, *, warn: bool = True) -> int:
    """`resolve_eot_id` of a data section and the model's vocabulary size: an id ``>= 0`` or `NO_EOT`.
    `warn`: log the warning for token files whose end-of-text id nothing says."""
    if cfg.eot_id >= 0 or cfg.eot_id == NO_EOT:
        return cfg.eot_id
    if cfg.eot_id != FROM_DATA:
        raise DataError(
            f"data.eot_id={cfg.eot_id} must be a token id (>= 0), {FROM_DATA} (the one the data says) or "
            f"{NO_EOT} (none)."
        )
    if cfg.source != "tokens":  # builtin (module docstring) and synthetic data: one stream
        return NO_EOT
    prepared = prepared_eot_id(cfg.path) if cfg.path else None
    if prepared is not None:
        return prepared
    if vocab_size in GPT2_VOCAB_SIZES:
        return GPT2_EOT_ID
    if warn and cfg.path and Path(cfg.path).is_dir():  # a missing directory is an error of its own, later
        log.warning(
            "warning: data.path=%r has no %s and model.vocab_size=%d is not GPT-2's: no end-of-text id "
            "is known, so attention will cross document boundaries (pass --data.eot_id=ID).",
            cfg.path,
            PREPARE_META,
            vocab_size,
        )
    return NO_EOT


def resolve_eot_id(cfg: TrainConfig) -> int:
    """The id that ends each document of `cfg`'s data (module docstring), or `NO_EOT` (-2) where the
    data has none. Cheap: reads at most the ``prepare.json`` beside the token files."""
    return data_eot_id(cfg.data, cfg.model.vocab_size)
