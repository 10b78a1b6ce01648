"""Config validation: every cross-field rule gives its clear message, before anything is built."""

import pytest

from jaxzero.config import ConfigError, TrainConfig, validate
from jaxzero.overrides import apply_overrides, parse_args


@pytest.mark.parametrize(
    "args, message",
    [
        (["--steps=0"], "steps=0 must be >= 1"),
        (["--model.hidden_size=130"], "model.hidden_size=130 must be divisible by model.num_heads=4"),
        (["--model.num_kv_heads=3"], "model.num_heads=4 must be divisible by model.num_kv_heads=3"),
        (["--data.seq_len=4096"], "data.seq_len=4096 exceeds model.max_seq_len=1024"),
        (
            ["--data.batch_size=10", "--data.grad_accum=4"],
            "data.batch_size=10 must be a positive multiple of",
        ),
        (["--data.source=tokens"], "data.source=tokens needs data.path=DIR"),
        (
            ["--data.path=/data/owt"],
            "data.path='/data/owt' is read only with data.source=tokens, but data.source=builtin",
        ),
        (["--data.path=d", "--data.source=synthetic"], "Add --data.source=tokens to train on its train.bin"),
        (["--optimizer.name=adamx"], "optimizer.name='adamx' is not one of ['adamw', 'adam', 'lion', 'sgd']"),
        (["--optimizer.lr=0"], "optimizer.lr=0.0 must be > 0"),
        (["--optimizer.b2=1.0"], "must be in [0, 1)"),
        (["--optimizer.grad_clip=-1"], "optimizer.grad_clip=-1.0 must be >= 0"),
        (
            ["--offload.params=cpu", "--offload.optimizer=none"],
            "offload.params=cpu needs offload.optimizer=cpu",
        ),
        (
            ["--offload.params=none", "--offload.resident_blocks=2"],
            "offload.resident_blocks only applies with offload.params=cpu",
        ),
        (
            ["--offload.optimizer=cpu", "--offload.params=cpu", "--offload.resident_blocks=9"],
            "offload.resident_blocks=9 exceeds model.num_layers=4",
        ),
        (["--model.name=gpt2-tiny", "--model.num_kv_heads=2"], "gpt2 uses multi-head attention"),
        (["--logging.log_every=0"], "logging.log_every=0 must be >= 1"),
        (
            ["--model.name=gpt2-tiny", "--model.rope_type=llama3", "--model.attention_bias=true"],
            "model.rope_type='llama3', model.attention_bias=True: Llama-family settings; gpt2 has none",
        ),
        (["--model.hf_model_type=qwen2"], "model.hf_model_type='qwen2' needs model.attention_bias=true"),
        (
            ["--model.attention_bias=true", "--model.hf_model_type=mistral"],
            "model.attention_bias=true has no mistral counterpart",
        ),
        (["--model.hf_model_type=gpt2"], "model.hf_model_type='gpt2' cannot describe a llama model"),
        (
            ["--model.rope_type=llama3", "--model.rope_factor=8", "--model.rope_low_freq_factor=4"],
            "needs 0 < model.rope_low_freq_factor < model.rope_high_freq_factor; got 4.0 and 4.0",
        ),
        (["--model.rope_type=linear", "--model.rope_factor=0.5"], "model.rope_factor=0.5 must be >= 1"),
        (
            ["--model.sliding_window=64", "--data.seq_len=128"],
            "data.seq_len=128 exceeds model.sliding_window=64",
        ),
    ],
)
def test_error_messages(args, message):
    """Impossible values and combinations are refused with the numbers and the fix."""
    with pytest.raises(ConfigError) as e:
        parse_args(args)
    assert message in str(e.value)


def test_mesh_divisibility_checked_with_device_count():
    cfg = apply_overrides(TrainConfig(), {"data.batch_size": "6"})
    validate(cfg)
    with pytest.raises(ConfigError, match="4 devices of the data axis; e.g. data.batch_size=8"):
        validate(cfg, num_devices=4)


@pytest.mark.parametrize("written, name", [("Adam", "adam"), ("ADAMW", "adamw"), ("Lion", "lion")])
def test_choices_are_case_insensitive(written, name):
    """DeepSpeed and PyTorch spell optimizers `Adam`, `AdamW`: a choice matches whatever its case, and
    the config holds the canonical spelling (config.json, the resume guard)."""
    assert parse_args([f"--optimizer.name={written}"]).optimizer.name == name
    assert parse_args(["--model.compute_dtype=BFloat16"]).model.compute_dtype == "bfloat16"
