"""Registered regions behind raw pointers: host views, bounds, device staging.

CUDA and Ascend NPU memory cannot exist on this machine, so the device tests use a fake
runtime that stands in for libcudart / ACL (it "owns" a range of addresses no host mapping
covers and copies to and from a bytearray); the real runtimes are checked on hardware.
"""

from __future__ import annotations

import ctypes
import gc
import threading
from typing import Any

import pytest

from kvpool_client.compat.devices import DeviceMemory, locate_device
from kvpool_client.compat.memory import ProcessMaps, RegionRegistry
from kvpool_wire.status import KVPoolError, Status

MAPS = """\
00400000-00452000 r-xp 00000000 08:02 173521      /usr/bin/python3
00651000-00652000 r--p 00051000 08:02 173521      /usr/bin/python3
00652000-00655000 rw-p 00052000 08:02 173521      /usr/bin/python3
00655000-00700000 rw-p 00000000 00:00 0           [heap]
7f0000000000-7f0000100000 ---p 00000000 00:00 0
7ffff7dd3000-7ffff7dfc000 r-xp 00000000 08:02 135522  /lib/ld.so
"""


def test_maps_access_covers_adjacent_mappings_and_reports_writability() -> None:
    maps = ProcessMaps.parse(MAPS)
    assert maps.access(0x652000, 0x1000) is True
    assert maps.access(0x654000, 0x2000) is True  # spans rw-p then [heap], both writable
    assert maps.access(0x651000, 0x2000) is False  # r--p then rw-p: readable, not writable
    assert maps.access(0x400000, 0x10) is False  # code: r-x
    assert maps.access(0x6ff000, 0x2000) is None  # runs past the heap into a hole
    assert maps.access(0x7F0000000000, 16) is None  # reserved, unreadable (---p)
    assert maps.access(0x1000, 16) is None  # below every mapping


def test_maps_of_this_process_see_a_ctypes_buffer() -> None:
    buf = ctypes.create_string_buffer(4096)
    maps = ProcessMaps.read()
    assert maps is not None
    assert maps.access(ctypes.addressof(buf), 4096) is True


def test_register_find_and_views_alias_the_memory() -> None:
    buf = ctypes.create_string_buffer(b"0123456789abcdef", 16)
    base = ctypes.addressof(buf)
    registry = RegionRegistry(runtimes=lambda: [])
    region = registry.register(base, 16)
    assert region.kind == "host" and region.writable
    assert registry.register(base, 16) is region  # idempotent
    assert len(registry) == 1
    (view,) = registry.sources([(base + 4, 6)])
    assert bytes(view) == b"456789"
    dest = registry.destination([(base + 10, 3)])
    dest.views[0][:] = b"XYZ"
    dest.finish(3)
    assert buf.raw[:16] == b"0123456789XYZdef"


def test_ranges_outside_registered_memory_are_refused_before_anything_moves() -> None:
    buf = ctypes.create_string_buffer(64)
    base = ctypes.addressof(buf)
    registry = RegionRegistry(runtimes=lambda: [])
    registry.register(base, 32)
    for address, size in ((base + 30, 4), (base + 32, 1), (base - 1, 2), (0, 4)):
        with pytest.raises(KVPoolError) as info:
            registry.sources([(address, size)])
        assert info.value.status == Status.INVALID_ARGUMENT
    with pytest.raises(KVPoolError):
        registry.destination([(base, 8), (base + 40, 8)])
    assert buf.raw == b"\0" * 64


def test_bad_registrations_and_unregister() -> None:
    buf = ctypes.create_string_buffer(64)
    base = ctypes.addressof(buf)
    registry = RegionRegistry(runtimes=lambda: [])
    for address, size in ((base, 0), (base, -1), (0, 8), ("x", 8), (base, 1.5), (True, 8)):
        with pytest.raises(KVPoolError) as info:
            registry.register(address, size)  # type: ignore[arg-type]
        assert info.value.status == Status.INVALID_ARGUMENT
    assert len(registry) == 0
    with pytest.raises(KVPoolError) as info:
        registry.unregister(base)
    assert info.value.status == Status.INVALID_ARGUMENT
    registry.register(base, 64)
    registry.register(base, 16)  # a second, overlapping region at the same address
    registry.unregister(base)
    assert len(registry) == 0
    with pytest.raises(KVPoolError):
        registry.find(base, 8)


def test_overlapping_regions_resolve_in_the_one_that_holds_the_range() -> None:
    buf = ctypes.create_string_buffer(bytes(range(64)), 64)
    base = ctypes.addressof(buf)
    registry = RegionRegistry(runtimes=lambda: [])
    registry.register(base, 64)
    registry.register(base + 8, 8)
    (view,) = registry.sources([(base + 12, 20)])  # outside the small one, inside the big one
    assert bytes(view) == bytes(range(12, 32))


def test_unmapped_memory_without_a_device_runtime_names_what_is_missing() -> None:
    registry = RegionRegistry(runtimes=lambda: [])
    with pytest.raises(KVPoolError) as info:
        registry.register(0x10, 4096)  # page zero is never mapped
    assert info.value.status == Status.INVALID_ARGUMENT
    assert "torch built with CUDA" in info.value.message
    assert "'acl'" in info.value.message


