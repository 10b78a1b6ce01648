"""The resolution pass, once per run: the config validated, its end-of-text id, batch and `auto` keys
resolved, and the placement decided for the machine (`decide`); before JAX starts, XLA's pools sized
for that placement too (`decide_before_jax`, which a program calls once, before its first JAX call).
The decision's config is final: the trainer takes it (`build_trainer(..., decision=...)`) and neither
validates, resolves nor plans again.

    processes = distributed.start(timeout_s)                # several processes join first (no backend)
    decision = preflight.decide_before_jax(cfg, processes)  # decided, XLA's variables set
    trainer = build_trainer(decision.config, decision=decision)

XLA reads its pinned pool's cap and its share of each GPU once, when its backend starts: the pool
must be sized from the placement before that, and the placement needs the machine. So the machine is
told without JAX (`machine.accelerators_before_backend`: `nvidia-smi`, or the CPU backend's
settings), the model's shapes from its config (`placement.whole_params_of`), and the processes of a
run agree on the figures each sees through the coordination service (`primitives.coordination`).
`python -m jaxzero.plan` decides through the same path (`decide`), and sets nothing; so does
`build_trainer` for a library caller who passes no decision, on the devices of its running backend.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import socket
from typing import TYPE_CHECKING

import jax

from jaxzero.config import ConfigError, TrainConfig
from jaxzero.config.checks import check_batch_split, resolve_batch, validate
from jaxzero.data.eot import FROM_DATA, resolve_eot_id
from jaxzero.models import grouped_matmul
from jaxzero.plan import placement
from jaxzero.planner import runtime, search
from jaxzero.planner.machine import (
    Accelerators,
    Machine,
    accelerators_before_backend,
    accelerators_of,
    detect_machine,
)
from jaxzero.planner.report import Decision
from jaxzero.primitives.coordination import gather

if TYPE_CHECKING:  # a type of the run's, given by the program: nothing of the run is loaded
    from jaxzero.run.distributed import Processes

log = logging.getLogger(__name__)  # the library speaks through logging (`jaxzero.run.console`)


def decide_before_jax(
    cfg: TrainConfig, processes: Processes | None = None, *, validated: bool = False
) -> Decision:
    """The placement of `cfg` for this run, decided before JAX starts by the resolution pass (`decide`,
    `validated` as there), and XLA's variables set for it: 95% of each GPU for XLA's allocator
    (`runtime.claim_accelerator_memory`), the pinned pool sized to the decision
    (`runtime.configure_pinned_pool`) and, with `cfg.determinism`, XLA's deterministic GPU kernels
    (`runtime.request_determinism`). Call it once, before the first JAX call (with several processes,
    after `distributed.start`: every process calls it). Raises ConfigError where nothing fits, with
    what would, or where determinism is asked for after an accelerator's backend started without it."""
    if cfg.determinism:
        runtime.request_determinism()
    if cfg.finetune.partial:
        partial_on_one_device(processes)
    runtime.claim_accelerator_memory()
    decision = decide(cfg, processes.count if processes is not None else 1, validated=validated)
    if decision.plan.host_update is not None or decision.memory.pinned:
        runtime.configure_pinned_pool(decision.memory)
    return decision


def partial_on_one_device(processes: Processes | None) -> None:
    """A run with a frozen part (LoRA, `finetune.freeze`) trains on one GPU (`jaxzero.finetune.part`):
    refused in several processes; in one, only the first GPU it would see is made visible (before JAX
    starts), so that XLA claims no memory on the others."""
    if processes is not None and processes.count > 1:
        raise ConfigError(
            f"finetune.method=lora and finetune.freeze train on one GPU in one process; this run has "
            f"{processes.count} processes. Run it as one process (python -m jaxzero.train), or train every "
            "unit (finetune.method=full, no finetune.freeze)."
        )
    if runtime.backends_started():
        return
    seen = accelerators_before_backend()
    if seen.platform == "gpu" and seen.local > 1:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        first = visible.split(",")[0].strip() if visible else "0"
        os.environ["CUDA_VISIBLE_DEVICES"] = first
        log.warning(
            f"a run with a frozen part trains on one GPU: CUDA_VISIBLE_DEVICES={first} "
            f"(of {seen.local} visible)"
        )


def decide(
    cfg: TrainConfig,
    processes: int = 1,
    *,
    seen: Accelerators | None = None,
    pool_fixed: bool = False,
    validated: bool = False,
) -> Decision:
    """The resolution pass: `cfg` validated, its end-of-text id read from the data where it leaves it
    to the data, the machine this process trains on found, the batch resolved for its devices, and the
    placement decided; the decision's `config` is final (nothing downstream checks it again). `seen`:
    the devices (default: those JAX will show, told without starting its backend, or the running
    backend's), with `machine.*` keys overriding what is detected; each of the run's `processes` takes
    its share of the host. An explicit placement is evaluated, not searched: its decision decides
    nothing. With several processes every process must call it (their figures are agreed, each at its
    least). `pool_fixed`: whether XLA's pinned pool cap is fixed for the run already (JAX started).
    `validated`: the program checked `cfg` with `validate` already (`python -m jaxzero.train` does, as
    it parses its arguments, before anything is written): not checked twice."""
    if not validated:
        validate(cfg)
    if cfg.data.eot_id == FROM_DATA:  # whether attention stays inside documents changes the memory
        cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, eot_id=resolve_eot_id(cfg)))
    seen = _accelerators(cfg) if seen is None else seen
    machine = _agreed(cfg, seen, processes, pool_fixed)
    # every device of every process: the Mosaic grouping runs on one GPU alone
    cfg = resolve_moe_impl(cfg, machine.kind, machine.devices * machine.processes)
    cfg = resolve_batch(cfg, machine.devices)
    check_batch_split(cfg, machine.devices)
    whole = placement.whole_params_of(cfg.model, machine.devices)
    if search.concrete(cfg):
        return search.as_configured(cfg, machine, whole)
    return search.choose(cfg, machine, whole)


