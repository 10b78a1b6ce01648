"""`--deepspeed=ds_config.json`: a DeepSpeed config file read as jaxzero settings.

Every key with a jaxzero meaning becomes a dotted override (`translate`), applied above a preset and
below the command line's own `--section.key=value`:

    train_batch_size, train_micro_batch_size_per_gpu,   data.batch_size, data.micro_batch_size,
    gradient_accumulation_steps                         data.grad_accum (DeepSpeed's rule: batch =
                                                        micro x accumulation x devices; one missing
                                                        is derived once the devices are known)
    zero_optimization.stage                             parallel.zero_stage
    zero_optimization.offload_optimizer.device          offload.optimizer (cpu, nvme -> disk, none)
      .nvme_path, .ratio                                offload.disk_path, offload.device_state_units
    zero_optimization.offload_param.device              offload.params (cpu; nvme -> cpu, see notes)
    fp16.*, bf16.enabled, bf16.bf16_optimizer_states    model.compute_dtype, fp16.*, optimizer.state_dtype
    optimizer (Adam, AdamW, Lion, SGD) and its params   optimizer.*
    scheduler (WarmupLR, WarmupDecayLR, WarmupCosineLR) optimizer.schedule, warmup_*, decay_steps, ...
    gradient_clipping, steps_per_print                  optimizer.grad_clip, logging.log_every
    activation_checkpointing.cpu_checkpointing          offload.activations=cpu
    tensorboard.enabled                                 logging.tensorboard

A value of "auto" leaves the key to jaxzero (its default, a preset or the command line), as the
Hugging Face Trainer fills "auto" from its own arguments. Keys DeepSpeed knows that mean nothing here
(bucket sizes XLA decides, pinning jaxzero always does, loggers of other tools) are listed with why;
features that would change the training (quantized ZeRO, curriculum learning, static loss scaling,
...) are refused. Unknown keys and values of the wrong type are errors naming the key path. A value
the file set that jaxzero refuses (a batch that breaks DeepSpeed's rule, a rate out of range, offload
without the ZeRO stage it needs, ...) is refused in the file's own keys and values, with the
arithmetic (`check`): the user reads their own file, not jaxzero's settings.
"""

from __future__ import annotations

import difflib
import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from jaxzero.config import ConfigError, TrainConfig, validate

AUTO = "auto"

