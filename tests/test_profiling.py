"""`profile.steps`: the window's rule, checked before anything runs, and a traced offloaded run whose
trace holds the offload engine's host-work spans (on the CPU backend)."""

import io
import re

import jax.numpy as jnp
import pytest
from test_train import tiny

from jaxzero.cli import train as train_lib
from jaxzero.config import ConfigError, ProfileConfig, TrainConfig
from jaxzero.config.checks import validate
from jaxzero.overrides import apply_overrides, parse_args
from jaxzero.run.profiling import StepTrace


@pytest.mark.parametrize(
    "window, message",
    [
        ("x", "profile.steps='x' is not A:B, two step numbers"),
        ("2:4:6", "profile.steps='2:4:6' is not A:B"),
        ("4:2", "profile.steps='4:2' traces no step: A:B traces steps A to B - 1"),
        ("3:3", "profile.steps='3:3' traces no step"),
        ("0:2", "profile.steps='0:2' starts at step 0, but steps count from 1"),
        ("5:12", "profile.steps='5:12' traces up to step 11, past the run's last step (steps=10)"),
    ],
)
def test_a_bad_window_is_refused_with_the_rule_and_an_example(window, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        parse_args(["--steps=10", f"--profile.steps={window}"])


def test_the_window_is_a_range_of_steps_up_to_the_last():
    assert ProfileConfig().window() is None and ProfileConfig(" ").window() is None
    assert ProfileConfig("2:4").window() == range(2, 4)  # steps 2 and 3
    validate(apply_overrides(TrainConfig(), {"steps": "10", "profile.steps": "9:11"}))  # 9 and 10


def test_a_run_that_starts_after_the_window_traces_nothing(tmp_path):
    console = io.StringIO()
    trace = StepTrace(range(2, 4), tmp_path / "profile", first=5, console=console)
    for step in (5, 6):
        trace.before(step)
        trace.after(step, None)
    trace.stop()
    assert "this run starts at step 5, after the window, so nothing is traced" in console.getvalue()
    assert not (tmp_path / "profile").exists()


def test_a_resume_inside_the_window_traces_from_its_first_step_and_a_failure_still_writes(tmp_path):
    console = io.StringIO()
    trace = StepTrace(range(2, 6), tmp_path / "profile", first=3, console=console)
    trace.before(3)
    trace.after(3, jnp.ones(3) * 2)
    trace.stop()  # the way out of a failing step
    assert len(list((tmp_path / "profile").rglob("*.xplane.pb"))) == 1
    assert "profiler trace of steps from 3 (stopped early)" in console.getvalue()
    trace.before(4)  # one trace per run
    trace.stop()
    assert len(list((tmp_path / "profile").rglob("*.xplane.pb"))) == 1


def test_an_offloaded_run_traces_its_window_with_the_engines_host_work(tmp_path):
    console = io.StringIO()
    over = {"offload.optimizer": "cpu", "offload.params": "cpu", "profile.steps": "2:4"}
    cfg = tiny(tmp_path, **over, **{"logging.tensorboard": "false", "logging.samples": "0"})
    path = train_lib.train(cfg, console)
    traces = list((path / "profile").rglob("*.xplane.pb"))
    assert len(traces) == 1
    session = traces[0].parent
    assert (session / "perfetto_trace.json.gz").exists()  # what ui.perfetto.dev opens
    assert f"profiler trace of steps 2 to 3 in {session}" in console.getvalue()
    data = traces[0].read_bytes()
    spans = [b"host_update unit=", b"wait_grads unit=", b"wait_norm unit=", b"wait_update unit=0"]
    spans += [b"d2h grad unit=", b"h2d weights unit=1"]  # block 0 is unit 1, streamed
    missing = [s for s in spans if b"jaxzero/" + s not in data]
    assert not missing, f"spans missing from the trace: {missing}"
    assert not (path / "tensorboard").exists()  # logging.tensorboard=false writes no event files
