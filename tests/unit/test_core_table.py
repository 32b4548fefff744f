"""The object table's own structures against an ``OrderedDict`` model: the sharded key index,
the recency list (appends, touches, removals, walks), the DRAM order and the child counts.

The property runs derandomized (the same examples every run, so it cannot fail by chance).
"""

from __future__ import annotations

from collections import OrderedDict

from hypothesis import example, given, settings
from hypothesis import strategies as st

from kvpool_master.core.objects import NUM_SHARDS, ObjectEntry, ObjectTable
from kvpool_wire.types import ClientId, ObjectKey, Pin, SegmentId

KEYS = [ObjectKey(b"k%d" % i) for i in range(5)]
WRITER = ClientId("w")

OPS = st.lists(st.tuples(st.sampled_from(["put", "commit", "touch", "pop", "dram_start",
                                          "dram_add", "dram_remove", "read"]),
                         st.sampled_from(KEYS), st.sampled_from([None, *KEYS[:3]])),
               max_size=80)


class Model:
    def __init__(self) -> None:
        self.order: OrderedDict[ObjectKey, tuple[bool, ObjectKey | None]] = OrderedDict()
        self.dram: OrderedDict[ObjectKey, None] | None = None
        self.pending: dict[ObjectKey, None] = {}  # by start

    def children(self) -> dict[ObjectKey, int]:
        counts: dict[ObjectKey, int] = {}
        for ready, parent in self.order.values():
            if ready and parent is not None:
                counts[parent] = counts.get(parent, 0) + 1
        return counts


def check(table: ObjectTable, model: Model) -> None:
    assert [e.key for e in table.entries()] == list(model.order)
    assert len(table) == len(model.order)
    for key in KEYS:
        entry = table.get(key)
        assert (entry is not None) == (key in model.order) == (key in table)
        if entry is not None:
            assert entry.key == key and (entry.writer_id is None) == model.order[key][0]
    assert list(table.pending_key_to_started_s) == list(model.pending)
    assert table.ready_bytes == sum(ready for ready, _ in model.order.values())
    for key in KEYS:
        assert table.num_children(key) == model.children().get(key, 0)
    if model.dram is None:
        assert table.dram_order is None
    else:
        assert table.dram_order is not None
        assert [e.key for e in table.dram_order.entries()] == list(model.dram)
        assert len(table.dram_order) == len(model.dram)


@settings(max_examples=500, derandomize=True, deadline=None)
@given(OPS)
@example([("dram_start", KEYS[4], None), ("put", KEYS[0], None), ("put", KEYS[1], None),
          ("commit", KEYS[0], None)])  # a commit is recent in the DRAM order too
def test_the_table_keeps_the_order_a_model_ordered_dict_keeps(ops: list[tuple[str, ObjectKey,
                                                                              ObjectKey | None]]
                                                              ) -> None:
    table = ObjectTable(track_children=True)
    model = Model()
    for name, key, parent in ops:
        entry = table.get(key)
        if name == "put" and entry is None:
            entry = ObjectEntry(key, 1, SegmentId("s"), 0, WRITER, Pin.NONE, parent)
            table.add_pending(key, entry, 0.0)
            model.order[key] = (False, parent)
            model.pending[key] = None
            if model.dram is not None:
                model.dram[key] = None
        elif name == "commit" and entry is not None and entry.writer_id is not None:
            table.commit(key, entry, 0)
            table.touch_all([entry])
            model.order[key] = (True, model.order[key][1])
            del model.pending[key]
            model.order.move_to_end(key)
            if model.dram is not None and key in model.dram:
                model.dram.move_to_end(key)
        elif name == "touch" and entry is not None:
            table.recency.touch_all([entry])
            model.order.move_to_end(key)
        elif name == "pop" and entry is not None:
            assert table.pop(key) is entry
            assert entry.older is None and entry.newer is None and entry.dram is None
            del model.order[key]
            model.pending.pop(key, None)
            if model.dram is not None:
                model.dram.pop(key, None)
        elif name == "dram_start" and model.dram is None:
            in_dram = [e for e in table.entries() if e.key != key]  # one of them not in DRAM
            table.start_dram_order(in_dram)
            model.dram = OrderedDict((e.key, None) for e in in_dram)
        elif name == "dram_add" and entry is not None and model.dram is not None:
            table.dram_add(entry)
            model.dram.setdefault(key, None)
        elif name == "dram_remove" and entry is not None and model.dram is not None:
            table.dram_remove(entry)
            model.dram.pop(key, None)
        elif name == "read" and entry is not None:
            table.touch_all([entry])
            model.order.move_to_end(key)
            if model.dram is not None and key in model.dram:
                model.dram.move_to_end(key)
        check(table, model)


def test_a_walk_may_drop_the_entry_it_holds() -> None:
    table = ObjectTable(track_children=False)
    for key in KEYS:
        table.add_ready(key, ObjectEntry(key, 1, SegmentId("s"), 0, None, Pin.NONE, None))
    table.start_dram_order(list(table.entries()))
    seen = []
    for entry in table.entries():
        seen.append(entry.key)
        if entry.key in KEYS[::2]:
            table.pop(entry.key)
    assert seen == KEYS
    assert [e.key for e in table.entries()] == KEYS[1::2]
    assert [e.key for e in table.dram_order.entries()] == KEYS[1::2]  # type: ignore[union-attr]