# Keys DeepSpeed accepts that have no jaxzero meaning, with why; a whole section's contents are not
# read when the section itself is listed.
_IGNORED_TOP = {
    "wall_clock_breakdown": "the offload step's time breakdown is always in metrics.jsonl",
    "memory_breakdown": "peak accelerator and host memory are always in metrics.jsonl",
    "dump_state": "the resolved config is written to <run_dir>/config.json",
    "prescale_gradients": "gradients are reduced in float32 by XLA; no pre-scaling is needed",
    "gradient_predivide_factor": "gradients are reduced in float32 by XLA; no pre-division is needed",
    "communication_data_type": "XLA reduces gradients in their own dtype (float32 masters' gradients)",
    "gradient_allreduce_op": "gradients are averaged over the data axis by XLA",
    "sparse_gradients": "embedding gradients are dense arrays in JAX",
    "managed_gradient_accumulation": "data.grad_accum micro-batches are always summed inside the step",
    "zero_allow_untested_optimizer": "every optimizer jaxzero offers runs under every ZeRO stage",
    "zero_force_ds_cpu_optimizer": "the host update is jaxzero's own fused kernel or optax on XLA:CPU",
    "wandb": "jaxzero writes metrics.jsonl and TensorBoard events, not Weights & Biases",
    "comet": "jaxzero writes metrics.jsonl and TensorBoard events, not Comet",
    "csv_monitor": "metrics.jsonl is the machine-readable log",
    "comms_logger": "XLA issues the collectives; --profile.steps traces them",
    "flops_profiler": "model FLOPs and MFU are in every metrics.jsonl record; --profile.steps traces a step",
    "autotuning": "the placement planner (offload.*=auto) chooses the memory/speed settings",
    "aio": "the disk tier reads and writes with its own thread pool and aligned buffers",
    "checkpoint": "checkpoints are Orbax's, in <run_dir>/checkpoints (checkpoint.*)",
    "nebula": "checkpoints are Orbax's, in <run_dir>/checkpoints (checkpoint.*)",
    "data_types": "gradients are accumulated in float32",
    "pipeline": "jaxzero has no pipeline parallelism; the devices form one data axis",
    "steps_per_print_throughput": "throughput is in every metrics.jsonl record",
}
# Sections whose feature, when switched on, would change the training jaxzero runs: refused.
_REFUSED_WHEN_ENABLED = {
    "amp": "NVIDIA Apex AMP; use bf16 or fp16",
    "torch_autocast": "torch.autocast; use bf16 or fp16 (model.compute_dtype)",
    "curriculum_learning": "curriculum learning",
    "data_efficiency": "data efficiency (curriculum sampling, random layer-token drop)",
    "progressive_layer_drop": "progressive layer dropping",
    "elasticity": "elastic batch sizes",
    "hybrid_engine": "the RLHF hybrid engine",
    "eigenvalue": "eigenvalue computation",
    "quantize_training": "quantization-aware training",
    "expert_parallel": "mixture-of-experts parallelism",
}
_REFUSED_WHEN_PRESENT = {
    "sparse_attention": "sparse attention (jaxzero computes dense causal attention)",
    "compression_training": "compression training (quantization, pruning, layer reduction)",
}
_TOP_KEYS = {
    "train_batch_size",
    "train_micro_batch_size_per_gpu",
    "gradient_accumulation_steps",
    "optimizer",
    "scheduler",
    "fp16",
    "bf16",
    "bfloat16",
    "gradient_clipping",
    "zero_optimization",
    "steps_per_print",
    "activation_checkpointing",
    "tensorboard",
    "tensor_parallel",
    "sequence_parallel_size",
    *_IGNORED_TOP,
    *_REFUSED_WHEN_ENABLED,
    *_REFUSED_WHEN_PRESENT,
}

