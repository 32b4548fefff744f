"""Leases a reader ends: holds per proven reader, numbered leases, early frees of removed bytes."""

from __future__ import annotations

from kvpool_master.core.master import CoreConfig, MasterCore
from kvpool_wire.status import Status
from kvpool_wire.types import ClientId, ObjectKey, PutOptions, SegmentId, SegmentInfo

KEY = b"k" * 32
A, B = ClientId("client-a"), ClientId("client-b")
X = [ObjectKey(b"x")]


def core_with_object(segment_bytes: int = 4096) -> MasterCore:
    """A's segment holding the READY 4 KiB object ``x`` (by default it fills the segment)."""
    core = MasterCore(CoreConfig(default_lease_ttl_s=5.0, eviction_high_watermark_ratio=1.0))
    for client in (A, B):
        assert core.register_client(client, "host-1", KEY, 0.0) == (Status.OK, KEY)
    assert core.mount_segment(SegmentInfo(SegmentId("seg-a"), A, segment_bytes,
                                                          host_id="host-1"),
                              0.0) == Status.OK
    assert core.put_start(A, X, [4096], PutOptions(), 1.0)[0][0] == Status.OK
    assert core.put_end(A, X, 1.0) == [Status.OK]
    return core


def read(core: MasterCore, reader: ClientId | None, now: float) -> int:
    [result] = core.get_replicas(X, now, reader)
    assert result.status == Status.OK
    return core.last_lease_id


def room_for_y(core: MasterCore, now: float) -> Status:
    status: Status = core.put_start(A, [ObjectKey(b"y")], [4096], PutOptions(), now)[0][0]
    return status


def test_a_forced_remove_frees_the_bytes_once_the_reader_ended_its_lease() -> None:
    core = core_with_object()
    lease = read(core, B, 10.0)
    assert core.remove(X, True, 10.1) == [Status.OK]
    assert room_for_y(core, 10.2) == Status.NO_SPACE      # B may still be copying
    core.end_lease(B, lease, 10.3)
    assert core.stats().deferred_free_bytes == 0
    assert room_for_y(core, 10.4) == Status.OK            # well before the lease's 15.0
    assert core.stats().leases_ended_total == 1


def test_an_ended_lease_leaves_mooncakes_lease_to_run_its_time() -> None:
    """A plain remove still answers HAS_LEASE (as Mooncake does after a get): only the bytes'
    protection ended."""
    core = core_with_object()
    lease = read(core, B, 10.0)
    core.end_lease(B, lease, 10.1)
    assert core.remove(X, False, 10.2) == [Status.HAS_LEASE]
    assert core.remove(X, False, 15.0) == [Status.OK]


def forced_remove_frees_now(core: MasterCore, now: float) -> bool:
    assert core.remove(X, True, now) == [Status.OK]
    return core.stats().deferred_free_bytes == 0


def test_a_later_read_of_the_same_reader_keeps_its_own_hold() -> None:
    core = core_with_object()
    first = read(core, B, 10.0)
    second = read(core, B, 11.0)                          # still copying under lease 2
    core.end_lease(B, first, 11.5)
    assert not forced_remove_frees_now(core, 11.6)
    core.end_lease(B, second, 11.7)
    assert core.stats().deferred_free_bytes == 0
    assert room_for_y(core, 11.8) == Status.OK


def test_a_reader_ends_only_its_own_holds() -> None:
    core = core_with_object()
    read(core, A, 10.0)
    lease_b = read(core, B, 10.5)
    core.end_lease(B, lease_b, 10.6)
    assert core.remove(X, True, 10.7) == [Status.OK]
    assert room_for_y(core, 10.8) == Status.NO_SPACE      # A still holds it until 15.0
    core.end_lease(B, lease_b + 100, 10.9)            # naming a later lease changes nothing
    assert room_for_y(core, 11.0) == Status.NO_SPACE
    assert room_for_y(core, 15.0) == Status.OK


def test_leases_nobody_can_end_protect_the_bytes_for_their_time() -> None:
    core = core_with_object()
    core.exist(X, 10.0)                                   # anonymous lease until 15.0
    lease = read(core, B, 10.5)
    core.end_lease(B, lease, 10.6)
    assert not forced_remove_frees_now(core, 10.7)
    assert room_for_y(core, 14.9) == Status.NO_SPACE
    assert room_for_y(core, 15.0) == Status.OK

    core = core_with_object()
    lease = read(core, B, 10.0)
    core.get_replicas(X, 12.0)                            # an anonymous read, until 17.0
    core.end_lease(B, lease, 12.1)
    assert not forced_remove_frees_now(core, 12.2)
    assert room_for_y(core, 16.9) == Status.NO_SPACE
    assert room_for_y(core, 17.0) == Status.OK

    core = core_with_object()
    lease = read(core, B, 10.0)
    core.end_lease(B, lease, 10.1)
    core.exist(X, 10.2)                                   # taken after every hold ended
    assert not forced_remove_frees_now(core, 10.3)
    assert room_for_y(core, 15.2) == Status.OK


