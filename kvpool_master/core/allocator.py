"""Best-fit extent allocator for one segment.

Rules of this file:
- Offsets and sizes handed out are multiples of ``ALIGN_BYTES`` (a cache line), so copies into
  a segment start aligned; callers pass their exact size and get the rounded extent back.
- Free space is a set of maximal extents: a free always coalesces with both neighbours, so two
  free extents never touch and allocation never overlaps (pinned by a property test).
- Every operation is O(log n) in the number of free extents (a run of k holes, O(k log n)):
  ``_by_size`` is a sorted list of ``size << OFFSET_BITS | offset`` (one int compares faster
  than a tuple and costs less memory), searched by value, never by position (a positional
  lookup rebuilds the list's position index after a change), and two maps find the
  neighbours of a freed extent in O(1). Each map is split into dicts by position in the
  segment, one per 64 MiB of it up to 64 (``_EDGE_SHARD_BYTES``, ``_MAX_EDGE_SHARDS``): a dict
  that churns at a constant size rebuilds its whole table now and then, in one call, and a
  large segment freed in random order holds hundreds of thousands of holes (20-40 ms for
  such a rebuild; a 64th of it well under one).
- Best fit (smallest extent that fits, lowest offset among equals) keeps holes of a uniform
  block size reusable exactly, which is the common case for KV blocks.
- A restore rebuilds an allocator from its segment's extents, one per object
  (``from_columns``): numpy sorts and checks them and finds the gaps between them, so that
  step costs no Python work per object (about a sixth of a 10 M-object restore before).
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Iterable
from typing import Any

import numpy as np
from sortedcontainers import SortedList

ALIGN_BYTES = 64
OFFSET_BITS = 48
#: Largest segment (and so largest object) accepted: 64 TiB, well inside what an extent packed
#: as ``offset << OFFSET_BITS | size`` can describe (a size of 2**48 would spill into the offset).
MAX_SEGMENT_BYTES = 1 << (OFFSET_BITS - 2)
_OFFSET_MASK = (1 << OFFSET_BITS) - 1
_ALIGN_MASK_U64 = np.uint64(ALIGN_BYTES - 1)
#: Bytes of a segment per dict of each edge map, and most dicts per map (see the module rules).
_EDGE_SHARD_BYTES = 64 << 20
_MAX_EDGE_SHARDS = 64

#: (index, count) of a partition of the index (see ``share``); ``WHOLE``: the only one.
Part = tuple[int, int]
WHOLE: Part = (0, 1)


def aligned(size_bytes: int) -> int:
    """Return ``size_bytes`` rounded up to a multiple of ``ALIGN_BYTES``."""
    return (size_bytes + ALIGN_BYTES - 1) & ~(ALIGN_BYTES - 1)


def share(size_bytes: int, part: Part = WHOLE) -> tuple[int, int]:
    """``[start, end)`` of a segment of ``size_bytes`` that partition ``part`` = (index,
    count) of the index allocates in: the aligned bytes split in ``count`` aligned slices in
    order, the last one taking the rest (the whole segment for one partition)."""
    index, count = part
    usable = size_bytes - size_bytes % ALIGN_BYTES  # a ragged tail is never usable
    if count == 1:
        return 0, usable
    slice_bytes = usable // count // ALIGN_BYTES * ALIGN_BYTES
    start = index * slice_bytes
    return start, (start + slice_bytes if index < count - 1 else usable)


class Allocator:
    """Allocates aligned extents of ``[start_bytes, end_bytes)``: of ``[0, size_bytes)``, or of
    partition ``part``'s share of it (``share``); ``size_bytes`` is then that share's."""

    __slots__ = ("size_bytes", "start_bytes", "end_bytes", "used_bytes", "num_extents",
                 "_by_size", "_start_to_size", "_end_to_start", "_edge_shards", "_edge_scale")

    def __init__(self, size_bytes: int, part: Part = WHOLE) -> None:
        if not 0 < size_bytes <= MAX_SEGMENT_BYTES:
            raise ValueError(f"segment size must be in (0, {MAX_SEGMENT_BYTES}], got {size_bytes}")
        self.start_bytes, self.end_bytes = share(size_bytes, part)
        self.size_bytes = self.end_bytes - self.start_bytes
        self.used_bytes = 0
        self.num_extents = 0  # allocated extents
        self._by_size: SortedList = SortedList()
        # free extents by start and by end, each in the dict of its position's shard
        # (``position * _edge_shards // _edge_scale``; a share uses the shards of its span)
        shards = min(_MAX_EDGE_SHARDS, max(1, self.end_bytes // _EDGE_SHARD_BYTES))
        self._start_to_size: list[dict[int, int]] = [{} for _ in range(shards)]
        self._end_to_start: list[dict[int, int]] = [{} for _ in range(shards)]
        self._edge_shards = shards
        self._edge_scale = self.end_bytes + 1
        if self.size_bytes:
            self._add_free(self.start_bytes, self.size_bytes)

    @classmethod
    def from_used(cls, size_bytes: int, used: Iterable[tuple[int, int]],
                  part: Part = WHOLE) -> Allocator:
        """Return an allocator whose allocated extents are exactly ``used`` ((offset, size)).

        Raises ``ValueError`` when two extents overlap or one lies outside the segment (or
        outside ``part``'s share of it).
        """
        pairs = list(used)
        if any(offset < 0 or size <= 0 for offset, size in pairs):
            raise ValueError("extents lie outside the segment")
        return cls.from_columns(size_bytes, [offset for offset, _ in pairs],
                                [aligned(size) for _, size in pairs], part)

    @classmethod
    def from_packed(cls, size_bytes: int, packed: list[int], part: Part = WHOLE) -> Allocator:
        """Like ``from_used`` with extents as ``offset << OFFSET_BITS | aligned size``."""
        return cls.from_columns(size_bytes, [p >> OFFSET_BITS for p in packed],
                                [p & _OFFSET_MASK for p in packed], part)

    @classmethod
    def from_columns(cls, size_bytes: int, offsets: Any, sizes_bytes: Any,
                     part: Part = WHOLE) -> Allocator:
        """Like ``from_used`` with the extents' offsets and aligned sizes as two columns of
        unsigned machine words (numpy arrays, ``array("Q")``s or lists of ints, in any
        order): how a restore rebuilds a segment's allocator from its objects.

        The work is numpy's (sort, checks, the gaps between extents), so a restore pays no
        Python step per object here; Python steps only per free extent.
        """
        allocator = cls(size_bytes, part)
        try:
            starts = np.asarray(offsets, dtype=np.uint64)
            sizes = np.asarray(sizes_bytes, dtype=np.uint64)
        except (OverflowError, TypeError, ValueError) as exc:   # negative, not ints
            raise ValueError(f"extents are not unsigned machine words: {exc}") from None
        if starts.ndim != 1 or starts.shape != sizes.shape:
            raise ValueError("offsets and sizes must be two columns of one length")
        if not len(starts):
            return allocator
        first, limit = allocator.start_bytes, allocator.end_bytes
        # bounds first, so that no sum below wraps around
        if starts.max() >= limit or starts.min() < first or sizes.max() > limit \
                or not sizes.all() or ((starts | sizes) & _ALIGN_MASK_U64).any():
            raise ValueError("extents lie outside the segment or are not aligned")
        order = np.argsort(starts, kind="stable")
        starts, sizes = starts[order], sizes[order]
        ends = starts + sizes
        if ends[-1] > limit or (starts[1:] < ends[:-1]).any():
            raise ValueError("extents overlap or lie outside the segment")
        # the end of what precedes each
        before = np.concatenate((np.full(1, first, np.uint64), ends))
        gap = before[:-1] < starts
        free_starts = np.concatenate((before[:-1][gap], before[-1:]))
        free_sizes = np.concatenate((starts[gap] - free_starts[:-1],
                                     np.array([limit], np.uint64) - before[-1:]))
        if free_sizes[-1] == 0:   # no tail
            free_starts, free_sizes = free_starts[:-1], free_sizes[:-1]
        allocator._clear_free()
        allocator._set_free(free_starts, free_sizes)
        allocator.used_bytes = int(sizes.sum())
        allocator.num_extents = len(starts)
        return allocator

    @property
    def free_bytes(self) -> int:
        """Bytes not allocated (possibly split across several extents)."""
        return self.size_bytes - self.used_bytes

    @property
    def largest_free_bytes(self) -> int:
        """Size of the largest free extent: the biggest allocation that can succeed now."""
        return self._by_size[-1] >> OFFSET_BITS if self._by_size else 0

    @property
    def num_free_extents(self) -> int:
        """Number of free extents (1 for an empty segment; more means fragmentation)."""
        return len(self._by_size)

    def fragmentation(self) -> float:
        """Return 1 - largest free extent / free bytes (0.0 when free space is one extent)."""
        free = self.free_bytes
        return 0.0 if free == 0 else 1.0 - self.largest_free_bytes / free

    def allocate(self, size_bytes: int) -> int:
        """Return the offset of a fresh extent of ``aligned(size_bytes)`` bytes, or -1 if none fits.

        ``size_bytes`` must be positive (the caller validates input).
        """
        size = aligned(size_bytes)
        fitting: int | None = next(self._by_size.irange(size << OFFSET_BITS), None)
        if fitting is None:
            return -1
        self._carve(fitting, size, 1)
        return fitting & _OFFSET_MASK

    def allocate_run(self, size_bytes: int, count: int) -> list[int]:
        """Return the offsets of up to ``count`` (>= 1) fresh extents of ``aligned(size_bytes)``
        bytes, in order: back to back out of the smallest free extent that holds them all;
        where none does, out of the smallest free extents that hold one or more, in turn (after
        an LRU pool has turned over, free space is mostly holes of one block each). Empty if
        not even one fits. Each is an extent of its own, freed on its own later, as
        ``allocate`` gives them.
        """
        size = aligned(size_bytes)
        by_size = self._by_size
        whole = next(by_size.irange(size * count << OFFSET_BITS), None)
        chosen = [whole] if whole is not None else \
            list(itertools.islice(by_size.irange(size << OFFSET_BITS), count))
        offsets: list[int] = []
        for packed in chosen:
            offset = packed & _OFFSET_MASK
            got = self._carve(packed, size, count - len(offsets))
            offsets += range(offset, offset + got * size, size)
            if len(offsets) == count:
                break
        return offsets

    def _carve(self, packed: int, size: int, count: int) -> int:
        """Allocate up to ``count`` extents of ``size`` (aligned) from the start of the free
        extent ``packed`` (at least one fits); return how many."""
        extent_size = packed >> OFFSET_BITS
        offset = packed & _OFFSET_MASK
        self._remove_free(offset, extent_size)
        got = min(count, extent_size // size)
        taken = got * size
        if extent_size > taken:
            self._add_free(offset + taken, extent_size - taken)
        self.used_bytes += taken
        self.num_extents += got
        return got

    def free(self, offset: int, size_bytes: int) -> None:
        """Return the extent ``allocate`` gave at ``offset`` for ``size_bytes`` to free space.

        Raises ``ValueError`` on an extent outside the segment or one whose start or end is
        already the start or end of a free extent (a double free); the allocator is unchanged
        then. The object table frees each extent exactly once; this check is a cheap backstop.
        """
        size = aligned(size_bytes)
        end = offset + size
        if offset < self.start_bytes or size <= 0 or end > self.end_bytes or offset % ALIGN_BYTES:
            raise ValueError(f"extent ({offset}, {size}) lies outside the segment")
        if self._is_free_edge(offset, end):
            raise ValueError(f"extent ({offset}, {size}) is already free")
        self._release(offset, end)
        self.num_extents -= 1

    def free_many(self, extents: list[tuple[int, int]]) -> None:
        """Free many ``(offset, size_bytes)`` extents (each as ``free`` would) at once.

        Raises ``ValueError`` like ``free`` (also when two of them overlap), before changing
        anything.
        """
        packed: list[int] = []
        for offset, size_bytes in extents:
            size = aligned(size_bytes)
            if offset < 0 or not 0 < size < MAX_SEGMENT_BYTES:
                raise ValueError(f"extent ({offset}, {size}) lies outside the segment")
            packed.append(offset << OFFSET_BITS | size)
        self.free_packed(packed)

    def free_packed(self, packed: list[int]) -> None:
        """Free extents given as ``offset << OFFSET_BITS | aligned size`` (sorted in place).

        Extents that touch are merged before they meet the free lists, so freeing a run of
        neighbours (what an LRU eviction pass mostly frees) costs one sorted-list update per
        run instead of two per extent. Raises ``ValueError`` like ``free`` (also when two
        extents overlap), before changing anything.
        """
        packed.sort()
        first, limit = self.start_bytes, self.end_bytes
        runs: list[tuple[int, int]] = []
        run_start = run_end = -1
        for item in packed:
            offset = item >> OFFSET_BITS
            if offset == run_end:
                run_end += item & _OFFSET_MASK
                continue
            if offset < run_end:
                raise ValueError(f"extent at {offset} is freed twice")
            if offset < first or offset % ALIGN_BYTES:
                raise ValueError(f"extent at {offset} lies outside the segment")
            if run_end >= 0:
                runs.append((run_start, run_end))
            run_start, run_end = offset, offset + (item & _OFFSET_MASK)
        if run_end > limit:
            raise ValueError(f"extent ending at {run_end} lies outside the segment")
        if run_end >= 0:
            runs.append((run_start, run_end))
        for start, end in runs:
            if start >= end or self._is_free_edge(start, end):
                raise ValueError(f"extent ({start}, {end - start}) is already free")
        for start, end in runs:
            self._release(start, end)
        self.num_extents -= len(packed)

    def reserve_free(self) -> list[tuple[int, int]]:
        """Turn every free extent into an allocated one; return them as sorted (offset, size).

        Each can be handed back with ``free`` later (how a restore holds the free space of a
        restored segment back for a while).
        """
        extents = self.free_extents()
        self._clear_free()
        self.used_bytes = self.size_bytes
        self.num_extents += len(extents)
        return extents

    def free_extents(self) -> list[tuple[int, int]]:
        """Return the free extents as sorted (offset, size) pairs (for tests and snapshots)."""
        return sorted(itertools.chain.from_iterable(d.items() for d in self._start_to_size))

    def _is_free_edge(self, start: int, end: int) -> bool:
        """Whether ``start`` starts, or ``end`` ends, a free extent."""
        shards, scale = self._edge_shards, self._edge_scale
        return (start in self._start_to_size[start * shards // scale]
                or end in self._end_to_start[end * shards // scale])

    def _release(self, start: int, end: int) -> None:
        """Turn allocated ``[start, end)`` into free space, merged with free neighbours."""
        self.used_bytes -= end - start
        shards, scale = self._edge_shards, self._edge_scale
        right_size = self._start_to_size[end * shards // scale].get(end)
        if right_size is not None:
            self._remove_free(end, right_size)
            end += right_size
        left_start = self._end_to_start[start * shards // scale].get(start)
        if left_start is not None:
            self._remove_free(left_start, start - left_start)
            start = left_start
        self._add_free(start, end - start)

    def _add_free(self, offset: int, size: int) -> None:
        self._by_size.add(size << OFFSET_BITS | offset)
        end = offset + size
        shards, scale = self._edge_shards, self._edge_scale
        self._start_to_size[offset * shards // scale][offset] = size
        self._end_to_start[end * shards // scale][end] = offset

    def _remove_free(self, offset: int, size: int) -> None:
        self._by_size.remove(size << OFFSET_BITS | offset)
        end = offset + size
        shards, scale = self._edge_shards, self._edge_scale
        del self._start_to_size[offset * shards // scale][offset]
        del self._end_to_start[end * shards // scale][end]

    def _set_free(self, starts: Any, sizes: Any) -> None:
        """Add the free extents ``starts[i], sizes[i]`` (numpy columns sorted by start, none
        touching another or a free extent): a sort for the size list, a dict update per edge
        shard."""
        start_list, size_list = starts.tolist(), sizes.tolist()
        self._by_size.update(map(operator.or_, map(operator.lshift, size_list,
                                                   itertools.repeat(OFFSET_BITS)), start_list))
        shards, scale = self._edge_shards, self._edge_scale
        end_list = (starts + sizes).tolist()
        start_cut = np.searchsorted(starts * np.uint64(shards) // np.uint64(scale),
                                    np.arange(shards + 1, dtype=np.uint64)).tolist()
        end_cut = np.searchsorted((starts + sizes) * np.uint64(shards) // np.uint64(scale),
                                  np.arange(shards + 1, dtype=np.uint64)).tolist()
        for k in range(shards):
            lo, hi = start_cut[k], start_cut[k + 1]
            self._start_to_size[k].update(zip(start_list[lo:hi], size_list[lo:hi], strict=True))
            lo, hi = end_cut[k], end_cut[k + 1]
            self._end_to_start[k].update(zip(end_list[lo:hi], start_list[lo:hi], strict=True))

    def _clear_free(self) -> None:
        """Forget every free extent."""
        self._by_size.clear()
        for start_to_size, end_to_start in zip(self._start_to_size, self._end_to_start,
                                               strict=True):
            start_to_size.clear()
            end_to_start.clear()
