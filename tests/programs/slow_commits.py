"""Run by tests/test_checkpoint.py: `python -m jaxzero.train` whose checkpoints take 2 s to commit once
their files are written (a slow disk's sync): the next save is asked for while the previous one's
files and the checkpoint it supersedes are both on disk.

    python tests/programs/slow_commits.py [--section.key=value ...]
"""

import sys
import time

from jaxzero.cli import train
from jaxzero.storage.checkpoint_handler import PartsHandler

finalize = PartsHandler.finalize


def slow_finalize(self, directory):
    time.sleep(2)
    finalize(self, directory)


PartsHandler.finalize = slow_finalize
sys.exit(train.main(sys.argv[1:]))
