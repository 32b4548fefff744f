"""The SSD tier in the core: puts stay in DRAM, demotion copies run ahead of eviction, an
evicted object with an SSD copy keeps it, promotion brings hot objects back, and a copy that
raced a removal or ran out of time never commits."""

from __future__ import annotations

from kvpool_master.core.events import ReplicasChanged
from kvpool_master.core.master import CoreConfig, MasterCore
from kvpool_master.core.tiering import CopyTask
from kvpool_wire.capability import client_token
from kvpool_wire.status import Status
from kvpool_wire.types import ClientId, ObjectKey, Pin, PutOptions, SegmentId, SegmentInfo, Tier

BLOCK = 4096
A = ClientId("owner")
B = ClientId("other")
DRAM = SegmentId("a-dram")
SSD = SegmentId("a-ssd")


def make(dram_blocks: int = 10, ssd_blocks: int = 20, promote_after: int = 1,
         ttl_s: float = 30.0, client_ttl_s: float = 1e9) -> MasterCore:
    core = MasterCore(CoreConfig(eviction_high_watermark_ratio=0.8, eviction_ratio=0.1,
                                 default_lease_ttl_s=1.0, client_ttl_s=client_ttl_s,
                                 put_start_discard_timeout_s=1e9, write_capability_ttl_s=5.0,
                                 ssd_promote_after_hits=promote_after, copy_task_ttl_s=ttl_s))
    for client in (A, B):
        core.register_client(client, "h", b"k" * 32, 0.0)
    core.mount_segment(SegmentInfo(DRAM, A, dram_blocks * BLOCK), 0.0)
    core.mount_segment(SegmentInfo(SSD, A, ssd_blocks * BLOCK, tier=Tier.SSD,
                                   file_path="/ssd/a"), 0.0)
    core.take_events()
    return core


def put(core: MasterCore, name: str, now: float) -> Status:
    key = ObjectKey(name.encode())
    [(status, _)] = core.put_start(A, [key], [BLOCK], PutOptions(), now)
    if status == Status.OK:
        assert core.put_end(A, [key], now, [7]) == [Status.OK]
    return status


def segments_of(core: MasterCore, name: str) -> list[str]:
    """Where an object lives, without reading it (a read would change its recency)."""
    entry = core._objects.get(ObjectKey(name.encode()))
    assert entry is not None
    return [p.segment_id for p in entry.extents()]


def read(core: MasterCore, name: str, now: float) -> None:
    [result] = core.get_replicas([ObjectKey(name.encode())], now)
    assert result.status == Status.OK


def fetch(core: MasterCore, now: float, client: ClientId = A) -> list[CopyTask]:
    status, tasks = core.copy_tasks(client, [], 64, now)
    assert status == Status.OK
    return tasks


def report(core: MasterCore, tasks: list[CopyTask], now: float,
           status: Status = Status.OK) -> None:
    assert core.copy_tasks(A, [(t.task_id, int(status)) for t in tasks], 0, now)[0] == Status.OK


def _with_copies(core: MasterCore) -> tuple[MasterCore, list[CopyTask]]:
    """Seven objects (70 % of DRAM): the copies of the three least recently used, fetched."""
    for i in range(7):
        put(core, f"k{i}", float(i))
    core.tick(10.0)
    return core, fetch(core, 10.0)


def test_puts_never_land_on_ssd() -> None:
    core = make()
    for i in range(30):
        assert put(core, f"k{i}", float(i)) == Status.OK
    # SSD space is taken only by the targets of demotion copies (none reported yet)
    assert all(segments_of(core, name) == [DRAM] for name in (f"k{i}" for i in range(30))
               if ObjectKey(name.encode()) in core._objects)
    assert core.stats().tier_to_used_bytes[Tier.SSD] == BLOCK * len(fetch(core, 40.0)) > 0
    [(status, placements)] = core.put_start(A, [ObjectKey(b"x")], [BLOCK],
                                            PutOptions(preferred_segment=SSD), 40.0)
    assert status == Status.OK and [p.segment_id for p in placements] == [DRAM]


