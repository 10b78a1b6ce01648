"""Documents and fine-tuning examples to token ids and loss marks (`Encoder`), over worker processes
that this one owns and kills, in input order (`encoded_spans`), with only a few spans of the inputs in
memory at once."""

from __future__ import annotations

import contextlib
import os
import pickle
import signal
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from multiprocessing import connection, get_context
from pathlib import Path
from typing import Any

import numpy as np

from jaxzero.data.chat_template import ChatTemplate
from jaxzero.data.documents import Example, Span, read_documents, read_examples, spans
from jaxzero.data.tokenizer import ByteTokenizer, HFTokenizer
from jaxzero.data.types import DataError


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
            spans = self.chat.spans(example.messages, example.where, example.tools)
            encoded = self.tok.encode([text for text, _ in spans])
            parts = [(ids, counted) for ids, (_, counted) in zip(encoded, spans)]
            parts.append((np.asarray([self.eot]), 0))  # the separator; the template ends each turn
        ids = np.concatenate([p.astype(np.uint32) for p, _ in parts])
        marks = np.concatenate([np.full(p.size, c, np.uint8) for p, c in parts])
        return ids, marks


@dataclass(frozen=True)
class Encoded:
    """One span's documents (or examples), encoded: `ids` uint32 [tokens], the documents one after
    another, each ending with the end-of-text id; `ends` int64 [documents], where each ends in `ids`;
    `marks` uint8 [tokens] (1: a target the loss counts) for fine-tuning examples, else None; `chars`
    the characters read (for the progress line)."""

    ids: np.ndarray
    ends: np.ndarray
    marks: np.ndarray | None
    chars: int


def encode_span(encoder: Encoder, span: Span, text_field: str) -> Encoded:
    """`span`'s documents (fine-tuning examples where the encoder's `sft`) through `encoder`."""
    items = list(read_examples(span) if encoder.sft else read_documents(span, text_field))
    encoded = encoder(items)
    ids = np.concatenate([i for i, _ in encoded]) if encoded else np.zeros(0, np.uint32)
    ends = np.cumsum([i.size for i, _ in encoded], dtype=np.int64)
    marks = None
    if encoder.sft:
        marks = np.concatenate([m for _, m in encoded]) if encoded else np.zeros(0, np.uint8)
    chars = sum(len(t) if isinstance(t, str) else t.chars for t in items)
    return Encoded(ids.astype(np.uint32), ends, marks, chars)


# The signals a terminal or a service manager sends a whole process group: the workers ignore them
# all, and end only by the parent's kill or at the end of their task pipe (the parent is gone).
_GROUP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def _work(tasks: connection.Connection, results: connection.Connection, args: tuple[Any, ...]) -> None:
    """A worker process: encode each span `tasks` brings and send back its `Encoded`, or the exception
    it raised, until a None or the end of the pipe."""
    for s in _GROUP_SIGNALS:
        signal.signal(s, signal.SIG_IGN)  # spawned with them blocked (`encoded_spans`); now for good
    # Silent from exec (its stderr is /dev/null: `_Workers.start`): an error reaches the parent with
    # its span's result; anything a worker printed itself would be cut off mid-line by the kill.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread per worker: the processes are the parallelism
    text_field, encoder_args = args
    try:
        encoder: Encoder | Exception = Encoder(*encoder_args)
    except Exception as e:
        encoder = e
    while True:
        try:
            span = tasks.recv()
        except (EOFError, OSError):
            return
        if span is None:
            return
        try:
            if isinstance(encoder, Exception):
                raise encoder
            result: Any = encode_span(encoder, span, text_field)
        except Exception as e:
            try:
                pickle.dumps(e)
                result = e
            except Exception:
                result = RuntimeError(f"{type(e).__name__}: {e}")
        try:
            results.send(result)
        except OSError:  # the parent is gone
            return


