"""MasterCore API: clients, segments, two-phase put, reads, removal, events, stats."""

from __future__ import annotations

import random
import sys

import pytest

from kvpool_master.core.events import (
    ClientExpired,
    ClientRegistered,
    ClientUnregistered,
    ObjectCommitted,
    ObjectRemoved,
    PendingReclaimed,
    SegmentMounted,
    SegmentUnmounted,
)
from kvpool_master.core.master import CoreConfig, MasterCore
from kvpool_wire.capability import client_token
from kvpool_wire.status import Status
from kvpool_wire.types import (
    ClientId,
    ObjectKey,
    Pin,
    PutOptions,
    SegmentId,
    SegmentInfo,
)

KEY = b"k" * 32
A, B = ClientId("client-a"), ClientId("client-b")
MIB = 1 << 20


def seg(name: str, client: ClientId, size: int = MIB, host: str = "host-1") -> SegmentInfo:
    return SegmentInfo(SegmentId(name), client, size, host_id=host)


def core_with(*clients: ClientId, config: CoreConfig | None = None,
              size: int = MIB) -> MasterCore:
    core = MasterCore(config or CoreConfig())
    for client in clients:
        assert core.register_client(client, "host-1", KEY, 0.0) == (Status.OK, KEY)
        assert core.mount_segment(seg(f"seg-{client}", client, size), 0.0) == Status.OK
    core.take_events()
    return core


def put(core: MasterCore, client: ClientId, keys: list[bytes], size: int = 1000,
        now: float = 1.0, **options: object) -> list[Status]:
    started = core.put_start(client, [ObjectKey(k) for k in keys], [size] * len(keys),
                             PutOptions(**options), now)  # type: ignore[arg-type]
    ok = [ObjectKey(k) for k, (status, _) in zip(keys, started, strict=True)
          if status == Status.OK]
    core.put_end(client, ok, now)
    return [status for status, _ in started]


# ---- clients ---------------------------------------------------------------------------------

def test_register_keeps_the_first_key_and_heartbeat_keeps_alive() -> None:
    core = MasterCore(CoreConfig(client_ttl_s=10.0))
    assert core.register_client(A, "h", KEY, 0.0) == (Status.OK, KEY)
    assert core.register_client(A, "h", b"x" * 32, 1.0, client_token(KEY)) == (Status.OK, KEY)
    # without the token, a live id cannot be taken over, and its key is not handed out
    assert core.register_client(A, "h", b"x" * 32, 1.0) == (Status.CLIENT_ALREADY_EXISTS, b"")
    assert core.holder_expires_in_s(A, 1.0) == 10.0
    assert core.heartbeat(A, 9.0) == Status.OK
    core.tick(18.0)
    assert core.heartbeat(A, 18.0) == Status.OK
    core.tick(28.5)
    assert core.heartbeat(A, 28.5) == Status.UNKNOWN_CLIENT
    events = core.take_events()
    assert events == [ClientRegistered(A, "h", KEY), ClientExpired(A)]


def test_expiry_is_strictly_older_than_ttl() -> None:
    core = MasterCore(CoreConfig(client_ttl_s=10.0))
    core.register_client(A, "h", KEY, 0.0)
    core.tick(10.0)
    assert core.heartbeat(A, 10.0) == Status.OK
    core.tick(20.0001)
    assert core.heartbeat(A, 20.0001) == Status.UNKNOWN_CLIENT


def test_a_clock_jump_the_server_corrected_expires_nobody() -> None:
    # The server feeds a clock that stops while the master is stalled; the core only
    # compares now with the last heartbeat, so after a tick at 5 the next tick at 14.9
    # (a long master stall already subtracted by the server) expires nobody.
    core = core_with(A, config=CoreConfig(client_ttl_s=10.0))
    core.tick(5.0)
    core.tick(9.9)
    assert core.heartbeat(A, 9.9) == Status.OK
    core.tick(19.8)
    assert core.heartbeat(A, 19.8) == Status.OK
    assert core.stats().clients_expired_total == 0
    # The core is honest about the clock it is given: an uncorrected jump would expire.
    core.tick(19.8 + 10.001)
    assert core.heartbeat(A, 30.0) == Status.UNKNOWN_CLIENT
    assert core.stats().clients_expired_total == 1


@pytest.mark.parametrize(("client_id", "host_id", "key"), [
    ("", "h", KEY), ("x" * 257, "h", KEY), ("a", "h", b""), ("a", "h", b"short"),
    ("a", 5, KEY), (None, "h", KEY), ("a", "h", "not-bytes"),
])
def test_malformed_registration_changes_nothing(client_id: object, host_id: object,
                                                key: object) -> None:
    core = MasterCore(CoreConfig())
    assert core.register_client(client_id, host_id, key, 0.0) == (  # type: ignore[arg-type]
        Status.INVALID_ARGUMENT, b"")
    assert core.stats().num_clients == 0
    assert core.take_events() == []


