"""`--determinism=true`: XLA's deterministic GPU kernels asked for before JAX starts (the flags added to
`XLA_FLAGS` once, after the user's, and refused once an accelerator's backend runs without them), and
the host side reproducible whatever its schedule: the fused kernels bitwise the same over any chunking,
thread count and completion order, and two runs of the trainer bitwise equal, with the host's
timing-driven choices (threads, the adaptive two-pass count) differing between them.

The GPU proof (two runs of the 3.37B preset, and a resume, bitwise equal) is a benchmark:
scripts/bench_determinism.py.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import jax
import numpy as np
import pytest
from subprocess_run import user_env

from jaxzero.config import ConfigError, TrainConfig
from jaxzero.data import build_data
from jaxzero.offload import host_kernels
from jaxzero.overrides import apply_overrides
from jaxzero.plan import placement
from jaxzero.planner import preflight, runtime
from jaxzero.trainer import build_trainer

ADDED = "--xla_gpu_deterministic_ops=true --xla_gpu_exclude_nondeterministic_ops=true"
OFFLOADED = {"offload.optimizer": "cpu", "offload.params": "cpu"}


@pytest.fixture
def before_jax(monkeypatch):
    """This process as one whose JAX has not started (the tests' own runs on the CPU)."""
    monkeypatch.setattr(runtime, "started_platforms", lambda: set())


def test_prepare_adds_the_flags_once_after_the_users(monkeypatch, before_jax):
    user = "--xla_force_host_platform_device_count=4 --xla_dump_to=/tmp/somewhere"
    monkeypatch.setenv("XLA_FLAGS", user)
    plain = apply_overrides(TrainConfig(), OFFLOADED)
    preflight.decide_before_jax(plain)
    assert os.environ["XLA_FLAGS"] == user  # determinism off: untouched
    deterministic = apply_overrides(TrainConfig(), {**OFFLOADED, "determinism": "true"})
    preflight.decide_before_jax(deterministic)
    assert os.environ["XLA_FLAGS"] == f"{user} {ADDED}"
    preflight.decide_before_jax(deterministic)  # again (a second run in this process): nothing repeated
    assert os.environ["XLA_FLAGS"] == f"{user} {ADDED}"
    monkeypatch.delenv("XLA_FLAGS")
    runtime.request_determinism()
    assert os.environ["XLA_FLAGS"] == ADDED


def test_a_flag_the_user_set_is_kept_and_one_turned_off_refused(monkeypatch, before_jax):
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_deterministic_ops")  # bare: true
    runtime.request_determinism()
    assert os.environ["XLA_FLAGS"] == (
        "--xla_gpu_deterministic_ops --xla_gpu_exclude_nondeterministic_ops=true"
    )
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_deterministic_ops=true --xla_gpu_deterministic_ops=false")
    with pytest.raises(ConfigError, match="xla_gpu_deterministic_ops=false: remove it"):
        runtime.request_determinism()  # the last one counts, as XLA reads them


def test_refused_once_an_accelerators_backend_runs_without_them(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
    for started in ({"cpu", "cuda"}, None):  # a GPU's backend runs, or JAX's private API moved
        monkeypatch.setattr(runtime, "started_platforms", lambda started=started: started)
        with pytest.raises(ConfigError, match="before the first JAX call") as refused:
            runtime.request_determinism()
        assert f"XLA_FLAGS='--xla_force_host_platform_device_count=4 {ADDED}'" in str(refused.value)
    monkeypatch.setenv("XLA_FLAGS", ADDED)  # set in the environment before JAX started: fine
    runtime.request_determinism()
    monkeypatch.setattr(runtime, "started_platforms", lambda: {"cpu"})  # XLA:CPU only: nothing to set
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
    runtime.request_determinism()
    assert os.environ["XLA_FLAGS"] == "--xla_force_host_platform_device_count=4"


def test_a_program_starts_jax_with_the_flags_this_xla_knows():
    """Through `decide_before_jax`, as `python -m jaxzero.train` calls it, in a fresh process: the flags
    are in `XLA_FLAGS` before the backend starts, and it starts (XLA ends a process whose `XLA_FLAGS`
    names a flag it does not know)."""
    code = (
        "import os\n"
        "from jax._src import xla_bridge\n"
        "from jaxzero.planner import preflight\n"
        "from jaxzero.config import TrainConfig\n"
        "from jaxzero.overrides import apply_overrides\n"
        "cfg = apply_overrides(TrainConfig(), {'determinism': 'true', 'offload.optimizer': 'cpu'})\n"
        "preflight.decide_before_jax(cfg)\n"
        "assert not xla_bridge.backends_are_initialized()\n"
        "import jax\n"
        "assert int(jax.jit(lambda x: x + 1)(1)) == 2\n"
        "print(os.environ['XLA_FLAGS'])\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=user_env(), timeout=240
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == ADDED


def test_the_host_kernels_give_the_same_bits_over_any_chunking_threads_and_order():
    """One AdamW update of a long array (bfloat16 moments, gradients and weights) in one call, and in
    chunks of other sizes run on pools of other sizes in shuffled order: the kernels are elementwise,
    so nothing of the schedule reaches the result."""
    tile = host_kernels.LAYOUTS[True][0]  # bfloat16 moments' tile
    n = 3 * tile + 4321
    rng = np.random.default_rng(3)
    bits = lambda x: (x.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)  # noqa: E731
    p0 = rng.standard_normal(n).astype(np.float32)
    m0, v0 = bits(rng.standard_normal(n) * 0.1), bits(np.abs(rng.standard_normal(n)))
    g = bits(rng.standard_normal(n))
    rule = host_kernels.FusedRule(name="adamw", b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1, momentum=0.0)
    kernel = rule.kernel(6, 3e-4, 0.37)

    def update(size: int | None, threads: int, seed: int):
        p, m, v, w = p0.copy(), m0.copy(), v0.copy(), np.zeros(n, np.uint16)
        pieces = host_kernels.chunks(n, size) if size else [slice(0, n)]
        random.Random(seed).shuffle(pieces)
        with ThreadPoolExecutor(threads) as pool:
            for f in [pool.submit(kernel, p[s], m[s], v[s], g[s], w[s], 0.1) for s in pieces]:
                f.result()
        return p, m, v, w

    whole = update(None, 1, 0)
    assert not np.array_equal(whole[0], p0)  # it did update
    for size, threads, seed in ((1000, 4, 1), (4097, 2, 2), (tile, 3, 3)):
        for a, b in zip(update(size, threads, seed), whole, strict=True):
            np.testing.assert_array_equal(a, b)


def tiny(**over: str) -> TrainConfig:
    return apply_overrides(
        TrainConfig(),
        {
            "model.name": "llama-tiny",
            "model.num_layers": "3",
            "data.seq_len": "32",
            "data.batch_size": "8",
            "data.grad_accum": "2",
            "steps": "4",
            "optimizer.warmup_steps": "2",
            "optimizer.lr": "1e-2",
            "determinism": "true",
            **over,
        },
    )


def train(cfg: TrainConfig):
    """Per-step losses and gradient norms, the final saved state (masters, optimizer state), and the
    host update's counts (`two_pass_units`; None for the resident trainer)."""
    trainer = build_trainer(cfg, placement.make_mesh(jax.devices()[:1]))
    batches = build_data(cfg.data, cfg.model.vocab_size, cfg.seed).train_iter()
    state = trainer.init(jax.random.key(cfg.seed))
    losses, norms = [], []
    for _ in range(cfg.steps):
        state, m = trainer.step(state, trainer.put_batch(next(batches)))
        m = jax.device_get(m)
        losses.append(np.float32(m.loss))
        norms.append(np.float32(m.grad_norm))
    saved = jax.device_get(trainer.saved_state(state))
    counts = None if trainer.timings is None else trainer.timings(1.0, 1)
    trainer.close()
    return np.array(losses), np.array(norms), saved, counts


def assert_bitwise(a, b) -> None:
    (la, na, sa, _), (lb, nb, sb, _) = a, b
    np.testing.assert_array_equal(la.view(np.uint32), lb.view(np.uint32))
    np.testing.assert_array_equal(na.view(np.uint32), nb.view(np.uint32))
    assert jax.tree.structure(sa) == jax.tree.structure(sb)
    for x, y in zip(jax.tree.leaves(sa), jax.tree.leaves(sb), strict=True):
        x, y = np.atleast_1d(np.asarray(x)), np.atleast_1d(np.asarray(y))
        assert x.dtype == y.dtype
        np.testing.assert_array_equal(x.view(np.uint8), y.view(np.uint8))


# Each case: the first run's settings, and the second's, whose host schedule differs: other thread
# counts and, with clipping on (below grad_clip and above it), the adaptive two-pass count against none.
HOST_SCHEDULES = {
    "resident": ({}, {}),
    "zero3-unclipped": (
        {
            **OFFLOADED,
            "optimizer.grad_clip": "50",
            "offload.host_threads": "1",
            "offload.two_pass_units": "0",
        },
        {
            **OFFLOADED,
            "optimizer.grad_clip": "50",
            "offload.host_threads": "3",
        },
    ),
    "zero3-clipped": (
        {
            **OFFLOADED,
            "optimizer.grad_clip": "0.5",
            "offload.host_threads": "1",
            "offload.two_pass_units": "0",
        },
        {
            **OFFLOADED,
            "optimizer.grad_clip": "0.5",
            "offload.host_threads": "3",
        },
    ),
    "zero-offload-delayed": (
        {"offload.optimizer": "cpu", "offload.update": "delayed", "offload.host_threads": "1"},
        {"offload.optimizer": "cpu", "offload.update": "delayed", "offload.host_threads": "3"},
    ),
}


@pytest.mark.parametrize("case", list(HOST_SCHEDULES))
def test_runs_are_bitwise_equal_whatever_the_host_schedule(case):
    """Two runs of one command give the same losses, gradient norms, masters and optimizer state bit
    for bit, and so does a run whose host update is scheduled otherwise."""
    first, second = HOST_SCHEDULES[case]
    reference = train(tiny(**first))
    assert_bitwise(train(tiny(**first)), reference)
    if second == first:
        return
    other = train(tiny(**second))
    assert_bitwise(other, reference)
    counts = other[3]
    if case == "zero3-unclipped":  # never clipped: units in two passes
        assert counts["two_pass_units"] > 0
