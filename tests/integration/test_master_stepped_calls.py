"""A call over many keys (PutStart, PutEnd, GetReplicas, Exist) is served in steps by a real
master: its answer is whole and exact, other connections are served between its steps, and the
later calls of its own lean connection only after it."""

from __future__ import annotations

import asyncio

import pytest

from kvpool_client.rpc import MasterRpc
from kvpool_master.rpc.servicer import EXIST_STEP_KEYS, READ_STEP_KEYS, STEP_KEYS
from kvpool_wire.status import Status
from kvpool_wire.types import ClientId, PutOptions, SegmentId, SegmentInfo, Tier

BLOCK = 4096


async def _owner(address: str, name: str, num_keys: int, use_fast_path: bool = True
                 ) -> MasterRpc:
    rpc = MasterRpc(address, timeout_s=60.0, use_fast_path=use_fast_path)
    await rpc.register_client(name, "host-a", "")
    segment = SegmentInfo(SegmentId(f"{name}-seg"), ClientId(name), 2 * num_keys * BLOCK)
    assert await rpc.mount_segment(name, segment) == Status.OK
    return rpc


def _keys(name: str, num_keys: int) -> list[bytes]:
    return [b"%s-%07d" % (name.encode(), i) for i in range(num_keys)]


async def _pending(address: str, num_keys: int) -> tuple[MasterRpc, list[bytes]]:
    """Owner "c" with ``num_keys`` PENDING objects (started, not committed)."""
    rpc = await _owner(address, "c", num_keys)
    keys = _keys("c", num_keys)
    started = await rpc.put_start("c", keys, [BLOCK] * num_keys, PutOptions())
    assert all(s == Status.OK for s, _ in started)
    return rpc, keys


@pytest.mark.parametrize("use_fast_path", [True, False], ids=["lean", "grpc"])
async def test_a_put_of_many_keys_is_answered_whole_and_exact(master,
                                                               use_fast_path: bool) -> None:
    n = 2 * STEP_KEYS + 123
    rpc = await _owner(master.address, "c", n, use_fast_path)
    try:
        keys = _keys("c", n)
        keys[-1] = keys[0]  # a repeat in the last step: refused, the rest placed
        started = await rpc.put_start("c", keys, [BLOCK] * n, PutOptions())
        assert [s for s, _ in started] == [Status.OK] * (n - 1) + [Status.OK]  # the writer's
        placements = [p for _, (p,) in started[:-1]]
        assert len({p.offset for p in placements}) == n - 1                 # no extent twice
        assert {p.put_id for p in placements} == {started[0][1][0].put_id}  # one put
        assert all(p.capability for p in placements)
        statuses = await rpc.put_end("c", keys[:-1], list(range(n - 1)))
        assert statuses == [Status.OK] * (n - 1)
        results, _, _ = await rpc.get_replicas("c", keys[:-1])
        assert [r.checksum for r in results] == list(range(n - 1))
        assert [r.placements[0].offset for r in results] == [p.offset for p in placements]
    finally:
        await rpc.close()


async def test_other_connections_are_served_between_the_steps(master) -> None:
    n = 12 * STEP_KEYS
    owner = await _owner(master.address, "big", n)
    other = MasterRpc(master.address, timeout_s=60.0)
    try:
        big = asyncio.get_running_loop().create_task(
            owner.put_start("big", _keys("big", n), [BLOCK] * n, PutOptions()))
        seen: list[int] = []
        while not big.done() and len(seen) < 100_000:
            seen.append((await other.get_stats())["objects"]["pending"])
        assert [s for s, _ in await big] == [Status.OK] * n
        # between the steps the other connection saw some of the keys placed, not all
        assert any(0 < pending < n for pending in seen), sorted(set(seen))
    finally:
        await owner.close()
        await other.close()


async def test_later_calls_of_the_connection_are_served_after_a_stepped_call(master) -> None:
    n = 3 * STEP_KEYS + 7
    rpc, keys = await _pending(master.address, n)
    try:
        committed = rpc.put_end_nowait("c", keys)   # served in steps
        statuses, _ = await rpc.exist("c", [keys[-1]])   # sent behind it, on the same connection
        assert statuses == [Status.OK]                    # so served after its last step
        assert await committed == [Status.OK] * n
    finally:
        await rpc.close()


