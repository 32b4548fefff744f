"""What both clients do around a driver call: turning the caller's arguments into one batch of
distinct keys (``core.keys``, its duplicate-key policy), and the per-position results back.
Pure: no I/O; the clients call a driver in between.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvpool_client.buffers import BufferRegistry, alloc_bytes, slice_view, to_key
from kvpool_client.core.keys import KeyBatch
from kvpool_client.core.read_plan import DstFor
from kvpool_client.core.regions import Regions, by_address, total_bytes, trim_regions
from kvpool_wire.status import KVPoolError, Status


def same_length(keys: Sequence[Any], values: Sequence[Any]) -> None:
    """Raise INVALID_ARGUMENT unless there is one value per key."""
    if len(keys) != len(values):
        raise KVPoolError(Status.INVALID_ARGUMENT, f"{len(keys)} keys but {len(values)} values")


def attempt(make: Any, value: Any, **kwargs: Any) -> Any:
    """``make(value)`` as regions, or None when the value is unusable (its key then fails
    alone)."""
    try:
        result = make(value, **kwargs)
    except KVPoolError:
        return None
    return [result] if isinstance(result, memoryview) else result


def slices(buffers: BufferRegistry, keys: Sequence[Any], bufs: Any, offsets: Sequence[int],
           sizes: Sequence[int], *, writable: bool) -> list[Regions | None]:
    """One single-region list per key, ``bufs[i][offsets[i]:offsets[i]+sizes[i]]`` (``bufs``
    one buffer for all keys, or a list of one per key); None where the range or buffer is bad."""
    per_key = isinstance(bufs, list | tuple)
    if per_key:
        same_length(keys, bufs)
    same_length(keys, offsets)
    same_length(keys, sizes)
    shared = None if per_key else buffers.view(bufs, writable=writable)
    out: list[Regions | None] = []
    for index in range(len(keys)):
        try:
            base = shared if shared is not None else buffers.view(bufs[index], writable=writable)
            out.append([slice_view(base, offsets[index], sizes[index])])
        except KVPoolError:
            out.append(None)
    return out


def key_batch(keys: Sequence[Any]) -> KeyBatch[Any]:
    """The batch of distinct valid keys of ``keys`` (no values)."""
    return KeyBatch(keys, None, to_key)


def each_position(batch: KeyBatch[Any], consume: Any) -> Any:
    """``consume(index, view)`` for the distinct keys of ``batch``, as a consumer that hands
    each view to the caller's ``consume`` at every position of that key."""
    repeats: dict[int, list[int]] = {}
    for position, first in batch.repeats:
        repeats.setdefault(first, []).append(position)

    def consume_all(index: int, view: memoryview) -> None:
        consume(batch.positions[index], view)
        for position in repeats.get(index, ()):
            consume(position, view)
    return consume_all


class WriteRequest:
    """A batch write: distinct keys with their regions and sizes (empty objects refused)."""

    def __init__(self, keys: Sequence[Any], regions: Sequence[Regions | None]) -> None:
        same_length(keys, regions)
        batch = self.batch = KeyBatch(keys, regions, to_key)
        self.sizes = [total_bytes(r) for r in batch.values]
        for index in reversed(range(len(self.sizes))):
            if self.sizes[index] == 0:  # objects are never empty
                batch.refuse(index, Status.INVALID_ARGUMENT)
                del self.sizes[index]

    def finish(self, statuses: Sequence[Status]) -> list[Status]:
        """Per position of the caller's batch."""
        return self.batch.spread(statuses)


class SizedRequest:
    """A batch of distinct keys with positive int sizes (caller-moved writes)."""

    def __init__(self, keys: Sequence[Any], sizes: Sequence[Any]) -> None:
        same_length(keys, sizes)
        ok = [s if not isinstance(s, bool) and isinstance(s, int) and s > 0 else None
              for s in sizes]
        self.batch: KeyBatch[int] = KeyBatch(keys, ok, to_key)

    def position_of(self, index: int) -> int:
        """The caller's position of distinct key ``index``."""
        return self.batch.positions[index]


