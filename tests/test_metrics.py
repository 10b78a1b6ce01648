"""Step metrics: MFU peaks, throughput, the JSONL records and the console line."""

import io
import json
import math
import shutil
import sys

import jax
import numpy as np
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from test_train import tiny

from jaxzero.cli import train as train_lib
from jaxzero.run import metrics
from jaxzero.run.metrics import (
    MetricsLog,
    ProgressBar,
    Throughput,
    format_record,
    peak_tflops,
    tensorboard_scalars,
)
from jaxzero.state import BREAKDOWN, BREAKDOWN_COUNTS, BREAKDOWN_TIMES


class Device:
    def __init__(self, device_kind: str):
        self.device_kind = device_kind


def test_peak_tflops_by_device_kind_or_override():
    assert peak_tflops(Device("NVIDIA H100 80GB HBM3")) == 989.0
    assert peak_tflops(Device("NVIDIA H200")) == 989.0
    assert peak_tflops(Device("cpu")) is None
    assert peak_tflops(Device("cpu"), override=123.0) == 123.0


def test_throughput_between_host_syncs(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(metrics.time, "perf_counter", lambda: now[0])
    t = Throughput(tokens_per_step=1000, flops_per_token=6e9, peak=400.0)
    t.restart()
    t.add_step()
    t.add_step()
    now[0] = 102.0
    rates = t.read()  # 2 steps x 1000 tokens in 2 s
    assert rates["tokens_per_s"] == pytest.approx(1000.0)
    assert rates["tflops"] == pytest.approx(1000.0 * 6e9 / 1e12)
    assert rates["mfu"] == pytest.approx(rates["tflops"] / 400.0)
    t.restart()
    now[0] = 103.0
    assert t.read() == {"tokens_per_s": None, "tflops": None, "mfu": None}  # no step since
    assert Throughput(1000, 6e9, peak=None).read()["mfu"] is None


def test_records_are_json_lines_flushed_and_echoed(tmp_path):
    console = io.StringIO()
    log = MetricsLog(tmp_path / "metrics.jsonl", console)
    log.write({"step": 1, "loss": 5.123456789, "lr": 0.0, "grad_norm": math.nan, "mfu": None})
    # Flushed as written: readable before the log is closed.
    rec = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
    assert rec == {"step": 1, "loss": 5.12346, "lr": 0.0, "grad_norm": None, "mfu": None}
    assert console.getvalue().startswith("step 1 | loss 5.1235 | lr 0.00e+00")
    log.write({"step": 2, "loss": 4.0})
    log.close()
    assert [json.loads(ln)["step"] for ln in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1, 2]


def test_the_console_shows_the_breakdown_with_its_labels():
    record = {"step": 10, "loss": 3.0, "step_s": 1.25}
    record.update({k.key: 0.5 for k in BREAKDOWN_TIMES})
    record.update({k.key: 0.0 for k in BREAKDOWN_COUNTS})
    record["two_pass_units"] = 27.0
    line = format_record(record, device="TPU")
    head, breakdown = line.split("\n")
    assert head == "step 10 | loss 3.0000"
    assert breakdown.startswith("    step 1.250s: TPU compute 0.500 | H2D 0.500")
    assert "TPU waits for host 0.500 | TPU idle 0.500" in breakdown and "GPU" not in breakdown
    for k in BREAKDOWN_TIMES:
        assert f"{k.label.format(device='TPU')} 0.500" in breakdown
    assert "two-pass units 27.0" in breakdown and "redone" not in breakdown  # counts only when nonzero
    assert "disk" not in breakdown  # the disk's figures only where a step moved data to or from disk
    record.update({"disk_read_s": 20.0, "disk_gb": 96.5})
    breakdown = format_record(record, device="TPU").split("\n")[1]
    assert "disk read 20.000" in breakdown and "GB to and from disk 96.500" in breakdown
    assert "\n" not in format_record({"step": 1, "loss": 3.0})  # no breakdown: one line
    assert len({k.key for k in BREAKDOWN}) == len(BREAKDOWN)


def test_the_progress_bar_is_silent_off_a_terminal():
    stream = io.StringIO()  # not a TTY
    bar = ProgressBar(10, stream=stream)
    bar.update(5)
    bar.clear()
    bar.close()
    assert stream.getvalue() == ""


def test_every_number_of_a_record_becomes_a_tensorboard_scalar():
    record = {"step": 7, "loss": 2.5, "val_loss": 2.75, "lr": 1e-3, "grad_norm": 0.5, "mfu": None}
    record.update({"compile_s": 3.0, "host_rss_gib": 1.5, "gpu_peak_gib": None, "skipped_steps": 2})
    record.update({k.key: 0.25 for k in BREAKDOWN})
    record.update({"per_process": {"step_s": [1.0, None, 2.0]}, "slowest_process": 2, "a_new_key": 4.0})
    scalars = tensorboard_scalars(record)
    assert scalars["train/loss"] == 2.5 and scalars["eval/loss"] == 2.75 and scalars["train/lr"] == 1e-3
    assert scalars["train/skipped_steps"] == 2.0 and scalars["memory/host_rss_gib"] == 1.5
    assert scalars["throughput/compile_s"] == 3.0 and scalars["throughput/slowest_process"] == 2.0
    assert {f"breakdown/{k.key}" for k in BREAKDOWN} <= set(scalars)
    assert "throughput/mfu" not in scalars and "memory/gpu_peak_gib" not in scalars  # None: not measured
    assert scalars["per_process/step_s/process_2"] == 2.0 and "per_process/step_s/process_1" not in scalars
    assert scalars["train/a_new_key"] == 4.0  # a key no group names still reaches TensorBoard
    assert len(scalars) == len(record) - 4 + 2  # not step, the 2 Nones, per_process; its 2 figures


OFFLOADED = {"offload.optimizer": "cpu", "offload.params": "cpu", "logging.samples": "0"}


def test_a_run_writes_its_records_as_tensorboard_events_and_a_resume_replaces_what_it_recomputes(tmp_path):
    cfg = tiny(tmp_path, **OFFLOADED, **{"steps": "4", "checkpoint.every": "2"})
    path = train_lib.train(cfg, io.StringIO())
    # As if the run had died after logging step 4, before its checkpoint: the resume recomputes 3 and 4.
    shutil.rmtree(path / "checkpoints" / "4")
    train_lib.train(cfg, io.StringIO())
    records = [json.loads(ln) for ln in (path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert not any("aux_loss" in r for r in records)  # a dense model has no load-balancing loss
    assert len(list((path / "tensorboard").glob("events.out.tfevents.*"))) == 2  # one per run, none deleted
    events = EventAccumulator(str(path / "tensorboard"))
    events.Reload()
    losses = events.Scalars("train/loss")
    assert [e.step for e in losses] == [1, 2, 3, 4]  # the first run's steps 3 and 4 dropped
    assert [e.value for e in losses] == pytest.approx([r["loss"] for r in records], rel=1e-5)
    val = events.Scalars("eval/loss")
    assert [e.step for e in val] == [4] and val[0].value == pytest.approx(records[-1]["val_loss"], rel=1e-5)
    tags = set(events.Tags()["scalars"])
    assert {f"breakdown/{k.key}" for k in BREAKDOWN} <= tags  # the offload engine's breakdown
    expected = {"train/lr", "train/grad_norm", "throughput/tokens_per_s", "throughput/tflops"}
    assert expected | {"throughput/step_s", "memory/host_rss_gib"} <= tags
    host_update = events.Scalars("breakdown/host_update_s")
    assert [e.step for e in host_update] == [2, 4]  # none in a run's first record (step 1; 3 resumed)


MOE = {
    "model.num_experts": "4",
    "model.num_experts_per_tok": "2",
    "model.moe_intermediate_size": "32",
    "model.router_aux_loss_coef": "0.05",
    "model.num_layers": "2",
    "data.batch_size": "8",
    "data.grad_accum": "2",
}


def test_a_moe_run_logs_its_load_balancing_loss_and_resumes_bitwise(tmp_path):
    """An experts' model's records carry `aux_loss` (unweighted, beside the cross-entropy `loss`), on
    the console too; a run stopped after its step-2 checkpoint and resumed logs and ends as the
    uninterrupted run, bit for bit."""
    from jaxzero.storage.checkpoint_masters import read_saved_state

    full = tiny(tmp_path / "full", **OFFLOADED, **MOE, **{"steps": "4", "checkpoint.every": "2"})
    console = io.StringIO()
    path = train_lib.train(full, console)
    records = [json.loads(ln) for ln in (path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert all(r["aux_loss"] > 0 and r["loss"] > 0 for r in records)
    assert " | aux " in console.getvalue()
    events = EventAccumulator(str(path / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("train/aux_loss")] == [1, 2, 3, 4]

    first = tiny(tmp_path / "resumed", **OFFLOADED, **MOE, **{"steps": "2", "checkpoint.every": "2"})
    resumed_path = train_lib.train(first, io.StringIO())
    train_lib.train(train_lib.configure([f"--run_dir={resumed_path}", "--steps=4"]).config, io.StringIO())
    resumed = [json.loads(ln) for ln in (resumed_path / "metrics.jsonl").read_text().splitlines()]
    keys = ("step", "loss", "aux_loss", "grad_norm")
    assert [{k: r[k] for k in keys} for r in resumed] == [{k: r[k] for k in keys} for r in records]
    a, b = (read_saved_state(p / "checkpoints" / "4")["params"] for p in (path, resumed_path))
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_a_missing_tensorboardx_is_refused_before_anything_is_built(tmp_path, monkeypatch, capsys):
    """Without tensorboardX the program stops at once, naming the fix, and writes nothing (it found
    out only when its loop opened the event files, minutes into building a large model)."""
    monkeypatch.setitem(sys.modules, "tensorboardX", None)  # `import tensorboardX` raises ImportError
    run_dir = tmp_path / "run"
    assert train_lib.main(["--steps=1", "--model.num_layers=1", f"--run_dir={run_dir}"]) == 2
    err = capsys.readouterr().err
    assert "tensorboardX" in err and "--logging.tensorboard=false" in err, err
    assert not run_dir.exists()
    monkeypatch.delitem(sys.modules, "tensorboardX")
    metrics.require_tensorboard()  # installed: nothing to say
