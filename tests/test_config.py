"""Config validation: every cross-field rule gives its clear message, before anything is built; and
named sizes resolve by ModelConfig.named, as --model.name does."""

import json

import pytest

from jaxzero.config import CheckpointConfig, ConfigError, ModelConfig, OffloadConfig, TrainConfig
from jaxzero.config.checks import validate
from jaxzero.config.keys import config_from_dict
from jaxzero.models.sizes import NAMED_SIZES, param_count
from jaxzero.overrides import apply_overrides, parse_args
from jaxzero.planner import memory


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
        (["--steps=99999999999999999999"], "steps=99999999999999999999 must be below 2**31"),
        # one message per value, naming only the wrong one (it listed every checkpoint condition)
        (["--checkpoint.keep=0"], "checkpoint.keep=0 must be >= 1: the newest checkpoints kept."),
        (["--checkpoint.every=-1"], "checkpoint.every=-1 must be >= 0 (0: a checkpoint at the end only)."),
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
        (["--model.hf_model_type=qwen3"], "model.hf_model_type='qwen3' needs model.qk_norm=true"),
        (
            ["--model.qk_norm=true", "--model.attention_bias=true", "--model.hf_model_type=qwen2"],
            "model.qk_norm=true has no qwen2 counterpart",
        ),
        (["--model.head_size=64"], "model.head_size=64 x model.num_heads=4 != model.hidden_size=128"),
        (["--model.name=gpt2-tiny", "--model.qk_norm=true"], "model.qk_norm=True: Llama-family settings"),
        (["--model.head_size=-1"], "model.head_size=-1 must be >= 1, or 0"),
        (["--model.sliding_window_pattern=6"], "model.sliding_window_pattern=6: Gemma 3 settings"),
        (
            ["--model.family=gemma3", "--model.tie_embeddings=true"],
            "model.family=gemma3 needs model.sliding_window_pattern >= 1 (every N-th layer global); "
            "model.rope_local_theta > 0",
        ),
        (["--model.name=gemma-3-1b", "--model.tie_embeddings=false"], "needs model.tie_embeddings=true"),
        (["--model.qk_norm=true", "--model.head_size=33"], "rotary embeddings need an even head_dim; got 33"),
        (
            ["--model.rope_type=llama3", "--model.rope_factor=8", "--model.rope_low_freq_factor=4"],
            "needs 0 < model.rope_low_freq_factor < model.rope_high_freq_factor; got 4.0 and 4.0",
        ),
        (["--model.rope_type=linear", "--model.rope_factor=0.5"], "model.rope_factor=0.5 must be >= 1"),
        (["--model.hf_model_type=mixtral"], "model.hf_model_type='mixtral' needs model.num_experts >= 1"),
        (["--model.num_experts=4"], "model.moe_intermediate_size=0 (each expert's width, >= 1)"),
        (
            ["--model.num_experts=4", "--model.moe_intermediate_size=64", "--model.num_experts_per_tok=5"],
            "model.num_experts_per_tok=5 (1 .. num_experts=4)",
        ),
        (
            ["--model.num_experts=4", "--model.moe_intermediate_size=64", "--model.hf_model_type=qwen3"],
            "model.hf_model_type='qwen3' (a dense type; use qwen3_moe, mixtral, granitemoe or '')",
        ),
        (
            ["--model.name=gemma-3-1b", "--model.num_experts=4", "--model.moe_intermediate_size=64"],
            "model.family='gemma3' (experts are the llama family's)",
        ),
        (
            [
                "--model.sliding_window=64",
                "--model.hf_model_type=qwen3",
                "--model.qk_norm=true",
                "--data.seq_len=128",
            ],
            "data.seq_len=128 exceeds model.sliding_window=64 of a qwen3 model: its window covers only",
        ),
        # Phi-3's and OLMo 2's block variants: each where a transformers type computes it.
        (["--model.hf_model_type=phi3"], "model.hf_model_type='phi3' needs model.fused_projections=true"),
        (["--model.hf_model_type=olmo2"], "model.hf_model_type='olmo2' needs model.post_norm=true"),
        (["--model.post_norm=true", "--model.hf_model_type=qwen3"], "model.post_norm=True: no qwen3 model"),
        (["--model.name=gpt2-tiny", "--model.fused_projections=true"], "Llama-family settings"),
        (["--model.qk_norm_scope=projection"], "model.qk_norm_scope=projection needs model.qk_norm=true"),
        (["--model.partial_rotary_factor=0.3"], "int(head_dim=32 x factor) = 9"),
        (
            ["--model.name=phi-4", "--model.rope_type=linear", "--model.rope_factor=2"],
            "model.rope_type=default (longrope is not implemented)",
        ),
        (
            ["--model.name=phi-4", "--finetune.method=lora"],
            "use --finetune.lora_targets=qkv,o,gate_up,down",
        ),
        (
            ["--finetune.method=lora", "--finetune.lora_targets=qkv,o"],
            "names qkv, Phi-3's fused projections",
        ),
        # Granite's four scalars: positive, the Llama family's, exported as granite or granitemoe only.
        (["--model.logits_scaling=0"], "logits_scaling=0.0 must be > 0"),
        (["--model.name=gpt2-tiny", "--model.residual_multiplier=0.5"], "Llama-family settings"),
        (
            ["--model.qk_norm=true", "--model.hf_model_type=qwen3", "--model.embedding_multiplier=2"],
            "model.embedding_multiplier=2.0: no qwen3 model of transformers computes this",
        ),
        (["--model.hf_model_type=granite", "--model.qk_norm=true"], "'granite' needs model.qk_norm=false"),
        (["--model.hf_model_type=granitemoe"], "'granitemoe' needs model.num_experts >= 1"),
        (
            ["--model.name=granite-3.1-3b-a800m", "--model.norm_topk_prob=false"],
            "'granitemoe' needs model.norm_topk_prob=true",
        ),
        (
            ["--model.name=granite-3.1-3b-a800m", "--finetune.method=lora", "--finetune.lora_targets=q,up"],
            "model.num_experts=40 experts has not",
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


# Named sizes resolve by `ModelConfig.named`, as `--model.name=NAME` resolves them.
LLAMA_7B_PARAMS = 6_738_415_616  # Llama 2 7B (tests/test_models.py checks every published count)


def test_a_named_model_config_has_the_named_shape():
    m = ModelConfig.named("llama-7b")
    assert (m.num_layers, m.hidden_size, m.num_heads, m.vocab_size) == (32, 4096, 32, 32000)
    assert m == parse_args(["--model.name=llama-7b"]).model == NAMED_SIZES["llama-7b"]
    assert apply_overrides(TrainConfig(), {"model.name": "llama-7b"}).model == m
    assert ModelConfig() == ModelConfig.named("llama-tiny")


def test_explicit_fields_override_a_named_size_as_on_the_command_line():
    """A field given with a name wins over the size's, whatever its value (the toy's included)."""
    for over in ({"num_layers": 2}, {"num_layers": 4}, {"tie_embeddings": False}):
        args = [f"--model.{k}={v}" for k, v in over.items()]
        cli = parse_args(["--model.name=llama-1b", *args]).model
        assert ModelConfig.named("llama-1b", **over) == cli
        assert all(getattr(cli, k) == v for k, v in over.items())
    # A size's shape with a field of its own, as a preset's model.name and model.num_layers give it.
    cut = ModelConfig.named("llama-13b", num_layers=2)
    assert (cut.num_layers, cut.hidden_size) == (2, 5120)
    assert apply_overrides(TrainConfig(), {"model.name": "llama-13b", "model.num_layers": 2}).model == cut
    # A shape of your own under a name of your own: the fields given, llama-tiny's for the rest.
    mine = ModelConfig(name="mine", num_layers=2)
    assert (mine.num_layers, mine.hidden_size) == (2, ModelConfig().hidden_size)


def test_a_train_config_of_a_named_model_plans_its_parameters():
    cfg = TrainConfig(
        model=ModelConfig.named("llama-7b"),
        offload=OffloadConfig(params="none", optimizer="none"),
        checkpoint=CheckpointConfig(enabled=False),
    )
    assert param_count(cfg.model) == LLAMA_7B_PARAMS
    # masters 4 + AdamW 8 + gradients 2 bytes per parameter (tests/test_memory.py's accounting)
    assert memory.plan_memory(cfg).accelerator_state == 14 * LLAMA_7B_PARAMS


@pytest.mark.parametrize(
    "model",
    [
        ModelConfig.named("llama-7b"),
        ModelConfig.named("llama-3.1-8b", num_layers=2, compute_dtype="float32"),
        ModelConfig.named("llama-1b", tie_embeddings=False),
        ModelConfig.named("phi-3-mini", partial_rotary_factor=0.75),
        ModelConfig.named("olmo-2-32b"),
        ModelConfig(name="mine", hidden_size=64, num_heads=2),
    ],
    ids=lambda m: m.name,
)
def test_a_named_size_round_trips_through_config_json(model):
    cfg = TrainConfig(model=model)
    assert config_from_dict(json.loads(cfg.to_json())) == cfg
    assert "_shape_of" not in cfg.to_dict()["model"]  # config.json holds the fields only


def test_a_saved_model_section_lacking_a_field_takes_its_sizes_value():
    """A config.json saved before a field existed loads that field from its named size."""
    saved = TrainConfig(model=ModelConfig.named("llama-3.1-8b", num_layers=2)).to_dict()
    del saved["model"]["rope_type"], saved["model"]["rope_factor"]
    model = config_from_dict(saved).model
    assert (model.rope_type, model.rope_factor, model.num_layers) == ("llama3", 8.0, 2)


@pytest.mark.parametrize(
    "make",
    [lambda: ModelConfig.named("llama-7B"), lambda: parse_args(["--model.name=llama-7B"])],
    ids=["constructed", "parsed"],
)
def test_an_unknown_name_is_refused_with_the_valid_ones(make):
    with pytest.raises(ConfigError, match="unknown model.name 'llama-7B'. Valid names: llama-tiny, "):
        make()


def test_an_hf_name_is_left_to_the_parser():
    """A ModelConfig reads no file: an hf:DIR name without its shape says what builds it."""
    with pytest.raises(ConfigError, match="model_config_from_hf"):
        ModelConfig.named("hf:/no/such/checkpoint")


def test_a_data_path_alone_names_token_files():
    """--data.path without --data.source means the token files it names (it was refused, so the README's
    and docs/lora.md's commands exited 2); a source that contradicts it is still refused."""
    assert parse_args(["--data.path=/data/owt"]).data.source == "tokens"
    assert apply_overrides(TrainConfig(), {"data.path": "d", "data.seq_len": "64"}).data.source == "tokens"
    preset_then_cli = apply_overrides(apply_overrides(TrainConfig(), {"data.path": "d"}), {"steps": "3"})
    assert preset_then_cli.data.source == "tokens"
    with pytest.raises(ConfigError, match="data.path='d' is read only with data.source=tokens"):
        parse_args(["--data.path=d", "--data.source=builtin"])


def test_a_named_size_built_as_a_plain_dataclass_is_refused():
    """`ModelConfig(name="llama-7b")` is llama-tiny's shape labelled llama-7b (a plain dataclass looks
    no name up): refused with the constructor that builds the size, not trained silently."""
    with pytest.raises(ConfigError, match=r"ModelConfig.named\('llama-7b'\)"):
        validate(TrainConfig(model=ModelConfig(name="llama-7b")))
    validate(TrainConfig(model=ModelConfig.named("llama-7b")))
    validate(TrainConfig(model=ModelConfig.named("llama-7b", num_layers=2)))
    validate(TrainConfig(model=ModelConfig(name="mine", hidden_size=64)))