def test_unregister_drops_segments_objects_and_pending() -> None:
    core = core_with(A, B)
    put(core, A, [b"done"])
    core.put_start(A, [ObjectKey(b"open")], [10], PutOptions(), 1.0)
    core.take_events()
    assert core.unregister_client(A, 2.0) == Status.OK
    assert core.unregister_client(A, 2.0) == Status.UNKNOWN_CLIENT
    events = core.take_events()
    assert events == [
        ObjectRemoved(ObjectKey(b"open"), 10, "reclaim"), PendingReclaimed(ObjectKey(b"open")),
        SegmentUnmounted(SegmentId("seg-client-a"), A),
        ObjectRemoved(ObjectKey(b"done"), 1000, "segment_lost"), ClientUnregistered(A)]
    assert core.exist([ObjectKey(b"done")], 3.0)[0] == [Status.NOT_FOUND]


# ---- segments --------------------------------------------------------------------------------

def test_mount_is_idempotent_and_conflicts_are_refused() -> None:
    core = core_with(A)
    assert core.mount_segment(seg("seg-client-a", A), 1.0) == Status.OK
    assert core.mount_segment(seg("seg-client-a", A, size=2 * MIB), 1.0) == (
        Status.SEGMENT_ALREADY_EXISTS)
    assert core.mount_segment(seg("s2", ClientId("nobody")), 1.0) == Status.UNKNOWN_CLIENT
    assert core.mount_segment(seg("", A), 1.0) == Status.INVALID_ARGUMENT
    assert core.mount_segment(seg("s3", A, size=0), 1.0) == Status.INVALID_ARGUMENT
    assert core.mount_segment(seg("s3", A, size=-5), 1.0) == Status.INVALID_ARGUMENT
    assert core.mount_segment("not a segment", 1.0) == Status.INVALID_ARGUMENT  # type: ignore[arg-type]
    assert core.take_events() == []
    assert core.stats().tier_to_capacity_bytes[0] == MIB


def engine_seg(name: str, client: ClientId, endpoint: str = "10.0.0.1:15001",
               base: int = 0x7F0000000000) -> SegmentInfo:
    return SegmentInfo(SegmentId(name), client, MIB, host_id="host-1",
                       engine_endpoint=endpoint, engine_base_address=base)


def test_mount_checks_the_engine_endpoint_and_base_address() -> None:
    core = core_with(A)
    for endpoint, base in (("10.0.0.1:15001", 0),          # an engine needs a base
                           ("", 0x1000),                   # a base needs an engine
                           ("10.0.0.1", 0x1000),           # no port
                           ("10.0.0.1:0", 0x1000),
                           ("10.0.0.1:70000", 0x1000),
                           (":15001", 0x1000),
                           ("10.0.0.1:15001", (1 << 64) - 10),  # the segment would wrap
                           ("10.0.0.1:15001", -1)):
        assert core.mount_segment(engine_seg("e", A, endpoint, base), 1.0) == \
            Status.INVALID_ARGUMENT, (endpoint, base)
    assert core.mount_segment(engine_seg("e", A), 1.0) == Status.OK
    # the base address is part of what the segment is: a different one is another segment
    assert core.mount_segment(engine_seg("e", A, base=0x7F0000100000), 1.0) == \
        Status.SEGMENT_ALREADY_EXISTS


@pytest.mark.parametrize("policy", ["allow", "refuse", "require"])
def test_the_engine_transport_policy_admits_or_refuses_segments(policy: str) -> None:
    core = MasterCore(CoreConfig(engine_transport=policy))
    assert core.register_client(A, "host-1", KEY, 0.0) == (Status.OK, KEY)
    core_engine = core.mount_segment(engine_seg("with-engine", A), 1.0)
    core_plain = core.mount_segment(seg("plain", A), 1.0)
    assert (core_engine, core_plain) == {
        "allow": (Status.OK, Status.OK),
        "refuse": (Status.PERMISSION_DENIED, Status.OK),
        "require": (Status.OK, Status.PERMISSION_DENIED)}[policy]
    with pytest.raises(ValueError, match="engine_transport"):
        CoreConfig(engine_transport="sometimes")


def test_unmount_checks_owner_and_drops_only_sole_replicas() -> None:
    core = core_with(A, B)
    assert put(core, A, [b"two"], replica_num=2) == [Status.OK]
    put(core, A, [b"one"], preferred_segment="seg-client-b")
    assert core.unmount_segment(A, SegmentId("seg-client-b"), 2.0) == Status.PERMISSION_DENIED
    assert core.unmount_segment(A, SegmentId("nope"), 2.0) == Status.SEGMENT_NOT_FOUND
    assert core.unmount_segment(ClientId("x"), SegmentId("seg-client-b"), 2.0) == (
        Status.UNKNOWN_CLIENT)
    core.take_events()
    assert core.unmount_segment(B, SegmentId("seg-client-b"), 2.0) == Status.OK
    assert core.take_events() == [SegmentUnmounted(SegmentId("seg-client-b"), B),
                                  ObjectRemoved(ObjectKey(b"one"), 1000, "segment_lost")]
    [result] = core.get_replicas([ObjectKey(b"two")], 3.0)
    assert result.status == Status.OK
    assert [p.segment_id for p in result.placements] == ["seg-client-a"]
    assert core.get_segments(["seg-client-a", "seg-client-b", 7]) == [  # type: ignore[list-item]
        seg("seg-client-a", A), None, None]
    assert core.segment_key(SegmentId("seg-client-a")) == KEY
    assert core.segment_key(SegmentId("seg-client-b")) is None


# ---- two-phase put ---------------------------------------------------------------------------