_EXPORT = "python -m jaxzero.export writes the weights in bf16 or fp32"
_ZERO_IGNORED = {
    "allgather_partitions": "XLA gathers each streamed or sharded block whole",
    "allgather_bucket_size": "XLA sizes its collectives",
    "overlap_comm": "copies and collectives always overlap compute (one block ahead)",
    "reduce_scatter": "ZeRO-2/3 gradients are always reduce-scattered",
    "reduce_bucket_size": "XLA sizes its collectives",
    "contiguous_gradients": "each unit's gradient is one contiguous buffer already",
    "load_from_fp32_weights": "checkpoints always hold the float32 masters",
    "grad_hooks": "gradients are produced per block by the streamed backward pass",
    "round_robin_gradients": "each process updates its own rows of every unit",
    "stage3_max_live_parameters": "one block is live at a time, plus the one being prefetched",
    "stage3_max_reuse_distance": "blocks are fetched again for the backward pass; the plan decides residency",
    "stage3_prefetch_bucket_size": "the next block is always prefetched while one computes",
    "stage3_param_persistence_threshold": "units stay whole; offload.resident_blocks keeps blocks resident",
    "stage3_module_granularity_threshold": "the unit of streaming is one transformer block",
    "stage3_gather_16bit_weights_on_model_save": _EXPORT,
    "stage3_gather_fp16_weights_on_model_save": _EXPORT,
    "gather_16bit_weights_on_model_save": _EXPORT,
    "sub_group_size": "the host update runs one unit (a block) at a time",
    "elastic_checkpoint": "checkpoints restore on any device count",
    "ignore_unused_parameters": "every parameter takes part in each step",
    "legacy_stage1": "ZeRO stages are XLA shardings",
    "log_trace_cache_warnings": "no module tracing: blocks are compiled once",
    "memory_efficient_linear": "XLA decides the linear layers' buffers",
    "cpu_offload_use_pin_memory": "streamed state is always in pinned host memory",
    "mics_hierarchical_params_gather": "no MiCS: ZeRO shards over the whole data axis",
    "use_multi_rank_bucket_allreduce": "XLA sizes its collectives",
    "zeropp_loco_param": "no quantized ZeRO++ communication",
    "pipeline_loading_checkpoint": "checkpoints are Orbax's",
    "override_module_apply": "no module hooks: blocks are compiled functions",
}
_ZERO_KEYS = {
    "stage",
    "offload_optimizer",
    "offload_param",
    "cpu_offload",
    "cpu_offload_params",
    "zero_hpz_partition_size",
    "mics_shard_size",
    "zero_quantized_weights",
    "zero_quantized_gradients",
    "zero_quantized_nontrainable_weights",
    *_ZERO_IGNORED,
}
_OFFLOAD_IGNORED = {
    "pin_memory": "host state the accelerator reads is always pinned",
    "buffer_count": "the disk tier sizes its pinned buffers from the plan",
    "buffer_size": "the disk tier sizes its pinned buffers from the plan",
    "max_in_cpu": "the planner decides what stays in host RAM",
    "fast_init": "the state is initialised where it lives",
    "pipeline": "disk reads and writes always overlap the update",
    "pipeline_read": "disk reads always overlap the update",
    "pipeline_write": "disk writes always overlap the update",
}
# jaxzero's batch keys and the DeepSpeed keys that set them (DeepSpeed's rule: train_batch_size =
# train_micro_batch_size_per_gpu x gradient_accumulation_steps x GPUs).
_BATCH_KEYS = {
    "data.batch_size": "train_batch_size",
    "data.micro_batch_size": "train_micro_batch_size_per_gpu",
    "data.grad_accum": "gradient_accumulation_steps",
}
_OPTIMIZERS = {"adam": "Adam", "adamw": "AdamW", "lion": "Lion", "sgd": "SGD"}
_OPT_PARAMS = {
    "adam": {"lr", "betas", "eps", "weight_decay", "adam_w_mode", "bias_correction", "amsgrad", "torch_adam"},
    "lion": {"lr", "betas", "weight_decay"},
    "sgd": {"lr", "momentum", "weight_decay", "dampening", "nesterov"},
}
_OPT_PARAMS["adamw"] = _OPT_PARAMS["adam"]
_SCHEDULERS = {
    "WarmupLR": {"warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type", "last_batch_iteration"},
    "WarmupDecayLR": {
        "warmup_min_lr",
        "warmup_max_lr",
        "warmup_num_steps",
        "warmup_type",
        "total_num_steps",
        "last_batch_iteration",
    },
    "WarmupCosineLR": {
        "warmup_min_ratio",
        "warmup_num_steps",
        "cos_min_ratio",
        "warmup_type",
        "total_num_steps",
        "last_batch_iteration",
    },
}


@dataclass(frozen=True)
class Translation:
    """A DeepSpeed config as jaxzero sees it.

    `overrides`: dotted jaxzero keys to values (typed), applied like a preset's. `ignored`: "key: why"
    for each key that has no jaxzero meaning. `notes`: where a key is read differently from
    DeepSpeed's own meaning, or a DeepSpeed default differs from jaxzero's. `origins`: for an override,
    the file's key and value it comes from, as the file writes them (`train_batch_size=16`), so that
    a refusal of it speaks the file's words (`check`)."""

    source: str
    overrides: dict[str, Any] = field(default_factory=dict)
    ignored: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    origins: dict[str, str] = field(default_factory=dict)

    def set(self, key: str, value: Any, path: str, written: Any = None, left_out: bool = False) -> None:
        """The override `key=value`, from the file's `path` whose value is `written` (default `value`),
        or, `left_out`, from DeepSpeed's default for a `path` the file leaves out."""
        self.overrides[key] = value
        if left_out:
            self.origins[key] = f"{path} (left out: {json.dumps(value)})"
        else:
            self.origins[key] = _as_written(path, value if written is None else written)

    def report(self) -> str:
        """The lines the trainer prints once at start."""
        lines = [f"jaxzero: {self.source}: {len(self.overrides)} settings read"]
        lines += [f"  {k}={v!r}" for k, v in self.overrides.items()]
        if self.ignored:
            lines.append("jaxzero: DeepSpeed keys with no meaning in jaxzero (not applied):")
            lines += [f"  {line}" for line in self.ignored]
        lines += [f"jaxzero: note: {n}" for n in self.notes]
        return "\n".join(lines)