def test_a_hold_that_ran_out_is_dropped_at_the_next_read_and_ending_it_late_is_harmless() -> None:
    core = core_with_object()
    old = read(core, B, 10.0)
    fresh = read(core, A, 20.0)                           # B's hold ran out at 15.0
    core.end_lease(B, old, 20.1)
    assert not forced_remove_frees_now(core, 20.2)
    core.end_lease(A, fresh, 20.3)
    assert core.stats().deferred_free_bytes == 0


def test_a_key_put_again_after_a_forced_remove_keeps_both_incarnations_apart() -> None:
    core = core_with_object(segment_bytes=8192)
    old = read(core, B, 10.0)
    assert core.remove(X, True, 10.1) == [Status.OK]
    assert core.put_start(A, X, [4096], PutOptions(), 10.2)[0][0] == Status.OK
    assert core.put_end(A, X, 10.2) == [Status.OK]
    new = read(core, B, 10.3)
    core.end_lease(B, old, 10.4)                      # the removed one is freed ...
    assert core.stats().deferred_free_bytes == 0
    assert not forced_remove_frees_now(core, 10.5)        # ... the new one still held
    core.end_lease(B, new, 10.6)
    assert core.stats().deferred_free_bytes == 0


def test_extents_freed_early_are_not_freed_again_when_their_time_comes() -> None:
    core = core_with_object()
    lease = read(core, B, 10.0)
    assert core.remove(X, True, 10.1) == [Status.OK]
    core.end_lease(B, lease, 10.2)
    assert room_for_y(core, 10.3) == Status.OK
    assert core.put_end(A, [ObjectKey(b"y")], 10.3) == [Status.OK]
    assert core.heartbeat(A, 15.0) == Status.OK
    core.tick(15.5)                                       # the parked extent's time passes
    assert core.exist([ObjectKey(b"y")], 15.5)[0] == [Status.OK]
    assert core.put_start(A, [ObjectKey(b"z")], [4096], PutOptions(), 15.6)[0][0] == (
        Status.NO_SPACE)                                  # y still owns the only extent


def test_an_earlier_read_still_copying_keeps_its_hold_when_a_later_one_ends_first() -> None:
    """Two threads of one client read the same object; the later read ends first: the earlier
    one may still be copying, so the bytes stay until it ends too."""
    core = core_with_object()
    first = read(core, B, 10.0)                           # a large copy, still running
    second = read(core, B, 10.1)                          # a quick one, done at once
    core.end_lease(B, second, 10.2)
    assert not forced_remove_frees_now(core, 10.3)
    assert room_for_y(core, 10.4) == Status.NO_SPACE     # never under the first reader
    core.end_lease(B, first, 10.5)
    assert core.stats().deferred_free_bytes == 0
    assert room_for_y(core, 10.6) == Status.OK


def test_a_lease_ended_twice_counts_once() -> None:
    """An ended lease sent again (a retried call the master had already served) does not end
    another read's hold."""
    core = core_with_object()
    first = read(core, B, 10.0)
    second = read(core, B, 10.1)
    core.end_lease(B, first, 10.2)
    core.end_lease(B, first, 10.3)                    # the retry
    assert not forced_remove_frees_now(core, 10.4)
    core.end_lease(B, second, 10.5)
    assert core.stats().deferred_free_bytes == 0


def test_a_lease_never_ended_is_forgotten_once_it_ran_out_and_its_late_end_changes_nothing(
        ) -> None:
    core = core_with_object()
    crashed = read(core, B, 10.0)                         # a reader that never says it is done
    for client in (A, B):
        assert core.heartbeat(client, 15.0) == Status.OK
    core.tick(15.5)                                       # its lease ran out at 15.0
    assert len(core._open_leases) == 0  # noqa: SLF001 (the registry holds nothing stale)
    fresh = read(core, B, 16.0)
    core.end_lease(B, crashed, 16.1)                      # late: not the hold that is live now
    assert not forced_remove_frees_now(core, 16.2)
    core.end_lease(B, fresh, 16.3)
    assert core.stats().deferred_free_bytes == 0