def test_pending_is_invisible_and_commit_makes_it_readable() -> None:
    core = core_with(A)
    [(status, placements)] = core.put_start(A, [ObjectKey(b"x")], [100], PutOptions(), 1.0)
    assert status == Status.OK and placements[0].length == 100
    assert core.get_replicas([ObjectKey(b"x")], 1.0)[0].status == Status.NOT_FOUND
    assert core.exist([ObjectKey(b"x")], 1.0) == ([Status.NOT_FOUND], [0])
    assert core.query_prefix([ObjectKey(b"x")], 1.0) == 0
    assert core.remove([ObjectKey(b"x")], True, 1.0) == [Status.NOT_READY]
    assert core.put_end(A, [ObjectKey(b"x")], 1.0, checksums=[42]) == [Status.OK]
    [result] = core.get_replicas([ObjectKey(b"x")], 2.0)
    assert (result.status, result.size_bytes, result.placements, result.checksum) == (
        Status.OK, 100, placements, 42)
    assert core.take_events() == [ObjectCommitted(ObjectKey(b"x"), 100, placements, 42,
                                                  Pin.NONE, None)]


def test_write_once_retry_and_ownership() -> None:
    core = core_with(A, B)
    first = core.put_start(A, [ObjectKey(b"x")], [100], PutOptions(), 1.0)
    assert core.put_start(A, [ObjectKey(b"x")], [100], PutOptions(), 1.5) == first
    assert core.put_start(A, [ObjectKey(b"x")], [200], PutOptions(), 1.5) == [
        (Status.INVALID_ARGUMENT, ())]
    assert core.put_start(B, [ObjectKey(b"x")], [100], PutOptions(), 1.5) == [
        (Status.ALREADY_EXISTS, ())]
    assert core.put_end(B, [ObjectKey(b"x")], 2.0) == [Status.PERMISSION_DENIED]
    assert core.put_revoke(B, [ObjectKey(b"x")], 2.0) == [Status.PERMISSION_DENIED]
    assert core.put_end(A, [ObjectKey(b"x")], 2.0) == [Status.OK]
    assert core.put_end(A, [ObjectKey(b"x")], 2.0) == [Status.OK]  # retried commit
    assert core.put_revoke(A, [ObjectKey(b"x")], 2.0) == [Status.INVALID_ARGUMENT]
    assert core.put_start(A, [ObjectKey(b"x")], [100], PutOptions(), 3.0) == [
        (Status.ALREADY_EXISTS, ())]
    assert core.stats().put_started_total == 1


def test_revoked_space_is_reused_only_after_the_write_capabilities_expired() -> None:
    # The writer may still hold WRITE capabilities for the revoked extent: a late write must
    # land on space that belongs to nobody, never on the next object's bytes.
    core = core_with(A, config=CoreConfig(write_capability_ttl_s=10.0))
    core.put_start(A, [ObjectKey(b"x")], [4096], PutOptions(), 1.0)
    (status, (first,)), = core.put_start(A, [ObjectKey(b"w")], [4096], PutOptions(), 1.0)
    assert core.stats().tier_to_used_bytes[0] == 8192
    assert core.put_revoke(A, [ObjectKey(b"w"), ObjectKey(b"y")], 1.0) == [
        Status.OK, Status.NOT_FOUND]
    assert core.stats().deferred_free_bytes == 4096
    assert core.put_end(A, [ObjectKey(b"w")], 1.0) == [Status.NOT_FOUND]
    (status, (held,)), = core.put_start(A, [ObjectKey(b"z")], [4096], PutOptions(), 10.9)
    assert status == Status.OK and held.offset != first.offset
    (status, (reused,)), = core.put_start(A, [ObjectKey(b"v")], [4096], PutOptions(), 11.1)
    assert status == Status.OK and reused.offset == first.offset
    assert core.stats().deferred_free_bytes == 0


@pytest.mark.parametrize("filler", [0, 3000])   # swept at once / a step at a time
@pytest.mark.parametrize("lost_by", ["expiry", "unmount"])
def test_a_lost_segments_pending_space_waits_for_its_writers_capabilities(
        lost_by: str, filler: int) -> None:
    # B writes into A's segment; A's segment is lost (A expires, or unmounts it) and mounted
    # again under the same id, over the same memory. B's WRITE capability may still land
    # there until write_capability_ttl: no object may be placed on that space before.
    core = core_with(A, B, config=CoreConfig(client_ttl_s=5.0, write_capability_ttl_s=10.0))
    core.unmount_segment(B, SegmentId(f"seg-{B}"), 0.0)
    if filler:
        core.mount_segment(seg("filler", B, 64 * MIB), 0.0)
        put(core, B, [b"f%d" % i for i in range(filler)], size=1000, now=0.5,
            preferred_segment=SegmentId("filler"))
    (status, (pending,)), = core.put_start(B, [ObjectKey(b"late")], [4096],
                                           PutOptions(preferred_segment=SegmentId(f"seg-{A}")),
                                           1.0)
    assert status == Status.OK and pending.segment_id == f"seg-{A}"
    if lost_by == "expiry":
        core.heartbeat(B, 5.5)
        core.tick(6.5)   # A silent past its ttl: expired, its segment lost
        assert core.register_client(A, "host-1", b"n" * 32, 6.6)[0] == Status.OK
    else:
        assert core.unmount_segment(A, SegmentId(f"seg-{A}"), 6.5) == Status.OK
    while core.sweep(6.6):
        pass
    assert core.put_end(B, [ObjectKey(b"late")], 6.6) == [Status.NOT_FOUND]
    assert core.mount_segment(seg(f"seg-{A}", A), 6.7) == Status.OK
    core.heartbeat(B, 6.7)
    placed = core.put_start(B, [ObjectKey(b"n%d" % i) for i in range(255)], [4096] * 255,
                            PutOptions(preferred_segment=SegmentId(f"seg-{A}")), 6.8)
    offsets = [p.offset for status, places in placed for p in places
               if status == Status.OK and p.segment_id == f"seg-{A}"]
    assert len(offsets) == 255 and pending.offset not in offsets
    assert core.put_end(B, [ObjectKey(b"n%d" % i) for i in range(255)], 6.9) == \
        [Status.OK] * 255
    for now in (11.2, 16.0):
        core.heartbeat(A, now)
        core.heartbeat(B, now)
    core.tick(16.7)   # B's capability ran out: the space is free again
    (status, (reused,)), = core.put_start(B, [ObjectKey(b"after")], [4096],
                                          PutOptions(preferred_segment=SegmentId(f"seg-{A}")),
                                          16.8)
    assert status == Status.OK and reused.offset == pending.offset


