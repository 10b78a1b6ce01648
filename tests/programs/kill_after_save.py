"""Run by tests/test_checkpoint.py: `python -m jaxzero.train`, SIGKILLed right after the save of one
step starts, while its asynchronous write is in flight.

    python tests/programs/kill_after_save.py STEP [--section.key=value ...]
"""

import os
import signal
import sys

from jaxzero.cli import train
from jaxzero.storage import checkpoint

kill_at = int(sys.argv[1])
save = checkpoint.Checkpointer.save


def save_then_die(self, step, state, meta, *fence):
    save(self, step, state, meta, *fence)
    if step == kill_at:
        os.kill(os.getpid(), signal.SIGKILL)


checkpoint.Checkpointer.save = save_then_die
sys.exit(train.main(sys.argv[2:]))
