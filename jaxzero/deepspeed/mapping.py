"""A DeepSpeed config's keys mapped to jaxzero settings (`translate`): the batch triple, the precision,
ZeRO and its offload, activation checkpointing, logging and parallelism here; the optimizer and
scheduler in `jaxzero.deepspeed.optimizer`. Which keys exist, mean nothing or are refused:
`jaxzero.deepspeed.keys`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from jaxzero.config import TrainConfig
from jaxzero.deepspeed.keys import (
    BATCH_KEYS,
    IGNORED_TOP,
    OFFLOAD_IGNORED,
    REFUSED_WHEN_ENABLED,
    REFUSED_WHEN_PRESENT,
    TOP_KEYS,
    ZERO_IGNORED,
    ZERO_KEYS,
)
from jaxzero.deepspeed.optimizer import translate_optimizer, translate_scheduler
from jaxzero.deepspeed.reading import Reader, Translation, as_written


def translate(ds: Mapping[str, Any], base: TrainConfig, source: str = "ds_config.json") -> Translation:
    """jaxzero's reading of the DeepSpeed config `ds` (a parsed JSON object; `jaxzero.deepspeed`'s docstring).

    `base` is the config the file applies on top of (defaults, preset, the command line's model): it
    gives the model's unit count for `offload_optimizer.ratio` and the values jaxzero keeps where the
    file says "auto" or is silent. Raises ConfigError for unknown keys, wrong types, a batch triple
    that breaks DeepSpeed's rule, and features jaxzero does not run."""
    r = Reader(source)
    out = Translation(source)
    r.check_keys(ds, "", TOP_KEYS)
    _batch(ds, r, out)
    _precision(ds, r, out)
    translate_optimizer(ds, base, r, out)
    translate_scheduler(ds, base, r, out)
    _zero(ds, base, r, out)
    clip = r.get(ds, "gradient_clipping", "gradient_clipping", float)
    if clip is not None:
        if clip < 0:
            raise r.error("gradient_clipping", f"{clip} must be >= 0 (0: no clipping).")
        out.set("optimizer.grad_clip", clip, "gradient_clipping", ds["gradient_clipping"])
    elif "gradient_clipping" not in ds:
        out.notes.append(
            f"no gradient_clipping: jaxzero's optimizer.grad_clip={base.optimizer.grad_clip} applies "
            '(DeepSpeed\'s default is none; set "gradient_clipping": 0 for that).'
        )
    every = r.positive(ds, "steps_per_print", "steps_per_print")
    if every is not None:
        out.set("logging.log_every", every, "steps_per_print", ds["steps_per_print"])
    ckpt = r.section(
        ds,
        "activation_checkpointing",
        "activation_checkpointing",
        {
            "partition_activations",
            "cpu_checkpointing",
            "contiguous_memory_optimization",
            "number_checkpoints",
            "synchronize_checkpoint_boundary",
            "profile",
        },
    )
    if ckpt is not None:
        if r.get(ckpt, "cpu_checkpointing", "activation_checkpointing.cpu_checkpointing", bool):
            out.set("offload.activations", "cpu", "activation_checkpointing.cpu_checkpointing", True)
        for k in sorted(set(ckpt) - {"cpu_checkpointing"}):
            out.ignored.append(
                f"activation_checkpointing.{k}: every block's input is the one checkpoint; the backward "
                "pass recomputes the block from it"
            )
    tb = r.section(ds, "tensorboard", "tensorboard", {"enabled", "output_path", "job_name"})
    if tb is not None:
        enabled = r.get(tb, "enabled", "tensorboard.enabled", bool)
        if enabled is not None:
            out.set("logging.tensorboard", enabled, "tensorboard.enabled")
        for k in ("output_path", "job_name"):
            if k in tb:
                out.ignored.append(f"tensorboard.{k}: the events go in <run_dir>/tensorboard")
    _parallel_features(ds, r, out)
    for key, why in IGNORED_TOP.items():
        if key in ds:
            out.ignored.append(f"{key}: {why}")
    for key, what in REFUSED_WHEN_ENABLED.items():
        section = ds.get(key)
        if isinstance(section, dict) and section.get("enabled") is True:
            raise r.error(
                f"{key}.enabled", f"jaxzero does not run {what}. Remove the section or set enabled false."
            )
        if key in ds:
            out.ignored.append(f"{key}: not enabled")
    for key, what in REFUSED_WHEN_PRESENT.items():
        if key in ds and ds[key]:
            raise r.error(key, f"jaxzero does not run {what}. Remove the section.")
    return out


def _batch(ds: Mapping[str, Any], r: Reader, out: Translation) -> None:
    """DeepSpeed's batch triple: the given ones set; of a missing one, what DeepSpeed infers."""
    batch = r.positive(ds, "train_batch_size", "train_batch_size")
    micro = r.positive(ds, "train_micro_batch_size_per_gpu", "train_micro_batch_size_per_gpu")
    accum = r.positive(ds, "gradient_accumulation_steps", "gradient_accumulation_steps")
    if batch is None and micro is None:
        if accum is not None:
            raise r.error(
                "gradient_accumulation_steps",
                f"{accum} is given without train_batch_size or train_micro_batch_size_per_gpu; DeepSpeed "
                "needs one of them too (train_batch_size = train_micro_batch_size_per_gpu x "
                "gradient_accumulation_steps x GPUs).",
            )
        return
    if batch is not None and micro is not None and accum is None:
        accum = 0  # derived: batch / (micro x devices)
    elif accum is None:
        accum = 1  # DeepSpeed's default when only one of batch and micro is given
    # 0: left out, derived from the other two once the devices are known
    for key, value in (
        ("data.batch_size", batch),
        ("data.grad_accum", accum),
        ("data.micro_batch_size", micro),
    ):
        out.set(key, value or 0, BATCH_KEYS[key], value or 0)


def _precision(ds: Mapping[str, Any], r: Reader, out: Translation) -> None:
    fp16 = r.section(
        ds,
        "fp16",
        "fp16",
        {
            "enabled",
            "auto_cast",
            "loss_scale",
            "initial_scale_power",
            "loss_scale_window",
            "hysteresis",
            "consecutive_hysteresis",
            "min_loss_scale",
            "fp16_master_weights_and_grads",
        },
    )
    bf16_key = "bf16" if "bf16" in ds or "bfloat16" not in ds else "bfloat16"  # bfloat16: the old name
    bf16 = r.section(
        ds,
        bf16_key,
        bf16_key,
        {
            "enabled",
            "immediate_grad_update",
            "check_grad_overflow",
            "bf16_master_weights_and_grads",
            "bf16_optimizer_states",
        },
    )
    half = r.get(fp16, "enabled", "fp16.enabled", bool)
    brain = r.get(bf16, "enabled", f"{bf16_key}.enabled", bool)
    if half and brain:
        raise r.error(
            "fp16.enabled",
            f"true, and {bf16_key}.enabled is true: fp16 and {bf16_key} are both enabled; enable one.",
        )
    if half:
        out.set("model.compute_dtype", "float16", "fp16.enabled", True)
        scale = r.get(fp16, "loss_scale", "fp16.loss_scale", float)
        if scale:
            raise r.error(
                "fp16.loss_scale",
                f"{scale} is a static loss scale; jaxzero scales float16 losses dynamically only. Set 0 "
                "(dynamic, starting at 2**initial_scale_power).",
            )
        for key, kind in (
            ("initial_scale_power", int),
            ("loss_scale_window", int),
            ("hysteresis", int),
            ("consecutive_hysteresis", bool),
            ("min_loss_scale", float),
        ):
            value = r.get(fp16, key, f"fp16.{key}", kind)
            if value is not None:
                out.set(f"fp16.{key}", value, f"fp16.{key}", fp16[key])
        if r.get(fp16, "fp16_master_weights_and_grads", "fp16.fp16_master_weights_and_grads", bool):
            raise r.error(
                "fp16.fp16_master_weights_and_grads", "true: jaxzero's masters are float32; set it false."
            )
        if "auto_cast" in fp16:
            out.ignored.append("fp16.auto_cast: the model computes in model.compute_dtype throughout")
    elif brain:
        out.set("model.compute_dtype", "bfloat16", f"{bf16_key}.enabled", True)
    elif half is False or brain is False:  # a precision section, switched off: DeepSpeed trains in float32
        out.set(
            "model.compute_dtype",
            "float32",
            "fp16.enabled" if half is False else f"{bf16_key}.enabled",
            False,
        )
    elif fp16 is None and bf16 is None:
        out.notes.append(
            "no fp16 or bf16 section: jaxzero's model.compute_dtype applies (bfloat16 by default; "
            "DeepSpeed alone would compute in float32)."
        )
    if bf16 is not None:
        if brain and r.get(bf16, "bf16_optimizer_states", f"{bf16_key}.bf16_optimizer_states", bool):
            out.set("optimizer.state_dtype", "bfloat16", f"{bf16_key}.bf16_optimizer_states", True)
        if r.get(bf16, "bf16_master_weights_and_grads", f"{bf16_key}.bf16_master_weights_and_grads", bool):
            raise r.error(
                f"{bf16_key}.bf16_master_weights_and_grads",
                "true: jaxzero's masters are float32; set it false.",
            )
        for k in ("immediate_grad_update", "check_grad_overflow"):
            if k in bf16:
                out.ignored.append(f"{bf16_key}.{k}: bfloat16 gradients are applied once per step, unscaled")


def _offload_device(
    section: Mapping[str, Any], path: str, r: Reader, out: Translation
) -> tuple[str, str | None]:
    device = r.get(section, "device", f"{path}.device", str)
    if device not in ("cpu", "nvme", "none"):
        raise r.error(f"{path}.device", f'{section.get("device")!r} must be "cpu", "nvme" or "none".')
    nvme = r.get(section, "nvme_path", f"{path}.nvme_path", str)
    for k in sorted(set(section) & set(OFFLOAD_IGNORED)):
        out.ignored.append(f"{path}.{k}: {OFFLOAD_IGNORED[k]}")
    return device, nvme


def _zero(ds: Mapping[str, Any], base: TrainConfig, r: Reader, out: Translation) -> None:
    o = out.overrides
    if isinstance(ds.get("zero_optimization"), bool):  # DeepSpeed's early form: true is stage 1
        flag = ds["zero_optimization"]
        out.set("parallel.zero_stage", int(flag), "zero_optimization", flag)
        out.set("offload.params", "none", "zero_optimization", flag)
        out.set("offload.optimizer", "none", "zero_optimization", flag)
        return
    zero = r.section(ds, "zero_optimization", "zero_optimization", ZERO_KEYS)
    if zero is None:
        if "zero_optimization" not in ds:
            out.notes.append(
                "no zero_optimization: ZeRO stage 0, nothing offloaded, as in DeepSpeed "
                "(--offload.params=auto --offload.optimizer=auto lets jaxzero's planner choose)."
            )
            o["parallel.zero_stage"], o["offload.params"], o["offload.optimizer"] = 0, "none", "none"
            for key in ("parallel.zero_stage", "offload.params", "offload.optimizer"):
                out.origins[key] = "zero_optimization (left out)"
        return
    stage = r.get(zero, "stage", "zero_optimization.stage", int)
    if stage is not None and stage not in (0, 1, 2, 3):
        raise r.error("zero_optimization.stage", f"{stage} must be 0, 1, 2 or 3.")
    if stage is not None:
        out.set("parallel.zero_stage", stage, "zero_optimization.stage", zero["stage"])
    for key in ("zero_quantized_weights", "zero_quantized_gradients", "zero_quantized_nontrainable_weights"):
        if r.get(zero, key, f"zero_optimization.{key}", bool):
            raise r.error(
                f"zero_optimization.{key}",
                "true: ZeRO++ quantization changes the numerics; jaxzero does not run it. Set it false.",
            )
    for key in ("zero_hpz_partition_size", "mics_shard_size"):
        size = r.get(zero, key, f"zero_optimization.{key}", int)
        if size is not None and size > 1:
            raise r.error(
                f"zero_optimization.{key}",
                f"{size}: jaxzero shards over the whole data axis (no hierarchical or MiCS groups); "
                "remove it.",
            )
        if key in zero:
            out.ignored.append(f"zero_optimization.{key}: one shard group, the whole data axis")
    optim_section = r.section(
        zero,
        "offload_optimizer",
        "zero_optimization.offload_optimizer",
        {"device", "nvme_path", "ratio", *OFFLOAD_IGNORED},
    )
    param_section = r.section(
        zero, "offload_param", "zero_optimization.offload_param", {"device", "nvme_path", *OFFLOAD_IGNORED}
    )
    optim_device, param_device = "none", "none"
    if r.get(zero, "cpu_offload", "zero_optimization.cpu_offload", bool):  # deprecated spelling
        optim_device = "cpu"
    if r.get(zero, "cpu_offload_params", "zero_optimization.cpu_offload_params", bool):
        param_device = "cpu"
    nvme_path = None
    if optim_section is not None:
        optim_device, nvme_path = _offload_device(
            optim_section, "zero_optimization.offload_optimizer", r, out
        )
        ratio = r.get(optim_section, "ratio", "zero_optimization.offload_optimizer.ratio", float)
        if ratio is not None:
            if not 0 < ratio <= 1:
                raise r.error("zero_optimization.offload_optimizer.ratio", f"{ratio} must be in (0, 1].")
            if optim_device != "cpu":
                raise r.error(
                    "zero_optimization.offload_optimizer.ratio",
                    f'{ratio} applies with device "cpu" only; offload_optimizer.device is "{optim_device}".',
                )
            units = base.model.num_layers + 2
            keep = round((1 - ratio) * units)
            # A ratio given is a placement named: 1.0 pins every unit's state to the host (without
            # one the planner may keep the first units' state on the GPU where it has room).
            out.set("offload.device_state_units", keep, "zero_optimization.offload_optimizer.ratio", ratio)
            if keep:
                out.notes.append(
                    f"offload_optimizer.ratio={ratio}: the first {keep} of the model's {units} units keep "
                    "their state on the accelerator (offload.device_state_units), the rest in host RAM."
                )
    if param_section is not None:
        param_device, param_nvme = _offload_device(param_section, "zero_optimization.offload_param", r, out)
        if param_device == "nvme":
            out.notes.append(
                "offload_param.device=nvme: the 2-byte compute weights stay in pinned host RAM "
                "(offload.params=cpu); the disk holds the masters and optimizer state when "
                "offload_optimizer.device is nvme."
            )
            nvme_path = nvme_path or param_nvme
    if param_device != "none" and stage is not None and stage < 3:
        raise r.error(
            "zero_optimization.offload_param",
            f"parameter offload needs ZeRO stage 3 (as in DeepSpeed); stage is {stage}.",
        )
    if param_device != "none" and optim_device == "none":
        raise r.error(
            "zero_optimization.offload_param",
            f'device "{param_device}" without offload_optimizer: jaxzero streams weights updated from '
            'host-resident masters, so it needs offload_optimizer.device "cpu" or "nvme" too. Add it, or '
            "remove offload_param.",
        )

    def origin(section: dict[str, Any] | None, name: str, deprecated: str, device: str) -> str:
        """Where the file says this state lives, in its words."""
        if section is not None:
            return as_written(f"zero_optimization.{name}.device", device)
        if deprecated in zero:
            return as_written(f"zero_optimization.{deprecated}", zero[deprecated])
        return f"zero_optimization.{name} (left out)"

    o["offload.optimizer"] = {"cpu": "cpu", "nvme": "disk", "none": "none"}[optim_device]
    out.origins["offload.optimizer"] = origin(optim_section, "offload_optimizer", "cpu_offload", optim_device)
    o["offload.params"] = "none" if param_device == "none" else "cpu"
    out.origins["offload.params"] = origin(param_section, "offload_param", "cpu_offload_params", param_device)
    if optim_device == "nvme" and nvme_path:
        out.set("offload.disk_path", nvme_path, "zero_optimization.offload_optimizer.nvme_path")
    for key, why in ZERO_IGNORED.items():
        if key in zero:
            out.ignored.append(f"zero_optimization.{key}: {why}")


def _parallel_features(ds: Mapping[str, Any], r: Reader, out: Translation) -> None:
    tp = ds.get("tensor_parallel")
    if tp is not None:
        if not isinstance(tp, dict):
            raise r.error("tensor_parallel", f"{tp!r} must be an object {{...}}.")
        size = r.get(tp, "autotp_size", "tensor_parallel.autotp_size", int) if "autotp_size" in tp else None
        if size is not None and size > 1:
            raise r.error(
                "tensor_parallel.autotp_size", f"{size}: jaxzero has no tensor parallelism; remove it."
            )
        out.ignored.append("tensor_parallel: no tensor parallelism (size 1)")
    sp = r.get(ds, "sequence_parallel_size", "sequence_parallel_size", int)
    if sp is not None and sp > 1:
        raise r.error("sequence_parallel_size", f"{sp}: jaxzero has no sequence parallelism; remove it.")
    if "sequence_parallel_size" in ds:
        out.ignored.append("sequence_parallel_size: no sequence parallelism (size 1)")
