"""Configuration: one frozen dataclass per concern, composed into `TrainConfig`, its validation, and
the error types.

This module is a leaf: it imports nothing of jaxzero, so every other module may import it. The
dataclass defaults are the built-in default run (a tiny Llama on bundled bytes). How a config is built
from presets and `--section.key=value` overrides is `jaxzero.overrides`; every cross-field rule is
checked by `validate` before anything is compiled or allocated.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from typing import Any, Literal


class ConfigError(ValueError):
    """A config value or combination is invalid; the message says which and how to fix it."""


class CheckpointError(ConfigError):
    """A checkpoint cannot be used; the message names it and says why. A ConfigError, so the CLI
    reports it as bad input (exit status 2)."""


@dataclass(frozen=True)
class ModelConfig:
    """Transformer shape and numerics. Masters are always float32; `compute_dtype` is the matmul dtype."""

    name: str = "llama-tiny"  # a named size (sets every other model.* key) or hf:DIR, a HF checkpoint
    family: Literal["llama", "gpt2"] = "llama"  # the architecture
    vocab_size: int = 256  # rows of the token embedding; every token id must be below it
    hidden_size: int = 128  # width of the residual stream
    num_layers: int = 4  # transformer blocks
    num_heads: int = 4  # attention (query) heads
    num_kv_heads: int = 2  # grouped-query attention; == num_heads is plain multi-head attention
    intermediate_size: int = 384  # MLP width (SwiGLU for llama, GELU for gpt2)
    max_seq_len: int = 1024  # longest sequence (gpt2: rows of the position table)
    tie_embeddings: bool = False  # the output head reuses the token embedding (gpt2 always does)
    rope_theta: float = 10000.0  # rotary embedding base (llama)
    # Rotary frequency scaling (transformers' rope_type): default (none), linear (positions / factor),
    # or llama3 (Llama 3.1+: low frequencies / factor, high kept, the band between interpolated).
    rope_type: Literal["default", "linear", "llama3"] = "default"
    rope_factor: float = 1.0  # linear and llama3
    rope_low_freq_factor: float = 1.0  # llama3
    rope_high_freq_factor: float = 4.0  # llama3
    rope_original_max_len: int = 8192  # llama3: the context length pretraining used
    attention_bias: bool = False  # biases on the q, k and v projections (Qwen2)
    # Sliding-window attention's window (Mistral v0.1, some Qwen2): 0 is none. Attention is computed
    # in full, which equals the windowed attention only while data.seq_len <= the window.
    sliding_window: int = 0
    # The transformers model_type an export writes: "" is the family's own (llama, gpt2); Llama-family
    # checkpoints imported as qwen2 or mistral keep theirs.
    hf_model_type: Literal["", "llama", "qwen2", "mistral", "gpt2"] = ""
    norm_eps: float = 1e-5  # epsilon of RMSNorm / LayerNorm
    init_std: float = 0.02  # standard deviation of the random init of matrices
    # matmul and activation dtype (masters are float32); float16 adds dynamic loss scaling
    compute_dtype: Literal["bfloat16", "float32", "float16"] = "bfloat16"
    attention_impl: Literal["auto", "xla", "cudnn"] = "auto"  # auto: cuDNN on GPU when it applies, else XLA
    init_from: str = ""  # a Hugging Face safetensors directory to start from (set by model.name=hf:DIR)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


@dataclass(frozen=True)
class DataConfig:
    """Where tokens come from and how they are batched.

    `batch_size` is the global number of sequences per optimizer step, over all devices and all
    `grad_accum` micro-batches; each sequence is `seq_len` inputs plus one shifted target. As in
    DeepSpeed, batch_size = micro_batch_size x grad_accum x devices of the data axis: one of the three
    may be 0 and is derived from the others when the devices are known (`resolve_batch`).
    """

    # builtin: bytes of Python's standard library; tokens: nanoGPT .bin files; synthetic: random ids
    source: Literal["builtin", "tokens", "synthetic"] = "builtin"
    path: str = ""  # source=tokens: directory holding train.bin (and optionally val.bin)
    token_dtype: Literal["uint16", "uint32"] = "uint16"  # source=tokens: the dtype the .bin files hold
    seq_len: int = 128  # tokens per sequence (each sequence also reads one shifted target)
    batch_size: int = 16  # sequences per optimizer step, over all devices and micro-batches; 0: derived
    grad_accum: int = 1  # micro-batches per step (gradients summed before the update); 0: derived
    # Sequences per device per micro-batch (DeepSpeed's train_micro_batch_size_per_gpu); 0: derived
    # from batch_size / (grad_accum x devices), the default.
    micro_batch_size: int = 0
    val_fraction: float = 0.05  # held-out tail when there is no val.bin
    # Check every token id against model.vocab_size before training (a vectorised pass over the files);
    # false: check a sample of ~4M tokens spread over each file.
    check_tokens: bool = True


@dataclass(frozen=True)
class OptimizerConfig:
    """AdamW with warmup then decay, weight decay masked off norms/biases/embeddings, global-norm clipping."""

    name: Literal["adamw", "adam", "lion", "sgd"] = "adamw"  # the update rule (optax's)
    lr: float = 3e-3  # peak learning rate, reached after warmup_steps
    warmup_steps: int = 20  # warmup from lr x warmup_start_ratio to lr
    warmup_type: Literal["linear", "log"] = "linear"  # log: DeepSpeed's, log(step+1)/log(warmup_steps)
    warmup_start_ratio: float = 0.0  # the first step's lr / lr (DeepSpeed's warmup_min_lr / warmup_max_lr)
    schedule: Literal["cosine", "linear", "constant"] = "cosine"  # decay after warmup
    min_lr_ratio: float = 0.1  # final lr = lr * min_lr_ratio
    # Steps the schedule spans, warmup included (it holds its final rate after them); 0: the run's
    # steps. A resumed run that extends `steps` keeps the length it started with unless this is set.
    decay_steps: int = 0
    b1: float = 0.9  # first-moment decay (adam, adamw, lion)
    b2: float = 0.95  # second-moment decay (adam, adamw; lion's update interpolation)
    eps: float = 1e-8  # added to the second moment's root (adam, adamw)
    momentum: float = 0.9  # sgd only; 0: plain sgd
    weight_decay: float = 0.1  # decoupled decay of matrices (adamw, lion, sgd)
    decay_norms_biases_embeddings: bool = False  # also decay norms, biases and embeddings
    grad_clip: float = 1.0  # global-norm clip; 0 disables
    state_dtype: Literal["float32", "bfloat16"] = "float32"  # storage of moments (bf16: half the bytes)


@dataclass(frozen=True)
class FP16Config:
    """Dynamic loss scaling for `model.compute_dtype=float16`, in DeepSpeed's terms (its `fp16` section)."""

    initial_scale_power: int = 16  # the scale starts at 2**initial_scale_power
    loss_scale_window: int = 1000  # stable steps before the scale doubles
    hysteresis: int = 2  # overflows tolerated before the scale halves
    consecutive_hysteresis: bool = False  # refill the tolerance on every stable step
    min_loss_scale: float = 1.0  # the scale never drops below this; overflowing at it stops the run


