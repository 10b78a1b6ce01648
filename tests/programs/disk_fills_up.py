"""Run by tests/test_faults.py: `python -m jaxzero.train` on a disk that fills up after the first
checkpoint is written: from then on `shutil.disk_usage` reports 1 KB free.

    python tests/programs/disk_fills_up.py [--section.key=value ...]
"""

import shutil
import sys

from jaxzero.cli import train
from jaxzero.storage import checkpoint

real = shutil.disk_usage
save = checkpoint.Checkpointer.save
full = []


def disk_usage(path):
    total, used, free = real(path)
    return shutil._ntuple_diskusage(total, used, 1000 if full else free)


def save_then_fill(self, step, state, meta, *fence):
    save(self, step, state, meta, *fence)
    full.append(step)


shutil.disk_usage = disk_usage
checkpoint.Checkpointer.save = save_then_fill
sys.exit(train.main(sys.argv[1:]))
