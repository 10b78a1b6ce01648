"""The types every trainer shares: `Trainer` (the contract), `TrainState`, `StepMetrics`, and the keys
of the per-step breakdown that the offload engine measures.

    trainer = build_trainer(cfg)                     # jaxzero.trainer
    state = trainer.init(jax.random.key(cfg.seed))
    for batch in batches:                            # int32 numpy (grad_accum, micro_batch, seq_len + 1)
        state, metrics = trainer.step(state, trainer.put_batch(batch))
    trainer.evaluate(state, val_batches)             # float, mean loss over (B, seq_len + 1) batches
    save_state(trainer, state, "runs/x", step=100)   # jaxzero.storage.state_io: runs/x/checkpoints/100
    state, step, data_state = restore_state(trainer, "runs/x")
    export_state(trainer, state, "export/x")         # jaxzero.interop.state_export: Hugging Face safetensors

This module holds types only: saving and restoring a state are I/O, in `jaxzero.storage.state_io`, and
exporting it is the exporters' (`jaxzero.interop.state_export`), so that the engines that build a
`Trainer` load no Orbax, run directory or exporter.

Ownership: `step` consumes the state it is given, in every mode (its accelerator buffers are donated,
or its host arrays are updated in place); keep only the state it returns. Reading a consumed state
raises an error.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import jax
import numpy as np
import optax
from jax.sharding import Mesh

from jaxzero.config import TrainConfig
from jaxzero.models import Model, ModelParams
from jaxzero.plan import OffloadPlan
from jaxzero.plan.placement import process_count
from jaxzero.primitives.write_fence import WriteFence


class TrainState(NamedTuple):
    """The resident trainer's state (a pytree).

    step:       int32 scalar, optimizer updates applied so far.
    params:     float32 master weights.
    opt_state:  the optax state of `Trainer.optimizer` over `params` (float32).
    loss_scale: float16 training's `LossScaleState`; None otherwise.
    """

    step: jax.Array
    params: ModelParams
    opt_state: Any
    loss_scale: Any = None


class StepMetrics(NamedTuple):
    """Per-step float32 scalars, left on the device until the loop reads them."""

    loss: jax.Array  # mean cross-entropy over the step's tokens
    grad_norm: jax.Array  # global L2 norm of the averaged gradient, before clipping
    lr: jax.Array  # learning rate used by this step's update
    loss_scale: jax.Array | None = None  # float16: the scale this step used
    skipped: jax.Array | None = None  # float16: bool, the step overflowed and its update was skipped
    # a model whose blocks emit statistics (experts): its unweighted load-balancing loss, averaged
    # over the step's micro-batches; None for other models
    aux_loss: jax.Array | None = None


class BreakdownKey(NamedTuple):
    """One entry of the per-step breakdown: its `metrics.jsonl` key and its console label, where
    `{device}` stands for the accelerator's platform (GPU, TPU, CPU)."""

    key: str
    label: str


# Where an offloaded step's time went, per step (seconds; `jaxzero.offload.timeline` says how each is
# measured), in the order `metrics.jsonl` and the console show them.
BREAKDOWN_TIMES = (
    BreakdownKey("gpu_compute_s", "{device} compute"),  # accelerator computations, summed
    BreakdownKey("h2d_s", "H2D"),  # busy time of the weight copies to the accelerator
    BreakdownKey("d2h_s", "D2H"),  # busy time of the gradient copies to the host
    BreakdownKey("host_update_s", "host update"),  # wall time with a unit being updated on the host
    BreakdownKey("wait_weights_s", "{device} waits for host"),  # the next pass held back for new weights
    BreakdownKey("gpu_idle_s", "{device} idle"),  # wall time minus accelerator compute
    BreakdownKey("host_idle_s", "host idle"),  # wall time minus host update
)
# Host-update events, per step.
BREAKDOWN_COUNTS = (
    BreakdownKey("two_pass_units", "two-pass units"),  # units updated in two passes
)
# The disk tier's traffic, per step (0 without disk units).
BREAKDOWN_DISK = (
    BreakdownKey("disk_read_s", "disk read"),  # reads of disk units' state, one after another
    BreakdownKey("disk_write_s", "disk write"),  # their write-backs
    BreakdownKey("wait_disk_s", "host waits for disk"),  # updates held back for their read, summed over units
    BreakdownKey("disk_gb", "GB to and from disk"),  # disk units' state read and written back
)
BREAKDOWN = BREAKDOWN_TIMES + BREAKDOWN_COUNTS + BREAKDOWN_DISK


