"""The batch paths of the master core: a plain batch of puts, a writer's commits and a
pass's drops made with C-level maps instead of a Python step per key.

Rules of this file:
- ``BatchPaths`` is mixed into ``Mutations`` (``mutations.py``), whose key-by-key loops call
  it and fall back on themselves for whatever it does not take; it changes the table only
  through the same state those loops change (``MasterCore.__init__`` sets it).
- Each path checks a call whole with C-level maps first and changes nothing when the call
  is not its case. Its case: a ``PutStart`` of ``BATCH_MIN_KEYS`` or more plain puts whose
  keys are well formed and distinct, sizes one int and parents well formed or empty (its
  stretches of ``BATCH_MIN_KEYS`` or more absent keys are placed; the loop answers the
  keys between them); a ``PutEnd`` of a writer's own PENDING keys with u64 checksums; a
  ``_drop`` of READY objects with one replica and no live lease (an eviction pass's
  victims, mostly).
- Every path has the effects the loop would have, in the same order: the same extents
  carved and handed out, a watermark check where the loop makes one (and the entries
  placed so far in the table before a check that runs a pass), the same events, counters
  and frees. ``Mutations.batch_paths`` off turns them off; the differential test
  (``tests/unit/test_core_batch_paths.py``) runs the same calls both ways and compares.
"""

from __future__ import annotations

import itertools
import operator
from collections import deque
from collections.abc import Sequence

from kvpool_master.core.allocator import OFFSET_BITS, aligned
from kvpool_master.core.config import CoreConfig
from kvpool_master.core.events import (
    Event,
    ObjectCommitted,
    ObjectRemoved,
    ObjectsCommitted,
    RemoveReason,
)
from kvpool_master.core.leases import LeaseCounters
from kvpool_master.core.objects import INT_TYPES, KEY_TYPES, ObjectEntry, ObjectTable
from kvpool_master.core.segments import SegmentState, SegmentTable
from kvpool_wire.placed import Run
from kvpool_wire.types import ClientId, Extent, ObjectKey, Pin, Tier

#: Fewest keys a call takes the batch paths for: below it their maps' fixed cost is more than
#: the loop's (``master_core.py``'s single-key puts took 16.6 µs a call with them against
#: 12.3 µs without).
BATCH_MIN_KEYS = 8
#: Stretches of puts whose entries the core keeps for their commit (``_recent_puts``).
RECENT_PUTS = 64
#: Most extents one run carves (a batch still spreads over segments in runs this long).
RUN_MAX_KEYS = 64
MAX_CHECKSUM = (1 << 64) - 1
_WRITER_OF, _MORE_OF, _SIZE_OF, _SEGMENT_OF, _OFFSET_OF, _PIN_OF, _PARENT_OF, _NEWER_OF, \
    _LEASE_OF = (operator.attrgetter(name) for name in (
        "writer_id", "more", "size_bytes", "segment_id", "offset", "pin", "parent_key",
        "newer", "lease_expiry_s"))
_NONE = {None}
_NO_MORE: set[tuple[Extent, ...]] = {()}


