"""MasterRpc against a real master process, over gRPC and over the lean framing."""

from __future__ import annotations

import asyncio
import time

import pytest

from kvpool_client.rpc import ClientIdTaken, MasterRpc
from kvpool_wire import capability
from kvpool_wire.status import KVPoolError, Status
from kvpool_wire.types import ClientId, Op, PutOptions, SegmentId, SegmentInfo, Tier

SEGMENT_BYTES = 1 << 20


def _segment(client_id: str, index: int = 0) -> SegmentInfo:
    return SegmentInfo(SegmentId(f"{client_id}-seg{index}"), ClientId(client_id), SEGMENT_BYTES,
                       host_id="host-a", shm_name=f"/kvpool-test-{client_id}-{index}",
                       tcp_endpoint="127.0.0.1:1")


@pytest.mark.parametrize("use_fast_path", [True, False], ids=["lean", "grpc"])
async def test_put_read_remove_round_trip(master, use_fast_path: bool) -> None:
    rpc = MasterRpc(master.address, timeout_s=5.0, use_fast_path=use_fast_path)
    try:
        registration = await rpc.register_client("c1", "host-a", "127.0.0.1:1")
        assert len(registration.capability_key) == capability.KEY_BYTES
        assert registration.fast_port == master.fast_port
        assert registration.client_ttl_s == 10.0
        assert registration.default_lease_ttl_s == 5.0
        assert registration.master_id == master.master_id
        assert rpc.fast_port == (master.fast_port if use_fast_path else 0)
        # Re-registering keeps the key the master already holds.
        again = await rpc.register_client("c1", "host-a", "127.0.0.1:1")
        assert again.capability_key == registration.capability_key

        segment = _segment("c1")
        assert await rpc.mount_segment("c1", segment) == Status.OK
        assert await rpc.get_segments([segment.segment_id, "nope"]) == [segment, None]
        assert await rpc.heartbeat("c1") == Status.OK
        assert await rpc.heartbeat("ghost") == Status.UNKNOWN_CLIENT

        keys = [b"k0", b"k1", b"k2"]
        started = await rpc.put_start("c1", keys, [100, 200, 300], PutOptions())
        assert [s for s, _ in started] == [Status.OK] * 3
        for (_, placements), size in zip(started, [100, 200, 300], strict=True):
            (placement,) = placements
            assert placement.segment_id == segment.segment_id
            assert placement.length == size
            assert placement.put_id > 0
            assert capability.verify(registration.capability_key, placement.capability,
                                     placement.segment_id, placement.offset, placement.length,
                                     Op.WRITE, placement.capability_expiry_ms,
                                     placement.capability_expiry_ms - 1,
                                     registration.clock.epoch, placement.put_id)
            # WRITE capabilities live write_capability_ttl (10 s) on the master's clock
            left_ms = placement.capability_expiry_ms - rpc.session.clock.now_ms(time.monotonic())
            assert 9_000 <= left_ms <= 10_000
        # PENDING objects are invisible to readers.
        statuses, _ = await rpc.exist("c1", keys)
        assert statuses == [Status.NOT_FOUND] * 3
        assert await rpc.put_end("c1", keys[:2], [7, 8]) == [Status.OK, Status.OK]
        assert await rpc.put_revoke("c1", keys[2:]) == [Status.OK]

        statuses, sizes = await rpc.exist("c1", keys)
        assert statuses == [Status.OK, Status.OK, Status.NOT_FOUND]
        assert sizes == [100, 200, 0]
        results, lease_ttl_s, _ = await rpc.get_replicas("c1", keys)
        assert lease_ttl_s == 5.0
        assert [r.status for r in results] == [Status.OK, Status.OK, Status.NOT_FOUND]
        assert [r.checksum for r in results[:2]] == [7, 8]
        placement = results[0].placements[0]
        assert capability.verify(registration.capability_key, placement.capability,
                                 placement.segment_id, placement.offset, placement.length,
                                 Op.READ, placement.capability_expiry_ms,
                                 placement.capability_expiry_ms - 1, registration.clock.epoch)
        assert await rpc.query_prefix("c1", keys) == 2
        assert await rpc.query_prefix("c1", [b"zz", *keys]) == 0

        assert await rpc.remove("c1", [b"k0"]) == [Status.HAS_LEASE]
        assert await rpc.remove("c1", [b"k0", b"absent"], force=True) == [Status.OK,
                                                                           Status.NOT_FOUND]
        assert await rpc.remove_by_regex("c1", "^k1$", force=True) == 1
        with pytest.raises(KVPoolError) as err:
            await rpc.remove_by_regex("c1", "([", force=True)
        assert err.value.status == Status.INVALID_ARGUMENT
        assert await rpc.remove_all("c1", force=True) == 0

        stats = await rpc.get_stats()
        assert stats["clients"] == 1 and stats["segments"]["mounted"] == 1
        # Another caller naming "c1" cannot act as it: no key, no token, nothing changes.
        impostor = MasterRpc(master.address, timeout_s=5.0, use_fast_path=use_fast_path)
        try:
            with pytest.raises(ClientIdTaken) as taken:
                await impostor.register_client("c1", "host-a", "")
            assert 9.0 <= taken.value.retry_after_s <= 10.0
            assert await impostor.heartbeat("c1") == Status.UNKNOWN_CLIENT
            assert await impostor.mount_segment("c1", _segment("c1", 9)) == \
                Status.UNKNOWN_CLIENT
            assert await impostor.unmount_segment("c1", segment.segment_id) == \
                Status.UNKNOWN_CLIENT
            assert await impostor.unregister_client("c1") == Status.UNKNOWN_CLIENT
            assert [s for s, _ in await impostor.put_start("c1", [b"i"], [8], PutOptions())] \
                == [Status.UNKNOWN_CLIENT]
            assert (await impostor.get_stats())["totals"]["calls_unauthenticated_total"] == 5
        finally:
            await impostor.close()
        assert await rpc.heartbeat("c1") == Status.OK
        assert (await rpc.get_stats())["segments"]["mounted"] == 1
        assert await rpc.unmount_segment("c1", segment.segment_id) == Status.OK
        assert await rpc.unmount_segment("c1", segment.segment_id) == Status.SEGMENT_NOT_FOUND
    finally:
        await rpc.close()