def resolve_moe_impl(cfg: TrainConfig, device_kind: str, devices: int = 1) -> TrainConfig:
    """`cfg` with a mixture of experts' `model.moe_impl=auto` decided for a machine of `devices`
    devices of `device_kind` (`Machine.kind`, `Machine.devices`): the Mosaic GPU grouped matmul on one
    Hopper GPU where the layer suits it, else the padded grouping (`grouped_matmul.planned_impl`);
    the memory plan counts what that grouping holds. `mosaic` where that machine cannot run it:
    ConfigError."""
    m = cfg.model
    if m.moe_impl == "padded" or not (m.num_experts or m.family == "gpt_oss"):
        return cfg
    # mosaic where it cannot run is refused now, not when the step is traced after building the model
    impl = grouped_matmul.planned_impl(m.moe_impl, device_kind, devices, m.compute_dtype)
    if impl == m.moe_impl:
        return cfg
    return dataclasses.replace(cfg, model=dataclasses.replace(m, moe_impl=impl))


def as_written(cfg: TrainConfig, decision: Decision) -> TrainConfig:
    """`cfg` as the user wrote it (offload keys left on `auto` and `data.eot_id=-1` kept, as a run's
    config.json records them) with the batch sizes the decision resolved for its devices."""
    d = decision.config.data
    batch = {"batch_size": d.batch_size, "grad_accum": d.grad_accum, "micro_batch_size": 0}
    return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, **batch))


def _say_what_was_detected(cfg: TrainConfig, machine: Machine) -> None:
    """A warning naming the figures of a described node (`machine.gpus`) taken from this machine, whose
    host may be nothing like the node's."""
    mc, GiB = cfg.machine, 2**30
    taken = [
        f"host RAM {machine.host_bytes / GiB:.1f} GiB (--machine.host_gib)" if not mc.host_gib else "",
        f"{machine.cores} cores (--machine.cores)" if not mc.cores else "",
        f"free disk {machine.disk_bytes / GiB:.1f} GiB (--machine.disk_gib)" if not mc.disk_gib else "",
    ]
    taken = [t for t in taken if t]
    if taken:
        log.warning(
            f"warning: planning for a node of {mc.gpus} GPUs of {mc.gpu_gib:g} GiB with this machine's "
            f"{', '.join(taken)}: pass the node's own to plan for it."
        )


def local_devices(cfg: TrainConfig) -> int:
    """How many devices this process will train on (`decide`'s count, without the planner)."""
    seen = _accelerators(cfg)
    return seen.local if seen is not None else 1


def _accelerators(cfg: TrainConfig) -> Accelerators | None:
    """What this process will train on: the running backend's devices if JAX has started (a library
    caller's), else what it will show once it starts; None where `machine.gpu_gib` describes a GPU
    this machine does not have (one device of that size: planning on a CPU-only machine for a GPU)."""
    if runtime.backends_started():  # asking the running backend starts nothing
        seen = accelerators_of(jax.local_devices())
    else:
        seen = accelerators_before_backend()
    if cfg.finetune.partial:  # trains on the first device (`jaxzero.finetune.part`)
        seen = dataclasses.replace(seen, local=1)
    return None if cfg.machine.gpu_gib and seen.platform == "cpu" else seen


def _agreed(cfg: TrainConfig, seen: Accelerators | None, count: int, pool_fixed: bool) -> Machine:
    """The machine of the run: this process's figures (`detect_machine`) or, with several processes,
    each figure a process may see differently (free memory, cores, devices) at its least over the
    processes, so that every process decides the same placement; the processes on this host counted
    by host name. (Through the coordination service: every process calls it.)"""
    local = seen.local if seen is not None else 1
    if count == 1 and seen is None and cfg.machine.gpus > 1:  # a node described, one process per GPU
        gpus = cfg.machine.gpus
        machine = detect_machine(
            cfg, None, devices=gpus, processes=gpus, local_processes=gpus, pool_fixed=pool_fixed
        )
        _say_what_was_detected(cfg, machine)
        return machine
    if count == 1:
        return detect_machine(cfg, seen, devices=local, processes=1, pool_fixed=pool_fixed)
    host = socket.gethostname()
    hosts = gather("host", host, cfg.parallel.timeout_s)
    here = hosts.count(host)
    mine = detect_machine(
        cfg, seen, devices=local * count, processes=count, local_processes=here, pool_fixed=pool_fixed
    )
    figures = [mine.gpu_bytes or 0, mine.host_share, mine.host_bw / here, mine.cores, local]
    every = [json.loads(t) for t in gather("machine", json.dumps(figures), cfg.parallel.timeout_s)]
    gpu, share, bw, cores, _ = (min(column) for column in zip(*every, strict=True))
    devices = sum(e[4] for e in every)
    return dataclasses.replace(
        mine,
        gpu_bytes=None if mine.gpu_bytes is None else int(gpu),
        host_bytes=int(share) * here,
        host_bw=bw * here,
        cores=int(cores),
        devices=devices,
    )
