"""The adaptive two-pass count (`TwoPassCounter`), through its public API, with explicit times."""

from jaxzero.offload.two_pass import TwoPassCounter
from jaxzero.plan import TwoPass


def second_passes(counter: TwoPassCounter, step: int, ends: list[float]) -> None:
    """Two-pass updates of `step` whose second passes ended at `ends`."""
    for t in ends:
        counter.begin()
        counter.end(step, t)


def test_adaptive_two_pass_count_follows_the_host_slack():
    """The adaptive count: that many fewer units for each second pass still running when the next
    norm arrives; with none running, one more only if the slack since the last second pass ended
    would fit another (1.5x their mean interval); within [0, the maximum]."""
    c = TwoPassCounter(TwoPass(max_units=5, adaptive=True))
    assert c.units(0, now=0.0) == 5  # the first step: the maximum
    c.begin()
    c.begin()  # two of step 0's second passes still running at step 1's norm
    assert c.units(1, now=1.0) == 3
    assert c.units(1, now=9.0) == 3  # decided once per step
    c.end(0, 1.05)
    c.end(0, 1.06)
    second_passes(c, 1, [1.1, 1.2, 1.3])  # step 1's three second passes, 0.1 s apart
    assert c.units(2, now=1.349) == 3  # 0.049 s of slack: no room for a fourth
    second_passes(c, 2, [2.1, 2.2, 2.3])
    assert c.units(3, now=2.451) == 4  # 0.151 s >= 1.5 x 0.1 s: room for one more
    second_passes(c, 3, [3.2])  # one second pass: nothing to measure an interval by
    assert [c.units(s, now=float(s)) for s in (4, 5, 6)] == [5, 5, 5]  # capped
    for _ in range(9):
        c.begin()
    assert c.units(7, now=7.0) == 0
    assert set(c._count_of) | set(c._ends) <= {5, 6, 7}  # old steps' records are dropped (memory)


def test_a_failed_two_pass_update_stops_counting_as_running():
    c = TwoPassCounter(TwoPass(max_units=4, adaptive=True))
    assert c.units(0, now=0.0) == 4
    c.begin()
    c.end(0, None)  # failed: no end time, no longer running
    assert c.units(1, now=1.0) == 4  # nothing late, and no interval to measure: capped at 4


def test_a_fixed_count_does_not_adapt():
    c = TwoPassCounter(TwoPass(max_units=3, adaptive=False))
    for _ in range(5):
        c.begin()  # late second passes do not matter
    assert [c.units(s, now=float(s)) for s in range(4)] == [3, 3, 3, 3]
    off = TwoPassCounter(TwoPass(max_units=0, adaptive=False))
    assert off.units(0, now=0.0) == 0
