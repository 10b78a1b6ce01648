"""Step metrics: MFU peaks, throughput, the JSONL records and the console line."""

import io
import json
import math

import pytest

from jaxzero import metrics
from jaxzero.metrics import MetricsLog, ProgressBar, Throughput, format_record, peak_tflops
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
