"""How late the master's event loop runs what is due: the wait a call arriving at a random
moment sees before the master gets to it.

Every ``interval_s`` a timer is due; when it fires, how late it fired is one sample. A stall of
the loop (a long step, a collector pause, the process starved of CPU) delays the timers due
during it, so the samples' distribution is the distribution of the extra wait a request sees,
measured from inside without a probe client: the master's "no stall over 10 ms" as a
histogram (``kvpool_master_loop_lag_seconds``), plus the longest lag seen.
"""

from __future__ import annotations

import asyncio
import bisect

#: Lag buckets from 1 ms (the timers' own resolution) to 2.5 s.
LAG_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)

#: One sample every this many seconds: 50 a second, a timer callback each.
LAG_INTERVAL_S = 0.02


class LoopLag:
    """Samples of how late timers fire on one loop (``start`` on that loop, ``stop`` to end)."""

    def __init__(self, interval_s: float = LAG_INTERVAL_S) -> None:
        if not interval_s > 0:
            raise ValueError("interval_s must be > 0")
        self.interval_s = interval_s
        #: per bucket of ``LAG_BUCKETS_S`` (and one past the last) how many samples fell in it
        self.buckets = [0] * (len(LAG_BUCKETS_S) + 1)
        self.count = 0
        self.sum_s = 0.0
        self.max_s = 0.0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._timer: asyncio.TimerHandle | None = None

    def start(self) -> None:
        """Start sampling on the running loop."""
        self._loop = asyncio.get_running_loop()
        self._schedule(self._loop.time() + self.interval_s)

    def stop(self) -> None:
        """Stop sampling (idempotent)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def observe(self, lag_s: float) -> None:
        """Count one sample of ``lag_s`` seconds."""
        lag_s = max(lag_s, 0.0)
        self.buckets[bisect.bisect_left(LAG_BUCKETS_S, lag_s)] += 1
        self.count += 1
        self.sum_s += lag_s
        if lag_s > self.max_s:
            self.max_s = lag_s

    def _schedule(self, due_s: float) -> None:
        assert self._loop is not None
        self._timer = self._loop.call_at(due_s, self._fired, due_s)

    def _fired(self, due_s: float) -> None:
        now_s = self._loop.time()  # type: ignore[union-attr]
        self.observe(now_s - due_s)
        self._schedule(now_s + self.interval_s)
