"""`--deepspeed=ds_config.json`: DeepSpeed's own example configs run as they are; every mapped key
lands on its jaxzero setting; DeepSpeed's batch rule and schedules hold; bad files are refused with the
key path. The configs in tests/deepspeed_configs/ are written out from DeepSpeed's documentation:
getting_started (Getting Started), zero_offload (ZeRO-Offload tutorial, its JSON made valid),
zero_infinity_cpu (ZeRO tutorial, ZeRO-Infinity), zero_infinity_nvme (ZeRO-3 docs, NVMe), the config
reference's examples together (config_reference), and the Hugging Face Trainer's ZeRO-3 "auto" one."""

import dataclasses
import json
import math
from pathlib import Path

import jax.numpy as jnp
import pytest
from subprocess_run import run_module

from jaxzero import deepspeed
from jaxzero.config import ConfigError, TrainConfig
from jaxzero.config.checks import resolve_batch, validate
from jaxzero.numerics.optim import learning_rate_schedule
from jaxzero.overrides import apply_overrides, layer, split_args

CONFIGS = Path(__file__).parent / "deepspeed_configs"
TB, MB, GAS = "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"


def configure(*argv: str) -> tuple[TrainConfig, deepspeed.Translation | None]:
    layered = layer(TrainConfig(), split_args(list(argv)))
    validate(layered.config)
    return layered.config, layered.deepspeed


def translate(ds: dict, base: TrainConfig | None = None) -> deepspeed.Translation:
    return deepspeed.translate(ds, base or TrainConfig(), "ds.json")


# ---------------------------------------------------------------------------------------------------
# DeepSpeed's own configs, end to end through the CLI
# ---------------------------------------------------------------------------------------------------