def test_a_pending_objects_lost_replica_waits_for_its_writers_capabilities() -> None:
    # B's PENDING object has a replica on A's segment and one on B's own: when A's segment is
    # lost and mounted again, the lost replica's space stays held as the object's would.
    core = core_with(A, B, config=CoreConfig(client_ttl_s=5.0, write_capability_ttl_s=10.0))
    (status, places), = core.put_start(B, [ObjectKey(b"two")], [4096],
                                       PutOptions(replica_num=2), 1.0)
    assert status == Status.OK and {p.segment_id for p in places} == {f"seg-{A}", f"seg-{B}"}
    lost = next(p for p in places if p.segment_id == f"seg-{A}")
    assert core.unmount_segment(A, SegmentId(f"seg-{A}"), 2.0) == Status.OK
    assert core.mount_segment(seg(f"seg-{A}", A), 2.1) == Status.OK
    placed = core.put_start(A, [ObjectKey(b"a%d" % i) for i in range(255)], [4096] * 255,
                            PutOptions(preferred_segment=SegmentId(f"seg-{A}")), 2.2)
    assert lost.offset not in [p.offset for status, places in placed for p in places
                               if status == Status.OK and p.segment_id == f"seg-{A}"]
    assert core.put_end(B, [ObjectKey(b"two")], 2.3) == [Status.OK]


def test_stale_pending_is_reclaimed_after_the_discard_timeout() -> None:
    core = core_with(A, config=CoreConfig(put_start_discard_timeout_s=30.0, client_ttl_s=100))
    core.put_start(A, [ObjectKey(b"old")], [10], PutOptions(), 0.0)
    core.put_start(A, [ObjectKey(b"new")], [10], PutOptions(), 20.0)
    core.take_events()
    core.tick(30.0)
    assert core.stats().num_pending == 2
    core.tick(30.5)
    assert core.take_events() == [ObjectRemoved(ObjectKey(b"old"), 10, "reclaim"),
                                  PendingReclaimed(ObjectKey(b"old"))]
    assert core.put_end(A, [ObjectKey(b"old"), ObjectKey(b"new")], 31.0) == [
        Status.NOT_FOUND, Status.OK]


def test_pending_of_an_expired_writer_is_reclaimed() -> None:
    core = core_with(A, B, config=CoreConfig(client_ttl_s=10.0))
    core.put_start(A, [ObjectKey(b"x")], [10], PutOptions(), 1.0)
    core.heartbeat(B, 9.0)
    core.tick(10.5)
    assert core.stats().num_pending == 0
    assert core.put_start(B, [ObjectKey(b"x")], [10], PutOptions(), 11.0)[0][0] == Status.OK


# ---- reads, leases, removal ------------------------------------------------------------------

def test_query_prefix_counts_leading_ready_keys() -> None:
    core = core_with(A)
    put(core, A, [b"b0", b"b1", b"b3"])
    keys = [ObjectKey(k) for k in (b"b0", b"b1", b"b2", b"b3")]
    assert core.query_prefix(keys, 2.0) == 2
    assert core.query_prefix([], 2.0) == 0
    stats = core.stats()
    assert (stats.lookup_queries_total, stats.lookup_keys_total, stats.lookup_hit_keys_total) == (
        2, 4, 2)
    # The two leading blocks are leased, the one after the gap is not.
    assert core.remove([keys[0], keys[1], keys[3]], False, 3.0) == [
        Status.HAS_LEASE, Status.HAS_LEASE, Status.OK]


def test_every_read_extends_the_lease_to_max() -> None:
    core = core_with(A, config=CoreConfig(default_lease_ttl_s=5.0))
    put(core, A, [b"x"])
    x = [ObjectKey(b"x")]
    core.exist(x, 10.0)                       # lease until 15
    assert core.remove(x, False, 14.9) == [Status.HAS_LEASE]
    core.get_replicas(x, 12.0)                # until 17
    assert core.remove(x, False, 16.9) == [Status.HAS_LEASE]
    assert core.remove(x, False, 17.0) == [Status.OK]
    assert core.remove(x, False, 17.0) == [Status.NOT_FOUND]


