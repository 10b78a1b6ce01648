"""Run by tests/test_launch.py: `python -m jaxzero.train` where, on process 1 only, checkpoint 3 fails
its checksum verification (as a flaky or shared file system may make it) and Orbax's restore of
checkpoint 2 raises before it reads anything; the other processes can read both. Each process prints
the step it resumed from.

    python tests/programs/unreadable_on_one_process.py [--section.key=value ...]
"""

import sys

import jax
import orbax.checkpoint as ocp

from jaxzero.cli import train
from jaxzero.config import CheckpointError
from jaxzero.run import loop
from jaxzero.storage import checkpoint

verify_checksums = checkpoint.verify_checksums
manager_restore = ocp.CheckpointManager.restore
start = loop.start


def verify_fails_for_3_on_process_1(step_dir, pool):
    if jax.process_index() == 1 and step_dir.name == "3":
        raise CheckpointError(f"checksum mismatch on process 1 only in {step_dir}")
    return verify_checksums(step_dir, pool)


def restore_fails_for_2_on_process_1(self, step, *args, **kwargs):
    if jax.process_index() == 1 and step == 2:
        raise OSError(f"read error on process 1 only: checkpoint {step}")
    return manager_restore(self, step, *args, **kwargs)


def start_and_say_where(*args, **kwargs):
    begin = start(*args, **kwargs)
    print(f"process {jax.process_index()}: resumed from step {begin.restored_step}", flush=True)
    return begin


checkpoint.verify_checksums = verify_fails_for_3_on_process_1
ocp.CheckpointManager.restore = restore_fails_for_2_on_process_1
loop.start = start_and_say_where
sys.exit(train.main(sys.argv[1:]))