def test_demotion_runs_ahead_of_eviction_and_eviction_keeps_the_ssd_copy() -> None:
    core = make()
    for i in range(7):                                 # 70 % >= 80 % - 2 x 10 %: demote
        put(core, f"k{i}", float(i))
    core.tick(10.0)
    assert core.copy_tasks_waiting(A) > 0 and core.copy_tasks_waiting(B) == 0
    tasks = fetch(core, 10.0)
    assert [t.key for t in tasks] == [b"k0", b"k1", b"k2"]   # window: 30 % of DRAM, LRU first
    assert all(t.source.segment_id == DRAM and t.target.segment_id == SSD for t in tasks)
    report(core, tasks, 11.0)
    assert segments_of(core, "k0") == [DRAM, SSD]             # DRAM first
    assert [type(e) for e in core.take_events()].count(ReplicasChanged) == 3
    for i in range(7, 12):                                    # eviction now
        put(core, f"k{i}", 20.0 + i)
    assert segments_of(core, "k0") == [SSD]                   # kept on SSD only
    stats = core.stats()
    assert stats.evicted_replicas_total >= 1 and stats.demotions_done_total == 3
    assert core.tiers_of([ObjectKey(b"k0"), ObjectKey(b"k11"), ObjectKey(b"nope")]) == \
        [Tier.SSD, Tier.DRAM, Tier.DRAM]


def test_objects_copied_already_do_not_use_up_the_demotion_window() -> None:
    # k0..k2 (soft-pinned: eviction passes them by while others can go) have their SSD copy
    # and stay in DRAM; the next pass copies the next least recently used ones, which
    # eviction takes instead, rather than stopping at them
    core = make()
    for i in range(7):
        key = ObjectKey(b"k%d" % i)
        [(status, _)] = core.put_start(A, [key], [BLOCK], PutOptions(
            pin=Pin.SOFT if i < 3 else Pin.NONE), float(i))
        assert status == Status.OK and core.put_end(A, [key], float(i), [7]) == [Status.OK]
    core.tick(10.0)
    first = fetch(core, 10.0)
    assert [t.key for t in first] == [b"k0", b"k1", b"k2"]
    report(core, first, 10.5)
    core.tick(11.0)
    assert [t.key for t in fetch(core, 11.0)] == [b"k3", b"k4", b"k5"]


def _demoted_to_ssd_only(core: MasterCore) -> None:
    for i in range(7):
        put(core, f"k{i}", float(i))
    core.tick(10.0)
    report(core, fetch(core, 10.0), 11.0)
    for i in range(7, 12):
        put(core, f"k{i}", 20.0 + i)
    core.tick(40.0)
    report(core, fetch(core, 40.0), 40.0)


def test_a_hit_on_ssd_brings_the_object_back_to_dram() -> None:
    core = make()
    _demoted_to_ssd_only(core)
    assert segments_of(core, "k0") == [SSD]
    read(core, "k0", 45.0)                                    # the first hit
    core.tick(50.0)
    [task] = [t for t in fetch(core, 50.0) if t.key == b"k0"]
    assert task.source.segment_id == SSD and task.target.segment_id == DRAM
    report(core, [task], 51.0)
    assert segments_of(core, "k0") == [DRAM, SSD]
    assert core.stats().promotions_done_total == 1
    assert core.stats().ssd_read_hit_keys_total >= 1


def test_promotion_off_and_after_n_hits() -> None:
    core = make(promote_after=0)
    _demoted_to_ssd_only(core)
    for _ in range(5):
        read(core, "k0", 45.0)
    core.tick(50.0)
    assert not [t for t in fetch(core, 50.0) if t.key == b"k0"]
    core = make(promote_after=3)
    _demoted_to_ssd_only(core)
    read(core, "k0", 45.0)
    read(core, "k0", 46.0)
    core.tick(50.0)
    assert not [t for t in fetch(core, 50.0) if t.key == b"k0"]
    read(core, "k0", 50.5)
    core.tick(51.0)
    assert [t for t in fetch(core, 51.0) if t.key == b"k0"]


def test_a_copy_that_raced_a_removal_never_commits_and_frees_its_target() -> None:
    core, tasks = _with_copies(make())
    assert core.remove([ObjectKey(b"k0")], False, 10.5) == [Status.OK]
    put(core, "k0", 10.6)                                     # same key, a new object
    report(core, tasks, 11.0)
    assert segments_of(core, "k0") == [DRAM]
    assert core.stats().demotions_failed_total == 1
    # k0's first target is free again: k1, k2 committed and the report planned k3's copy
    assert core.stats().tier_to_used_bytes[Tier.SSD] == 3 * BLOCK
    assert [t.key for t in fetch(core, 11.0)] == [b"k3"]