def test_forced_remove_of_a_leased_object_defers_reuse_of_its_bytes() -> None:
    core = core_with(A, size=4096, config=CoreConfig(default_lease_ttl_s=5.0,
                                                     eviction_high_watermark_ratio=1.0))
    put(core, A, [b"x"], size=4096)
    core.get_replicas([ObjectKey(b"x")], 10.0)
    assert core.remove([ObjectKey(b"x")], True, 11.0) == [Status.OK]
    assert core.exist([ObjectKey(b"x")], 11.0)[0] == [Status.NOT_FOUND]
    # Hidden at once, but the bytes stay reserved until the lease ran out at 15.
    assert core.put_start(A, [ObjectKey(b"y")], [4096], PutOptions(), 14.0)[0][0] == (
        Status.NO_SPACE)
    assert core.stats().deferred_free_bytes == 4096
    assert core.put_start(A, [ObjectKey(b"y")], [4096], PutOptions(), 15.0)[0][0] == Status.OK


def test_remove_all_and_by_regex() -> None:
    core = core_with(A)
    put(core, A, [b"model-a/1", b"model-a/2", b"model-b/1", b"leased"])
    core.exist([ObjectKey(b"leased")], 2.0)
    assert core.remove_by_regex("^model-a/", False, 2.0) == (Status.OK, 2)
    assert core.remove_by_regex("([unclosed", False, 2.0) == (Status.INVALID_ARGUMENT, 0)
    assert core.remove_by_regex("x" * 5000, False, 2.0) == (Status.INVALID_ARGUMENT, 0)
    assert core.remove_all(False, 2.0) == 1
    assert core.remove_all(True, 2.0) == 1
    assert core.stats().num_objects == 0


# ---- bad input -------------------------------------------------------------------------------

def test_bad_items_get_their_own_status_and_change_nothing() -> None:
    core = core_with(A, config=CoreConfig(max_key_bytes=64))
    keys = [b"", b"x" * 65, "str-key", b"ok", b"zero", b"neg", b"float", b"huge", b"badparent"]
    sizes = [10, 10, 10, 10, 0, -1, 1.5, 1 << 60, 10]
    parents = [b"", b"", b"", b"", b"", b"", b"", b"", b"p" * 65]
    results = core.put_start(A, keys, sizes, PutOptions(), 1.0, parent_keys=parents)  # type: ignore[arg-type]
    assert [status for status, _ in results] == [
        Status.INVALID_KEY, Status.INVALID_KEY, Status.INVALID_KEY, Status.OK,
        Status.INVALID_ARGUMENT, Status.INVALID_ARGUMENT, Status.INVALID_ARGUMENT,
        Status.NO_SPACE, Status.INVALID_KEY]
    assert core.stats().num_pending == 1
    assert core.get_replicas([b"", b"x" * 65, b"missing"], 1.0)[0].status == Status.INVALID_KEY  # type: ignore[list-item]
    assert core.exist([b"", b"missing"], 1.0)[0] == [Status.INVALID_KEY, Status.NOT_FOUND]  # type: ignore[list-item]
    assert core.remove([b""], False, 1.0) == [Status.INVALID_KEY]  # type: ignore[list-item]
    assert core.put_end(A, [ObjectKey(b"ok")], 1.0, checksums=[-1]) == [Status.INVALID_ARGUMENT]
    assert core.put_end(A, [ObjectKey(b"ok")], 1.0, checksums=[1 << 64]) == [
        Status.INVALID_ARGUMENT]
    assert core.stats().num_objects == 0


def test_bad_batches_answer_invalid_argument_for_every_item() -> None:
    core = core_with(A, config=CoreConfig(max_batch_keys=4))
    five = [ObjectKey(b"k%d" % i) for i in range(5)]
    assert core.put_start(A, five, [1] * 5, PutOptions(), 1.0) == [
        (Status.INVALID_ARGUMENT, ())] * 5
    assert core.put_start(A, five[:2], [1], PutOptions(), 1.0) == [
        (Status.INVALID_ARGUMENT, ())] * 2
    assert core.put_start(A, five[:2], [1, 1], PutOptions(), 1.0, parent_keys=[b""]) == [  # type: ignore[list-item]
        (Status.INVALID_ARGUMENT, ())] * 2
    assert core.put_end(A, five[:2], 1.0, checksums=[1]) == [Status.INVALID_ARGUMENT] * 2
    assert core.put_end(A, five, 1.0) == [Status.INVALID_ARGUMENT] * 5
    assert core.put_revoke(A, five, 1.0) == [Status.INVALID_ARGUMENT] * 5
    assert [r.status for r in core.get_replicas(five, 1.0)] == [Status.INVALID_ARGUMENT] * 5
    assert core.exist(five, 1.0) == ([Status.INVALID_ARGUMENT] * 5, [0] * 5)
    assert core.query_prefix(five, 1.0) == 0
    assert core.remove(five, True, 1.0) == [Status.INVALID_ARGUMENT] * 5
    assert core.get_segments(["a"] * 5) == [None] * 5
    assert core.stats().put_started_total == 0