async def test_put_end_nowait_is_ordered_before_later_calls(master) -> None:
    rpc = MasterRpc(master.address)
    try:
        await rpc.register_client("w", "host-a", "")
        assert await rpc.mount_segment("w", _segment("w")) == Status.OK
        keys = [f"n{i}".encode() for i in range(50)]
        started = await rpc.put_start("w", keys, [64] * len(keys), PutOptions())
        assert all(s == Status.OK for s, _ in started)
        commits = [rpc.put_end_nowait("w", [key]) for key in keys]
        # Sent after the commits on the same connection: must see every one of them.
        statuses, _ = await rpc.exist("w", keys)
        assert statuses == [Status.OK] * len(keys)
        assert [await c for c in commits] == [[Status.OK]] * len(keys)
    finally:
        await rpc.close()


async def test_calls_fail_fast_when_the_master_is_gone(start_master) -> None:
    master = start_master()
    rpc = MasterRpc(master.address, timeout_s=2.0)
    try:
        await rpc.register_client("gone", "h", "")
        assert master.stop() == 0
        loop = asyncio.get_running_loop()
        started_s = loop.time()
        with pytest.raises(KVPoolError) as err:
            await rpc.exist("gone", [b"a"])
        assert err.value.status in (Status.RPC_FAILED, Status.TIMEOUT)
        assert loop.time() - started_s < 3.0
    finally:
        await rpc.close()


@pytest.mark.parametrize("use_fast_path", [True, False], ids=["lean", "grpc"])
async def test_a_stalled_master_times_calls_out(master, use_fast_path: bool) -> None:
    import os
    import signal

    rpc = MasterRpc(master.address, timeout_s=1.0, use_fast_path=use_fast_path)
    try:
        await rpc.register_client("s", "h", "")
        assert await rpc.heartbeat("s") == Status.OK
        os.kill(master.pid, signal.SIGSTOP)
        try:
            loop = asyncio.get_running_loop()
            started_s = loop.time()
            with pytest.raises(KVPoolError) as err:
                await rpc.exist("s", [b"a"])
            assert err.value.status == Status.TIMEOUT
            assert loop.time() - started_s < 1.5
        finally:
            os.kill(master.pid, signal.SIGCONT)
        # The connection survives the stall; the late answer was discarded.
        assert await rpc.heartbeat("s") == Status.OK
    finally:
        await rpc.close()


@pytest.mark.parametrize("use_fast_path", [True, False], ids=["lean", "grpc"])
async def test_only_the_reader_ends_its_lease(master, use_fast_path: bool) -> None:
    """A proven reader's lease is numbered and ends with its next call (a force-removed object
    it read frees its bytes then); the same end sent by a caller without the reader's token, or
    by another client, changes nothing."""
    owner = MasterRpc(master.address, timeout_s=5.0, use_fast_path=use_fast_path)
    impostor = MasterRpc(master.address, timeout_s=5.0, use_fast_path=use_fast_path)
    try:
        await owner.register_client("c1", "host-a", "127.0.0.1:1")
        await impostor.register_client("c2", "host-a", "127.0.0.1:1")
        assert await owner.mount_segment("c1", _segment("c1")) == Status.OK
        started = await owner.put_start("c1", [b"x", b"y"], [100, 100], PutOptions())
        assert [status for status, _ in started] == [Status.OK] * 2
        assert await owner.put_end("c1", [b"x", b"y"]) == [Status.OK] * 2
        anonymous = await impostor.get_replicas("", [b"y"])
        assert anonymous.lease_ids == ()                 # nobody can end an anonymous lease
        answer = await owner.get_replicas("c1", [b"x"])
        assert len(answer.lease_ids) == 1 and answer.results[0].status == Status.OK
        assert await owner.remove("c1", [b"x"], force=True) == [Status.OK]

        async def parked_bytes() -> int:
            return int((await owner.get_stats())["objects"]["deferred_free_bytes"])

        assert await parked_bytes() == 100                  # c1 may still be copying x
        # Another client names c1's lease: it ends only its own holds (none).
        impostor.session.end_lease(answer.lease_ids, [b"x"])
        await impostor.remove("c2", [b"y"])
        assert await parked_bytes() == 100
        # A caller without c1's token names c1 and c1's lease: nothing ends.
        token, impostor.session.token = impostor.session.token, b""
        impostor.session.end_lease(answer.lease_ids, [b"x"])
        await impostor.remove("c1", [b"y"])
        assert await parked_bytes() == 100
        impostor.session.token = token
        # c1's own end, sent along with its next call, frees x's bytes at once.
        owner.session.end_lease(answer.lease_ids, [b"x"])
        await owner.get_replicas("c1", [b"absent"])
        assert await parked_bytes() == 0
        stats = await owner.get_stats()
        assert stats["totals"]["leases_ended_total"] == 1
    finally:
        await owner.close()
        await impostor.close()