@dataclass(frozen=True)
class OffloadConfig:
    """Where state lives, in DeepSpeed's vocabulary: `none` keeps it on the accelerator, `cpu` in host RAM,
    `auto` lets the planner (`jaxzero.plan.search`) choose for this model on this machine.

    The planner decides only what is left to it: `params` and `optimizer` when `auto`, and with them
    `resident_blocks`, `device_state_units` (when 0) and `two_pass_units` (when -1: it may turn it to 0
    where that alone makes a placement fit). Explicit values keep their meaning; a run whose explicit
    settings do not fit is refused by the memory check."""

    # compute weights: on the accelerator (none), streamed from host RAM (cpu), or the planner's choice
    params: Literal["auto", "none", "cpu"] = "auto"
    # fp32 masters and optimizer state: accelerator (none), host RAM (cpu), local disk (disk: read into
    # host RAM for each update and written back, ZeRO-Infinity's NVMe tier), or the planner's choice.
    # Under cpu and disk, units are updated on the CPU.
    optimizer: Literal["auto", "none", "cpu", "disk"] = "auto"
    resident_blocks: int = 0  # with params=cpu: keep the first K blocks on the accelerator, stream the rest
    # With optimizer=cpu: the first K units in forward order (embedding, block 0, 1, ...) keep their
    # fp32 masters and optimizer state in accelerator memory and are updated there, so the next
    # forward pass never waits for the host on them; their weights are on the accelerator too.
    # 0: every unit's state in host RAM.
    device_state_units: int = 0
    # Where the backward pass's rematerialisation checkpoints (each block's input) wait between the
    # forward and the backward pass: "none" in accelerator memory; "cpu" in pinned host memory,
    # copied out as the forward pass makes them and back ahead of the backward pass that needs them
    # (overlapped like the weights), when accelerator memory is what binds (long sequences).
    activations: Literal["none", "cpu"] = "none"
    # How the host update meets the accelerator: "overlapped" (exact: each unit updates once the
    # gradient norm is known, in the order the next forward pass needs them, which waits per unit) or
    # "delayed" (ZeRO-Offload's DPU: the forward and backward run on weights one update old, so the
    # host update of step t overlaps step t+1 completely).
    update: Literal["overlapped", "delayed"] = "overlapped"
    # With clipping: update this many units speculatively during the backward pass (exact: kept only
    # if the norm shows no clipping applies, else recomputed). Costs a spare copy of their host state.
    # 0: off (the default).
    speculative_units: int = 0
    # With clipping: update this many units (in forward order) in two passes: the compute-dtype
    # weights as soon as the norm is known (the next forward pass waits only for those), the masters
    # and optimizer state during the next backward pass, when the host is otherwise idle. The same
    # bits as one pass; more host memory traffic in all, less of it before the next forward pass.
    # -1: adaptive (as many as the host finishes within the next backward pass); 0: off. Where it
    # applies, and what -1 means for a model, is resolved once by `jaxzero.plan`.
    two_pass_units: int = -1
    # The fused host kernels where they cover the optimizer; false: the optax update on XLA:CPU.
    fused_update: bool = True
    # With optimizer=disk: the last K units in forward order whose state is not on the accelerator keep
    # it on disk, the others in host RAM; -1: every such unit. (The planner sets K with auto.)
    disk_units: int = -1
    # With optimizer=disk: the directory the working state goes in (a fresh subdirectory, removed when
    # the run ends); empty: <run_dir>/offload-state. Checkpoints never depend on it.
    disk_path: str = ""
    # Threads of the host update's pool; 0: one per CPU core this process may run on (its affinity:
    # `python -m jaxzero.launch` gives each process its own share) but one, which stays free for the
    # thread that issues the accelerator's work and for the copy engines' driver threads.
    host_threads: int = 0