@pytest.mark.parametrize("options", [
    PutOptions(replica_num=-1), PutOptions(replica_num=17), PutOptions(pin=7),  # type: ignore[arg-type]
    PutOptions(preferred_segment=5),  # type: ignore[arg-type]
])
def test_bad_options_refuse_the_whole_call(options: PutOptions) -> None:
    core = core_with(A)
    assert core.put_start(A, [ObjectKey(b"x")], [1], options, 1.0) == [
        (Status.INVALID_ARGUMENT, ())]
    assert core.stats().num_pending == 0


def test_unknown_client_writes_nothing() -> None:
    core = core_with(A)
    ghost = ClientId("ghost")
    assert core.put_start(ghost, [ObjectKey(b"x")], [1], PutOptions(), 1.0) == [
        (Status.UNKNOWN_CLIENT, ())]
    assert core.put_end(ghost, [ObjectKey(b"x")], 1.0) == [Status.UNKNOWN_CLIENT]
    assert core.put_revoke(ghost, [ObjectKey(b"x")], 1.0) == [Status.UNKNOWN_CLIENT]
    assert core.heartbeat(ghost, 1.0) == Status.UNKNOWN_CLIENT
    assert core.unmount_segment(ghost, SegmentId("seg-client-a"), 1.0) == Status.UNKNOWN_CLIENT


