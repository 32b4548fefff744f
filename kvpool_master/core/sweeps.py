"""Work too large for one call, done a step at a time: losing segments and removing by pattern.

Rules of this file:
- The master serves every client from one loop, so no call may hold it for long. Work that
  grows with the table (a lost segment's objects, ``RemoveAll``, ``RemoveByRegex``) is split:
  what must be true at once is done at once, the rest by ``sweep``, which the server calls
  between requests (a step looks at a few thousand table entries, about a millisecond) until
  ``sweeping`` is False. Small work (a table of at most ``SWEEP_NOW_KEYS`` objects, or a lost
  segment that holds no extent) is done at once.
- Objects are not listed per segment (that list cost memory per object and, once objects
  were removed, kept their keys alive until it was compacted). Sweeps find their objects by
  one walk over the object table instead, a shard at a time (``TableWalk``: a shard's entries
  are taken as a list when the walk reaches it). Every lost segment and every removal job
  rides that one walk: each counts the shards it has still to see (``NUM_SHARDS`` from the
  next shard on) and is done once it has seen them all. Objects put meanwhile may or may not
  be met: none can be on a lost segment, and a removal job leaves them.
- Losing a segment (unmount, its owner leaving or expiring) takes it out of the segment table
  at once and logs ``SegmentUnmounted``; nothing places on it or reads from it from then on
  (reads filter placements on it out: ``SegmentTable.filtering``). The walk then drops the
  objects whose every replica sat on lost segments; the others lose those replicas. A put of
  a key found only on lost segments drops that object first. Placements naming a lost id
  must never reach new memory, so a segment mounted again under that id waits for its sweep
  (``defer_upkeep``: the mount answers UNAVAILABLE until it is done, which the server turns
  into a late answer) or, in process, finishes it at once.
- A removal job removes the READY objects it meets that match (and are not leased, unless
  forced), but none that was not READY when it started (``RemoveJob.spared``): as one call
  would. It holds their extents (``HeldFrees``) until its walk is done, then frees them in
  offset order, a step at a time: freed in the walk's hash order, each would be a hole of its
  own in the free lists. It counts what it removed; its caller is answered once it is done,
  extents freed (``RemoveJob.done``). A ``sweep`` call frees for one job or walks, in turn.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from itertools import compress, islice

from kvpool_master.core.events import SegmentUnmounted
from kvpool_master.core.heldfrees import HeldFrees
from kvpool_master.core.keyregex import KeyPattern, compile_key_pattern
from kvpool_master.core.mutations import Mutations
from kvpool_master.core.objects import NUM_SHARDS, SHARD_MASK, ObjectEntry
from kvpool_master.core.segments import SegmentState
from kvpool_wire.status import Status
from kvpool_wire.types import Extent, ObjectKey, SegmentId, SegmentInfo, Tier

#: Work over a table of at most this many objects is done at once, not in steps.
SWEEP_NOW_KEYS = 1024
#: Table entries one ``sweep`` call looks at while a removal job runs (each a Python check).
SWEEP_STEP_KEYS = 1024
#: Table entries one ``sweep`` call looks at for lost segments alone (a C-level filter each).
SWEEP_SCAN_KEYS = 2048
#: Objects one ``sweep`` call drops (or takes a lost replica from) for the lost segments, and
#: removes for each removal job, at most (each about 3 µs; a removal job holds the extents,
#: ``HeldFrees``, and frees them in offset order at its end).
SWEEP_STEP_OBJECTS = 128

_SEGMENT_OF = operator.attrgetter("segment_id")
_MORE_OF = operator.attrgetter("more")


@dataclass(slots=True)
class RemoveJob:
    """One ``RemoveAll`` / ``RemoveByRegex`` in progress."""

    pattern: KeyPattern | None
    force: bool
    shards_left: int = 0     # table shards the walk has still to show it (0: it frees)
    removed: int = 0
    done: bool = False
    held: HeldFrees = field(default_factory=HeldFrees)   # extents of what it removed
    # the ids of the objects PENDING when it started, and of those put since in a shard the
    # walk has still to list (``spare``): it leaves them, as one call would have. Ids, not
    # entries: an entry gone meanwhile is not kept alive, and its id can only come back as
    # an object put later, which it leaves too
    spared: set[int] = field(default_factory=set)


@dataclass(slots=True)
class TableWalk:
    """Where the one walk over the object table is: the shard it is in, and that shard's
    entries as they were when it got there, less those it has looked at (None between
    shards). Each step cuts what it looked at off the list, so the objects it dropped are let
    go in that step: held to the shard's end, a removal in hash order would let the last
    objects of hundreds of allocator arenas go at once (a walk that empties the table would
    end on a step of tens of milliseconds)."""

    shard: int = 0
    entries: list[ObjectEntry] | None = None
    freed_last: bool = False   # the last step freed for a removal job (the next one walks)


class Sweeps(Mutations):
    """Losing segments and removal jobs, in steps; the base of ``Tiering``."""

    _jobs: list[RemoveJob]  # set by MasterCore.__init__
    _walk: TableWalk        # likewise

    # ---- removal ---------------------------------------------------------------------------

    def remove_all(self, force: bool, now: float) -> int:
        """Remove every READY object (leased ones only with ``force``) at once; return how
        many (the server uses ``start_remove`` and answers when the job is done)."""
        job = self.start_remove(None, force, now, at_once=True)
        return job.removed

    def remove_by_regex(self, pattern: str, force: bool, now: float) -> tuple[Status, int]:
        """Like ``remove_all`` for keys containing a match of ``pattern`` (RE2 syntax, on the
        key bytes, see ``keyregex``). (INVALID_ARGUMENT, 0) for a pattern RE2 does not compile
        (backreferences, lookaround) or one over 4096 chars. Time linear in the key bytes."""
        compiled = compile_key_pattern(pattern)
        if compiled is None:
            return Status.INVALID_ARGUMENT, 0
        job = self.start_remove(compiled, force, now, at_once=True)
        return Status.OK, job.removed

    def start_remove(self, pattern: KeyPattern | None, force: bool, now: float,
                     at_once: bool = False) -> RemoveJob:
        """Start removing the READY objects whose key matches ``pattern`` (all when None);
        small tables (or ``at_once``) are done now (``job.done``), else ``sweep`` continues."""
        job = RemoveJob(pattern, force)
        if at_once or len(self._objects) <= SWEEP_NOW_KEYS:
            for shard in self._objects.shards:
                if shard:
                    self._run_job(job, list(shard.values()), now)
            job.held.free_all(self._segments)
            job.done = True
        else:
            job.shards_left = self._shards_to_walk()
            pending = self._objects.pending_key_to_started_s   # committed later: left too
            job.spared.update(map(id, map(self._objects.get, pending)))
            self._jobs.append(job)
        return job

    def spare(self, jobs: list[RemoveJob], entry: ObjectEntry, shard: int) -> None:
        """``entry`` was just put into ``shard``: the walking ``jobs`` that will still list that
        shard leave it (a shard listed already is never met again)."""
        walk = self._walk
        ahead = (shard - walk.shard) & SHARD_MASK   # 0: the shard the walk is in
        first = 0 if walk.entries is None else 1    # ... unless it is listed already
        for job in jobs:
            if first <= ahead < job.shards_left:
                job.spared.add(id(entry))

    def _run_job(self, job: RemoveJob, entries: list[ObjectEntry], now: float) -> None:
        """Remove the objects of ``entries`` (still in the table) that ``job`` removes."""
        self._remove_found(job, entries, self._doomed(job, entries, now, len(entries)), now)

    def _doomed(self, job: RemoveJob, entries: list[ObjectEntry], now: float,
                most: int) -> list[int]:
        """The positions in ``entries`` of the first ``most`` objects ``job`` removes."""
        pattern, force, spared = job.pattern, job.force, job.spared
        return list(islice((i for i, entry in enumerate(entries)   # (stops at the most-th)
                            if (entry.writer_id is None
                                and (force or entry.lease_expiry_s <= now)
                                and (pattern is None or pattern.search(entry.key) is not None)
                                and id(entry) not in spared)), most))

    def _remove_found(self, job: RemoveJob, entries: list[ObjectEntry], found: list[int],
                      now: float) -> None:
        """Remove the objects at ``found`` in ``entries`` that are still in the table."""
        get = self._objects.get
        doomed = [entry.key for entry in map(entries.__getitem__, found)
                  if get(entry.key) is entry]
        if doomed:
            freed: list[Extent] = []
            self._drop(doomed, "remove", now, freed=freed)
            job.held.hold(freed, self._segments)
            self._counters.removed_objects += len(doomed)
            job.removed += len(doomed)

    # ---- losing segments -------------------------------------------------------------------

    def _mount_fresh(self, segment: SegmentInfo, now: float) -> None:
        dying = self._segments.dying.get(segment.segment_id)
        if dying is not None:  # placements naming this id must not reach the new memory
            self._sweep_at_once(dying, now)
        super()._mount_fresh(segment, now)

    def _lose_segment(self, state: SegmentState, now: float) -> None:
        """Forget a segment at once (no placement, read or capacity counts it from here on) and
        sweep its objects: those whose every replica sat on lost segments are dropped, the
        others lose those replicas. The walk of ``sweep`` finds them a step at a time (see the
        module rules); a segment with no extent, or a small table, is swept now. Extents of
        leased objects on it stay held (``DeferredFrees``) until the lease ends, in case the
        segment is mounted again."""
        segment_id = state.info.segment_id
        dying = self._segments.dying
        if segment_id in dying:
            self._sweep_at_once(dying[segment_id], now)
        self._segments.discard(state)
        dying[segment_id] = state
        self._events.append(SegmentUnmounted(segment_id, state.info.client_id))
        if state.allocator.num_extents == 0 or len(self._objects) <= SWEEP_NOW_KEYS:
            self._sweep_at_once(state, now)
        else:
            state.sweep_shards_left = self._shards_to_walk()

    def _sweep_at_once(self, state: SegmentState, now: float) -> None:
        """Finish sweeping the lost segment ``state`` now: the whole table, filtered for it in C
        (about a second per million objects: besides small tables, only a segment mounted
        again in process while its sweep runs, or lost twice, comes here with objects)."""
        alone = {state.info.segment_id: state}
        if state.allocator.num_extents:
            for shard in self._objects.shards:
                if shard:
                    entries = list(shard.values())
                    self._sweep_entries(entries, self._on_lost(entries, alone, len(entries)),
                                        alone, now)
        del self._segments.dying[state.info.segment_id]
        state.sweep_shards_left = 0

    def _shards_to_walk(self) -> int:
        """Shards a sweep that starts now must see: all of them from the next one on (the
        shard in progress was partly walked before it came)."""
        return NUM_SHARDS + (self._walk.entries is not None)

    def sweep(self, now: float, budget_keys: int = SWEEP_STEP_KEYS,
              budget_objects: int = SWEEP_STEP_OBJECTS) -> bool:
        """Advance the walk by one step: up to ``SWEEP_SCAN_KEYS`` table entries for lost
        segments alone, ``budget_keys`` while a removal job runs, ending early after
        ``budget_objects`` objects for the lost segments or for one job; True while there is
        more to do (the server calls it again between requests)."""
        dying = self._segments.dying
        if not dying and not self._jobs:
            return False
        walk = self._walk
        jobs = [job for job in self._jobs if job.shards_left]
        freeing = [job for job in self._jobs if not job.shards_left]
        if freeing and not ((dying or jobs) and walk.freed_last):   # walks and frees alternate
            walk.freed_last = True
            if not freeing[0].held.free_step(self._segments):
                freeing[0].done = True
                self._jobs = [job for job in self._jobs if not job.done]
            return self.sweeping
        walk.freed_last = False
        entries = walk.entries
        if entries is None:
            entries = walk.entries = list(self._objects.shards[walk.shard].values())
        chunk = entries[:budget_keys if jobs else SWEEP_SCAN_KEYS]
        lost = self._on_lost(chunk, dying, budget_objects) if dying else []
        doomed = [self._doomed(job, chunk, now, budget_objects) for job in jobs]
        cut = len(chunk)   # after the last object of whichever list reached the budget first
        for found in (lost, *doomed):
            if len(found) == budget_objects:
                cut = min(cut, found[-1] + 1)
        if lost:
            self._sweep_entries(chunk, [i for i in lost if i < cut], dying, now)
        for job, found in zip(jobs, doomed, strict=True):
            self._remove_found(job, chunk, [i for i in found if i < cut], now)
        del chunk, entries[:cut]
        if not entries:
            self._next_shard()
        return self.sweeping

    def _next_shard(self) -> None:
        """The walk is done with its shard: count it for every sweep, end those that have seen
        every shard, and move on to the next."""
        walk = self._walk
        walk.entries = None
        walk.shard = (walk.shard + 1) & SHARD_MASK
        dying = self._segments.dying
        for segment_id, state in list(dying.items()):
            state.sweep_shards_left -= 1
            if state.sweep_shards_left <= 0:
                del dying[segment_id]
        for job in self._jobs:
            if job.shards_left:
                job.shards_left -= 1
                if not job.shards_left:
                    job.spared.clear()
                    job.done = not job.held   # else it frees them first
        if self._jobs:
            self._jobs = [job for job in self._jobs if not job.done]

    def held_extents(self) -> int:
        """How many extents of removed objects removal jobs hold, still allocated, until they
        free them in offset order."""
        return sum(job.held.num_extents for job in self._jobs)

    def sweep_backlog_keys(self) -> int:
        """About how many table entries the walk has still to look at for the sweeps
        running (0: none is)."""
        left = [s.sweep_shards_left for s in self._segments.dying.values()]
        left += [job.shards_left for job in self._jobs]
        return max(left, default=0) * len(self._objects) // NUM_SHARDS

    @property
    def sweeping(self) -> bool:
        """Whether ``sweep`` has work."""
        return bool(self._segments.dying) or bool(self._jobs)

    @staticmethod
    def _on_lost(entries: list[ObjectEntry], dying: dict[SegmentId, SegmentState],
                 most: int) -> list[int]:
        """The positions in ``entries`` of the first ``most`` objects with a replica on a
        segment of ``dying`` (first replicas checked through C-level ``map``s)."""
        found = list(compress(range(len(entries)),
                              map(dying.__contains__, map(_SEGMENT_OF, entries))))
        more = list(compress(range(len(entries)), map(_MORE_OF, entries)))
        if more:
            found = sorted(set(found).union(
                i for i in more if any(p.segment_id in dying for p in entries[i].more)))
        return found[:most]

    def _sweep_entries(self, entries: list[ObjectEntry], hits: list[int],
                       dying: dict[SegmentId, SegmentState], now: float) -> None:
        """Sweep the objects at ``hits`` of ``entries`` (each with a replica on a segment of
        ``dying``), those still in the table: drop the ones left with no replica on a segment
        still known, take the lost replicas away from the others. A lost extent stays parked,
        in case the segment is mounted again over the same memory, while a reader's lease
        runs and, for a PENDING object, while its writer's capability may still write
        (``write_capability_ttl_s``, as for a revoked put)."""
        get = self._objects.get
        id_to_segment = self._segments.id_to_segment
        lost: list[ObjectKey] = []
        lost_pending: list[ObjectKey] = []
        seq = self._segments.next_free_seq()
        writing_until_s = now + self._config.write_capability_ttl_s
        for i in hits:
            entry = entries[i]
            if get(entry.key) is not entry:
                continue   # removed (or put again) since the walk took the shard
            extents = entry.extents()
            kept = tuple(p for p in extents if p.segment_id not in dying)
            if not any(p.segment_id in id_to_segment for p in kept):
                (lost if entry.writer_id is None else lost_pending).append(entry.key)
                continue
            until_s = entry.lease_expiry_s if entry.writer_id is None else max(
                entry.lease_expiry_s, writing_until_s)
            if until_s > now:
                for p in extents:
                    if p.segment_id in dying:
                        self._deferred.add(until_s, dying[p.segment_id], p.offset, p.length, seq)
            entry.set_extents(kept)
            if entry.dram is not None and not self._segments.has_tier(kept, Tier.DRAM):
                self._objects.dram_remove(entry)  # on SSD only now
        self._drop(lost, "segment_lost", now)
        if lost_pending:
            self._drop(lost_pending, "segment_lost", now, writing_until_s)
        self._counters.segment_lost_objects += len(lost) + len(lost_pending)
