"""Configuration: one frozen dataclass per concern, composed into `TrainConfig`, the named model sizes,
and the error types.

This module is a leaf: it imports nothing of jaxzero, so every other module may import it. The
dataclass defaults are the built-in default run (a tiny Llama on bundled bytes). How a config is built
from presets and `--section.key=value` overrides is `jaxzero.overrides`; every cross-field rule is
checked by `jaxzero.config.checks.validate` before anything is compiled or allocated.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any, Literal

from jaxzero.config.sizes import SIZE_SHAPES


class ConfigError(ValueError):
    """A config value or combination is invalid; the message says which and how to fix it."""


class CheckpointError(ConfigError):
    """A checkpoint cannot be used; the message names it and says why. A ConfigError, so the CLI
    reports it as bad input (exit status 2)."""


# The transformers model types an export may write (`ModelConfig.hf_model_type`).
HFModelType = Literal[
    "",
    "llama",
    "qwen2",
    "qwen3",
    "mistral",
    "qwen3_moe",
    "mixtral",
    "phi3",
    "olmo2",
    "gpt2",
    "gemma3_text",
    "gpt_oss",
    "granitemoe",
    "granite",
]


@dataclass(frozen=True)
class ModelConfig:
    """Transformer shape and numerics. Masters are always float32; `compute_dtype` is the matmul dtype.

    A plain frozen dataclass: the fields given, llama-tiny's shape for the rest. A named size's shape
    is `ModelConfig.named(NAME, **fields)` (what `--model.name=NAME --model.KEY=VALUE` builds); any
    other name labels a shape of your own. An `hf:DIR` name is a Hugging Face checkpoint whose shape
    is in its files: `jaxzero.interop.model_config_from_hf` builds it (`--model.name=hf:DIR` calls it);
    an `orbax:DIR` name an Orbax export of jaxzero's, whose shape is its `model.json`
    (`jaxzero.storage.orbax_export.read_model`).
    """

    # a named size (sets every other model.* key), hf:DIR (a HF checkpoint) or orbax:DIR (an Orbax export)
    name: str = "llama-tiny"
    family: Literal["llama", "gpt2", "gemma3", "gpt_oss"] = "llama"  # the architecture
    vocab_size: int = 256  # rows of the token embedding; every token id must be below it
    hidden_size: int = 128  # width of the residual stream
    num_layers: int = 4  # transformer blocks
    num_heads: int = 4  # attention (query) heads
    num_kv_heads: int = 2  # grouped-query attention; == num_heads is plain multi-head attention
    head_size: int = 0  # width of each head (HF's head_dim; Qwen3, Gemma 3); 0: hidden_size / num_heads
    intermediate_size: int = 384  # MLP width (SwiGLU for llama, GELU for gpt2; gpt_oss: unused)
    max_seq_len: int = 1024  # longest sequence (gpt2: rows of the position table)
    tie_embeddings: bool = False  # the output head reuses the token embedding (gpt2 always does)
    rope_theta: float = 1e4  # rotary embedding base (llama)
    # Rotary frequency scaling (transformers' rope_type): default (none), linear (positions / factor),
    # or llama3 (Llama 3.1+: low frequencies / factor, high kept, the band between interpolated), or
    # yarn (gpt_oss: frequencies blended between / factor and kept, cos and sin scaled).
    rope_type: Literal["default", "linear", "llama3", "yarn"] = "default"
    rope_factor: float = 1.0  # linear, llama3 and yarn
    rope_low_freq_factor: float = 1.0  # llama3
    rope_high_freq_factor: float = 4.0  # llama3
    rope_original_max_len: int = 8192  # llama3 and yarn: the context length pretraining used
    rope_beta_fast: float = 32.0  # yarn: rotations at which the ramp to kept frequencies ends
    rope_beta_slow: float = 1.0  # yarn: rotations at which the ramp from scaled frequencies starts
    rope_truncate: bool = True  # yarn: the ramp's bounds rounded outward to whole dimensions
    rope_attention_factor: float = 0.0  # yarn: cos and sin times it; 0: 0.1 ln(rope_factor) + 1
    attention_bias: bool = False  # biases on the q, k and v projections (Qwen2; gpt_oss: and o)
    qk_norm: bool = False  # RMSNorm of each query and key head before the rotary embedding (Qwen3)
    # what qk_norm normalises over: each head's width (Qwen3), or the whole q and k projections (OLMo 2)
    qk_norm_scope: Literal["head", "projection"] = "head"
    # the RMSNorms after the attention's and the MLP's outputs, before each residual add, and none
    # before them (OLMo 2); false: before each sub-block (Llama)
    post_norm: bool = False
    # q, k, v as one qkv_proj (D, (N+2K)H) and gate, up as one gate_up_proj (D, 2F), as Phi-3 stores them
    fused_projections: bool = False
    partial_rotary_factor: float = 1.0  # rotary embeddings rotate this fraction of each head (its first dims)
    # Mixture of experts (llama family: Qwen3-MoE, Mixtral; gpt_oss always): every block's MLP is a
    # router over num_experts SwiGLU experts, each token through its top num_experts_per_tok.
    num_experts: int = 0  # experts per block's MLP (0: a dense MLP)
    num_experts_per_tok: int = 2  # the experts each token goes through (top-k of the router)
    moe_intermediate_size: int = 0  # each expert's MLP width
    norm_topk_prob: bool = True  # the top-k routing weights renormalised to sum 1 (Mixtral: always)
    swiglu_alpha: float = 1.702  # gpt_oss experts: gate * sigmoid(swiglu_alpha * gate)
    swiglu_limit: float = 7.0  # gpt_oss experts: gate clipped above, up clipped both sides at it
    router_aux_loss_coef: float = 0.0  # weight of the router's load-balancing loss added to the objective
    # how experts' rows are grouped: "padded" blocks (every backend), "mosaic" (the Mosaic GPU grouped
    # matmul, one Hopper GPU), "auto" (mosaic where it runs, decided for the machine the run plans for)
    moe_impl: Literal["auto", "padded", "mosaic"] = "auto"
    # Sliding-window attention's window (Mistral v0.1, some Qwen2, Phi-3-mini): 0 is none. Attention
    # is computed in full, which equals the windowed attention only while data.seq_len <= the window.
    sliding_window: int = 0
    # gemma3, gpt_oss: every N-th layer global, the others windowed (any seq_len)
    sliding_window_pattern: int = 0
    rope_local_theta: float = 0.0  # gemma3: the rotary base of the windowed layers
    query_pre_attn_scalar: int = 0  # gemma3: scores scaled by its -1/2 power; 0: head_dim's
    final_logit_softcap: float = 0.0  # gemma3: logits = cap * tanh(logits / cap); 0: none
    # Granite's four scalars (llama family; the defaults leave every other model as it is):
    embedding_multiplier: float = 1.0  # the token embeddings times it
    residual_multiplier: float = 1.0  # each sub-block's output times it, before its residual add
    attention_multiplier: float = 0.0  # the attention scores' factor; 0: 1/sqrt(head_dim)
    logits_scaling: float = 1.0  # the logits divided by it
    # The transformers model_type an export writes: "" is the family's own (llama, gpt2); Llama-family
    # checkpoints imported as qwen2, qwen3, mistral, granite, ... keep theirs.
    hf_model_type: HFModelType = ""
    norm_eps: float = 1e-5  # epsilon of RMSNorm / LayerNorm
    init_std: float = 0.02  # standard deviation of the random init of matrices
    # matmul and activation dtype (masters are float32); float16 adds dynamic loss scaling
    compute_dtype: Literal["bfloat16", "float32", "float16"] = "bfloat16"
    attention_impl: Literal["auto", "xla", "cudnn"] = "auto"  # auto: cuDNN on GPU when it applies, else XLA
    # an export to start from: a Hugging Face checkpoint or an Orbax export (set by model.name=hf:DIR or
    # orbax:DIR)
    init_from: str = ""

    @classmethod
    def named(cls, name: str, **fields: Any) -> ModelConfig:
        """The named size `name` (a key of `SIZE_SHAPES`), each of `fields` overriding that one field,
        as `--model.name=NAME --model.KEY=VALUE` does: `ModelConfig.named("llama-7b", num_layers=2)`
        is Llama 2 7B cut to two blocks. An unknown name (or an `hf:DIR` one) raises ConfigError."""
        size = SIZE_SHAPES.get(name)
        if size is None:
            raise ConfigError(_not_a_size(name))
        return cls(**{**size, **fields, "name": name})

    @property
    def head_dim(self) -> int:
        """Width of each attention head: `head_size`, or hidden_size / num_heads where it is 0."""
        return self.head_size or self.hidden_size // self.num_heads


def _not_a_size(name: str) -> str:
    """The refusal of `ModelConfig.named(name)` for a `name` of no named size."""
    if name.startswith("orbax:"):
        return (
            f"model.name={name!r} is an Orbax export, whose shape is in its model.json, which a ModelConfig "
            "does not read: build it with jaxzero.storage.orbax_export.read_model(DIR) (as "
            "--model.name=orbax:DIR does)."
        )
    if name.startswith("hf:"):
        return (
            f"model.name={name!r} is a Hugging Face checkpoint, whose shape is in its config.json, which "
            "a ModelConfig does not read: build the config with jaxzero.apply_overrides(cfg, "
            "{'model.name': 'hf:DIR'}) or jaxzero.parse_args (as --model.name=hf:DIR does), the model "
            "with jaxzero.interop.model_config_from_hf(DIR), or give the shape's fields as "
            "ModelConfig(name=..., ...)."
        )
    return (
        f"unknown model.name {name!r}. Valid names: {', '.join(SIZE_SHAPES)}. A shape of your own takes "
        "any other name with its fields given, e.g. ModelConfig(name='mine', hidden_size=256, num_layers=8)."
    )


@dataclass(frozen=True)
class DataConfig:
    """Where tokens come from and how they are batched.

    `batch_size` is the global number of sequences per optimizer step, over all devices and all
    `grad_accum` micro-batches; each sequence is `seq_len` inputs plus one shifted target. As in
    DeepSpeed, batch_size = micro_batch_size x grad_accum x devices of the data axis: one of the three
    may be 0 and is derived from the others when the devices are known
    (`jaxzero.config.checks.resolve_batch`).
    """

    # builtin: bytes of Python's standard library; tokens: nanoGPT .bin files; synthetic: random ids
    source: Literal["builtin", "tokens", "synthetic"] = "builtin"
    # source=tokens: directory holding train.bin (and optionally val.bin); given alone, source=tokens
    path: str = ""
    # source=tokens: the dtype the .bin files hold; auto: what their prepare.json records, else uint16
    token_dtype: Literal["auto", "uint16", "uint32"] = "auto"
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
    # The id that ends each document (and each fine-tuning example) in the token stream: attention stays
    # inside a document. -1: the one the data says (prepare.json's eot_id; for nanoGPT .bin files
    # without one, GPT-2's 50256 where model.vocab_size is GPT-2's); -2: none (one stream).
    eot_id: int = -1
    # Attend across document boundaries inside a sequence (what packed training did before
    # document-aware attention); false: each token attends only within its document.
    cross_document_attention: bool = False
    # Fine-tuning examples (prepare --sft): pack whole examples into each row (best fit, never split);
    # false: one example per row, padded (the padding masked out of the loss).
    pack: bool = True


def padding_id(eot_id: int) -> int:
    """The id that pads rows of fine-tuning examples ending with `eot_id` (`jaxzero.data.packing`),
    marked not-a-target: any id but `eot_id`, so that the padding is one run after the row's last
    end-of-text. The data writes it and the training objective knows it by it
    (`jaxzero.numerics.objective.real_tokens`)."""
    return 1 if eot_id == 0 else 0


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
    # decoupled decay of matrices (adamw, lion, sgd); adam has none: --optimizer.name=adam alone sets 0
    weight_decay: float = 0.1
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


# Where offload.disk_path is not set, the disk tier works in this directory of the run directory.
OFFLOAD_STATE_DIR = "offload-state"


@dataclass(frozen=True)
class OffloadConfig:
    """Where state lives, in DeepSpeed's vocabulary: `none` keeps it on the accelerator, `cpu` in host RAM,
    `auto` lets the planner (`jaxzero.planner.search`) choose for this model on this machine.

    The planner decides only what is left to it: `params` and `optimizer` when `auto`, and with them
    `resident_blocks` (when 0) and `two_pass_units` (when -1: it may turn it to 0 where that alone
    makes a placement fit); `device_state_units` when -1, whether the mode is `auto` or explicit
    (an explicit ZeRO-Offload or ZeRO-3 placement still gets the accelerator's spare memory for the
    units the next forward pass needs first; 0 pins every unit's state to the host). Explicit values
    keep their meaning; a run whose explicit settings do not fit is refused by the memory check."""

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
    # -1: the planner's choice, with explicit params/optimizer too (the fewest that close the next
    # forward pass's wait for the host, where the accelerator has room beside everything else);
    # 0: every unit's state in host RAM.
    device_state_units: int = -1
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

    # accelerator memory per device to plan for, GiB: what XLA's allocator gets, as detection reports it
    # (95% of the GPU less its CUDA context: 75.1 for an H100 80 GB, 133 for an H200), not the card's size
    gpu_gib: float = 0.0
    host_gib: float = 0.0  # host RAM available to the run, GiB
    h2d_gbps: float = 0.0  # host-to-accelerator link, GB/s per direction per device
    d2h_gbps: float = 0.0  # accelerator-to-host link, GB/s per direction per device
    host_gbps: float = 0.0  # host memory bandwidth the host optimizer update reaches, GB/s
    gpu_tflops: float = 0.0  # dense bf16 TFLOP/s one device reaches on the model's step (8N accounting)
    cores: int = 0  # CPU cores of the host update (the figures above are for 16)
    disk_gib: float = 0.0  # free local disk for offload.optimizer=disk's working state, GiB
    disk_gbps: float = 0.0  # what that disk reads and writes, GB/s, reads and writes together
    # GPUs of one host to plan for, one process each (as python -m jaxzero.launch runs them), with
    # machine.gpu_gib: a node you do not have; 0: the GPUs this process will see
    gpus: int = 0


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


IN_FLIGHT_MAX = 2**30  # bytes a save keeps in flight to disk at most (`in_flight_bytes`)


def in_flight_bytes(cfg: CheckpointConfig) -> int:
    """Of the buffer, what a save or a restore keeps in flight to or from disk: half of it, at most
    1 GiB; a save holds copies of units the next step updates before the writer has written them in
    the rest (`jaxzero.primitives.write_fence`), so that those updates need not wait."""
    return min(buffer_bytes(cfg) // 2, IN_FLIGHT_MAX)


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


# PEFT's Llama projections, without "_proj"; Phi-3's fused qkv_proj and gate_up_proj are qkv and gate_up.
LORA_TARGETS = ("q", "k", "v", "o", "gate", "up", "down", "qkv", "gate_up")


@dataclass(frozen=True)
class FinetuneConfig:
    """What trains: every parameter (`full`), or LoRA adapters over a frozen base (`lora`, PEFT's rule)."""

    method: Literal["full", "lora"] = "full"  # lora: adapters train on the accelerator, the base is frozen
    lora_rank: int = 16  # the adapters' rank r
    lora_alpha: float = 32.0  # the adapter product is scaled by lora_alpha / lora_rank
    lora_dropout: float = 0.0  # dropout on each adapter's input (PEFT's lora_dropout)
    # Projections that get adapters, comma-separated among q, k, v, o, gate, up, down (PEFT's q_proj ...;
    # a model with fused_projections has qkv and gate_up instead of q, k, v, gate, up)
    lora_targets: str = "q,k,v,o,gate,up,down"
    # The frozen base's storage: bfloat16, int8 (weight-only, per output channel, dequantised on the
    # accelerator inside each block; the embedding, norms and head stay bfloat16), or float32
    base_dtype: Literal["bfloat16", "int8", "float32"] = "bfloat16"
    # Full fine-tuning of part of a model: the units that do not train, comma-separated among embed,
    # head and blocks:A-B (0-based, inclusive), e.g. "embed,blocks:0-15"; they are kept in base_dtype
    # with no masters, no optimizer state and no gradients
    freeze: str = ""

    @property
    def partial(self) -> bool:
        """Whether part of the model is frozen: LoRA (the whole base) or `freeze`."""
        return self.method == "lora" or bool(self.freeze.strip())

    def frozen(self, num_layers: int) -> frozenset[int]:
        """The positions (embedding 0, block i at 1 + i, head num_layers + 1) that do not train under
        `freeze`; ConfigError naming the bad item for one that is not embed, head or blocks:A-B."""
        out: set[int] = set()
        for item in (t.strip() for t in self.freeze.split(",")):
            if not item:
                continue
            if item in ("embed", "head"):
                out.add(0 if item == "embed" else num_layers + 1)
                continue
            lo_hi = item.removeprefix("blocks:").split("-") if item.startswith("blocks:") else []
            if len(lo_hi) in (1, 2) and all(x.strip().isdecimal() for x in lo_hi):
                lo, hi = int(lo_hi[0]), int(lo_hi[-1])
                if lo <= hi < num_layers:
                    out.update(range(1 + lo, 2 + hi))
                    continue
            raise ConfigError(
                f"finetune.freeze={self.freeze!r}: {item!r} is not embed, head or blocks:A-B with "
                f'0 <= A <= B < model.num_layers={num_layers} (e.g. "embed,blocks:0-15").'
            )
        return frozenset(out)

    def base_positions(self, num_layers: int) -> frozenset[int]:
        """The units the frozen base keeps (embedding 0, block i at 1 + i, head num_layers + 1): all
        under LoRA, the frozen ones under `freeze`."""
        return frozenset(range(num_layers + 2)) if self.method == "lora" else self.frozen(num_layers)

    def lowest_trainable_block(self, num_layers: int) -> int:
        """The first block whose backward pass matters: 0 where the embedding or block 0 trains (or
        under LoRA), else the lowest trainable block (below it nothing trains and no gradient flows);
        num_layers where only the head trains."""
        if self.method == "lora":
            return 0
        frozen = self.frozen(num_layers)
        if 0 not in frozen:
            return 0
        return next((i for i in range(num_layers) if 1 + i not in frozen), num_layers)

    @property
    def targets(self) -> tuple[str, ...]:
        """`lora_targets` as a tuple of names, in `LORA_TARGETS` order."""
        named = {t.strip() for t in self.lora_targets.split(",") if t.strip()}
        return tuple(t for t in LORA_TARGETS if t in named)


@dataclass(frozen=True)
class TrainConfig:
    """The whole run. `steps`, `seed`, `run_dir` and `determinism` are the run concern and live at the
    top level."""

    steps: int = 300  # optimizer steps to run (on resume: the step to run to)
    seed: int = 0  # seeds parameter init and data order
    run_dir: str = ""  # output directory; empty: runs/<model.name>-<UTC timestamp>
    # Deterministic GPU kernels and fixed reduction orders: two runs of one command, and a resumed run
    # and an uninterrupted one, give bitwise the same losses and parameters (slower; see the README).
    determinism: bool = False
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
    finetune: FinetuneConfig = field(default_factory=FinetuneConfig)

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
    "finetune": FinetuneConfig,
}
TOP_LEVEL_KEYS = ("steps", "seed", "run_dir", "determinism")