@dataclass(frozen=True)
class ParallelConfig:
    """How the run spreads over every device of every process: one `data` mesh axis, with DeepSpeed's
    ZeRO stages saying what is sharded over it (the rest is replicated)."""

    # 0: nothing sharded (data parallel); 1: optimizer state; 2: also gradients; 3: also parameters
    # (resident: FSDP). -1: auto, the least replication each mode allows (3 with offload.params=cpu,
    # 2 with offload.optimizer=cpu, 0 otherwise). With one device every stage is the same run.
    zero_stage: int = -1
    # Seconds a process waits for the others (joining, checkpoints, a step's collectives) before it
    # fails with an error, so one dead process never leaves the rest hanging.
    timeout_s: int = 300


@dataclass(frozen=True)
class MachineConfig:
    """The machine the planner (`offload.params` / `offload.optimizer` = auto, `python -m jaxzero.plan`)
    plans for; 0 means: detect it, or the default for the detected device kind (the plan's table says
    which). Read by the planner only, so that a run can be planned for a card or a box you do not have."""

    gpu_gib: float = 0.0  # accelerator memory per device to plan for, GiB
    host_gib: float = 0.0  # host RAM available to the run, GiB
    h2d_gbps: float = 0.0  # host-to-accelerator link, GB/s per direction per device
    d2h_gbps: float = 0.0  # accelerator-to-host link, GB/s per direction per device
    host_gbps: float = 0.0  # host memory bandwidth the host optimizer update reaches, GB/s
    gpu_tflops: float = 0.0  # dense bf16 TFLOP/s one device reaches on the model's step (8N accounting)
    cores: int = 0  # CPU cores of the host update (the figures above are for 16)
    disk_gib: float = 0.0  # free local disk for offload.optimizer=disk's working state, GiB
    disk_gbps: float = 0.0  # what that disk reads and writes, GB/s, reads and writes together


@dataclass(frozen=True)
class CheckpointConfig:
    """Orbax checkpoints in `<run_dir>/checkpoints`: every `every` steps (0: only at the end and on
    preemption), keeping the newest `keep` plus every `keep_every`-th step (0: none)."""

    enabled: bool = True  # save checkpoints (at the end, every `every` steps, and on SIGTERM)
    every: int = 0  # steps between checkpoints; 0: only at the end and on preemption
    keep: int = 3  # newest checkpoints kept
    keep_every: int = 0  # also keep every keep_every-th step's; 0: none
    # Verify each checkpoint's files against checksums written at save before restoring from it.
    verify: bool = True
    # Write in the background while training goes on (a unit the next step updates before the writer
    # has written it is copied into the buffer, or its update waits); false: the step that saves
    # waits until the checkpoint is committed.
    async_save: bool = True
    # Host RAM a save or a restore takes beyond one unit's arrays, whatever the model's size: up to
    # 1 GiB in flight to or from disk, the rest for copies of units training reaches before the writer.
    buffer_gib: float = 2.0


def buffer_bytes(cfg: CheckpointConfig) -> int:
    """`checkpoint.buffer_gib` in bytes: the host RAM a save or a restore takes beyond one unit (read
    by the checkpointer, which keeps to it, and by the memory plan, which counts it)."""
    return int(cfg.buffer_gib * 2**30)


