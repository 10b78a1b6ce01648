"""Building a config: presets, `--section.key=value` overrides, types and names, before validation."""

import json
import logging
from pathlib import Path

import pytest

from jaxzero.config import SECTIONS, ConfigError, TrainConfig
from jaxzero.config.keys import COMMAND_LINE, all_keys, config_from_dict, set_by_preset
from jaxzero.overrides import field_meanings, help_text, layer, parse_args, split_args


def test_defaults_are_valid_and_keys_listed():
    cfg = parse_args([])
    assert cfg == TrainConfig()
    for key in ("steps", "seed", "run_dir", "offload.params", "offload.optimizer", "model.name"):
        assert key in all_keys()


def test_cli_overrides_are_typed():
    cfg = parse_args(
        [
            "--steps=7",
            "--seed=3",
            "--run_dir=/tmp/x",
            "--optimizer.lr=1e-4",
            "--logging.progress=false",
            "--offload.optimizer=cpu",
            "--offload.params=cpu",
        ]
    )
    assert (cfg.steps, cfg.seed, cfg.run_dir) == (7, 3, "/tmp/x")
    assert cfg.optimizer.lr == 1e-4 and cfg.logging.progress is False
    assert (cfg.offload.params, cfg.offload.optimizer) == ("cpu", "cpu")


def test_model_name_selects_size_then_fields_override():
    cfg = parse_args(["--model.num_layers=2", "--model.name=gpt2-tiny"])
    assert cfg.model.family == "gpt2" and cfg.model.num_layers == 2 and cfg.model.name == "gpt2-tiny"


def test_preset_then_cli(tmp_path):
    preset = tmp_path / "p.toml"
    preset.write_text('steps = 11\n[model]\nname = "gpt2-tiny"\nnum_layers = 3\n[data]\nseq_len = 64\n')
    cfg = parse_args([f"--config={preset}", "--data.seq_len=32"])
    assert cfg.steps == 11 and cfg.model.family == "gpt2" and cfg.model.num_layers == 3
    assert cfg.data.seq_len == 32


def test_each_key_set_is_traced_to_the_layer_that_set_it_last(tmp_path):
    preset = tmp_path / "p.toml"
    preset.write_text("steps = 11\n[data]\nseq_len = 64\n")
    ds = tmp_path / "ds.json"
    ds.write_text('{"train_micro_batch_size_per_gpu": 2}')
    args = split_args([f"--config={preset}", f"--deepspeed={ds}", "--data.seq_len=32", "--seed=3"])
    sources = layer(TrainConfig(), args).sources
    assert sources["steps"] == str(preset)  # as given
    assert sources["data.micro_batch_size"] == f"--deepspeed={ds}"
    assert sources["data.seq_len"] == sources["seed"] == COMMAND_LINE  # the command line wins
    assert "run_dir" not in sources  # left as it was: the time-stamped default
    # A refused resume names the preset a key came from; a DeepSpeed file's keys are its own, translated.
    by_preset = [set_by_preset(sources[k]) for k in ("steps", "data.micro_batch_size", "seed")]
    assert by_preset == [True, False, False]


def test_config_json_round_trip():
    cfg = parse_args(["--model.name=gpt2-tiny", "--steps=5", "--offload.optimizer=cpu"])
    assert config_from_dict(json.loads(cfg.to_json())) == cfg


@pytest.mark.parametrize(
    "args, message",
    [
        (["--stepz=3"], "unknown config key 'stepz'. Did you mean 'steps'? Valid keys: steps, seed"),
        (["--optimiser.lr=3"], "unknown config key 'optimiser.lr'. Did you mean 'optimizer.lr'?"),
        (
            ["--model.hidden=3"],
            "unknown config key 'model.hidden'. Did you mean 'model.hidden_size'? Valid keys: model.name",
        ),
        (["--nosuch.key=1"], "unknown config key 'nosuch.key'"),
        (["--steps=ten"], "steps='ten' is not an integer"),
        (["--optimizer.lr=fast"], "optimizer.lr='fast' is not a number"),
        (["--logging.progress=maybe"], "is not a boolean; use true or false"),
        (["--offload.params=gpu"], "offload.params='gpu' is not one of ['auto', 'none', 'cpu']"),
        (["--model.name=llama-9000b"], "unknown model.name 'llama-9000b'. Valid names:"),
        (["steps=3"], "cannot parse argument 'steps=3'"),
        (["--config=/nonexistent.toml"], "config file '/nonexistent.toml' does not exist"),
        (["--config=/"], "config file '/' is a directory, not a TOML file"),
        (["--machine.gpus=3"], "machine.gpus=3 plans for a node you do not have"),
    ],
)
def test_parse_error_messages(args, message):
    """Unknown keys, wrong types and unknown names are refused with the valid choices."""
    with pytest.raises(ConfigError) as e:
        parse_args(args)
    assert message in str(e.value)