def load(path: str | Path) -> dict[str, Any]:
    """The JSON object in `path`; ConfigError naming the file (and the line and column of a syntax
    error) when it is missing, unreadable or not a JSON object."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"--deepspeed={path}: no such file.")
    try:
        tree = json.loads(p.read_text())
    except UnicodeDecodeError as e:
        raise ConfigError(f"--deepspeed={path} is not a UTF-8 text file: {e}") from e
    except json.JSONDecodeError as e:
        raise ConfigError(
            f"--deepspeed={path} is not valid JSON: {e.msg} at line {e.lineno}, column {e.colno} "
            "(DeepSpeed's config is strict JSON: commas between entries, none after the last)."
        ) from e
    if not isinstance(tree, dict):
        raise ConfigError(
            f"--deepspeed={path} holds a JSON {type(tree).__name__}, not an object of settings."
        )
    return tree


def _as_written(path: str, value: Any) -> str:
    """`path=value` with the value as JSON writes it (true, "cpu", [0.9, 0.95]): the file's own words."""
    return f"{path}={json.dumps(value)}"


class _Reader:
    """Typed access to one DeepSpeed config, each error naming the file and the key path."""

    def __init__(self, source: str) -> None:
        self.source = source

    def error(self, path: str, message: str) -> ConfigError:
        return ConfigError(f"{self.source}: {path}: {message}")

    def section(self, tree: Mapping[str, Any], key: str, path: str, known: set[str]) -> dict[str, Any] | None:
        """The dict at `tree[key]` (None if absent), its keys checked against `known`."""
        if key not in tree:
            return None
        value = tree[key]
        if not isinstance(value, dict):
            raise self.error(path, f"{value!r} must be an object {{...}}.")
        self.check_keys(value, path, known)
        return value

    def check_keys(self, tree: Mapping[str, Any], path: str, known: set[str]) -> None:
        for k in tree:
            if k not in known:
                close = difflib.get_close_matches(k, sorted(known), n=1, cutoff=0.6)
                hint = f" Did you mean {close[0]!r}?" if close else ""
                where = f"{path}.{k}" if path else k
                raise self.error(
                    where, f"not a DeepSpeed key jaxzero knows.{hint} Known here: {', '.join(sorted(known))}."
                )

    def get(self, tree: Mapping[str, Any] | None, key: str, path: str, kind: type | tuple[type, ...]) -> Any:
        """`tree[key]` checked to be of `kind` (int accepts whole floats like 5e8; float accepts ints);
        None when absent or "auto"."""
        if tree is None or key not in tree or tree[key] == AUTO:
            return None
        value = tree[key]
        kinds = kind if isinstance(kind, tuple) else (kind,)
        if int in kinds and isinstance(value, float) and value.is_integer():
            value = int(value)
        if float in kinds and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if isinstance(value, bool) and bool not in kinds:
            ok = False
        else:
            ok = isinstance(value, kinds)
        if not ok:
            names = " or ".join(
                {
                    int: "an integer",
                    float: "a number",
                    bool: "true or false",
                    str: "a string",
                    list: "a list",
                }[k]
                for k in kinds
            )
            raise self.error(path, f'{value!r} must be {names} (or "auto").')
        return value

    def positive(self, tree: Mapping[str, Any] | None, key: str, path: str) -> int | None:
        value = self.get(tree, key, path, int)
        if value is not None and value < 1:
            raise self.error(path, f"{value} must be >= 1.")
        return value