@dataclass(frozen=True)
class LoggingConfig:
    """How often scalars are read back from the device (a host sync) and validation runs."""

    log_every: int = 10  # steps between records in metrics.jsonl (one host sync each)
    eval_every: int = 100  # 0 disables periodic validation; a final validation always runs
    eval_batches: int = 4  # batches of the validation loss
    progress: bool = True  # a one-line progress bar on stderr
    # The placement plan at start: auto: one line when it is obvious (state on the devices, every
    # memory at most half full), the planner's table otherwise; full: always the table.
    plan: Literal["auto", "full"] = "auto"
    peak_tflops: float = 0.0  # accelerator peak for MFU; 0 = look up from the device kind
    # Continuations printed at the end of a run on the built-in corpus (from its last checkpoint), so
    # that a first run shows what the model learned; 0: none.
    samples: int = 2
    # Every record's scalars also as TensorBoard event files in <run_dir>/tensorboard (written by
    # process 0 when the record is, no extra host sync), for `tensorboard --logdir=<run_dir>`.
    tensorboard: bool = True


@dataclass(frozen=True)
class ProfileConfig:
    """A JAX profiler trace of a window of steps in `<run_dir>/profile` (Perfetto, TensorBoard's profile
    plugin), with the offload engine's host work as named spans (`jaxzero/...`)."""

    # "A:B": trace steps A to B - 1, as Python's range(A, B) (e.g. "10:13" traces steps 10, 11, 12;
    # steps count from 1); empty: no trace.
    steps: str = ""

    def window(self) -> range | None:
        """The steps to trace, or None for none. ConfigError if `steps` is not "A:B" with 1 <= A < B."""
        if not self.steps.strip():
            return None
        parts = self.steps.split(":")
        try:
            if len(parts) != 2:
                raise ValueError
            first, stop = int(parts[0]), int(parts[1])
        except ValueError:
            raise ConfigError(
                f"profile.steps={self.steps!r} is not A:B, two step numbers: --profile.steps=10:13 traces "
                "steps 10, 11 and 12 (as range(10, 13)); leave it empty for no trace."
            ) from None
        if first < 1:
            raise ConfigError(
                f"profile.steps={self.steps!r} starts at step {first}, but steps count from 1 (step 1 "
                f"includes compilation): e.g. --profile.steps=2:{max(stop, 4)}."
            )
        if stop <= first:
            raise ConfigError(
                f"profile.steps={self.steps!r} traces no step: A:B traces steps A to B - 1 (as range(A, B)), "
                f"so B must exceed A; e.g. --profile.steps={first}:{first + 2} traces steps {first} and "
                f"{first + 1}."
            )
        return range(first, stop)


@dataclass(frozen=True)
class TrainConfig:
    """The whole run. `steps`, `seed` and `run_dir` are the run concern and live at the top level."""

    steps: int = 300  # optimizer steps to run (on resume: the step to run to)
    seed: int = 0  # seeds parameter init and data order
    run_dir: str = ""  # output directory; empty: runs/<model.name>-<UTC timestamp>
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    offload: OffloadConfig = field(default_factory=OffloadConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    fp16: FP16Config = field(default_factory=FP16Config)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    machine: MachineConfig = field(default_factory=MachineConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)

    @property
    def schedule_steps(self) -> int:
        """Steps the learning-rate schedule spans: `optimizer.decay_steps`, else `steps`."""
        return self.optimizer.decay_steps or self.steps

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=False)


# The config file's sections and top-level keys, as `--section.key=value` and TOML name them.
SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "data": DataConfig,
    "optimizer": OptimizerConfig,
    "offload": OffloadConfig,
    "parallel": ParallelConfig,
    "fp16": FP16Config,
    "checkpoint": CheckpointConfig,
    "logging": LoggingConfig,
    "machine": MachineConfig,
    "profile": ProfileConfig,
}
TOP_LEVEL_KEYS = ("steps", "seed", "run_dir")


# ---------------------------------------------------------------------------------------------------
# Cross-field validation: runs before any array is allocated or any function compiled.
# ---------------------------------------------------------------------------------------------------


