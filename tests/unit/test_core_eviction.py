"""Eviction: exact LRU order, leases and pins respected, prefix-lru tails first, NO_SPACE only
when nothing is evictable."""

from __future__ import annotations

from kvpool_master.core.events import EvictionPass, ObjectRemoved
from kvpool_master.core.master import CoreConfig, MasterCore
from kvpool_wire.capability import client_token
from kvpool_wire.status import Status
from kvpool_wire.types import ClientId, ObjectKey, Pin, PutOptions, SegmentId, SegmentInfo, Tier

BLOCK = 4096
A = ClientId("writer")


def make(num_blocks: int = 10, high: float = 0.5, ratio: float = 0.2, policy: str = "lru",
         lease_ttl_s: float = 1.0, num_segments: int = 1) -> MasterCore:
    core = MasterCore(CoreConfig(eviction_high_watermark_ratio=high, eviction_ratio=ratio,
                                 eviction_policy=policy, default_lease_ttl_s=lease_ttl_s,
                                 client_ttl_s=1e9, put_start_discard_timeout_s=1e9))
    core.register_client(A, "h", b"k" * 32, 0.0)
    for i in range(num_segments):
        core.mount_segment(SegmentInfo(SegmentId(f"s{i}"), A, num_blocks * BLOCK), 0.0)
    core.take_events()
    return core


def put(core: MasterCore, name: str, now: float, parent: str = "",
        pin: Pin = Pin.NONE) -> Status:
    key = ObjectKey(name.encode())
    [(status, _)] = core.put_start(A, [key], [BLOCK], PutOptions(pin=pin), now,
                                   parent_keys=[ObjectKey(parent.encode())])
    if status == Status.OK:
        assert core.put_end(A, [key], now) == [Status.OK]
    return status


def evicted(core: MasterCore) -> list[str]:
    return [e.key.decode() for e in core.take_events()
            if isinstance(e, ObjectRemoved) and e.reason == "evict"]


def keys(*names: str) -> list[ObjectKey]:
    return [ObjectKey(n.encode()) for n in names]


def test_lru_order_is_commit_or_last_read() -> None:
    core = make()
    for i, name in enumerate(["b0", "b1", "b2", "b3", "b4"]):
        put(core, name, float(i))
    core.exist(keys("b0"), 5.0)
    core.get_replicas(keys("b2"), 5.5)
    core.take_events()
    # 6 of 10 blocks > 50 %: evict at least 20 % of capacity = 2 blocks, least recent first.
    assert put(core, "b5", 10.0) == Status.OK
    events = core.take_events()
    assert events[:3] == [ObjectRemoved(ObjectKey(b"b1"), BLOCK, "evict"),
                          ObjectRemoved(ObjectKey(b"b3"), BLOCK, "evict"),
                          EvictionPass(2, 2 * BLOCK)]
    assert put(core, "b6", 11.0) == Status.OK    # 5 of 10: not above
    assert evicted(core) == []
    assert put(core, "b7", 12.0) == Status.OK
    assert evicted(core) == ["b4", "b0"]
    assert core.exist(keys("b0", "b1", "b2", "b3", "b4", "b5", "b6", "b7"), 13.0)[0] == [
        Status.NOT_FOUND, Status.NOT_FOUND, Status.OK, Status.NOT_FOUND, Status.NOT_FOUND,
        Status.OK, Status.OK, Status.OK]


def test_query_prefix_touches_in_chain_order() -> None:
    core = make()
    for i, name in enumerate(["x", "c0", "c1", "c2", "y"]):
        put(core, name, float(i))
    assert core.query_prefix(keys("c0", "c1", "c2", "missing", "x"), 5.0) == 3
    put(core, "z", 10.0)
    assert evicted(core) == ["x", "y"]
    put(core, "w", 11.0)
    put(core, "v", 12.0)
    assert evicted(core) == ["c0", "c1"]


