"""The serving clock stands still across stalls and never goes backwards (no sleeps: a fake
monotonic source drives it)."""

from __future__ import annotations

import pytest

from kvpool_master.clock import ServingClock


class FakeMonotonic:
    def __init__(self) -> None:
        self.now_s = 1000.0

    def __call__(self) -> float:
        return self.now_s


def test_advances_with_regular_observations() -> None:
    source = FakeMonotonic()
    clock = ServingClock(stall_threshold_s=0.5, start_s=7.0, monotonic=source)
    assert clock.now() == 7.0
    for _ in range(30):
        source.now_s += 0.1
        clock.now()
    assert clock.now() == pytest.approx(10.0)
    assert clock.stalled_s == 0 and clock.num_stalls == 0


def test_a_gap_beyond_the_threshold_is_not_serving_time() -> None:
    source = FakeMonotonic()
    clock = ServingClock(stall_threshold_s=0.5, monotonic=source)
    source.now_s += 0.4
    before = clock.now()
    source.now_s += 20.0  # SIGSTOP for 20 s
    assert clock.now() == before
    assert clock.stalled_s == pytest.approx(20.0) and clock.num_stalls == 1
    source.now_s += 0.25
    assert clock.now() == pytest.approx(before + 0.25)


def test_never_goes_backwards() -> None:
    source = FakeMonotonic()
    clock = ServingClock(monotonic=source)
    source.now_s += 0.2
    first = clock.now()
    source.now_s -= 5.0  # a misbehaving source
    assert clock.now() == first
    source.now_s += 0.1
    assert clock.now() >= first


def test_threshold_must_be_positive() -> None:
    with pytest.raises(ValueError):
        ServingClock(stall_threshold_s=0)
