"""BusyPoller on a real event loop with socketpairs: it lingers after serving, ends as soon as
bytes arrive, backs off when none do, and never watches a number another connection took."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator

import pytest

from kvpool_master.rpc.busypoll import BusyPoller
from kvpool_wire.polling import MAX_SKIPS


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    ours, theirs = socket.socketpair()
    yield ours, theirs
    ours.close()
    theirs.close()


async def _one_linger(poller: BusyPoller) -> None:
    poller.served()
    await asyncio.sleep(0)  # the linger runs as a callback of this iteration
    await asyncio.sleep(0)


async def test_a_linger_ends_when_bytes_arrive(pair) -> None:
    poller = BusyPoller(budget_us=2_000_000)  # 2 s: only bytes can end it early
    ours, theirs = pair
    try:
        poller.watch(ours.fileno(), "conn")
        timer = threading.Timer(0.05, theirs.send, args=(b"x",))
        timer.start()
        started = time.monotonic()
        await _one_linger(poller)
        elapsed_s = time.monotonic() - started
        timer.join()
        assert (poller.num_hits, poller.num_misses) == (1, 0)
        assert elapsed_s < 1.5 and 0 < poller.polled_s < 1.5
        assert ours.recv(1) == b"x"  # polling never reads: the bytes are still there
    finally:
        poller.close()


async def test_empty_lingers_back_off_and_a_hit_resets(pair) -> None:
    poller = BusyPoller(budget_us=200)
    ours, theirs = pair
    try:
        poller.watch(ours.fileno(), "conn")
        for _ in range(40):
            await _one_linger(poller)
        # lingers on calls 1, 3, 6, 11, 20, 37: skipping 1, 2, 4, 8, 16 calls in between
        assert poller.num_misses == 6 and poller.num_hits == 0
        theirs.send(b"x")
        for _ in range(MAX_SKIPS + 1):
            await _one_linger(poller)
            if poller.num_hits:
                break
        assert poller.num_hits == 1
        await _one_linger(poller)
        assert poller.num_hits == 2  # no skipping right after a hit
    finally:
        poller.close()


def test_a_reused_fd_number_stays_watched(pair) -> None:
    poller = BusyPoller(budget_us=100)
    ours, _theirs = pair
    try:
        poller.watch(ours.fileno(), "old")
        poller.watch(ours.fileno(), "new")  # the number was reused before "old" was forgotten
        poller.forget(ours.fileno(), "old")
        assert poller._fd_to_owner == {ours.fileno(): "new"}
        poller.forget(ours.fileno(), "new")
        assert poller._fd_to_owner == {}
    finally:
        poller.close()


async def test_budget_zero_never_lingers() -> None:
    poller = BusyPoller(budget_us=0)
    assert not poller.enabled
    poller.watch(3, "conn")
    await _one_linger(poller)
    assert (poller.num_hits, poller.num_misses, poller.polled_s) == (0, 0, 0.0)
    poller.close()
