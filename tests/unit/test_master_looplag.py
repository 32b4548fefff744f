"""The loop-lag sampler (``kvpool_master.looplag``): a stall of the loop shows as a sample at
least as late as the stall kept a due timer waiting; an idle loop's samples count too."""

from __future__ import annotations

import asyncio
import time

import pytest

from kvpool_master.looplag import LAG_BUCKETS_S, LoopLag


async def test_a_stall_of_the_loop_is_sampled_as_lag() -> None:
    lag = LoopLag(interval_s=0.01)
    lag.start()
    try:
        await asyncio.sleep(0.05)          # idle: a few samples
        idle_samples = lag.count
        assert idle_samples >= 1
        time.sleep(0.08)                   # the loop blocked for 80 ms: a due timer waits
        await asyncio.sleep(0.03)
    finally:
        lag.stop()
    # the timer due 10 ms into the stall fired at its end, at least 60 ms late (however
    # slow the machine: lateness only grows)
    assert lag.max_s >= 0.06
    late = sum(lag.buckets[LAG_BUCKETS_S.index(0.05) + 1:])
    assert late >= 1 and lag.count > idle_samples
    assert sum(lag.buckets) == lag.count and lag.sum_s >= lag.max_s
    count = lag.count
    await asyncio.sleep(0.05)
    assert lag.count == count              # stopped: no more samples


def test_samples_land_in_their_buckets() -> None:
    lag = LoopLag()
    for lag_s in (-0.001, 0.0005, 0.001, 0.003, 3.0):
        lag.observe(lag_s)
    assert lag.buckets[0] == 3             # clamped to 0, 0.5 ms, exactly 1 ms: le 1 ms
    assert lag.buckets[LAG_BUCKETS_S.index(0.005)] == 1
    assert lag.buckets[-1] == 1            # past the last bound: +Inf only
    assert lag.count == 5 and lag.max_s == 3.0
    with pytest.raises(ValueError):
        LoopLag(interval_s=0)