@pytest.mark.slow  # the CLI in subprocesses
@pytest.mark.parametrize(
    "name, extra, expect",
    [
        ("getting_started", [], "resident"),
        ("zero_offload", [], "ZeRO-Offload"),
        ("zero_infinity_nvme", ["--offload.disk_path={tmp}/nvme"], "on local disk"),
        ("config_reference", [], "block inputs wait in pinned host memory"),
    ],
)
def test_deepspeed_configs_train(tmp_path, name, extra, expect):
    """A few steps of each on CPU: the run starts with the placement the file asks for, its loss is
    finite, and config.json holds the resolved settings."""
    run_dir = tmp_path / "run"
    args = [f"--deepspeed={CONFIGS / name}.json", "--steps=3", f"--run_dir={run_dir}", "--data.seq_len=32"]
    args += ["--logging.samples=0", "--logging.eval_every=0", *(e.format(tmp=tmp_path) for e in extra)]
    proc = run_module("jaxzero.train", *args, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert f"--deepspeed={CONFIGS / name}.json: " in proc.stdout and expect in proc.stdout
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert records and all(math.isfinite(r["loss"]) for r in records if "loss" in r)
    saved = json.loads((run_dir / "config.json").read_text())
    assert saved["data"]["micro_batch_size"] == 0 and saved["data"]["batch_size"] >= 1  # resolved


def test_tutorial_configs_map_to_their_placements():
    cfg, t = configure(f"--deepspeed={CONFIGS / 'zero_offload.json'}")
    assert (cfg.parallel.zero_stage, cfg.offload.optimizer, cfg.offload.params) == (2, "cpu", "none")
    assert any(line.startswith("zero_optimization.overlap_comm:") for line in t.ignored)
    cfg, t = configure(f"--deepspeed={CONFIGS / 'zero_infinity_cpu.json'}")
    assert (cfg.parallel.zero_stage, cfg.offload.optimizer, cfg.offload.params) == (3, "cpu", "cpu")
    assert {line.split(":")[0] for line in t.ignored} >= {
        "zero_optimization.stage3_max_live_parameters",
        "zero_optimization.sub_group_size",
        "zero_optimization.reduce_bucket_size",
    }
    cfg, _ = configure(f"--deepspeed={CONFIGS / 'zero_infinity_nvme.json'}")
    assert (cfg.offload.optimizer, cfg.offload.params, cfg.offload.disk_path) == ("disk", "cpu", "/nvme_data")
    cfg, _ = configure(f"--deepspeed={CONFIGS / 'getting_started.json'}")
    assert (cfg.parallel.zero_stage, cfg.model.compute_dtype, cfg.optimizer.name) == (1, "float16", "adamw")
    assert (cfg.data.batch_size, cfg.data.grad_accum, cfg.optimizer.lr) == (8, 1, 0.00015)
    assert (cfg.optimizer.b1, cfg.optimizer.b2, cfg.optimizer.weight_decay) == (0.9, 0.999, 0.0)  # torch's


def test_config_reference_maps_every_key():
    cfg, t = configure(f"--deepspeed={CONFIGS / 'config_reference.json'}", "--model.name=llama-tiny")
    o, d, f = cfg.optimizer, cfg.data, cfg.fp16
    assert (d.micro_batch_size, d.grad_accum, d.batch_size) == (2, 2, 0)
    assert resolve_batch(cfg, 4).data.batch_size == 16  # 2 x 2 x 4 devices
    assert (o.name, o.lr, o.b1, o.b2, o.eps, o.weight_decay, o.grad_clip) == (
        "adamw",
        0.001,
        0.8,
        0.999,
        1e-8,
        3e-7,
        1.0,
    )
    assert (o.schedule, o.warmup_steps, o.warmup_type, o.warmup_start_ratio) == ("constant", 1000, "log", 0.0)
    assert cfg.model.compute_dtype == "float16"
    assert (f.initial_scale_power, f.loss_scale_window, f.hysteresis, f.min_loss_scale) == (16, 1000, 2, 1.0)
    assert (cfg.parallel.zero_stage, cfg.offload.params, cfg.offload.optimizer) == (3, "cpu", "cpu")
    assert cfg.offload.device_state_units == round(0.7 * (cfg.model.num_layers + 2))  # ratio 0.3 on the host
    assert cfg.offload.activations == "cpu"  # cpu_checkpointing
    assert cfg.logging.log_every == 1 and cfg.logging.tensorboard is True
    ignored = {line.split(":")[0] for line in t.ignored}
    assert {"wall_clock_breakdown", "flops_profiler", "tensorboard.output_path", "fp16.auto_cast"} <= ignored
    assert "zero_optimization.offload_param.buffer_size" in ignored
    assert "DeepSpeed keys with no meaning" in t.report()


def test_hf_trainer_auto_values_keep_jaxzero_settings():
    """ "auto" leaves each key to jaxzero's own value, command line included, as the HF Trainer fills
    them from its arguments."""
    cfg, _ = configure(
        f"--deepspeed={CONFIGS / 'hf_trainer_auto.json'}", "--optimizer.lr=2e-4", "--data.batch_size=12"
    )
    default = TrainConfig()
    assert cfg.optimizer.lr == 2e-4 and cfg.data.batch_size == 12 and cfg.data.grad_accum == 1
    assert (cfg.optimizer.b1, cfg.optimizer.b2, cfg.optimizer.weight_decay) == (
        default.optimizer.b1,
        default.optimizer.b2,
        default.optimizer.weight_decay,
    )
    assert cfg.optimizer.grad_clip == default.optimizer.grad_clip
    assert cfg.model.compute_dtype == default.model.compute_dtype
    assert cfg.optimizer.schedule == "linear" and cfg.optimizer.min_lr_ratio == 0.0  # WarmupDecayLR
    assert cfg.optimizer.decay_steps == 0 and cfg.optimizer.warmup_steps == default.optimizer.warmup_steps
    assert (cfg.parallel.zero_stage, cfg.offload.params, cfg.offload.optimizer) == (3, "cpu", "cpu")
    assert cfg.logging.log_every == 2000


def test_command_line_overrides_the_file():
    cfg, _ = configure(
        f"--deepspeed={CONFIGS / 'zero_offload.json'}", "--offload.optimizer=none", "--parallel.zero_stage=1"
    )
    assert (cfg.offload.optimizer, cfg.parallel.zero_stage) == ("none", 1)
    # The file's precision applies to a model the command line names.
    cfg, _ = configure(f"--deepspeed={CONFIGS / 'getting_started.json'}", "--model.name=gpt2-tiny")
    assert cfg.model.compute_dtype == "float16" and cfg.model.family == "gpt2"


# ---------------------------------------------------------------------------------------------------
# The batch rule: train_batch_size = micro x accumulation x devices
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "ds, devices, batch, accum",
    [
        ({"train_batch_size": 32}, 4, 32, 1),
        ({"train_micro_batch_size_per_gpu": 2}, 4, 8, 1),
        ({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3}, 4, 24, 3),
        ({"train_batch_size": 32, "gradient_accumulation_steps": 2}, 4, 32, 2),
        ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 2}, 4, 32, 4),
        ({TB: 16, MB: 2, GAS: 2}, 4, 16, 2),
        ({TB: 4, MB: 2, GAS: 2}, 1, 4, 2),
    ],
)
def test_batch_rule_and_inference(ds, devices, batch, accum):
    cfg = resolve_batch(_with_data(ds), devices)
    assert (cfg.data.batch_size, cfg.data.grad_accum, cfg.data.micro_batch_size) == (batch, accum, 0)
    validate(cfg, num_devices=devices)
    if "train_micro_batch_size_per_gpu" in ds:  # each device's micro-batch is the one asked for
        assert batch // accum // devices == ds["train_micro_batch_size_per_gpu"]


