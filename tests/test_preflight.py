"""The decision made once: one CLI run (and one library `build_trainer`) validates its config once and
resolves its batch once, the shapes the planner reads before JAX starts equal the model's, the
devices are told without starting a backend, and a trainer given a decision builds from it without
planning again (and refuses one made for another config)."""

from __future__ import annotations

import contextlib
import dataclasses
import subprocess
import sys
from collections import Counter

import jax
import numpy as np
import pytest
from subprocess_run import user_env

from jaxzero.cli import train as train_lib
from jaxzero.config import ConfigError, ModelConfig, TrainConfig
from jaxzero.config import checks as config_checks
from jaxzero.models import build_model
from jaxzero.models.sizes import unit_param_shapes
from jaxzero.overrides import apply_overrides
from jaxzero.plan import placement, resolve_plan
from jaxzero.planner import preflight, search
from jaxzero.trainer import build_trainer, decide_and_build

MODELS = [
    ModelConfig(),
    ModelConfig.named("llama-tiny", tie_embeddings=False),
    ModelConfig.named("llama-tiny", attention_bias=True, num_heads=8, num_kv_heads=2, hidden_size=96),
    ModelConfig.named("gpt2-tiny"),
]


TINY = {
    "steps": "2",
    "data.seq_len": "16",
    "data.batch_size": "4",
    "model.num_layers": "1",
    "logging.progress": "false",
    "offload.optimizer": "cpu",
}


def counted_resolutions(monkeypatch: pytest.MonkeyPatch) -> Counter:
    """How often `validate` and `resolve_batch` run from here on, counted wherever a jaxzero module
    looks them up (each module that imported one holds its own name for it)."""
    counts: Counter = Counter()
    for name in ("validate", "resolve_batch"):
        original = getattr(config_checks, name)

        def counted(*args, _name=name, _original=original, **kwargs):
            counts[_name] += 1
            return _original(*args, **kwargs)

        for module in list(sys.modules.values()):
            named = getattr(module, "__name__", None) or ""
            if named.startswith("jaxzero") and getattr(module, name, None) is original:
                monkeypatch.setattr(module, name, counted)
    return counts


def test_one_cli_run_validates_once_and_resolves_its_batch_once(tmp_path, monkeypatch):
    counts = counted_resolutions(monkeypatch)
    argv = [f"--{k}={v}" for k, v in TINY.items()]
    assert train_lib.main([*argv, f"--run_dir={tmp_path / 'run'}"]) == 0
    assert counts == {"validate": 1, "resolve_batch": 1}


def test_build_trainer_without_a_decision_resolves_once(monkeypatch):
    cfg = apply_overrides(TrainConfig(), TINY)
    counts = counted_resolutions(monkeypatch)
    trainer = build_trainer(cfg)
    assert counts == {"validate": 1, "resolve_batch": 1}
    assert trainer.config.offload.optimizer == "cpu" and trainer.config.data.micro_batch_size == 0


@pytest.mark.parametrize("model", MODELS, ids=["tied", "untied", "biases", "gpt2"])
def test_the_shapes_told_before_jax_starts_are_the_models(model):
    shapes = jax.eval_shape(build_model(model).init, jax.random.key(0))
    told = unit_param_shapes(model)
    for unit, tree in zip(told, (shapes.embed, shapes.blocks[0], shapes.head), strict=True):
        assert Counter(unit) == Counter(tuple(x.shape) for x in jax.tree.leaves(tree))
    for devices in (1, 2, 3, 4, 6, 8):
        assert placement.whole_params_of(model, devices) == placement.whole_params(shapes, devices)


def test_a_concrete_placement_is_evaluated_not_searched():
    cfg = dataclasses.replace(
        TrainConfig(),
        offload=dataclasses.replace(
            TrainConfig().offload, params="cpu", optimizer="cpu", device_state_units=0
        ),
    )
    decision = preflight.decide(cfg)
    assert decision.decided == () and decision.plan == resolve_plan(decision.config)
    assert decision.memory.pinned > 0 and decision.machine.devices == len(jax.local_devices())


def test_a_trainer_given_a_decision_builds_from_it_without_planning_again(monkeypatch):
    cfg = TrainConfig()  # offload keys on auto
    decision = preflight.decide(cfg)
    assert decision.decided  # the planner set the auto keys

    def no_planning(*args, **kwargs):
        raise AssertionError("the trainer planned again")

    monkeypatch.setattr(search, "choose", no_planning)
    trainer, used = decide_and_build(cfg, decision=decision)
    assert used is decision and trainer.config == decision.config and trainer.plan == decision.plan


