"""A batch longer than the master's ``max_batch_keys`` goes as several calls of at most that
many keys (the stub learns the limit at registration): against a real master with a small
limit, every batched call answers per key, in key order, as one call would, over both stubs
and both transports."""

from __future__ import annotations

import asyncio

import pytest

from kvpool_client.rpc import BlockingMasterRpc, MasterRpc
from kvpool_wire.status import Status
from kvpool_wire.types import ClientId, PutOptions, SegmentId, SegmentInfo, Tier

LIMIT = 100
NUM_KEYS = 2 * LIMIT + 37   # three calls, the last one short
BLOCK = 4096


def _keys(prefix: bytes, num_keys: int) -> list[bytes]:
    return [b"%s-%05d" % (prefix, i) for i in range(num_keys)]


@pytest.fixture
def small_master(start_master):
    return start_master(max_batch_keys=LIMIT)


@pytest.mark.parametrize("use_fast_path", [True, False], ids=["lean", "grpc"])
async def test_every_batched_call_spans_several_calls(small_master, use_fast_path) -> None:
    name = f"split-aio-{use_fast_path}"
    rpc = MasterRpc(small_master.address, timeout_s=30.0, use_fast_path=use_fast_path)
    try:
        await rpc.register_client(name, "host-a", "")
        assert rpc.session.max_call_keys == LIMIT
        segment = SegmentInfo(SegmentId(f"{name}/0"), ClientId(name), 4 * NUM_KEYS * BLOCK)
        assert await rpc.mount_segment(name, segment) == Status.OK
        keys = _keys(name.encode(), NUM_KEYS)
        sizes = [BLOCK + i for i in range(NUM_KEYS)]   # sizes tell the keys' answers apart
        started = await rpc.put_start(name, keys, sizes, PutOptions(),
                                      parent_keys=[b""] + keys[:-1])
        assert [s for s, _ in started] == [Status.OK] * NUM_KEYS
        assert [p.length for _, (p,) in started] == sizes
        assert len({p.offset for _, (p,) in started}) == NUM_KEYS
        # revoke one key of every call, commit the rest with their checksums
        revoked = [keys[0], keys[LIMIT], keys[-1]]
        assert await rpc.put_revoke(name, revoked) == [Status.OK] * 3
        kept = [k for k in keys if k not in revoked]
        checksums = [i + 1 for i in range(len(kept))]
        assert await rpc.put_end(name, kept, checksums) == [Status.OK] * len(kept)
        statuses, found_sizes = await rpc.exist(name, keys)
        assert statuses == [Status.NOT_FOUND if k in revoked else Status.OK for k in keys]
        assert found_sizes == [0 if k in revoked else s for k, s in zip(keys, sizes, strict=True)]
        assert await rpc.tiers(name, keys) == [None if k in revoked else Tier.DRAM
                                               for k in keys]
        answer = await rpc.get_replicas(name, kept)
        assert [r.checksum for r in answer.results] == checksums
        kept_sizes = [s for k, s in zip(keys, sizes, strict=True) if k not in revoked]
        assert [r.size_bytes for r in answer.results] == kept_sizes
        assert len(answer.lease_ids) == 3 and len(set(answer.lease_ids)) == 3
        rpc.session.end_lease(answer.lease_ids, kept)
        # the chain's leading keys: counted across calls, up to the first miss
        assert await rpc.query_prefix(name, keys[1:LIMIT] + keys[LIMIT + 1:]) == len(kept)
        assert await rpc.query_prefix(name, keys[1:]) == LIMIT - 1
        removed = await rpc.remove(name, keys, force=True)   # the prefix queries leased them
        assert removed == [Status.NOT_FOUND if k in revoked else Status.OK for k in keys]
        assert (await rpc.get_stats())["objects"]["ready"] == 0
    finally:
        await rpc.close()


async def test_commits_sent_without_waiting_span_several_calls(small_master) -> None:
    name = "split-nowait"
    rpc = MasterRpc(small_master.address, timeout_s=30.0)
    try:
        await rpc.register_client(name, "host-a", "")
        segment = SegmentInfo(SegmentId(f"{name}/0"), ClientId(name), 2 * NUM_KEYS * BLOCK)
        assert await rpc.mount_segment(name, segment) == Status.OK
        keys = _keys(name.encode(), NUM_KEYS)
        await rpc.put_start(name, keys, [BLOCK] * NUM_KEYS, PutOptions())
        committed = rpc.put_end_nowait(name, keys[:-1] + [b"never-started"])
        statuses, _ = await rpc.exist(name, keys)   # served after every part of the commit
        assert statuses == [Status.OK] * (NUM_KEYS - 1) + [Status.NOT_FOUND]
        assert await asyncio.wait_for(committed, 30) == \
            [Status.OK] * (NUM_KEYS - 1) + [Status.NOT_FOUND]
    finally:
        await rpc.close()


def test_the_blocking_stub_splits_too(small_master) -> None:
    name = "split-blocking"
    rpc = BlockingMasterRpc(small_master.address, timeout_s=30.0)
    try:
        rpc.register_client(name, "host-a", "")
        assert rpc.session.max_call_keys == LIMIT
        segment = SegmentInfo(SegmentId(f"{name}/0"), ClientId(name), 2 * NUM_KEYS * BLOCK)
        assert rpc.mount_segment(name, segment) == Status.OK
        keys = _keys(name.encode(), NUM_KEYS)
        started = rpc.put_start(name, keys, [BLOCK] * NUM_KEYS, PutOptions())
        assert [s for s, _ in started] == [Status.OK] * NUM_KEYS
        assert rpc.put_end(name, keys) == [Status.OK] * NUM_KEYS
        assert rpc.exist(name, keys + [b"absent"])[0] == [Status.OK] * NUM_KEYS + \
            [Status.NOT_FOUND]
        answer = rpc.get_replicas(name, keys)
        assert [r.status for r in answer.results] == [Status.OK] * NUM_KEYS
        assert len(answer.lease_ids) == 3
        assert rpc.query_prefix(name, keys) == NUM_KEYS
        assert rpc.remove(name, keys, force=True) == [Status.OK] * NUM_KEYS
    finally:
        rpc.close()


async def test_segment_lookups_span_several_calls(small_master) -> None:
    rpc = MasterRpc(small_master.address, timeout_s=30.0)
    try:
        await rpc.register_client("split-segments", "host-a", "")
        mounted = [SegmentInfo(SegmentId(f"split-segments/{i}"), ClientId("split-segments"),
                               1 << 20) for i in range(3)]
        for segment in mounted:
            assert await rpc.mount_segment("split-segments", segment) == Status.OK
        asked = [f"absent/{i}" for i in range(NUM_KEYS)]
        asked[5], asked[LIMIT + 5], asked[-1] = (s.segment_id for s in mounted)
        found = await rpc.get_segments(asked)
        assert len(found) == NUM_KEYS
        assert [(i, info.segment_id) for i, info in enumerate(found) if info is not None] == \
            [(5, mounted[0].segment_id), (LIMIT + 5, mounted[1].segment_id),
             (NUM_KEYS - 1, mounted[2].segment_id)]
    finally:
        await rpc.close()