def translate(ds: Mapping[str, Any], base: TrainConfig, source: str = "ds_config.json") -> Translation:
    """jaxzero's reading of the DeepSpeed config `ds` (a parsed JSON object; module docstring).

    `base` is the config the file applies on top of (defaults, preset, the command line's model): it
    gives the model's unit count for `offload_optimizer.ratio` and the values jaxzero keeps where the
    file says "auto" or is silent. Raises ConfigError for unknown keys, wrong types, a batch triple
    that breaks DeepSpeed's rule, and features jaxzero does not run."""
    r = _Reader(source)
    out = Translation(source)
    r.check_keys(ds, "", _TOP_KEYS)
    _batch(ds, r, out)
    _precision(ds, r, out)
    _optimizer(ds, base, r, out)
    _scheduler(ds, base, r, out)
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
    for key, why in _IGNORED_TOP.items():
        if key in ds:
            out.ignored.append(f"{key}: {why}")
    for key, what in _REFUSED_WHEN_ENABLED.items():
        section = ds.get(key)
        if isinstance(section, dict) and section.get("enabled") is True:
            raise r.error(
                f"{key}.enabled", f"jaxzero does not run {what}. Remove the section or set enabled false."
            )
        if key in ds:
            out.ignored.append(f"{key}: not enabled")
    for key, what in _REFUSED_WHEN_PRESENT.items():
        if key in ds and ds[key]:
            raise r.error(key, f"jaxzero does not run {what}. Remove the section.")
    return out


def _batch(ds: Mapping[str, Any], r: _Reader, out: Translation) -> None:
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
        out.set(key, value or 0, _BATCH_KEYS[key], value or 0)


def _precision(ds: Mapping[str, Any], r: _Reader, out: Translation) -> None:
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


