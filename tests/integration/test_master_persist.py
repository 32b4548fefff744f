"""--state-dir wiring: a SIGKILLed master restarts with its index; remounted segments keep
their objects, segments not back within the grace period lose theirs; a torn log tail is cut."""

from __future__ import annotations

import re
import time
from pathlib import Path

import grpc
from helpers import metric_value
from token_stub import TokenStub

from kvpool_master.core.master import CoreConfig, MasterCore
from kvpool_master.persist import StateStore
from kvpool_wire._pb import kvpool_pb2 as pb
from kvpool_wire._pb import kvpool_pb2_grpc as pb_grpc
from kvpool_wire.capability import client_token
from kvpool_wire.status import Status
from kvpool_wire.types import ClientId, ObjectKey, PutOptions, SegmentId, SegmentInfo

GRACE_S = 2.0


def _segment(client_id: str, index: int, size_bytes: int = 1 << 20) -> pb.SegmentDescriptor:
    return pb.SegmentDescriptor(segment_id=f"{client_id}/{index}", client_id=client_id,
                                size_bytes=size_bytes, host_id="h", shm_name=f"/s-{index}")


def _view(stub: pb_grpc.MasterStub, keys: list[bytes]) -> list[tuple]:
    reply = stub.GetReplicas(pb.GetReplicasRequest(keys=keys))
    return [(s, size, checksum, tuple((p.segment_id, p.offset, p.length) for p in r.placements))
            for s, size, checksum, r in zip(reply.statuses, reply.sizes_bytes, reply.checksums,
                                            reply.replicas, strict=True)]


def _populate(stub: pb_grpc.MasterStub) -> tuple[bytes, list[bytes], list[bytes]]:
    reply = stub.RegisterClient(pb.RegisterClientRequest(client_id="c", host_id="h"))
    for index in (0, 1):
        assert stub.MountSegment(pb.MountSegmentRequest(client_id="c", segment=_segment("c", index))
                                 ).status == pb.STATUS_OK
    on_0 = [f"a{i}".encode() for i in range(20)]
    on_1 = [f"b{i}".encode() for i in range(20)]
    for keys, segment_id in ((on_0, "c/0"), (on_1, "c/1")):
        started = stub.PutStart(pb.PutStartRequest(
            client_id="c", keys=keys, sizes_bytes=[500 + i for i in range(20)],
            options=pb.PutOptions(preferred_segment=segment_id)))
        assert set(started.statuses) == {pb.STATUS_OK}
        assert {r.placements[0].segment_id for r in started.replicas} == {segment_id}
        assert set(stub.PutEnd(pb.PutEndRequest(client_id="c", keys=keys,
                                                checksums=range(100, 120))).statuses) == {0}
    stub.PutStart(pb.PutStartRequest(client_id="c", keys=[b"pending"], sizes_bytes=[10]))
    return reply.capability_key, on_0, on_1


def test_restart_restores_remounted_segments_and_drops_the_rest(start_master,
                                                                tmp_path: Path) -> None:
    state = tmp_path / "state"
    first = start_master(state_dir=str(state), restore_grace=GRACE_S)
    with grpc.insecure_channel(first.address) as channel:
        stub = TokenStub(channel)
        key, on_0, on_1 = _populate(stub)
        before = _view(stub, on_0)
    first.kill()  # no graceful close: everything must already be in the log

    second = start_master(state_dir=str(state), restore_grace=GRACE_S)
    assert second.master_id == first.master_id
    assert "restored from" in second.log() and "40 objects" in second.log()
    with grpc.insecure_channel(second.address) as channel:
        stub = TokenStub(channel)
        # Restored but not remounted yet: not readable.
        assert set(stub.Exist(pb.ExistRequest(keys=on_0)).statuses) == {pb.STATUS_NOT_FOUND}
        assert stub.Heartbeat(pb.HeartbeatRequest(client_id="c")).status == \
            pb.STATUS_UNKNOWN_CLIENT
        # A restored id is still c's: without c's token it is refused, with it (the stub
        # sends the token c's first registration returned) c gets its key back.
        impostor = stub.RegisterClient(pb.RegisterClientRequest(client_id="c", host_id="h",
                                                                client_token=bytes(16)))
        assert impostor.status == pb.STATUS_CLIENT_ALREADY_EXISTS
        assert not impostor.capability_key and impostor.retry_after_ms > 0
        reply = stub.RegisterClient(pb.RegisterClientRequest(client_id="c", host_id="h"))
        assert reply.status == pb.STATUS_OK
        assert reply.capability_key == key  # data servers keep verifying with the same key
        assert reply.master_id == first.master_id
        assert stub.MountSegment(pb.MountSegmentRequest(client_id="c", segment=_segment("c", 0))
                                 ).status == pb.STATUS_OK
        assert _view(stub, on_0) == before
        assert set(stub.Exist(pb.ExistRequest(keys=[b"pending"])).statuses) == \
            {pb.STATUS_NOT_FOUND}
        deadline = time.monotonic() + 10 * GRACE_S
        while time.monotonic() < deadline:
            if stub.GetSegments(pb.GetSegmentsRequest(segment_ids=["c/1"])).statuses[0] == \
                    pb.STATUS_SEGMENT_NOT_FOUND and '"restored": 0' in \
                    stub.GetStats(pb.GetStatsRequest()).json:
                break
            time.sleep(0.1)
        # c/1 was not remounted in time: its objects are gone, even if it comes back now.
        assert stub.MountSegment(pb.MountSegmentRequest(client_id="c", segment=_segment("c", 1))
                                 ).status == pb.STATUS_OK
        assert set(stub.Exist(pb.ExistRequest(keys=on_1)).statuses) == {pb.STATUS_NOT_FOUND}
        assert _view(stub, on_0) == before
    assert second.stop() == 0