async def test_frames_read_together_with_a_stepped_call_wait_for_it(master) -> None:
    # A stepped commit and a read of its last key in one write: the master reads both
    # frames at once, and still serves the read only after the commit's last step.
    import socket

    from kvpool_wire import calls
    from kvpool_wire.framing import FrameDecoder, encode_frame

    n = 3 * STEP_KEYS + 7
    rpc, keys = await _pending(master.address, n)
    try:
        commit = calls.put_end("c", rpc.session.token, keys)
        read = calls.exist("c", [keys[-1]])
        stream = b"".join(encode_frame(call.method.method_id, request_id,
                                       call.request.SerializeToString())
                          for request_id, call in ((1, commit), (2, read)))

        def exchange() -> dict[int, bytes]:
            with socket.create_connection(("127.0.0.1", master.fast_port), timeout=30) as sock:
                sock.sendall(stream)
                decoder = FrameDecoder(1 << 26)
                answers: dict[int, bytes] = {}
                while len(answers) < 2:
                    data = sock.recv(1 << 20)
                    assert data, "connection closed"
                    answers.update((request_id, payload)
                                   for _, request_id, payload in decoder.feed(data))
                return answers

        answers = await asyncio.get_running_loop().run_in_executor(None, exchange)
        assert commit.decode(commit.method.response_type.FromString(answers[1])) == \
            [Status.OK] * n
        assert read.decode(read.method.response_type.FromString(answers[2]))[0] == [Status.OK]
    finally:
        await rpc.close()


async def _ready(address: str, num_keys: int) -> tuple[MasterRpc, list[bytes], list[int]]:
    """Owner "c" with ``num_keys`` READY objects; their offsets."""
    rpc, keys = await _pending(address, num_keys)
    offsets = [p.offset for _, (p,) in await rpc.put_start("c", keys, [BLOCK] * num_keys,
                                                          PutOptions())]  # the writer's retry
    assert await rpc.put_end("c", keys) == [Status.OK] * num_keys
    return rpc, keys, offsets


async def _parked_bytes(rpc: MasterRpc) -> int:
    return int((await rpc.get_stats())["objects"]["deferred_free_bytes"])


@pytest.mark.parametrize("use_fast_path", [True, False], ids=["lean", "grpc"])
async def test_a_read_of_many_keys_holds_them_all_under_one_lease(master,
                                                                  use_fast_path: bool) -> None:
    n = 3 * READ_STEP_KEYS + 5
    owner, keys, offsets = await _ready(master.address, n)
    reader = MasterRpc(master.address, timeout_s=60.0, use_fast_path=use_fast_path)
    try:
        await reader.register_client("r", "host-b", "")
        asked = keys + [b"absent"]   # a miss in the last step
        results, _, lease_ids = await reader.get_replicas("r", asked)
        assert [r.status for r in results] == [Status.OK] * n + [Status.NOT_FOUND]
        assert [r.placements[0].offset for r in results[:n]] == offsets
        assert all(r.placements[0].capability for r in results[:n])
        assert len(lease_ids) == 1 and lease_ids[0] > 0
        # a forced remove of a key read under a live lease parks its bytes ...
        assert await owner.remove("c", [keys[1]], force=True) == [Status.OK]
        assert await _parked_bytes(owner) == BLOCK
        # ... and frees them at once once the reader ended that lease (the remove carries the
        # end): the answer's one lease covers the keys of every step
        reader.session.end_lease(lease_ids, asked)
        every_step = [keys[1], keys[READ_STEP_KEYS], keys[-1]]
        assert await reader.remove("r", every_step, force=True) == \
            [Status.NOT_FOUND, Status.OK, Status.OK]
        assert await _parked_bytes(owner) == 0
    finally:
        await owner.close()
        await reader.close()


async def test_other_connections_are_served_between_the_steps_of_a_read(master) -> None:
    n = 16 * READ_STEP_KEYS
    owner, keys, _ = await _ready(master.address, n)
    other = MasterRpc(master.address, timeout_s=60.0)
    try:
        before = (await other.get_stats())["totals"]["read_keys_total"]
        big = asyncio.get_running_loop().create_task(owner.get_replicas("c", keys))
        seen: list[int] = []
        while not big.done() and len(seen) < 100_000:
            seen.append((await other.get_stats())["totals"]["read_keys_total"] - before)
        assert [r.status for r in (await big)[0]] == [Status.OK] * n
        assert any(0 < read < n for read in seen), sorted(set(seen))
    finally:
        await owner.close()
        await other.close()


@pytest.mark.parametrize("use_fast_path", [True, False], ids=["lean", "grpc"])
async def test_an_exist_of_many_keys_is_answered_whole_and_exact(master,
                                                                 use_fast_path: bool) -> None:
    n = 2 * EXIST_STEP_KEYS + 9
    owner, keys, _ = await _ready(master.address, n)
    asker = MasterRpc(master.address, timeout_s=60.0, use_fast_path=use_fast_path)
    try:
        asked = [b"absent-0"] + keys + [b"absent-1"]
        statuses, sizes = await asker.exist("a", asked)
        assert statuses == [Status.NOT_FOUND] + [Status.OK] * n + [Status.NOT_FOUND]
        assert sizes == [0] + [BLOCK] * n + [0]
        tiers = await asker.tiers("a", asked)
        assert tiers == [None] + [Tier.DRAM] * n + [None]
    finally:
        await owner.close()
        await asker.close()