def _optimizer(ds: Mapping[str, Any], base: TrainConfig, r: _Reader, out: Translation) -> None:
    opt = r.section(ds, "optimizer", "optimizer", {"type", "params", "legacy_fusion"})
    if opt is None:
        return
    kind = r.get(opt, "type", "optimizer.type", str)
    if kind is None or kind.lower() not in _OPTIMIZERS:
        raise r.error(
            "optimizer.type",
            f"{opt.get('type')!r}: jaxzero runs {', '.join(_OPTIMIZERS.values())} (optax's); "
            "others (OneBitAdam, Lamb, ...) are not offered.",
        )
    kind = kind.lower()
    params = r.section(opt, "params", "optimizer.params", _OPT_PARAMS[kind]) or {}
    p = lambda key, k=float: r.get(params, key, f"optimizer.params.{key}", k)  # noqa: E731
    o = out.overrides
    if "params" not in opt:
        out.notes.append("optimizer has no params: torch's defaults for its type apply (lr 1e-3).")

    # Absent params take the defaults DeepSpeed's (torch's) optimizers have; "auto" keeps jaxzero's.
    def param(key: str, jaxzero_key: str, default: Any) -> None:  # the file's value, torch's if left out
        value = p(key)
        if value is not None or key not in params:
            written = params.get(key)
            out.set(
                jaxzero_key,
                default if value is None else value,
                f"optimizer.params.{key}",
                written,
                value is None,
            )

    param("lr", "optimizer.lr", 1e-3)
    if kind in ("adam", "adamw"):
        w_mode = p("adam_w_mode", bool)
        decay = p("weight_decay")
        if kind == "adam" and w_mode is False:
            if decay:
                raise r.error(
                    "optimizer.params.weight_decay",
                    f"{decay} with adam_w_mode false is L2 regularisation added to the gradient; jaxzero "
                    "decays weights decoupled (AdamW) only. Set adam_w_mode true or weight_decay 0.",
                )
            out.set("optimizer.name", "adam", "optimizer.params.adam_w_mode", False)
            out.set("optimizer.weight_decay", 0.0, "optimizer.params.adam_w_mode", False)
        else:  # DeepSpeed's Adam is AdamW unless adam_w_mode is false
            out.set("optimizer.name", "adamw", "optimizer.type", opt["type"])
        if p("bias_correction", bool) is False:
            raise r.error(
                "optimizer.params.bias_correction", "false: jaxzero's Adam always corrects the moments' bias."
            )
        if p("amsgrad", bool):
            raise r.error("optimizer.params.amsgrad", "true: AMSGrad is not offered; set it false.")
        if "torch_adam" in params:
            out.ignored.append("optimizer.params.torch_adam: the update is jaxzero's (fused kernel or optax)")
        _betas(params, r, out, (0.9, 0.999))
        param("eps", "optimizer.eps", 1e-8)
    elif kind == "lion":
        out.set("optimizer.name", "lion", "optimizer.type", opt["type"])
        _betas(params, r, out, (0.9, 0.99))
    else:
        out.set("optimizer.name", "sgd", "optimizer.type", opt["type"])
        param("momentum", "optimizer.momentum", 0.0)
        dampening = p("dampening")
        if dampening:
            raise r.error(
                "optimizer.params.dampening", f"{dampening}: SGD dampening is not offered; set it 0."
            )
        if p("nesterov", bool):
            raise r.error(
                "optimizer.params.nesterov", "true: Nesterov momentum is not offered; set it false."
            )
    if o.get("optimizer.name") != "adam":
        param("weight_decay", "optimizer.weight_decay", 0.0)
    if (
        o.get("optimizer.weight_decay", base.optimizer.weight_decay)
        and not base.optimizer.decay_norms_biases_embeddings
    ):
        out.notes.append(
            "weight decay applies to matrices, not to norms, biases or embeddings (as the Hugging Face "
            "Trainer groups them); --optimizer.decay_norms_biases_embeddings=true decays every parameter."
        )
    if "legacy_fusion" in opt:
        out.ignored.append("optimizer.legacy_fusion: the update is jaxzero's (fused kernel or optax)")


def _betas(params: Mapping[str, Any], r: _Reader, out: Translation, default: tuple[float, float]) -> None:
    betas = r.get(params, "betas", "optimizer.params.betas", list)
    if betas is None and "betas" in params:  # "auto"
        return
    left_out = betas is None
    betas = list(default) if betas is None else betas
    if len(betas) != 2 or not all(isinstance(b, int | float) and not isinstance(b, bool) for b in betas):
        raise r.error("optimizer.params.betas", f"{betas!r} must be a list of two numbers.")
    for key, beta in (("optimizer.b1", betas[0]), ("optimizer.b2", betas[1])):
        out.set(key, float(beta), "optimizer.params.betas", betas, left_out)


