"""A trainer's state exported for inference, for research code: its weights as a Hugging Face
checkpoint, as Orbax parameters, or a LoRA trainer's adapter in PEFT's format.

    export_state(trainer, state, "export/x")                  # Hugging Face safetensors
    export_state(trainer, state, "export/a", format="peft")   # a LoRA trainer's adapter

It does not consume the state, and refuses one a step has consumed (`jaxzero.state.ensure_live`).
Saving and restoring a state (`jaxzero.storage.state_io`) sit below the exporters; this sits with them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax

from jaxzero.finetune.adapters import LORA_LAYOUT
from jaxzero.finetune.merged import merged_units
from jaxzero.finetune.trainable import FROZEN_LAYOUT
from jaxzero.interop.hf_io import export_hf
from jaxzero.interop.peft import export_peft_adapter
from jaxzero.plan.placement import process_count
from jaxzero.state import Trainer, ensure_live
from jaxzero.storage.checkpoint_masters import export_orbax


def export_state(
    trainer: Trainer,
    state: Any,
    out_dir: str | Path,
    format: str = "hf",
    dtype: str = "bfloat16",
    overwrite: bool = False,
) -> Path:
    """Write the weights of `trainer`'s `state` for inference: `format="hf"` a transformers
    checkpoint (`config.json` + safetensors), `"orbax"` the parameters with `model.json`; `dtype` bfloat16,
    float32 or float16. `out_dir` must be new, empty or an earlier export (`jaxzero.storage.export_dir`):
    `overwrite` replaces a finished one, and anything else is refused (FileExistsError) with or
    without it. Returns `out_dir`. The state is not consumed; the float32 masters are copied to host
    RAM whole, so one process must hold them all (a run of several processes exports a checkpoint
    with `python -m jaxzero.export` instead). A LoRA trainer's state: `format="peft"` its adapter in
    PEFT's format, "hf" / "orbax" the adapter merged into the base the user gave (`model.init_from`'s
    weights as read, not the `finetune.base_dtype` copy that trained; a base drawn from the seed, as
    trained: `jaxzero.finetune.merged.merged_into`), as `python -m jaxzero.export --merge` does; a
    `finetune.freeze` trainer's frozen units alike, as the user's base holds them."""
    ensure_live(state)
    lora = trainer.layout == LORA_LAYOUT
    partial = lora or trainer.layout == FROZEN_LAYOUT
    if format not in ("hf", "orbax", "peft") or (format == "peft" and not lora):
        formats = "'peft' (the adapter), 'hf', 'orbax' (the merged model)" if lora else "'hf', 'orbax'"
        raise ValueError(f"format={format!r} is not one of {formats}.")
    if process_count(trainer.mesh) > 1:
        raise ValueError(
            "export runs in one process: each of this run's processes holds only part of the weights. "
            "Save a checkpoint (save_state) and export it from one process: python -m jaxzero.export "
            "--run_dir=DIR --out=OUT."
        )
    if partial:  # LoRA's adapters in PEFT's format, or what trained with the base as it was trained
        cfg = trainer.config
        trained = jax.device_get(state.params)
        if format == "peft":
            base = cfg.model.init_from or None
            return export_peft_adapter(trained, cfg.model, cfg.finetune, out_dir, base, overwrite=overwrite)
        by_position = trained.units()
        masters = merged_units(cfg, lambda k: by_position[k], base_as_given=True)
    else:
        masters = jax.device_get(state.params)  # float32, one host copy
    if format == "hf":
        export_hf(masters, trainer.config.model, out_dir, dtype=dtype, overwrite=overwrite)
    else:
        export_orbax(masters, trainer.config.model, out_dir, dtype, overwrite=overwrite)
    return Path(out_dir)