def test_leased_objects_are_skipped_until_the_lease_ends() -> None:
    core = make(lease_ttl_s=10.0)
    for i, name in enumerate(["b0", "b1", "b2", "b3", "b4"]):
        put(core, name, float(i))
    core.get_replicas(keys("b0", "b1", "b2", "b3"), 5.0)  # leased until 15
    put(core, "b5", 6.0)
    assert evicted(core) == ["b4"]  # the only un-leased READY object
    put(core, "b6", 16.0)
    assert evicted(core) == ["b0", "b1"]


def test_soft_pins_go_last_and_hard_pins_never() -> None:
    core = make()
    put(core, "hard", 0.0, pin=Pin.HARD)
    put(core, "soft", 1.0, pin=Pin.SOFT)
    put(core, "p0", 2.0)
    put(core, "p1", 3.0)
    put(core, "p2", 4.0)
    put(core, "p3", 5.0)     # 6 blocks > 50 %: p0, p1 evicted
    assert evicted(core) == ["p0", "p1"]
    put(core, "p4", 6.0)     # 5 blocks
    put(core, "p5", 7.0)     # 6 > 5: p2, p3
    assert evicted(core) == ["p2", "p3"]
    core.get_replicas(keys("p4", "p5"), 8.0)   # leased until 9
    put(core, "p6", 8.5)     # 5
    put(core, "p7", 8.6)     # 6: p6 is the only unpinned candidate, then the soft pin goes
    assert evicted(core) == ["p6", "soft"]
    stats = core.stats()
    assert stats.num_objects == 4 and stats.evicted_objects_total == 6
    assert core.exist(keys("hard"), 9.0)[0] == [Status.OK]


def test_allocation_failure_evicts_then_no_space_only_when_nothing_is_evictable() -> None:
    core = make(num_blocks=4, high=1.0, ratio=0.25)
    for i in range(4):
        assert put(core, f"b{i}", float(i)) == Status.OK
    assert evicted(core) == []   # 100 % is not above a 100 % watermark
    assert put(core, "b4", 5.0) == Status.OK
    assert evicted(core) == ["b0"]
    core.get_replicas(keys("b1", "b2", "b3", "b4"), 6.0)
    assert put(core, "b5", 6.5) == Status.NO_SPACE   # every READY object is leased
    assert evicted(core) == []
    assert core.stats().put_no_space_total == 1
    assert put(core, "b5", 7.0) == Status.OK        # leases ended at 7.0
    assert evicted(core) == ["b1"]


def test_pending_objects_are_never_evicted() -> None:
    core = make(num_blocks=2, high=1.0, ratio=0.5)
    started = core.put_start(A, keys("p0", "p1", "p2"), [BLOCK] * 3, PutOptions(), 1.0)
    assert [s for s, _ in started] == [Status.OK, Status.OK, Status.NO_SPACE]
    assert core.put_end(A, keys("p0", "p1"), 1.0) == [Status.OK, Status.OK]


def test_a_batch_evicts_as_it_goes() -> None:
    core = make(num_blocks=4, high=1.0, ratio=0.5)
    for i in range(4):
        put(core, f"old{i}", float(i))
    started = core.put_start(A, keys("n0", "n1", "n2", "n3", "n4"), [BLOCK] * 5, PutOptions(),
                             10.0)
    assert [s for s, _ in started] == [Status.OK] * 4 + [Status.NO_SPACE]
    assert evicted(core) == ["old0", "old1", "old2", "old3"]


def test_too_large_objects_evict_nothing() -> None:
    core = make(num_blocks=4, high=1.0)
    put(core, "b0", 0.0)
    [(status, _)] = core.put_start(A, keys("big"), [5 * BLOCK], PutOptions(), 1.0)
    assert status == Status.NO_SPACE
    assert evicted(core) == []
    [(status, _)] = core.put_start(A, keys("two"), [BLOCK], PutOptions(replica_num=2), 1.0)
    assert status == Status.NO_SPACE   # one segment cannot hold two replicas
    assert evicted(core) == []


def test_tick_runs_a_background_pass_once_leases_end() -> None:
    core = make(lease_ttl_s=10.0)
    for i in range(6):
        put(core, f"b{i}", float(i))
        core.exist(keys(f"b{i}"), float(i))      # every object leased while the pool fills
    assert evicted(core) == []
    core.tick(9.0)
    assert evicted(core) == []
    core.tick(12.0)   # b0 and b1 leases ended
    assert evicted(core) == ["b0", "b1"]
    assert core.stats().tier_to_used_bytes[0] == 4 * BLOCK


