"""Tests for `python -m jaxzero.launch`: its command line, how it shares GPUs, and, in subprocesses
(slow), two CPU processes that train as one process does (through a preemption and a resume), and a
process that dies, which stops the others with a message naming it."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from subprocess_run import REPO, run_module, user_env

from jaxzero.cli import launch
from jaxzero.cli.launch import LaunchArgs, UsageError, child_env, parse_args, split_gpus, visible_gpus

TINY = [
    "--model.num_layers=2",
    "--data.seq_len=32",
    "--data.batch_size=8",
    "--steps=6",
    "--logging.log_every=1",
    # float32: a batch split over 1, 4 or 2 x 2 devices then gives the same losses to print precision
    "--model.compute_dtype=float32",
]


# -- the command line and the GPUs (fast) -----------------------------------------------------------


def test_options_end_at_the_separator_or_the_first_program_argument() -> None:
    assert parse_args(["--nproc=2", "--", "--steps=3"]) == LaunchArgs(nproc=2, args=["--steps=3"])
    assert parse_args(["--nproc", "4", "--cpu_devices_per_proc=2", "--steps=3", "--nproc=9"]) == LaunchArgs(
        nproc=4, cpu_devices_per_proc=2, args=["--steps=3", "--nproc=9"]
    )
    a = parse_args(["--nproc=2", "--grace_s=2.5", "--log_dir=logs", "--script=x.py", "--", "--nproc=1"])
    assert (a.grace_s, a.log_dir, a.script, a.args) == (2.5, "logs", "x.py", ["--nproc=1"])
    for argv, message in [
        (["--steps=3"], "--nproc=N is required"),
        (["--nproc=0"], r"--nproc=0 must be >= 1"),
        (["--nproc=two"], r"--nproc='two' must be a number"),
        (["--nproc"], r"--nproc needs a value"),
    ]:
        with pytest.raises(UsageError, match=message):
            parse_args(argv)


def test_each_process_gets_its_share_of_the_gpus() -> None:
    assert split_gpus([str(i) for i in range(8)], 4) == ["0,1", "2,3", "4,5", "6,7"]
    assert split_gpus(["3", "5"], 2) == ["3", "5"]  # the visible ones, not the first ones
    with pytest.raises(
        UsageError, match=r"--nproc=3 processes cannot share 8 visible GPU\(s\).*--nproc=1 or 2 or 4 or 8"
    ):
        split_gpus([str(i) for i in range(8)], 3)
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "2, 3,GPU-ab"}) == ["2", "3", "GPU-ab"]
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": ""}) == []  # none visible: nothing to split
    listing = "GPU 0: NVIDIA H200 (UUID: GPU-1)\nGPU 1: NVIDIA H200 (UUID: GPU-2)\n"
    assert visible_gpus({}, nvidia_smi=lambda: listing) == ["0", "1"]
    assert visible_gpus({}, nvidia_smi=lambda: None) == []  # no nvidia-smi: the processes see what JAX finds


def test_a_process_environment() -> None:
    base = {"XLA_FLAGS": "--xla_foo=1 --xla_force_host_platform_device_count=8", "KEEP": "x"}
    env = child_env(base, rank=1, nproc=2, port=4321, gpus="2,3", cpu_devices=0)
    assert {k: env[k] for k in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")} == {
        "JAX_COORDINATOR_ADDRESS": "127.0.0.1:4321",
        "JAX_NUM_PROCESSES": "2",
        "JAX_PROCESS_ID": "1",
    }
    assert (
        env["CUDA_VISIBLE_DEVICES"] == "2,3" and env["KEEP"] == "x" and env["XLA_FLAGS"] == base["XLA_FLAGS"]
    )
    cpu = child_env(base, rank=0, nproc=2, port=4321, gpus=None, cpu_devices=2)
    assert cpu["XLA_FLAGS"] == "--xla_foo=1  --xla_force_host_platform_device_count=2"
    assert cpu["JAX_PLATFORMS"] == "cpu" and "CUDA_VISIBLE_DEVICES" not in cpu


def test_how_a_process_ended_is_named() -> None:
    assert launch.describe_exit(-signal.SIGKILL) == "was killed by SIGKILL"
    assert launch.describe_exit(2) == "exited with status 2 (config error)"
    assert launch.exit_status(-signal.SIGKILL) == 137 and launch.exit_status(3) == 3


# -- processes (slow) ------------------------------------------------------------------------------


def _launch(*args: str, cwd: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "jaxzero.launch", *args],
        cwd=cwd,
        env=user_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_two_processes_train_as_one_through_a_preemption_and_a_resume(tmp_path: Path) -> None:
    """Two processes of two CPU devices each train the batches one process trains on four devices
    (or one): the same losses, also after SIGTERM to the launcher stopped both at one step with a
    checkpoint and the launcher resumed them. Only process 0 writes the run's files and prints."""
    launched = ["--nproc=2", "--cpu_devices_per_proc=2", "--", *TINY, "--run_dir=two"]
    first = _launch(*launched, cwd=tmp_path)
    assert first.stdout is not None
    output = []
    for line in first.stdout:  # both processes have joined once process 0 names the run directory
        output.append(line)
        if line.startswith("[0] jaxzero: run_dir ") and line.rstrip().endswith(": a new run"):
            first.send_signal(signal.SIGTERM)
    first.wait(timeout=300)
    text = "".join(output)
    assert first.returncode == 3, text[-3000:]
    assert "[0] jaxzero: preempted: SIGTERM: saved a checkpoint at step" in text, text[-3000:]
    assert "[1] jaxzero: preempted: SIGTERM: saved a checkpoint at step" in text, text[-3000:]
    assert (
        "jaxzero.launch: stopped: rank 0 exited with status 3 (preempted), rank 1 exited with status 3"
        in text
    )
    stopped_at = len(_records(tmp_path / "two"))
    assert 1 <= stopped_at < 6

    second = _launch(*launched, cwd=tmp_path)
    out, _ = second.communicate(timeout=300)
    assert second.returncode == 0, out[-3000:]
    assert "[0] jaxzero: resumed from" in out and "[0] jaxzero: done: step 6" in out
    assert "[Gloo]" not in out and "CANCELLED" not in out  # third-party lines that say nothing
    assert not [
        ln for ln in out.splitlines() if ln.startswith("[1] step") or ln.startswith("[1] jaxzero: done")
    ]
    assert sorted(p.name for p in (tmp_path / "two").iterdir()) == [
        "checkpoints",
        "config.json",
        "metrics.jsonl",
        "summary.json",
        "tensorboard",
    ]

    four = run_module(
        "jaxzero.train",
        *TINY,
        "--run_dir=four",
        cwd=tmp_path,
        env_extra={"XLA_FLAGS": "--xla_force_host_platform_device_count=4"},
    )
    one = run_module("jaxzero.train", *TINY, "--run_dir=one", cwd=tmp_path)
    assert four.returncode == 0 and one.returncode == 0, (four.stderr + one.stderr)[-3000:]
    two = _records(tmp_path / "two")
    assert [r["step"] for r in two] == list(range(1, 7))  # one record per step, written by process 0
    for name in ("four", "one"):
        reference = _records(tmp_path / name)
        for key in ("loss", "grad_norm"):
            assert [r[key] for r in two] == pytest.approx([r[key] for r in reference], rel=1e-5), (name, key)
        assert two[-1]["val_loss"] == pytest.approx(reference[-1]["val_loss"], rel=1e-5), name


