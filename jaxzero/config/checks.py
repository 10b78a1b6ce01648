"""The config's checks: `validate`, every cross-field rule of a `TrainConfig` section by section, and
`resolve_batch`, DeepSpeed's batch rule once the devices are known.

`validate` runs before any array is allocated or any function is compiled; each refusal is a
ConfigError that names the keys, their values and the fix. The models call `validate_model` too, since
they are also built without a TrainConfig.
"""

from __future__ import annotations

import dataclasses
import math

from jaxzero.config import (
    LORA_TARGETS,
    SECTIONS,
    SIZE_SHAPES,
    CheckpointConfig,
    ConfigError,
    FP16Config,
    MachineConfig,
    ModelConfig,
    OptimizerConfig,
    TrainConfig,
)
from jaxzero.config.families import validate_gemma3, validate_gpt_oss
from jaxzero.config.variants import LLAMA_TYPES, QWEN_WINDOWS, lora_target_problem, validate_variants


def _need(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


def validate(cfg: TrainConfig, num_devices: int | None = None) -> None:
    """Raise ConfigError for impossible values and combinations, section by section, before anything
    is built. `num_devices` adds the mesh checks when known."""
    _need(cfg.steps >= 1, f"steps={cfg.steps} must be >= 1.")
    _need(
        cfg.steps < 2**31,
        f"steps={cfg.steps} must be below 2**31 = {2**31:,}: a state counts its steps in int32.",
    )
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
    _validate_finetune(cfg)


def validate_placement(cfg: TrainConfig) -> None:
    """Raise ConfigError where `cfg`'s placement breaks a rule: the offload, ZeRO stage and fine-tuning
    sections' checks, the only ones that read the offload keys. The planner checks each placement it
    tries of a config `validate` accepted (only the offload keys differ) against these alone."""
    _validate_offload(cfg)
    _validate_parallel(cfg)
    _validate_finetune(cfg)


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
    if m.head_size < 0:
        raise ConfigError(f"model.head_size={m.head_size} must be >= 1, or 0 for hidden_size / num_heads.")
    if not m.head_size and m.hidden_size % m.num_heads:
        raise ConfigError(
            f"model.hidden_size={m.hidden_size} must be divisible by model.num_heads={m.num_heads} "
            "(or set model.head_size, the width of each head)."
        )
    if m.num_heads % m.num_kv_heads:
        raise ConfigError(
            f"model.num_heads={m.num_heads} must be divisible by model.num_kv_heads={m.num_kv_heads} "
            "(each key/value head serves a whole group of query heads)."
        )
    if m.family in ("llama", "gemma3", "gpt_oss") and m.head_dim % 2:
        raise ConfigError(
            f"rotary embeddings need an even head_dim; got {m.head_dim} "
            f"(model.head_size={m.head_size}, hidden_size={m.hidden_size} / num_heads={m.num_heads})."
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
            "qk_norm": False,
            "head_size": 0,
            "sliding_window": 0,
        }
        bad = [f"model.{k}={getattr(m, k)!r}" for k, v in llama_only.items() if getattr(m, k) != v]
        if bad:
            raise ConfigError(f"{', '.join(bad)}: Llama-family settings; gpt2 has none of them.")
    gemma_only = {"sliding_window_pattern": 0, "rope_local_theta": 0.0, "query_pre_attn_scalar": 0}
    gemma_only["final_logit_softcap"] = 0.0
    if m.family == "gpt_oss":  # its layers alternate too
        del gemma_only["sliding_window_pattern"]
    bad = [f"model.{k}={getattr(m, k)!r}" for k, v in gemma_only.items() if getattr(m, k) != v]
    if m.family != "gemma3" and bad:
        raise ConfigError(f"{', '.join(bad)}: Gemma 3 settings; model.family={m.family!r} has none of them.")
    if m.family == "gemma3":
        validate_gemma3(m)
    if m.family == "gpt_oss":
        validate_gpt_oss(m)
    elif m.rope_type == "yarn":
        raise ConfigError(
            f"model.rope_type=yarn scales cos and sin as gpt-oss does; model.family={m.family!r} "
            "implements default, linear and llama3 rope."
        )
    hf_types = {
        "llama": LLAMA_TYPES,
        "gpt2": ("", "gpt2"),
        "gemma3": ("", "gemma3_text"),
        "gpt_oss": ("", "gpt_oss"),
    }[m.family]
    if m.hf_model_type not in hf_types:
        raise ConfigError(
            f"model.hf_model_type={m.hf_model_type!r} cannot describe a {m.family} model; one of {hf_types}."
        )
    _validate_moe(m)
    validate_variants(m)
    if m.hf_model_type == "qwen2" and not m.attention_bias:
        raise ConfigError(
            "model.hf_model_type='qwen2' needs model.attention_bias=true (Qwen2 biases q, k, v)."
        )
    if m.hf_model_type == "qwen3" and (not m.qk_norm or m.attention_bias):
        raise ConfigError(
            f"model.hf_model_type='qwen3' needs model.qk_norm=true and model.attention_bias=false (Qwen3 "
            f"normalises q and k heads; its attention_bias also biases o_proj); got qk_norm={m.qk_norm}, "
            f"attention_bias={m.attention_bias}."
        )
    if m.family == "llama" and m.hf_model_type in ("llama", "qwen2", "mistral", "mixtral") and m.qk_norm:
        raise ConfigError(
            f"model.qk_norm=true has no {m.hf_model_type} counterpart in transformers; use "
            "model.hf_model_type=qwen3 or ''."
        )
    if m.family == "llama" and not m.qk_norm and m.head_size and m.head_size * m.num_heads != m.hidden_size:
        raise ConfigError(
            f"model.head_size={m.head_size} x model.num_heads={m.num_heads} != model.hidden_size="
            f"{m.hidden_size}: a head width of its own is Qwen3's (model.qk_norm=true); Llama, Qwen2 and "
            "Mistral checkpoints derive it from hidden_size / num_heads. Set model.head_size=0."
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


def _validate_moe(m: ModelConfig) -> None:
    """Experts: llama family only, top-k of at least k experts, a width; the MoE checkpoint types
    with experts and the dense ones without (Mixtral renormalises its top-k, no q/k norms)."""
    moe_types = ("qwen3_moe", "mixtral", "granitemoe")
    if not (m.router_aux_loss_coef >= 0 and math.isfinite(m.router_aux_loss_coef)):
        raise ConfigError(
            f"model.router_aux_loss_coef={m.router_aux_loss_coef} must be a finite number >= 0 (the "
            "weight of the load-balancing loss; 0 trains on the cross-entropy alone)."
        )
    if m.family == "gpt_oss":  # `validate_gpt_oss`
        return
    if not m.num_experts:
        if m.hf_model_type in moe_types:
            raise ConfigError(f"model.hf_model_type={m.hf_model_type!r} needs model.num_experts >= 1.")
        return
    bad = []
    if m.family != "llama":
        bad.append(f"model.family={m.family!r} (experts are the llama family's)")
    if m.num_experts < 0 or not 1 <= m.num_experts_per_tok <= m.num_experts:
        bad.append(f"model.num_experts_per_tok={m.num_experts_per_tok} (1 .. num_experts={m.num_experts})")
    if m.moe_intermediate_size < 1:
        bad.append(f"model.moe_intermediate_size={m.moe_intermediate_size} (each expert's width, >= 1)")
    if m.hf_model_type not in ("", *moe_types):
        bad.append(
            f"model.hf_model_type={m.hf_model_type!r} (a dense type; use qwen3_moe, mixtral, "
            "granitemoe or '')"
        )
    if m.hf_model_type == "mixtral" and (not m.norm_topk_prob or m.attention_bias):
        bad.append("model.hf_model_type='mixtral' with norm_topk_prob=false or attention_bias=true")
    if m.hf_model_type == "qwen3_moe" and (not m.qk_norm or m.attention_bias):
        bad.append("model.hf_model_type='qwen3_moe' without qk_norm=true and attention_bias=false")
    if bad:
        raise ConfigError(f"model.num_experts={m.num_experts}: unsupported settings: {'; '.join(bad)}.")


def _validate_finite(cfg: TrainConfig) -> None:
    """No setting is meaningful at inf or nan."""
    for section in (cfg.model, cfg.data, cfg.optimizer, cfg.fp16, cfg.logging):
        for f in dataclasses.fields(section):
            value = getattr(section, f.name)
            if isinstance(value, float) and not math.isfinite(value):
                name = next(k for k, v in SECTIONS.items() if isinstance(section, v))
                raise ConfigError(f"{name}.{f.name}={value} must be a finite number.")


def _validate_model_numerics(m: ModelConfig) -> None:
    """The model's numerical constants, and a named size's name on the default shape: the
    `ModelConfig(name="llama-7b")` that meant `ModelConfig.named("llama-7b")` (a plain dataclass
    looks no name up), which would train llama-tiny labelled as the size."""
    default = ModelConfig()
    _need(
        m.name == default.name or m.name not in SIZE_SHAPES or m != ModelConfig(name=m.name),
        f"model.name={m.name!r} names a size, but every other field is llama-tiny's default: "
        f"ModelConfig(name={m.name!r}) labels llama-tiny's shape. Build the size with "
        f"ModelConfig.named({m.name!r}) (as --model.name={m.name} does).",
    )
    _need(m.rope_theta > 0, f"model.rope_theta={m.rope_theta} must be > 0.")
    _need(m.norm_eps > 0, f"model.norm_eps={m.norm_eps} must be > 0.")
    _need(m.init_std > 0, f"model.init_std={m.init_std} must be > 0.")


def _validate_data(cfg: TrainConfig, num_devices: int | None) -> None:
    """The data section: lengths, the batch rule, the source and its path; with `num_devices`, the
    micro-batch's rows over the mesh."""
    m, d = cfg.model, cfg.data
    _need(d.seq_len >= 2, f"data.seq_len={d.seq_len} must be >= 2.")
    _need(
        d.eot_id in (-1, -2) or 0 <= d.eot_id < m.vocab_size,
        f"data.eot_id={d.eot_id} must be a token id below model.vocab_size={m.vocab_size}, -1 (the one the "
        "data says) or -2 (none: the stream is one document).",
    )
    _need(
        d.seq_len <= m.max_seq_len,
        f"data.seq_len={d.seq_len} exceeds model.max_seq_len={m.max_seq_len}; lower data.seq_len or "
        "raise model.max_seq_len.",
    )
    _need(
        not m.sliding_window or m.hf_model_type not in QWEN_WINDOWS or d.seq_len <= m.sliding_window,
        f"data.seq_len={d.seq_len} exceeds model.sliding_window={m.sliding_window} of a {m.hf_model_type} "
        "model: its window covers only the layers from max_window_layers on, and jaxzero windows every "
        f"layer, which equals it only within one window. Lower data.seq_len to at most {m.sliding_window}.",
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
        check_batch_split(cfg, num_devices)


def check_batch_split(cfg: TrainConfig, num_devices: int) -> None:
    """Raise ConfigError unless `cfg`'s batch is resolved (`resolve_batch`) and its micro-batch splits
    over the `num_devices` devices of the data axis: the one rule of `validate` that needs the devices."""
    d = cfg.data
    batch = {"data.batch_size": d.batch_size, "data.grad_accum": d.grad_accum}
    batch["data.micro_batch_size"] = d.micro_batch_size
    _need(
        d.micro_batch_size == 0,
        f"{_show(batch)} is not resolved for the {num_devices} devices: pass the config through "
        "jaxzero.config.checks.resolve_batch(cfg, num_devices) first (python -m jaxzero.train does).",
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
        -1 <= cfg.offload.device_state_units < m.num_layers + 2,
        f"offload.device_state_units={cfg.offload.device_state_units} must be in [-1, {m.num_layers + 1}] "
        f"(-1: the planner's choice): the model has {m.num_layers + 2} units (embedding, {m.num_layers} "
        "blocks, head), and with every unit's state on the accelerator use offload.optimizer=none.",
    )
    _need(
        cfg.offload.disk_units >= -1,
        f"offload.disk_units={cfg.offload.disk_units} must be >= -1 (-1: every unit the host updates).",
    )
    # The combination rules below bind explicit values only: the planner decides an `auto` key
    # consistently with the others (e.g. offload.params=cpu makes an auto offload.optimizer cpu).
    if cfg.offload.device_state_units > 0 and cfg.offload.optimizer == "none":
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
    if cfg.offload.device_state_units > 0 and cfg.offload.update == "delayed":
        raise ConfigError(
            "offload.device_state_units needs offload.update=overlapped: units updated on the accelerator "
            "cannot run one update behind (set offload.device_state_units=0 for the delayed update)."
        )
    if cfg.offload.resident_blocks and cfg.offload.params == "none":
        raise ConfigError(
            "offload.resident_blocks only applies with offload.params=cpu "
            f"(got offload.params={cfg.offload.params})."
        )
    lora = cfg.finetune.partial  # its frozen base streams with no optimizer behind it
    if cfg.offload.params == "cpu" and cfg.offload.optimizer == "none" and not lora:
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
    _need(ck.every >= 0, f"checkpoint.every={ck.every} must be >= 0 (0: a checkpoint at the end only).")
    _need(ck.keep >= 1, f"checkpoint.keep={ck.keep} must be >= 1: the newest checkpoints kept.")
    _need(ck.keep_every >= 0, f"checkpoint.keep_every={ck.keep_every} must be >= 0 (0: only the newest).")
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
    _need(
        machine.gpus <= 1 or machine.gpu_gib > 0,
        f"machine.gpus={machine.gpus} plans for a node you do not have, its GPUs of machine.gpu_gib each: "
        "set machine.gpu_gib too (what XLA gets of one GPU, e.g. 75.1 for an H100 80 GB), or leave "
        "machine.gpus out to plan for the GPUs this machine has.",
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


def _validate_finetune(cfg: TrainConfig) -> None:
    f = cfg.finetune
    if f.method == "full" and f.freeze.strip():
        _validate_freeze(cfg)
        return
    if f.method == "full":
        return
    _need(
        not f.freeze.strip(),
        f"finetune.freeze={f.freeze!r} with finetune.method=lora: LoRA freezes the whole base already; "
        "leave finetune.freeze empty, or use finetune.method=full to train the units it leaves.",
    )
    _need(
        cfg.model.family in ("llama", "gemma3", "gpt_oss"),
        f"finetune.method=lora adapts the projections of the llama family (Llama, Qwen2, Qwen3, Mistral), "
        f"Gemma 3 and gpt-oss; "
        f"model.family={cfg.model.family!r} has none of PEFT's names: use finetune.method=full.",
    )
    _need(f.lora_rank >= 1, f"finetune.lora_rank={f.lora_rank} must be >= 1 (16 is common).")
    _need(f.lora_alpha > 0, f"finetune.lora_alpha={f.lora_alpha} must be > 0 (2 x lora_rank is common).")
    _need(0 <= f.lora_dropout < 1, f"finetune.lora_dropout={f.lora_dropout} must be in [0, 1).")
    names = [t.strip() for t in f.lora_targets.split(",") if t.strip()]
    unknown = [t for t in names if t not in LORA_TARGETS]
    _need(
        names and not unknown,
        f"finetune.lora_targets={f.lora_targets!r}: {', '.join(unknown) or 'none named'}; name some of "
        f"{', '.join(LORA_TARGETS)}, comma-separated (PEFT's q_proj ... down_proj).",
    )
    problem = lora_target_problem(cfg.model, names)
    _need(problem is None, str(problem))
    dense = [t for t in names if t in ("gate", "up", "down")]
    _need(
        not (cfg.model.num_experts and dense),
        f"finetune.lora_targets={f.lora_targets!r} names the dense MLP's {', '.join(dense)}, which a model "
        f"of model.num_experts={cfg.model.num_experts} experts has not (its experts are not adapted): "
        "use finetune.lora_targets=q,k,v,o.",
    )
    _need(
        cfg.offload.params in ("auto", "none", "cpu") and cfg.offload.optimizer in ("auto", "none"),
        f"finetune.method=lora keeps the adapters and their optimizer state on the accelerator: "
        f"offload.optimizer={cfg.offload.optimizer!r} has no state to place; leave it at auto (or none). "
        "offload.params=cpu streams the frozen base from host memory, none keeps it on the accelerator.",
    )
    _need(
        cfg.model.compute_dtype != "float16",
        "finetune.method=lora runs in bfloat16 or float32 (model.compute_dtype), not float16.",
    )
    o = cfg.offload
    _need(
        o.resident_blocks == 0 and o.activations == "none",
        f"finetune.method=lora streams either every base block or none (offload.params) and keeps block "
        f"inputs on the accelerator: offload.resident_blocks={o.resident_blocks} and offload.activations="
        f"{o.activations!r} apply to finetune.method=full; leave them at 0 and none.",
    )


def _validate_freeze(cfg: TrainConfig) -> None:
    f, o, n = cfg.finetune, cfg.offload, cfg.model.num_layers
    frozen = f.frozen(n)
    _need(frozen, f"finetune.freeze={f.freeze!r} names no unit: name some of embed, head, blocks:A-B.")
    _need(
        len(frozen) < n + 2,
        f"finetune.freeze={f.freeze!r} freezes every unit of the model: nothing would train.",
    )
    _need(
        o.optimizer in ("auto", "none") and o.resident_blocks == 0 and o.activations == "none",
        f"finetune.freeze keeps the units that train, with their masters and optimizer state, on the "
        f"accelerator and streams only frozen blocks (offload.params): offload.optimizer={o.optimizer!r}, "
        f"offload.resident_blocks={o.resident_blocks} and offload.activations={o.activations!r} apply to "
        "a run that trains every unit; leave them at auto, 0 and none.",
    )
    _need(
        f.base_dtype != "int8" or cfg.model.family in ("llama", "gemma3", "gpt_oss"),
        f"finetune.base_dtype=int8 quantises the llama family's, Gemma 3's and gpt-oss's projections; "
        f"model.family={cfg.model.family!r}: use bfloat16.",
    )
    _need(
        cfg.model.compute_dtype != "float16",
        "finetune.freeze runs in bfloat16 or float32 (model.compute_dtype), not float16.",
    )
