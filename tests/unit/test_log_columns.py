"""The state log's rows of columns: what a master logs in runs, replayed, is the index it had."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
from helpers import KEY_A, KEY_B, A, B, come_back, each_commit

from kvpool_master.core.events import (
    ObjectCommitted,
    ObjectsCommitted,
    SegmentMounted,
    SegmentUnmounted,
)
from kvpool_master.core.master import CoreConfig, MasterCore
from kvpool_master.core.snapshot import ObjectColumns
from kvpool_master.persist import LOG_NAME, SNAPSHOT_NAME, StateStore
from kvpool_master.statefile import (
    Overlay,
    event_row,
    frame,
    log_rows,
    next_record,
    read_snapshot_tail,
)
from kvpool_wire.status import Status
from kvpool_wire.types import (
    ObjectKey,
    Pin,
    Placement,
    PutOptions,
    SegmentId,
    SegmentInfo,
)

SEG_A = SegmentInfo(SegmentId("seg-a"), A, 8 << 20, host_id="h1", shm_name="/kvp-a")
SEG_B = SegmentInfo(SegmentId("seg-b"), B, 8 << 20, host_id="h2", tcp_endpoint="10.0.0.2:1")
CONFIG = CoreConfig(client_ttl_s=1e9)


def started(path: Path, **kwargs: Any) -> tuple[StateStore, MasterCore]:
    store = StateStore(path, fsync="never", restore_grace_s=1e6, **kwargs)
    core = MasterCore(CONFIG)
    store.load(core, 0.0)
    core.register_client(A, "h1", KEY_A, 0.0)
    core.register_client(B, "h2", KEY_B, 0.0)
    core.mount_segment(SEG_A, 0.0)
    core.mount_segment(SEG_B, 0.0)
    store.append(core.take_events())
    return store, core


def put(core: MasterCore, keys: list[bytes], now: float, replicas: int = 1,
        parents: list[bytes | None] | None = None, pin: Pin = Pin.NONE) -> None:
    object_keys = [ObjectKey(k) for k in keys]
    answers = core.put_start(A, object_keys, [64 + 4096 * (len(k) % 3) for k in keys],
                             PutOptions(replica_num=replicas, pin=pin), now,
                             parent_keys=None if parents is None else [
                                 ObjectKey(p) if p else None for p in parents])
    assert all(status == Status.OK for status, _ in answers)
    core.put_end(A, object_keys, now, checksums=[len(k) * 7919 for k in keys])


def index(core: MasterCore) -> list[list[Any]]:
    """Every READY object's row, in LRU order."""
    return [list(row) for item in core.snapshot().objects
            for row in (item.rows() if isinstance(item, ObjectColumns) else [item])]


def restored(path: Path) -> MasterCore:
    core = MasterCore(CONFIG)
    StateStore(path).load(core, 10.0)
    come_back(core, 10.0, SEG_A, SEG_B)
    return core


def log_payloads(path: Path) -> list[Any]:
    data, offset, payloads = path.read_bytes(), 0, []
    while offset < len(data):
        payload, offset, problem = next_record(data, offset)
        assert not problem
        payloads.append(payload)
    return payloads


def test_runs_of_commits_and_removals_are_logged_as_rows_of_columns(tmp_path: Path) -> None:
    """A run of 16 or more commits with one replica is one row of columns, as is a run of
    removals; shorter runs, objects with two replicas and everything else stay rows; the
    order of the log is kept, and the log restores every field."""
    store, core = started(tmp_path)
    chain = [b"c%02d" % i for i in range(20)]
    put(core, chain, 1.0, parents=[b"elsewhere", *chain[:-1]], pin=Pin.SOFT)
    put(core, [b"two"], 1.0, replicas=2)
    put(core, [b"short-%d" % i for i in range(15)], 1.0)
    core.remove([ObjectKey(k) for k in chain[:16]], False, 2.0)
    put(core, [b"between"], 2.0)
    core.remove([ObjectKey(b"short-0")], False, 2.0)
    events = core.take_events()
    assert isinstance(events[0], ObjectsCommitted)   # the chain's commit, as columns
    each = each_commit(events)
    rows = log_rows(events)
    assert rows == log_rows(each)   # a batch commit logs as its objects' commits would
    assert [row[0] for row in rows] == [7, 5] + [5] * 15 + [8, 5, 6]
    assert rows[0][1] == chain and rows[17] == [8, chain[:16]]
    assert rows[1:17] == [event_row(e) for e in each[20:36]]
    store.append(events)
    store.close()
    [header, _, record] = log_payloads(tmp_path / LOG_NAME)   # (_: the clients, segments)
    assert header["version"] == 2 and record == rows
    assert index(restored(tmp_path)) == index(core)


def test_a_log_of_rows_of_version_1_still_restores(tmp_path: Path) -> None:
    store, core = started(tmp_path)
    put(core, [b"k%d" % i for i in range(40)], 1.0, parents=[None] + [b"k0"] * 39)
    core.remove([ObjectKey(b"k%d" % i) for i in range(20)], False, 2.0)
    rows = [row for row in map(event_row, each_commit(core.take_events())) if row is not None]
    store.close()
    path = tmp_path / LOG_NAME
    header, clients_and_segments = log_payloads(path)
    with path.open("wb") as f:
        f.write(frame({**header, "version": 1}) + frame(clients_and_segments) + frame(rows))
    assert len(index(core)) == 20 and index(restored(tmp_path)) == index(core)


