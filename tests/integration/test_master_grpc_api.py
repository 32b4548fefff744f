"""Every Master RPC through the generated gRPC stubs against a real master process.

Pins the per-item statuses of bad items, batch shapes (empty, mixed, over the limit), health
checking and reflection.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from token_stub import TokenStub

from kvpool_wire import capability
from kvpool_wire._pb import kvpool_pb2 as pb
from kvpool_wire._pb import kvpool_pb2_grpc as pb_grpc

MAX_BATCH = 64
SEGMENT_BYTES = 1 << 20


@pytest.fixture
def stub(start_master) -> Iterator[pb_grpc.MasterStub]:
    master = start_master(max_batch_keys=MAX_BATCH)
    with grpc.insecure_channel(master.address) as channel:
        yield TokenStub(channel)


def _register(stub: pb_grpc.MasterStub, client_id: str, segment_bytes: int = SEGMENT_BYTES
              ) -> pb.SegmentDescriptor:
    reply = stub.RegisterClient(pb.RegisterClientRequest(client_id=client_id, host_id="h1"))
    assert reply.status == pb.STATUS_OK
    segment = pb.SegmentDescriptor(segment_id=f"{client_id}/0", client_id=client_id,
                                   size_bytes=segment_bytes, host_id="h1")
    assert stub.MountSegment(pb.MountSegmentRequest(client_id=client_id, segment=segment)
                             ).status == pb.STATUS_OK
    return segment


def _put(stub: pb_grpc.MasterStub, client_id: str, keys: list[bytes], size: int = 128) -> None:
    started = stub.PutStart(pb.PutStartRequest(client_id=client_id, keys=keys,
                                               sizes_bytes=[size] * len(keys)))
    assert list(started.statuses) == [pb.STATUS_OK] * len(keys)
    ended = stub.PutEnd(pb.PutEndRequest(client_id=client_id, keys=keys))
    assert list(ended.statuses) == [pb.STATUS_OK] * len(keys)


def test_register_heartbeat_unregister(stub) -> None:
    reply = stub.RegisterClient(pb.RegisterClientRequest(client_id="a", host_id="h1",
                                                         hostname="x:1"))
    assert reply.status == pb.STATUS_OK
    assert len(reply.capability_key) == 32 and reply.fast_port > 0 and reply.master_id
    assert reply.client_ttl_ms == 10_000 and reply.default_lease_ttl_ms == 5000
    assert reply.client_token == capability.client_token(reply.capability_key)
    assert reply.capability_epoch > 0
    # The id is taken: another caller (a wrong token) is told when its holder expires at the
    # latest; the holder itself (the stub sends its token) re-registers and keeps its key.
    taken = stub.RegisterClient(pb.RegisterClientRequest(client_id="a", host_id="h1",
                                                         client_token=bytes(16)))
    assert taken.status == pb.STATUS_CLIENT_ALREADY_EXISTS and not taken.capability_key
    assert 0 < taken.retry_after_ms <= 10_000 and not taken.client_token
    again = stub.RegisterClient(pb.RegisterClientRequest(client_id="a", host_id="h1"))
    assert again.status == pb.STATUS_OK and again.capability_key == reply.capability_key
    beat = stub.Heartbeat(pb.HeartbeatRequest(client_id="a"))
    assert beat.status == pb.STATUS_OK and beat.master_clock_ms >= reply.master_clock_ms
    assert stub.Heartbeat(pb.HeartbeatRequest(client_id="b")).status == pb.STATUS_UNKNOWN_CLIENT
    assert stub.UnregisterClient(pb.UnregisterClientRequest(client_id="a")).status == \
        pb.STATUS_OK
    assert stub.Heartbeat(pb.HeartbeatRequest(client_id="a")).status == pb.STATUS_UNKNOWN_CLIENT
    with pytest.raises(grpc.RpcError) as err:
        stub.RegisterClient(pb.RegisterClientRequest(client_id=""))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "client_id" in err.value.details()


def test_segments_mount_remount_and_ownership(stub) -> None:
    segment = _register(stub, "a")
    _register(stub, "b")
    # An identical remount is idempotent; a different descriptor under the same id is not.
    assert stub.MountSegment(pb.MountSegmentRequest(client_id="a", segment=segment)).status == \
        pb.STATUS_OK
    changed = pb.SegmentDescriptor()
    changed.CopyFrom(segment)
    changed.size_bytes = 2 * SEGMENT_BYTES
    assert stub.MountSegment(pb.MountSegmentRequest(client_id="a", segment=changed)).status == \
        pb.STATUS_SEGMENT_ALREADY_EXISTS
    # Nobody mounts a segment in another client's name, or as an unknown client.
    assert stub.MountSegment(pb.MountSegmentRequest(client_id="b", segment=segment)).status == \
        pb.STATUS_PERMISSION_DENIED
    ghost = pb.SegmentDescriptor(segment_id="g/0", client_id="ghost", size_bytes=4096)
    assert stub.MountSegment(pb.MountSegmentRequest(client_id="ghost", segment=ghost)).status \
        == pb.STATUS_UNKNOWN_CLIENT
    zero = pb.SegmentDescriptor(segment_id="a/zero", client_id="a", size_bytes=0)
    assert stub.MountSegment(pb.MountSegmentRequest(client_id="a", segment=zero)).status == \
        pb.STATUS_INVALID_ARGUMENT
    with pytest.raises(grpc.RpcError) as err:
        stub.MountSegment(pb.MountSegmentRequest(client_id="a"))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.RpcError) as err:
        bad_tier = pb.SegmentDescriptor(segment_id="a/1", client_id="a", size_bytes=4096, tier=7)
        stub.MountSegment(pb.MountSegmentRequest(client_id="a", segment=bad_tier))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "tier" in err.value.details()

    found = stub.GetSegments(pb.GetSegmentsRequest(segment_ids=["a/0", "nope", "b/0"]))
    assert list(found.statuses) == [pb.STATUS_OK, pb.STATUS_SEGMENT_NOT_FOUND, pb.STATUS_OK]
    assert found.segments[1] == pb.SegmentDescriptor()
    # The descriptor comes back with the proof of its owner's key (what a mapper checks).
    proof = found.segments[0].ownership_proof
    assert len(proof) == 16 and found.segments[1].ownership_proof == b""
    found.segments[0].ClearField("ownership_proof")
    assert found.segments[0] == segment
    assert stub.UnmountSegment(pb.UnmountSegmentRequest(client_id="b", segment_id="a/0")
                               ).status == pb.STATUS_PERMISSION_DENIED
    assert stub.UnmountSegment(pb.UnmountSegmentRequest(client_id="a", segment_id="a/0")
                               ).status == pb.STATUS_OK
    assert stub.UnmountSegment(pb.UnmountSegmentRequest(client_id="a", segment_id="a/0")
                               ).status == pb.STATUS_SEGMENT_NOT_FOUND


def test_put_start_per_item_statuses(stub) -> None:
    _register(stub, "a")
    keys = [b"ok", b"", b"k" * 1025, b"zero", b"huge", b"ok"]
    sizes = [100, 100, 100, 0, 1 << 40, 100]
    reply = stub.PutStart(pb.PutStartRequest(client_id="a", keys=keys, sizes_bytes=sizes))
    statuses = list(reply.statuses)
    assert statuses[:5] == [pb.STATUS_OK, pb.STATUS_INVALID_KEY, pb.STATUS_INVALID_KEY,
                            pb.STATUS_INVALID_ARGUMENT, pb.STATUS_NO_SPACE]
    assert statuses[5] == pb.STATUS_OK  # the same writer repeating its own pending key
    assert len(reply.replicas) == len(keys)
    assert [len(r.placements) for r in reply.replicas] == [1, 0, 0, 0, 0, 1]
    placement = reply.replicas[0].placements[0]
    assert placement.length == 100 and len(placement.capability) == 16
    assert placement.capability_expiry_ms > 0
    # Mismatched lengths and unknown writers: every item refused, nothing changes.
    mismatched = stub.PutStart(pb.PutStartRequest(client_id="a", keys=[b"x", b"y"],
                                                  sizes_bytes=[1]))
    assert list(mismatched.statuses) == [pb.STATUS_INVALID_ARGUMENT] * 2
    unknown = stub.PutStart(pb.PutStartRequest(client_id="ghost", keys=[b"x"], sizes_bytes=[1]))
    assert list(unknown.statuses) == [pb.STATUS_UNKNOWN_CLIENT]
    with pytest.raises(grpc.RpcError) as err:
        stub.PutStart(pb.PutStartRequest(client_id="a", keys=[b"x"], sizes_bytes=[1],
                                         options=pb.PutOptions(pin=9)))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert list(stub.Exist(pb.ExistRequest(keys=[b"x", b"y"])).statuses) == \
        [pb.STATUS_NOT_FOUND] * 2


def test_another_clients_put_is_refused(stub) -> None:
    _register(stub, "a")
    _register(stub, "b")
    stub.PutStart(pb.PutStartRequest(client_id="a", keys=[b"mine"], sizes_bytes=[64]))
    # b sends its own valid token (the stub fills it in): what refuses it below is ownership.
    assert stub.Heartbeat(pb.HeartbeatRequest(client_id="b")).status == pb.STATUS_OK
    assert list(stub.PutEnd(pb.PutEndRequest(client_id="b", keys=[b"mine"])).statuses) == \
        [pb.STATUS_PERMISSION_DENIED]
    assert list(stub.PutRevoke(pb.PutRevokeRequest(client_id="b", keys=[b"mine"])).statuses) == \
        [pb.STATUS_PERMISSION_DENIED]
    # A second writer of a key being written is told it exists (same key, same bytes).
    other = stub.PutStart(pb.PutStartRequest(client_id="b", keys=[b"mine"], sizes_bytes=[64]))
    assert list(other.statuses) == [pb.STATUS_ALREADY_EXISTS]
    assert list(stub.PutEnd(pb.PutEndRequest(client_id="a", keys=[b"mine"])).statuses) == \
        [pb.STATUS_OK]
    assert list(stub.Exist(pb.ExistRequest(keys=[b"mine"])).statuses) == [pb.STATUS_OK]


def test_reads_batches_and_removal(stub) -> None:
    _register(stub, "a")
    keys = [f"k{i}".encode() for i in range(10)]
    _put(stub, "a", keys)
    assert stub.Exist(pb.ExistRequest(keys=[])).statuses == []
    mixed = stub.GetReplicas(pb.GetReplicasRequest(keys=[keys[0], b"absent", b""]))
    assert list(mixed.statuses) == [pb.STATUS_OK, pb.STATUS_NOT_FOUND, pb.STATUS_INVALID_KEY]
    assert list(mixed.sizes_bytes) == [128, 0, 0]
    assert mixed.lease_ttl_ms == 5000
    assert len(mixed.replicas[0].placements) == 1 and not mixed.replicas[1].placements
    prefix = stub.QueryPrefix(pb.QueryPrefixRequest(keys=[*keys[:3], b"absent", keys[4]]))
    assert (prefix.status, prefix.num_ready) == (pb.STATUS_OK, 3)

    # a list longer than max_batch_keys is refused for the call, before any work per key
    too_many = [f"x{i}".encode() for i in range(MAX_BATCH + 1)]
    for method, request in ((stub.Exist, pb.ExistRequest(keys=too_many)),
                            (stub.GetReplicas, pb.GetReplicasRequest(keys=too_many)),
                            (stub.QueryPrefix, pb.QueryPrefixRequest(keys=too_many)),
                            (stub.PutStart, pb.PutStartRequest(
                                client_id="a", keys=too_many, sizes_bytes=[1] * len(too_many)))):
        with pytest.raises(grpc.RpcError) as refused:
            method(request)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "max_batch_keys" in (refused.value.details() or "")

    assert list(stub.Remove(pb.RemoveRequest(keys=[keys[0], b"absent"])).statuses) == \
        [pb.STATUS_HAS_LEASE, pb.STATUS_NOT_FOUND]
    assert list(stub.Remove(pb.RemoveRequest(keys=[keys[0]], force=True)).statuses) == \
        [pb.STATUS_OK]
    by_regex = stub.RemoveByRegex(pb.RemoveByRegexRequest(pattern="^k[12]$", force=True))
    assert (by_regex.status, by_regex.num_removed) == (pb.STATUS_OK, 2)
    bad = stub.RemoveByRegex(pb.RemoveByRegexRequest(pattern="(", force=True))
    assert bad.status == pb.STATUS_INVALID_ARGUMENT
    # force removes leased keys too: k3..k9 are what is left.
    remove_all = stub.RemoveAll(pb.RemoveAllRequest(force=True))
    assert (remove_all.status, remove_all.num_removed) == (pb.STATUS_OK, 7)
    assert list(stub.Exist(pb.ExistRequest(keys=keys)).statuses) == [pb.STATUS_NOT_FOUND] * 10


def test_get_stats_health_and_reflection(start_master) -> None:
    master = start_master()
    with grpc.insecure_channel(master.address) as channel:
        stub = TokenStub(channel)
        _register(stub, "a")
        stats = stub.GetStats(pb.GetStatsRequest())
        document = json.loads(stats.json)
        assert stats.status == pb.STATUS_OK
        assert document["clients"] == 1
        assert document["capacity_bytes"]["DRAM"] == SEGMENT_BYTES
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "kvpool.v1.Master"):
            reply = health.Check(health_pb2.HealthCheckRequest(service=service))
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
        answers = list(reflection.ServerReflectionInfo(iter(
            [reflection_pb2.ServerReflectionRequest(list_services="")])))
        names = {s.name for s in answers[0].list_services_response.service}
        assert "kvpool.v1.Master" in names and "grpc.health.v1.Health" in names


def test_malformed_message_bytes_are_invalid_argument(master) -> None:
    with grpc.insecure_channel(master.address) as channel:
        exist = channel.unary_unary("/kvpool.v1.Master/Exist")
        with pytest.raises(grpc.RpcError) as err:
            exist(b"\xff\xff\xff\xff")
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "malformed Exist request" in err.value.details()
        # A string field holding invalid UTF-8 is malformed too.
        with pytest.raises(grpc.RpcError) as err:
            channel.unary_unary("/kvpool.v1.Master/Heartbeat")(b"\x0a\x02\xc3\x28")
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        # The master keeps serving.
        stub = TokenStub(channel)
        assert stub.Heartbeat(pb.HeartbeatRequest(client_id="x")).status == \
            pb.STATUS_UNKNOWN_CLIENT
