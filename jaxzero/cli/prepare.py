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
modification times), tokenizer and settings does nothing (unless a file it writes is missing, such as
the example index of a preparation made before it existed: then it writes them again); with anything
changed it refuses unless `--overwrite`, and it never replaces token files that it did not write (no
`prepare.json` beside them).

Fine-tuning data (`--sft`): JSONL records `{"prompt": ..., "completion": ...}` (encoded separately,
then the end-of-text id) or `{"messages": [{"role": ..., "content": ...}, ...]}` (rendered with the
checkpoint's `chat_template` from tokenizer_config.json, as transformers' apply_chat_template renders
it, with `strftime_now` at a fixed date, and each `--template_arg KEY=VALUE` passed to the template as
`apply_chat_template(..., KEY=VALUE)` passes it: VALUE read as JSON where it parses, else a string,
e.g. `--template_arg enable_thinking=false` for Qwen3, `--template_arg reasoning_effort=high` for
gpt-oss). Each example ends with the end-of-text id, and they are
written one after another; `train.mask.bin` (and `val.mask.bin`) hold one byte per token, 1 where the
token is a target the loss counts: completions and their end-of-text, assistant turns (from after
the generation prompt's header through the turn's end-of-turn marker); prompts, system and user turns
are 0; `train.idx.bin` (and `val.idx.bin`) hold the uint64 offset of each example's first token in its
token file. Training reads the masks with the token files, and packs whole examples into rows by the index
(`jaxzero.data.packing`).

Documents are encoded in parallel over `--workers` processes (default: the cores), in order. Ctrl-C,
SIGTERM or SIGHUP stops it at once: the workers are killed, the unfinished files removed, one line
printed, exit status 128 + the signal (130 for Ctrl-C).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from jaxzero.data.chat_template import ChatTemplate, check_template_args, parse_template_args
from jaxzero.data.documents import expand_inputs
from jaxzero.data.encoding import encoded_spans
from jaxzero.data.tokenizer import META_NAME, ByteTokenizer, HFTokenizer, default_eot_id, tokenizer_file
from jaxzero.data.types import DataError

# What stops a preparation, cleaning up: Ctrl-C, a service manager's SIGTERM, a closed terminal's SIGHUP.
_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

OUTPUTS = (
    "train.bin",
    "val.bin",
    "train.mask.bin",
    "val.mask.bin",
    "train.idx.bin",
    "val.idx.bin",
    META_NAME,
)


@dataclass(frozen=True)
class Recipe:
    """Everything the output depends on; a rerun with an equal recipe has nothing to do."""

    inputs: list[dict[str, Any]]  # {"path", "bytes", "mtime_ns"} per file, in document order
    tokenizer: str  # "bytes", or the tokenizer.json's path
    tokenizer_sha256: str  # "" for bytes
    text_field: str
    eot_id: int
    val_docs: int
    sft: bool = False
    # The chat template that split SFT conversations (tokenizer_config.json's, with its special tokens
    # and the date strftime_now prints): a changed template changes the counted tokens. "": none used.
    chat_template_sha256: str = ""
    # The keyword arguments every rendering of the chat template was given (--template_arg): other
    # arguments render other text. {}: none.
    chat_template_args: dict[str, Any] = field(default_factory=dict)

    def recorded(self) -> dict[str, Any]:
        """What prepare.json holds: the fields, without an unused chat template's empty hash or empty
        arguments (so preparations from before those fields still read as up to date)."""
        d = json.loads(json.dumps(asdict(self)))
        for key in ("chat_template_sha256", "chat_template_args"):
            if not d[key]:
                del d[key]
        return d