def test_prefix_lru_evicts_chains_tail_first() -> None:
    core = make(num_blocks=20, high=0.5, ratio=0.2, policy="prefix-lru")
    put(core, "a0", 0.0)
    put(core, "a1", 1.0, parent="a0")
    put(core, "a2", 2.0, parent="a1")
    put(core, "b0", 3.0)
    put(core, "b1", 4.0, parent="b0")
    put(core, "solo", 5.0)
    for i in range(4):
        put(core, f"f{i}", 6.0 + i)           # 10 blocks: at the watermark
    assert evicted(core) == []
    put(core, "g0", 20.0)                     # 11 > 10: evict 4 blocks
    assert evicted(core) == ["a2", "a1", "a0", "b1"]
    for i in range(1, 4):
        put(core, f"g{i}", 20.0 + i)          # 8, 9, 10 blocks
    assert evicted(core) == []
    put(core, "g4", 24.0)
    assert evicted(core) == ["b0", "solo", "f0", "f1"]


def test_prefix_lru_a_child_read_keeps_its_parent() -> None:
    core = make(num_blocks=20, high=0.5, ratio=0.1, policy="prefix-lru")
    put(core, "p", 0.0)
    put(core, "c", 1.0, parent="p")
    put(core, "old", 2.0)
    for i in range(7):
        put(core, f"f{i}", 3.0 + i)
    core.exist(keys("c"), 11.0)               # the child is recent; its parent is not
    put(core, "g0", 12.0)                     # 11 > 10: evict 2 blocks
    assert evicted(core) == ["old", "f0"]    # p waits behind its cached child


def test_prefix_lru_counts_children_put_before_their_parent() -> None:
    core = make(num_blocks=20, high=0.5, ratio=0.1, policy="prefix-lru")
    put(core, "c", 0.0, parent="p")           # parent absent (e.g. evicted), re-put later
    put(core, "p", 1.0)
    for i in range(8):
        put(core, f"f{i}", 2.0 + i)
    put(core, "g0", 12.0)
    assert evicted(core) == ["c", "p"]


def test_plain_lru_ignores_chains() -> None:
    core = make(num_blocks=20, high=0.5, ratio=0.1, policy="lru")
    put(core, "a0", 0.0)
    put(core, "a1", 1.0, parent="a0")
    for i in range(8):
        put(core, f"f{i}", 2.0 + i)
    put(core, "g0", 12.0)
    assert evicted(core) == ["a0", "a1"]


def test_eviction_relieves_only_the_tier_that_is_full() -> None:
    core = make(num_blocks=10, num_segments=2)
    # Two segments of 10 blocks: 11 blocks is 55 % of 20 > 50 %: 4 blocks go.
    for i in range(11):
        put(core, f"b{i}", float(i))
    assert evicted(core) == ["b0", "b1", "b2", "b3"]
    stats = core.stats()
    assert stats.evicted_bytes_total == 4 * BLOCK
    assert sorted(s.used_bytes for s in stats.segments) == [3 * BLOCK, 4 * BLOCK]


def test_a_short_watermark_pass_backs_off_for_a_tenth_of_a_lease() -> None:
    core = make(num_blocks=10, high=0.5, ratio=0.2, lease_ttl_s=10.0)
    for i in range(6):
        put(core, f"b{i}", float(i))
        core.exist(keys(f"b{i}"), float(i))     # leased until i + 10
    put(core, "c0", 9.95)                       # b0 leased until 10: short pass, back off
    put(core, "c1", 10.5)                       # b0 and c0 evictable, but within the back-off
    assert evicted(core) == []
    put(core, "c2", 11.0)
    assert evicted(core) == ["b0", "b1"]


