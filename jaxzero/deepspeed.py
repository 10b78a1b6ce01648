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
...) are refused. Unknown keys and values of the wrong type are errors naming the key path.
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from jaxzero.config import ConfigError, TrainConfig

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
    DeepSpeed's own meaning, or a DeepSpeed default differs from jaxzero's."""

    source: str
    overrides: dict[str, Any] = field(default_factory=dict)
    ignored: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

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
        out.overrides["optimizer.grad_clip"] = clip
    elif "gradient_clipping" not in ds:
        out.notes.append(
            f"no gradient_clipping: jaxzero's optimizer.grad_clip={base.optimizer.grad_clip} applies "
            '(DeepSpeed\'s default is none; set "gradient_clipping": 0 for that).'
        )
    every = r.positive(ds, "steps_per_print", "steps_per_print")
    if every is not None:
        out.overrides["logging.log_every"] = every
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
            out.overrides["offload.activations"] = "cpu"
        for k in sorted(set(ckpt) - {"cpu_checkpointing"}):
            out.ignored.append(
                f"activation_checkpointing.{k}: every block's input is the one checkpoint; the backward "
                "pass recomputes the block from it"
            )
    tb = r.section(ds, "tensorboard", "tensorboard", {"enabled", "output_path", "job_name"})
    if tb is not None:
        enabled = r.get(tb, "enabled", "tensorboard.enabled", bool)
        if enabled is not None:
            out.overrides["logging.tensorboard"] = enabled
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
                "given without train_batch_size or train_micro_batch_size_per_gpu; DeepSpeed needs one of "
                "them too (train_batch_size = micro x accumulation x GPUs).",
            )
        return
    if batch is not None and micro is not None and accum is None:
        accum = 0  # derived: batch / (micro x devices)
    elif accum is None:
        accum = 1  # DeepSpeed's default when only one of batch and micro is given
    out.overrides["data.batch_size"] = batch if batch is not None else 0
    out.overrides["data.grad_accum"] = accum
    out.overrides["data.micro_batch_size"] = micro if micro is not None else 0


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
        raise r.error("fp16.enabled", f"fp16 and {bf16_key} are both enabled; enable one of them.")
    if half:
        out.overrides["model.compute_dtype"] = "float16"
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
                out.overrides[f"fp16.{key}"] = value
        if r.get(fp16, "fp16_master_weights_and_grads", "fp16.fp16_master_weights_and_grads", bool):
            raise r.error(
                "fp16.fp16_master_weights_and_grads", "jaxzero's masters are float32; set it false."
            )
        if "auto_cast" in fp16:
            out.ignored.append("fp16.auto_cast: the model computes in model.compute_dtype throughout")
    elif brain:
        out.overrides["model.compute_dtype"] = "bfloat16"
    elif half is False or brain is False:  # a precision section, switched off: DeepSpeed trains in float32
        out.overrides["model.compute_dtype"] = "float32"
    elif fp16 is None and bf16 is None:
        out.notes.append(
            "no fp16 or bf16 section: jaxzero's model.compute_dtype applies (bfloat16 by default; "
            "DeepSpeed alone would compute in float32)."
        )
    if bf16 is not None:
        if brain and r.get(bf16, "bf16_optimizer_states", f"{bf16_key}.bf16_optimizer_states", bool):
            out.overrides["optimizer.state_dtype"] = "bfloat16"
        if r.get(bf16, "bf16_master_weights_and_grads", f"{bf16_key}.bf16_master_weights_and_grads", bool):
            raise r.error(
                f"{bf16_key}.bf16_master_weights_and_grads", "jaxzero's masters are float32; set it false."
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
    lr = p("lr")
    if lr is not None or "lr" not in params:
        o["optimizer.lr"] = 1e-3 if lr is None else lr
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
            o["optimizer.name"] = "adam"
            o["optimizer.weight_decay"] = 0.0
        else:  # DeepSpeed's Adam is AdamW unless adam_w_mode is false
            o["optimizer.name"] = "adamw"
        if p("bias_correction", bool) is False:
            raise r.error(
                "optimizer.params.bias_correction", "jaxzero's Adam always corrects the moments' bias."
            )
        if p("amsgrad", bool):
            raise r.error("optimizer.params.amsgrad", "AMSGrad is not offered; set it false.")
        if "torch_adam" in params:
            out.ignored.append("optimizer.params.torch_adam: the update is jaxzero's (fused kernel or optax)")
        _betas(params, r, o, (0.9, 0.999))
        eps = p("eps")
        if eps is not None or "eps" not in params:
            o["optimizer.eps"] = 1e-8 if eps is None else eps
    elif kind == "lion":
        o["optimizer.name"] = "lion"
        _betas(params, r, o, (0.9, 0.99))
    else:
        o["optimizer.name"] = "sgd"
        momentum = p("momentum")
        if momentum is not None or "momentum" not in params:
            o["optimizer.momentum"] = 0.0 if momentum is None else momentum
        if p("dampening"):
            raise r.error("optimizer.params.dampening", "SGD dampening is not offered; set it 0.")
        if p("nesterov", bool):
            raise r.error("optimizer.params.nesterov", "Nesterov momentum is not offered; set it false.")
    if o.get("optimizer.name") != "adam":
        decay = p("weight_decay")
        if decay is not None or "weight_decay" not in params:
            o["optimizer.weight_decay"] = 0.0 if decay is None else decay
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


def _betas(params: Mapping[str, Any], r: _Reader, o: dict[str, Any], default: tuple[float, float]) -> None:
    betas = r.get(params, "betas", "optimizer.params.betas", list)
    if betas is None and "betas" in params:  # "auto"
        return
    betas = default if betas is None else betas
    if len(betas) != 2 or not all(isinstance(b, int | float) and not isinstance(b, bool) for b in betas):
        raise r.error("optimizer.params.betas", f"{betas!r} must be a list of two numbers.")
    o["optimizer.b1"], o["optimizer.b2"] = float(betas[0]), float(betas[1])


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
    steps = p("warmup_num_steps", int)
    if steps is not None or "warmup_num_steps" not in params:
        if steps is not None and steps < 1:
            raise r.error("scheduler.params.warmup_num_steps", f"{steps} must be >= 1.")
        o["optimizer.warmup_steps"] = max(2, 1000 if steps is None else steps)  # at least 2, as DeepSpeed's
    warmup_type = p("warmup_type", str)
    if warmup_type is not None and warmup_type not in ("log", "linear"):
        raise r.error("scheduler.params.warmup_type", f'{warmup_type!r} must be "log" or "linear".')
    if warmup_type is not None or "warmup_type" not in params:
        o["optimizer.warmup_type"] = warmup_type or "log"
    if kind == "WarmupCosineLR":
        o["optimizer.schedule"] = "cosine"
        start = p("warmup_min_ratio")
        if start is not None or "warmup_min_ratio" not in params:
            o["optimizer.warmup_start_ratio"] = 0.0 if start is None else start
        floor = p("cos_min_ratio")
        if floor is not None or "cos_min_ratio" not in params:
            o["optimizer.min_lr_ratio"] = 1e-4 if floor is None else floor
    else:
        o["optimizer.schedule"] = "constant" if kind == "WarmupLR" else "linear"
        if kind == "WarmupDecayLR":
            o["optimizer.min_lr_ratio"] = 0.0  # decays to 0 at total_num_steps
        top = p("warmup_max_lr")
        if top is not None:
            o["optimizer.lr"] = top
        elif "warmup_max_lr" not in params and kind == "WarmupDecayLR":
            o["optimizer.lr"] = 1e-3  # WarmupDecayLR's default; WarmupLR's is the optimizer's lr
        low = p("warmup_min_lr")
        peak = o.get("optimizer.lr", base.optimizer.lr)
        if low is not None:
            if not 0 <= low <= peak or peak <= 0:
                raise r.error(
                    "scheduler.params.warmup_min_lr", f"{low} must be in [0, warmup_max_lr={peak}]."
                )
            o["optimizer.warmup_start_ratio"] = low / peak
        elif "warmup_min_lr" not in params:
            o["optimizer.warmup_start_ratio"] = 0.0
    if kind != "WarmupLR":
        total = p("total_num_steps", int)
        if total is None and "total_num_steps" not in params:
            raise r.error("scheduler.params.total_num_steps", f'{kind} needs total_num_steps (or "auto").')
        if total is not None:
            o["optimizer.decay_steps"] = total  # "auto": the run's steps, as the HF Trainer fills it
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
        o["parallel.zero_stage"] = int(ds["zero_optimization"])
        o["offload.params"], o["offload.optimizer"] = "none", "none"
        return
    zero = r.section(ds, "zero_optimization", "zero_optimization", _ZERO_KEYS)
    if zero is None:
        if "zero_optimization" not in ds:
            out.notes.append(
                "no zero_optimization: ZeRO stage 0, nothing offloaded, as in DeepSpeed "
                "(--offload.params=auto --offload.optimizer=auto lets jaxzero's planner choose)."
            )
            o["parallel.zero_stage"], o["offload.params"], o["offload.optimizer"] = 0, "none", "none"
        return
    stage = r.get(zero, "stage", "zero_optimization.stage", int)
    if stage is not None and stage not in (0, 1, 2, 3):
        raise r.error("zero_optimization.stage", f"{stage} must be 0, 1, 2 or 3.")
    if stage is not None:
        o["parallel.zero_stage"] = stage
    for key in ("zero_quantized_weights", "zero_quantized_gradients", "zero_quantized_nontrainable_weights"):
        if r.get(zero, key, f"zero_optimization.{key}", bool):
            raise r.error(
                f"zero_optimization.{key}",
                "ZeRO++ quantization changes the numerics; jaxzero does not run it.",
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
                raise r.error("zero_optimization.offload_optimizer.ratio", 'applies with device "cpu" only.')
            units = base.model.num_layers + 2
            keep = round((1 - ratio) * units)
            if keep:
                o["offload.device_state_units"] = keep
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
            "parameter offload without offload_optimizer: jaxzero streams weights updated from host-resident "
            'masters, so it needs offload_optimizer.device "cpu" or "nvme" too. Add it, or remove '
            "offload_param.",
        )
    o["offload.optimizer"] = {"cpu": "cpu", "nvme": "disk", "none": "none"}[optim_device]
    o["offload.params"] = "none" if param_device == "none" else "cpu"
    if optim_device == "nvme" and nvme_path:
        o["offload.disk_path"] = nvme_path
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
