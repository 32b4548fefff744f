"""StateStore: round trip, torn and corrupt logs, compaction, grace period, crash points."""

from __future__ import annotations

import contextlib
import logging
import os
import time
from pathlib import Path
from typing import Any

import pytest
from helpers import KEY_A, KEY_B, A, B, columns_of_rows, come_back

from kvpool_master.core.events import (
    ObjectCommitted,
    ObjectRemoved,
    SegmentMounted,
    SegmentUnmounted,
)
from kvpool_master.core.master import CoreConfig, MasterCore
from kvpool_master.core.snapshot import ObjectColumns
from kvpool_master.persist import LOG_NAME, SNAPSHOT_NAME, StateStore
from kvpool_master.server import _RestoreProgress
from kvpool_master.statefile import SNAPSHOT_VERSION, Overlay, event_row, frame, next_record
from kvpool_wire.capability import client_token
from kvpool_wire.status import Status
from kvpool_wire.types import (
    ClientId,
    ObjectKey,
    Pin,
    Placement,
    PutOptions,
    SegmentId,
    SegmentInfo,
)

SEG_A = SegmentInfo(SegmentId("seg-a"), A, 1 << 20, host_id="h1", shm_name="/kvp-a")
SEG_B = SegmentInfo(SegmentId("seg-b"), B, 1 << 20, host_id="h2", tcp_endpoint="10.0.0.2:1")
CONFIG = CoreConfig(client_ttl_s=10.0)


def fresh_store(path: Path, **kwargs: object) -> tuple[StateStore, MasterCore]:
    store = StateStore(path, fsync="always", restore_grace_s=20.0, **kwargs)  # type: ignore[arg-type]
    core = MasterCore(CONFIG)
    store.load(core, 0.0)
    return store, core


def sync(store: StateStore, core: MasterCore) -> None:
    store.append(core.take_events())


def populate(store: StateStore, core: MasterCore) -> None:
    core.register_client(A, "h1", KEY_A, 0.0)
    core.register_client(B, "h2", KEY_B, 0.0)
    core.mount_segment(SEG_A, 0.0)
    core.mount_segment(SEG_B, 0.0)
    keys = [ObjectKey(b"obj-%d" % i) for i in range(20)]
    core.put_start(A, keys, [1000 + i for i in range(20)], PutOptions(), 1.0)
    core.put_end(A, keys, 1.0, checksums=list(range(1, 21)))
    core.put_start(A, [ObjectKey(b"chain-1")], [64], PutOptions(replica_num=2, pin=Pin.SOFT),
                   1.0, parent_keys=[ObjectKey(b"obj-0")])
    core.put_end(A, [ObjectKey(b"chain-1")], 1.0, checksums=[7])
    core.put_start(A, [ObjectKey(b"pending")], [64], PutOptions(), 1.0)
    core.remove([ObjectKey(b"obj-19")], False, 1.0)
    sync(store, core)


def readable(core: MasterCore, now: float) -> dict[bytes, tuple]:  # type: ignore[type-arg]
    keys = [ObjectKey(b"obj-%d" % i) for i in range(20)] + [ObjectKey(b"chain-1"),
                                                          ObjectKey(b"pending")]
    return {k: (r.size_bytes, r.placements, r.checksum)
            for k, r in zip(keys, core.get_replicas(keys, now), strict=True)
            if r.status == Status.OK}


def test_round_trip_restores_clients_segments_and_ready_objects(tmp_path: Path) -> None:
    store, core = fresh_store(tmp_path)
    populate(store, core)
    before = readable(core, 2.0)
    assert len(before) == 20 and b"pending" not in before
    store.close()

    restored = MasterCore(CONFIG)
    report = StateStore(tmp_path, restore_grace_s=20.0).load(restored, 100.0)
    assert (report.num_clients, report.num_segments, report.num_objects) == (2, 2, 20)
    assert report.warnings == () and report.truncated_log_bytes == 0
    # Nothing is readable until the owners are back; then everything is, byte for byte.
    assert readable(restored, 100.0) == {}
    assert restored.get_segments(["seg-a"]) == [None]
    come_back(restored, 101.0, SEG_A, SEG_B)
    assert readable(restored, 102.0) == before
    [chain] = restored.get_replicas([ObjectKey(b"chain-1")], 102.0)
    assert chain.checksum == 7 and len(chain.placements) == 2
    # The free space stays quarantined until write capabilities of the previous master have
    # run out (write_capability_ttl_s after the restore).
    assert restored.put_start(A, [ObjectKey(b"early")], [5000], PutOptions(),
                              103.0)[0][0] == Status.NO_SPACE
    # The allocators know the restored extents: new puts never overlap them.
    after_s = 100.0 + CONFIG.write_capability_ttl_s
    restored.heartbeat(A, after_s)
    [(status, placements)] = restored.put_start(A, [ObjectKey(b"new")], [5000], PutOptions(),
                                                after_s)
    taken = {(p.segment_id, p.offset) for _, ps, _ in before.values() for p in ps}
    assert status == Status.OK and (placements[0].segment_id, placements[0].offset) not in taken
    assert restored.stats().tier_to_used_bytes[0] == core.stats().tier_to_used_bytes[0] - 64 + 5056


def test_objects_of_segments_not_back_in_time_are_dropped(tmp_path: Path) -> None:
    store, core = fresh_store(tmp_path)
    populate(store, core)
    store.close()
    restored = MasterCore(CONFIG)
    store2 = StateStore(tmp_path, restore_grace_s=20.0)
    store2.load(restored, 100.0)
    assert restored.register_client(A, "h1", KEY_A, 101.0,
                                    client_token(KEY_A)) == (Status.OK, KEY_A)
    assert restored.mount_segment(SEG_A, 101.0) == Status.OK   # B never comes back
    restored.tick(110.0)
    restored.heartbeat(A, 115.0)
    restored.tick(120.5)
    stats = restored.stats()
    assert (stats.num_clients, stats.num_segments, stats.num_restored_segments) == (1, 1, 0)
    survivors = readable(restored, 121.0)
    assert survivors and all(p.segment_id == "seg-a" for _, ps, _ in survivors.values()
                             for p in ps)
    assert len(survivors) + stats.segment_lost_objects_total == 20
    # The drops were logged: a second restart agrees.
    store2.append(restored.take_events())
    store2.close()
    third = MasterCore(CONFIG)
    report = StateStore(tmp_path).load(third, 200.0)
    assert (report.num_clients, report.num_segments, report.num_objects) == (
        1, 1, len(survivors))