class BatchPaths:
    """The batch paths; mixed into ``Mutations``, which provides the run machinery."""

    # Set by MasterCore.__init__.
    _config: CoreConfig
    _segments: SegmentTable
    _objects: ObjectTable
    _lease_counters: LeaseCounters
    # (writer, first key) -> (keys, entries) of the last RECENT_PUTS stretches _put_runs placed
    # whole (a whole batch, or the keys of one the pool did not have): a commit of the same
    # keys takes the entries from here once it has checked that each is still in the table
    # (an entry out of it has ``newer`` None), without a lookup
    _recent_puts: dict[tuple[ClientId, ObjectKey], tuple[Sequence[ObjectKey],
                                                         list[ObjectEntry]]]
    defer_upkeep: bool  # see ``Mutations``
    batch_paths = True  # tests turn it off (the module rules)

    # ---- the run machinery, in ``Mutations`` ------------------------------------------------

    def _carve_run(self, size_bytes: int, count: int) -> CarvedRun | None:
        raise NotImplementedError

    def _take(self, run: CarvedRun, now: float, exhausted: set[Tier]) -> Extent:
        raise NotImplementedError

    def _pass_due(self, tier: Tier, now: float) -> bool:
        raise NotImplementedError

    # ---- the paths -------------------------------------------------------------------------

    def _batchable(self, keys: Sequence[ObjectKey], sizes_bytes: Sequence[int],
                   parent_keys: Sequence[ObjectKey] | None,
                   ) -> tuple[list[dict[ObjectKey, ObjectEntry]], list[bool]] | None:
        """(the shard of each key, whether each key is in the table) of a plain batch whose
        keys are well formed and distinct, its sizes one int and its parents well formed or
        empty, checked with C-level maps; None for any other (the loop answers it all)."""
        n = len(keys)
        size = sizes_bytes[0]
        max_key_bytes = self._config.max_key_bytes
        if not (set(map(type, sizes_bytes)) == INT_TYPES and size > 0
                and sizes_bytes.count(size) == n and set(map(type, keys)) == KEY_TYPES
                and min(map(len, keys)) > 0 and max(map(len, keys)) <= max_key_bytes
                and (parent_keys is None or (set(map(type, parent_keys)) == KEY_TYPES
                                             and max(map(len, parent_keys)) <= max_key_bytes))
                and len(set(keys)) == n):
            return None
        key_shards = self._objects.shards_of(keys)
        return key_shards, list(map(dict.__contains__, key_shards, keys))

    def _put_runs(self, client_id: ClientId, keys: Sequence[ObjectKey], size: int, pin: Pin,
                  parent_keys: Sequence[ObjectKey] | None,
                  key_shards: list[dict[ObjectKey, ObjectEntry]], first: int, end: int,
                  run: CarvedRun | None, now: float,
                  exhausted: set[Tier]) -> tuple[int, list[Run], CarvedRun | None]:
        """Place ``keys[first:end]`` (a stretch of a ``_batchable`` batch, all absent) the
        C-level way: extents taken from ``run`` and the runs carved after it as the key-by-key
        loop takes and carves them (``_take`` where a watermark check is due, the extents
        between counted at once), the entries made and inserted by maps, those placed so far
        before a ``_take`` that runs a watermark pass (which then sees the table the loop
        would show it: eviction moves what it skips behind the newest entries).
        Returns how many keys it placed (fewer than the stretch when no run could be carved),
        their (segment id, offsets) runs, and the run the caller goes on with."""
        n = len(keys)
        size_to_int = self._objects.size_to_int
        size = size_to_int.setdefault(size, size) if len(size_to_int) < 4096 else size
        used = self._segments.tier_to_used_bytes
        runs: list[Run] = []
        entries: list[ObjectEntry] = []
        count = end - first
        placed = inserted = 0  # keys placed; how many of them are in the table
        while placed < count:
            if run is None or not run.left:
                run = self._carve_run(size, min(n - first - placed, RUN_MAX_KEYS))
                if run is None:
                    break
            if placed > inserted and self._pass_at_take(run, now, exhausted):
                entries += self._add_run_entries(client_id, keys, size, pin, parent_keys,
                                                 key_shards, first + inserted,
                                                 first + placed, runs, now)
                inserted = placed
            begin = len(run.offsets) - run.left
            segment_id = self._take(run, now, exhausted).segment_id
            quiet = min(run.left, run.quiet, count - placed - 1)  # handed out unchecked
            run.left -= quiet
            run.quiet -= quiet
            used[Tier.DRAM] += quiet * run.step_bytes
            runs.append((segment_id, run.offsets[begin:begin + 1 + quiet]))
            placed += 1 + quiet
        if placed > inserted:
            entries += self._add_run_entries(client_id, keys, size, pin, parent_keys,
                                             key_shards, first + inserted, first + placed,
                                             runs, now)
        if placed == count:  # a commit of this stretch finds them here (_own_pending)
            recent = self._recent_puts
            recent[(client_id, keys[first])] = (keys if count == n else keys[first:end],
                                                entries)
            if len(recent) > RECENT_PUTS:
                del recent[next(iter(recent))]
        return placed, runs, run

    def _add_run_entries(self, client_id: ClientId, keys: Sequence[ObjectKey], size: int,
                         pin: Pin, parent_keys: Sequence[ObjectKey] | None,
                         key_shards: list[dict[ObjectKey, ObjectEntry]], lo: int, hi: int,
                         runs: list[Run], now: float) -> list[ObjectEntry]:
        """Make and insert, with C-level maps, the entries of ``keys[lo:hi]``: the keys the
        last runs of ``runs`` placed."""
        objects = self._objects
        repeat = itertools.repeat
        whole = hi - lo == len(keys)
        batch = keys if whole else keys[lo:hi]
        start, left = len(runs), hi - lo
        while left:  # the runs that placed them: the last ones
            start -= 1
            left -= len(runs[start][1])
        mine = runs[start:]
        segment_ids = list(itertools.chain.from_iterable(
            repeat(segment_id, len(run_offsets)) for segment_id, run_offsets in mine))
        offsets = list(itertools.chain.from_iterable(run_offsets for _, run_offsets in mine))
        entries = list(map(ObjectEntry, batch, repeat(size), segment_ids, offsets,
                           repeat(client_id), repeat(pin), repeat(None)))
        objects.add_pending_all(key_shards if whole else key_shards[lo:hi], batch, entries, now)
        if parent_keys is not None:  # shared once all are in (a chain's parents are in it)
            deque(map(setattr, entries, repeat("parent_key"),
                      objects.shared_parents(parent_keys if whole else parent_keys[lo:hi])),
                  maxlen=0)
        return entries

    @staticmethod
    def _commit_events(keys: Sequence[ObjectKey], entries: list[ObjectEntry],
                       checksums: Sequence[int] | None) -> list[Event]:
        """The events of a batch commit: one ``ObjectsCommitted`` when every object has one
        replica, else an ``ObjectCommitted`` each."""
        if any(map(_MORE_OF, entries)):
            return list(map(commit_event, keys, entries, checksums or itertools.repeat(0)))
        return [ObjectsCommitted(
            list(keys), list(map(_SIZE_OF, entries)), list(map(_SEGMENT_OF, entries)),
            list(map(_OFFSET_OF, entries)),
            list(checksums) if checksums is not None else [0] * len(entries),
            list(map(_PIN_OF, entries)), list(map(_PARENT_OF, entries)))]

    def _own_pending(self, client_id: ClientId, keys: Sequence[ObjectKey],
                     checksums: Sequence[int] | None) -> list[ObjectEntry] | None:
        """The entries of ``keys`` when the keys are distinct and each PENDING by
        ``client_id``, and every checksum a u64; else None. Looked up with C-level maps;
        changes nothing."""
        if checksums is not None and checksums and not (
                set(map(type, checksums)) == INT_TYPES and min(checksums) >= 0
                and max(checksums) <= MAX_CHECKSUM):
            return None
        placed = self._recent_puts.pop((client_id, keys[0]), None)
        if placed is not None and placed[0] == keys and None not in map(_NEWER_OF, placed[1]):
            entries = placed[1]  # the batch put_start placed, every entry still in the table
        else:
            found = self._objects.get_all(keys)
            if None in found or len(set(keys)) != len(keys):
                return None
            entries = found  # type: ignore[assignment]   # (no None in it)
        return entries if set(map(_WRITER_OF, entries)) == {client_id} else None

    def _unprotected(self, keys: Sequence[ObjectKey], now: float,
                     entries: list[ObjectEntry] | None) -> list[ObjectEntry] | None:
        """The entries of ``keys`` (looked up unless given: then the keys are distinct)
        when the keys are distinct and each READY, with one replica and no live lease at
        ``now`` (its holds expire by its lease, so none is live either): what ``_drop_all``
        takes. Else None. C-level maps; changes nothing."""
        if entries is None:
            found = self._objects.get_all(keys)
            if None in found or len(set(keys)) != len(keys):
                return None
            return self._unprotected(keys, now, found)  # type: ignore[arg-type]   # no None
        if (set(map(_WRITER_OF, entries)) != _NONE or set(map(_MORE_OF, entries)) != _NO_MORE
                or max(map(_LEASE_OF, entries)) > now):
            return None
        return entries

    def _drop_all(self, keys: Sequence[ObjectKey], entries: list[ObjectEntry],
                  reason: RemoveReason, events: list[Event] | None) -> None:
        """``_drop`` of ``keys``, whose entries (``_unprotected``) are freed at once, with
        C-level maps: the extents freed a segment at a time, as ``SegmentTable.free`` would
        free them."""
        self._objects.pop_all_ready(keys, entries)
        sizes = list(map(_SIZE_OF, entries))
        if events is not None:
            events.extend(map(ObjectRemoved, keys, sizes, itertools.repeat(reason)))
        self._lease_counters.leases_lapsed += sum(map(bool, map(_LEASE_OF, entries)))
        segments = self._segments
        seq = segments.next_free_seq()
        aligned_of = {size: aligned(size) for size in set(sizes)}
        packed = list(map(operator.or_,
                          map(operator.lshift, map(_OFFSET_OF, entries),
                              itertools.repeat(OFFSET_BITS)),
                          map(aligned_of.__getitem__, sizes)))
        segment_ids = list(map(_SEGMENT_OF, entries))
        on = dict.fromkeys(segment_ids)  # each segment once, in the order the loop meets it
        for segment_id in on:
            state = segments.id_to_segment.get(segment_id)
            if state is None:  # gone: its extents went with it
                continue
            segments.free_packed_on(state, packed if len(on) == 1 else list(itertools.compress(
                packed, map(operator.eq, segment_ids, itertools.repeat(segment_id)))), seq)

    def _pass_at_take(self, run: CarvedRun, now: float, exhausted: set[Tier]) -> bool:
        """Whether the ``_take`` of the next extent of ``run`` runs a watermark pass (the
        same checks, made before it)."""
        if run.quiet or self.defer_upkeep or Tier.DRAM in exhausted:
            return False
        used = self._segments.tier_to_used_bytes
        used[Tier.DRAM] += run.step_bytes
        due = self._pass_due(Tier.DRAM, now)
        used[Tier.DRAM] -= run.step_bytes
        return due