def test_a_decision_for_another_config_is_refused_and_one_for_other_devices_redone(caplog):
    cfg = TrainConfig()
    decision = preflight.decide(cfg)
    other = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, batch_size=cfg.data.batch_size * 2))
    with pytest.raises(ConfigError, match="made for another config"):
        build_trainer(other, decision=decision)
    one = jax.sharding.Mesh(np.array(jax.devices()[:1]), (placement.DATA_AXIS,))
    assert decision.machine.devices == 4  # the four fake devices of the tests
    _, used = decide_and_build(cfg, one, decision)
    assert used is not decision and used.machine.devices == 1
    assert "deciding again for the mesh" in caplog.text


def test_the_plan_program_starts_no_backend():
    code = (
        "from jaxzero.cli.plan import main\n"
        "from jax._src import xla_bridge\n"
        # (no checkpoints: llama-7b's may not fit this machine's disk, which the plan refuses as train does)
        "assert main(['--model.name=llama-7b', '--machine.host_gib=125', '--checkpoint.enabled=false'])"
        " == 0\n"
        "assert main(['--offload.optimizer=cpu', '--offload.params=cpu']) == 0\n"
        "assert not xla_bridge.backends_are_initialized()\n"
    )
    env = user_env(XLA_FLAGS="--xla_force_host_platform_device_count=4")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=240)
    assert done.returncode == 0, done.stderr
    assert "plan for llama-7b" in done.stdout and "4 devices in 1 process" in done.stdout


def test_the_program_decides_before_jax_starts(tmp_path):
    """`python -m jaxzero.train` decides the placement (and sizes XLA's pools) before anything starts
    JAX, even a run whose short warmup is warned about (the warning is computed with JAX)."""
    code = (
        "import sys\n"
        "import jaxzero.planner.preflight as preflight, jaxzero.planner.runtime as runtime\n"
        "decide = preflight.decide_before_jax\n"
        "def checked(cfg, processes=None, **kw):\n"
        "    assert not runtime.backends_started(), 'JAX started before the placement was decided'\n"
        "    return decide(cfg, processes, **kw)\n"
        "preflight.decide_before_jax = checked\n"
        "from jaxzero import train\n"
        "sys.exit(train.main(sys.argv[1:]))\n"
    )
    args = [
        f"--run_dir={tmp_path / 'run'}",
        "--steps=2",
        "--logging.samples=0",
        "--logging.tensorboard=false",
    ]
    done = subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, env=user_env(), timeout=300
    )
    assert done.returncode == 0, done.stderr
    assert "the learning rate never reaches" in done.stdout  # the warmup warning, after the decision


def test_a_node_of_eight_gpus_is_planned_without_one(monkeypatch):
    """`machine.gpus` with `machine.gpu_gib`: that many GPUs of one host, one process each, share its
    RAM; ZeRO-3 offload's host state per process falls with the GPU count and the step does not grow."""
    from jaxzero.overrides import parse_args
    from jaxzero.planner import runtime

    monkeypatch.setattr(runtime, "backends_started", lambda: False)  # as in a program, before JAX starts
    box = ["--machine.gpu_gib=79.2", "--machine.host_gib=560", "--machine.cores=128"]
    zero3 = [
        "--model.name=llama-3.4b-bench",
        "--data.seq_len=2048",
        "--offload.params=cpu",
        "--offload.optimizer=cpu",
    ]
    plans = {
        g: preflight.decide(parse_args([*zero3, *box, f"--data.batch_size={8 * g}", f"--machine.gpus={g}"]))
        for g in (1, 2, 4, 8)
    }
    for g, d in plans.items():
        assert (d.machine.devices, d.machine.processes, d.machine.local_processes) == (g, g, g)
        assert d.machine.host_share == 560 * 2**30 // g
    hosts = [plans[g].memory.host for g in (1, 2, 4, 8)]
    assert hosts == sorted(hosts, reverse=True) and hosts[-1] < hosts[0] / 3
    assert plans[8].step_s <= 1.05 * plans[1].step_s


def test_a_described_node_says_which_figures_were_taken_from_this_machine(monkeypatch, caplog):
    """`machine.gpus` without the node's host RAM, cores or disk planned with this machine's, silently:
    a warning names each figure taken from here and the key that gives the node's own."""
    import logging

    from jaxzero.overrides import parse_args
    from jaxzero.planner import runtime

    monkeypatch.setattr(runtime, "backends_started", lambda: False)
    node = ["--machine.gpu_gib=79.2", "--machine.gpus=8", "--data.batch_size=64"]
    with caplog.at_level(logging.WARNING, logger="jaxzero"), contextlib.suppress(ConfigError):
        preflight.decide(parse_args([*node, "--machine.cores=128"]))  # this host's RAM may not fit 8
    assert "planning for a node of 8 GPUs of 79.2 GiB with this machine's host RAM" in caplog.text
    assert "(--machine.host_gib)" in caplog.text and "(--machine.disk_gib)" in caplog.text
    assert "--machine.cores" not in caplog.text  # given
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="jaxzero"):
        given = ["--machine.cores=128", "--machine.host_gib=560", "--machine.disk_gib=900"]
        preflight.decide(parse_args([*node, *given]))
    assert "planning for a node" not in caplog.text
