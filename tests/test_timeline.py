"""Where an offloaded step's time goes: the interval arithmetic and the clock, with known times."""

import time

import jax
import jax.numpy as jnp
import pytest

from jaxzero.offload import timeline
from jaxzero.offload.timeline import StepClock, busy, union
from jaxzero.state import BREAKDOWN_TIMES


def test_busy_time_of_in_order_work():
    # Issued at 0 and 0.5, finished at 1 and 3: the second starts when the first finishes.
    assert busy([(0.0, 1.0), (0.5, 3.0)]) == pytest.approx(3.0)
    # A gap: issued at 5 after the previous finished at 1.
    assert busy([(0.0, 1.0), (5.0, 6.0)]) == pytest.approx(2.0)
    # Order of finishing decides, not the order given.
    assert busy([(5.0, 6.0), (0.0, 1.0)]) == pytest.approx(2.0)
    assert busy([]) == 0.0


def test_union_of_intervals():
    assert union([(0.0, 1.0), (0.5, 2.0), (3.0, 4.0)]) == pytest.approx(3.0)
    assert union([(0.0, 10.0), (1.0, 2.0)]) == pytest.approx(10.0)  # nested
    assert union([]) == 0.0


def test_the_clock_reports_every_breakdown_time_from_what_happened(monkeypatch):
    clock = StepClock()
    x = jnp.ones(8)
    clock.computed(x + 1)
    clock.copied(jax.device_put(x))
    clock.sent(jax.device_put(x))
    now = time.perf_counter()
    clock.updated(now - 0.4, now - 0.3)  # two overlapping unit updates: 0.3 s of host work
    clock.updated(now - 0.35, now - 0.1)
    with clock.waiting():
        time.sleep(0.02)
    jax.block_until_ready(x)
    time.sleep(0.05)  # the watcher threads note the finished arrays
    out = clock.summary(wall=1.0)
    assert list(out) == [k.key for k in BREAKDOWN_TIMES]
    assert out["host_update_s"] == pytest.approx(0.3, abs=0.02)
    assert out["host_idle_s"] == pytest.approx(1.0 - out["host_update_s"])
    assert out["gpu_idle_s"] == pytest.approx(1.0 - out["gpu_compute_s"])
    assert 0.02 <= out["wait_weights_s"] < 0.5
    for key in ("gpu_compute_s", "h2d_s", "d2h_s"):
        assert 0.0 <= out[key] < 1.0, key
    # Read once: the next window starts empty.
    again = clock.summary(wall=1.0)
    assert again["host_update_s"] == again["wait_weights_s"] == again["gpu_compute_s"] == 0.0


def test_work_begun_before_the_window_counts_from_its_start():
    clock = StepClock()
    now = time.perf_counter()
    clock.updated(now - 5.0, now - 0.5)  # began 4.5 s before a 1 s window opened
    assert clock.summary(wall=1.0)["host_update_s"] == pytest.approx(0.5, abs=0.05)


def test_the_off_clock_records_nothing():
    off = StepClock.off()
    assert not off.enabled and off is StepClock.off()
    x = off.computed(jnp.ones(2))
    assert x.shape == (2,)
    off.updated(0.0, 1.0)
    assert off.summary(wall=1.0)["host_update_s"] == 0.0
    assert timeline.STREAMS == ("h2d", "compute", "d2h")