def _shown(args: Mapping[str, Any]) -> str:
    """Template arguments as the command line gives them: `enable_thinking=false`."""
    return " ".join(f"{k}={json.dumps(v)}" for k, v in args.items())


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _temporary(name: str) -> int:
    """The pid of the preparation writing `name` when it is one of its unfinished files
    (`.train.bin.<pid>.partial`), else 0."""
    parts = name.split(".")
    if len(parts) < 4 or parts[0] or parts[-1] != "partial" or not parts[-2].isdigit():
        return 0
    return int(parts[-2]) if ".".join(parts[1:-2]) in OUTPUTS else 0


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _check_outputs(out: Path, recipe: Recipe, overwrite: bool, names: Sequence[str]) -> bool:
    """True when `out` already holds this recipe's output, every one of `names` included (a preparation
    from before the example index lacks ``*.idx.bin``: it is made again). Raises DataError where `out`
    holds anything but an earlier preparation (a run directory, someone's files: as an export, prepare
    writes only into a new or empty directory or over its own output), where writing would replace files
    this tool did not write, or an earlier preparation without `--overwrite`. A killed preparation's
    unfinished files are removed."""
    meta_path = out / META_NAME
    entries = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    foreign = [e for e in entries if e not in OUTPUTS and not _temporary(e)]
    if foreign and not meta_path.is_file():
        shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        raise DataError(
            f"--out={out} is not empty and is not a jaxzero.prepare output (it holds {shown}; no "
            f"{META_NAME}): prepare writes only into a new or empty directory or over its own earlier "
            "output. Choose a new --out; nothing was changed."
        )
    for stale in (e for e in entries if _temporary(e) and not _running(_temporary(e))):
        (out / stale).unlink(missing_ok=True)  # a killed preparation's unfinished file
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
    if meta.get("recipe") == recipe.recorded():
        return all((out / name).is_file() for name in names)
    if not overwrite:
        raise DataError(
            f"{out} holds a preparation of other inputs or settings ({META_NAME}); pass --overwrite to "
            "replace it, or choose another --out."
        )
    return False


class _Progress:
    """Progress on stderr: on a terminal one line, rewritten at most twice a second and erased at the
    end (the summary that follows says the same); in a log a line every `LOG_EVERY_S` seconds."""

    LOG_EVERY_S = 30.0

    def __init__(self, stream: TextIO = sys.stderr) -> None:
        self.stream = stream
        self.tty = stream.isatty()
        self.start = self.last = time.monotonic()
        self.docs = self.tokens = self.chars = 0
        self.width = 0  # of the line on the terminal

    def add(self, docs: int, chars: int, tokens: int) -> None:
        self.docs += docs
        self.chars += chars
        self.tokens += tokens
        now = time.monotonic()
        if now - self.last >= (0.5 if self.tty else self.LOG_EVERY_S):
            self.last = now
            self.show()

    def show(self) -> None:
        s = max(time.monotonic() - self.start, 1e-9)
        line = (
            f"jaxzero.prepare: {self.docs:,} documents, {self.tokens:,} tokens "
            f"({self.chars / s / 1e6:.1f} M characters/s)"
        )
        if self.tty:
            self.width = max(self.width, len(line))
            self.stream.write(f"\r{line}")
        else:
            self.stream.write(f"{line}\n")
        self.stream.flush()

    def close(self) -> None:
        """Erase the terminal's line, for the summary to take its place."""
        if self.tty and self.width:
            self.stream.write("\r" + " " * self.width + "\r")
            self.stream.flush()