def test_config_rejects_out_of_range_values() -> None:
    for bad in ({"client_ttl_s": 0}, {"eviction_ratio": 1.5}, {"eviction_policy": "fifo"},
                {"max_key_bytes": 0}, {"max_batch_keys": 0},
                {"eviction_high_watermark_ratio": float("nan")}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            CoreConfig(**bad)  # type: ignore[arg-type]


def test_stats_report_capacity_and_usage_per_segment() -> None:
    core = core_with(A)
    put(core, A, [b"x"], size=100)
    stats = core.stats()
    assert (stats.num_clients, stats.num_segments, stats.num_objects, stats.ready_bytes) == (
        1, 1, 1, 100)
    [segment] = stats.segments
    assert (segment.capacity_bytes, segment.used_bytes, segment.mounted) == (MIB, 128, True)
    assert core.take_events() == [ObjectCommitted(ObjectKey(b"x"), 100, segment_placements(core),
                                                  0, Pin.NONE, None)]


def segment_placements(core: MasterCore) -> tuple:  # type: ignore[type-arg]
    return core.get_replicas([ObjectKey(b"x")], 0.0)[0].placements


def test_segment_mounted_event_carries_the_descriptor() -> None:
    core = MasterCore(CoreConfig())
    core.register_client(A, "h", KEY, 0.0)
    core.take_events()
    core.mount_segment(seg("s", A), 0.0)
    assert core.take_events() == [SegmentMounted(seg("s", A))]


def test_lapsed_leases_are_counted_when_seen() -> None:
    core = core_with(A, config=CoreConfig(default_lease_ttl_s=5.0))
    put(core, A, [b"x", b"y"])
    core.exist([ObjectKey(b"x"), ObjectKey(b"y")], 10.0)     # leases until 15
    core.exist([ObjectKey(b"x")], 12.0)                      # renewed before it ran out
    core.exist([ObjectKey(b"x")], 20.0)                      # x's lease (until 17) lapsed
    assert core.remove([ObjectKey(b"y")], False, 20.0) == [Status.OK]   # y's lapsed too
    stats = core.stats()
    assert (stats.leases_granted_total, stats.leases_lapsed_total) == (4, 2)
    assert (stats.read_keys_total, stats.read_hit_keys_total) == (4, 4)


def _churn_one(core: MasterCore, live: set[ObjectKey], rng: random.Random) -> None:
    """Remove one of 300 keys if it is live on A's segment, else put it there."""
    key = ObjectKey(b"k-%d" % rng.randrange(300))
    if key in live:
        assert core.remove([key], False, 1.0) == [Status.OK]
        live.discard(key)
    else:
        core.put_start(A, [key], [64], PutOptions(preferred_segment="seg-client-a"), 1.0)
        core.put_end(A, [key], 1.0)
        live.add(key)


def test_the_core_keeps_no_reference_to_a_removed_object_s_key() -> None:
    # Objects are not listed per segment: once removed (or evicted), nothing in the core holds
    # their keys, however many came and went through one segment.
    core = core_with(A, config=CoreConfig(eviction_high_watermark_ratio=1.0))
    gone = [ObjectKey(b"churn-%d" % i) for i in range(5000)]
    for key in gone:
        core.put_start(A, [key], [64], PutOptions(preferred_segment="seg-client-a"), 1.0)
        core.put_end(A, [key], 1.0)
        assert core.remove([key], False, 1.0) == [Status.OK]
    del key
    core.take_events()
    unused = [ObjectKey(b"churn-%d" % 5000)]   # held the same way, never given to the core
    assert {sys.getrefcount(k) for k in gone} == {sys.getrefcount(k) for k in unused}


def test_churn_then_losing_the_segment_drops_exactly_its_live_objects() -> None:
    # The server's mode, seeded churn through one segment (keys put, removed and put again):
    # losing the segment then drops exactly the objects live on it, whatever the table went
    # through.
    rng = random.Random(11)
    core = core_with(A, config=CoreConfig(eviction_high_watermark_ratio=1.0))
    core.defer_upkeep = True
    live: set[ObjectKey] = set()
    for _ in range(30_000):
        _churn_one(core, live, rng)
    assert len(core._objects) == len(live) > 0
    core.take_events()
    assert core.unmount_segment(A, SegmentId("seg-client-a"), 2.0) == Status.OK
    while core.upkeep_due:
        core.upkeep(2.0)
    dropped = {e.key for e in core.take_events() if isinstance(e, ObjectRemoved)}
    assert dropped == live and len(core._objects) == 0


def _keys_in_shard(shard: int, prefix: bytes, count: int) -> list[ObjectKey]:
    """``count`` keys the object table files under ``shard`` (hashes vary per process)."""
    from kvpool_master.core.objects import SHARD_MASK
    found: list[ObjectKey] = []
    i = 0
    while len(found) < count:
        key = ObjectKey(b"%s-%d" % (prefix, i))
        if hash(key) & SHARD_MASK == shard:
            found.append(key)
        i += 1
    return found


def test_a_segment_lost_while_the_walk_is_inside_a_shard_is_swept_there_too() -> None:
    # The walk has looked at part of a shard for one lost segment when a second is lost: the
    # second's object in that part is met when the walk comes round to the shard again.
    core = _big_segment_core(3000)
    shard = core._walk.shard
    [early] = _keys_in_shard(shard, b"b-early", 1)
    core.put_start(B, [early], [4096], PutOptions(preferred_segment="seg-" + B), 1.0)
    core.put_end(B, [early], 1.0)
    late = _keys_in_shard(shard, b"a-late", 2)
    core.put_start(A, late, [4096] * 2, PutOptions(preferred_segment="seg-" + A), 1.0)
    core.put_end(A, late, 1.0)
    assert core.unmount_segment(A, SegmentId("seg-" + A), 2.0) == Status.OK
    early_entry = core._objects.get(early)
    walk = core._walk
    while walk.entries is None or any(e is early_entry for e in walk.entries):
        core.sweep(2.0, budget_objects=1)    # one object of A a step
    # B's object lies behind the walk, A's late ones ahead of it, in that shard
    assert walk.shard == shard and walk.entries
    assert core.unmount_segment(B, SegmentId("seg-" + B), 2.0) == Status.OK
    backlog = core.stats().sweep_backlog_keys
    assert backlog > 0
    while core.sweep(3.0):
        assert core.stats().sweep_backlog_keys <= backlog
    assert core.stats().num_objects == 0 and core.stats().sweep_backlog_keys == 0
    assert core.stats().segment_lost_objects_total == 3000 + 1 + 2 + 1


def test_a_removal_job_and_a_lost_segment_share_the_walk() -> None:
    # A stepped RemoveAll starts while a lost segment is swept: both end, every object goes,
    # each counted once, and no step removes more than a step's worth.
    from kvpool_master.core.sweeps import SWEEP_STEP_OBJECTS
    core = _big_segment_core(3000)
    keys_b = [ObjectKey(b"b%d" % i) for i in range(2000)]
    for i in range(0, len(keys_b), 1000):
        core.put_start(B, keys_b[i:i + 1000], [4096] * 1000,
                       PutOptions(preferred_segment="seg-" + B), 1.0)
        core.put_end(B, keys_b[i:i + 1000], 1.0)
    core.take_events()
    assert core.unmount_segment(A, SegmentId("seg-" + A), 2.0) == Status.OK
    for _ in range(100):
        core.sweep(2.0)
    core.take_events()
    job = core.start_remove(None, False, 2.0)
    assert not job.done
    while core.sweep(2.0):
        removed = [e for e in core.take_events() if isinstance(e, ObjectRemoved)]
        assert len(removed) <= 2 * SWEEP_STEP_OBJECTS
    stats = core.stats()
    assert job.done and stats.num_objects == 0
    assert stats.segment_lost_objects_total + job.removed == 3000 + 1 + 2000
    assert job.removed >= 2000     # B's objects, and the twin once A's replica was gone


def test_losing_a_segment_drops_exactly_the_objects_left_on_it() -> None:
    core = core_with(A, B, config=CoreConfig(eviction_high_watermark_ratio=1.0))
    # Churn 5000 objects through segment A, keeping 10 of them, and one two-replica object.
    for i in range(5000):
        key = ObjectKey(b"churn-%d" % i)
        core.put_start(A, [key], [64], PutOptions(preferred_segment="seg-client-a"), 1.0)
        core.put_end(A, [key], 1.0)
        if i >= 10:
            core.remove([key], False, 1.0)
    put(core, A, [b"both"], size=64, replica_num=2)
    core.take_events()
    assert core.unmount_segment(A, SegmentId("seg-client-a"), 2.0) == Status.OK
    dropped = sorted(e.key for e in core.take_events() if isinstance(e, ObjectRemoved))
    assert dropped == sorted(ObjectKey(b"churn-%d" % i) for i in range(10))
    [both] = core.get_replicas([ObjectKey(b"both")], 3.0)
    assert [p.segment_id for p in both.placements] == ["seg-client-b"]


def _big_segment_core(num_objects: int) -> MasterCore:
    core = MasterCore(CoreConfig(client_ttl_s=1e9, put_start_discard_timeout_s=1e9))
    for client in (A, B):
        core.register_client(client, "h", b"k" * 32, 0.0)
        core.mount_segment(SegmentInfo(SegmentId(f"seg-{client}"), client, 1 << 30), 0.0)
    keys = [ObjectKey(b"k%d" % i) for i in range(num_objects)]
    for i in range(0, num_objects, 1000):
        chunk = keys[i:i + 1000]
        core.put_start(A, chunk, [4096] * len(chunk), PutOptions(preferred_segment="seg-" + A),
                       1.0)
        core.put_end(A, chunk, 1.0)
    twin = [ObjectKey(b"twin")]
    core.put_start(A, twin, [4096], PutOptions(replica_num=2), 1.0)
    core.put_end(A, twin, 1.0)
    core.take_events()
    return core


def test_a_large_segment_is_lost_at_once_and_swept_in_bounded_steps() -> None:
    from kvpool_master.core.sweeps import SWEEP_STEP_OBJECTS
    core = _big_segment_core(5000)
    assert core.unmount_segment(A, SegmentId("seg-" + A), 2.0) == Status.OK
    assert core.sweeping
    # nothing on it is readable, though the sweep has not reached it yet
    assert core.exist([ObjectKey(b"k0"), ObjectKey(b"k4999")], 2.0)[0] == [Status.NOT_FOUND] * 2
    [twin] = core.get_replicas([ObjectKey(b"twin")], 2.0)
    assert twin.status == Status.OK and [p.segment_id for p in twin.placements] == ["seg-" + B]
    steps = 0
    while core.sweep(3.0):
        steps += 1
        removed = [e for e in core.take_events() if isinstance(e, ObjectRemoved)]
        assert len(removed) <= SWEEP_STEP_OBJECTS
    assert steps >= 4 and core.stats().num_objects == 1
    assert core.stats().segment_lost_objects_total == 5000


def test_a_segment_mounted_again_while_swept_never_serves_old_placements() -> None:
    core = _big_segment_core(5000)
    info = SegmentInfo(SegmentId("seg-" + A), A, 1 << 30)
    assert core.unmount_segment(A, info.segment_id, 2.0) == Status.OK
    core.sweep(2.0)
    assert core.mount_segment(info, 2.5) == Status.OK     # finishes the sweep first
    assert not core.sweeping and core.stats().num_objects == 1
    assert core.exist([ObjectKey(b"k4999")], 3.0)[0] == [Status.NOT_FOUND]


def test_a_server_core_mounts_an_id_being_swept_once_it_is_swept() -> None:
    # The server's mode: the mount is refused (UNAVAILABLE, nothing changed) while the walk
    # sweeps the segment lost under that id, rather than sweep the whole table in one call.
    core = _big_segment_core(5000)
    core.defer_upkeep = True
    info = SegmentInfo(SegmentId("seg-" + A), A, 1 << 30)
    assert core.unmount_segment(A, info.segment_id, 2.0) == Status.OK
    core.take_events()
    assert core.mount_segment(info, 2.5) == Status.UNAVAILABLE
    assert core.take_events() == [] and core.stats().num_objects == 5001
    while core.upkeep(2.6):
        pass
    assert core.mount_segment(info, 2.7) == Status.OK
    assert core.stats().num_objects == 1
    assert core.exist([ObjectKey(b"k4999")], 3.0)[0] == [Status.NOT_FOUND]


def test_a_put_of_a_key_on_a_lost_segment_only_is_a_fresh_put() -> None:
    core = _big_segment_core(5000)
    assert core.unmount_segment(A, SegmentId("seg-" + A), 2.0) == Status.OK
    [(status, placements)] = core.put_start(B, [ObjectKey(b"k4999")], [4096], PutOptions(),
                                            2.0)
    assert status == Status.OK and placements[0].segment_id == "seg-" + B
    assert core.put_end(B, [ObjectKey(b"k4999")], 2.0) == [Status.OK]
    while core.sweep(3.0):
        pass
    assert core.exist([ObjectKey(b"k4999")], 3.0)[0] == [Status.OK]


def test_a_large_removal_is_a_job_done_in_bounded_steps() -> None:
    from kvpool_master.core.keyregex import compile_key_pattern
    from kvpool_master.core.sweeps import SWEEP_STEP_OBJECTS
    core = _big_segment_core(5000)
    pattern = compile_key_pattern("^k1")                  # k1, k10-k19, k100-k199, ...
    assert pattern is not None
    job = core.start_remove(pattern, False, 2.0)
    assert not job.done and core.sweeping
    # a put meanwhile is removed if the walk meets it (it may land behind the walk)
    core.put_start(A, [ObjectKey(b"k1-late")], [4096], PutOptions(), 2.1)
    core.put_end(A, [ObjectKey(b"k1-late")], 2.1)
    while core.sweep(2.2):
        assert len([e for e in core.take_events() if isinstance(e, ObjectRemoved)]) <= \
            SWEEP_STEP_OBJECTS
    [k1999, k2, late] = core.exist([ObjectKey(b"k1999"), ObjectKey(b"k2"),
                                    ObjectKey(b"k1-late")], 3.0)[0]
    late_met = late == Status.NOT_FOUND
    assert job.done and job.removed == 1111 + late_met
    assert (k1999, k2) == (Status.NOT_FOUND, Status.OK)
    assert core.remove_all(True, 3.0) == 5000 - 1111 + 1 + (not late_met)   # at once
    assert core.stats().num_objects == 0 and not core.sweeping
