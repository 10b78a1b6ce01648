"""Run by tests/test_faults.py: `python -m jaxzero.train` (its `main()`, on this command line) whose
checkpoint directory refuses every new entry with EPERM, as an immutable directory or a revoked mount
does, at the call Orbax makes to create a save's directory (`os.mkdir`). The failed save also leaves
a non-daemon thread waiting for ever, as a library's thread waiting on work the failure cut short does
(Orbax's commit threads wait up to 300 s for signals a failed save never sends): without the program's
bounded exit, the interpreter would wait for it after printing the error.

    python tests/programs/checkpoint_dir_not_permitted.py [--section.key=value ...]
"""

import errno
import os
import sys
import threading

from jaxzero.cli import train

real_mkdir = os.mkdir
never = threading.Event()


def mkdir(path, *args, **kwargs):
    if f"{os.sep}checkpoints{os.sep}" in os.fspath(path):  # an entry in <run_dir>/checkpoints
        threading.Thread(target=never.wait, name="left-waiting", daemon=False).start()
        raise PermissionError(errno.EPERM, os.strerror(errno.EPERM), os.fspath(path))
    return real_mkdir(path, *args, **kwargs)


os.mkdir = mkdir
sys.exit(train.main())
