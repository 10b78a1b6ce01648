"""`build_trainer`: a `Trainer` built once from a `TrainConfig`: the resident trainer
(`jaxzero.resident`) or the offload engine (`jaxzero.offload`), as the decided placement asks.

This is the library API. The config comes resolved and its placement decided
(`jaxzero.planner.preflight.decide_before_jax`, before JAX starts, as the programs do), and is trusted
as it is; or the resolution pass runs here once, for the mesh's devices
(`jaxzero.planner.preflight.decide`). The decided config's offload plan (`jaxzero.plan`) is checked
against host and accelerator memory (`jaxzero.planner.runtime`), and the plan picks the trainer: whether
weights are resident or streamed from host memory is decided here, when the step function is built,
never inside it:

    trainer = build_trainer(cfg)
    state = trainer.init(jax.random.key(cfg.seed))
    for batch in batches:                       # int32 numpy (grad_accum, micro_batch, seq_len + 1)
        state, metrics = trainer.step(state, trainer.put_batch(batch))

The resident trainer (`offload.optimizer=none`) keeps everything in accelerator memory; it is the
oracle the offload engine is tested against.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import jax
import optax
from jax.sharding import Mesh

from jaxzero.config import ConfigError, TrainConfig
from jaxzero.config.keys import set_keys
from jaxzero.data.eot import FROM_DATA
from jaxzero.finetune.part import TrainableOverBase
from jaxzero.models import Model
from jaxzero.models.sizes import param_count
from jaxzero.offload import build_offload_trainer
from jaxzero.plan import placement
from jaxzero.planner import memory, preflight, runtime
from jaxzero.planner.machine import accelerators_of
from jaxzero.planner.report import Decision
from jaxzero.resident import build_resident_trainer
from jaxzero.state import Trainer, with_checks

log = logging.getLogger(__name__)  # the library speaks through logging (`jaxzero.run.console`)


def build_trainer(
    cfg: TrainConfig | None = None,
    mesh: Mesh | None = None,
    *,
    decision: Decision | None = None,
    model: Model | None = None,
    optimizer: optax.GradientTransformation | None = None,
    **overrides: Any,
) -> Trainer:
    """Check `cfg`'s decided placement against the mesh and memory, and build the trainer its offload
    plan asks for.

    `cfg` defaults to the built-in default run; keyword `overrides` change single keys, with `__` for
    the dot: `build_trainer(model__name="gpt2-tiny", offload__optimizer="cpu")` (as
    `jaxzero.config.keys.set_keys` reads them: a Hugging Face checkpoint's shape, `model.name=hf:DIR`,
    is read into `cfg` first by `jaxzero.apply_overrides` or `jaxzero.parse_args`). `decision`: the
    resolution pass's result from before JAX started (`jaxzero.planner.preflight.decide_before_jax`,
    which also sized XLA's pinned pool for it), whose config is final and checked again nowhere;
    without one, the pass runs here once (`jaxzero.planner.preflight.decide`: validation, the batch
    for the mesh's devices, offload keys left on `auto` decided), within the pool XLA has already.
    `trainer.config` is the decided config. Nothing is allocated or compiled here; `trainer.init`
    and the first `trainer.step` do that. A run that cannot fit in host or accelerator memory fails
    here with the numbers (`jaxzero.planner.memory`, or the planner's refusal). The trainer's
    `put_batch` and `put_eval_batch` check a batch's shape, dtype and token ids.

    `model`: a researcher's own model (the block protocol, `jaxzero.models.base.Model`) in place of
    `cfg.model`'s, which must describe its shape (the planner counts it; `jaxzero.custom` checks).
    `optimizer`: an optax transformation in place of `cfg.optimizer`'s, per-parameter (the offload
    engine applies it to each unit alone, as optax on XLA:CPU); clipping stays `optimizer.grad_clip`.
    """
    cfg = TrainConfig() if cfg is None else cfg
    if overrides:
        cfg = set_keys(cfg, {k.replace("__", "."): v for k, v in overrides.items()})
    return decide_and_build(cfg, mesh, decision, model=model, optimizer=optimizer)[0]


def decide_and_build(
    cfg: TrainConfig,
    mesh: Mesh | None = None,
    decision: Decision | None = None,
    *,
    model: Model | None = None,
    optimizer: optax.GradientTransformation | None = None,
) -> tuple[Trainer, Decision]:
    """`build_trainer` of `cfg`, with the decision it was built from (`decision` where it holds for
    the mesh, else one made here): `python -m jaxzero.train` prints its table. `model` and
    `optimizer`: as `build_trainer`'s."""
    if mesh is None:  # a run with a frozen part trains on the first device (`jaxzero.finetune.part`)
        mesh = placement.make_mesh(jax.devices()[:1] if cfg.finetune.partial else None)
    processes = placement.process_count(mesh)
    sharing = placement.processes_on_this_host(mesh)  # a collective: every process calls it, here
    device = mesh.local_devices[0]  # memory stats exist only for this process's devices
    planned_for = None if decision is None else (decision.machine.devices, decision.machine.processes)
    if planned_for is not None and planned_for != (mesh.size, processes):
        log.warning(
            f"warning: the placement was decided for {decision.machine.devices} device(s) in "
            f"{decision.machine.processes} process(es), but the mesh has {mesh.size} in {processes}: "
            "deciding again for the mesh, within the pinned pool XLA has."
        )
        decision = None
    if decision is not None and _as_decided(cfg, decision) != decision.config:
        raise ConfigError(
            "the decision passed to build_trainer was made for another config (it differs in more than "
            "the offload keys, batch and end-of-text id the resolution pass settles): decide for this one "
            "(jaxzero.planner.preflight.decide_before_jax(cfg)) or pass decision.config."
        )
    if decision is None:  # the library's own resolution pass, on the running backend's devices
        seen = accelerators_of(list(mesh.local_devices))
        decision = preflight.decide(cfg, processes, seen=seen, pool_fixed=True)
    cfg, plan, need = decision.config, decision.plan, decision.memory
    whole = placement.whole_params_of(cfg.model, mesh.size)
    unsplit = whole[0] + cfg.model.num_layers * whole[1] + whole[2]
    if mesh.size > 1 and (plan.zero_stage or plan.host_update) and unsplit > 0.1 * param_count(cfg.model):
        log.warning(
            f"warning: on {mesh.size} devices {unsplit / param_count(cfg.model):.0%} of the "
            "parameters are in arrays whose first axis does not divide by the device count, so every "
            "device (and process) keeps them whole; a device count dividing model.hidden_size, "
            "model.intermediate_size and model.vocab_size splits them."
        )
    if (
        plan.host_update is not None or need.pinned
    ):  # the pool XLA started with must hold this process's share
        runtime.check_pinned_pool(need)
    warning = runtime.check_fits(cfg, need, device, sharing=sharing)
    if warning:
        log.warning(warning)
    # What trains: every parameter, or the trainable part beside a frozen base (LoRA, freezing), whose
    # state the plan keeps on the accelerator: the resident engine's, its passes the streamed schedule.
    trains = None
    if cfg.finetune.partial:
        reserve = memory.pinned_pool_reservation(need, device.platform) if need.pinned else 0
        trains = TrainableOverBase(cfg, mesh, pinned_reserve=reserve)
    if plan.host_update is not None and trains is None:  # a frozen part's host plan: refused there
        reserve = memory.pinned_pool_reservation(need, device.platform)
        trainer = build_offload_trainer(
            cfg, mesh, plan=plan, pinned_reserve=reserve, model=model, optimizer=optimizer
        )
    else:
        trainer = build_resident_trainer(cfg, mesh, plan, model=model, optimizer=optimizer, trains=trains)
    return with_checks(trainer), decision


def _as_decided(cfg: TrainConfig, decision: Decision) -> TrainConfig:
    """`cfg` with what a decision settles of it: the offload keys, the experts' grouping where `cfg`
    leaves it to the machine (`model.moe_impl=auto`), the end-of-text id the data says
    where `cfg` leaves it to the data (`data.eot_id=-1`), and the batch sizes resolved for the devices
    where `cfg` gives them by DeepSpeed's rule (`data.micro_batch_size`) and they agree with it."""
    decided = decision.config
    cfg = dataclasses.replace(cfg, offload=decided.offload)
    if cfg.model.moe_impl == "auto":
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, moe_impl=decided.model.moe_impl))
    if cfg.data.eot_id == FROM_DATA:
        cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, eot_id=decided.data.eot_id))
    d, r = cfg.data, decided.data
    devices = decision.machine.devices
    if d.micro_batch_size and d.micro_batch_size * r.grad_accum * devices == r.batch_size:
        if d.batch_size in (0, r.batch_size) and d.grad_accum in (0, r.grad_accum):
            batch = {"batch_size": r.batch_size, "grad_accum": r.grad_accum, "micro_batch_size": 0}
            cfg = dataclasses.replace(cfg, data=dataclasses.replace(d, **batch))
    return cfg