def test_drops_after_the_grace_period_are_logged(tmp_path: Path) -> None:
    store, core = fresh_store(tmp_path)
    populate(store, core)
    store.close()
    second = MasterCore(CONFIG)
    store2 = StateStore(tmp_path, restore_grace_s=5.0)
    store2.load(second, 100.0)
    second.tick(106.0)
    store2.append(second.take_events())
    store2.close()
    third = MasterCore(CONFIG)
    report = StateStore(tmp_path).load(third, 200.0)
    assert (report.num_clients, report.num_segments, report.num_objects) == (0, 0, 0)


def test_remount_with_another_descriptor_drops_the_objects(tmp_path: Path) -> None:
    store, core = fresh_store(tmp_path)
    populate(store, core)
    store.close()
    restored = MasterCore(CONFIG)
    StateStore(tmp_path).load(restored, 100.0)
    come_back(restored, 101.0, SEG_A)
    changed = SegmentInfo(SegmentId("seg-b"), B, 1 << 20, host_id="h2", shm_name="/new")
    assert restored.mount_segment(changed, 101.0) == Status.OK
    assert all(p.segment_id == "seg-a" for _, ps, _ in readable(restored, 102.0).values()
               for p in ps)


def test_torn_tail_is_truncated_with_a_warning(tmp_path: Path) -> None:
    store, core = fresh_store(tmp_path)
    populate(store, core)
    core.put_start(A, [ObjectKey(b"late")], [10], PutOptions(), 2.0)
    core.put_end(A, [ObjectKey(b"late")], 2.0)
    sync(store, core)
    store.close()
    log_path = tmp_path / LOG_NAME
    size = log_path.stat().st_size
    with log_path.open("r+b") as f:
        f.truncate(size - 3)   # the last record is torn
    restored = MasterCore(CONFIG)
    report = StateStore(tmp_path).load(restored, 100.0)
    assert report.truncated_log_bytes > 0 and "torn" in report.warnings[0]
    assert report.num_objects == 20   # everything but the torn "late" commit
    assert log_path.stat().st_size < size - 3
    # The truncated log is appendable and loads cleanly afterwards.
    store3 = StateStore(tmp_path)
    again = MasterCore(CONFIG)
    assert store3.load(again, 200.0).warnings == ()
    store3.close()


def test_corrupt_record_ends_the_log(tmp_path: Path) -> None:
    store, core = fresh_store(tmp_path)
    core.register_client(A, "h1", KEY_A, 0.0)
    core.mount_segment(SEG_A, 0.0)
    sync(store, core)
    good_size = (tmp_path / LOG_NAME).stat().st_size
    for i in range(3):
        key = ObjectKey(b"k%d" % i)
        core.put_start(A, [key], [10], PutOptions(), 1.0)
        core.put_end(A, [key], 1.0)
        sync(store, core)
    store.close()
    data = bytearray((tmp_path / LOG_NAME).read_bytes())
    data[good_size + 12] ^= 0xFF   # inside the payload of the first object record
    (tmp_path / LOG_NAME).write_bytes(bytes(data))
    restored = MasterCore(CONFIG)
    report = StateStore(tmp_path).load(restored, 100.0)
    assert "checksum" in report.warnings[0]
    assert (report.num_clients, report.num_segments, report.num_objects) == (1, 1, 0)
    assert report.truncated_log_bytes == len(data) - good_size


def test_the_state_directory_is_made_private_to_its_user(tmp_path: Path) -> None:
    """It holds every client's capability key: a directory a service manager made 0755, and
    files an older master left 0644, are closed to others when the store opens."""
    state = tmp_path / "state"
    state.mkdir(mode=0o755)
    state.chmod(0o755)
    (state / LOG_NAME).write_bytes(b"")
    (state / LOG_NAME).chmod(0o644)
    store, core = fresh_store(state)
    core.register_client(A, "h1", KEY_A, 0.0)
    sync(store, core)
    store.close()
    assert state.stat().st_mode & 0o777 == 0o700
    assert (state / LOG_NAME).stat().st_mode & 0o777 == 0o600


def test_garbage_log_never_crashes(tmp_path: Path) -> None:
    (tmp_path / LOG_NAME).write_bytes(b"\xff" * 100)
    restored = MasterCore(CONFIG)
    store = StateStore(tmp_path)
    report = store.load(restored, 0.0)
    assert report.truncated_log_bytes == 100 and report.num_objects == 0
    restored.register_client(A, "h1", KEY_A, 0.0)
    store.append(restored.take_events())
    store.close()
    assert StateStore(tmp_path).load(MasterCore(CONFIG), 1.0).num_clients == 1


def test_records_that_pass_their_checksum_but_hold_nonsense_never_crash_a_restore(
        tmp_path: Path) -> None:
    """A damaged or hand-edited state directory whose records still pass their CRC: ids that
    are lists or numbers, rows cut short, columns of the wrong kind. Seeded, 400 of them:
    every restore ends (rows it cannot read dropped) and the master runs on."""
    import copy
    import random
    source = tmp_path / "source"
    store, core = fresh_store(source)
    populate(store, core)
    store.compact(core)
    more = [ObjectKey(b"more-%d" % i) for i in range(8)]
    core.put_start(A, more, [500] * 8, PutOptions(), 2.0)
    core.put_end(A, more, 2.0)
    core.remove(more[:3], False, 3.0)
    core.unmount_segment(B, SegmentId("seg-b"), 4.0)
    sync(store, core)
    store.close()
    snapshot = _records(source / SNAPSHOT_NAME)
    log = _records(source / LOG_NAME)
    odd = [None, [], [[]], {}, {"columns": []}, -1, 0, (1 << 64) - 1, -(1 << 63), 1.5, "",
           "seg-a", b"", [1, 2], ["seg-a"], [b"obj-1"], True]
    rng = random.Random(7)

    def mutated(value: Any, depth: int = 0) -> Any:
        if isinstance(value, list) and value and depth < 6 and rng.random() < 0.8:
            value = list(value)
            i = rng.randrange(len(value))
            value[i] = mutated(value[i], depth + 1)
            return value
        if isinstance(value, dict) and value and depth < 6 and rng.random() < 0.8:
            value = dict(value)
            name = rng.choice(list(value))
            value[name] = mutated(value[name], depth + 1)
            return value
        return copy.deepcopy(rng.choice([*odd, value]))

    for case in range(400):
        snapshot_records, log_records = list(snapshot), list(log)
        for records in rng.choice([[snapshot_records], [log_records],
                                   [snapshot_records, log_records]]):
            for _ in range(rng.randint(1, 3)):
                i = rng.randrange(len(records))
                records[i] = mutated(records[i])
        damaged = tmp_path / f"case-{case}"
        damaged.mkdir()
        (damaged / SNAPSHOT_NAME).write_bytes(b"".join(map(frame, snapshot_records)))
        (damaged / LOG_NAME).write_bytes(b"".join(map(frame, log_records)))
        restored = MasterCore(CONFIG)
        damaged_store = StateStore(damaged, fsync="never")
        try:
            damaged_store.load(restored, 100.0)
            restored.tick(101.0)
            restored.tick(200.0)   # past the grace: restored segments and clients dropped
        finally:
            damaged_store.close()


