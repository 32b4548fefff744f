"""AsyncWriter: bounded queue, batching, failures counted and reported, commits watched.

The write function is a stand-in gated by asyncio events: no sockets, no sleeps."""

from __future__ import annotations

import asyncio

import pytest

from kvpool_client.asyncwrite import AsyncWriter
from kvpool_client.buffers import Regions
from kvpool_client.metrics import ClientMetrics
from kvpool_wire.status import KVPoolError, Status
from kvpool_wire.types import Pin, PutOptions


class FakePool:
    """Records batches; fails the keys it is told to; waits for ``gate`` when asked."""

    def __init__(self) -> None:
        self.batches: list[list[bytes]] = []
        self.fail: dict[bytes, Status] = {}
        self.gate: asyncio.Event | None = None
        self.raise_status: Status | None = None

    async def write(self, keys: list[bytes], regions: list[Regions],
                    options: PutOptions) -> list[Status]:
        if self.gate is not None:
            await self.gate.wait()
        self.batches.append(list(keys))
        if self.raise_status is not None:
            raise KVPoolError(self.raise_status, "master unreachable")
        return [self.fail.get(k, Status.OK) for k in keys]


def region(data: bytes) -> Regions:
    return [memoryview(data)]


async def test_writes_are_batched_and_flushed() -> None:
    pool, metrics = FakePool(), ClientMetrics()
    writer = AsyncWriter(pool.write, 100, metrics)
    pool.gate = asyncio.Event()
    keys = [f"k{i}".encode() for i in range(10)]
    await writer.submit(keys, [region(b"x")] * 10, PutOptions())
    assert writer.pending == 10 and metrics.async_queue_depth == 10
    pool.gate.set()
    await writer.flush(timeout_s=5)
    assert [k for batch in pool.batches for k in batch] == keys
    assert len(pool.batches) == 1  # queued together, written together
    assert writer.pending == 0 and metrics.async_queue_depth == 0


async def test_queue_is_bounded() -> None:
    pool = FakePool()
    writer = AsyncWriter(pool.write, 2, ClientMetrics())
    pool.gate = asyncio.Event()
    await writer.submit([b"a", b"b"], [region(b"1"), region(b"2")], PutOptions())
    blocked = asyncio.ensure_future(writer.submit([b"c"], [region(b"3")], PutOptions()))
    for _ in range(5):
        await asyncio.sleep(0)
    assert not blocked.done()  # waits for room instead of dropping
    pool.gate.set()
    await asyncio.wait_for(blocked, 5)
    await writer.flush(5)
    assert sorted(k for batch in pool.batches for k in batch) == [b"a", b"b", b"c"]


async def test_failures_are_counted_and_reported_once() -> None:
    pool, metrics = FakePool(), ClientMetrics()
    writer = AsyncWriter(pool.write, 10, metrics)
    pool.fail = {b"bad1": Status.NO_SPACE, b"bad2": Status.TRANSFER_FAILED}
    await writer.submit([b"ok", b"bad1", b"bad2"], [region(b"x")] * 3, PutOptions())
    with pytest.raises(KVPoolError) as info:
        await writer.flush(5)
    assert info.value.status == Status.NO_SPACE
    assert "2 async writes failed" in str(info.value) and "TRANSFER_FAILED" in str(info.value)
    assert metrics.async_failures == 2
    await writer.flush(5)  # reported, then counted afresh
    pool.raise_status = Status.RPC_FAILED
    await writer.submit([b"x1", b"x2"], [region(b"x")] * 2, PutOptions())
    with pytest.raises(KVPoolError, match="2 async writes failed") as info:
        await writer.flush(5)
    assert info.value.status == Status.RPC_FAILED


async def test_same_key_twice_and_different_options_go_in_separate_batches() -> None:
    pool = FakePool()
    writer = AsyncWriter(pool.write, 10, ClientMetrics())
    pool.gate = asyncio.Event()
    await writer.submit([b"a", b"a"], [region(b"1"), region(b"2")], PutOptions())
    await writer.submit([b"b"], [region(b"3")], PutOptions(pin=Pin.HARD))
    pool.gate.set()
    await writer.flush(5)
    assert pool.batches == [[b"a"], [b"a"], [b"b"]]


async def test_flush_times_out_and_close_refuses_new_work() -> None:
    pool = FakePool()
    writer = AsyncWriter(pool.write, 10, ClientMetrics())
    pool.gate = asyncio.Event()
    await writer.submit([b"slow"], [region(b"x")], PutOptions())
    with pytest.raises(KVPoolError) as info:
        await writer.flush(timeout_s=0.01)
    assert info.value.status == Status.TIMEOUT
    pool.gate.set()
    await writer.close()
    with pytest.raises(KVPoolError) as info:
        await writer.submit([b"late"], [region(b"x")], PutOptions())
    assert info.value.status == Status.UNAVAILABLE


async def test_watched_commits_are_waited_for_and_reported() -> None:
    writer = AsyncWriter(FakePool().write, 10, ClientMetrics())
    loop = asyncio.get_running_loop()
    ok: asyncio.Future[list[Status]] = loop.create_future()
    failed: asyncio.Future[list[Status]] = loop.create_future()
    writer.watch_commit([b"c1"], ok)
    writer.watch_commit([b"c2", b"c3"], failed)
    flushing = asyncio.ensure_future(writer.flush(5))
    await asyncio.sleep(0)
    assert not flushing.done() and writer.pending == 3
    ok.set_result([Status.OK])
    failed.set_exception(KVPoolError(Status.UNKNOWN_CLIENT, "expired"))
    with pytest.raises(KVPoolError, match="2 async writes failed") as info:
        await flushing
    assert info.value.status == Status.UNKNOWN_CLIENT


async def test_a_submit_waiting_for_room_when_close_starts_is_written_or_refused() -> None:
    """close() while a submit waits for room: the room frees, the waiter wakes: it must not
    queue work close() no longer waits for (an acknowledged write that is never written)."""
    pool = FakePool()
    writer = AsyncWriter(pool.write, 1, ClientMetrics())
    pool.gate = asyncio.Event()
    await writer.submit([b"first"], [region(b"1")], PutOptions())
    waiting = asyncio.ensure_future(writer.submit([b"second"], [region(b"2")], PutOptions()))
    await asyncio.sleep(0)
    closing = asyncio.ensure_future(writer.close())
    await asyncio.sleep(0)
    pool.gate.set()
    await asyncio.wait_for(closing, 5)
    written = [k for batch in pool.batches for k in batch]
    try:
        await waiting
    except KVPoolError as exc:
        assert exc.status == Status.UNAVAILABLE and b"second" not in written
    else:
        assert b"second" in written
    assert b"first" in written and writer.pending == 0