class OneRead:
    """A read of one valid key into ``dst`` (or into fresh bytes, ``dst`` None): what
    ``ReadRequest`` does for a batch of one, without its batch bookkeeping (single gets are
    the hot path)."""

    __slots__ = ("keys", "fresh", "_dst", "_have_bytes")

    def __init__(self, key: bytes, dst: Regions | None) -> None:
        self.keys = [key]
        self.fresh = b""  # the bytes read, when dst is None
        self._dst = dst
        self._have_bytes = 0 if dst is None else total_bytes(dst)

    def dst_for(self, index: int, size_bytes: int) -> Regions | Status:
        """Where the driver puts the bytes (``DstFor`` of a batch of one)."""
        if self._dst is None:
            self.fresh, view = alloc_bytes(size_bytes)
            return [view]
        return _fit(self._dst, self._have_bytes, size_bytes)


class ReadRequest:
    """A batch read into the caller's regions (``dsts``, a Status for an unusable one) or into
    fresh bytes (``dsts`` None)."""

    def __init__(self, keys: Sequence[Any], dsts: Sequence[Regions | Status] | None) -> None:
        if dsts is not None:
            same_length(keys, dsts)
        self.batch = key_batch(keys)
        self._dsts = dsts
        self.fresh: dict[int, bytes] = {}  # position -> the bytes read, when dsts is None
        positions = self.batch.positions
        self.dst_sizes = None if dsts is None else [
            0 if isinstance(dsts[p], Status) else total_bytes(dsts[p])  # type: ignore[arg-type]
            for p in positions]

    @property
    def dst_for(self) -> DstFor:
        """Where the driver puts distinct key ``index``'s bytes."""
        positions, dsts, sizes = self.batch.positions, self._dsts, self.dst_sizes

        def dst_for(index: int, size_bytes: int) -> Regions | Status:
            position = positions[index]
            if dsts is None:
                obj, view = alloc_bytes(size_bytes)
                self.fresh[position] = obj
                return [view]
            assert sizes is not None
            return _fit(dsts[position], sizes[index], size_bytes)
        return dst_for

    def finish(self, results: Sequence[int]) -> list[int]:
        """Per position of the caller's batch: bytes read or a negative Status (a repeated key
        gets a copy of its first occurrence's bytes; where either is memory named by address,
        device memory this process cannot copy, the repeat fails with INVALID_ARGUMENT)."""
        out: list[int] = self.batch.spread(results, int)
        for position, first in self.batch.repeats:
            size_bytes = out[position]
            if size_bytes < 0:
                continue
            source_position = self.batch.positions[first]
            if self._dsts is None:
                self.fresh[position] = self.fresh[source_position]
                continue
            dst = _fit(self._dsts[position], _size_of(self._dsts[position]), size_bytes)
            if isinstance(dst, Status):
                out[position] = int(dst)
                continue
            source = trim_regions(self._dsts[source_position], size_bytes)  # type: ignore[arg-type]
            if by_address(dst) or by_address(source):
                out[position] = int(Status.INVALID_ARGUMENT)
                continue
            _copy_regions(dst, source)
        return out

    def objects(self, results: Sequence[int]) -> list[bytes | None]:
        """The fresh bytes per position, None where the read failed."""
        return [self.fresh.get(p, b"") if r >= 0 else None for p, r in enumerate(results)]


def _size_of(dst: Regions | Status) -> int:
    return 0 if isinstance(dst, Status) else total_bytes(dst)


def _fit(dst: Regions | Status, have_bytes: int, size_bytes: int) -> Regions | Status:
    if isinstance(dst, Status):
        return dst
    if have_bytes < size_bytes:
        return Status.BUFFER_OVERFLOW
    return dst if have_bytes == size_bytes and len(dst) == 1 else trim_regions(dst, size_bytes)


def _copy_regions(dst: Regions, src: Regions) -> None:
    """Copy the concatenation of ``src`` into ``dst`` (same total size), piece by piece."""
    sources = iter(src)
    source = memoryview(b"")
    for view in dst:
        filled = 0
        while filled < view.nbytes:
            if not source.nbytes:
                source = next(sources)
            take = min(view.nbytes - filled, source.nbytes)
            view[filled:filled + take] = source[:take]
            source = source[take:]
            filled += take