def _index_segment_bytes(num_objects: int) -> int:
    return num_objects * 128   # 64-byte objects fill half of it: no eviction


def _write_index(state: Path, num_objects: int) -> tuple[bytes, list[bytes]]:
    """Write a state directory holding client c, its segment c/0 and ``num_objects`` READY
    objects, as a master would have left it (built in this process, through the core)."""
    key = bytes(range(32))
    core = MasterCore(CoreConfig())
    assert core.register_client(ClientId("c"), "h", key, 0.0)[0] == Status.OK
    segment = _segment("c", 0, _index_segment_bytes(num_objects))
    assert core.mount_segment(SegmentInfo(SegmentId(segment.segment_id), ClientId("c"),
                                          segment.size_bytes, host_id="h",
                                          shm_name=segment.shm_name), 0.0) == Status.OK
    keys = [b"%020d" % i for i in range(num_objects)]
    for start in range(0, num_objects, 10_000):
        chunk: list[ObjectKey] = keys[start:start + 10_000]  # type: ignore[assignment]
        assert {s for s, _ in core.put_start(ClientId("c"), chunk, [64] * len(chunk),
                                              PutOptions(), 0.0)} == {Status.OK}
        assert set(core.put_end(ClientId("c"), chunk, 0.0)) == {Status.OK}
    store = StateStore(state, fsync="never")
    store.load(MasterCore(CoreConfig()), 0.0)
    store.compact(core)
    store.close()
    return key, keys


def _restore_seconds(log: str) -> float:
    """How long a master took to restore its index, as its ``log`` says."""
    found = re.search(r"restored from \S+ in ([0-9.]+) s", log)
    assert found is not None, log
    return float(found[1])


def test_the_restore_grace_starts_once_the_master_serves(start_master, tmp_path: Path) -> None:
    """An index whose restore takes longer than --restore-grace keeps the objects of an owner
    that comes back within the grace after the master is up (the serving clock counts the
    restore as a stall)."""
    state = tmp_path / "state"
    key, keys = _write_index(state, 800_000)
    # How long this machine takes to restore the index (a first start, stopped within its
    # grace, changes nothing): the grace of the second start is half of it.
    probe = start_master(state_dir=str(state), restore_grace=60.0, timeout_s=120)
    grace_s = _restore_seconds(probe.log()) / 2
    assert probe.stop() == 0
    master = start_master(state_dir=str(state), restore_grace=grace_s, timeout_s=120)
    restore_s = _restore_seconds(master.log())
    assert restore_s > grace_s, "the restore was too quick to show anything"
    exported_s = metric_value(master.metrics_url, "kvpool_restore_seconds")
    assert exported_s is not None and abs(exported_s - restore_s) < 0.06   # the log rounds
    time.sleep(0.3 * grace_s)   # the master ticks (every 0.1 s) meanwhile
    with grpc.insecure_channel(master.address) as channel:
        stub = TokenStub(channel)
        reply = stub.RegisterClient(pb.RegisterClientRequest(
            client_id="c", host_id="h", client_token=client_token(key)))
        assert reply.status == pb.STATUS_OK and reply.capability_key == key
        segment = _segment("c", 0, _index_segment_bytes(len(keys)))
        assert stub.MountSegment(pb.MountSegmentRequest(client_id="c", segment=segment)
                                 ).status == pb.STATUS_OK
        sample = keys[::10_000]
        assert set(stub.Exist(pb.ExistRequest(keys=sample)).statuses) == {pb.STATUS_OK}
    assert master.stop() == 0


def test_torn_log_tail_is_cut_and_the_master_serves(start_master, tmp_path: Path) -> None:
    state = tmp_path / "state"
    first = start_master(state_dir=str(state))
    with grpc.insecure_channel(first.address) as channel:
        stub = TokenStub(channel)
        _, on_0, _ = _populate(stub)
        before = _view(stub, on_0)
    first.kill()
    with (state / "log.kvp").open("ab") as f:
        f.write(b"\x40\x00\x00\x00\xde\xad")  # half a record, as a crash mid-write leaves it

    second = start_master(state_dir=str(state))
    assert "truncat" in second.log().lower()
    with grpc.insecure_channel(second.address) as channel:
        stub = TokenStub(channel)
        stub.RegisterClient(pb.RegisterClientRequest(client_id="c", host_id="h"))
        assert stub.MountSegment(pb.MountSegmentRequest(client_id="c", segment=_segment("c", 0))
                                 ).status == pb.STATUS_OK
        assert _view(stub, on_0) == before
    assert second.stop() == 0


def test_without_state_dir_a_restart_starts_empty(start_master) -> None:
    first = start_master()
    second = start_master()
    assert first.master_id != second.master_id
    with grpc.insecure_channel(second.address) as channel:
        stats = TokenStub(channel).GetStats(pb.GetStatsRequest())
    assert '"clients": 0' in stats.json
