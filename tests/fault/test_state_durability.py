"""--state-dir under a full disk, a conflicting index and a restart with writes in flight, against
real master processes.

A full disk is stood in for by RLIMIT_FSIZE set on the running master (``prlimit``): a write
past the limit is cut short or fails with EFBIG, as one on a full file system fails with
ENOSPC. The snapshot that would end read-only mode is kept failing by a directory in the way
of its temporary file (the limit cannot do it: it would also silence the master's own log).
No mount needed.
"""

from __future__ import annotations

import resource
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvpool_master.core.events import ObjectCommitted
from kvpool_master.core.master import CoreConfig, MasterCore
from kvpool_master.persist import LOG_NAME, SNAPSHOT_NAME, StateStore
from kvpool_wire._pb import kvpool_pb2 as pb
from kvpool_wire._pb import kvpool_pb2_grpc as pb_grpc
from kvpool_wire.capability import client_token
from kvpool_wire.types import ClientId, ObjectKey, Pin, PutOptions, SegmentId, SegmentInfo

SEGMENT_BYTES = 1 << 20
OBJECT_BYTES = 4096
NUM_OBJECTS = 40


def segment(index: int = 0) -> pb.SegmentDescriptor:
    return pb.SegmentDescriptor(segment_id=f"c/{index}", client_id="c", size_bytes=SEGMENT_BYTES,
                                host_id="h", shm_name=f"/durable-{index}")


#: The client token of each client id, from its latest registration.
TOKENS: dict[str, bytes] = {}


def join(stub: Any) -> None:
    """Register client "c" (proving its token if it was registered before) and mount its
    segment."""
    reply = stub.RegisterClient(pb.RegisterClientRequest(client_id="c", host_id="h",
                                                         client_token=TOKENS.get("c", b"")))
    assert reply.status == 0
    TOKENS["c"] = reply.client_token
    assert stub.MountSegment(pb.MountSegmentRequest(client_id="c", client_token=TOKENS["c"],
                                                    segment=segment())
                             ).status == pb.STATUS_OK


def put(stub: Any, keys: list[bytes], commit: bool = True) -> list[tuple[int, tuple]]:
    """PutStart (+ PutEnd) ``keys``; return (status, extents) per key."""
    started = stub.PutStart(pb.PutStartRequest(client_id="c", client_token=TOKENS["c"], keys=keys,
                                               sizes_bytes=[OBJECT_BYTES] * len(keys)))
    ok = [k for k, s in zip(keys, started.statuses, strict=True) if s == pb.STATUS_OK]
    if commit and ok:
        assert set(stub.PutEnd(pb.PutEndRequest(client_id="c", client_token=TOKENS["c"],
                                                keys=ok)).statuses) == {0}
    return [(s, tuple((p.segment_id, p.offset, p.length) for p in r.placements))
            for s, r in zip(started.statuses, started.replicas, strict=True)]


def extents_of(stub: Any, keys: list[bytes]) -> dict[bytes, tuple]:
    reply = stub.GetReplicas(pb.GetReplicasRequest(keys=keys))
    return {k: tuple((p.segment_id, p.offset, p.length) for p in r.placements)
            for k, s, r in zip(keys, reply.statuses, reply.replicas, strict=True)
            if s == pb.STATUS_OK}


def overlaps(a: tuple, b: tuple) -> bool:
    return any(sa == sb and oa < ob + lb and ob < oa + la
               for sa, oa, la in a for sb, ob, lb in b)