@dataclass(frozen=True)
class Trainer:
    """A built training setup: the model, where its state lives (`plan`), and the functions that make
    and advance that state. `step` consumes its state (donated accelerator buffers, or host arrays
    updated in place): keep only the state it returns."""

    config: TrainConfig
    plan: OffloadPlan  # where every unit's arrays live, and how the host update runs
    model: Model
    mesh: Mesh
    optimizer: optax.GradientTransformation  # the update (the offload engine applies it per unit)
    init: Callable[[jax.Array], Any]  # PRNG key -> state in its final placement
    # float32 host (NumPy) masters, or units `Deferred` until placed -> fresh state, placed
    init_from_params: Callable[[ModelParams], Any]
    step: Callable[[Any, jax.Array], tuple[Any, StepMetrics]]  # (state, batch) -> (state, metrics)
    eval_loss: Callable[[Any, jax.Array], jax.Array]  # (state, int32 (B, S+1)) -> float32 scalar
    put_batch: Callable[[np.ndarray], jax.Array]  # host (A, mb, S+1) -> sharded device array
    put_eval_batch: Callable[[np.ndarray], jax.Array]  # host (B, S+1) -> sharded device array
    # Checkpointing: what is saved ({"step", "params", "opt_state"}, the optimizer state one per unit
    # whatever the trainer), its abstract placed form (the restore target), and how a state is
    # rebuilt from it. `layout` names the trainer that saved, for the record.
    layout: str
    saved_state: Callable[[Any], dict[str, Any]]
    abstract_saved_state: Callable[[], dict[str, Any]]
    from_saved_state: Callable[[dict[str, Any]], Any]
    # Where the time of the steps since the last call went, per step: (wall seconds, steps) -> a
    # dict keyed by `BREAKDOWN`'s keys. Only the offload engine measures it; None elsewhere.
    timings: Callable[[float, int], dict[str, float]] | None = None
    # Releases what the trainer holds outside its states (the disk tier's working files): call once
    # training is over; its states are then unusable.
    close: Callable[[], None] = lambda: None
    # Where `step` waits for a checkpoint being written from its state before changing it in place:
    # pass it to `jaxzero.storage.checkpoint.Checkpointer.save` (`jaxzero.primitives.write_fence`).
    fence: WriteFence = dataclasses.field(default_factory=WriteFence)
    # `strategy`'s line where the plan does not say it (a LoRA run: `jaxzero.finetune`)
    description: str | None = None

    def evaluate(self, state: Any, batches: Sequence[np.ndarray]) -> float:
        """Mean loss of `state` over validation batches, each int32 (B, seq_len + 1): this process's
        rows, B a multiple of its devices (`build_data(..., shard).val_batches(n)` yields them). A
        host sync; the state is not consumed."""
        ensure_live(state)
        losses = [self.eval_loss(state, self.put_eval_batch(b)) for b in batches]
        return float(np.mean(jax.device_get(losses)))  # host sync

    @property
    def strategy(self) -> str:
        """A one-line description of where state lives and how it is updated, for logs."""
        if self.description is not None:
            return self.description
        if self.plan.host_update is None:
            devices = f"{self.mesh.size} device(s)"
        elif self.mesh.size == 1:
            devices = str(self.mesh.devices.flat[0])
        else:
            devices = f"{self.mesh.size} devices"
        line = self.plan.describe(self.config.optimizer.name, devices)
        if self.mesh.size > 1:
            processes = process_count(self.mesh)
            stage = self.plan.zero_stage
            line += f"; ZeRO stage {stage} over {self.mesh.size} devices in {processes} process(es)"
        return line