def test_read_only_memory_cannot_be_a_read_destination() -> None:
    maps = ProcessMaps.parse(MAPS)
    registry = RegionRegistry(runtimes=lambda: [], maps_reader=lambda: maps)
    # the r--p page of MAPS; the views are never touched by this test
    region = registry.register(0x651000, 0x1000)
    assert not region.writable
    registry.sources([(0x651000, 0)])
    with pytest.raises(KVPoolError) as info:
        registry.destination([(0x651000, 16)])
    assert "read-only" in info.value.message


class FakeDevice:
    """Stands in for a CUDA/NPU runtime: owns [base, base+size) and keeps its bytes here."""

    name = "fake"

    def __init__(self, base: int, size: int) -> None:
        self.base = base
        self.memory = bytearray(size)
        self.copies: list[str] = []

    def locate(self, address: int) -> object | None:
        return "ctx" if self.base <= address < self.base + len(self.memory) else None

    def to_host(self, handle: object, dst: memoryview, src_ranges: list[tuple[int, int]]
                ) -> None:
        assert handle == "ctx" and dst.nbytes == sum(size for _, size in src_ranges)
        cursor = 0
        for address, size in src_ranges:
            offset = address - self.base
            dst[cursor:cursor + size] = self.memory[offset:offset + size]
            cursor += size
        self.copies.append(f"d2h x{len(src_ranges)}")

    def from_host(self, handle: object, src: memoryview, dst_ranges: list[tuple[int, int]]
                  ) -> None:
        assert src.nbytes == sum(size for _, size in dst_ranges)
        cursor = 0
        for address, size in dst_ranges:
            offset = address - self.base
            self.memory[offset:offset + size] = src[cursor:cursor + size]
            cursor += size
        self.copies.append(f"h2d x{len(dst_ranges)}")


def test_device_regions_are_staged_through_host_memory() -> None:
    device = FakeDevice(0x7F0000000000, 1024)
    device.memory[100:110] = b"devicedata"
    registry = RegionRegistry(runtimes=lambda: [device],
                              maps_reader=lambda: ProcessMaps.parse(MAPS))
    region = registry.register(0x7F0000000000, 1024)
    assert region.kind == "fake" and region.view is None
    (view,) = registry.sources([(0x7F0000000000 + 100, 10)])
    assert bytes(view) == b"devicedata" and device.copies == ["d2h x1"]

    dest = registry.destination([(0x7F0000000000 + 200, 6), (0x7F0000000000 + 300, 6)])
    (staging,) = dest.views  # two consecutive device ranges: one staging view
    staging[:] = b"abcdefghijkl"
    dest.finish(9)  # only 9 bytes were read: the second staged view is copied back in part
    assert device.memory[200:206] == b"abcdef"
    assert device.memory[300:306] == b"ghi\0\0\0"
    assert device.copies[1:] == ["h2d x2"]  # one call for both ranges


def test_a_calls_device_ranges_are_staged_together_around_its_host_ranges() -> None:
    device = FakeDevice(0x7F0000000000, 1024)
    device.memory[0:8] = b"K0K0K0K0"
    device.memory[512:516] = b"V0V0"
    host = ctypes.create_string_buffer(b"hosthost", 8)
    maps = ProcessMaps.parse(f"{ctypes.addressof(host):x}-{ctypes.addressof(host) + 8:x} rw-p")
    registry = RegionRegistry(runtimes=lambda: [device], maps_reader=lambda: maps)
    registry.register(0x7F0000000000, 1024)
    registry.register(ctypes.addressof(host), 8)
    ranges = [(0x7F0000000000, 8), (ctypes.addressof(host), 8), (0x7F0000000000 + 512, 4)]
    views = registry.sources(ranges)
    assert [bytes(v) for v in views] == [b"K0K0K0K0", b"hosthost", b"V0V0"]
    assert device.copies == ["d2h x2"]  # both device ranges in one call, one host buffer
    assert views[0].obj is views[2].obj

    dest = registry.destination(ranges)
    for v, data in zip(dest.views, (b"k1k1k1k1", b"HOSTHOST", b"v1v1"), strict=True):
        v[:] = data
    dest.finish(20)
    assert device.memory[0:8] == b"k1k1k1k1" and device.memory[512:516] == b"v1v1"
    assert host.raw == b"HOSTHOST" and device.copies[1:] == ["h2d x2"]
    dest.finish(0)  # nothing read: nothing copied
    assert device.copies[1:] == ["h2d x2"]


def test_locate_device_uses_the_first_runtime_that_claims_the_pointer() -> None:
    first, second = FakeDevice(0x1000, 16), FakeDevice(0x2000, 16)
    found = locate_device(0x2004, 4, [first, second])
    assert found == DeviceMemory(second, "ctx")
    with pytest.raises(KVPoolError) as info:
        locate_device(0x3000, 4, [first, second])
    assert "present: fake, fake" in info.value.message