def http(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def metric(master: Any, name: str) -> float | None:
    """The value of an unlabelled metric, None when it is not exported."""
    _, text = http(master.metrics_url + "/metrics")
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return None


def limit_file_size(pid: int, size_bytes: int) -> None:
    """Set the soft limit only: raising it again needs no privilege."""
    resource.prlimit(pid, resource.RLIMIT_FSIZE, (size_bytes, resource.RLIM_INFINITY))


def wait_for(predicate: Any, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def fill_then_fail_a_removal(master: Any, state: Path, stub: Any) -> tuple[list[bytes], list]:
    """Put NUM_OBJECTS objects, block snapshots, then let the log take only small records and
    remove them all in one call: that record fails. Then put one small object at once (a
    small record). Return the removed keys and what that put was answered."""
    join(stub)
    keys = [b"old-%d" % i for i in range(NUM_OBJECTS)]
    assert {s for s, _ in put(stub, keys)} == {pb.STATUS_OK}
    time.sleep(0.3)   # a tick's flush: everything so far is synced
    (state / (SNAPSHOT_NAME + ".tmp")).mkdir()   # no snapshot can be written
    limit_file_size(master.pid, (state / LOG_NAME).stat().st_size + 120)
    assert set(stub.Remove(pb.RemoveRequest(keys=keys)).statuses) == {pb.STATUS_OK}
    answered = put(stub, [b"new"])   # a small record would still fit in the log
    limit_file_size(master.pid, resource.RLIM_INFINITY)
    return keys, answered


def test_a_failed_log_write_makes_the_master_read_only_and_loses_no_bytes(
        start_master: Any, tmp_path: Path) -> None:
    state = tmp_path / "state"
    master = start_master(state_dir=str(state), restore_grace=30)
    with grpc.insecure_channel(master.address) as channel:
        stub = pb_grpc.MasterStub(channel)
        removed, answered = fill_then_fail_a_removal(master, state, stub)
        # Read-only: every call that changes durable state answers UNAVAILABLE ...
        refused = [put(stub, [b"later"])[0][0],
                   stub.PutEnd(pb.PutEndRequest(client_id="c", client_token=TOKENS["c"],
                                                keys=[b"new"])).statuses[0],
                   stub.Remove(pb.RemoveRequest(keys=[b"x"])).statuses[0],
                   stub.RemoveAll(pb.RemoveAllRequest(force=True)).status,
                   stub.MountSegment(pb.MountSegmentRequest(
                       client_id="c", client_token=TOKENS["c"], segment=segment(1))).status,
                   stub.RegisterClient(pb.RegisterClientRequest(client_id="d", host_id="h")
                                       ).status]
        # ... while reads, heartbeats and stats are served.
        beat = stub.Heartbeat(pb.HeartbeatRequest(client_id="c", client_token=TOKENS["c"]))
        assert beat.status == pb.STATUS_OK
        assert set(stub.Exist(pb.ExistRequest(keys=removed)).statuses) == {pb.STATUS_NOT_FOUND}
        assert stub.GetStats(pb.GetStatsRequest()).status == pb.STATUS_OK
        healthz = http(master.metrics_url + "/healthz")
        read_only = metric(master, "kvpool_state_read_only")
        failures = metric(master, "kvpool_state_write_failures_total")
    time.sleep(1.0)   # snapshot retries fail meanwhile
    log_text = master.log()
    master.kill()     # before any snapshot could make the state directory whole

    second = start_master(state_dir=str(state), restore_grace=30)
    with grpc.insecure_channel(second.address) as channel:
        stub = pb_grpc.MasterStub(channel)
        join(stub)
        restored = extents_of(stub, [*removed, b"new"])
    # What the disk holds never points two objects at one extent, and no restored object
    # points at the bytes a writer was told to write after the failure.
    handed_out = [extents for status, extents in answered if status == pb.STATUS_OK]
    for key, extents in restored.items():
        assert not any(overlaps(extents, other) for other in handed_out), key
    print(f"after the failed write: put answered {answered[0][0]}, refused calls {refused}, "
          f"/healthz {healthz[0]}; restored {len(restored)}/{NUM_OBJECTS} removed objects "
          f"(the removal never reached the disk), all on their own bytes")
    assert answered[0][0] == pb.STATUS_UNAVAILABLE
    assert set(refused) == {pb.STATUS_UNAVAILABLE}
    assert healthz[0] == 503 and "read-only" in healthz[1]
    assert (read_only, failures) == (1.0, 1.0)
    assert log_text.count("read-only until a full snapshot succeeds") == 1   # loud, once
    assert "state snapshot failed" in log_text, log_text


def test_read_only_ends_when_a_snapshot_succeeds(start_master: Any, tmp_path: Path) -> None:
    state = tmp_path / "state"
    master = start_master(state_dir=str(state), restore_grace=30)
    with grpc.insecure_channel(master.address) as channel:
        stub = pb_grpc.MasterStub(channel)
        removed, _ = fill_then_fail_a_removal(master, state, stub)
        assert http(master.metrics_url + "/healthz")[0] == 503
        health = health_pb2_grpc.HealthStub(channel)
        master_service = health_pb2.HealthCheckRequest(service="kvpool.v1.Master")
        wait_for(lambda: health.Check(master_service).status
                 == health_pb2.HealthCheckResponse.NOT_SERVING, timeout_s=5)
        (state / (SNAPSHOT_NAME + ".tmp")).rmdir()   # a snapshot can be written again
        wait_for(lambda: http(master.metrics_url + "/healthz")[0] == 200, timeout_s=10)
        assert metric(master, "kvpool_state_read_only") == 0.0
        wait_for(lambda: health.Check(master_service).status
                 == health_pb2.HealthCheckResponse.SERVING, timeout_s=5)
        [(status, _)] = put(stub, [b"after"])
        assert status == pb.STATUS_OK
    master.kill()
    # The snapshot that ended read-only mode holds the removal the log missed.
    second = start_master(state_dir=str(state), restore_grace=30)
    with grpc.insecure_channel(second.address) as channel:
        stub = pb_grpc.MasterStub(channel)
        join(stub)
        assert extents_of(stub, removed) == {}
        assert set(extents_of(stub, [b"after"])) == {b"after"}


def test_objects_claiming_one_extent_are_dropped_counted_and_logged(start_master: Any,
                                                                    tmp_path: Path) -> None:
    # An index that lost a removal: "a" and "b" both claim one extent.
    state = tmp_path / "state"
    store = StateStore(state, fsync="always")
    core = MasterCore(CoreConfig())
    store.load(core, 0.0)
    client = ClientId("c")
    core.register_client(client, "h", b"k" * 16, 0.0)
    described = segment()
    core.mount_segment(SegmentInfo(SegmentId(described.segment_id), client, SEGMENT_BYTES,
                                   host_id="h", shm_name=described.shm_name), 0.0)
    keys = [ObjectKey(b"a"), ObjectKey(b"kept")]
    [(_, [extent]), _] = core.put_start(client, keys, [OBJECT_BYTES] * 2, PutOptions(), 0.0)
    core.put_end(client, keys, 0.0)
    store.append(core.take_events())
    store.append([ObjectCommitted(ObjectKey(b"b"), OBJECT_BYTES, (extent,), 0, Pin.NONE, None)])
    store.close()

    master = start_master(state_dir=str(state), restore_grace=30)
    TOKENS["c"] = client_token(b"k" * 16)   # the restored client proves it is "c"
    with grpc.insecure_channel(master.address) as channel:
        stub = pb_grpc.MasterStub(channel)
        join(stub)
        found = set(extents_of(stub, [b"a", b"b", b"kept"]))
    assert found == {b"kept"}
    assert metric(master, "kvpool_restore_conflicting_objects") == 2.0
    assert "2 objects claimed extents that overlap" in master.log()


def test_restored_free_space_waits_for_old_write_capabilities(start_master: Any,
                                                              tmp_path: Path) -> None:
    state = tmp_path / "state"
    flags = {"state_dir": str(state), "restore_grace": 30, "write_capability_ttl": 2}
    master = start_master(**flags)
    with grpc.insecure_channel(master.address) as channel:
        stub = pb_grpc.MasterStub(channel)
        join(stub)
        put(stub, [b"ready"])
        # A writer is handed an extent and is still writing when the master dies.
        [(status, in_flight)] = put(stub, [b"in-flight"], commit=False)
        assert status == pb.STATUS_OK
    master.kill()

    second = start_master(**flags)
    with grpc.insecure_channel(second.address) as channel:
        stub = pb_grpc.MasterStub(channel)
        join(stub)
        restarted_s = time.monotonic()
        early = put(stub, [b"early-%d" % i for i in range(8)])
        # The restart does not make restored objects room for new ones either.
        assert set(extents_of(stub, [b"ready"])) == {b"ready"}
        later: list = []
        wait_for(lambda: later.extend(put(stub, [b"later"])) or later[-1][0] == pb.STATUS_OK,
                 timeout_s=10)
        waited_s = time.monotonic() - restarted_s
    print(f"puts right after the restart: {[s for s, _ in early]}; the first one placed "
          f"{waited_s:.1f} s after the restart")
    for status, extents in early:
        assert status == pb.STATUS_NO_SPACE or not overlaps(extents, in_flight)
    assert not any(s == pb.STATUS_OK for s, _ in early)
    assert waited_s >= 1.0


def test_compactions_run_in_steps_while_the_master_serves_and_survive_a_kill(
        start_master: Any, tmp_path: Path) -> None:
    """With a small --state-compact-bytes, compactions start again and again while puts and
    removals go on; the master keeps answering (each snapshot is written a step at a time
    between requests), and a master killed at any point restores exactly what the last one
    answered."""
    state = tmp_path / "state"
    master = start_master(state_dir=str(state), restore_grace=30, state_compact_bytes=4096,
                          state_compact_ratio=0)
    live: dict[bytes, tuple] = {}
    with grpc.insecure_channel(master.address) as channel:
        stub = pb_grpc.MasterStub(channel)
        join(stub)
        for round_no in range(40):
            keys = [b"r%02d-%02d" % (round_no, i) for i in range(8)]
            assert all(status == pb.STATUS_OK for status, _ in put(stub, keys))
            gone = keys[:2]
            assert set(stub.Remove(pb.RemoveRequest(keys=gone)).statuses) == {pb.STATUS_OK}
            live.update(extents_of(stub, keys[2:]))
            time.sleep(0.05)   # idle time: compactions finish and are swapped in
        log_text = master.log()
        assert (state / SNAPSHOT_NAME).exists(), log_text
        assert extents_of(stub, list(live)) == live
    log_text = master.log()
    master.kill()
    done = log_text.count("background compaction done")
    assert done >= 2, log_text
    second = start_master(state_dir=str(state), restore_grace=30)
    with grpc.insecure_channel(second.address) as channel:
        stub = pb_grpc.MasterStub(channel)
        join(stub)
        assert extents_of(stub, list(live)) == live
        removed = [b"r%02d-%02d" % (r, i) for r in range(40) for i in range(2)]
        assert extents_of(stub, removed) == {}
    print(f"{done} background compactions; {len(live)} objects restored exactly")