def test_allocation_failures_evict_even_during_a_back_off() -> None:
    core = make(num_blocks=4, high=0.5, ratio=0.25, lease_ttl_s=10.0)
    for i in range(2):
        put(core, f"b{i}", float(i))
        core.exist(keys(f"b{i}"), float(i))
    put(core, "b2", 2.0)            # 3 of 4 blocks: short pass (b0, b1 leased), back off
    put(core, "b3", 2.5)            # 4 of 4
    assert evicted(core) == []
    assert put(core, "b4", 2.6) == Status.OK
    assert evicted(core) == ["b2"]


def test_a_pass_evicts_at_most_max_victims_and_the_next_put_goes_on() -> None:
    from kvpool_master.core.eviction import MAX_VICTIMS
    core = make(num_blocks=40_000, high=0.5, ratio=0.4)   # a pass wants 16,000 blocks
    keys_all = [ObjectKey(b"b%d" % i) for i in range(30_000)]
    for i in range(0, len(keys_all), 1000):
        chunk = keys_all[i:i + 1000]
        core.put_start(A, chunk, [BLOCK] * len(chunk), PutOptions(), 1.0)
        core.put_end(A, chunk, 1.0)
    passes = [e for e in core.take_events() if isinstance(e, EvictionPass)]
    assert passes and all(p.num_objects <= MAX_VICTIMS for p in passes)
    assert passes[0].num_objects == MAX_VICTIMS           # cut, not all it wanted
    assert len(passes) >= 2                                # the next puts went on
    assert core.stats().tier_to_used_bytes[Tier.DRAM] <= 0.5 * 40_000 * BLOCK


def test_without_object_events_the_index_behaves_the_same() -> None:
    """A master without a state directory skips the per-object events: two cores, one with
    them and one without, given the same puts, reads and removals, answer alike and evict the
    same objects; only the per-object events are missing."""
    with_events, without = make(num_blocks=20), make(num_blocks=20)
    without.skip_object_events()
    for core in (with_events, without):
        for i in range(30):
            assert put(core, f"k{i}", float(i)) == Status.OK
            if i % 3 == 0:
                core.get_replicas([ObjectKey(f"k{i // 2}".encode())], float(i) + 0.5)
        assert core.remove([ObjectKey(b"k29"), ObjectKey(b"nope")], False, 40.0) == \
            [Status.OK, Status.NOT_FOUND]
    keys = [ObjectKey(f"k{i}".encode()) for i in range(30)]
    assert with_events.exist(keys, 50.0) == without.exist(keys, 50.0)
    assert with_events.stats().evicted_objects_total == without.stats().evicted_objects_total > 0
    kinds = {type(e).__name__ for e in with_events.take_events()}
    assert {"ObjectCommitted", "ObjectRemoved", "EvictionPass"} <= kinds
    kinds = {type(e).__name__ for e in without.take_events()}
    assert "EvictionPass" in kinds and not kinds & {"ObjectCommitted", "ObjectRemoved"}


def test_leased_objects_at_the_old_end_are_looked_at_once_not_by_every_pass(
        monkeypatch) -> None:
    """The pool turns over within a lease: 6,000 objects read (leased for 1,000 s) end up at
    the least recently used end. The pass that meets them steps over them to its victims and
    moves them out of the way, so the passes look at each leased object once (before: every
    pass walked all 6,000), a pass with victims looks at no more than MAX_SCANNED, every put
    still finds room, and no leased object is evicted."""
    from kvpool_master.core import objects
    from kvpool_master.core.eviction import MAX_SCANNED
    core = MasterCore(CoreConfig(eviction_high_watermark_ratio=0.9, eviction_ratio=0.01,
                                 default_lease_ttl_s=1000.0, client_ttl_s=1e9,
                                 put_start_discard_timeout_s=1e9))
    core.register_client(A, "h", b"k" * 32, 0.0)
    core.mount_segment(SegmentInfo(SegmentId("s"), A, 20_000 * BLOCK), 0.0)
    keys = [ObjectKey(b"b%d" % i) for i in range(28_000)]
    leased = keys[:6000]

    def put_all(batch: list[ObjectKey], now: float) -> None:
        for i in range(0, len(batch), 500):
            chunk = batch[i:i + 500]
            started = core.put_start(A, chunk, [BLOCK] * len(chunk), PutOptions(), now)
            assert [s for s, _ in started] == [Status.OK] * len(chunk)
            assert core.put_end(A, chunk, now) == [Status.OK] * len(chunk)

    put_all(keys[:12_000], 1.0)
    assert {r.status for r in core.get_replicas(leased, 2.0)} == {Status.OK}
    looked_at: list[int] = []
    walk = objects.Recency.entries

    def counted(self: objects.Recency):  # type: ignore[no-untyped-def]
        looked_at.append(0)
        for entry in walk(self):
            looked_at[-1] += 1
            yield entry
    monkeypatch.setattr(objects.Recency, "entries", counted)
    core.take_events()
    put_all(keys[12_000:], 3.0)   # evicts the 6,000 unread, then new ones past the leased
    evicted_keys = {e.key for e in core.take_events() if isinstance(e, ObjectRemoved)}
    assert sum(looked_at) <= len(evicted_keys) + len(leased) + len(looked_at)
    assert sorted(looked_at)[-2] <= MAX_SCANNED   # only the pass that met them all is longer
    assert not evicted_keys & set(leased) and len(evicted_keys) >= 10_000
    assert core.exist(leased, 4.0)[0] == [Status.OK] * len(leased)


