"""Refusals of a DeepSpeed file's values, in the file's words (`check`): the user reads their own
keys and values and DeepSpeed's arithmetic, not jaxzero's settings."""

from __future__ import annotations

import math
import re
from typing import Any

from jaxzero.config import ConfigError, TrainConfig
from jaxzero.config.checks import validate
from jaxzero.deepspeed.keys import BATCH_KEYS
from jaxzero.deepspeed.reading import Translation


def check(t: Translation, cfg: TrainConfig, num_devices: int | None = None) -> None:
    """Raise ConfigError in the words of the DeepSpeed file (its path, its keys and values as it writes
    them, DeepSpeed's arithmetic) where `cfg`, the config the file's `t` was applied to, holds a value
    the file set that jaxzero refuses: DeepSpeed's batch rule (with `num_devices`, for that many GPUs),
    the ranges and combinations `jaxzero.config.checks.validate` checks, and disk offload's fused update. A
    key the command line changed is named as jaxzero's (`data.batch_size=8`); a refusal of such keys
    alone is left to `validate`. Any other refusal `validate` makes of a key the file set gets the
    file's key and value appended."""
    c = _Check(t, cfg)
    _check_batch(c, num_devices)
    _check_ranges(c)
    _check_offload(c)
    try:
        validate(cfg)
    except ConfigError as e:  # a rule not phrased above: jaxzero's words, and the file's keys it read
        named = [k for k in t.origins if c.ours(k) and re.search(rf"\b{re.escape(k)}\b", str(e))]
        if named:
            raise ConfigError(
                f"{t.source}: {e} (from the file: {'; '.join(f'{t.origins[k]} as {k}' for k in named)})"
            ) from e


class _Check:
    """The file's values in `cfg`, and how to name them."""

    def __init__(self, t: Translation, cfg: TrainConfig) -> None:
        self.t, self.cfg = t, cfg

    def value(self, key: str) -> Any:
        section, _, name = key.partition(".")
        return getattr(getattr(self.cfg, section), name) if name else getattr(self.cfg, key)

    def ours(self, key: str) -> bool:
        """Whether `cfg` holds the value the file set for `key` (the command line did not change it)."""
        return key in self.t.origins and self.value(key) == self.t.overrides[key]

    def name(self, key: str) -> str:
        """`key` with its value as the file writes it (`train_batch_size=16`), else as jaxzero's."""
        return self.t.origins[key] if self.ours(key) else f"{key}={self.value(key)}"

    def refuse(self, keys: list[str], message: str) -> None:
        """ConfigError naming the file, where one of `keys` is the file's."""
        if any(self.ours(k) for k in keys):
            raise ConfigError(f"{self.t.source}: {message}")