def _with_data(ds: dict) -> TrainConfig:
    """The defaults with the data.* keys `ds` translates to."""
    overrides = translate(ds).overrides
    data = {k.split(".")[1]: v for k, v in overrides.items() if k.startswith("data.")}
    cfg = TrainConfig()
    return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, **data))


def test_batch_rule_broken_is_refused_with_the_arithmetic():
    cfg = _with_data({TB: 30, MB: 2, GAS: 2})
    validate(cfg)  # consistent for some device count: checked once the devices are known
    with pytest.raises(ConfigError, match=r"2 x 2 x 4 = 16"):
        resolve_batch(cfg, 4)
    cfg = _with_data({"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4})
    with pytest.raises(ConfigError, match=r"30 / 16 is not a whole number.*e\.g\. 32"):
        resolve_batch(cfg, 4)
    with pytest.raises(ConfigError, match="gradient_accumulation_steps: 4 is given without"):
        translate({"gradient_accumulation_steps": 4})


# ---------------------------------------------------------------------------------------------------
# Schedules: DeepSpeed's formulas (deepspeed/runtime/lr_schedules.py) at each update count
# ---------------------------------------------------------------------------------------------------


def _ds_gamma_warmup(n: int, warmup: int, kind: str) -> float:
    warmup = max(2, warmup)
    return math.log(n + 1) / math.log(warmup) if kind == "log" else n / warmup


@pytest.mark.parametrize("kind", ["log", "linear"])
def test_warmup_lr_equals_deepspeeds_formula(kind):
    ds = {"scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 1e-4, "warmup_max_lr": 1e-3}}}
    ds["scheduler"]["params"].update(warmup_num_steps=10, warmup_type=kind)
    cfg, _ = _with(ds)
    lr = learning_rate_schedule(cfg.optimizer, 100)
    for n in range(0, 30):
        gamma = _ds_gamma_warmup(n, 10, kind) if n < 10 else 1.0
        assert float(lr(jnp.int32(n))) == pytest.approx(1e-4 + (1e-3 - 1e-4) * gamma, rel=1e-6), n


def test_warmup_decay_lr_equals_deepspeeds_formula():
    ds = {"scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 50, "warmup_num_steps": 10}}}
    cfg, _ = _with(ds)
    lr = learning_rate_schedule(cfg.optimizer, cfg.schedule_steps)
    for n in range(0, 60):
        gamma = _ds_gamma_warmup(n, 10, "log") if n < 10 else max(0.0, (50 - n) / (50 - 10))
        assert float(lr(jnp.int32(n))) == pytest.approx(1e-3 * gamma, rel=1e-5, abs=1e-12), n


def test_warmup_cosine_lr_follows_deepspeeds_curve():
    """Warmup as DeepSpeed's; the cosine phase equals DeepSpeed's formula one count later (its cosine
    counts from warmup_num_steps - 1), ending at the same floor."""
    params = {"total_num_steps": 40, "warmup_num_steps": 8, "warmup_min_ratio": 0.1, "cos_min_ratio": 0.05}
    ds = {"optimizer": {"type": "AdamW", "params": {"lr": 2e-3}}, "scheduler": {"type": "WarmupCosineLR"}}
    ds["scheduler"]["params"] = {**params, "warmup_type": "linear"}
    cfg, _ = _with(ds)
    lr = learning_rate_schedule(cfg.optimizer, cfg.schedule_steps)

    def ds_warmup(n: int) -> float:
        return 0.1 + (n / 8) * 0.9

    def ds_cosine(n: int) -> float:
        progress = min(1.0, (n - 8 + 1) / (40 - 8))
        return 0.05 + 0.95 * (1 + math.cos(math.pi * progress)) / 2

    for n in range(0, 8):
        assert float(lr(jnp.int32(n))) == pytest.approx(2e-3 * ds_warmup(n), rel=1e-5), n
    for n in range(8, 50):
        assert float(lr(jnp.int32(n))) == pytest.approx(2e-3 * ds_cosine(n - 1), rel=1e-5, abs=1e-9), n


def _with(ds: dict) -> tuple[TrainConfig, deepspeed.Translation]:
    t = translate(ds)
    cfg = apply_overrides(TrainConfig(), t.overrides)
    validate(cfg)
    return cfg, t


# ---------------------------------------------------------------------------------------------------
# Refusals: unknown keys, wrong types, features jaxzero does not run, unreadable files
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "ds, message",
    [
        ({"train_batch_sise": 8}, r"train_batch_sise: not a DeepSpeed key.*Did you mean 'train_batch_size'"),
        ({"zero_optimization": {"stag": 2}}, r"zero_optimization\.stag: .*Did you mean 'stage'"),
        ({"zero_optimization": {"offload_optimizer": {"device": "gpu"}}}, r"optimizer\.device: 'gpu'"),
        ({"zero_optimization": {"stage": "3"}}, r"zero_optimization\.stage: '3' must be an integer"),
        ({"zero_optimization": {"stage": 4}}, r"must be 0, 1, 2 or 3"),
        ({"train_batch_size": 0}, r"train_batch_size: 0 must be >= 1"),
        ({"optimizer": {"type": "OneBitAdam"}}, r"optimizer\.type: 'OneBitAdam'"),
        ({"optimizer": {"type": "Adam", "params": {"lr": "fast"}}}, r"params\.lr: 'fast' must be a number"),
        ({"optimizer": {"type": "Adam", "params": {"adam_w_mode": False, "weight_decay": 0.01}}}, "L2"),
        ({"optimizer": {"type": "Adam", "params": {"betas": [0.9]}}}, "list of two numbers"),
        ({"scheduler": {"type": "OneCycle", "params": {}}}, r"scheduler\.type: 'OneCycle'"),
        ({"scheduler": {"type": "WarmupDecayLR", "params": {}}}, "needs total_num_steps"),
        ({"scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 0, "warmup_min_lr": 0}}}, "in \\["),
        ({"fp16": {"enabled": True, "loss_scale": 128}}, "static loss scale"),
        ({"fp16": {"enabled": True}, "bf16": {"enabled": True}}, "both enabled"),
        ({"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}}, "needs ZeRO stage 3"),
        ({"zero_optimization": {"zero_quantized_weights": True}}, "ZeRO\\+\\+ quantization"),
        ({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}}, "needs offload_optimizer"),
        ({"curriculum_learning": {"enabled": True}}, r"curriculum_learning\.enabled: jaxzero does not run"),
        ({"sparse_attention": {"mode": "fixed"}}, "sparse attention"),
        ({"tensor_parallel": {"autotp_size": 2}}, "no tensor parallelism"),
        ({"zero_optimization": {"offload_optimizer": {"device": "nvme", "ratio": 0.5}}}, 'cpu" only'),
    ],
)
def test_bad_configs_are_refused_naming_the_key(ds, message):
    with pytest.raises(ConfigError, match=message):
        translate(ds)


def test_unreadable_files_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        split_args([f"--deepspeed={tmp_path / 'missing.json'}"])
    with pytest.raises(ConfigError, match="a directory, not a JSON file"):
        split_args([f"--deepspeed={tmp_path}"])
    # The ZeRO-Offload tutorial's snippet as printed: a comma missing, one too many.
    (tmp_path / "as_printed.json").write_text(
        '{\n  "zero_optimization": {\n    "stage": 2,\n    "offload_optimizer": {\n      "device": "cpu",\n'
        '    }\n    "contiguous_gradients": true\n  }\n}\n'
    )
    with pytest.raises(ConfigError, match=r"not valid JSON: .* at line 6, column 5"):
        split_args([f"--deepspeed={tmp_path / 'as_printed.json'}"])
    (tmp_path / "list.json").write_text("[1, 2]")
    with pytest.raises(ConfigError, match="holds a JSON list"):
        split_args([f"--deepspeed={tmp_path / 'list.json'}"])


@pytest.mark.slow  # the CLI in subprocesses
def test_bad_file_fails_before_anything_is_written(tmp_path):
    (tmp_path / "ds.json").write_text(json.dumps({"zero_optimization": {"stage": 2, "overlap_com": True}}))
    proc = run_module(
        "jaxzero.train", f"--deepspeed={tmp_path / 'ds.json'}", f"--run_dir={tmp_path / 'run'}", cwd=tmp_path
    )
    assert proc.returncode == 2
    assert "zero_optimization.overlap_com" in proc.stderr and "Did you mean 'overlap_comm'" in proc.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.slow  # the CLI in subprocesses
def test_resume_with_the_same_file_and_a_changed_batch(tmp_path):
    """The batch sizes a DeepSpeed file derives are compared with the checkpointed run's once they
    are resolved: the same file resumes, another micro-batch is refused."""
    ds = {MB: 2, GAS: 2, "zero_optimization": {"stage": 0}}
    (tmp_path / "ds.json").write_text(json.dumps(ds))

    def train(steps: int):
        return run_module(
            "jaxzero.train",
            f"--deepspeed={tmp_path / 'ds.json'}",
            f"--steps={steps}",
            f"--run_dir={tmp_path / 'r'}",
            *("--data.seq_len=16", "--logging.samples=0", "--logging.eval_every=0", "--logging.log_every=1"),
            cwd=tmp_path,
        )

    first = train(2)
    assert first.returncode == 0, first.stderr
    again = train(3)
    assert again.returncode == 0, again.stderr
    last = json.loads((tmp_path / "r" / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["step"] == 3
    ds[MB] = 1
    (tmp_path / "ds.json").write_text(json.dumps(ds))
    changed = train(4)
    assert changed.returncode == 2 and "data.batch_size (4 -> 2)" in changed.stderr


def test_batch_keys_validated_before_the_devices_are_known():
    cfg = TrainConfig()
    two_derived = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, batch_size=0, grad_accum=0))
    with pytest.raises(ConfigError, match="except one of them 0"):
        validate(two_derived)
    unresolved = _with_data({MB: 2})
    validate(unresolved)
    with pytest.raises(ConfigError, match="resolve_batch"):
        validate(unresolved, num_devices=4)
    assert resolve_batch(cfg, 4) is cfg  # nothing to derive: the config as it is


# ---------------------------------------------------------------------------------------------------
# Refusals of the file's values in the file's words: its path, its keys and values, the arithmetic
# ---------------------------------------------------------------------------------------------------


def refusal(tmp_path: Path, ds: dict, *argv: str) -> str:
    """The one-line refusal of `--deepspeed=FILE` holding `ds` (FILE's path at its start, checked)."""
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(ds))
    with pytest.raises(ConfigError) as e:
        configure(f"--deepspeed={path}", *argv)
    message = str(e.value)
    assert message.startswith(f"--deepspeed={path}: ") and "\n" not in message, message
    return message[len(f"--deepspeed={path}: ") :]


@pytest.mark.parametrize(
    "ds, says",
    [
        (
            {TB: 1, GAS: 4},
            "train_batch_size=1 must equal train_micro_batch_size_per_gpu x gradient_accumulation_steps=4 x "
            "GPUs, so train_micro_batch_size_per_gpu = 1 / (4 x GPUs) is not a whole number on any number of "
            "GPUs: make train_batch_size a multiple of 4 (e.g. 4), or change gradient_accumulation_steps.",
        ),
        (
            {TB: 10, MB: 2, GAS: 2},
            "train_batch_size=10 must equal train_micro_batch_size_per_gpu=2 x gradient_accumulation_steps=2 "
            "x GPUs = 4 x GPUs, and 10 is not a multiple of 4",
        ),
        (
            {TB: 30, MB: 4},
            "train_batch_size=30 must equal train_micro_batch_size_per_gpu=4 x gradient_accumulation_steps x "
            "GPUs, so gradient_accumulation_steps = 30 / (4 x GPUs) is not a whole number",
        ),
        ({"optimizer": {"type": "AdamW", "params": {"lr": -1}}}, "optimizer.params.lr=-1 must be > 0."),
        ({"optimizer": {"type": "AdamW", "params": {"lr": float("inf")}}}, "lr=Infinity must be a finite"),
        (
            {"optimizer": {"type": "Adam", "params": {"betas": [0.9, 1.5]}}},
            "optimizer.params.betas=[0.9, 1.5] must hold betas in [0, 1).",
        ),
        ({"optimizer": {"type": "Adam", "params": {"eps": 0}}}, "optimizer.params.eps=0 must be > 0"),
        (
            {"optimizer": {"type": "AdamW", "params": {"weight_decay": -0.1}}},
            "weight_decay=-0.1 must be >= 0.",
        ),
        ({"optimizer": {"type": "SGD", "params": {"momentum": 1}}}, "momentum=1 must be in [0, 1)."),
        (
            {"scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 0}}},
            "scheduler.params.warmup_max_lr=0 must be > 0.",
        ),
        (
            {"scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 9, "cos_min_ratio": 2}}},
            "scheduler.params.cos_min_ratio=2 must be in [0, 1]",
        ),
        (
            {
                "scheduler": {
                    "type": "WarmupCosineLR",
                    "params": {"total_num_steps": 9, "warmup_min_ratio": -1},
                }
            },
            "scheduler.params.warmup_min_ratio=-1 must be in [0, 1]",
        ),
        (
            {"scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 0}}},
            'scheduler.params.total_num_steps: 0 must be >= 1 ("auto": the run\'s steps).',
        ),
        (
            {"fp16": {"enabled": True, "initial_scale_power": 70}},
            "fp16.initial_scale_power=70 must be in [0, 64]",
        ),
        (
            {"fp16": {"enabled": True, "initial_scale_power": 2, "min_loss_scale": 16}},
            "fp16.initial_scale_power=2 starts the loss scale at 2**2 = 4, below fp16.min_loss_scale=16: "
            "raise initial_scale_power to at least 4, or lower min_loss_scale.",
        ),
        ({"fp16": {"enabled": True, "hysteresis": 0}}, "fp16.hysteresis=0 must be >= 1."),
        ({"fp16": {"enabled": True, "loss_scale_window": 0}}, "fp16.loss_scale_window=0 must be >= 1."),
        ({"fp16": {"enabled": True, "min_loss_scale": 0}}, "fp16.min_loss_scale=0 must be > 0."),
        (
            {"fp16": {"enabled": True, "fp16_master_weights_and_grads": True}},
            "fp16.fp16_master_weights_and_grads: true: jaxzero's masters are float32",
        ),
        (
            {"fp16": {"enabled": True}, "bf16": {"enabled": True}},
            "fp16.enabled: true, and bf16.enabled is true: fp16 and bf16 are both enabled",
        ),
        (
            {"optimizer": {"type": "Adam", "params": {"amsgrad": True}}},
            "optimizer.params.amsgrad: true: AMSGrad is not offered; set it false.",
        ),
        (
            {"zero_optimization": {"stage": 0, "offload_optimizer": {"device": "cpu"}}},
            'zero_optimization.offload_optimizer.device="cpu" needs ZeRO stage 1, 2 or 3 (as in DeepSpeed: '
            "the offloaded state is one shard per GPU), but zero_optimization.stage=0.",
        ),
        (
            {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "ratio": 0.01}}},
            "zero_optimization.offload_optimizer.ratio=0.01 keeps round((1 - ratio) x 6 units) = 6 units' "
            "optimizer state on the GPU: all of the model's units (embedding, 4 blocks, head)",
        ),
        (
            {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme", "ratio": 0.5}}},
            'zero_optimization.offload_optimizer.ratio: 0.5 applies with device "cpu" only; '
            'offload_optimizer.device is "nvme".',
        ),
        (
            {"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}},
            'zero_optimization.offload_param: device "cpu" without offload_optimizer',
        ),
        (
            {
                "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme"}},
                "fp16": {"enabled": True},
            },
            'zero_optimization.offload_optimizer.device="nvme" needs the fused host update, which updates '
            "the state read from disk in place, but with fp16.enabled=true the update is optax's on XLA:CPU.",
        ),
        (
            {"zero_optimization": {"stage": 2}, "activation_checkpointing": {"cpu_checkpointing": True}},
            "activation_checkpointing.cpu_checkpointing=true needs the offload engine, which keeps block "
            "inputs in host memory while the optimizer state is offloaded, but "
            "zero_optimization.offload_optimizer (left out).",
        ),
        (
            {"activation_checkpointing": {"cpu_checkpointing": True}},
            "activation_checkpointing.cpu_checkpointing=true needs the offload engine, which keeps block "
            "inputs in host memory while the optimizer state is offloaded, but zero_optimization (left out). "
            'Add zero_optimization.offload_optimizer with device "cpu", or set cpu_checkpointing false.',
        ),
    ],
)
def test_a_refusal_of_the_files_value_names_its_keys_and_values(tmp_path, ds, says):
    message = refusal(tmp_path, ds)
    assert says in message, message
    jaxzero_keys = [k for k in ("data.", "optimizer.lr=", "offload.", "parallel.", "model.") if k in message]
    assert not jaxzero_keys, f"{message} names jaxzero's keys {jaxzero_keys}"


def test_a_value_the_command_line_changed_is_named_as_jaxzeros(tmp_path):
    # The file's own value, changed on the command line: nothing of the file to refuse.
    configure(*_file(tmp_path, {"optimizer": {"type": "AdamW", "params": {"lr": -1}}}), "--optimizer.lr=1e-4")
    # A combination of the file's value and the command line's names each as its source writes it.
    message = refusal(
        tmp_path,
        {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}},
        "--parallel.zero_stage=0",
    )
    assert 'zero_optimization.offload_optimizer.device="cpu" needs ZeRO stage 1, 2 or 3' in message
    assert "but parallel.zero_stage=0." in message
    message = refusal(tmp_path, {TB: 8, GAS: 2}, "--data.grad_accum=3")
    assert message.startswith(
        "train_batch_size=8 must equal train_micro_batch_size_per_gpu x data.grad_accum=3"
    )
    # A refusal of the command line's values alone stays jaxzero's.
    with pytest.raises(ConfigError, match=r"^optimizer\.lr=-1\.0 must be > 0\.$"):
        configure(*_file(tmp_path, {"zero_optimization": {"stage": 2}}), "--optimizer.lr=-1")


def test_other_refusals_of_the_files_keys_carry_them(tmp_path):
    """A rule not phrased in DeepSpeed's words still names the file's keys that it read."""
    message = refusal(tmp_path, {"zero_optimization": {"stage": 2}}, "--offload.resident_blocks=1")
    assert message == (
        "offload.resident_blocks only applies with offload.params=cpu (got offload.params=none). (from the "
        "file: zero_optimization.offload_param (left out) as offload.params)"
    )


def _file(tmp_path: Path, ds: dict) -> list[str]:
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(ds))
    return [f"--deepspeed={path}"]


@pytest.mark.parametrize(
    "ds, says",
    [
        (
            {TB: 6, MB: 1, GAS: 2, "zero_optimization": {"stage": 0}},
            "train_batch_size=6 must equal train_micro_batch_size_per_gpu=1 x gradient_accumulation_steps=2 "
            "x 4 GPUs = 8: change one of them (on 4 GPUs, train_batch_size=8), or leave one out to have it "
            "derived.",
        ),
        (
            {TB: 8, GAS: 4, "zero_optimization": {"stage": 0}},
            "train_batch_size=8 must equal train_micro_batch_size_per_gpu x gradient_accumulation_steps=4 x "
            "4 GPUs, so train_micro_batch_size_per_gpu = 8 / (4 x 4 GPUs) = 8 / 16 is not a whole number: "
            "make train_batch_size a multiple of 16 (e.g. 16), or change gradient_accumulation_steps.",
        ),
        (
            {TB: 12, MB: 2, "zero_optimization": {"stage": 0}},
            "so gradient_accumulation_steps = 12 / (2 x 4 GPUs) = 12 / 8 is not a whole number: make "
            "train_batch_size a multiple of 8 (e.g. 16), or change train_micro_batch_size_per_gpu.",
        ),
    ],
)
def test_the_batch_rule_for_the_gpus_found_in_the_files_words(tmp_path, capsys, ds, says):
    """Consistent for some GPU count, refused for the 4 devices the tests run on: `python -m
    jaxzero.train` in-process, exit 2, nothing written."""
    from jaxzero.cli import train as train_lib  # the program: imported by its test only

    run_dir = tmp_path / "run"
    code = train_lib.main([*_file(tmp_path, ds), f"--run_dir={run_dir}", "--data.seq_len=16"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert f"jaxzero: config error: --deepspeed={tmp_path / 'ds_config.json'}: " in err and says in err, err
    assert not run_dir.exists()


def test_the_planner_refuses_the_batch_in_the_files_words(tmp_path, capsys):
    from jaxzero.cli.plan import main as plan_main  # the program: imported by its test only

    ds = {TB: 6, MB: 1, GAS: 2, "zero_optimization": {"stage": 0}}
    assert plan_main([*_file(tmp_path, ds), "--machine.gpu_gib=80", "--machine.host_gib=64"]) == 2
    assert (
        "train_batch_size=6 must equal train_micro_batch_size_per_gpu=1 x gradient_accumulation_steps=2 x 1 "
        "GPU = 2" in capsys.readouterr().err
    )


@pytest.mark.parametrize("ratio, units", [(None, -1), (1.0, 0), (0.5, 3)])
def test_an_offload_ratio_names_the_units_on_the_gpu_and_none_leaves_them_to_the_planner(ratio, units):
    """DeepSpeed's `offload_optimizer.ratio` (the share of the state on the CPU) is a placement named:
    1.0 pins every unit's state to the host as DeepSpeed keeps it; without one jaxzero's planner may
    keep the first units' state on the GPU (offload.device_state_units=-1)."""
    section = {"device": "cpu", **({} if ratio is None else {"ratio": ratio})}
    base = apply_overrides(TrainConfig(), {"model.name": "llama-tiny"})  # 6 units
    t = translate({"zero_optimization": {"stage": 2, "offload_optimizer": section}}, base)
    assert apply_overrides(base, t.overrides).offload.device_state_units == units


def test_the_report_marks_the_settings_the_command_line_overrode(tmp_path):
    """The "settings read" list printed values the command line then overrode, as if they applied."""
    (tmp_path / "ds.json").write_text(json.dumps({"train_batch_size": 16, "optimizer": {
        "type": "AdamW", "params": {"lr": 3e-4, "weight_decay": 0.01}}}))  # fmt: skip
    cfg, t = configure(f"--deepspeed={tmp_path / 'ds.json'}", "--optimizer.lr=1e-3")
    assert cfg.optimizer.lr == 1e-3 and cfg.optimizer.weight_decay == 0.01
    report = t.report().splitlines()
    assert "  optimizer.lr=0.0003 (not used: the command line's optimizer.lr=1e-3)" in report
    assert "  optimizer.weight_decay=0.01" in report