def test_deferred_watermark_passes_run_in_relieve_not_inside_the_put() -> None:
    core = make(num_blocks=10, high=0.5, ratio=0.2)
    core.defer_upkeep = True
    for i in range(6):
        put(core, f"b{i}", float(i))               # the 6th is above the watermark
    assert evicted(core) == [] and core.relief_due == {Tier.DRAM}
    assert core.relieve(6.0) is False              # 2 of 10 blocks freed: 4 of 10, not above
    assert evicted(core) == ["b0", "b1"] and core.relief_due == set()
    assert core.relieve(6.0) is False              # nothing due: nothing done
    assert evicted(core) == []


def test_a_deferred_pass_that_leaves_the_tier_above_stays_due() -> None:
    core = make(num_blocks=20, high=0.5, ratio=0.05)   # a pass frees one block
    core.defer_upkeep = True
    for i in range(13):
        put(core, f"b{i}", float(i))
    assert evicted(core) == []
    assert core.relieve(13.0) is True                  # 12 of 20: still above
    assert core.relieve(13.0) is True                  # 11 of 20
    assert core.relieve(13.0) is False                 # 10 of 20: at the watermark, done
    assert evicted(core) == ["b0", "b1", "b2"] and not core.relief_due


def test_a_deferred_pass_backs_off_and_allocation_failures_still_evict_at_once() -> None:
    core = make(num_blocks=4, high=0.5, ratio=0.25, lease_ttl_s=10.0)
    core.defer_upkeep = True
    for i in range(3):
        put(core, f"b{i}", float(i))
        core.exist(keys(f"b{i}"), float(i))        # leased until i + 10
    assert core.relieve(3.0) is False              # nothing evictable: a short pass, back off
    put(core, "c0", 3.5)                           # 4 of 4; within the back-off nothing is due
    assert core.relief_due == set() and core.relieve(3.5) is False
    assert evicted(core) == []
    assert put(core, "c1", 3.6) == Status.OK       # does not fit: evicts inside the put
    assert evicted(core) == ["c0"]


def test_no_deferred_pass_runs_during_the_restart_quarantine() -> None:
    core = make(num_blocks=10, high=0.5, ratio=0.2)
    core.defer_upkeep = True
    for i in range(6):
        put(core, f"b{i}", float(i))
    restored = MasterCore(core.config)
    restored.defer_upkeep = True
    restored.restore(core.snapshot(), 10.0, grace_s=30.0)
    restored.register_client(A, "h", b"k" * 32, 10.0, token=client_token(b"k" * 32))
    restored.mount_segment(SegmentInfo(SegmentId("s0"), A, 10 * BLOCK), 10.0)
    restored.take_events()
    restored.relief_due.add(Tier.DRAM)
    assert restored.relieve(10.0) is False and restored.relief_due == set()
    assert evicted(restored) == []
