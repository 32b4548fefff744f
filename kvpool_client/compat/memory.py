"""Registered memory regions behind raw pointers, and the byte views transfers use.

Rules of this file:
- Mooncake callers pass integers: ``register_buffer(ptr, size)`` once, then pointers inside
  those regions on every transfer. Every pointer range a transfer names must lie inside one
  registered region; anything else is ``INVALID_ARGUMENT`` before a byte moves (Mooncake itself
  would read or write wherever the pointer points).
- A region is host memory when this process maps it readable (``/proc/self/maps``); otherwise a
  device runtime (``devices.py``) must claim it. Host regions are viewed in place, without
  copies; device regions are staged through host buffers around each transfer.
- Registration is idempotent for the same (ptr, size). Overlapping registrations are allowed
  (a pointer is resolved in any region that holds the whole range); unregistering an address
  that was never registered is ``INVALID_ARGUMENT``.
- The registry is shared by every thread: changes build a new sorted index under the lock and
  publish it in one assignment, so lookups take no lock and copy nothing.
- Device ranges are staged in host buffers: fresh ones by default, or, inside
  ``with registry.staging():`` (a connector call that is done with its views when it returns),
  slices of a per-thread arena reused call after call, so staging pays no page faults twice.
"""

from __future__ import annotations

import bisect
import contextlib
import ctypes
import functools
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvpool_client.compat.devices import (
    DeviceMemory,
    DeviceRuntime,
    default_runtimes,
    locate_device,
)
from kvpool_client.core.regions import AddressRange
from kvpool_wire.status import KVPoolError, Status

#: a transfer region as Mooncake passes it: (address, size in bytes)
PointerRange = tuple[int, int]


@dataclass(frozen=True, slots=True)
class Region:
    """One registered range: host memory (``view`` set) or device memory (``device`` set)."""

    address: int
    size_bytes: int
    writable: bool
    view: memoryview | None = None
    device: DeviceMemory | None = None

    @property
    def kind(self) -> str:
        """``"host"`` or the device runtime's name (``"cuda"``, ``"npu"``)."""
        return "host" if self.device is None else self.device.runtime.name

    def contains(self, address: int, size_bytes: int) -> bool:
        """True when ``[address, address+size_bytes)`` lies inside this region."""
        return self.address <= address and address + size_bytes <= self.address + self.size_bytes

    def host_view(self, address: int, size_bytes: int) -> memoryview | None:
        """The bytes ``[address, address+size_bytes)`` of this host region (a range inside it),
        or None for device memory."""
        if self.view is None:
            return None
        offset = address - self.address
        return self.view[offset:offset + size_bytes]


@dataclass(frozen=True, slots=True)
class ProcessMaps:
    """This process's memory mappings (``/proc/self/maps``), sorted by address."""

    lows: list[int]
    highs: list[int]
    perms: list[str]

    @classmethod
    def parse(cls, text: str) -> ProcessMaps:
        """Return the mappings listed in ``text`` (the format of ``/proc/<pid>/maps``)."""
        lows, highs, perms = [], [], []
        for line in text.splitlines():
            fields = line.split(maxsplit=2)
            if len(fields) < 2:
                continue
            low_text, _, high_text = fields[0].partition("-")
            lows.append(int(low_text, 16))
            highs.append(int(high_text, 16))
            perms.append(fields[1])
        return cls(lows, highs, perms)

    @classmethod
    def read(cls) -> ProcessMaps | None:
        """Return the current mappings, or None where ``/proc/self/maps`` does not exist."""
        try:
            with open("/proc/self/maps", encoding="ascii") as f:
                return cls.parse(f.read())
        except OSError:  # pragma: no cover - Linux always has it
            return None

    def access(self, address: int, size_bytes: int) -> bool | None:
        """Return None when part of the range is unmapped or unreadable, else whether all of
        it is writable."""
        end = address + max(size_bytes, 1)
        index = bisect.bisect_right(self.lows, address) - 1
        if index < 0:
            return None
        cursor, writable = address, True
        while cursor < end:
            if index >= len(self.lows) or self.lows[index] > cursor or \
                    self.highs[index] <= cursor or self.perms[index][0] != "r":
                return None  # a hole in the range, or unreadable pages
            writable = writable and self.perms[index][1] == "w"
            cursor = self.highs[index]
            index += 1
        return writable


_EMPTY = memoryview(b"")


