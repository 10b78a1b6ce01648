"""Run by tests/test_faults.py: `python -m jaxzero.train` whose second asynchronous save fails inside
Orbax's background commit with `OSError(ENOSPC)` (injected where jaxzero's writer sums the files).

    python tests/programs/write_fails_in_background.py [--section.key=value ...]
"""

import errno
import sys

from jaxzero.cli import train
from jaxzero.storage import checkpoint

write = checkpoint.write_checksums
written = []


def write_then_fail(step_dir, pool):
    if written:
        raise OSError(errno.ENOSPC, "No space left on device", str(step_dir))
    write(step_dir, pool)
    written.append(step_dir)


checkpoint.write_checksums = write_then_fail
sys.exit(train.main(sys.argv[1:]))
