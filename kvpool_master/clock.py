"""The serving clock: the time the master core sees, which stands still while the master stalls.

Why: client liveness deadlines, PENDING reclaim and leases are measured in the core's ``now``.
If the master process is paused (SIGSTOP, a VM freeze, a long GC or swap storm) its clients keep
heartbeating into a socket nobody reads; on resume, a wall or monotonic clock would make every
client look silent for the whole pause and the master would expire them all (Mooncake issue
#3937). Here deadlines are measured in time the master was actually serving.

How: the server observes the clock at least every ``tick_interval_s`` (a tick task) and on every
request. Consecutive observations normally lie a tick apart; a gap longer than
``stall_threshold_s`` means the process was not running (or its loop was blocked), so the whole
gap is counted as stalled and the serving clock does not advance across it. The clock never goes
backwards. The caller passes the monotonic source, so tests drive it without sleeping.
"""

from __future__ import annotations

import time
from collections.abc import Callable


class ServingClock:
    """Monotonic seconds of serving time, starting at ``start_s``."""

    def __init__(self, *, stall_threshold_s: float = 0.5, start_s: float = 0.0,
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        if stall_threshold_s <= 0:
            raise ValueError("stall_threshold_s must be > 0")
        self._monotonic = monotonic
        self._stall_threshold_s = stall_threshold_s
        self._last_observed_s = monotonic()
        self._now_s = start_s
        self.stalled_s = 0.0   # total time subtracted, exported as a metric
        self.num_stalls = 0

    def now(self) -> float:
        """Observe the monotonic clock; return the serving time (stalls excluded)."""
        observed_s = self._monotonic()
        gap_s = observed_s - self._last_observed_s
        self._last_observed_s = observed_s
        if gap_s > self._stall_threshold_s:
            self.stalled_s += gap_s
            self.num_stalls += 1
        elif gap_s > 0:
            self._now_s += gap_s
        return self._now_s

    @property
    def stall_threshold_s(self) -> float:
        """Gaps between observations longer than this are counted as stalls."""
        return self._stall_threshold_s
