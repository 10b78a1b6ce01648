"""How the library speaks: through Python's `logging`, under the `jaxzero` logger (`jaxzero.trainer`,
`jaxzero.storage.checkpoint`, ...), never by printing. A researcher embedding jaxzero silences or captures it
as any library (`logging.getLogger("jaxzero").setLevel(logging.ERROR)`); without configuration,
Python shows its warnings on stderr. The programs (`python -m jaxzero.train` and the others) call
`to_stderr`, so that their users read each message as one `jaxzero: ...` line."""

from __future__ import annotations

import errno
import logging
import os
import sys
from typing import Any, TextIO


class _Line(logging.Handler):
    """Each record as `jaxzero: <message>` on the stderr of the moment (a test's captured one too)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            print(f"jaxzero: {record.getMessage()}", file=sys.stderr, flush=True)
        except Exception:  # noqa: BLE001 - logging never raises into the caller
            self.handleError(record)


def to_stderr(level: int = logging.INFO) -> None:
    """Show the library's messages of `level` and above as `jaxzero: ...` lines on stderr (once per
    process, whoever calls it again)."""
    logger = logging.getLogger("jaxzero")
    if not any(isinstance(h, _Line) for h in logger.handlers):
        logger.addHandler(_Line())
    logger.setLevel(level)
    logger.propagate = False  # not also through the root logger's own stderr handler


def ignore_closed_event_loops() -> None:
    """Drop one kind of error Python reports as ignored (`sys.unraisablehook`): "Event loop is
    closed", which Orbax's leftover TensorStore callbacks raise after a failed read or write, a
    traceback each, once the error itself has been reported; and asyncio's report of those callbacks'
    tasks whose failure nobody read. Every other one goes to the hook as
    it was. Process-wide: the programs call it, never the library."""
    previous = sys.unraisablehook
    if getattr(previous, "drops_closed_event_loops", False):  # installed already (a second main())
        return

    def hook(unraisable: sys.UnraisableHookArgs) -> None:
        if (
            isinstance(unraisable.exc_value, RuntimeError)
            and str(unraisable.exc_value) == "Event loop is closed"
        ):
            return
        previous(unraisable)

    hook.drops_closed_event_loops = True
    sys.unraisablehook = hook
    # The same leftovers' tasks, collected with the error they failed with: asyncio logs each with its
    # traceback ("Task exception was never retrieved") as the process ends.
    logging.getLogger("asyncio").addFilter(_drop_unretrieved)


def _drop_unretrieved(record: logging.LogRecord) -> bool:
    return not str(record.msg).partition("\n")[0].endswith("exception was never retrieved")


def detach_hung_up_terminal() -> None:
    """Point stdout and stderr at /dev/null where they are a terminal: after SIGHUP (a closed terminal,
    a dropped SSH session) nothing reads it, and every write to it fails (EIO), which would stop the
    run before its checkpoint. Output to a file or a pipe is left as it is. For a signal handler: only
    the file descriptors change, so Python's buffered streams keep working."""
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        for stream in (sys.stdout, sys.stderr):
            try:
                fd = stream.fileno()
            except (AttributeError, OSError, ValueError):  # replaced by a test or a caller: not a tty
                continue
            if os.isatty(fd):
                os.dup2(null, fd)
    finally:
        os.close(null)


class HangupSafe:
    """A console stream whose writes outlive its terminal: a write that fails because the terminal hung
    up (EIO, as SIGHUP arrives while a line is being written, before its handler runs) points the
    terminal's streams at /dev/null (`detach_hung_up_terminal`) and is dropped; every other error is
    raised. What the run records (`metrics.jsonl`) is unaffected."""

    def __init__(self, stream: TextIO):
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except OSError as e:
            if e.errno != errno.EIO:
                raise
            detach_hung_up_terminal()
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except OSError as e:
            if e.errno != errno.EIO:
                raise
            detach_hung_up_terminal()

    def __getattr__(self, name: str) -> Any:  # isatty, fileno, encoding: the stream's own
        return getattr(self._stream, name)