class _Workers:
    """`n` spawned encoding processes, each with a pipe of spans in and a pipe of results out. Only
    small spans go in (never more than `_PER_WORKER` per worker, well under a pipe's buffer), so no
    send can block; results are read only by the caller's thread, and no thread of this process waits
    on a worker: `kill` ends them all at once, whatever they are doing."""

    _PER_WORKER = 2

    def __init__(self) -> None:
        self.procs: list[Any] = []
        self.tasks: list[connection.Connection] = []
        self.results: list[connection.Connection] = []
        self.queued: list[list[int]] = []  # the span numbers sent to each worker, in order

    def start(self, n: int, text_field: str, encoder_args: tuple[Any, ...]) -> None:
        """Start `n` workers (`kill` ends those started, should this fail or be interrupted)."""
        # spawn, not fork: a library caller may run JAX, whose threads a fork would copy mid-lock
        ctx = get_context("spawn")
        # Ctrl-C reaches the whole process group: spawned with the group's signals blocked (a signal
        # mask survives exec), a worker never dies of one or prints a traceback, even while starting.
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, _GROUP_SIGNALS)
        # and with stderr on /dev/null from their first instruction: a worker killed while its
        # interpreter starts (a stop right after the spawn) cannot leave half a traceback on the terminal
        saved_stderr, null = os.dup(2), os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, 2)
        try:
            for _ in range(n):
                task_r, task_w = ctx.Pipe(duplex=False)
                result_r, result_w = ctx.Pipe(duplex=False)
                self.tasks.append(task_w)
                self.results.append(result_r)
                self.queued.append([])
                p = ctx.Process(
                    target=_work, args=(task_r, result_w, (text_field, encoder_args)), daemon=True
                )
                self.procs.append(p)
                p.start()
                # the worker's ends: with only its own kept here, a dead worker reads as the end of its pipe
                task_r.close()
                result_w.close()
        finally:
            os.dup2(saved_stderr, 2)
            os.close(saved_stderr)
            os.close(null)
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)  # one pressed meanwhile: now

    def idle(self) -> int | None:
        """A worker with room for another span, else None."""
        free = [w for w, q in enumerate(self.queued) if len(q) < self._PER_WORKER]
        return min(free, key=lambda w: len(self.queued[w])) if free else None

    def send(self, worker: int, number: int, span: Span) -> None:
        with contextlib.suppress(BrokenPipeError):  # a dead worker: `receive` reads its end and says so
            self.tasks[worker].send(span)
        self.queued[worker].append(number)

    def receive(self) -> tuple[int, Encoded | BaseException]:
        """The next result of any worker: its span's number, and the Encoded or the error it raised."""
        busy = [self.results[w] for w, q in enumerate(self.queued) if q]
        ready = connection.wait(busy)[0]
        w = next(w for w, c in enumerate(self.results) if c is ready)
        try:
            result = self.results[w].recv()
        except (EOFError, OSError) as e:
            self.procs[w].join(1)
            raise DataError(
                f"an encoding process (pid {self.procs[w].pid}) ended without its result (exit code "
                f"{self.procs[w].exitcode}; a negative code is the signal that killed it, as the kernel "
                "does when memory runs out). Nothing was kept; run again, with fewer --workers if memory "
                "was short."
            ) from e
        return self.queued[w].pop(0), result

    def kill(self) -> None:
        started = [p for p in self.procs if p.pid is not None]
        for p in started:
            p.kill()  # SIGKILL: a worker mid-send or mid-encode ends now, holding nothing
        for p in started:
            p.join()
        for c in [*self.tasks, *self.results]:
            c.close()


def _in_order(workers: _Workers, todo: Iterator[Span], ahead: int) -> Iterator[Encoded]:
    """Each span's `Encoded`, in input order, with at most `ahead` spans sent and not yet returned:
    the inputs are never read into memory whole."""
    done: dict[int, Encoded | BaseException] = {}
    sent = returned = 0
    todo = iter(todo)
    more = True
    while True:
        while more and sent - returned < ahead and (w := workers.idle()) is not None:
            span = next(todo, None)
            if span is None:
                more = False
                break
            workers.send(w, sent, span)
            sent += 1
        if returned == sent:
            return
        number, result = workers.receive()
        done[number] = result
        while returned in done:
            result = done.pop(returned)
            if isinstance(result, BaseException):
                raise result  # in input order: the first bad record of the inputs is the one reported
            yield result
            returned += 1


@contextlib.contextmanager
def encoded_spans(
    files: Sequence[Path],
    text_field: str,
    encoder_args: tuple[str, int, bool, ChatTemplate | None],
    workers: int,
) -> Iterator[Iterator[Encoded]]:
    """The `Encoded` spans of `files` (fine-tuning examples where `encoder_args`' sft), in input order,
    through an `Encoder(*encoder_args)`. `workers` processes encode (1: this one); the context's end,
    however it comes (an error, Ctrl-C), kills them."""
    sft = encoder_args[2]
    todo = (span for path in files for span in spans(path, text_field, sft))
    if workers == 1:
        encoder = Encoder(*encoder_args)
        yield (encode_span(encoder, span, text_field) for span in todo)
        return
    pool = _Workers()
    try:
        pool.start(workers, text_field, encoder_args)
        yield _in_order(pool, todo, 2 * workers)
    finally:
        pool.kill()