def validate_model(m: ModelConfig) -> None:
    """Raise ConfigError if `m` describes no valid transformer of its family. Used by `validate` and by
    the models themselves (they are also built without a TrainConfig)."""
    for k in (
        "vocab_size",
        "hidden_size",
        "num_layers",
        "num_heads",
        "num_kv_heads",
        "intermediate_size",
        "max_seq_len",
    ):
        if getattr(m, k) < 1:
            raise ConfigError(f"model.{k}={getattr(m, k)} must be >= 1.")
    if m.hidden_size % m.num_heads:
        raise ConfigError(
            f"model.hidden_size={m.hidden_size} must be divisible by model.num_heads={m.num_heads}."
        )
    if m.num_heads % m.num_kv_heads:
        raise ConfigError(
            f"model.num_heads={m.num_heads} must be divisible by model.num_kv_heads={m.num_kv_heads} "
            "(each key/value head serves a whole group of query heads)."
        )
    if m.family == "llama" and m.head_dim % 2:
        raise ConfigError(
            f"rotary embeddings need an even head_dim; got {m.head_dim} "
            f"(hidden_size={m.hidden_size} / num_heads={m.num_heads})."
        )
    if m.family == "gpt2" and m.num_kv_heads != m.num_heads:
        raise ConfigError(
            f"gpt2 uses multi-head attention: model.num_kv_heads={m.num_kv_heads} must equal "
            f"model.num_heads={m.num_heads}."
        )
    if m.family == "gpt2":
        llama_only = {
            "rope_type": "default",
            "attention_bias": False,
            "sliding_window": 0,
        }
        bad = [f"model.{k}={getattr(m, k)!r}" for k, v in llama_only.items() if getattr(m, k) != v]
        if bad:
            raise ConfigError(f"{', '.join(bad)}: Llama-family settings; gpt2 has none of them.")
    hf_types = {"llama": ("", "llama", "qwen2", "mistral"), "gpt2": ("", "gpt2")}[m.family]
    if m.hf_model_type not in hf_types:
        raise ConfigError(
            f"model.hf_model_type={m.hf_model_type!r} cannot describe a {m.family} model; one of {hf_types}."
        )
    if m.hf_model_type == "qwen2" and not m.attention_bias:
        raise ConfigError(
            "model.hf_model_type='qwen2' needs model.attention_bias=true (Qwen2 biases q, k, v)."
        )
    if m.attention_bias and m.hf_model_type in ("llama", "mistral"):
        raise ConfigError(
            f"model.attention_bias=true has no {m.hf_model_type} counterpart in transformers "
            "(LlamaConfig's attention_bias also biases o_proj); use model.hf_model_type=qwen2 or ''."
        )
    if m.rope_type != "default" and m.rope_factor < 1:
        raise ConfigError(
            f"model.rope_factor={m.rope_factor} must be >= 1 with model.rope_type={m.rope_type}."
        )
    if m.rope_type == "llama3" and not (0 < m.rope_low_freq_factor < m.rope_high_freq_factor):
        raise ConfigError(
            f"model.rope_type=llama3 needs 0 < model.rope_low_freq_factor < model.rope_high_freq_factor; "
            f"got {m.rope_low_freq_factor} and {m.rope_high_freq_factor}."
        )
    if m.rope_original_max_len < 1 or m.sliding_window < 0:
        raise ConfigError(
            f"model.rope_original_max_len={m.rope_original_max_len} must be >= 1 and "
            f"model.sliding_window={m.sliding_window} >= 0."
        )