def view_at(address: int, size_bytes: int) -> memoryview:
    """Return an unsigned-byte view of host memory at ``address`` (the caller checked it)."""
    return memoryview((ctypes.c_ubyte * size_bytes).from_address(address)).cast("B")


@dataclass(slots=True)
class _Staged:
    """Device ranges of one device staged through one host buffer, back to back."""

    device: DeviceMemory
    buffer: memoryview
    #: (offset in the object, device address, size) of each range, in buffer order
    ranges: list[tuple[int, int, int]] = field(default_factory=list)


#: Most staging memory one thread's arena keeps between calls.
ARENA_MAX_BYTES = 256 << 20
#: Smallest buffer an arena adds.
ARENA_CHUNK_BYTES = 16 << 20


class _Arena(threading.local):
    """One thread's reusable staging buffers: a bump allocator reset when its scope ends."""

    def __init__(self) -> None:
        self.chunks: list[bytearray] = []
        self.depth = 0  # nested staging() scopes open on this thread
        self.index = 0  # chunk being filled
        self.offset = 0  # bytes of it handed out

    def take(self, size_bytes: int) -> memoryview:
        """A view of ``size_bytes`` staging bytes, valid until the outermost scope ends (a
        fresh buffer outside any scope or beyond the arena's limit)."""
        if self.depth == 0:
            return memoryview(bytearray(size_bytes))
        while self.index < len(self.chunks):
            chunk = self.chunks[self.index]
            if len(chunk) - self.offset >= size_bytes:
                self.offset += size_bytes
                return memoryview(chunk)[self.offset - size_bytes:self.offset]
            self.index, self.offset = self.index + 1, 0
        size = max(size_bytes, ARENA_CHUNK_BYTES)
        if sum(map(len, self.chunks)) + size > ARENA_MAX_BYTES:
            return memoryview(bytearray(size_bytes))
        self.chunks.append(bytearray(size))
        self.index, self.offset = len(self.chunks) - 1, size_bytes
        return memoryview(self.chunks[-1])[:size_bytes]


#: a device range awaiting staging: (index in the views, device, address, size, offset in the
#: object)
_Pending = tuple[int, DeviceMemory, int, int, int]


def _stage(views: list[memoryview], pending: list[_Pending], arena: _Arena
           ) -> tuple[list[memoryview], list[_Staged]]:
    """Stage the pending device ranges in one buffer per device; return the object's views,
    with each run of consecutive staged ranges of one device as one view (the same bytes,
    fewer and larger copies), and the groups."""
    sizes: dict[tuple[int, Any], int] = {}
    for _, device, _, size, _ in pending:
        key = (id(device.runtime), device.handle)
        sizes[key] = sizes.get(key, 0) + size
    groups: dict[tuple[int, Any], _Staged] = {}
    filled: dict[tuple[int, Any], int] = {}  # bytes of each group's buffer handed out
    spans: dict[int, tuple[_Staged, int, int]] = {}  # view index -> (group, start, end)
    for index, device, address, size, object_offset in pending:
        key = (id(device.runtime), device.handle)
        group = groups.get(key)
        if group is None:
            group = groups[key] = _Staged(device, arena.take(sizes[key]))
        start = filled.get(key, 0)
        filled[key] = start + size
        spans[index] = (group, start, start + size)
        group.ranges.append((object_offset, address, size))
    merged: list[memoryview] = []
    run: tuple[_Staged, int, int] | None = None
    for index, view in enumerate(views):
        span = spans.get(index)
        if span is not None and run is not None and run[0] is span[0] and run[2] == span[1]:
            run = (run[0], run[1], span[2])
            merged[-1] = run[0].buffer[run[1]:run[2]]
        elif span is not None:
            run = span
            merged.append(span[0].buffer[span[1]:span[2]])
        else:
            run = None
            merged.append(view)
    return merged, list(groups.values())


@dataclass(slots=True)
class Destination:
    """Views a read fills, and the device copies that must follow it (see :meth:`finish`)."""

    #: what the read fills: host ranges in place, device ranges as staging (runs merged)
    views: list[memoryview]
    #: the staging buffers, one group per device
    staged: list[_Staged] = field(default_factory=list)

    def finish(self, nbytes_read: int) -> None:
        """Copy the first ``nbytes_read`` bytes of staged views to their device memory."""
        if not self.staged:
            return
        for group in self.staged:
            # a read fills a prefix of the object, so the bytes to copy are a prefix of the
            # group's buffer
            ranges = []
            for object_offset, address, size in group.ranges:
                take = min(size, nbytes_read - object_offset)
                if take > 0:
                    ranges.append((address, take))
            if ranges:
                nbytes = sum(size for _, size in ranges)
                group.device.runtime.from_host(group.device.handle, group.buffer[:nbytes],
                                               ranges)