def test_unregistered_ranges_are_classified_only_when_asked() -> None:
    buf = ctypes.create_string_buffer(b"hello", 8)
    registry = RegionRegistry(runtimes=lambda: [])
    address = ctypes.addressof(buf)
    with pytest.raises(KVPoolError):
        registry.sources([(address, 5)])
    (view,) = registry.sources([(address, 5)], registered_only=False)
    assert bytes(view) == b"hello"
    assert len(registry) == 0  # classifying does not register
    with pytest.raises(KVPoolError):
        registry.sources([(0x10, 5)], registered_only=False)


def test_cuda_pointer_query_struct_holds_cuda13_layout_and_the_loaded_runtime_is_found() -> None:
    from kvpool_client.compat.devices import _CudaPointerAttributes, _mapped_libraries

    # CUDA 13 writes 4 + 4 + 8 + 8 + 8 * 8 bytes; a smaller struct is overrun on every query
    assert ctypes.sizeof(_CudaPointerAttributes) >= 88
    assert _CudaPointerAttributes().reserved[7] == 0  # "must be zero"
    libc = _mapped_libraries("libc.so")
    assert libc and all(path.startswith("/") and "/libc.so" in path for path in libc)
    assert _mapped_libraries("libnot-a-library-kvpool") == []


class FakeCudaLib:
    """The few libcudart entry points the scratch buffer uses (plain functions, as ctypes
    gives them: the runtime sets their ``argtypes``), keeping count of device memory handed
    out and given back."""

    def __init__(self) -> None:
        self.live: dict[int, int] = {}  # address -> size
        self.freed: list[int] = []
        next_address = [0x7000_0000_0000]

        def malloc(pointer: Any, size: int) -> int:
            pointer._obj.value = next_address[0]
            self.live[next_address[0]] = size
            next_address[0] += size
            return 0

        def free(pointer: ctypes.c_void_p) -> int:
            assert pointer.value in self.live, "freed twice or never allocated"
            del self.live[pointer.value]
            self.freed.append(pointer.value)
            return 0

        self.cudaMalloc, self.cudaFree = malloc, free

    def __getattr__(self, name: str) -> Any:  # any other entry point: present, succeeds
        def call(*args: Any) -> int:
            return 0
        setattr(self, name, call)
        return call


def test_cuda_scratch_is_kept_per_thread_and_freed_when_the_thread_ends() -> None:
    from kvpool_client.compat.devices import CudaRuntime

    lib = FakeCudaLib()
    runtime = CudaRuntime(lib)
    seen: list[int | None] = []
    held: list[int] = []  # device memory while the worker still ran

    def work() -> None:
        first = runtime._scratch(0, 4 << 20)
        seen.extend([first, runtime._scratch(0, 1 << 20)])  # reused: large enough
        seen.append(runtime._scratch(0, 8 << 20))  # grown: the smaller one goes at once
        held.extend(lib.live)

    mine = runtime._scratch(0, 2 << 20)  # this thread's own, kept while it runs
    worker = threading.Thread(target=work)
    worker.start()
    worker.join(10)
    gc.collect()
    assert seen[0] == seen[1] and seen[2] not in (None, seen[0])
    assert sorted(held) == sorted([mine, seen[2]])  # the grown one replaced the first
    assert list(lib.live) == [mine]  # the worker's scratch went with the worker
    assert sorted(lib.freed) == sorted([seen[0], seen[2]])


def test_staging_scopes_reuse_one_threads_arena_and_never_hand_out_overlapping_views() -> None:
    from kvpool_client.compat.memory import ARENA_MAX_BYTES

    device = FakeDevice(0x7F0000000000, 4096)
    device.memory[:] = bytes(range(256)) * 16
    registry = RegionRegistry(runtimes=lambda: [device],
                              maps_reader=lambda: ProcessMaps.parse(MAPS))
    registry.register(0x7F0000000000, 4096)
    base = 0x7F0000000000

    def addresses(views: list[memoryview]) -> list[int]:
        return [ctypes.addressof(ctypes.c_char.from_buffer(v)) for v in views]

    with registry.staging():
        first = registry.sources([(base, 100), (base + 1000, 50)])
        assert len(first) == 1 and first[0].nbytes == 150  # one device: one merged view
        with registry.staging():  # nested: still the same scope
            second = registry.destination([(base + 2000, 300)])
        third = registry.sources([(base + 3000, 10)])
        spans = sorted((a, a + v.nbytes) for a, v in zip(
            addresses([*first, *second.views, *third]), [*first, *second.views, *third],
            strict=True))
        assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:], strict=False))
        assert bytes(first[0][100:]) == bytes(device.memory[1000:1050])
        assert bytes(third[0]) == bytes(device.memory[3000:3010])
        reused = addresses(first)[0]
    with registry.staging():  # the next call starts at the same place
        assert addresses(registry.sources([(base + 5, 8)]))[0] == reused
    outside = registry.sources([(base, 8)])  # no scope: a fresh buffer
    assert addresses(outside)[0] != reused and bytes(outside[0]) == bytes(device.memory[:8])
    assert ARENA_MAX_BYTES >= 16 << 20