def abstract_placed(shapes: Any, shardings: Any) -> Any:
    """ShapeDtypeStructs of `shapes` carrying `shardings` (a tree of the same structure): a restore
    target that puts every array back in its intended memory."""
    return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, shardings)


def ensure_live(state: Any) -> None:
    """Raise RuntimeError, saying what to do, for a state a step has consumed (its accelerator buffers
    donated, or its host arrays updated in place by the offload engine)."""
    leaves = [] if getattr(state, "consumed", False) else jax.tree.leaves(getattr(state, "step", None))
    if getattr(state, "consumed", False) or any(getattr(x, "is_deleted", lambda: False)() for x in leaves):
        raise RuntimeError(
            "this training state was consumed by trainer.step: use the state that step returned."
        )


def check_batch(
    batch: Any, shape: tuple[int | None, ...], vocab_size: int, what: str, source: str
) -> np.ndarray:
    """`batch` as int32 NumPy, or ValueError saying what it should be: `shape` (None: any length), an
    integer dtype, ids in [0, vocab_size), each possibly marked not-a-target as ~id (negative; see
    `jaxzero.numerics.objective`). `source` names what yields such batches."""
    array = np.asarray(batch)
    want = "(" + ", ".join("N" if d is None else str(d) for d in shape) + ")"
    if array.ndim != len(shape) or any(d is not None and a != d for a, d in zip(array.shape, shape)):
        raise ValueError(
            f"a {what} batch must be int32 {want} for this config; got {array.dtype} {array.shape}. "
            f"{source} yields such batches."
        )
    if not np.issubdtype(array.dtype, np.integer):
        raise ValueError(
            f"a {what} batch holds token ids, an integer dtype; got {array.dtype} {array.shape}."
        )
    low, high = (int(array.min()), int(array.max())) if array.size else (0, 0)
    if low < -vocab_size or high >= vocab_size:
        raise ValueError(
            f"a {what} batch holds token ids in [{low}, {high}], outside [0, model.vocab_size={vocab_size}) "
            f"(or [{-vocab_size}, -1] for ids marked not-a-target, ~id)."
        )
    return array.astype(np.int32, copy=False)


def with_checks(trainer: Trainer) -> Trainer:
    """`trainer` whose `put_batch` and `put_eval_batch` check shape, dtype and token ids first, and
    whose `step` refuses a consumed state with a message (not an error about deleted buffers)."""
    d, vocab = trainer.config.data, trainer.config.model.vocab_size
    # Each process hands over its own rows of every micro-batch (`DataShard`).
    processes = process_count(trainer.mesh)
    train_shape = (d.grad_accum, d.batch_size // d.grad_accum // processes, d.seq_len + 1)
    source = "build_data(...).train_iter()" + (
        f" with DataShard(jax.process_index(), {processes})" if processes > 1 else ""
    )
    put_batch, put_eval_batch, step = trainer.put_batch, trainer.put_eval_batch, trainer.step

    def checked_batch(batch: Any) -> jax.Array:
        return put_batch(check_batch(batch, train_shape, vocab, "training", source))

    def checked_step(state: Any, batch: jax.Array) -> tuple[Any, StepMetrics]:
        ensure_live(state)
        return step(state, batch)

    def checked_eval_batch(batch: Any) -> jax.Array:
        array = check_batch(
            batch, (None, d.seq_len + 1), vocab, "validation", "build_data(...).val_batches(n)"
        )
        local = trainer.mesh.size // processes  # this process's devices share its rows
        if array.shape[0] % local:
            raise ValueError(
                f"a validation batch of {array.shape[0]} rows cannot be split over this process's "
                f"{local} devices; use a multiple of {local} rows."
            )
        return put_eval_batch(array)

    return dataclasses.replace(
        trainer, put_batch=checked_batch, put_eval_batch=checked_eval_batch, step=checked_step
    )
