"""The types every trainer shares: `Trainer` (the contract), `TrainState`, `StepMetrics`, and the keys
of the per-step breakdown that the offload engine measures.

    trainer = build_trainer(cfg)                 # jaxzero.trainer
    state = trainer.init(jax.random.key(cfg.seed))
    for batch in batches:                        # int32 numpy (grad_accum, micro_batch, seq_len + 1)
        state, metrics = trainer.step(state, trainer.put_batch(batch))
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import jax
import numpy as np
import optax
from jax.sharding import Mesh

from jaxzero.config import TrainConfig
from jaxzero.models import Model, ModelParams
from jaxzero.plan import OffloadPlan


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
    BreakdownKey("speculated", "speculative updates kept"),
    BreakdownKey("rolled_back", "redone"),  # speculative updates recomputed with clipping
    BreakdownKey("two_pass_units", "two-pass units"),  # units updated in two passes
)
BREAKDOWN = BREAKDOWN_TIMES + BREAKDOWN_COUNTS


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
    init_from_params: Callable[[ModelParams], Any]  # float32 host (NumPy) masters -> fresh state, placed
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

    @property
    def strategy(self) -> str:
        """A one-line description of where state lives and how it is updated, for logs."""
        if self.plan.host_update is None:
            devices = f"{self.mesh.size} device(s)"
        else:
            devices = str(self.mesh.devices.flat[0])
        return self.plan.describe(self.config.optimizer.name, devices)


def abstract_placed(shapes: Any, shardings: Any) -> Any:
    """ShapeDtypeStructs of `shapes` carrying `shardings` (a tree of the same structure): a restore
    target that puts every array back in its intended memory."""
    return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, shardings)
