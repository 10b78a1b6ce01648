"""Documents and fine-tuning examples to token ids and loss marks (`Encoder`), over worker processes
and in input order (`encoded_chunks`), with only a few chunks of the inputs in memory at once."""

from __future__ import annotations

import collections
import contextlib
import multiprocessing
import os
import signal
import sys
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from jaxzero.data.chat_template import ChatTemplate
from jaxzero.data.documents import Example, read_documents, read_examples
from jaxzero.data.tokenizer import ByteTokenizer, HFTokenizer
from jaxzero.data.types import DataError

# Documents per task handed to a worker: large enough to amortise the pickling, small enough that
# the progress line moves and the ordered results do not pile up in memory.
_CHUNK_DOCS = 256


def _chunks(files: Sequence[Path], text_field: str, sft: bool) -> Iterator[list[Any]]:
    chunk: list[Any] = []
    for path in files:
        for doc in read_examples(path) if sft else read_documents(path, text_field):
            chunk.append(doc)
            if len(chunk) == _CHUNK_DOCS:
                yield chunk
                chunk = []
    if chunk:
        yield chunk


class Encoder:
    """Documents, or fine-tuning examples, to (ids, marks): ids end with the end-of-text id; marks is
    None for documents, else uint8 per id (1: a target the loss counts)."""

    def __init__(self, tokenizer: str, eot: int, sft: bool, chat: ChatTemplate | None) -> None:
        self.tok = ByteTokenizer() if tokenizer == "bytes" else HFTokenizer(Path(tokenizer))
        self.eot, self.sft, self.chat = eot, sft, chat

    def __call__(self, items: list[Any]) -> list[tuple[np.ndarray, np.ndarray | None]]:
        if not self.sft:
            eot = np.asarray([self.eot], np.uint32)
            return [(np.concatenate([ids, eot]), None) for ids in self.tok.encode(items)]
        return [self._example(item) for item in items]

    def _example(self, example: Example) -> tuple[np.ndarray, np.ndarray]:
        if example.messages is None:
            prompt, completion = self.tok.encode([example.prompt, example.completion])
            parts = [(prompt, 0), (completion, 1), (np.asarray([self.eot]), 1)]
        else:
            if self.chat is None:
                raise DataError(
                    f"{example.where}: a messages record needs the tokenizer's chat_template "
                    "(tokenizer_config.json); this tokenizer has none. Write prompt/completion records."
                )
            spans = self.chat.spans(example.messages, example.where)
            encoded = self.tok.encode([text for text, _ in spans])
            parts = [(ids, counted) for ids, (_, counted) in zip(encoded, spans)]
            parts.append((np.asarray([self.eot]), 0))  # the separator; the template ends each turn
        ids = np.concatenate([p.astype(np.uint32) for p, _ in parts])
        marks = np.concatenate([np.full(p.size, c, np.uint8) for p, c in parts])
        return ids, marks


# Each worker process holds one Encoder, built by the pool's initializer.
_WORKER: Encoder | None = None


def _init_worker(*args: Any) -> None:
    global _WORKER
    # deaf to Ctrl-C for good (spawned with it blocked: `encoded_chunks`), from any thread's pool
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # silent: an encoding error reaches the parent with the chunk's result; what a worker would print
    # itself is the traceback of its pipes closing as the pool is terminated (cut off mid-line)
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, sys.stderr.fileno())
    os.close(null)
    # one thread per worker process: the processes are the parallelism
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _WORKER = Encoder(*args)


def _encode_chunk(items: list[Any]) -> list[tuple[np.ndarray, np.ndarray | None]]:
    assert _WORKER is not None
    return _WORKER(items)


def _in_order(
    pool: Any, chunks: Iterator[list[Any]], ahead: int, stop: threading.Event
) -> Iterator[tuple[list[Any], list[Any]]]:
    """(items, encoded) of each chunk, in input order, with at most `ahead` chunks read and not yet
    written: the inputs are never read into memory whole. KeyboardInterrupt, between the pool's calls,
    once `stop` is set (Ctrl-C)."""

    def done(result: Any) -> list[Any]:
        while not result.ready():
            if stop.wait(0.05):
                raise KeyboardInterrupt
        return result.get()

    pending: collections.deque[tuple[list[Any], Any]] = collections.deque()
    for chunk in chunks:
        if stop.is_set():
            raise KeyboardInterrupt
        pending.append((chunk, pool.apply_async(_encode_chunk, (chunk,))))
        if len(pending) >= ahead:
            texts, result = pending.popleft()
            yield texts, done(result)
    while pending:
        texts, result = pending.popleft()
        yield texts, done(result)


@contextlib.contextmanager
def encoded_chunks(
    files: Sequence[Path],
    text_field: str,
    sft: bool,
    encoder_args: tuple[str, int, bool, ChatTemplate | None],
    workers: int,
) -> Iterator[Iterator[tuple[list[Any], list[tuple[np.ndarray, np.ndarray | None]]]]]:
    """(items, encoded) of each chunk of the documents of `files` (fine-tuning examples with `sft`), in
    input order: `encoded` holds an `Encoder(*encoder_args)`'s (uint32 ids, uint8 marks or None) per
    item. `workers` processes encode (1: this one); they end when the context does."""
    chunks = _chunks(files, text_field, sft)
    if workers == 1:
        encoder = Encoder(*encoder_args)
        yield ((c, encoder(c)) for c in chunks)
        return
    # Ctrl-C reaches the whole process group. The workers are deaf to it: spawned with SIGINT blocked
    # (a signal mask survives exec), none prints a traceback, even while starting. The parent takes it
    # as a request, acted on between the pool's calls: a KeyboardInterrupt inside them could leave the
    # pool's queue locked and its terminate waiting forever.
    main = threading.current_thread() is threading.main_thread()
    stop, previous = threading.Event(), None
    if main:
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        # spawn, not fork: a library caller may run JAX, whose threads a fork would copy mid-lock
        spawn = multiprocessing.get_context("spawn")
        pool = spawn.Pool(workers, initializer=_init_worker, initargs=encoder_args)
        if main:
            previous = signal.signal(signal.SIGINT, lambda signum, frame: stop.set())
    finally:
        if main:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})  # one pressed meanwhile: now
    try:
        yield _in_order(pool, chunks, 4 * workers, stop)
    finally:
        pool.terminate()
        if main:
            signal.signal(signal.SIGINT, signal.SIG_DFL if previous is None else previous)