class RegionRegistry:
    """The regions registered by one store (or shared by every store of one TransferEngine)."""

    def __init__(self, runtimes: Callable[[], list[DeviceRuntime]] = default_runtimes,
                 maps_reader: Callable[[], ProcessMaps | None] = ProcessMaps.read) -> None:
        self._lock = threading.Lock()
        self._runtimes = runtimes
        self._maps_reader = maps_reader
        # (addresses, regions) sorted by address, replaced as a whole on every change
        self._index: tuple[list[int], list[Region]] = ([], [])
        self._arena = _Arena()

    @contextlib.contextmanager
    def staging(self) -> Iterator[None]:
        """A scope whose device staging comes from this thread's reusable arena: every view
        that ``sources`` and ``destination`` return inside it, and every ``finish``, must be
        done with before it ends."""
        arena = self._arena
        arena.depth += 1
        try:
            yield
        finally:
            arena.depth -= 1
            if arena.depth == 0:
                arena.index = arena.offset = 0

    def register(self, address: int, size_bytes: int) -> Region:
        """Register ``[address, address+size_bytes)`` and return its region.

        Raises ``INVALID_ARGUMENT`` for a non-positive size, a null address, or memory that is
        neither host memory of this process nor claimed by a device runtime.
        """
        _check_range(address, size_bytes)
        for region in self._regions_at(address):
            if region.size_bytes == size_bytes:
                return region
        region = self.classify(address, size_bytes, self._maps_reader())
        with self._lock:
            addresses, regions = list(self._index[0]), list(self._index[1])
            index = bisect.bisect_right(addresses, address)
            addresses.insert(index, address)
            regions.insert(index, region)
            self._index = (addresses, regions)
        return region

    def classify(self, address: int, size_bytes: int, maps: ProcessMaps | None) -> Region:
        """Return an unregistered region for the range: host memory when ``maps`` shows it
        readable, else device memory a runtime claims; ``INVALID_ARGUMENT`` otherwise."""
        writable = True if maps is None else maps.access(address, size_bytes)
        if writable is not None:
            return Region(address, size_bytes, writable, view=view_at(address, size_bytes))
        device = locate_device(address, size_bytes, self._runtimes())
        return Region(address, size_bytes, True, device=device)

    def unregister(self, address: int) -> None:
        """Forget every region registered at ``address``; ``INVALID_ARGUMENT`` if there is none."""
        with self._lock:
            addresses, regions = self._index
            low = bisect.bisect_left(addresses, address)
            high = bisect.bisect_right(addresses, address)
            if low == high:
                raise KVPoolError(Status.INVALID_ARGUMENT,
                                  f"no buffer is registered at 0x{address:x}")
            self._index = (addresses[:low] + addresses[high:], regions[:low] + regions[high:])

    def clear(self) -> None:
        """Forget every region."""
        with self._lock:
            self._index = ([], [])

    def __len__(self) -> int:
        return len(self._index[1])

    def find(self, address: int, size_bytes: int) -> Region:
        """Return a registered region holding the whole range; ``INVALID_ARGUMENT`` when none
        does."""
        _check_range(address, size_bytes, allow_empty=True)
        addresses, regions = self._index
        index = bisect.bisect_right(addresses, address) - 1
        while index >= 0:
            region = regions[index]
            if region.contains(address, size_bytes):
                return region
            index -= 1
        raise KVPoolError(Status.INVALID_ARGUMENT,
                          f"range 0x{address:x}+{size_bytes} is not inside a registered buffer "
                          "(call register_buffer(ptr, size) on the memory first)")

    def device_ranges(self, ranges: Sequence[PointerRange]) -> list[AddressRange] | None:
        """The ranges as ``AddressRange`` regions when every one lies in a registered device
        region (a transfer engine then moves them in place), else None."""
        out: list[AddressRange] = []
        for address, size_bytes in ranges:
            try:
                region = self.find(address, size_bytes)
            except KVPoolError:
                return None
            if region.device is None:
                return None
            out.append(AddressRange(address, size_bytes))
        return out or None

    def sources(self, ranges: Sequence[PointerRange], *,
                registered_only: bool = True) -> list[memoryview]:
        """Return views whose concatenation is the bytes of ``ranges``: host ranges in place,
        device ranges copied to host first (consecutive ones of one device in one view).

        With ``registered_only=False`` a range outside every region is classified on the spot
        (MindIE's non-direct Ascend calls never register). Raises ``INVALID_ARGUMENT`` for a
        range nobody can read, ``TRANSFER_FAILED`` when a device copy fails.
        """
        views, pending = self._views(ranges, registered_only, writing=False)
        views, groups = _stage(views, pending, self._arena)
        for group in groups:
            group.device.runtime.to_host(group.device.handle, group.buffer,
                                         [(address, size) for _, address, size in group.ranges])
        return views

    def destination(self, ranges: Sequence[PointerRange], *,
                    registered_only: bool = True) -> Destination:
        """Return the views a read fills for ``ranges``; call ``finish`` after the read.

        Raises ``INVALID_ARGUMENT`` for a range outside every region or in read-only memory.
        """
        views, pending = self._views(ranges, registered_only, writing=True)
        return Destination(*_stage(views, pending, self._arena))

    def write_at(self, address: int, data: memoryview) -> None:
        """Copy ``data`` to registered memory at ``address`` (device memory through staging).
        Raises like ``destination``."""
        dest = self.destination([(address, data.nbytes)])
        at = 0
        for view in dest.views:
            view[:] = data[at:at + view.nbytes]
            at += view.nbytes
        dest.finish(data.nbytes)

    def read_into(self, address: int, into: memoryview) -> None:
        """Copy ``into.nbytes`` bytes of registered memory at ``address`` into ``into``.
        Raises like ``sources``."""
        at = 0
        for view in self.sources([(address, into.nbytes)]):
            into[at:at + view.nbytes] = view
            at += view.nbytes

    def _views(self, ranges: Sequence[PointerRange], registered_only: bool, *, writing: bool
               ) -> tuple[list[memoryview], list[_Pending]]:
        """Views of the host ranges (placeholders for device ranges), and the device ranges
        to stage."""
        locate = self._locator(registered_only)
        views: list[memoryview] = []
        pending: list[_Pending] = []
        object_offset = 0
        for address, size_bytes in ranges:
            region = locate(address, size_bytes)
            if writing and not region.writable:
                raise KVPoolError(Status.INVALID_ARGUMENT,
                                  f"range 0x{address:x}+{size_bytes} is read-only memory")
            view = region.host_view(address, size_bytes)
            if view is not None:
                views.append(view)
            else:
                assert region.device is not None
                pending.append((len(views), region.device, address, size_bytes, object_offset))
                views.append(_EMPTY)
            object_offset += size_bytes
        return views, pending

    def _locator(self, registered_only: bool) -> Callable[[int, int], Region]:
        if registered_only:
            return self.find
        maps: list[ProcessMaps | None] = []

        def locate(address: int, size_bytes: int) -> Region:
            _check_range(address, size_bytes, allow_empty=True)
            try:
                return self.find(address, size_bytes)
            except KVPoolError:
                if not maps:
                    maps.append(self._maps_reader())  # read once per call
                return self.classify(address, size_bytes, maps[0])

        return locate

    def _regions_at(self, address: int) -> list[Region]:
        addresses, regions = self._index
        low = bisect.bisect_left(addresses, address)
        high = bisect.bisect_right(addresses, address)
        return regions[low:high]


def staged(method: Callable[..., Any]) -> Callable[..., Any]:
    """Run a connector method inside ``self._registry.staging()`` (it must be done with every
    staged view when it returns)."""

    @functools.wraps(method)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        with self._registry.staging():
            return method(self, *args, **kwargs)

    return wrapper


def _check_range(address: object, size_bytes: object, *, allow_empty: bool = False) -> None:
    if isinstance(address, bool) or not isinstance(address, int) or \
            isinstance(size_bytes, bool) or not isinstance(size_bytes, int):
        raise KVPoolError(Status.INVALID_ARGUMENT, "a pointer and a size are integers")
    if address <= 0 or size_bytes < 0 or (size_bytes == 0 and not allow_empty):
        raise KVPoolError(Status.INVALID_ARGUMENT,
                          f"bad buffer range: address 0x{address:x}, size {size_bytes}")
