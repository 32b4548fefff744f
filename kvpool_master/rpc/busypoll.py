"""Busy polling: after serving lean frames the master keeps its core for a moment.

Why: a small call costs the master about 10-30 µs of Python, but waking a sleeping process
costs about 25 µs here (a virtual machine: the idle core halts and must be woken by another).
Clients send their calls in quick succession (a put is two calls a few microseconds apart,
an engine loads or saves many blocks in a row), so sleeping between two calls of one burst
doubles their cost. ``benchmarks/rpc_floor.py`` shows the effect.

How: the lean server registers the socket of every connection in an epoll set of its own.
After a loop iteration that served lean frames, one callback polls that set, without reading,
for at most ``budget_us``, and yields the core between polls (``sched_yield``) so that a process
waiting for this core is not held back. It returns as soon as any connection has bytes; the
event loop then reads them without sleeping. A linger that ends empty backs off: the next 1,
2, 4 ... 64 chances to linger are skipped (``kvpool_wire.polling.PollBackoff``, which the
client's calls use too), so a master whose clients call now and then spends at most
``budget_us`` per 64 calls, while a busy master keeps polling.

Costs, bounded: the loop's other work (gRPC calls, timers, the metrics endpoint) waits at most
``budget_us``; lean frames never wait. ``--busy-poll-us 0`` turns it off. The time spent and the
outcome of every linger are exported (``kvpool_busy_poll_*``).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import select
import time

from kvpool_wire.polling import PollBackoff


class BusyPoller:
    """Lingers on the lean connections after serving them; see the module docstring."""

    def __init__(self, budget_us: int) -> None:
        self._budget_s = budget_us / 1e6
        use = budget_us > 0 and hasattr(select, "epoll")
        self._epoll: select.epoll | None = select.epoll() if use else None
        self._fd_to_owner: dict[int, object] = {}
        self._armed = False
        self.backoff = PollBackoff()
        self.num_hits = 0  # lingers that ended because bytes arrived
        self.num_misses = 0  # lingers that ran out of budget
        self.polled_s = 0.0  # time spent lingering

    @property
    def enabled(self) -> bool:
        """False when the budget is 0 or this system has no epoll."""
        return self._epoll is not None

    def watch(self, fd: int, owner: object) -> None:
        """Linger for bytes on ``fd`` too (a connection ``owner`` just made)."""
        if self._epoll is None or fd < 0:
            return
        with contextlib.suppress(OSError):  # the fd number of a closed, unforgotten connection
            self._epoll.unregister(fd)
        self._epoll.register(fd, select.EPOLLIN)
        self._fd_to_owner[fd] = owner

    def forget(self, fd: int, owner: object) -> None:
        """Stop watching ``fd`` unless another connection has taken that number since."""
        if self._epoll is None or self._fd_to_owner.get(fd) is not owner:
            return
        del self._fd_to_owner[fd]
        with contextlib.suppress(OSError):  # closed already: epoll dropped it by itself
            self._epoll.unregister(fd)

    def served(self) -> None:
        """Lean frames were served: linger once this loop iteration's callbacks have run."""
        if self._epoll is None or self._armed or not self.backoff.take():
            return
        self._armed = True
        asyncio.get_running_loop().call_soon(self._linger)

    def _linger(self) -> None:
        self._armed = False
        epoll = self._epoll
        if epoll is None:
            return
        started = time.monotonic()
        until = started + self._budget_s
        hit = False
        while True:
            if epoll.poll(0):
                hit = True
                break
            if time.monotonic() >= until:
                break
            os.sched_yield()
        self.polled_s += time.monotonic() - started
        if hit:
            self.num_hits += 1
            self.backoff.paid()
        else:
            self.num_misses += 1
            self.backoff.ran_out()

    def close(self) -> None:
        """Release the epoll set (idempotent)."""
        epoll, self._epoll = self._epoll, None
        self._fd_to_owner.clear()
        if epoll is not None:
            epoll.close()
