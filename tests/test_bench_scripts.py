"""The GPU benchmark scripts' argument handling and shapes, on the CPU: `scripts/bench_deepspeed.py`
at the Qwen3-MoE shape of the DeepSpeed comparison (its parameter count by the script's formula, by
jaxzero's config and by transformers' model built on the meta device)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
MOE_PARAMS = 4_474_328_064  # the "4.47B": hidden 2048, 12 layers, 64 experts of 768, vocab 151,936


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def bench():
    return load_script("bench_deepspeed")


def test_the_moe_shape_is_4_47b_parameters_in_jaxzero_and_in_transformers(bench):
    import torch
    import transformers

    from jaxzero.config import TrainConfig
    from jaxzero.models.sizes import param_count
    from jaxzero.overrides import apply_overrides

    args = bench.parse_args(["--shape=qwen3-moe"])
    assert (args.hidden, args.layers, args.heads, args.kv_heads, args.head_dim) == (2048, 12, 32, 4, 128)
    assert (args.experts, args.mlp, args.top_k, args.vocab) == (64, 768, 8, 151936)
    assert bench.shape_param_count(args) == MOE_PARAMS
    cfg = apply_overrides(TrainConfig(), bench.jaxzero_overrides(args))
    assert cfg.model.num_experts == 64 and not cfg.model.tie_embeddings
    assert param_count(cfg.model) == MOE_PARAMS
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(bench.hf_model_config(args))
    assert type(model).__name__ == "Qwen3MoeForCausalLM"
    assert sum(p.numel() for p in model.parameters()) == MOE_PARAMS


def test_the_llama_shape_keeps_its_count_in_all_three(bench):
    import torch
    import transformers

    from jaxzero.config import TrainConfig
    from jaxzero.models.sizes import param_count
    from jaxzero.overrides import apply_overrides

    args = bench.parse_args([])
    assert args.cases == ["resident", "zero2-offload", "zero3-offload"]
    assert bench.shape_param_count(args) == 3_367_676_928  # llama-3.4b-bench
    assert param_count(apply_overrides(TrainConfig(), bench.jaxzero_overrides(args)).model) == 3_367_676_928
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(bench.hf_model_config(args))
    assert sum(p.numel() for p in model.parameters()) == 3_367_676_928


def test_one_run_holds_deepspeed_and_both_jaxzero_placements(bench, tmp_path):
    args = bench.parse_args(["--shape=qwen3-moe", "--steps=4", f"--out={tmp_path}"])
    assert args.cases == ["zero3-offload", "jaxzero-host", "jaxzero-auto"]
    ds = bench.ds_config("zero3-offload", args)
    assert ds["zero_optimization"]["offload_optimizer"] == {"device": "cpu", "pin_memory": True}
    assert ds["zero_optimization"]["stage3_prefetch_bucket_size"] == bench.block_param_count(args)
    host = bench._jaxzero_argv(args, "jaxzero-host")
    assert host[0].endswith("scripts/bench_offload.py") and "--case=zero3-offload" in host
    assert "--case=auto" in bench._jaxzero_argv(args, "jaxzero-auto")
    assert "--set=optimizer.state_dtype=bfloat16" not in host
    bf16 = bench._jaxzero_argv(args, "jaxzero-host-bf16")  # the same case with bf16 moments
    assert set(bf16) - set(host) == {"--set=optimizer.state_dtype=bfloat16"}
    assert "--case=zero3-offload" in bf16
    assert "--set=model.num_experts=64" in host and "--batch=8" in host and "--seq=2048" in host
    child = bench.parse_args(bench._child_argv(args, "zero3-offload"))
    assert child.case == "zero3-offload" and bench.shape_param_count(child) == MOE_PARAMS


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--shape=qwen3-moe", "--experts=0"], "the qwen3-moe shape has experts"),
        (["--shape=qwen3-moe", "--top_k=65"], "0 < top_k <= experts"),
        (["--experts=8"], "the llama shape none"),
        (["--cases=zero3-offload,jaxzero-fast"], "unknown case"),
        (["--shape=qwen3-moe", "--heads=30"], "multiple of --heads"),
        (["--ds=stage"], "KEY.PATH=VALUE"),
    ],
)
def test_bad_flags_are_refused_before_any_case_runs(bench, argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        bench.parse_args(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_jaxzero_cases_alone_run_without_deepspeed(bench, monkeypatch, tmp_path, capsys):
    """No DeepSpeed case named: the parent neither needs DeepSpeed nor imports torch; each case's
    process is started and its RESULT line tabulated beside the others."""
    monkeypatch.setattr(bench.importlib.util, "find_spec", lambda name: None)
    started = []

    def fake_run(cmd, stdout, **kw):
        started.append(cmd)
        result = {"step_s": 2.0, "mean_step_s": 2.1, "tokens_per_s": 8192.0, "tflops_8N": 1.0,
                  "gpu_peak_gib": 10.0, "host_rss_gib": 50.0, "losses": [12.0], "device": "cpu",
                  "plan": "ZeRO-3 offload", "plan_step_s": 1.9, "plan_gpu_gib": 9.0, "plan_host_gib": 48.0,
                  "init_s": 1.0}  # fmt: skip
        stdout.write("RESULT " + bench.json.dumps(result) + "\n")
        return bench.subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(bench.subprocess, "run", fake_run)
    bench.main(["--shape=qwen3-moe", "--cases=jaxzero-host,jaxzero-auto", f"--out={tmp_path}"])
    out = capsys.readouterr().out
    assert len(started) == 2 and all(c[0] == sys.executable for c in started)
    assert "4.47B params" in out and "jaxzero-host" in out and "jaxzero-auto" in out


def test_a_runs_overrides_keep_commas_inside_values():
    runs = load_script("bench_checkpoint_runs")
    assert runs.split_overrides("model.name=x,finetune.lora_targets=q,k,v,o,steps=4,") == [
        "model.name=x",
        "finetune.lora_targets=q,k,v,o",
        "steps=4",
    ]


TINY_MOE = (
    "model.hidden_size=64,model.num_layers=2,model.num_heads=4,model.num_kv_heads=2,model.head_size=16,"
    "model.num_experts=4,model.num_experts_per_tok=2,model.moe_intermediate_size=32,model.vocab_size=256,"
    "data.seq_len=32,data.batch_size=2,logging.progress=false"
)


def _moe_targets(tmp_path: Path, *models: str, **env: str):
    import os
    import subprocess

    env = {**os.environ, "PYTHON": sys.executable, "PYTHONPATH": str(REPO), "RUNS": str(tmp_path / "runs"),
           **env}  # fmt: skip
    script = REPO / "scripts" / "gpu_moe_targets.sh"
    argv = ["bash", str(script), *models]
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600)


def test_the_moe_targets_refuse_a_resume_with_nothing_to_resume_from(tmp_path):
    done = _moe_targets(tmp_path, OUT=str(tmp_path / "out"), STEPS="4", EVERY="4")
    assert done.returncode == 2 and "EVERY=4 must be below STEPS=4" in done.stderr
    done = _moe_targets(tmp_path)
    assert done.returncode != 0 and "set OUT" in done.stderr


@pytest.mark.slow  # two training processes and two plans
def test_the_moe_targets_save_resume_and_finish_a_tiny_moe(tmp_path):
    """A tiny Qwen3-MoE shape through the script: LoRA over an int8 base, saved at 2 and 4, resumed
    from 2 through to the final checkpoint with the uninterrupted run's loss; logs under OUT, the run
    directory removed."""
    import json

    out = tmp_path / "out"
    done = _moe_targets(tmp_path, "qwen3-30b-a3b", OUT=str(out), STEPS="4", EVERY="2", EXTRA=TINY_MOE)
    assert done.returncode == 0, done.stderr[-3000:]
    first, resumed = json.loads((out / "qwen3-30b-a3b" / "runs.json").read_text())
    assert first["exit"] == resumed["exit"] == 0
    assert first["saved"] == resumed["saved"] == [2, 4]
    assert min(int(s) for s in resumed["losses"]) > 2  # it resumed after step 2
    assert resumed["losses"]["4"] == first["losses"]["4"]
    assert first["plan_step_s"] is not None and "peak_gpu_gib" in first
    assert not (tmp_path / "runs" / "lora-qwen3-30b-a3b").exists()


def test_the_sink_attention_check_passes_on_the_cpu():
    """`scripts/check_sink_attention.py` at its CPU shapes: every path within float32 tolerance of the
    dense one and the dense one of float64, and the timing table printed (exit 1 on a failed check)."""
    import os
    import subprocess

    env = {**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu"}
    argv = [sys.executable, str(REPO / "scripts" / "check_sink_attention.py"), "--small", "--iters=1"]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "FAILED" not in done.stdout and "global  switch, xla" in done.stdout