@pytest.mark.parametrize("row", [
    [7], [7, [b"k"]], [7, *([None] * 9)], [8], [8, b"k"], [8, [b"k", ["unhashable"]]],
    [8, [b"k", "str"]], [5, ["unhashable"], 64, ["seg-a", 0, 64], 1, 0, None],
], ids=repr)
def test_a_malformed_row_of_columns_changes_nothing(row: list[Any]) -> None:
    overlay = Overlay({}, {})
    overlay.apply([row])
    assert overlay.latest == {}
    assert list(overlay.objects(iter([[b"kept", 64, ["seg-a", 0, 64], 1, 0, None]]))) == [
        [b"kept", 64, ["seg-a", 0, 64], 1, 0, None]]


@pytest.mark.parametrize("seed", range(10))
def test_any_history_logged_and_compacted_in_steps_restores_the_index_it_built(
        tmp_path: Path, seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Random batches of puts (1 to 200 keys, chained, some with two replicas, keys removed
    before put again), removals, a segment lost and mounted again, background compactions
    stepped between them (whose tails hold rows of columns) or none, a master stopped at any
    point, also while a lost segment's objects are swept: the state directory restores
    exactly the live index, in LRU order."""
    import kvpool_master.statefile as statefile
    monkeypatch.setattr(statefile, "RESTORE_CHUNK", 64)   # the log's chunks joined and cut
    rng = random.Random(seed)
    store, core = started(tmp_path, compact_log_bytes=20_000 if seed % 2 else 1 << 30,
                          compact_log_ratio=0.5, background=True)
    live: list[bytes] = []
    dead: list[bytes] = []
    fresh = iter(b"key-%d-%d" % (seed, i) for i in range(1 << 20))
    for step in range(60):
        now = 1.0 + step
        choice = rng.random()
        if choice < 0.55:
            size = rng.choice([1, 3, 15, 16, 17, 40, 200])
            again = rng.sample(dead, min(len(dead), 3))   # removed or lost before
            dead = [k for k in dead if k not in again]
            keys = [*again, *(next(fresh) for _ in range(size))]
            parents = [rng.choice([None, *live[-3:], *keys[:i][-1:]]) for i in range(len(keys))]
            put(core, keys, now, replicas=1 if rng.random() < 0.85 else 2, parents=parents,
                pin=rng.choice(list(Pin)))
            live += keys
        elif choice < 0.85 and live:
            gone = set(rng.sample(live, min(len(live), rng.choice([1, 5, 16, 30]))))
            core.remove([ObjectKey(k) for k in gone], False, now)
            live = [k for k in live if k not in gone]
            dead += gone
        else:
            core.unmount_segment(B, SEG_B.segment_id, now)
            while core.upkeep(now):
                pass
            assert core.mount_segment(SEG_B, now) == Status.OK
            kept = {row[0] for row in index(core)}
            dead += [k for k in live if k not in kept]
            live = [k for k in live if k in kept]
        assert store.record(core, core.take_events())
        if store.compacting and rng.random() < 0.7:
            store.compact_step(core)
        if store._stepped is not None and store._stepped.sync is not None:
            store._stepped.sync.join()
    if rng.random() < 0.5:   # stopped with the segment lost, before its sweep is logged
        core.unmount_segment(B, SEG_B.segment_id, 100.0)
        assert store.record(core, core.take_events())
        while core.upkeep(100.0):
            pass
    expected = index(core)
    assert expected and not store.failure
    store.close()
    payloads = log_payloads(tmp_path / LOG_NAME)
    assert payloads[0]["version"] == 2
    assert index(restored(tmp_path)) == expected


def test_the_snapshot_tail_holds_the_log_s_rows_of_columns(tmp_path: Path) -> None:
    store, core = started(tmp_path, compact_log_bytes=1000, compact_log_ratio=0.01,
                          background=True)
    put(core, [b"before-%d" % i for i in range(100)], 1.0)
    assert store.record(core, core.take_events()) and store.compacting
    put(core, [b"during-%d" % i for i in range(100)], 2.0)
    core.remove([ObjectKey(b"before-%d" % i) for i in range(50)], False, 2.0)
    assert store.record(core, core.take_events())
    while store.compact_step(core) is not None:
        if store._stepped is not None and store._stepped.sync is not None:
            store._stepped.sync.join()
    assert not store.compacting
    store.close()
    with (tmp_path / SNAPSHOT_NAME).open("rb") as f:
        tail = read_snapshot_tail(f, [])
    assert [[b"during-%d" % i for i in range(100)], [b"before-%d" % i for i in range(50)]] == [
        row[1] for record in tail for row in record if row[0] in (7, 8)]
    assert index(restored(tmp_path)) == index(core)


def test_a_row_of_columns_loses_its_replicas_on_a_segment_unmounted_after_it_only() -> None:
    """As rows do: the objects of a run on a segment unmounted after it are gone (a master
    stopped before the sweep logged their removal), those on other segments and those
    committed after the segment came back are kept."""
    def run(prefix: bytes, *segments: str) -> list[Any]:
        events = [ObjectCommitted(ObjectKey(b"%s-%d" % (prefix, i)), 64,
                                  (Placement(SegmentId(segments[i % len(segments)]),
                                             4096 * i, 64),), i, Pin.NONE, None)
                  for i in range(16)]
        [row] = log_rows(events)
        assert row[0] == 7
        return row

    overlay = Overlay({}, {})
    overlay.apply([event_row(SegmentMounted(SEG_A)), event_row(SegmentMounted(SEG_B)),
                   run(b"old", "seg-a", "seg-b"),
                   event_row(SegmentUnmounted(SEG_A.segment_id, A)),
                   event_row(SegmentMounted(SEG_A)), run(b"new", "seg-a")])
    rows = [row for item in overlay.objects(iter([]))
            for row in (item.rows() if isinstance(item, ObjectColumns) else [item])]
    assert [row[0] for row in rows] == [b"old-%d" % i for i in range(1, 16, 2)] + [
        b"new-%d" % i for i in range(16)]
