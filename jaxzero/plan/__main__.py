"""`python -m jaxzero.plan [--config=PATH] [--deepspeed=PATH] [--section.key=value ...]`: where a run's
state would live.

Takes the arguments of `python -m jaxzero.train` (the same parsing, presets and checks) and prints
what the planner (`jaxzero.plan.search`) decides for that run on this machine, or on the machine
`--machine.*` describes: every unit's tier, memory against capacity, the predicted step and its
bottleneck, and the figures it used. It allocates nothing on any accelerator. With
`--machine.gpu_gib` it starts no JAX backend at all (a GPU of that size, one device); without it, it
starts the backend only to read the devices' kind and memory (with XLA's preallocation off) and
plans for every device, as `python -m jaxzero.train` would use them.

    python -m jaxzero.plan --model.name=llama-13b --data.batch_size=16 --data.seq_len=2048 \\
        --machine.gpu_gib=139 --machine.host_gib=125 --machine.cores=16

Exit status 0 with the plan; 2 with the reason when nothing fits (what was needed against what is
available, and what would fit) or the arguments are wrong.
"""

from __future__ import annotations

import os
import sys

from jaxzero import deepspeed, runtime
from jaxzero.config import ConfigError, TrainConfig, resolve_batch, validate
from jaxzero.console import to_stderr
from jaxzero.overrides import help_text, layer, split_args
from jaxzero.plan.machine import detect_machine
from jaxzero.plan.search import decide

EXIT_CONFIG = 2


def main(argv: list[str] | None = None) -> int:
    to_stderr()  # the library's messages as `jaxzero: ...` lines
    argv = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__ + help_text())
        return 0
    try:
        layered = layer(TrainConfig(), split_args(argv))
        cfg = layered.config
        validate(cfg)
        if layered.deepspeed is not None:
            print(layered.deepspeed.report())
        devices = 1
        if not cfg.machine.gpu_gib:
            # Reading a device's memory must not take it: no preallocation in this process (set
            # before JAX starts its backend, below).
            os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
            runtime.claim_accelerator_memory()  # the run's share of the card, as the trainer sets it
            devices = _device_count()
        if layered.deepspeed is not None:  # the file's batch keys, refused in its words for these devices
            deepspeed.check(layered.deepspeed, cfg, devices)
        cfg = resolve_batch(cfg, devices)
        # The run sizes XLA's pinned pool to its placement when it starts: not a limit here.
        decision = decide(cfg, detect_machine(cfg, devices=devices, pool_fixed=False))
    except ConfigError as e:
        print(f"jaxzero: config error: {e}", file=sys.stderr)
        return EXIT_CONFIG
    print(decision.table())
    return 0


def _device_count() -> int:
    """The devices `python -m jaxzero.train` would train on in one process (starts the backend)."""
    # Imported here: JAX starts its backend on this call only, after the environment is set above.
    import jax

    return jax.device_count()


if __name__ == "__main__":
    sys.exit(main())
