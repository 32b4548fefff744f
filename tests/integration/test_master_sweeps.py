"""Work that grows with the table runs in steps on a real master: a large RemoveAll or
RemoveByRegex is answered (over gRPC and over the lean framing) once it is done, with every
other call answered meanwhile; a large segment lost by unmount, unregistration or expiry is
gone for readers at once and swept behind; a segment mounted again under the same id is
answered once the old one is swept, and never sees the old placements."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import grpc
import pytest
from token_stub import TokenStub

from kvpool_client.rpc import MasterRpc
from kvpool_wire._pb import kvpool_pb2 as pb
from kvpool_wire.status import KVPoolError, Status
from kvpool_wire.types import ClientId, PutOptions, SegmentId, SegmentInfo

NUM_OBJECTS = 30_000  # thirty times what one call may sweep
BATCH = 5000


async def _owner(address: str, name: str) -> tuple[MasterRpc, SegmentInfo]:
    rpc = MasterRpc(address, timeout_s=60)
    await rpc.register_client(name, "host", "")
    segment = SegmentInfo(SegmentId(f"{name}-seg"), ClientId(name), NUM_OBJECTS * 8192)
    assert await rpc.mount_segment(name, segment) == Status.OK
    return rpc, segment


async def _fill(rpc: MasterRpc, name: str, prefix: str = "k") -> list[bytes]:
    keys = [f"{prefix}{i:06d}".encode() for i in range(NUM_OBJECTS)]
    for i in range(0, NUM_OBJECTS, BATCH):
        chunk = keys[i:i + BATCH]
        started = await rpc.put_start(name, chunk, [4096] * len(chunk), PutOptions())
        assert {s for s, _ in started} == {Status.OK}, {s for s, _ in started}
        assert set(await rpc.put_end(name, chunk)) == {Status.OK}
    return keys


async def _probe_while(rpc: MasterRpc, work: Any) -> tuple[Any, int]:
    """Run ``work`` and count the Exist calls answered before it finished."""
    task = asyncio.ensure_future(work)
    answered = 0
    while not task.done():
        await rpc.exist("probe", [b"nothing"])
        answered += 1
    return await task, answered


def test_large_removals_are_answered_when_done_and_others_are_served_meanwhile(
        start_master: Any) -> None:
    master = start_master()

    async def run() -> None:
        rpc, _ = await _owner(master.address, "owner")
        probe = MasterRpc(master.address, timeout_s=60)
        keys = await _fill(rpc, "owner")
        # RemoveByRegex over the lean framing: every key ending in 7
        removed, answered = await _probe_while(
            probe, rpc.remove_by_regex("owner", "7$", force=True))
        assert removed == NUM_OBJECTS // 10 and answered >= 1
        statuses, _ = await rpc.exist("owner", [keys[7], keys[8]])
        assert statuses == [Status.NOT_FOUND, Status.OK]
        # RemoveAll over gRPC, the lean framing probing meanwhile
        with grpc.insecure_channel(master.address) as channel:
            stub = TokenStub(channel)
            future = asyncio.get_running_loop().run_in_executor(
                None, lambda: stub.RemoveAll(pb.RemoveAllRequest(force=True), timeout=60))
            answer, answered = await _probe_while(probe, future)
        assert answer.status == pb.STATUS_OK and answer.num_removed == NUM_OBJECTS * 9 // 10
        assert await rpc.exist("owner", [keys[8]]) == ([Status.NOT_FOUND], [0])
        await rpc.close()
        await probe.close()

    asyncio.run(run())


def test_what_is_put_while_a_large_remove_all_runs_stays(start_master: Any) -> None:
    """RemoveAll removes what was there when it was called: objects put (over the same lean
    connection) while it runs in steps are all there once it answers."""
    master = start_master()

    async def run() -> None:
        rpc, _ = await _owner(master.address, "owner")
        keys = await _fill(rpc, "owner")
        removing = asyncio.ensure_future(rpc.remove_all("owner", force=False))
        late: list[bytes] = []
        while not removing.done() and len(late) < 2000:
            batch = [b"late-%06d" % (len(late) + i) for i in range(20)]
            started = await rpc.put_start("owner", batch, [4096] * 20, PutOptions())
            assert {s for s, _ in started} == {Status.OK}
            assert set(await rpc.put_end("owner", batch)) == {Status.OK}
            late += batch
        assert await removing == NUM_OBJECTS and late
        statuses, _ = await rpc.exist("owner", late + keys[:1])
        assert statuses == [Status.OK] * len(late) + [Status.NOT_FOUND]
        await rpc.close()

    asyncio.run(run())


def test_a_large_lost_segment_is_gone_at_once_and_its_id_can_come_back(
        start_master: Any) -> None:
    master = start_master(client_ttl=1)

    async def beat(rpc: MasterRpc) -> None:
        while True:  # alive while it fills, however long that takes on a busy machine
            assert await rpc.heartbeat("owner") == Status.OK
            await asyncio.sleep(0.1)

    async def run() -> None:
        rpc, segment = await _owner(master.address, "owner")
        beating = asyncio.get_running_loop().create_task(beat(rpc))
        keys = await _fill(rpc, "owner")
        assert await rpc.unmount_segment("owner", segment.segment_id) == Status.OK
        # gone for readers at once, swept behind
        assert (await rpc.exist("owner", [keys[0], keys[-1]]))[0] == [Status.NOT_FOUND] * 2
        # mounted again under the same id: answered once the old one is swept (fresh memory,
        # none of the old placements)
        assert (await rpc.get_stats())["objects"]["sweep_backlog_keys"] > 0
        assert await rpc.mount_segment("owner", segment) == Status.OK
        stats = await rpc.get_stats()
        assert stats["objects"]["sweep_backlog_keys"] == 0 and stats["objects"]["ready"] == 0
        assert (await rpc.exist("owner", [keys[-1]]))[0] == [Status.NOT_FOUND]
        await _fill(rpc, "owner", "n")
        beating.cancel()
        # the owner goes silent: expired, and its objects go with it
        deadline = time.monotonic() + 10
        while (await rpc.exist("probe", [b"n000000"]))[0] != [Status.NOT_FOUND]:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)
        await rpc.close()

    asyncio.run(run())


@pytest.mark.parametrize("partitions", [1, 2])
def test_a_join_mounts_a_segment_id_still_being_swept_once_it_is(
        start_master: Any, caplog: Any, partitions: int) -> None:
    # A restarted worker takes its fixed client id back: its segment ids are the previous
    # holder's, whose segment the master still sweeps. The master answers the mount once that
    # sweep is done, later than a call's deadline (here 50 ms, as 5 s is at 10 M objects):
    # the join's mount asks again until then (on every partition, each sweeping its share).
    from kvpool_client.member import _mount_when_swept
    master = start_master(*(["--partitions", str(partitions)] if partitions > 1 else []))
    table_objects = 400_000   # the sweep walks the whole table, whoever owns it

    async def run() -> None:
        other, _ = await _owner(master.address, "other")
        keys = [b"t%07d" % i for i in range(table_objects)]
        for i in range(0, table_objects, 20_000):
            chunk = keys[i:i + 20_000]
            await other.put_start("other", chunk, [64] * len(chunk), PutOptions())
            await other.put_end("other", chunk)
        segment = SegmentInfo(SegmentId("w-seg0"), ClientId("w"), 1 << 20)
        old = MasterRpc(master.address, timeout_s=60)
        await old.register_client("w", "host", "")
        assert await old.mount_segment("w", segment) == Status.OK
        started = await old.put_start("w", [b"old"], [4096],
                                      PutOptions(preferred_segment="w-seg0"))
        assert started[0][0] == Status.OK and await old.put_end("w", [b"old"]) == [Status.OK]
        assert await old.unregister_client("w") == Status.OK   # it leaves: the sweep starts
        await old.close()
        new = MasterRpc(master.address, timeout_s=60)
        await new.register_client("w", "host", "")
        assert (await other.get_stats())["objects"]["sweep_backlog_keys"] > 0
        hasty = MasterRpc(master.address, timeout_s=0.05, session=new.session)
        caplog.set_level("INFO", logger="kvpool_client.member")
        assert await _mount_when_swept(hasty, "w", segment) == Status.OK
        assert [r for r in caplog.records if "asking again" in r.getMessage()]
        stats = await other.get_stats()
        assert stats["objects"]["sweep_backlog_keys"] == 0
        assert (await new.get_segments(["w-seg0"]))[0] == segment
        assert (await new.exist("w", [b"old", keys[-1]]))[0] == [Status.NOT_FOUND, Status.OK]
        # a deadline that passes gives the call's own error
        with pytest.raises(KVPoolError) as raised:
            await _mount_when_swept(MasterRpc("127.0.0.1:9", timeout_s=0.05), "w", segment,
                                    wait_s=0.0)
        assert raised.value.status in (Status.TIMEOUT, Status.RPC_FAILED)
        for rpc in (hasty, new, other):
            await rpc.close()

    asyncio.run(run())
