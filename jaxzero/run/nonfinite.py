"""What most likely made a step's loss non-finite, from the facts the loop has at hand, and what to do:
the text of the `TrainingError` the metrics raise (`jaxzero.run.metrics.LogWindow`)."""

from __future__ import annotations

from jaxzero.config import TrainConfig
from jaxzero.run.start import Start
from jaxzero.state import StepMetrics


def nonfinite_cause(
    cfg: TrainConfig, step: int, values: StepMetrics, start: Start, grad_norms: list[float]
) -> str:
    """What most likely made the loss of `step` non-finite, from the facts at hand, and what to do.

    The loss of step k is computed with the weights after k - 1 updates, so the first step a process
    runs has seen no update of its own: its weights come from the init or the restored checkpoint."""
    lr, norm = float(values.lr), float(values.grad_norm)
    if step == start.first and start.restored_step is not None:
        return (
            f"it is the first step after restoring checkpoint {start.restored_step}, before any update: "
            f"the checkpoint's state or the data at this point is bad. Resume from an earlier checkpoint "
            f"(move {cfg.run_dir}/checkpoints/{start.restored_step} aside) or start a new --run_dir."
        )
    if step == start.first:
        data = (
            " (data.check_tokens=false: only a sample of the token ids was checked against "
            "model.vocab_size; the full check may find the bad id)"
            if cfg.data.source == "tokens" and not cfg.data.check_tokens
            else ""
        )
        return (
            f"no update had changed the freshly initialised weights yet, so the learning rate is not the "
            f"cause: look at the data{data} and the model's numerics (model.compute_dtype="
            f"{cfg.model.compute_dtype}; float32 rules out overflow)."
        )
    growth = f"; recent gradient norms {', '.join(f'{g:.3g}' for g in grad_norms[-3:])}" if grad_norms else ""
    float32 = "" if cfg.model.compute_dtype == "float32" else ", or model.compute_dtype=float32"
    return (
        f"the loss diverged after {step - 1} updates at lr {lr:.3g} (gradient norm {norm:.4g}{growth}). "
        f"Try a lower optimizer.lr (now {cfg.optimizer.lr}), more optimizer.warmup_steps (now "
        f"{cfg.optimizer.warmup_steps}), clipping (optimizer.grad_clip, now {cfg.optimizer.grad_clip})"
        f"{float32}."
    )
