"""Bounded resources: batch and key sizes, message size, connections, in-flight calls.

Past every limit the answer is a clear status (per item, or for the call), never a crash, and
the master keeps serving.
"""

from __future__ import annotations

import asyncio
import resource
import shutil
import struct
import sys
import time

import grpc
import pytest
from token_stub import TokenStub

from kvpool_client.rpc import MasterRpc
from kvpool_wire._pb import kvpool_pb2 as pb
from kvpool_wire.status import KVPoolError, Status
from kvpool_wire.types import ClientId, PutOptions, SegmentId, SegmentInfo

NUM_KEYS = 100_000


@pytest.mark.parametrize("use_fast_path", [True, False], ids=["lean", "grpc"])
async def test_100k_keys_of_1_kib_are_answered_and_a_longer_call_refused(
        master, use_fast_path) -> None:
    keys = [i.to_bytes(4, "little") * 256 for i in range(NUM_KEYS)]  # 1 KiB each, distinct
    rpc = MasterRpc(master.address, use_fast_path=use_fast_path, timeout_s=120)
    try:
        await rpc.register_client("big", "h", "")
        segment = SegmentInfo(SegmentId("big/0"), ClientId("big"), 1 << 30)
        assert await rpc.mount_segment("big", segment) == Status.OK
        started_s = time.perf_counter()
        statuses, sizes = await rpc.exist("big", keys)   # sent as calls of max_batch_keys
        elapsed_s = time.perf_counter() - started_s
        print(f"Exist of {NUM_KEYS} keys of 1 KiB ({'lean' if use_fast_path else 'grpc'}): "
              f"{elapsed_s:.2f} s")
        assert statuses == [Status.NOT_FOUND] * NUM_KEYS and sizes == [0] * NUM_KEYS
        # one call past the master's limit (the stub told to send it whole) is refused for the
        # call, before the master does any work per key
        limit = rpc.session.max_call_keys
        assert limit == 16_384   # the master's default, learnt at registration
        over = keys[:limit + 1]
        rpc.session.max_call_keys = len(over)
        with pytest.raises(KVPoolError) as refused:
            await rpc.put_start("big", over, [64] * len(over), PutOptions())
        assert refused.value.status == Status.INVALID_ARGUMENT
        assert "max_batch_keys" in str(refused.value)
        rpc.session.max_call_keys = limit
        statuses, _ = await rpc.exist("big", keys[:3])
        assert statuses == [Status.NOT_FOUND] * 3  # nothing changed
    finally:
        await rpc.close()


def test_message_over_the_limit_is_refused_for_the_call(start_master, lean_socket) -> None:
    master = start_master(max_message_bytes="1mb")
    big = pb.ExistRequest(keys=[b"k" * 1000] * 2000).SerializeToString()  # about 2 MB
    with grpc.insecure_channel(master.address) as channel:
        with pytest.raises(grpc.RpcError) as err:
            channel.unary_unary("/kvpool.v1.Master/Exist")(big, timeout=30)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        stub = TokenStub(channel)
        assert stub.Heartbeat(pb.HeartbeatRequest(client_id="x")).status == \
            pb.STATUS_UNKNOWN_CLIENT
    conn = lean_socket(master.fast_port)
    # The header alone is refused: the master never buffers a frame longer than the limit.
    conn.send_raw(struct.pack("<IBI", len(big) + 5, pb.METHOD_EXIST, 7))
    method, _, payload = conn.recv()
    assert method == pb.METHOD_ERROR
    assert payload.startswith(b"INVALID_ARGUMENT: frame length")
    with pytest.raises(ConnectionError):
        conn.recv()
    fresh = lean_socket(master.fast_port)
    method, _ = fresh.call(pb.METHOD_EXIST, pb.ExistRequest(keys=[b"a"]).SerializeToString())
    assert method == pb.METHOD_EXIST