def test_compaction_writes_a_snapshot_and_restarts_the_log(tmp_path: Path) -> None:
    store, core = fresh_store(tmp_path, compact_log_bytes=500)
    populate(store, core)
    assert store.log_bytes > 500
    assert store.maybe_compact(core) is True
    assert store.maybe_compact(core) is False
    assert (tmp_path / SNAPSHOT_NAME).exists()
    assert store.log_bytes < 100
    # Changes after the snapshot go to the new log and apply on top of it.
    core.remove([ObjectKey(b"obj-0")], False, 3.0)
    core.unmount_segment(B, SegmentId("seg-b"), 3.0)
    sync(store, core)
    expected = readable(core, 4.0)
    store.close()
    restored = MasterCore(CONFIG)
    report = StateStore(tmp_path).load(restored, 100.0)
    assert report.generation == 1 and report.num_log_records == 1
    assert report.num_segments == 1
    come_back(restored, 101.0, SEG_A)
    assert readable(restored, 102.0) == expected


def test_a_crash_between_snapshot_and_new_log_keeps_the_snapshot(tmp_path: Path) -> None:
    store, core = fresh_store(tmp_path)
    populate(store, core)
    old_log = (tmp_path / LOG_NAME).read_bytes()
    store.compact(core)
    store.close()
    (tmp_path / LOG_NAME).write_bytes(old_log)   # as if the crash hit before the log swap
    restored = MasterCore(CONFIG)
    report = StateStore(tmp_path).load(restored, 100.0)
    assert report.num_log_records == 0 and report.num_objects == 20


def test_a_restore_tells_its_progress_as_it_reads_the_snapshot(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    store, core = fresh_store(tmp_path)
    populate(store, core)
    store.compact(core)
    store.close()
    read: list[int] = []
    report = StateStore(tmp_path).load(MasterCore(CONFIG), 100.0, read.append)
    assert read and sum(read) == report.num_objects == 20
    # the master logs it (every few seconds; here every call)
    progress = _RestoreProgress(time.perf_counter(), 0.0)
    with caplog.at_level(logging.INFO, logger="kvpool.master"):
        progress(2048)
        progress(2048)
    assert [r.getMessage().split(" in ")[0] for r in caplog.records] == [
        "restoring: 2048 objects of the snapshot read",
        "restoring: 4096 objects of the snapshot read"]


def test_corrupt_snapshot_is_set_aside_and_the_log_still_applies(tmp_path: Path) -> None:
    store, core = fresh_store(tmp_path)
    populate(store, core)
    store.compact(core)
    core.register_client(ClientId("late"), "h3", b"c" * 32, 5.0)
    sync(store, core)
    store.close()
    (tmp_path / SNAPSHOT_NAME).write_bytes(b"not a snapshot at all")
    restored = MasterCore(CONFIG)
    report = StateStore(tmp_path).load(restored, 100.0)
    assert (tmp_path / (SNAPSHOT_NAME + ".corrupt")).exists()
    assert report.num_clients == 1 and report.num_objects == 0
    assert any("moved to" in w for w in report.warnings)


def test_pending_and_leases_are_not_persisted(tmp_path: Path) -> None:
    store, core = fresh_store(tmp_path)
    populate(store, core)
    core.get_replicas([ObjectKey(b"obj-1")], 5.0)
    store.close()
    restored = MasterCore(CONFIG)
    StateStore(tmp_path).load(restored, 6.0)
    come_back(restored, 6.0, SEG_A, SEG_B)
    assert restored.stats().num_pending == 0
    assert restored.remove([ObjectKey(b"obj-1")], False, 6.5) == [Status.OK]   # no lease
    assert restored.remove([ObjectKey(b"pending")], False, 6.5) == [Status.NOT_FOUND]


def test_a_compaction_waits_for_a_log_of_its_share_of_the_snapshot(tmp_path: Path) -> None:
    store, core = fresh_store(tmp_path, compact_log_bytes=500, compact_log_ratio=2.0)
    populate(store, core)
    assert store.maybe_compact(core) is True      # no snapshot yet: the size alone decides
    snapshot_bytes = (tmp_path / SNAPSHOT_NAME).stat().st_size
    assert store.compact_at_log_bytes == 2 * snapshot_bytes > 500
    churned = 0
    while store.log_bytes < 2 * snapshot_bytes and churned < 10_000:
        assert store.maybe_compact(core) is False  # past 500 bytes, not yet twice the snapshot
        key = ObjectKey(b"churn-%d" % churned)
        core.put_start(A, [key], [64], PutOptions(), 2.0)
        core.put_end(A, [key], 2.0)
        core.remove([key], False, 2.0)
        sync(store, core)
        churned += 1
    assert store.log_bytes > 500 and store.maybe_compact(core) is True
    store.close()
    # a store opened again knows the size of the snapshot its log applies to
    reopened = StateStore(tmp_path, compact_log_bytes=500, compact_log_ratio=2.0)
    reopened.load(MasterCore(CONFIG), 3.0)
    assert reopened.compact_at_log_bytes == 2 * (tmp_path / SNAPSHOT_NAME).stat().st_size
    reopened.close()


def test_bad_settings_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="fsync"):
        StateStore(tmp_path, fsync="sometimes")
    with pytest.raises(ValueError):
        StateStore(tmp_path, compact_log_bytes=0)
    with pytest.raises(ValueError):
        StateStore(tmp_path, compact_log_ratio=-0.5)
    store = StateStore(tmp_path)
    with pytest.raises(RuntimeError):
        store.append([])