def commit_event(key: ObjectKey, entry: ObjectEntry, checksum: int) -> ObjectCommitted:
    """The event of ``entry``'s commit under ``key``."""
    return ObjectCommitted(key, entry.size_bytes, entry.extents(), checksum, entry.pin,
                           entry.parent_key)


class CarvedRun:
    """Extents carved at once for the plain puts of one batch (``offsets``, back to back
    where the segment had room for it), handed out in order by ``Mutations._take`` (and in bulk by
    ``BatchPaths._put_runs``)."""

    __slots__ = ("state", "offsets", "size_bytes", "step_bytes", "left", "quiet")

    def __init__(self, state: SegmentState, offsets: list[int], size_bytes: int) -> None:
        self.state = state
        self.offsets = offsets
        self.size_bytes = size_bytes
        self.step_bytes = aligned(size_bytes)
        self.left = len(offsets)  # not handed out yet: the last ``left`` offsets
        self.quiet = 0  # extents to hand out before the watermark is checked again


class Stretches:
    """Where a ``_batchable`` batch's stretches of ``BATCH_MIN_KEYS`` or more absent keys
    are: those go the batch way (none when the batch is not batchable, ``checked`` None).
    Asked in key order only."""

    __slots__ = ("key_shards", "bounds", "at")

    def __init__(self, checked: tuple[list[dict[ObjectKey, ObjectEntry]], list[bool]] | None,
                 n: int) -> None:
        self.key_shards = checked[0] if checked is not None else None
        self.bounds: list[tuple[int, int]] = []  # (first, end) of each long absent stretch
        self.at = 0  # the stretch asked about last
        if checked is None:
            return
        present = checked[1]
        if not any(present):
            self.bounds.append((0, n))
            return
        first = 0
        for end in itertools.chain(itertools.compress(range(n), present), (n,)):
            if end - first >= BATCH_MIN_KEYS:
                self.bounds.append((first, end))
            first = end + 1

    def next_from(self, index: int) -> int:
        """The first key from ``index`` on that starts ``BATCH_MIN_KEYS`` or more absent keys
        in a row (-1: none)."""
        bounds = self.bounds
        while self.at < len(bounds):
            first, end = bounds[self.at]
            start = max(first, index)
            if end - start >= BATCH_MIN_KEYS:
                return start
            self.at += 1
        return -1

    def end(self) -> int:
        """The end of the stretch of the key ``next_from`` gave last."""
        return self.bounds[self.at][1]
