"""jaxzero: train models larger than one GPU's memory in JAX (host-resident state, streamed blocks).

The library API in one screen:

    cfg = parse_args(["--model.name=gpt2-tiny", "--offload.optimizer=cpu"])
    trainer = build_trainer(cfg)
    data = build_data(cfg.data, cfg.model.vocab_size, cfg.seed)
    state = trainer.init(jax.random.key(cfg.seed))
    state, metrics = trainer.step(state, trainer.put_batch(next(data.train_iter())))
"""

from jaxzero.config import ConfigError, TrainConfig
from jaxzero.data import build_data
from jaxzero.models import ModelParams, build_model
from jaxzero.overrides import apply_overrides, parse_args
from jaxzero.plan import OffloadPlan, resolve_plan
from jaxzero.state import StepMetrics, Trainer, TrainState
from jaxzero.trainer import build_trainer

__all__ = [
    "ConfigError",
    "ModelParams",
    "OffloadPlan",
    "StepMetrics",
    "TrainConfig",
    "TrainState",
    "Trainer",
    "apply_overrides",
    "build_data",
    "build_model",
    "build_trainer",
    "parse_args",
    "resolve_plan",
]