def _need(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


def validate(cfg: TrainConfig, num_devices: int | None = None) -> None:
    """Raise ConfigError for impossible values and combinations, section by section, before anything
    is built. `num_devices` adds the mesh checks when known."""
    _need(cfg.steps >= 1, f"steps={cfg.steps} must be >= 1.")
    _validate_finite(cfg)
    validate_model(cfg.model)
    _validate_model_numerics(cfg.model)
    _validate_data(cfg, num_devices)
    _validate_optimizer(cfg.optimizer)
    _validate_offload(cfg)
    _validate_parallel(cfg)
    _validate_fp16(cfg.fp16)
    _validate_logging(cfg)
    _validate_checkpoint(cfg.checkpoint)
    _validate_machine(cfg.machine)


def _validate_finite(cfg: TrainConfig) -> None:
    """No setting is meaningful at inf or nan."""
    for section in (cfg.model, cfg.data, cfg.optimizer, cfg.fp16, cfg.logging):
        for f in dataclasses.fields(section):
            value = getattr(section, f.name)
            if isinstance(value, float) and not math.isfinite(value):
                name = next(k for k, v in SECTIONS.items() if isinstance(section, v))
                raise ConfigError(f"{name}.{f.name}={value} must be a finite number.")


def _validate_model_numerics(m: ModelConfig) -> None:
    """The model's numerical constants."""
    _need(m.rope_theta > 0, f"model.rope_theta={m.rope_theta} must be > 0.")
    _need(m.norm_eps > 0, f"model.norm_eps={m.norm_eps} must be > 0.")
    _need(m.init_std > 0, f"model.init_std={m.init_std} must be > 0.")


def _validate_data(cfg: TrainConfig, num_devices: int | None) -> None:
    """The data section: lengths, the batch rule, the source and its path; with `num_devices`, the
    micro-batch's rows over the mesh."""
    m, d = cfg.model, cfg.data
    _need(d.seq_len >= 2, f"data.seq_len={d.seq_len} must be >= 2.")
    _need(
        d.seq_len <= m.max_seq_len,
        f"data.seq_len={d.seq_len} exceeds model.max_seq_len={m.max_seq_len}; lower data.seq_len or "
        "raise model.max_seq_len.",
    )
    _need(
        not m.sliding_window or d.seq_len <= m.sliding_window,
        f"data.seq_len={d.seq_len} exceeds model.sliding_window={m.sliding_window}: jaxzero attends over "
        "the whole sequence, which equals this model's windowed attention only within one window. "
        f"Lower data.seq_len to at most {m.sliding_window}.",
    )
    batch = {"data.batch_size": d.batch_size, "data.grad_accum": d.grad_accum}
    batch["data.micro_batch_size"] = d.micro_batch_size
    _need(
        all(v >= 0 for v in batch.values()) and sum(v == 0 for v in batch.values()) <= 1,
        f"{_show(batch)}: each must be >= 1, except one of them 0 to be derived from the others "
        "(batch_size = micro_batch_size x grad_accum x devices).",
    )
    if d.micro_batch_size == 0:
        _need(
            d.batch_size % d.grad_accum == 0,
            f"data.batch_size={d.batch_size} must be a positive multiple of data.grad_accum={d.grad_accum}.",
        )
    _need(0.0 <= d.val_fraction < 0.5, f"data.val_fraction={d.val_fraction} must be in [0, 0.5).")
    if d.source == "tokens":
        _need(
            d.path != "",
            "data.source=tokens needs data.path=DIR, a directory holding train.bin "
            "(nanoGPT format: a flat array of uint16 or uint32 token ids).",
        )
    _need(
        d.source == "tokens" or not d.path,
        f"data.path={d.path!r} is read only with data.source=tokens, but data.source={d.source}: the run "
        f"would train on the {d.source} data, not on {d.path!r}. Add --data.source=tokens to train on "
        "its train.bin, or drop data.path.",
    )
    if num_devices is not None:
        _need(
            d.micro_batch_size == 0,
            f"{_show(batch)} is not resolved for the {num_devices} devices: pass the config through "
            "jaxzero.config.resolve_batch(cfg, num_devices) first (python -m jaxzero.train does).",
        )
        micro = d.batch_size // d.grad_accum
        _need(
            micro % num_devices == 0,
            f"the micro-batch data.batch_size/data.grad_accum = {d.batch_size}/{d.grad_accum} = {micro} "
            f"must be divisible by the {num_devices} devices of the data axis; e.g. data.batch_size="
            f"{-(-micro // num_devices) * num_devices * d.grad_accum}.",
        )


def _validate_optimizer(o: OptimizerConfig) -> None:
    """The update rule's hyperparameters and schedule."""
    _need(o.lr > 0, f"optimizer.lr={o.lr} must be > 0.")
    _need(0 <= o.warmup_steps, f"optimizer.warmup_steps={o.warmup_steps} must be >= 0.")
    _need(o.decay_steps >= 0, f"optimizer.decay_steps={o.decay_steps} must be >= 0 (0: the run's steps).")
    _need(o.eps > 0, f"optimizer.eps={o.eps} must be > 0 (it keeps Adam's division finite).")
    _need(0.0 <= o.momentum < 1.0, f"optimizer.momentum={o.momentum} must be in [0, 1).")
    _need(
        0.0 <= o.warmup_start_ratio <= 1.0,
        f"optimizer.warmup_start_ratio={o.warmup_start_ratio} must be in [0, 1].",
    )
    _need(0.0 <= o.min_lr_ratio <= 1.0, f"optimizer.min_lr_ratio={o.min_lr_ratio} must be in [0, 1].")
    _need(0.0 <= o.b1 < 1.0 and 0.0 <= o.b2 < 1.0, f"optimizer.b1={o.b1}, b2={o.b2} must be in [0, 1).")
    _need(o.weight_decay >= 0, f"optimizer.weight_decay={o.weight_decay} must be >= 0.")
    _need(o.grad_clip >= 0, f"optimizer.grad_clip={o.grad_clip} must be >= 0 (0 disables clipping).")


def _validate_offload(cfg: TrainConfig) -> None:
    """Where state lives: each offload key, then the combinations of explicit values."""
    m = cfg.model
    _need(
        cfg.offload.resident_blocks >= 0,
        f"offload.resident_blocks={cfg.offload.resident_blocks} must be >= 0.",
    )
    _need(
        cfg.offload.speculative_units >= 0,
        f"offload.speculative_units={cfg.offload.speculative_units} must be >= 0 (0 disables speculation).",
    )
    _need(
        cfg.offload.host_threads >= 0,
        f"offload.host_threads={cfg.offload.host_threads} must be >= 0 (0: a core each but one).",
    )
    _need(
        cfg.offload.two_pass_units >= -1,
        f"offload.two_pass_units={cfg.offload.two_pass_units} must be >= -1 (-1: adaptive; 0: none).",
    )
    _need(
        cfg.offload.resident_blocks <= m.num_layers,
        f"offload.resident_blocks={cfg.offload.resident_blocks} exceeds model.num_layers={m.num_layers}.",
    )
    _need(
        0 <= cfg.offload.device_state_units < m.num_layers + 2,
        f"offload.device_state_units={cfg.offload.device_state_units} must be in [0, {m.num_layers + 1}]: "
        f"the model has {m.num_layers + 2} units (embedding, {m.num_layers} blocks, head), and with every "
        "unit's state on the accelerator use offload.optimizer=none.",
    )
    _need(
        cfg.offload.disk_units >= -1,
        f"offload.disk_units={cfg.offload.disk_units} must be >= -1 (-1: every unit the host updates).",
    )
    # The combination rules below bind explicit values only: the planner decides an `auto` key
    # consistently with the others (e.g. offload.params=cpu makes an auto offload.optimizer cpu).
    if cfg.offload.device_state_units and cfg.offload.optimizer == "none":
        raise ConfigError(
            "offload.device_state_units only applies with offload.optimizer=cpu "
            f"(got offload.optimizer={cfg.offload.optimizer}): without it every unit's state is on the "
            "accelerator."
        )
    if cfg.offload.optimizer in ("none", "cpu") and (cfg.offload.disk_units != -1 or cfg.offload.disk_path):
        raise ConfigError(
            f"offload.disk_units={cfg.offload.disk_units} and offload.disk_path={cfg.offload.disk_path!r} "
            "only "
            f"apply with offload.optimizer=disk (or auto; got {cfg.offload.optimizer})."
        )
    if cfg.offload.optimizer == "disk" and cfg.offload.disk_units == 0:
        raise ConfigError(
            "offload.optimizer=disk with offload.disk_units=0 keeps no unit on disk: use "
            "offload.optimizer=cpu, or set offload.disk_units=K (the last K host-updated units) or -1 (all)."
        )
    if cfg.offload.activations == "cpu" and cfg.offload.optimizer == "none":
        raise ConfigError(
            "offload.activations=cpu needs the offload engine (offload.optimizer=cpu, with "
            "offload.device_state_units to keep some units' state on the accelerator): the resident "
            "trainer keeps its activations in accelerator memory."
        )
    if cfg.offload.device_state_units and cfg.offload.update == "delayed":
        raise ConfigError(
            "offload.device_state_units needs offload.update=overlapped: units updated on the accelerator "
            "cannot run one update behind (set offload.device_state_units=0 for the delayed update)."
        )
    if cfg.offload.resident_blocks and cfg.offload.params == "none":
        raise ConfigError(
            "offload.resident_blocks only applies with offload.params=cpu "
            f"(got offload.params={cfg.offload.params})."
        )
    if cfg.offload.params == "cpu" and cfg.offload.optimizer == "none":
        raise ConfigError(
            "offload.params=cpu needs offload.optimizer=cpu: streamed weights are updated "
            "from host-resident fp32 masters (DeepSpeed's ZeRO-3 offload pairs them too)."
        )


def _validate_parallel(cfg: TrainConfig) -> None:
    """The ZeRO stage and the join timeout, and the stage each offload needs."""
    par = cfg.parallel
    _need(
        -1 <= par.zero_stage <= 3,
        f"parallel.zero_stage={par.zero_stage} must be 0, 1, 2 or 3 (-1: auto).",
    )
    _need(par.timeout_s >= 1, f"parallel.timeout_s={par.timeout_s} must be >= 1.")
    if cfg.offload.params == "cpu" and par.zero_stage in (0, 1, 2):
        raise ConfigError(
            f"offload.params=cpu needs parallel.zero_stage=3 (got {par.zero_stage}): streamed weights "
            "are kept as one shard per device, as DeepSpeed's offload_param needs ZeRO stage 3."
        )
    if cfg.offload.optimizer in ("cpu", "disk") and par.zero_stage == 0:
        raise ConfigError(
            f"offload.optimizer={cfg.offload.optimizer} needs parallel.zero_stage >= 1 (got 0): "
            "host-resident optimizer "
            "state is kept as one shard per device, as DeepSpeed's offload_optimizer needs stage 1, 2 or 3."
        )


def _validate_fp16(f16: FP16Config) -> None:
    """Dynamic loss scaling."""
    _need(
        f16.loss_scale_window >= 1 and f16.hysteresis >= 1 and f16.min_loss_scale > 0,
        f"fp16.loss_scale_window={f16.loss_scale_window} and fp16.hysteresis={f16.hysteresis} must be >= 1, "
        f"fp16.min_loss_scale={f16.min_loss_scale} > 0.",
    )
    _need(
        0 <= f16.initial_scale_power <= 64 and 2.0**f16.initial_scale_power >= f16.min_loss_scale,
        f"fp16.initial_scale_power={f16.initial_scale_power} must be in [0, 64] and give a scale >= "
        f"fp16.min_loss_scale={f16.min_loss_scale}.",
    )


def _validate_logging(cfg: TrainConfig) -> None:
    """Logging's frequencies and the profiled window."""
    lg = cfg.logging
    _need(lg.log_every >= 1, f"logging.log_every={lg.log_every} must be >= 1.")
    _need(lg.eval_every >= 0, f"logging.eval_every={lg.eval_every} must be >= 0.")
    _need(lg.eval_batches >= 1, f"logging.eval_batches={lg.eval_batches} must be >= 1.")
    _need(lg.peak_tflops >= 0, f"logging.peak_tflops={lg.peak_tflops} must be >= 0 (0: from the device).")
    window = cfg.profile.window()  # ConfigError for a malformed or empty window
    _need(
        window is None or window.stop - 1 <= cfg.steps,
        f"profile.steps={cfg.profile.steps!r} traces up to step {window.stop - 1 if window else 0}, past the "
        f"run's last step (steps={cfg.steps}): B - 1 is the last step traced, so B must be at most "
        f"{cfg.steps + 1}.",
    )


def _validate_checkpoint(ck: CheckpointConfig) -> None:
    """How often checkpoints are saved and kept, and the save buffer."""
    _need(
        ck.every >= 0 and ck.keep >= 1 and ck.keep_every >= 0,
        f"checkpoint.every={ck.every} and checkpoint.keep_every={ck.keep_every} must be >= 0, "
        f"checkpoint.keep={ck.keep} >= 1.",
    )
    _need(
        math.isfinite(ck.buffer_gib) and ck.buffer_gib >= 1 / 64,
        f"checkpoint.buffer_gib={ck.buffer_gib} must be a finite number >= 0.015625 (16 MiB): the host RAM "
        "a save or a restore takes beyond one unit (default 2).",
    )


def _validate_machine(machine: MachineConfig) -> None:
    """The planner's machine figures (0: detect)."""
    for f in dataclasses.fields(machine):
        value = getattr(machine, f.name)
        _need(
            math.isfinite(value) and value >= 0,
            f"machine.{f.name}={value} must be a finite number >= 0 (0: detect, or the default for the "
            "detected device).",
        )


def _show(values: dict[str, int]) -> str:
    return ", ".join(f"{k}={v}" for k, v in values.items())


def resolve_batch(cfg: TrainConfig, num_devices: int) -> TrainConfig:
    """`cfg` with data.batch_size and data.grad_accum filled in for `num_devices` devices of the data
    axis, and data.micro_batch_size 0 (implied): DeepSpeed's rule batch_size = micro_batch_size x
    grad_accum x devices, the key given as 0 derived from the other two. ConfigError, with the
    arithmetic, when all three are given and disagree or the derived one is not a whole number."""
    d = cfg.data
    m, g, b = d.micro_batch_size, d.grad_accum, d.batch_size
    given = _show({"data.batch_size": b, "data.grad_accum": g, "data.micro_batch_size": m})
    if m == 0:
        return cfg
    if b == 0:
        b = m * g * num_devices
    elif g == 0:
        if b % (m * num_devices):
            raise ConfigError(
                f"{given}: data.grad_accum = batch_size / (micro_batch_size x {num_devices} devices) = "
                f"{b} / {m * num_devices} is not a whole number. Make data.batch_size a multiple of "
                f"{m * num_devices}, e.g. {-(-b // (m * num_devices)) * m * num_devices}."
            )
        g = b // (m * num_devices)
    elif b != m * g * num_devices:
        raise ConfigError(
            f"{given}: data.batch_size must equal micro_batch_size x grad_accum x devices = "
            f"{m} x {g} x {num_devices} = {m * g * num_devices} (DeepSpeed's train_batch_size = "
            "train_micro_batch_size_per_gpu x gradient_accumulation_steps x data-parallel size). "
            "Change one of them, or give one as 0 to derive it."
        )
    return dataclasses.replace(
        cfg, data=dataclasses.replace(d, batch_size=b, grad_accum=g, micro_batch_size=0)
    )