async def _join_with_ssd(rpc: MasterRpc) -> None:
    """Register "c1" with a DRAM segment and an SSD one (no file behind it: the master never
    opens it)."""
    await rpc.register_client("c1", "host-a", "127.0.0.1:1")
    assert await rpc.mount_segment("c1", _segment("c1")) == Status.OK
    ssd = SegmentInfo(SegmentId("c1-ssd"), ClientId("c1"), 4 * SEGMENT_BYTES, Tier.SSD,
                      host_id="host-a", tcp_endpoint="127.0.0.1:1",
                      file_path="/nonexistent/c1.kvpool")
    assert await rpc.mount_segment("c1", ssd) == Status.OK


@pytest.mark.parametrize("use_fast_path", [True, False], ids=["lean", "grpc"])
async def test_copy_tasks_waits_for_tasks_and_a_newer_call_ends_the_wait(
        master, use_fast_path: bool) -> None:
    """A CopyTasks call that asks to wait is answered when no task came after its wait, at
    once when a commit makes tasks for its caller, and at once when the same caller calls
    again; other calls are served meanwhile."""
    rpc = MasterRpc(master.address, timeout_s=5.0, use_fast_path=use_fast_path)
    try:
        await _join_with_ssd(rpc)

        started = time.monotonic()
        assert await rpc.copy_tasks("c1", [], 64, 0.5) == []      # nothing to copy: the wait
        assert 0.4 <= time.monotonic() - started < 3.0

        waiting = asyncio.ensure_future(rpc.copy_tasks("c1", [], 64, 4.0))
        await asyncio.sleep(0.2)
        assert not waiting.done()
        size = SEGMENT_BYTES // 16
        keys = [f"k{i}".encode() for i in range(14)]            # 87.5 %: past the 85 % line
        for key in keys:                                        # served while the call waits
            [(status, _)] = await rpc.put_start("c1", [key], [size], PutOptions())
            assert status == Status.OK and await rpc.put_end("c1", [key]) == [Status.OK]
        tasks = await asyncio.wait_for(waiting, 2.0)              # well before its 4 s
        assert tasks and {t.key for t in tasks} <= set(keys)
        assert all(t.target.segment_id == "c1-ssd" for t in tasks)

        waiting = asyncio.ensure_future(rpc.copy_tasks("c1", [], 64, 4.0))
        await asyncio.sleep(0.2)
        assert not waiting.done()
        # a call that fetches nothing (a copier stopping) answers the waiting one at once
        assert await rpc.copy_tasks("c1", [], 0) == []
        await asyncio.wait_for(waiting, 2.0)
    finally:
        await rpc.close()


@pytest.mark.parametrize("use_fast_path", [True, False], ids=["lean", "grpc"])
async def test_a_copy_wait_whose_connection_closed_hands_nothing(
        master, use_fast_path: bool) -> None:
    """The tasks made after a waiting CopyTasks lost its connection wait for the owner's next
    call instead of going to nobody (and waiting out their ttl)."""
    first = MasterRpc(master.address, timeout_s=5.0, use_fast_path=use_fast_path)
    second = MasterRpc(master.address, timeout_s=5.0, session=first.session)
    try:
        await _join_with_ssd(first)
        waiting = asyncio.ensure_future(first.copy_tasks("c1", [], 64, 4.0))
        await asyncio.sleep(0.2)
        await first.close()                                      # the copier's process died
        with pytest.raises(KVPoolError):
            await waiting
        await asyncio.sleep(0.2)
        size = SEGMENT_BYTES // 16
        keys = [f"k{i}".encode() for i in range(14)]            # past the demotion line
        for key in keys:
            [(status, _)] = await second.put_start("c1", [key], [size], PutOptions())
            assert status == Status.OK and await second.put_end("c1", [key]) == [Status.OK]
        await asyncio.sleep(0.5)                                # a tick's pass made tasks
        tasks = await second.copy_tasks("c1", [], 64, 2.0)
        assert tasks and {t.key for t in tasks} <= set(keys)
    finally:
        await first.close()
        await second.close()
