"""The extents a removal job took off the objects it removed, freed in offset order at its end.

Rules of this file:
- A removal job meets its objects in the order of the table's hashes. Freed in that order,
  each extent is a hole of its own in its segment's free lists until its neighbours go too
  (about 10 µs a free: 9 of the 12 s a million-object ``RemoveAll`` took). Held and then freed
  in offset order, neighbours merge before they reach the free lists, a run of them one
  update (``Allocator.free_packed``).
- Held extents stay allocated: nothing is placed on them until they are freed. The objects
  are gone from the table (and their removals from the log) at once; the job is answered
  once its extents are free too.
- Holding makes no Python object per extent: each segment keeps its extents in buckets by
  offset (about 256 extents a bucket for extents spread over the segment), each two columns
  of machine words. Freeing takes one bucket at a time in offset order, sorts it (numpy) and
  frees at most ``FREE_STEP_EXTENTS`` a step; a bucket of more than ``SORT_MAX_EXTENTS`` is
  first split by the next 16 bits of the offset, in one step of O(n) (a radix sort).
- Extents of a segment lost, or mounted again, since they were taken are dropped: that
  memory went with the segment (as ``SegmentTable.free`` drops them).
"""

from __future__ import annotations

import operator
from array import array
from dataclasses import dataclass, field
from itertools import repeat
from typing import Any

import numpy as np

from kvpool_master.core.allocator import OFFSET_BITS, aligned
from kvpool_master.core.segments import SegmentState, SegmentTable
from kvpool_wire.types import Extent, SegmentId

#: Extents one ``free_step`` frees at most (each about half a microsecond in offset order).
FREE_STEP_EXTENTS = 2048
#: A bucket of more extents is split before it is sorted (a sort of 65,536 about 3 ms).
SORT_MAX_EXTENTS = 65_536
_SPLIT_BITS = 16
_EXTENTS_PER_BUCKET = 256


@dataclass(slots=True)
class _Held:
    """One segment's held extents: buckets by ``offset >> shift``, then what is being freed
    (``queue``: pieces as numpy columns with the shift their offsets share above, -1 once
    sorted; the next to free last)."""

    state: SegmentState
    shift: int
    buckets: dict[int, tuple[array[int], array[int]]] = field(default_factory=dict)
    keys: list[int] = field(default_factory=list)   # buckets to free, the next last
    queue: list[tuple[Any, Any, int]] = field(default_factory=list)
    num_extents: int = 0   # held here still


class HeldFrees:
    """Extents held to be freed in offset order (see the module rules)."""

    __slots__ = ("_id_to_held",)

    def __init__(self) -> None:
        self._id_to_held: dict[SegmentId, _Held] = {}

    def __bool__(self) -> bool:
        """Whether any extent is held."""
        return bool(self._id_to_held)

    @property
    def num_extents(self) -> int:
        """How many extents are held, not yet freed."""
        return sum(held.num_extents for held in self._id_to_held.values())

    def hold(self, extents: list[Extent], segments: SegmentTable) -> None:
        """Hold ``extents`` (allocated, of objects just removed) to be freed later; those on
        segments no longer known are dropped."""
        id_to_segment = segments.id_to_segment
        id_to_held = self._id_to_held
        for extent in extents:
            state = id_to_segment.get(extent.segment_id)
            if state is None:
                continue
            held = id_to_held.get(extent.segment_id)
            if held is None or held.state is not state:
                buckets = max(1, state.allocator.num_extents // _EXTENTS_PER_BUCKET)
                shift = max(0, state.allocator.end_bytes.bit_length()
                            - min(_SPLIT_BITS, buckets.bit_length()))
                held = id_to_held[extent.segment_id] = _Held(state, shift)
            key = extent.offset >> held.shift
            bucket = held.buckets.get(key)
            if bucket is None:
                bucket = held.buckets[key] = (array("Q"), array("Q"))
            bucket[0].append(extent.offset)
            bucket[1].append(aligned(extent.length))
            held.num_extents += 1

    def free_step(self, segments: SegmentTable,
                  budget_extents: int = FREE_STEP_EXTENTS) -> bool:
        """Free up to ``budget_extents`` held extents of one segment in offset order (or sort
        or split one of its buckets); True while some are still held."""
        if not self._id_to_held:
            return False
        segment_id, held = next(iter(self._id_to_held.items()))
        if segments.id_to_segment.get(segment_id) is not held.state:
            del self._id_to_held[segment_id]   # lost or mounted again: dropped with it
            return bool(self._id_to_held)
        queue = held.queue
        if not queue:
            if not held.keys:   # (buckets held since the last sort come after, unordered)
                held.keys = sorted(held.buckets, reverse=True)
            offsets, sizes = held.buckets.pop(held.keys.pop())
            queue.append((np.asarray(offsets), np.asarray(sizes), held.shift))
        offsets, sizes, shift = queue[-1]
        if shift > 0 and len(offsets) > SORT_MAX_EXTENTS:
            queue[-1:] = reversed(_split(offsets, sizes, max(0, shift - _SPLIT_BITS)))
        else:
            if shift >= 0:
                order = np.argsort(offsets)
                offsets, sizes = offsets[order], sizes[order]
            segments.free_packed_on(held.state, list(map(
                operator.or_, map(operator.lshift, offsets[:budget_extents].tolist(),
                                  repeat(OFFSET_BITS)),
                sizes[:budget_extents].tolist())), segments.next_free_seq())
            held.num_extents -= min(len(offsets), budget_extents)
            if len(offsets) > budget_extents:
                queue[-1] = (offsets[budget_extents:], sizes[budget_extents:], -1)
            else:
                queue.pop()
        if not queue and not held.buckets:
            del self._id_to_held[segment_id]
        return bool(self._id_to_held)

    def free_all(self, segments: SegmentTable) -> None:
        """Free every held extent now."""
        while self.free_step(segments, 1 << 62):
            pass


def _split(offsets: Any, sizes: Any, shift: int) -> list[tuple[Any, Any, int]]:
    """The extents of a piece whose offsets share their bits above ``shift + 16``, in pieces
    by ``offset >> shift``, in offset order (a stable sort of 16-bit digits is numpy's radix
    sort)."""
    digits = ((offsets >> np.uint64(shift)) & np.uint64((1 << _SPLIT_BITS) - 1)).astype(
        np.uint16)
    order = np.argsort(digits, kind="stable")
    offsets, sizes, digits = offsets[order], sizes[order], digits[order]
    cuts = (np.flatnonzero(np.diff(digits)) + 1).tolist()
    return list(zip(np.split(offsets, cuts), np.split(sizes, cuts), repeat(shift),
                    strict=False))