def test_connections_past_the_limit_are_refused(start_master, lean_socket) -> None:
    master = start_master(max_connections=2)
    exist = pb.ExistRequest(keys=[b"a"]).SerializeToString()
    first, second = lean_socket(master.fast_port), lean_socket(master.fast_port)
    assert first.call(pb.METHOD_EXIST, exist)[0] == pb.METHOD_EXIST
    assert second.call(pb.METHOD_EXIST, exist)[0] == pb.METHOD_EXIST
    third = lean_socket(master.fast_port)
    method, _, payload = third.recv()
    assert method == pb.METHOD_ERROR
    assert payload.startswith(b"RESOURCE_EXHAUSTED: too many connections")
    first.close()
    deadline = time.monotonic() + 10
    while True:  # the slot frees once the master has seen the close
        retry = lean_socket(master.fast_port)
        try:
            retry.send(pb.METHOD_EXIST, 1, exist)
            method = retry.recv()[0]
        except ConnectionError:
            method = -1
        if method == pb.METHOD_EXIST:
            break
        assert method in (-1, pb.METHOD_ERROR)
        assert time.monotonic() < deadline
        time.sleep(0.05)


async def test_in_flight_calls_past_the_limit_are_resource_exhausted(start_master) -> None:
    master = start_master(max_inflight_requests=1)
    rpc = MasterRpc(master.address, use_fast_path=False, timeout_s=30)
    keys = [f"k{i}".encode() for i in range(16_000)]   # one call each
    try:
        # Overlap of calls depends on scheduling on a loaded machine: try a few bounded rounds
        # until one shows calls past the limit (each round must still answer every call).
        refused: list[KVPoolError] = []
        served: list[object] = []
        for _ in range(5):
            outcomes = await asyncio.gather(*(rpc.exist("c", keys) for _ in range(64)),
                                            return_exceptions=True)
            round_refused = [o for o in outcomes if isinstance(o, KVPoolError)]
            round_served = [o for o in outcomes if not isinstance(o, BaseException)]
            assert len(round_refused) + len(round_served) == len(outcomes)
            refused += round_refused
            served += round_served
            if round_refused:
                break
        assert all(e.status == Status.RESOURCE_EXHAUSTED for e in refused)
        assert refused and served
        print(f"max_inflight_requests 1, 64 concurrent calls: {len(served)} served, "
              f"{len(refused)} refused with RESOURCE_EXHAUSTED")
        assert await rpc.heartbeat("c") == Status.UNKNOWN_CLIENT
    finally:
        await rpc.close()


def test_half_a_frame_times_out_while_others_are_served(start_master, lean_socket) -> None:
    master = start_master(frame_timeout=0.5)
    exist = pb.ExistRequest(keys=[b"a"]).SerializeToString()
    stuck = lean_socket(master.fast_port)
    frame = struct.pack("<IBI", len(exist) + 5, pb.METHOD_EXIST, 1) + exist
    stuck.send_raw(frame[:-3])
    other = lean_socket(master.fast_port)
    assert other.call(pb.METHOD_EXIST, exist)[0] == pb.METHOD_EXIST
    started_s = time.monotonic()
    method, _, payload = stuck.recv()
    assert method == pb.METHOD_ERROR and payload.startswith(b"TIMEOUT: incomplete frame")
    assert 0.3 < time.monotonic() - started_s < 5
    assert other.call(pb.METHOD_EXIST, exist)[0] == pb.METHOD_EXIST


def _open_files_limit(pid: int) -> tuple[int, int]:
    """(soft, hard) of ``pid``'s open-files limit."""
    soft, hard = resource.prlimit(pid, resource.RLIMIT_NOFILE)
    return soft, hard


@pytest.mark.skipif(shutil.which("prlimit") is None, reason="needs prlimit (util-linux)")
def test_the_master_raises_its_open_files_limit_to_fit_its_connections(start_master) -> None:
    """Started with a shell's soft limit (here 256), the master raises it to what
    --max-connections needs, within the hard limit; a hard limit below that is warned about."""
    command = [sys.executable, "-m", "kvpool_master.cli"]
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    roomy = start_master(executable=["prlimit", f"--nofile=256:{hard}", *command],
                         max_connections=2000)
    assert _open_files_limit(roomy.pid) == (min(hard, 2000 + 1024), hard)
    assert "open-files limit raised from 256" in roomy.log()
    tight = start_master(executable=["prlimit", "--nofile=256:512", *command],
                         max_connections=2000)
    assert _open_files_limit(tight.pid) == (512, 512)
    assert "open-files hard limit is 512" in tight.log()