def _check_batch(c: _Check, devices: int | None) -> None:
    """DeepSpeed's rule train_batch_size = train_micro_batch_size_per_gpu x gradient_accumulation_steps
    x GPUs, the key left out (0) derived; without `devices`, what holds for every GPU count."""
    keys = list(BATCH_KEYS)
    batch, micro, accum = (c.value(k) for k in keys)
    term = {k: BATCH_KEYS[k] if c.ours(k) else k for k in keys}  # the file's names, else jaxzero's
    b, m, g = (term[k] for k in keys)
    gpus = "GPUs" if devices is None else f"{devices} GPU{'s' if devices != 1 else ''}"

    def derived(left_out: str, given: int, other: str) -> None:  # left_out = batch / (given x GPUs)
        step = given * (devices or 1)
        nearest = max(1, -(-batch // step)) * step
        if batch % step:
            division = f"{batch} / ({given} x {gpus})"
            if devices is None:
                division += " is not a whole number on any number of GPUs"
            else:
                division += f" = {batch} / {step} is not a whole number"
            micro_term = m if micro == 0 else f"{m}={micro}"
            accum_term = g if accum == 0 else f"{g}={accum}"
            c.refuse(
                keys,
                f"{b}={batch} must equal {micro_term} x {accum_term} x {gpus}, so {left_out} = {division}: "
                f"make {b} a multiple of {step} (e.g. {nearest}), or change {other}.",
            )

    if micro == 0 and batch and accum:
        derived(m, accum, g)
    elif accum == 0 and batch and micro:
        derived(g, micro, m)
    elif batch and micro and accum:
        if devices is None and batch % (micro * accum):
            c.refuse(
                keys,
                f"{b}={batch} must equal {m}={micro} x {g}={accum} x GPUs = {micro * accum} x GPUs, and "
                f"{batch} is not a multiple of {micro * accum}: change one of them, or leave one out to "
                "have it derived.",
            )
        if devices is not None and batch != micro * accum * devices:
            c.refuse(
                keys,
                f"{b}={batch} must equal {m}={micro} x {g}={accum} x {gpus} = {micro * accum * devices}: "
                f"change one of them (on {gpus}, {b}={micro * accum * devices}), or leave one out to have it "
                "derived.",
            )


def _check_ranges(c: _Check) -> None:
    """The single values jaxzero bounds, as the file wrote them."""
    for key, value in c.t.overrides.items():
        if isinstance(value, float) and not math.isfinite(c.value(key)):
            c.refuse([key], f"{c.name(key)} must be a finite number.")
    bounds = [
        ("optimizer.lr", lambda v: v > 0, "must be > 0"),
        ("optimizer.eps", lambda v: v > 0, "must be > 0 (it keeps Adam's division finite)"),
        ("optimizer.b1", lambda v: 0 <= v < 1, "must hold betas in [0, 1)"),
        ("optimizer.b2", lambda v: 0 <= v < 1, "must hold betas in [0, 1)"),
        ("optimizer.weight_decay", lambda v: v >= 0, "must be >= 0"),
        ("optimizer.momentum", lambda v: 0 <= v < 1, "must be in [0, 1)"),
        (
            "optimizer.warmup_start_ratio",
            lambda v: 0 <= v <= 1,
            "must be in [0, 1] (the first rate over the peak)",
        ),
        ("optimizer.min_lr_ratio", lambda v: 0 <= v <= 1, "must be in [0, 1] (the last rate over the peak)"),
        ("fp16.loss_scale_window", lambda v: v >= 1, "must be >= 1"),
        ("fp16.hysteresis", lambda v: v >= 1, "must be >= 1"),
        ("fp16.min_loss_scale", lambda v: v > 0, "must be > 0"),
        (
            "fp16.initial_scale_power",
            lambda v: 0 <= v <= 64,
            "must be in [0, 64] (the first scale is 2**power)",
        ),
    ]
    for key, ok, rule in bounds:
        if not ok(c.value(key)):
            c.refuse([key], f"{c.name(key)} {rule}.")
    power, floor = c.value("fp16.initial_scale_power"), c.value("fp16.min_loss_scale")
    if 2.0**power < floor:
        c.refuse(
            ["fp16.initial_scale_power", "fp16.min_loss_scale"],
            f"{c.name('fp16.initial_scale_power')} starts the loss scale at 2**{power} = {2.0**power:g}, "
            f"below {c.name('fp16.min_loss_scale')}: raise initial_scale_power to at least "
            f"{math.ceil(math.log2(floor))}, or lower min_loss_scale.",
        )


def _check_offload(c: _Check) -> None:
    """Where the file puts the optimizer state, the weights and the block inputs, against the ZeRO
    stage and the precision, as jaxzero's trainers can run them."""
    optimizer, params, stage = (
        c.value(k) for k in ("offload.optimizer", "offload.params", "parallel.zero_stage")
    )
    opt, par, zs = c.name("offload.optimizer"), c.name("offload.params"), c.name("parallel.zero_stage")
    keys = ["offload.optimizer", "offload.params", "parallel.zero_stage"]
    if optimizer in ("cpu", "disk") and stage == 0:
        c.refuse(
            keys,
            f"{opt} needs ZeRO stage 1, 2 or 3 (as in DeepSpeed: the offloaded state is one shard per GPU), "
            f"but {zs}. Set zero_optimization.stage to 1 or more, or remove offload_optimizer.",
        )
    if params == "cpu" and stage in (0, 1, 2):
        c.refuse(keys, f"{par} needs ZeRO stage 3 (as in DeepSpeed), but {zs}.")
    if params == "cpu" and optimizer == "none":
        c.refuse(
            keys,
            f"{par} needs offload_optimizer too (weights streamed from the host are updated there), but "
            f"{opt}.",
        )
    units = c.value("model.num_layers") + 2
    dsu = c.value("offload.device_state_units")
    if dsu >= units:  # a count only the file's ratio phrases so
        c.refuse(
            ["offload.device_state_units"],
            f"{c.name('offload.device_state_units')} keeps round((1 - ratio) x {units} units) = {dsu} units' "
            f"optimizer state on the GPU: all of the model's units (embedding, {units - 2} blocks, head), so "
            f"nothing is offloaded. Raise the ratio above {0.5 / units:.3g}, or remove offload_optimizer.",
        )
    if dsu > 0 and optimizer == "none":
        c.refuse(
            ["offload.device_state_units", "offload.optimizer"],
            f'{c.name("offload.device_state_units")} applies with device "cpu" only, but {opt}.',
        )
    if dsu > 0 and c.value("offload.update") == "delayed":
        c.refuse(
            ["offload.device_state_units"],
            f"{c.name('offload.device_state_units')} keeps units' state on the GPU, which needs "
            f"offload.update=overlapped, but {c.name('offload.update')}.",
        )
    if c.value("offload.disk_path") and optimizer not in ("disk", "auto"):
        c.refuse(
            ["offload.disk_path", "offload.optimizer"],
            f'{c.name("offload.disk_path")} applies with offload_optimizer.device "nvme" only, but {opt}.',
        )
    if c.value("offload.activations") == "cpu" and optimizer == "none":
        c.refuse(
            ["offload.activations", "offload.optimizer"],
            f"{c.name('offload.activations')} needs the offload engine, which keeps block inputs in host "
            f"memory while the optimizer state is offloaded, but {opt}. Add "
            'zero_optimization.offload_optimizer with device "cpu", or set cpu_checkpointing false.',
        )
    compute = c.value("model.compute_dtype")
    if optimizer == "disk" and (compute == "float16" or not c.value("offload.fused_update")):
        why = c.name("model.compute_dtype") if compute == "float16" else c.name("offload.fused_update")
        c.refuse(
            ["offload.optimizer", "model.compute_dtype"],
            f"{opt} needs the fused host update, which updates the state read from disk in place, but with "
            f"{why} the update is optax's on XLA:CPU. Use bf16 (or no fp16 section), or "
            'offload_optimizer.device "cpu".',
        )