def _scheduler(ds: Mapping[str, Any], base: TrainConfig, r: _Reader, out: Translation) -> None:
    sched = r.section(ds, "scheduler", "scheduler", {"type", "params"})
    if sched is None:
        if "optimizer" in ds:
            out.notes.append(
                f"no scheduler: jaxzero's optimizer.schedule={base.optimizer.schedule!r} with "
                f"warmup_steps={base.optimizer.warmup_steps} applies (DeepSpeed alone keeps lr constant; "
                "--optimizer.schedule=constant --optimizer.warmup_steps=0 for that)."
            )
        return
    kind = r.get(sched, "type", "scheduler.type", str)
    if kind not in _SCHEDULERS:
        raise r.error(
            "scheduler.type",
            f"{sched.get('type')!r}: jaxzero runs {', '.join(_SCHEDULERS)}; OneCycle and LRRangeTest are "
            "not offered.",
        )
    params = r.section(sched, "params", "scheduler.params", _SCHEDULERS[kind]) or {}
    p = lambda key, k=float: r.get(params, key, f"scheduler.params.{key}", k)  # noqa: E731
    o = out.overrides

    def param(key: str, jaxzero_key: str, value: Any) -> None:  # `value`: from the file, or its default
        out.set(jaxzero_key, value, f"scheduler.params.{key}", params.get(key), key not in params)

    steps = p("warmup_num_steps", int)
    if steps is not None or "warmup_num_steps" not in params:
        if steps is not None and steps < 1:
            raise r.error("scheduler.params.warmup_num_steps", f"{steps} must be >= 1.")
        warmup = max(2, 1000 if steps is None else steps)  # at least 2, as DeepSpeed's
        param("warmup_num_steps", "optimizer.warmup_steps", warmup)
    warmup_type = p("warmup_type", str)
    if warmup_type is not None and warmup_type not in ("log", "linear"):
        raise r.error("scheduler.params.warmup_type", f'{warmup_type!r} must be "log" or "linear".')
    if warmup_type is not None or "warmup_type" not in params:
        param("warmup_type", "optimizer.warmup_type", warmup_type or "log")
    if kind == "WarmupCosineLR":
        out.set("optimizer.schedule", "cosine", "scheduler.type", kind)
        start = p("warmup_min_ratio")
        if start is not None or "warmup_min_ratio" not in params:
            param("warmup_min_ratio", "optimizer.warmup_start_ratio", 0.0 if start is None else start)
        floor = p("cos_min_ratio")
        if floor is not None or "cos_min_ratio" not in params:
            param("cos_min_ratio", "optimizer.min_lr_ratio", 1e-4 if floor is None else floor)
    else:
        out.set("optimizer.schedule", "constant" if kind == "WarmupLR" else "linear", "scheduler.type", kind)
        if kind == "WarmupDecayLR":
            out.set("optimizer.min_lr_ratio", 0.0, "scheduler.type", kind)  # decays to 0 at total_num_steps
        top = p("warmup_max_lr")
        if top is not None:
            param("warmup_max_lr", "optimizer.lr", top)
        elif "warmup_max_lr" not in params and kind == "WarmupDecayLR":
            # WarmupDecayLR's default; WarmupLR's is the optimizer's lr
            param("warmup_max_lr", "optimizer.lr", 1e-3)
        low = p("warmup_min_lr")
        peak = o.get("optimizer.lr", base.optimizer.lr)
        if low is not None:
            if not 0 <= low <= peak or peak <= 0:
                raise r.error(
                    "scheduler.params.warmup_min_lr", f"{low} must be in [0, warmup_max_lr={peak}]."
                )
            param("warmup_min_lr", "optimizer.warmup_start_ratio", low / peak)
        elif "warmup_min_lr" not in params:
            param("warmup_min_lr", "optimizer.warmup_start_ratio", 0.0)
    if kind != "WarmupLR":
        total = p("total_num_steps", int)
        if total is None and "total_num_steps" not in params:
            raise r.error("scheduler.params.total_num_steps", f'{kind} needs total_num_steps (or "auto").')
        if total is not None and total < 1:
            raise r.error(
                "scheduler.params.total_num_steps", f'{total} must be >= 1 ("auto": the run\'s steps).'
            )
        if total is not None:  # "auto": the run's steps, as the HF Trainer fills it
            param("total_num_steps", "optimizer.decay_steps", total)
    if "last_batch_iteration" in params:
        out.ignored.append("scheduler.params.last_batch_iteration: a resumed run continues its own schedule")
    out.notes.append(
        f"{kind}: DeepSpeed's formula at each count of updates applied"
        + (
            " (its cosine phase counted from warmup_num_steps, DeepSpeed's from one before)"
            if kind == "WarmupCosineLR"
            else ""
        )
        + "; DeepSpeed's engine applies each rate one update later (its first two use the starting rate)."
    )


