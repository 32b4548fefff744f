"""Work too large for one call, done a step at a time: losing segments and removing by pattern.

Rules of this file:
- The master serves every client from one loop, so no call may hold it for long. Work that
  grows with the table (a lost segment's objects, ``RemoveAll``, ``RemoveByRegex``) is split:
  what must be true at once is done at once, the rest by ``sweep``, which the server calls
  between requests (``SWEEP_STEP_KEYS`` entries, about a millisecond, per call) until
  ``sweeping`` is False. Small work (at most ``SWEEP_NOW_KEYS`` entries) is done at once.
- Losing a segment (unmount, its owner leaving or expiring) takes it out of the segment table
  at once and logs ``SegmentUnmounted``; nothing places on it or reads from it from then on
  (reads filter placements on it out: ``SegmentTable.filtering``). Its key list is then swept:
  objects whose every replica sat on it are dropped, the others lose that replica. A put of a
  key found only on lost segments drops that object first, and a segment mounted again under
  that id finishes the sweep first (placements naming the id must never reach new memory).
- A removal job walks every segment's key list up to the length it had when the job started
  (objects put later are not its business), removing the READY objects that match (and are
  not leased, unless forced). Segment key lists are not compacted while a job walks them. The
  job counts what it removed; its caller is answered once it is done (``RemoveJob.done``).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvpool_master.core.events import SegmentUnmounted
from kvpool_master.core.keyregex import KeyPattern, compile_key_pattern
from kvpool_master.core.mutations import Mutations
from kvpool_master.core.segments import SegmentState
from kvpool_wire.status import Status
from kvpool_wire.types import ObjectKey, SegmentInfo, Tier

#: Work of at most this many key-list entries is done at once, not in steps.
SWEEP_NOW_KEYS = 1024
#: Key-list entries one ``sweep`` call looks at.
SWEEP_STEP_KEYS = 1024


@dataclass(slots=True)
class RemoveJob:
    """One ``RemoveAll`` / ``RemoveByRegex`` in progress."""

    pattern: KeyPattern | None
    force: bool
    segments: list[tuple[SegmentState, int]]   # (segment, length of its key list at the start)
    index: int = 0                              # the segment being walked
    at: int = 0                                 # the next entry of its key list
    removed: int = 0
    done: bool = False


class Sweeps(Mutations):
    """Losing segments and removal jobs, in steps; the base of ``Tiering``."""

    _jobs: list[RemoveJob]  # set by MasterCore.__init__

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
        segments = [(s, len(s.keys)) for s in self._segments.id_to_segment.values()]
        job = RemoveJob(pattern, force, segments)
        if at_once or sum(n for _, n in segments) <= SWEEP_NOW_KEYS:
            self._run_job(job, now, None)
        else:
            self._jobs.append(job)
        return job

    def _run_job(self, job: RemoveJob, now: float, budget_keys: int | None) -> int:
        """Advance ``job`` by ``budget_keys`` entries (all when None); return how many it
        looked at."""
        looked = 0
        get = self._objects.get
        pattern, force = job.pattern, job.force
        while job.index < len(job.segments):
            state, end = job.segments[job.index]
            keys = state.keys
            stop = min(end, len(keys))
            if budget_keys is not None:
                stop = min(stop, job.at + budget_keys - looked)
            doomed: dict[ObjectKey, None] = {}
            for index in range(job.at, stop):
                key = keys[index]
                entry = get(key)
                if (entry is not None and entry.writer_id is None
                        and (force or entry.lease_expiry_s <= now)
                        and (pattern is None or pattern.search(key) is not None)):
                    doomed[key] = None
            looked += max(stop - job.at, 0)
            job.at = stop
            self._drop(list(doomed), "remove", now)
            self._counters.removed_objects += len(doomed)
            job.removed += len(doomed)
            if job.at >= min(end, len(keys)):
                job.index += 1
                job.at = 0
            if budget_keys is not None and looked >= budget_keys:
                return looked
        job.done = True
        return max(looked, 1)

    # ---- losing segments -------------------------------------------------------------------

    def _mount_fresh(self, segment: SegmentInfo, now: float) -> None:
        dying = self._segments.dying.get(segment.segment_id)
        if dying is not None:  # placements naming this id must not reach the new memory
            self._sweep_segment(dying, now, None)
        super()._mount_fresh(segment, now)

    def _lose_segment(self, state: SegmentState, now: float) -> None:
        """Forget a segment at once (no placement, read or capacity counts it from here on) and
        sweep its objects: those whose every replica sat on it are dropped, the others only
        lose that replica. A small segment is swept now; a large one by ``sweep`` a chunk at a
        time (see the module rules). Extents of leased objects on it stay held
        (``DeferredFrees``) until the lease ends, in case the segment is mounted again."""
        segment_id = state.info.segment_id
        if segment_id in self._segments.dying:
            self._sweep_segment(self._segments.dying[segment_id], now, None)
        self._segments.discard(state)
        state.sweep_at = 0
        self._segments.dying[segment_id] = state
        self._events.append(SegmentUnmounted(segment_id, state.info.client_id))
        if len(state.keys) <= SWEEP_NOW_KEYS:
            self._sweep_segment(state, now, None)

    def sweep(self, now: float, budget_keys: int = SWEEP_STEP_KEYS) -> bool:
        """Sweep up to ``budget_keys`` entries (lost segments first, then removal jobs); True
        while there is more to do (the server calls it again between requests)."""
        dying = self._segments.dying
        while dying and budget_keys > 0:
            state = next(iter(dying.values()))
            budget_keys -= self._sweep_segment(state, now, budget_keys)
        jobs = self._jobs
        while jobs and budget_keys > 0:
            budget_keys -= self._run_job(jobs[0], now, budget_keys)
            if jobs[0].done:
                jobs.pop(0)
        return self.sweeping

    def sweep_backlog_keys(self) -> int:
        """Key-list entries the sweeps have still to look at (0: none running)."""
        backlog = sum(len(s.keys) - s.sweep_at for s in self._segments.dying.values())
        for job in self._jobs:
            backlog += sum(end for _, end in job.segments[job.index:]) - job.at
        return backlog

    @property
    def sweeping(self) -> bool:
        """Whether ``sweep`` has work."""
        return bool(self._segments.dying) or bool(self._jobs)

    def _sweep_segment(self, state: SegmentState, now: float, budget_keys: int | None) -> int:
        """Sweep the lost segment ``state`` from where it stopped, all of it or
        ``budget_keys`` entries of its key list; return how many entries were looked at."""
        segment_id = state.info.segment_id
        keys = state.keys
        start = state.sweep_at
        stop = len(keys) if budget_keys is None else min(len(keys), start + budget_keys)
        get = self._objects.get
        lost: dict[ObjectKey, None] = {}  # a key may be listed twice
        seq = self._segments.next_free_seq()
        for index in range(start, stop):
            key = keys[index]
            entry = get(key)
            if entry is None or not entry.on_segment(segment_id):
                continue  # gone, re-put elsewhere, or a repeat already swept
            extents = entry.extents()
            kept = tuple(p for p in extents if p.segment_id != segment_id)
            if not any(p.segment_id in self._segments.id_to_segment for p in kept):
                lost[key] = None
                continue
            if entry.lease_expiry_s > now:
                for p in extents:
                    if p.segment_id == segment_id:
                        self._deferred.add(entry.lease_expiry_s, state, p.offset, p.length, seq)
            entry.set_extents(kept)
            if entry.dram is not None and state.info.tier == Tier.DRAM and \
                    not self._segments.has_tier(kept, Tier.DRAM):
                self._objects.dram_remove(entry)  # on SSD only now
        self._drop(list(lost), "segment_lost", now)
        self._counters.segment_lost_objects += len(lost)
        # let go of the swept keys now, a step at a time, not all at the end in one go
        keys[start:stop] = [None] * (stop - start)  # type: ignore[list-item]
        state.sweep_at = stop
        if stop >= len(keys):
            del self._segments.dying[segment_id]
            state.keys = []
        return max(stop - start, 1)