@pytest.mark.parametrize("policy", ["always", "batch", "never"])
def test_every_fsync_policy_round_trips(tmp_path: Path, policy: str) -> None:
    store = StateStore(tmp_path, fsync=policy, fsync_interval_s=0.0)
    core = MasterCore(CONFIG)
    store.load(core, 0.0)
    populate(store, core)
    store.flush()
    store.close()
    store.close()
    assert StateStore(tmp_path).load(MasterCore(CONFIG), 1.0).num_objects == 20


def power_cut(store: StateStore, source: Path, target: Path) -> None:
    """Copy the state directory as a power cut would leave it: the log cut back to the bytes
    that were fsynced."""
    target.mkdir()
    for path in source.iterdir():
        data = path.read_bytes()
        if path.name == LOG_NAME:
            data = data[:store.synced_log_bytes]
        (target / path.name).write_bytes(data)


@pytest.mark.parametrize("policy", ["batch", "always"])
def test_a_freed_extent_is_handed_out_only_once_its_removal_is_synced(tmp_path: Path,
                                                                     policy: str) -> None:
    """remove "old", put "new" on the same bytes, cut the power: "old" never comes back
    pointing at the bytes "new" was told to write."""
    store = StateStore(tmp_path / "live", fsync=policy, fsync_interval_s=3600.0)
    core = MasterCore(CONFIG)
    store.load(core, 0.0)
    core.register_client(A, "h1", KEY_A, 0.0)
    core.mount_segment(SEG_A, 0.0)
    old, new = ObjectKey(b"old"), ObjectKey(b"new")
    [(_, [extent])] = core.put_start(A, [old], [4096], PutOptions(), 1.0)
    core.put_end(A, [old], 1.0)
    assert store.record(core, core.take_events())
    store.flush(core)
    assert core.remove([old], False, 2.0) == [Status.OK]
    assert store.record(core, core.take_events())
    [(status, [placement])] = core.put_start(A, [new], [4096], PutOptions(), 2.0)
    assert status == Status.OK and placement.offset == extent.offset   # the same bytes
    assert store.record(core, core.take_events())   # the answer may go out: synced first
    power_cut(store, tmp_path / "live", tmp_path / "after")
    restored = MasterCore(CONFIG)
    StateStore(tmp_path / "after").load(restored, 10.0)
    assert restored.register_client(A, "h1", b"new-key-ignored!", 11.0,
                                    client_token(KEY_A)) == (Status.OK, KEY_A)
    assert restored.mount_segment(SEG_A, 11.0) == Status.OK
    assert restored.get_replicas([old], 11.0)[0].status == Status.NOT_FOUND


def test_frees_do_not_wait_without_a_reuse_and_batch_syncs_once_per_reuse(
        tmp_path: Path) -> None:
    store = StateStore(tmp_path, fsync="batch", fsync_interval_s=3600.0)
    core = MasterCore(CONFIG)
    store.load(core, 0.0)
    core.register_client(A, "h1", KEY_A, 0.0)
    core.mount_segment(SEG_A, 0.0)
    keys = [ObjectKey(b"k%d" % i) for i in range(4)]
    core.put_start(A, keys, [4096] * 4, PutOptions(), 1.0)
    core.put_end(A, keys, 1.0)
    store.record(core, core.take_events())
    synced = store.synced_log_bytes
    core.remove(keys[:2], False, 2.0)
    store.record(core, core.take_events())
    assert store.synced_log_bytes == synced   # nothing reused yet: no fsync
    core.put_start(A, [ObjectKey(b"x")], [4096], PutOptions(), 2.0)
    events = core.take_events()
    assert type(events[-1]).__name__ == "SyncRequired"
    store.record(core, events)
    assert store.synced_log_bytes == store.log_bytes
    core.put_start(A, [ObjectKey(b"y")], [4096], PutOptions(), 2.0)   # durable already
    assert core.take_events() == []


def test_a_failed_append_makes_the_store_read_only_until_a_snapshot(tmp_path: Path) -> None:
    store, core = fresh_store(tmp_path)
    populate(store, core)
    size = store.log_bytes
    store._fd, real_fd = os.open(os.devnull, os.O_RDONLY), store._fd   # writes now fail
    core.remove([ObjectKey(b"obj-0")], False, 2.0)
    assert store.record(core, core.take_events()) is True   # no placement in this answer
    assert not store.healthy and store.failure
    os.close(store._fd)
    store._fd = real_fd
    core.remove([ObjectKey(b"obj-1")], False, 2.0)
    store.record(core, core.take_events())   # read-only: not appended after the hole
    assert os.path.getsize(tmp_path / LOG_NAME) == size
    with pytest.raises(OSError):
        store.append([])
    store.compact(core)
    assert store.healthy
    store.close()
    restored = MasterCore(CONFIG)
    StateStore(tmp_path).load(restored, 10.0)
    come_back(restored, 11.0, SEG_A, SEG_B)
    assert {ObjectKey(b"obj-0"), ObjectKey(b"obj-1")}.isdisjoint(readable(restored, 11.0))


def test_log_replay_drops_replicas_unmounted_after_their_commit_only() -> None:
    # "old" was committed on s before s was unmounted: gone. "new" was committed on s after it
    # came back (fresh memory): kept. "both" keeps its replica on t. Replay is one pass.
    seg_s = SegmentInfo(SegmentId("s"), A, 1 << 20)
    seg_t = SegmentInfo(SegmentId("t"), A, 1 << 20)
    overlay = Overlay({}, {})

    def commit(key: bytes, *placements: Placement) -> list[Any]:
        row = event_row(ObjectCommitted(ObjectKey(key), 64, placements, 0, Pin.NONE, None))
        assert row is not None
        return row

    overlay.apply([event_row(SegmentMounted(seg_s)), event_row(SegmentMounted(seg_t)),
                   commit(b"old", Placement(SegmentId("s"), 0, 64)),
                   commit(b"both", Placement(SegmentId("s"), 64, 64),
                          Placement(SegmentId("t"), 0, 64)),
                   event_row(SegmentUnmounted(SegmentId("s"), A)),
                   event_row(SegmentMounted(seg_s)),
                   commit(b"new", Placement(SegmentId("s"), 0, 64))])
    rows = {row[0]: row[2] for row in as_rows(overlay.objects(iter([])))}
    assert rows == {b"both": ["t", 0, 64], b"new": ["s", 0, 64]}