def test_a_key_given_twice_takes_the_last_value_and_says_so(caplog, capsys, monkeypatch):
    """The library says so through logging (`jaxzero.overrides`); the programs show it on stderr."""
    jaxzero_log = logging.getLogger("jaxzero")  # as a library's user finds it: no program's handler yet
    monkeypatch.setattr(jaxzero_log, "handlers", [])
    monkeypatch.setattr(jaxzero_log, "propagate", True)
    assert parse_args(["--steps=10", "--steps=20"]).steps == 20
    assert "--steps is given twice ('10', then '20'): using '20'." in caplog.text
    assert capsys.readouterr().err == ""  # a library prints nothing of its own
    from jaxzero.cli.plan import main as plan_main  # a program: its messages on stderr

    assert plan_main(["--steps=10", "--steps=20"]) == 0
    assert "jaxzero: --steps is given twice ('10', then '20'): using '20'." in capsys.readouterr().err


def test_bad_toml(tmp_path):
    p = tmp_path / "bad.toml"
    p.write_text("steps = = 3")
    with pytest.raises(ConfigError, match="is not valid TOML"):
        parse_args([f"--config={p}"])


def test_a_preset_error_names_the_file(tmp_path):
    p = tmp_path / "p.toml"
    p.write_text("[optimizer]\nlearning_rate = 0.1\n")
    with pytest.raises(ConfigError) as e:
        parse_args([f"--config={p}"])
    assert str(e.value).startswith(
        f"in config file {str(p)!r}: unknown config key 'optimizer.learning_rate'."
    )
    assert "Valid keys: optimizer.name" in str(e.value)
    p.write_text("steps = 'ten'\n")
    with pytest.raises(ConfigError, match=r"in config file .*p.toml': steps='ten' is not an integer"):
        parse_args([f"--config={p}"])


@pytest.mark.parametrize("preset", sorted((Path(__file__).parents[1] / "configs").glob("*.toml")), ids=str)
def test_every_preset_parses_and_says_what_to_expect(preset):
    parse_args([f"--config={preset}"])
    header = preset.read_text().split("\n\n")[0]
    assert "python -m jaxzero.train --config=configs/" in header and "Expect" in header


def test_help_lists_every_key_with_its_type_default_and_meaning():
    text = help_text()
    for key in all_keys():
        section, _, name = key.rpartition(".")
        assert f"--{key}  (" in text, key
        cls = SECTIONS[section] if section else TrainConfig
        assert field_meanings(cls).get(name), f"{key} has no comment in jaxzero/config.py to explain it"
    assert "--offload.params  (auto | none | cpu, default 'auto')" in text
    # a section's description is its docstring's whole first paragraph, not its first line
    assert (
        "[checkpoint] Orbax checkpoints in `<run_dir>/checkpoints`: every `every` steps (0: only at the end "
        "and on preemption)" in text
    )


def test_a_run_saved_when_the_planner_chose_units_on_the_accelerator_at_0_resumes_with_its_choice():
    """Until `offload.device_state_units=-1` existed, its default was 0, which with the optimizer's tier
    left to the planner meant "the planner's choice": such a saved config resumes with -1. An explicit
    tier's 0 meant (and means) every unit's state on the host."""
    old = json.loads(TrainConfig().to_json())
    old["offload"]["device_state_units"] = 0
    assert config_from_dict(old).offload.device_state_units == -1
    old["offload"]["optimizer"] = "cpu"
    assert config_from_dict(old).offload.device_state_units == 0


REMOVED = (
    "config key 'offload.speculative_units' was removed: speculative updates were slower than waiting for "
    "the gradient norm in every measurement (BENCHMARKS.md), and computed the same bits: drop the key"
)


def test_a_removed_key_is_refused_with_why_wherever_it_is_set(tmp_path):
    """The command line, a preset and `build_trainer`'s overrides each get the reason, not a typo's hint."""
    with pytest.raises(ConfigError) as e:
        parse_args(["--offload.speculative_units=2"])
    assert str(e.value).startswith(REMOVED) and "Valid keys" not in str(e.value)
    p = tmp_path / "p.toml"
    p.write_text("[offload]\nspeculative_units = 0\n")
    with pytest.raises(ConfigError) as e:
        parse_args([f"--config={p}"])
    assert str(e.value).startswith(f"in config file {str(p)!r}: {REMOVED}")
    from jaxzero.overrides import apply_overrides

    with pytest.raises(ConfigError, match="'offload.speculative_units' was removed"):
        apply_overrides(TrainConfig(), {"offload.speculative_units": 3})


def test_a_run_saved_with_a_removed_key_resumes_without_it():
    """A saved config (config.json, a checkpoint's) may hold a key that is gone: it reads as the same
    run, since no removed key changed what a run computes."""
    old = json.loads(TrainConfig().to_json())
    old["offload"]["speculative_units"] = 4
    assert config_from_dict(old) == TrainConfig()


def test_the_training_program_refuses_a_removed_key_in_one_line_before_any_work(tmp_path, capsys):
    """`python -m jaxzero.train` in-process: exit 2, the reason on one line, nothing written."""
    from jaxzero.cli import train as train_lib  # the program: imported by its test only

    run_dir = tmp_path / "run"
    code = train_lib.main([f"--run_dir={run_dir}", "--offload.speculative_units=8"])
    err = capsys.readouterr().err
    assert code == 2 and err == f"jaxzero: config error: {REMOVED}, and the run computes the same.\n", err
    assert not run_dir.exists()