@pytest.mark.slow
def test_a_killed_process_stops_the_launch_naming_its_rank(tmp_path: Path) -> None:
    program = REPO / "tests" / "programs" / "dies_after_joining.py"
    launched = _launch("--nproc=2", "--grace_s=5", f"--script={program}", "--", "300", cwd=tmp_path)
    out, _ = launched.communicate(timeout=300)
    assert launched.returncode == 128 + signal.SIGKILL, out[-3000:]
    assert "jaxzero.launch: rank 1 (pid " in out and ") was killed by SIGKILL; stopping the other 1" in out
    assert (
        "jaxzero.launch: failed: rank 1 was killed by SIGKILL; then rank 0 was killed by SIGKILL when stopped"
        in out
    )
    assert "[0] process 0: passed" not in out


@pytest.mark.slow
def test_without_the_launcher_the_survivor_stops_within_the_timeout(tmp_path: Path) -> None:
    """No launcher to stop it: the survivor's own runtime notices its peer is gone within
    parallel.timeout_s (5 s here) and stops with an error naming the task."""
    program = REPO / "tests" / "programs" / "dies_after_joining.py"
    port = launch.free_port()
    processes = [
        subprocess.Popen(
            [sys.executable, str(program), "5"],
            cwd=tmp_path,
            env=user_env(
                JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_NUM_PROCESSES="2", JAX_PROCESS_ID=str(i)
            ),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]
    (survivor, _), _ = [p.communicate(timeout=300) for p in processes]
    assert processes[1].returncode == -signal.SIGKILL
    assert processes[0].returncode != 0, survivor[-3000:]
    assert "process 0: joined" in survivor and "Task 1 heartbeat timeout" in survivor, survivor[-3000:]
    assert "passed a barrier" not in survivor


def test_each_process_gets_its_own_equal_share_of_the_cores():
    assert launch.split_cores([3, 0, 1, 2, 4], 2) == [[0, 1], [2, 3]]  # the remainder stays unused
    assert launch.split_cores([0], 2) == [[], []]  # fewer cores than processes: no binding
    assert launch.parse_args(["--nproc=2", "--bind_cores=false"]).bind_cores is False
    assert launch.parse_args(["--nproc=2"]).bind_cores is True
    with pytest.raises(launch.UsageError, match="bind_cores"):
        launch.parse_args(["--nproc=2", "--bind_cores=maybe"])


@pytest.mark.slow
@pytest.mark.parametrize(
    "mode",
    [
        ["--offload.optimizer=cpu", "--offload.params=cpu"],
        ["--parallel.zero_stage=3"],
        # the embedding and block 0 updated on the accelerators, one shard per device
        ["--offload.optimizer=cpu", "--offload.params=cpu", "--offload.device_state_units=2"],
    ],
    ids=["zero3-offload", "fsdp", "zero3-offload-device-state"],
)
def test_zero3_over_two_processes_survives_sigkill_and_restores_on_one_device(tmp_path: Path, mode) -> None:
    """ZeRO-3 over 2 processes x 2 CPU devices (offloaded: each process holds half the host state;
    resident: FSDP), both killed by SIGKILL just after the save of step 4 starts, relaunched: they
    finish the run on the losses of one process on one device; the checkpoint then resumes on one
    process and one device (N -> M) and stays on that run's losses."""
    offload = [
        *TINY,
        *mode,
        "--checkpoint.every=2",
        "--optimizer.decay_steps=8",  # one schedule for every run, whatever its steps
    ]
    one_device = {"XLA_FLAGS": "--xla_force_host_platform_device_count=1"}
    one = run_module(
        "jaxzero.train", *offload, "--steps=8", "--run_dir=one", cwd=tmp_path, env_extra=one_device
    )
    assert one.returncode == 0, one.stderr[-3000:]

    program = str(REPO / "tests" / "programs" / "kill_after_save.py")
    killed = _launch(
        "--nproc=2",
        "--cpu_devices_per_proc=2",
        f"--script={program}",
        "--",
        "4",
        *offload,
        "--run_dir=two",
        cwd=tmp_path,
    )
    out, _ = killed.communicate(timeout=300)
    assert killed.returncode == 128 + signal.SIGKILL, out[-3000:]
    resumed = _launch("--nproc=2", "--cpu_devices_per_proc=2", "--", *offload, "--run_dir=two", cwd=tmp_path)
    out, _ = resumed.communicate(timeout=300)
    assert resumed.returncode == 0 and "[0] jaxzero: resumed from" in out, out[-3000:]
    on_one = run_module("jaxzero.train", "--run_dir=two", "--steps=8", cwd=tmp_path, env_extra=one_device)
    assert on_one.returncode == 0 and "resumed from" in on_one.stdout, on_one.stderr[-3000:]

    multi = [r for r in _records(tmp_path / "two") if "per_process" in r]  # the 2-process records
    assert multi and all(len(r["per_process"]["host_rss_gib"]) == 2 for r in multi)
    timed = [r for r in multi if "step_s" in r]  # offloaded runs time their steps' parts
    assert bool(timed) == (mode[0] == "--offload.optimizer=cpu") and all(
        r["step_s"] == pytest.approx(max(r["per_process"]["step_s"]), rel=1e-4) for r in timed
    )
    assert all(r["slowest_process"] in (0, 1) for r in timed)
    expected = {r["step"]: r["loss"] for r in _records(tmp_path / "one")}
    got = {r["step"]: r["loss"] for r in _records(tmp_path / "two")}
    assert sorted(got) == list(range(1, 9))
    for step, loss in expected.items():
        assert got[step] == pytest.approx(loss, rel=1e-5), step


@pytest.mark.slow
def test_sigterm_to_one_process_stops_every_process_at_one_step_with_one_checkpoint(tmp_path: Path) -> None:
    """SIGTERM reaches only process 1 (a scheduler preempting one task): both stop after the same
    step through JAX's preemption sync point, each having written its part of one checkpoint, and a
    rerun resumes from it."""
    args = [
        *TINY,
        "--steps=100000",
        "--checkpoint.every=0",
        "--offload.optimizer=cpu",
        "--offload.params=cpu",
    ]
    port = launch.free_port()
    env = {
        "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
        "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}",
    }
    processes = [
        subprocess.Popen(
            [sys.executable, "-m", "jaxzero.train", *args, "--run_dir=run"],
            cwd=tmp_path,
            env=user_env(**env, JAX_NUM_PROCESSES="2", JAX_PROCESS_ID=str(i)),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]
    metrics = tmp_path / "run" / "metrics.jsonl"
    deadline = time.time() + 240
    while time.time() < deadline and not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
        time.sleep(0.2)
    processes[1].send_signal(signal.SIGTERM)
    outs = [p.communicate(timeout=300)[0] for p in processes]
    assert [p.returncode for p in processes] == [3, 3], outs[0][-2000:] + outs[1][-2000:]
    saved = [int(p.name) for p in (tmp_path / "run" / "checkpoints").iterdir() if p.name.isdigit()]
    assert len(saved) == 1, saved
    for out in outs:
        assert f"saved a checkpoint at step {saved[0]}" in out, out[-2000:]


@pytest.mark.slow
def test_two_processes_set_a_damaged_checkpoint_aside_once(tmp_path: Path) -> None:
    """2 processes: one whole checksums file per checkpoint (process 0 writes it); the newest
    checkpoint damaged, a relaunch sets it aside once (process 0 moves it) and resumes from the one
    before."""
    args = [*TINY, "--steps=3", "--checkpoint.every=1", "--run_dir=run"]
    first = _launch("--nproc=2", "--cpu_devices_per_proc=2", "--", *args, cwd=tmp_path)
    out, _ = first.communicate(timeout=300)
    assert first.returncode == 0, out[-3000:]
    checkpoints = tmp_path / "run" / "checkpoints"
    for step in ("1", "2", "3"):
        json.loads((checkpoints / step / "checksums.json").read_text())  # whole, not interleaved
    damaged = max(
        (p for p in (checkpoints / "3" / "state").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size
    )
    damaged.write_bytes(b"\0" * damaged.stat().st_size)
    second = _launch(
        "--nproc=2", "--cpu_devices_per_proc=2", "--", *args[:-1], "--steps=4", "--run_dir=run", cwd=tmp_path
    )
    out, _ = second.communicate(timeout=300)
    assert second.returncode == 0, out[-3000:]
    assert out.count("moved unreadable checkpoint 3") == 1, out[-3000:]
    assert re.search(r"\[0\] jaxzero: resumed from \S+/checkpoints/2\b", out), out[-3000:]
    assert (tmp_path / "run" / "checkpoints-unreadable" / "3").is_dir()


@pytest.mark.slow
def test_two_processes_with_blocking_saves_restore_every_checkpoint_and_resume(tmp_path: Path) -> None:
    """Blocking saves (checkpoint.async_save=false) over 2 processes: several periodic saves and the
    final one (not on the period) all commit, each with its checksums; every checkpoint restores to
    its own step and data position, and a relaunch resumes from the last and saves past it (a step
    saved twice, or one a process's Orbax manager counts as saved already, fails the run)."""
    blocking = ["--checkpoint.async_save=false", "--checkpoint.every=2", "--checkpoint.keep=10"]
    launched = ["--nproc=2", "--cpu_devices_per_proc=2", "--", *TINY, *blocking, "--run_dir=run"]
    first = _launch(*launched, "--steps=5", cwd=tmp_path)
    out, _ = first.communicate(timeout=300)
    assert first.returncode == 0 and "[0] jaxzero: done: step 5" in out, out[-3000:]
    checkpoints = tmp_path / "run" / "checkpoints"
    assert sorted(int(p.name) for p in checkpoints.iterdir() if p.name.isdigit()) == [2, 4, 5]

    import jax  # the checkpoints restore in this process too, on one device

    from jaxzero import build_trainer, restore_state
    from jaxzero.plan import placement

    trainer = build_trainer(
        mesh=placement.make_mesh(jax.devices()[:1]),
        model__num_layers=2,
        model__compute_dtype="float32",
        data__seq_len=32,
        data__batch_size=8,
    )
    positions = []
    for step in (2, 4, 5):
        json.loads((checkpoints / str(step) / "checksums.json").read_text())  # written, whole
        state, restored_step, data_state = restore_state(trainer, tmp_path / "run", step=step)
        assert restored_step == step and int(jax.device_get(state.step)) == step
        assert data_state is not None
        positions.append((data_state.epoch, data_state.cursor))
    assert positions == sorted(set(positions))  # each its own step's data position

    second = _launch(*launched, "--steps=7", cwd=tmp_path)
    out, _ = second.communicate(timeout=300)
    assert second.returncode == 0, out[-3000:]
    assert re.search(r"\[0\] jaxzero: resumed from \S+/checkpoints/5\b", out), out[-3000:]
    assert "[0] jaxzero: done: step 7" in out and "StepAlreadyExists" not in out, out[-3000:]
    assert sorted(int(p.name) for p in checkpoints.iterdir() if p.name.isdigit()) == [2, 4, 5, 6, 7]
    assert [r["step"] for r in _records(tmp_path / "run")] == list(range(1, 8))


@pytest.mark.slow
def test_a_checkpoint_unusable_on_one_process_is_skipped_by_every_process(tmp_path: Path) -> None:
    """2 processes, where only process 1 cannot use the newest checkpoints (3 fails its checksums
    there, Orbax's restore of 2 raises there): every process skips both, each set aside once, and
    all resume from 1 together, then train and save past them."""
    args = [*TINY, "--checkpoint.every=1", "--run_dir=run"]
    first = _launch("--nproc=2", "--cpu_devices_per_proc=2", "--", *args, "--steps=3", cwd=tmp_path)
    out, _ = first.communicate(timeout=300)
    assert first.returncode == 0, out[-3000:]
    program = REPO / "tests" / "programs" / "unreadable_on_one_process.py"
    second = _launch(
        "--nproc=2", "--cpu_devices_per_proc=2", f"--script={program}", "--", *args, "--steps=5", cwd=tmp_path
    )
    try:
        out, _ = second.communicate(timeout=120)
    except subprocess.TimeoutExpired:  # the processes disagree and wait for each other
        second.terminate()
        out = second.communicate(timeout=60)[0]
        pytest.fail(f"the processes did not finish:\n{out[-3000:]}")
    assert second.returncode == 0, out[-3000:]
    for rank in (0, 1):
        assert f"[{rank}] process {rank}: resumed from step 1" in out, out[-3000:]
        assert re.search(
            rf"\[{rank}\] jaxzero: checkpoint \S+/checkpoints/3 is unreadable on process 1 "
            r"\(CheckpointError: checksum mismatch on process 1 only",
            out,
        ), out[-3000:]
        assert re.search(
            rf"\[{rank}\] jaxzero: checkpoint \S+/checkpoints/2 is unreadable on process 1 "
            r"\(OSError: read error on process 1 only",
            out,
        ), out[-3000:]
    assert out.count("moved unreadable checkpoint 3") == 1 and out.count("moved unreadable checkpoint 2") == 1
    assert "[0] jaxzero: done: step 5" in out and "StepAlreadyExists" not in out, out[-3000:]
    run = tmp_path / "run"
    assert sorted(p.name for p in (run / "checkpoints-unreadable").iterdir()) == ["2", "3"]
    assert sorted(int(p.name) for p in (run / "checkpoints").iterdir() if p.name.isdigit()) == [3, 4, 5]
    assert [r["step"] for r in _records(run)] == list(range(1, 6))


def test_only_third_party_lines_that_say_nothing_are_held_back() -> None:
    connected = "[Gloo] Rank 1 is connected to 1 peer ranks. Expected number of connected peer ranks is : 1"
    assert launch._says_nothing(connected)
    assert not launch._says_nothing(connected.replace("connected to 1", "connected to 0"))  # a peer missing
    assert not launch._says_nothing("jaxzero: done: step 6")
    # Two ranks' threads of one process write their pieces into one line (seen in CI).
    rest = " is connected to 3 peer ranks. Expected number of connected peer ranks is : 3"
    interleaved = "[Gloo] Rank 1[Gloo] Rank 0" + rest
    assert launch._says_nothing(interleaved) and launch._says_nothing(rest)
    assert not launch._says_nothing(rest.replace("to 3", "to 2"))
    assert not launch._says_nothing(interleaved + " jaxzero: done")