def prepare(
    inputs: Sequence[str],
    out: str | os.PathLike[str],
    *,
    tokenizer: str | None = None,
    text_field: str = "text",
    eot_id: int | None = None,
    val_docs: int = 0,
    sft: bool = False,
    template_args: Mapping[str, Any] | None = None,
    workers: int = 0,
    overwrite: bool = False,
    progress: bool = True,
) -> dict[str, Any]:
    """Tokenize `inputs` (globs) into `out`/train.bin (and val.bin); returns what prepare.json holds.

    Everything is checked before a token is written: the globs match files, the tokenizer and its
    end-of-text id exist, `out` holds nothing this would wrongly replace. `template_args` are the chat
    template's keyword arguments (`--template_arg`; with `sft` and a tokenizer whose
    tokenizer_config.json has a chat template). `workers` processes encode (0: one per core). See the
    module docstring for formats and files.
    """
    files = expand_inputs(inputs)
    if val_docs < 0:
        raise DataError(f"--val_docs={val_docs} must be >= 0.")
    if workers < 0:
        raise DataError(f"--workers={workers}: give a number of encoding processes, or 0 for one per core.")
    template_args = check_template_args(template_args or {})
    if template_args and not sft:
        raise DataError(
            f"--template_arg {_shown(template_args)} is given to a chat template, which only --sft uses "
            "(for messages records): add --sft, or leave the --template_arg out."
        )
    if template_args and tokenizer is None:
        raise DataError(
            f"--template_arg {_shown(template_args)} needs a chat template, which the built-in byte "
            "tokenizer has none of: pass --tokenizer=DIR of a checkpoint whose tokenizer_config.json has "
            "a chat_template, or leave the --template_arg out."
        )
    chat = None
    if tokenizer is None:
        tok: ByteTokenizer | HFTokenizer = ByteTokenizer()
        tok_name, tok_sha = "bytes", ""
        eot = tok.eot_id if eot_id is None else eot_id
    else:
        file = tokenizer_file(tokenizer)
        tok = HFTokenizer(file)
        tok_name, tok_sha = str(file.resolve()), _sha256(file)
        eot = default_eot_id(file, tok) if eot_id is None else eot_id
        chat = ChatTemplate.of(file, template_args) if sft else None
        if template_args and chat is None:
            raise DataError(
                f"--template_arg {_shown(template_args)} needs a chat template, and "
                f"{file.parent / 'tokenizer_config.json'} has no chat_template: pass the --tokenizer of a "
                "checkpoint with one, or leave the --template_arg out."
            )
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
        sft=sft,
        chat_template_sha256="" if chat is None else chat.sha256(),
        chat_template_args=template_args,
    )
    out_dir = Path(out)
    if out_dir.exists() and not out_dir.is_dir():
        raise DataError(f"--out={out_dir} is a file, not a directory.")
    names = ["train.bin", "val.bin"]
    if sft:
        names += ["train.mask.bin", "val.mask.bin", "train.idx.bin", "val.idx.bin"]
    written = [n for n in names if val_docs or not n.startswith("val")]
    if _check_outputs(out_dir, recipe, overwrite, written):
        meta = json.loads((out_dir / META_NAME).read_text())
        if progress:
            print(
                f"jaxzero.prepare: {out_dir} is up to date ({META_NAME} matches); nothing to do.",
                file=sys.stderr,
            )
        return meta
    created = not out_dir.exists()
    out_dir.mkdir(parents=True, exist_ok=True)

    dtype = np.dtype(np.uint16 if tok.vocab_size <= 1 << 16 else np.uint32)
    temps = {name: out_dir / f".{name}.{os.getpid()}.partial" for name in names}
    meta_tmp = out_dir / f".{META_NAME}.{os.getpid()}.partial"  # named as the token files' (_temporary)
    counts = {"train": [0, 0, 0], "val": [0, 0, 0]}  # documents, tokens, counted targets
    shown = _Progress() if progress else None
    workers = workers or os.cpu_count() or 1
    encoder_args = (tok_name, int(eot), sft, chat)
    try:
        with contextlib.ExitStack() as stack:
            files_out = {name: stack.enter_context(t.open("wb")) for name, t in temps.items()}
            results = stack.enter_context(encoded_spans(files, text_field, encoder_args, workers))
            for enc in results:
                # the first val_docs documents of the inputs go to val, the rest to train
                n = enc.ends.size
                to_val = min(max(val_docs - counts["val"][0], 0), n)
                bounds = np.concatenate([np.zeros(1, np.int64), enc.ends])
                for split, lo, hi in (("val", 0, to_val), ("train", to_val, n)):
                    if lo == hi:
                        continue
                    a, b, c = int(bounds[lo]), int(bounds[hi]), counts[split]
                    if sft:  # where each example starts in its token file
                        files_out[f"{split}.idx.bin"].write(
                            (bounds[lo:hi] - a + c[1]).astype(np.uint64).tobytes()
                        )
                    files_out[f"{split}.bin"].write(enc.ids[a:b].astype(dtype).tobytes())
                    if enc.marks is not None:
                        files_out[f"{split}.mask.bin"].write(enc.marks[a:b].tobytes())
                    c[0] += hi - lo
                    c[1] += b - a
                    c[2] += b - a if enc.marks is None else int(enc.marks[a:b].sum())
                if shown:
                    shown.add(n, enc.chars, enc.ids.size)
        documents, tokens = counts["train"][0] + counts["val"][0], counts["train"][1] + counts["val"][1]
        if documents and tokens <= documents:  # at most each document's end-of-text id: empty inputs
            raise DataError(
                f"the inputs hold no text: {documents} document(s), every one empty. Check the input "
                "files (and --text_field for JSON lines)."
            )
        if counts["train"][0] == 0:
            raise DataError(
                f"no training documents: the inputs hold {counts['val'][0]} documents and --val_docs="
                f"{val_docs} took them all."
            )
        meta = {
            "recipe": recipe.recorded(),
            "vocab_size": tok.vocab_size,
            "token_dtype": dtype.name,
            **{
                split: {"documents": c[0], "tokens": c[1], "loss_tokens": c[2]} for split, c in counts.items()
            },
        }
        for name in written:
            os.replace(temps[name], out_dir / name)
        for name in OUTPUTS:  # an earlier preparation's, replaced with --overwrite (_check_outputs)
            if name != META_NAME and name not in written:
                (out_dir / name).unlink(missing_ok=True)
        meta_tmp.write_text(json.dumps(meta, indent=1))
        os.replace(meta_tmp, out_dir / META_NAME)
    except BaseException:
        for t in [*temps.values(), meta_tmp]:
            t.unlink(missing_ok=True)
        if created and not any(out_dir.iterdir()):
            out_dir.rmdir()  # the directory this run made, left empty by its failure
        raise
    finally:
        for t in [*temps.values(), meta_tmp]:
            t.unlink(missing_ok=True)
        if shown:
            shown.close()
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
    ap.add_argument("--sft", action="store_true", help="JSONL fine-tuning examples, with loss masks")
    ap.add_argument(
        "--template_arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a keyword argument of the chat template (VALUE as JSON where it parses, else a string), "
        "e.g. enable_thinking=false; repeat for more",
    )
    ap.add_argument("--workers", type=int, default=0, help="encoding processes (0: one per core)")
    ap.add_argument("--overwrite", action="store_true", help="replace an earlier preparation in --out")
    args = ap.parse_args(argv)
    stopped: list[int] = []

    def stop(signum: int, frame: Any) -> None:
        # the first one interrupts where the program is; the rest are ignored, so that the cleanup it
        # runs (the workers killed, the unfinished files removed) is not cut short
        for s in _STOP_SIGNALS:
            signal.signal(s, signal.SIG_IGN)
        stopped.append(signum)
        raise KeyboardInterrupt

    # a signal ignored when the program started (nohup, a shell's background job) stays ignored
    previous = {}
    if threading.current_thread() is threading.main_thread():
        for s in _STOP_SIGNALS:
            if signal.getsignal(s) != signal.SIG_IGN:
                previous[s] = signal.signal(s, stop)
    try:
        meta = prepare(
            args.input,
            args.out,
            tokenizer=args.tokenizer,
            text_field=args.text_field,
            eot_id=args.eot_id,
            val_docs=args.val_docs,
            sft=args.sft,
            template_args=parse_template_args(args.template_arg),
            workers=args.workers,
            overwrite=args.overwrite,
        )
    except DataError as e:
        print(f"jaxzero.prepare: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        signum = stopped[0] if stopped else signal.SIGINT
        how = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
        print(
            f"jaxzero.prepare: interrupted ({how}): nothing of this preparation is left in {args.out}.",
            file=sys.stderr,
        )
        return 128 + signum
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    t = meta["train"]
    print(
        f"jaxzero.prepare: {args.out}: {t['documents']:,} documents, {t['tokens']:,} tokens in train.bin"
        + (f", {meta['val']['tokens']:,} in val.bin" if meta["val"]["documents"] else "")
        + f" ({meta['token_dtype']}, vocabulary {meta['vocab_size']:,}).\n"
        f"Train on it: python -m jaxzero.train --data.source=tokens --data.path={args.out} "
        f"--model.vocab_size={meta['vocab_size']} (or a model whose vocabulary holds it; the token files' "
        "dtype is read from prepare.json)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
