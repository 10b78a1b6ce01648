"""The offload engine: masters and optimizer state in host RAM, updated there while the accelerator
streams the compute weights block by block.

    engine.py          build_offload_trainer: the `Trainer` of an offloaded run, wired from its parts
    context.py         EngineContext: what the parts share, built once
    state_init.py      the state made unit by unit: fresh, from masters, restored
    step.py            the step and the evaluation loss
    checkpointing.py   the state to and from its saved form
    breakdown.py       the per-step breakdown (`Trainer.timings`)
    streaming.py       forward and rematerialised backward, one compiled block for every layer
    pipeline.py        the per-unit host update, in the background of the accelerator's work
    two_pass.py        how many units each step updates in two passes
    host_optimizer.py  the optimizer on the host (fused kernels or optax on XLA:CPU)
    device_update.py   the units whose state the plan keeps on the accelerator, updated there
    host_kernels.py    the fused single-pass optimizer kernels (numba)
    host_memory.py     views of host memory, copies, pinned staging, the pinned pool
    futures.py         OffloadState: a future per unit, and helpers for futures
    timeline.py        where a step's time goes, measured while it runs

Which unit lives where, and which host-update strategies apply, is the offload plan's
(`jaxzero.plan`); shardings are `jaxzero.plan.placement`'s.
"""

from jaxzero.offload.engine import build_offload_trainer
from jaxzero.offload.futures import OffloadState

__all__ = ["OffloadState", "build_offload_trainer"]