def test_a_failed_copy_and_a_late_copy_free_their_targets() -> None:
    core, tasks = _with_copies(make(ttl_s=5.0))
    report(core, tasks[:1], 11.0, Status.TRANSFER_FAILED)
    assert segments_of(core, "k0") == [DRAM]
    # k0's target is free; the report planned k0's copy again (beside k1's and k2's)
    assert core.stats().tier_to_used_bytes[Tier.SSD] == 3 * BLOCK
    core.tick(16.0)               # the other two ran out of time; three new copies are planned
    assert core.stats().copies_expired_total == 2
    report(core, tasks[1:], 16.5)                             # too late: nothing commits
    assert segments_of(core, "k1") == [DRAM]
    # the late targets stay parked (their copier may write until 15 + 5) beside the new three
    assert core.stats().tier_to_used_bytes[Tier.SSD] == 5 * BLOCK
    # the parked ones are free; the new ones, never fetched, ran out and were planned again
    core.tick(21.5)
    assert core.stats().tier_to_used_bytes[Tier.SSD] == 3 * BLOCK
    assert len(fetch(core, 21.5)) == 3


def test_copies_handed_out_before_the_owner_expired_keep_their_targets() -> None:
    # The owner's copier fetched three copies, then the owner expired (a pause) and came back
    # with the same segments: the copier may still write those targets until the tasks' ttl
    # and the write capability's, so no new copy may target them before.
    core = make(ttl_s=5.0, client_ttl_s=3.0)
    for i in range(7):
        put(core, f"k{i}", 8.0 + i / 10)
    core.heartbeat(A, 10.0)
    core.tick(10.0)
    tasks = fetch(core, 10.0)
    old = {(t.target.segment_id, t.target.offset) for t in tasks}
    assert len(old) == 3
    core.tick(13.5)
    assert core.heartbeat(A, 13.5) == Status.UNKNOWN_CLIENT
    assert core.register_client(A, "h", b"n" * 32, 13.6)[0] == Status.OK
    core.mount_segment(SegmentInfo(DRAM, A, 10 * BLOCK), 13.6)
    core.mount_segment(SegmentInfo(SSD, A, 20 * BLOCK, tier=Tier.SSD, file_path="/ssd/a"), 13.6)
    for i in range(7):
        put(core, f"n{i}", 14.0 + i / 10)
    core.tick(15.0)
    fresh = fetch(core, 15.0)
    assert len(fresh) == 3 and not old & {(t.target.segment_id, t.target.offset) for t in fresh}
    report(core, fresh, 15.5)
    assert core.stats().tier_to_used_bytes[Tier.SSD] == 6 * BLOCK   # three copies, three parked
    for now in (17.5, 20.0):
        core.heartbeat(A, now)
    core.tick(20.5)   # the old tasks' ttl (10 + 5) and the capability's (+ 5) ended
    assert core.stats().tier_to_used_bytes[Tier.SSD] == 3 * BLOCK


def test_another_client_cannot_report_or_fetch_the_owners_copies() -> None:
    core, tasks = _with_copies(make())
    assert fetch(core, 10.0, B) == []
    assert core.copy_tasks(B, [(t.task_id, 0) for t in tasks], 0, 11.0)[0] == Status.OK
    assert segments_of(core, "k0") == [DRAM]                  # B's report changed nothing
    report(core, tasks, 12.0)
    assert segments_of(core, "k0") == [DRAM, SSD]


def test_restore_keeps_ssd_replicas() -> None:
    core = make()
    _demoted_to_ssd_only(core)
    snapshot = core.snapshot()
    rows = list(snapshot.objects)
    fresh = MasterCore(core.config)
    fresh.restore(type(snapshot)(snapshot.clients, snapshot.segments, rows), 100.0, 60.0)
    assert fresh.register_client(A, "h", b"x" * 32, 100.0, client_token(b"k" * 32))[0] == \
        Status.OK
    fresh.mount_segment(SegmentInfo(DRAM, A, 10 * BLOCK), 100.0)
    fresh.mount_segment(SegmentInfo(SSD, A, 20 * BLOCK, tier=Tier.SSD, file_path="/ssd/a"), 100.0)
    assert segments_of(fresh, "k0") == [SSD]
    assert fresh.tiers_of([ObjectKey(b"k0")]) == [Tier.SSD]


def test_losing_the_dram_segment_leaves_the_ssd_copies_readable() -> None:
    core = make()
    for i in range(7):
        put(core, f"k{i}", float(i))
    core.tick(10.0)
    report(core, fetch(core, 10.0), 11.0)
    assert core.unmount_segment(A, DRAM, 12.0) == Status.OK
    assert segments_of(core, "k0") == [SSD]                   # demoted: lives on
    assert ObjectKey(b"k3") not in core._objects               # DRAM only: gone
    assert core._objects.get(ObjectKey(b"k0")).dram is None  # type: ignore[union-attr]
    read(core, "k0", 13.0)
