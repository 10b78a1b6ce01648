"""`python -m jaxzero.plan [--config=PATH] [--deepspeed=PATH] [--section.key=value ...]`: where a run's
state would live.

Takes the arguments of `python -m jaxzero.train` (the same parsing, presets and checks) and prints
what the planner (`jaxzero.planner.search`) decides for that run on this machine, or on the machine
`--machine.*` describes: every unit's tier, memory against capacity, the predicted step and its
bottleneck, and the figures it used (and the warning a run's start prints where its saves would hold
training for much of it). It starts no JAX backend and allocates nothing: the devices are
told as `python -m jaxzero.train` tells them before JAX starts (`jaxzero.planner.preflight`: `nvidia-smi`,
or the CPU backend's settings), and it plans for every device, as that run would use them; with
`--machine.gpu_gib`, for a GPU of that size.

    python -m jaxzero.plan --model.name=llama-13b --data.batch_size=16 --data.seq_len=2048 \\
        --machine.gpu_gib=133 --machine.host_gib=125 --machine.cores=16

Exit status 0 with the plan; 2 with the reason when nothing fits (what was needed against what is
available, and what would fit), when the run's checkpoints cannot fit the free disk under its run
directory (which `python -m jaxzero.train` refuses at start), or the arguments are wrong.
"""

from __future__ import annotations

import sys

from jaxzero import deepspeed
from jaxzero.config import ConfigError, TrainConfig
from jaxzero.config.checks import validate
from jaxzero.overrides import help_text, layer, split_args
from jaxzero.planner import preflight
from jaxzero.run.console import to_stderr

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
        try:
            # The decision `python -m jaxzero.train` makes before JAX starts, for one process.
            decision = preflight.decide(cfg, validated=True)
        except ConfigError:
            if layered.deepspeed is not None:  # the file's batch keys, refused in its words for these devices
                deepspeed.check(layered.deepspeed, cfg, preflight.local_devices(cfg))
            raise
    except ConfigError as e:
        print(f"jaxzero: config error: {e}", file=sys.stderr)
        return EXIT_CONFIG
    print(decision.table())
    slow_saves = decision.save_warning()  # as the run's start warns
    if slow_saves is not None:
        print(f"jaxzero: {slow_saves}")
    short = decision.checkpoint_shortfall()
    if short is not None:  # the placement fits, its checkpoints do not: train would refuse it
        print(f"jaxzero: config error: {short}", file=sys.stderr)
        return EXIT_CONFIG
    return 0


if __name__ == "__main__":
    sys.exit(main())