def as_rows(items: Any) -> list[Any]:
    """What an overlay gives, chunks of columns as their rows."""
    return [row for item in items
            for row in (item.rows() if isinstance(item, ObjectColumns) else [item])]


@pytest.mark.parametrize("mask", [(1 << 24) - 1, 63], ids=["as built", "crowded bitmap"])
def test_the_filter_of_logged_keys_marks_exactly_the_logged_keys(
        mask: int, monkeypatch: pytest.MonkeyPatch) -> None:
    # with a 64-bit bitmap almost every key passes it, and the lookup alone decides
    from kvpool_master import statefile
    monkeypatch.setattr(statefile._KeyFilter, "_MASK", mask)
    logged = {b"k%d" % i: None for i in range(0, 3000, 3)}
    keys = [b"k%d" % i for i in range(2000, 6000)]
    marks = statefile._KeyFilter(logged).marks(keys)
    assert marks == [key in logged for key in keys]
    assert statefile._KeyFilter(logged).marks([b"x", b"y"]) is None
    assert statefile._KeyFilter({}).marks(keys) is None


def test_the_log_s_objects_restore_as_columns_where_they_can() -> None:
    """Runs of logged objects with one replica come out as chunks of columns, any other row as
    it is, in the log's order; a chunk with a row no column holds stays rows (restore checks
    and counts them one at a time). Every key is a copy, so the decoded log can go."""
    overlay = Overlay({}, {})

    def commit(key: bytes, *placements: Placement, parent: bytes | None = None) -> list[Any]:
        row = event_row(ObjectCommitted(ObjectKey(key), 64, placements, 7, Pin.NONE,
                                        ObjectKey(parent) if parent else None))
        assert row is not None
        return row

    one = [commit(b"a", Placement(SegmentId("s"), 0, 64)),
           commit(b"b", Placement(SegmentId("s"), 64, 64), parent=b"a"),
           commit(b"c", Placement(SegmentId("t"), 0, 64), parent=b"elsewhere")]
    two = commit(b"d", Placement(SegmentId("s"), 128, 64), Placement(SegmentId("t"), 64, 64))
    bad = commit(b"e", Placement(SegmentId("s"), 192, 64))
    bad[4] = -1   # a checksum no machine word holds
    decoded = {row[1]: row[1] for row in (*one, two)}   # the keys as the log decoded them
    overlay.apply([*one, two, bad, commit(b"f", Placement(SegmentId("s"), 256, 64))])
    items = list(overlay.objects(iter([])))
    assert [type(item) for item in items] == [ObjectColumns, list, list, list]
    assert as_rows(items) == [row[1:] for row in (*one, two, bad)] + [
        [b"f", 64, ["s", 256, 64], 7, 0, None]]
    first = items[0]
    assert first.parents.tolist() == [-1, 0, 3] and first.parent_keys == [b"elsewhere"]
    # a key no restore takes (a log written by something else) is passed on, not copied
    odd = commit(b"g", Placement(SegmentId("s"), 320, 64))
    odd[1] = "g"
    overlay.apply([odd])
    assert as_rows(overlay.objects(iter([])))[-1] == ["g", 64, ["s", 320, 64], 7, 0, None]
    assert all(key == decoded[key] and key is not decoded[key] for key in first.keys)
    assert items[1][0] == b"d" and items[1][0] is not decoded[b"d"]   # a row's key too


def _restores(path: Path, expected: dict[bytes, tuple], generation: int,  # type: ignore[type-arg]
              *segments: SegmentInfo) -> None:
    """A fresh master restored from ``path`` is at ``generation`` and, once ``segments`` are
    back, reads exactly ``expected``."""
    restored = MasterCore(CONFIG)
    assert StateStore(path).load(restored, 100.0).generation == generation
    come_back(restored, 101.0, *segments)
    assert readable(restored, 102.0) == expected


def _steps(store: StateStore, core: MasterCore, count: int | None = None) -> None:
    """Run ``count`` steps of the background compaction (all of them with None), as the
    server does between requests (its fsync thread joined at each step, for determinism)."""
    for _ in range(count if count is not None else 100_000):
        stepped = store._stepped
        if stepped is not None and stepped.sync is not None:
            stepped.sync.join()
        if store.compact_step(core) is None:
            return
    assert count is not None, "the compaction never finished"


def _order(core: MasterCore) -> list[bytes]:
    return [entry.key for entry in core._objects.entries()]


