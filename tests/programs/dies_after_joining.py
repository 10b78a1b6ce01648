"""A process of a run of several that joins as `python -m jaxzero.train` does (`jaxzero.run.distributed`,
from JAX's variables or the launcher's), after which process 1 kills itself with SIGKILL while the
others wait for it, as they would in a step's collective.

    python dies_after_joining.py TIMEOUT_S      (run by tests/test_launch.py)
"""

import os
import signal
import sys

from jaxzero.run import distributed


def main(timeout_s: int) -> None:
    processes = distributed.start(timeout_s)
    assert processes is not None, "run with JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and JAX_PROCESS_ID"
    distributed.barrier("joined", timeout_s)
    print(f"process {processes.index}: joined", flush=True)
    if processes.index == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    distributed.barrier("never reached by process 1", timeout_s)
    print(f"process {processes.index}: passed a barrier process 1 never reached", flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]))