def _offload_device(
    section: Mapping[str, Any], path: str, r: _Reader, out: Translation
) -> tuple[str, str | None]:
    device = r.get(section, "device", f"{path}.device", str)
    if device not in ("cpu", "nvme", "none"):
        raise r.error(f"{path}.device", f'{section.get("device")!r} must be "cpu", "nvme" or "none".')
    nvme = r.get(section, "nvme_path", f"{path}.nvme_path", str)
    for k in sorted(set(section) & set(_OFFLOAD_IGNORED)):
        out.ignored.append(f"{path}.{k}: {_OFFLOAD_IGNORED[k]}")
    return device, nvme


def _zero(ds: Mapping[str, Any], base: TrainConfig, r: _Reader, out: Translation) -> None:
    o = out.overrides
    if isinstance(ds.get("zero_optimization"), bool):  # DeepSpeed's early form: true is stage 1
        flag = ds["zero_optimization"]
        out.set("parallel.zero_stage", int(flag), "zero_optimization", flag)
        out.set("offload.params", "none", "zero_optimization", flag)
        out.set("offload.optimizer", "none", "zero_optimization", flag)
        return
    zero = r.section(ds, "zero_optimization", "zero_optimization", _ZERO_KEYS)
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
        {"device", "nvme_path", "ratio", *_OFFLOAD_IGNORED},
    )
    param_section = r.section(
        zero, "offload_param", "zero_optimization.offload_param", {"device", "nvme_path", *_OFFLOAD_IGNORED}
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
            if keep:
                out.set(
                    "offload.device_state_units", keep, "zero_optimization.offload_optimizer.ratio", ratio
                )
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
            return _as_written(f"zero_optimization.{name}.device", device)
        if deprecated in zero:
            return _as_written(f"zero_optimization.{deprecated}", zero[deprecated])
        return f"zero_optimization.{name} (left out)"

    o["offload.optimizer"] = {"cpu": "cpu", "nvme": "disk", "none": "none"}[optim_device]
    out.origins["offload.optimizer"] = origin(optim_section, "offload_optimizer", "cpu_offload", optim_device)
    o["offload.params"] = "none" if param_device == "none" else "cpu"
    out.origins["offload.params"] = origin(param_section, "offload_param", "cpu_offload_params", param_device)
    if optim_device == "nvme" and nvme_path:
        out.set("offload.disk_path", nvme_path, "zero_optimization.offload_optimizer.nvme_path")
    for key, why in _ZERO_IGNORED.items():
        if key in zero:
            out.ignored.append(f"zero_optimization.{key}: {why}")


def _parallel_features(ds: Mapping[str, Any], r: _Reader, out: Translation) -> None:
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


# ---------------------------------------------------------------------------------------------------
# Refusals of the file's values, in the file's words
# ---------------------------------------------------------------------------------------------------


def check(t: Translation, cfg: TrainConfig, num_devices: int | None = None) -> None:
    """Raise ConfigError in the words of the DeepSpeed file (its path, its keys and values as it writes
    them, DeepSpeed's arithmetic) where `cfg`, the config the file's `t` was applied to, holds a value
    the file set that jaxzero refuses: DeepSpeed's batch rule (with `num_devices`, for that many GPUs),
    the ranges and combinations `jaxzero.config.validate` checks, and disk offload's fused update. A
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
    keys = list(_BATCH_KEYS)
    batch, micro, accum = (c.value(k) for k in keys)
    term = {k: _BATCH_KEYS[k] if c.ours(k) else k for k in keys}  # the file's names, else jaxzero's
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
    if dsu and optimizer == "none":
        c.refuse(
            ["offload.device_state_units", "offload.optimizer"],
            f'{c.name("offload.device_state_units")} applies with device "cpu" only, but {opt}.',
        )
    if dsu and c.value("offload.update") == "delayed":
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