def test_a_background_compaction_keeps_what_changed_while_it_was_written(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Written a few objects a step, with removals, commits, reads, an unmount and a new
    client between the steps (before and after the walk reached them): the fuzzy rows and the
    tail restore exactly the index at the swap, and what the new log holds after it."""
    import kvpool_master.persist as persist
    monkeypatch.setattr(persist, "_OBJECTS_PER_CHUNK", 3)
    store, core = fresh_store(tmp_path, compact_log_bytes=500, background=True)
    populate(store, core)
    assert store.maybe_compact(core) is False and store.compacting   # nothing waited for it
    assert not (tmp_path / SNAPSHOT_NAME).exists()
    _steps(store, core, 2)                                  # obj-0 .. obj-5 written
    order = _order(core)
    core.remove([ObjectKey(b"obj-0"), ObjectKey(b"obj-12")], False, 2.0)  # behind, ahead
    core.put_start(A, [ObjectKey(b"obj-19")], [999], PutOptions(preferred_segment="seg-a"), 2.0)
    core.put_end(A, [ObjectKey(b"obj-19")], 2.0, checksums=[99])
    sync(store, core)
    on_a = [e.key for e in core._objects.entries()
            if e.segment_id == "seg-a" and e.writer_id is None and not e.more]
    read = [on_a[-2], on_a[0]]                                # one ahead of the walk, one behind
    core.get_replicas(read, 2.0)                                        # reads: held back
    assert _order(core) == [k for k in order if k not in (b"obj-0", b"obj-12")] + [b"obj-19"]
    _steps(store, core, 2)
    core.unmount_segment(B, SegmentId("seg-b"), 2.0)
    core.register_client(ClientId("late"), "h3", b"c" * 32, 2.0)
    sync(store, core)
    _steps(store, core)
    assert (tmp_path / SNAPSHOT_NAME).exists() and store.log_bytes < 100
    assert not store.compacting and not core.settling
    assert _order(core)[-2:] == read                              # the reads moved, in order
    core.remove([ObjectKey(b"obj-2")], False, 3.0)                     # after the swap
    sync(store, core)
    expected = readable(core, 4.0)
    assert ObjectKey(b"obj-19") in expected and ObjectKey(b"obj-0") not in expected
    assert ObjectKey(b"obj-12") not in expected and ObjectKey(b"chain-1") in expected
    store.close()
    restored = MasterCore(CONFIG)
    report = StateStore(tmp_path).load(restored, 100.0)
    assert report.generation == 1 and report.num_clients == 3 and report.num_segments == 1
    come_back(restored, 101.0, SEG_A)
    assert readable(restored, 102.0) == expected


@pytest.mark.parametrize("background", [False, True])
@pytest.mark.parametrize("mounted_again", [False, True])
def test_a_snapshot_written_while_a_lost_segment_is_swept_keeps_only_the_replicas_left(
        tmp_path: Path, background: bool, mounted_again: bool) -> None:
    """OLD has replicas on seg-s and seg-t; seg-s is unmounted, and a snapshot is written
    while its sweep (a step at a time: the table is larger than one sweeps at once) has not
    reached OLD. Restored, OLD lives on seg-t only: not lost with seg-s, and never on seg-s
    again, where its bytes went to NEW once seg-s was mounted again over the same memory."""
    seg_s = SegmentInfo(SegmentId("seg-s"), A, 1 << 20, host_id="h1", shm_name="/kvp-s")
    seg_t = SegmentInfo(SegmentId("seg-t"), A, 2000 * 4096 + 8192, host_id="h1",
                        shm_name="/kvp-t")
    store, core = fresh_store(tmp_path, compact_log_bytes=1, background=background)
    core.defer_upkeep = True   # as the server runs it: sweeps in steps
    core.register_client(A, "h1", KEY_A, 0.0)
    core.mount_segment(seg_t, 0.0)
    filler = [ObjectKey(b"fill-%d" % i) for i in range(2000)]
    for i in range(0, 2000, 500):
        core.put_start(A, filler[i:i + 500], [4096] * 500, PutOptions(), 1.0)
        core.put_end(A, filler[i:i + 500], 1.0)
    core.mount_segment(seg_s, 1.0)
    old = ObjectKey(b"OLD")
    [(_, placed)] = core.put_start(A, [old], [8192], PutOptions(replica_num=2), 2.0)
    assert {p.segment_id for p in placed} == {"seg-s", "seg-t"}
    core.put_end(A, [old], 2.0)
    assert core.unmount_segment(A, SegmentId("seg-s"), 3.0) == Status.OK
    assert core.sweep_backlog_keys() > 0
    sync(store, core)
    if background:
        assert store.maybe_compact(core) is True or store.compacting
        _steps(store, core)
    else:
        store.compact(core)
    while core.sweeping:
        core.sweep(4.0)
    sync(store, core)
    if mounted_again:
        assert core.mount_segment(seg_s, 5.0) == Status.OK
        new = ObjectKey(b"NEW")
        [(_, (there,))] = core.put_start(A, [new], [8192],
                                         PutOptions(preferred_segment=SegmentId("seg-s")), 6.0)
        assert there in placed   # OLD's bytes on seg-s
        core.put_end(A, [new], 6.0)
        core.remove([new], False, 7.0)
        sync(store, core)
    store.close()
    restored = MasterCore(CONFIG)
    StateStore(tmp_path).load(restored, 100.0)
    assert restored.register_client(A, "h1", b"new-key-ignored!", 101.0,
                                    client_token(KEY_A)) == (Status.OK, KEY_A)
    for segment in (seg_t, *([seg_s] if mounted_again else [])):
        assert restored.mount_segment(segment, 101.0) == Status.OK
    [result] = restored.get_replicas([old], 102.0)
    assert result.status == Status.OK
    assert [p.segment_id for p in result.placements] == ["seg-t"]


def test_a_failed_background_compaction_leaves_the_old_snapshot_and_log(
        tmp_path: Path) -> None:
    """A write that fails part-way (a full disk) drops that compaction and its file, leaves
    the store healthy, and the next one starts afresh once the log has grown by
    ``compact_log_bytes`` again."""
    store, core = fresh_store(tmp_path, compact_log_bytes=500, background=True)
    populate(store, core)
    store.maybe_compact(core)
    stepped = store._stepped
    assert stepped is not None

    class Full:
        def __init__(self, file: Any) -> None:
            self.file = file

        def write(self, data: bytes) -> int:
            raise OSError(28, "No space left on device")

        def __getattr__(self, name: str) -> Any:
            return getattr(self.file, name)
    stepped.file = Full(stepped.file)  # type: ignore[assignment]
    assert store.compact_step(core) == 0.0
    assert not store.compacting and store.healthy
    assert not stepped.path.exists()                                   # its file is gone
    _steps(store, core)                                                # reads settle
    core.remove([ObjectKey(b"obj-3")], False, 2.0)
    sync(store, core)
    expected = readable(core, 4.0)
    _restores_copy(tmp_path, expected, 0, SEG_A, SEG_B)
    assert store.maybe_compact(core) is False and not store.compacting  # not at once
    grown = store.log_bytes
    for n in range(50):
        key = ObjectKey(b"more-%d" % n)
        core.put_start(A, [key], [64], PutOptions(preferred_segment="seg-a"), 2.0)
        core.put_end(A, [key], 2.0)
        sync(store, core)
        store.maybe_compact(core)
        assert store.compacting == (store.log_bytes >= grown + 500)
        if store.compacting:
            break
    assert store.compacting                                              # tried again
    expected = readable(core, 4.0)
    _steps(store, core)
    store.close()
    _restores(tmp_path, expected, 1, SEG_A, SEG_B)


def _restores_copy(path: Path, expected: dict[bytes, tuple],  # type: ignore[type-arg]
                   generation: int, *segments: SegmentInfo) -> None:
    """``_restores`` on a copy of the state directory as it is now (the store stays open)."""
    copy = path.parent / (path.name + "-copy")
    copy_as_killed(path, copy)
    _restores(copy, expected, generation, *segments)


def copy_as_killed(state: Path, copy: Path) -> None:
    """Copy the state directory as a kill now would leave it: a retired file the store's
    thread unlinks meanwhile is there or not, as a kill either side of the unlink finds it."""
    import shutil

    def copy_if_there(source: str, target: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            shutil.copy2(source, target)
    shutil.copytree(state, copy, copy_function=copy_if_there)


def test_an_explicit_compaction_abandons_a_background_one(tmp_path: Path) -> None:
    store, core = fresh_store(tmp_path, compact_log_bytes=500, background=True)
    populate(store, core)
    store.maybe_compact(core)
    assert store.compacting
    core.get_replicas([ObjectKey(b"obj-4")], 2.0)                      # held back
    core.remove([ObjectKey(b"obj-5")], False, 2.0)
    sync(store, core)
    store.compact(core)                                   # e.g. the way out of read-only
    assert not store.compacting and not core.settling
    assert _order(core)[-1] == b"obj-4"
    expected = readable(core, 4.0)
    store.close()
    _restores(tmp_path, expected, 1, SEG_A, SEG_B)


def test_a_background_compaction_copies_its_tail_in_steps_and_syncs_off_the_loop(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Changes logged while the tail is copied (a few bytes a step) and while its file is
    synced (in a thread) all land in the tail, whole records only; the swap waits for the
    sync."""
    import threading

    import kvpool_master.persist as persist
    monkeypatch.setattr(persist, "_TAIL_STEP_BYTES", 20)  # about a record
    store, core = fresh_store(tmp_path, compact_log_bytes=500, background=True)
    populate(store, core)
    store.maybe_compact(core)
    stepped = store._stepped
    assert stepped is not None
    while stepped.tail_offset < 0:                                     # the objects
        assert store.compact_step(core) == 0.0
    for n in range(5, 10):                                             # five records
        core.remove([ObjectKey(b"obj-%d" % n)], False, 2.0)
        sync(store, core)
    release = threading.Event()
    real_fsync = os.fsync

    def slow_fsync(fd: int) -> None:
        if threading.current_thread().name == "kvpool-snapshot-sync":
            release.wait(10)
        real_fsync(fd)
    monkeypatch.setattr(persist.os, "fsync", slow_fsync)
    steps = 0
    while stepped.sync is None:                                        # copied in steps
        assert store.compact_step(core) == 0.0
        steps += 1
    assert steps > 1 and stepped.copied > 0
    assert store.compact_step(core) == persist._SYNC_POLL_S            # waits for the sync
    core.remove([ObjectKey(b"obj-10")], False, 2.0)                    # a sixth, meanwhile
    sync(store, core)
    release.set()
    _steps(store, core)
    assert not store.compacting and store.log_bytes < 100
    expected = readable(core, 4.0)
    assert ObjectKey(b"obj-5") not in expected and ObjectKey(b"obj-10") not in expected
    store.close()
    restored = MasterCore(CONFIG)
    report = StateStore(tmp_path).load(restored, 100.0)
    assert report.generation == 1 and report.num_log_records == 6   # the tail's records
    come_back(restored, 101.0, SEG_A, SEG_B)
    assert readable(restored, 102.0) == expected


def test_whole_records_bytes_stops_before_a_torn_record() -> None:
    from kvpool_master.statefile import frame, whole_records_bytes
    whole = frame([1, 2]) + frame({"a": 1})
    assert whole_records_bytes(whole + frame([3])[:-1]) == len(whole)
    assert whole_records_bytes(whole[:5]) == 0


def test_the_files_a_compaction_replaces_are_unlinked_by_a_thread_and_leftovers_at_load(
        tmp_path: Path) -> None:
    """Replacing a big snapshot or log would free its blocks on the caller's thread; they keep
    a second name until a thread unlinks them, and a load removes any a crash left."""
    import threading
    store, core = fresh_store(tmp_path)
    populate(store, core)
    store.compact(core)
    first = os.stat(tmp_path / SNAPSHOT_NAME).st_ino
    core.remove([ObjectKey(b"obj-1")], False, 2.0)
    sync(store, core)
    store.compact(core)                                  # replaces snapshot and log again
    for thread in threading.enumerate():
        if thread.name == "kvpool-state-unlink":
            thread.join(10)
    assert sorted(p.name for p in tmp_path.iterdir()) == [LOG_NAME, SNAPSHOT_NAME]
    assert os.stat(tmp_path / SNAPSHOT_NAME).st_ino != first
    expected = readable(core, 4.0)
    store.close()
    (tmp_path / (SNAPSHOT_NAME + ".old")).write_bytes(b"left by a crash")
    (tmp_path / (LOG_NAME + ".old")).write_bytes(b"left by a crash")
    _restores(tmp_path, expected, 2, SEG_A, SEG_B)
    assert sorted(p.name for p in tmp_path.iterdir()) == [LOG_NAME, SNAPSHOT_NAME]


def test_a_background_compaction_whose_swap_fails_makes_the_store_read_only(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A swap that fails may leave the new snapshot beside the old log: the store turns
    read-only until a full snapshot succeeds, as after any failed write."""
    store, core = fresh_store(tmp_path, compact_log_bytes=500, background=True)
    populate(store, core)
    store.maybe_compact(core)
    real_install = store._install

    def failing(path: Path, generation: int) -> None:
        raise OSError(5, "Input/output error")
    monkeypatch.setattr(store, "_install", failing)
    _steps(store, core)
    assert not store.healthy and not store.compacting
    assert not (tmp_path / (SNAPSHOT_NAME + ".tmp")).exists()
    monkeypatch.setattr(store, "_install", real_install)
    store.compact(core)                                   # the way out of read-only
    assert store.healthy
    expected = readable(core, 4.0)
    store.close()
    _restores(tmp_path, expected, 1, SEG_A, SEG_B)


def test_a_master_killed_at_any_step_of_a_background_compaction_restores_what_it_answered(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The state directory as a kill would leave it after every step of a compaction (head,
    rows a few objects at a time, the tail copied a record at a time, the sync, the swap,
    the held-back reads settling), with a change logged before each step: each copy
    restores exactly what the master would have answered at that moment."""
    import shutil

    import kvpool_master.persist as persist
    monkeypatch.setattr(persist, "_OBJECTS_PER_CHUNK", 3)
    monkeypatch.setattr(persist, "_TAIL_STEP_BYTES", 20)
    state = tmp_path / "state"
    store, core = fresh_store(state, compact_log_bytes=500, background=True)
    populate(store, core)
    assert store.maybe_compact(core) is False and store.compacting
    phases: set[str] = set()
    for step in range(60):
        n = step // 2 % 18   # every step logs a change: the swap must carry the last ones
        if step % 2 == 0:
            core.remove([ObjectKey(b"obj-%d" % n)], True, 2.0 + step)   # read: forced
        else:
            key = ObjectKey(b"obj-%d" % n)
            core.put_start(A, [key], [100 + n], PutOptions(preferred_segment="seg-a"),
                           2.0 + step)
            core.put_end(A, [key], 2.0 + step, checksums=[n])
            core.get_replicas([ObjectKey(b"obj-%d" % (17 - n))], 2.0 + step)
        grown = store.log_bytes
        sync(store, core)
        assert store.log_bytes > grown
        expected = readable(core, 1000.0 + step)
        killed = tmp_path / f"killed-{step}"
        copy_as_killed(state, killed)
        restored = MasterCore(CONFIG)
        StateStore(killed).load(restored, 100.0)
        come_back(restored, 101.0, SEG_A, SEG_B)
        assert readable(restored, 102.0) == expected, f"after step {step}"
        shutil.rmtree(killed)
        stepped = store._stepped
        phases.add("none" if stepped is None else "rows" if stepped.tail_offset < 0
                   else "tail" if stepped.sync is None else "synced")
        if stepped is not None and stepped.sync is not None:
            stepped.sync.join()
        if store.compact_step(core) is None and not store.maybe_compact(core):
            pass
    assert phases == {"rows", "tail", "synced", "none"}
    store.close()


def _records(path: Path) -> list[Any]:
    data, offset, records = path.read_bytes(), 0, []
    while True:
        record, offset, problem = next_record(data, offset)
        if problem:
            return records
        records.append(record)


def test_a_snapshot_holds_objects_with_one_replica_as_columns_and_the_rest_as_rows(
        tmp_path: Path) -> None:
    store, core = fresh_store(tmp_path)
    populate(store, core)   # "chain-1" has two replicas, between runs of one-replica objects
    expected = readable(core, 2.0)   # reads every object, "chain-1" last
    core.get_replicas([ObjectKey(b"obj-3")], 2.0)
    store.compact(core)
    store.close()
    records = _records(tmp_path / SNAPSHOT_NAME)
    assert records[0]["version"] == SNAPSHOT_VERSION == 3
    chunks = records[3:-1]
    assert [("columns" in c) if isinstance(c, dict) else len(c) for c in chunks] == [
        True, 1, True]
    assert chunks[1][0][0] == b"chain-1"
    assert chunks[0]["columns"][0][:2] == [b"obj-0", b"obj-1"]
    assert chunks[2]["columns"][0] == [b"obj-3"]   # read last: the most recent
    _restores(tmp_path, expected, 1, SEG_A, SEG_B)


def test_a_version_1_snapshot_of_rows_still_restores(tmp_path: Path) -> None:
    store, core = fresh_store(tmp_path)
    populate(store, core)
    expected = readable(core, 2.0)
    snapshot = core.snapshot()
    store.close()
    with (tmp_path / SNAPSHOT_NAME).open("wb") as f:   # as a master before columns wrote it
        f.write(frame({"format": "kvpool-snapshot", "version": 1, "generation": 1}))
        f.write(frame([list(c) for c in snapshot.clients]))
        f.write(frame([list(s) for s in snapshot.segments]))
        rows = [list(r) for r in snapshot.objects]
        f.write(frame(rows[:7]) + frame(rows[7:]))
        f.write(frame({"end": True, "num_objects": len(rows)}))
    (tmp_path / LOG_NAME).unlink()
    _restores(tmp_path, expected, 1, SEG_A, SEG_B)


def test_a_log_over_a_chunk_of_columns_drops_what_it_touched_and_keeps_parents() -> None:
    """The log's changes apply to a chunk of columns without taking it row by row, unless a
    segment of the chunk was unmounted: a removed or recommitted object leaves the chunk, and
    a child of a removed object names its parent by key from then on."""
    rows: list[list[Any]] = [[b"p", 64, ["s", 0, 64], 1, 0, None],
                             [b"c", 64, ["s", 4096, 64], 2, 0, b"p"],
                             [b"again", 64, ["s", 8192, 64], 3, 0, b"c"],
                             [b"other", 64, ["t", 0, 64], 4, 0, None]]
    seg_t = SegmentInfo(SegmentId("t"), A, 1 << 20)
    overlay = Overlay({}, {})
    overlay.apply([event_row(ObjectRemoved(ObjectKey(b"p"), 64, "remove")),
                   event_row(ObjectCommitted(ObjectKey(b"again"), 64,
                                             (Placement(SegmentId("s"), 12288, 64),), 5,
                                             Pin.NONE, None))])
    [kept, again] = list(overlay.objects(iter([columns_of_rows(rows)])))
    assert isinstance(kept, ObjectColumns)
    assert kept.rows() == [rows[1], rows[3]] and kept.parent_keys == [b"p"]
    assert as_rows([again]) == [[b"again", 64, ["s", 12288, 64], 5, 0, None]]
    overlay.apply([event_row(SegmentUnmounted(SegmentId("t"), A)),
                   event_row(SegmentMounted(seg_t))])
    assert as_rows(overlay.objects(iter([columns_of_rows(rows)]))) == [
        rows[1], [b"again", 64, ["s", 12288, 64], 5, 0, None]]