def test_many_keys_spread_over_every_shard_and_come_back_in_order() -> None:
    table = ObjectTable(track_children=False)
    keys = [ObjectKey(b"key-%d" % i) for i in range(20 * NUM_SHARDS)]
    for key in keys:
        table.add_ready(key, ObjectEntry(key, 1, SegmentId("s"), 0, None, Pin.NONE, None))
    assert all(len(shard) > 0 for shard in table.shards)
    assert max(len(shard) for shard in table.shards) < 20 * 4
    for key in keys[::3]:
        table.recency.touch_all([table.get(key)])  # type: ignore[list-item]
    expected = [k for i, k in enumerate(keys) if i % 3] + keys[::3]
    assert [e.key for e in table.entries()] == expected
    for key in keys[1::3]:
        table.pop(key)
    assert [e.key for e in table.entries()] == [k for k in expected if k not in set(keys[1::3])]
    assert len(table) == sum(len(shard) for shard in table.shards)


def test_objects_that_leave_the_table_are_freed_without_the_cyclic_collector() -> None:
    """The recency links make cycles while an object is in the table; every way out of it
    breaks them, so reference counting frees the entry (the server freezes the collector's
    survivors, so a cycle left behind would never be freed)."""
    import gc

    from kvpool_master.core.master import CoreConfig, MasterCore
    from kvpool_wire.status import Status
    from kvpool_wire.types import PutOptions, SegmentId, SegmentInfo, Tier

    block = 4096
    core = MasterCore(CoreConfig(eviction_high_watermark_ratio=0.8, eviction_ratio=0.1,
                                 default_lease_ttl_s=0.5, client_ttl_s=1e9,
                                 put_start_discard_timeout_s=1e9, ssd_promote_after_hits=1))
    owner = ClientId("owner")
    core.register_client(owner, "h", b"k" * 32, 0.0)
    core.mount_segment(SegmentInfo(SegmentId("dram"), owner, 40 * block), 0.0)
    core.mount_segment(SegmentInfo(SegmentId("ssd"), owner, 60 * block, tier=Tier.SSD,
                                   file_path="/ssd/a"), 0.0)
    was_enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        # entries other tests left alive (this one's table is still empty)
        before = sum(type(o) is ObjectEntry for o in gc.get_objects())
        now = 1.0
        for i in range(400):
            now += 1.0
            key = ObjectKey(b"k%d" % i)
            [(status, _)] = core.put_start(owner, [key], [block], PutOptions(), now)
            if status == Status.OK:
                core.put_end(owner, [key], now, [i])
            core.get_replicas([ObjectKey(b"k%d" % (i // 2))], now)   # promotions
            if i % 7 == 0:
                core.remove([ObjectKey(b"k%d" % (i - 3))], True, now)
            if i % 5 == 0:
                core.tick(now)
                _, tasks = core.copy_tasks(owner, [], 64, now)
                core.copy_tasks(owner, [(t.task_id, 0) for t in tasks], 0, now)
        stats = core.stats()
        assert stats.demotions_done_total and stats.promotions_done_total \
            and stats.evicted_objects_total
        live = sum(type(o) is ObjectEntry for o in gc.get_objects()) - before
        assert live == len(core._objects) < 400
    finally:
        if was_enabled:
            gc.enable()


WALK_KEYS = [ObjectKey(b"w%d" % i) for i in range(12)]
WALK_OPS = st.lists(st.tuples(st.sampled_from(["put", "commit", "read", "pop", "step"]),
                              st.sampled_from(WALK_KEYS), st.integers(1, 4)),
                    max_size=60)


@settings(max_examples=500, derandomize=True, deadline=None)
@given(st.integers(0, 8), WALK_OPS)
def test_a_stepped_walk_visits_every_object_there_at_its_start_once_in_that_order(
        num_ready: int, ops: list[tuple[str, ObjectKey, int]]) -> None:
    """Between the steps of a walk objects come (PENDING, then committed), are read and
    go. The walk visits each object that was there at its start and is still there when its
    turn comes exactly once, in the order of the start, and nothing else; PENDING objects
    move at once, READY ones move afterwards (``settle``) in the order they were touched."""
    table = ObjectTable(track_children=False)
    model: list[ObjectKey] = []  # the recency order once every held-back move is made
    for key in WALK_KEYS[:num_ready]:
        table.add_ready(key, ObjectEntry(key, 1, SegmentId("s"), 0, None, Pin.NONE, None))
        model.append(key)
    at_start = list(table.entries())
    table.recency.start_walk()
    held: list[ObjectEntry] = []  # READY objects read during the walk
    visited: list[ObjectEntry] = []
    done = False
    for name, key, count in ops:
        entry = table.get(key)
        if name == "put" and entry is None:
            table.add_pending(key, ObjectEntry(key, 1, SegmentId("s"), 0, WRITER, Pin.NONE,
                                               None), 0.0)
            model.append(key)
        elif name == "commit" and entry is not None and entry.writer_id is not None:
            table.commit(key, entry, 0)
            table.touch_all([entry])
            held.append(entry)
        elif name == "read" and entry is not None:
            table.touch_all([entry])
            if entry.writer_id is None:
                held.append(entry)
            else:
                model.remove(key)
                model.append(key)
        elif name == "pop" and entry is not None:
            table.pop(key)
            model.remove(key)
        elif name == "step" and not done:
            step = table.recency.walk(count)
            done = step is None
            visited += step or ()
        assert [e.key for e in table.entries()] == model   # moves of READY ones held back
    while not done:
        step = table.recency.walk(3)
        done = step is None
        visited += step or ()
    assert len(set(map(id, visited))) == len(visited)
    assert visited == [e for e in at_start if e in visited]   # in order, none new
    assert all(e in visited for e in at_start if table.get(e.key) is e)
    while table.recency.settle(2):
        pass
    assert not table.recency.walking
    for entry in held:
        if table.get(entry.key) is entry:  # not gone (nor put again) since
            model.remove(entry.key)
            model.append(entry.key)
    assert [e.key for e in table.entries()] == model and len(table) == len(model)
