"""jaxzero: train models larger than one GPU's memory in JAX (host-resident state, streamed blocks).

The library API in one screen:

    cfg = parse_args(["--model.name=gpt2-tiny", "--offload.optimizer=cpu"])
    trainer = build_trainer(cfg)
    data = build_data(cfg.data, cfg.model.vocab_size, cfg.seed)
    state = trainer.init(jax.random.key(cfg.seed))
    state, metrics = trainer.step(state, trainer.put_batch(next(data.train_iter())))
    save_state(trainer, state, "runs/x", step=1)   # restore_state: jaxzero.storage.state_io
    export_state(trainer, state, "export/x")       # jaxzero.interop.state_export
    model, params = from_export("export/x")        # an export's model and weights (Orbax or HF)

Each name is imported from its module on first use: Python runs this file before any submodule, so
importing it eagerly would load every layer (Orbax, the exporters, the argument parser) into a
program that asks for one of them (`import jaxzero.offload.engine` loads no Orbax).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # for type checkers and editors; at run time `__getattr__` imports on first use
    from jaxzero.config import ConfigError, TrainConfig
    from jaxzero.data import build_data
    from jaxzero.interop.exports import from_export
    from jaxzero.interop.state_export import export_state
    from jaxzero.models import ModelParams, build_model
    from jaxzero.overrides import apply_overrides, parse_args
    from jaxzero.plan import OffloadPlan, resolve_plan
    from jaxzero.state import StepMetrics, Trainer, TrainState
    from jaxzero.storage.state_io import restore_state, save_state
    from jaxzero.trainer import build_trainer

# The public names (`__all__`) and the module that defines each.
_HOMES = {
    "ConfigError": "jaxzero.config",
    "TrainConfig": "jaxzero.config",
    "build_data": "jaxzero.data",
    "from_export": "jaxzero.interop.exports",
    "ModelParams": "jaxzero.models",
    "build_model": "jaxzero.models",
    "apply_overrides": "jaxzero.overrides",
    "parse_args": "jaxzero.overrides",
    "OffloadPlan": "jaxzero.plan",
    "resolve_plan": "jaxzero.plan",
    "StepMetrics": "jaxzero.state",
    "Trainer": "jaxzero.state",
    "TrainState": "jaxzero.state",
    "export_state": "jaxzero.interop.state_export",
    "restore_state": "jaxzero.storage.state_io",
    "save_state": "jaxzero.storage.state_io",
    "build_trainer": "jaxzero.trainer",
}

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
    "export_state",
    "from_export",
    "parse_args",
    "resolve_plan",
    "restore_state",
    "save_state",
]


def __getattr__(name: str) -> Any:
    """The public name `name` (`__all__`), imported from its module on first use (PEP 562); any other
    name is an AttributeError, as Python's import system expects of a submodule not yet imported."""
    if name not in _HOMES:
        raise AttributeError(f"module 'jaxzero' has no attribute {name!r}")
    value = getattr(importlib.import_module(_HOMES[name]), name)  # on first use: see the docstring
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
