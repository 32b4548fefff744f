"""Pages of segments: huge pages where the host gives them (4 KiB and a warning where not), and a
peer's segment populated in the background once mapped, a chunk at a time, never holding a
mapping that was let go. Real shared memory and the kernel's own account (/proc/self/smaps)."""

from __future__ import annotations

import ctypes
import dataclasses
import errno
import logging
import mmap
import os
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest

from kvpool_client import pages
from kvpool_client.segments import HEADER_BYTES, SHM_DIR, LocalSegment
from kvpool_client.transfer import ShmTransport
from kvpool_client.transfer.copy import ParallelCopier
from kvpool_wire.capability import ownership_proof
from kvpool_wire.status import KVPoolError, Status
from kvpool_wire.types import Placement, SegmentInfo

KEY = b"k" * 32
SEGMENT_BYTES = 3 * pages.POPULATE_CHUNK_BYTES // 2  # two chunks: the second one is partial


def _mappings_of(shm_name: str) -> dict[int, int]:
    """Start address -> resident bytes of every mapping of ``shm_name`` in this process."""
    found: dict[int, int] = {}
    with open("/proc/self/smaps", encoding="ascii", errors="replace") as f:
        address = None
        for line in f:
            head = line.split()
            if head and "-" in head[0] and not head[0].endswith(":"):
                address = int(head[0].split("-")[0], 16) if line.rstrip().endswith(
                    shm_name) or line.rstrip().endswith(f"{shm_name} (deleted)") else None
            elif address is not None and line.startswith("Rss:"):
                found[address] = int(head[1]) * 1024
    return found


def _wait_for(predicate: object, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():  # type: ignore[operator]
            return True
        time.sleep(0.02)
    return bool(predicate())  # type: ignore[operator]


@pytest.fixture
def cluster() -> str:
    return f"test-{uuid.uuid4().hex[:12]}"


@pytest.fixture
def segment(cluster: str) -> Iterator[LocalSegment]:
    seg = LocalSegment.create(cluster, "owner", 0, SEGMENT_BYTES)
    try:
        yield seg
    finally:
        seg.close()


def _descriptor(segment: LocalSegment) -> SegmentInfo:
    segment.stamp_owner(KEY)
    return dataclasses.replace(segment.describe("this-host"), ownership_proof=ownership_proof(
        KEY, segment.segment_id, segment.shm_name, segment.size_bytes))


@pytest.fixture
async def peer() -> AsyncIterator[ShmTransport]:
    transport = ShmTransport(copier=ParallelCopier(num_threads=1))
    try:
        yield transport
    finally:
        await transport.close()


def test_populate_fills_a_mapping_without_changing_a_byte(segment: LocalSegment) -> None:
    segment.buffer[:5] = b"bytes"
    fd = os.open(os.path.join(SHM_DIR, segment.shm_name), os.O_RDWR)
    try:
        second = mmap.mmap(fd, segment.size_bytes)
    finally:
        os.close(fd)
    address = ctypes.addressof(ctypes.c_char.from_buffer(second))
    assert _mappings_of(segment.shm_name)[address] == 0  # nothing touched through it yet
    assert pages.populate(address, segment.size_bytes) == 0
    assert _mappings_of(segment.shm_name)[address] == segment.size_bytes
    assert second[:5] == b"bytes" and segment.buffer[5:9] == bytes(4)
    second.close()


def test_huge_pages_segment_is_whole_zeroed_and_says_what_it_got(
        cluster: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="kvpool_client.segments")
    with LocalSegment.create(cluster, "huge", 0, 8 << 20, huge_pages=True) as seg:
        resident = _mappings_of(seg.shm_name)[seg.address]
        # every page faulted in at creation (but a few a host's proactive reclaim may unmap:
        # test_segments_shm.RECLAIMED_PAGES)
        assert resident >= seg.size_bytes + HEADER_BYTES - 16 * mmap.PAGESIZE
        assert os.stat(os.path.join(SHM_DIR, seg.shm_name)).st_blocks * 512 >= seg.size_bytes
        assert bytes(seg.buffer[:4096]) == bytes(4096) and bytes(seg.buffer[-4096:]) == bytes(4096)
        seg.buffer[-3:] = b"end"
        assert seg.huge_bytes == min(seg.size_bytes, pages.huge_bytes(seg.address))
        if seg.huge_bytes:  # this host's /dev/shm gives 2 MiB pages
            assert seg.huge_bytes == seg.size_bytes
            assert "on 2 MiB pages" in caplog.text
        else:
            assert "continuing on 4 KiB pages" in caplog.text


@pytest.mark.parametrize("huge_pages", [False, True])
def test_a_segment_that_cannot_be_backed_is_no_space_and_leaves_nothing(
        cluster: str, huge_pages: bool) -> None:
    with pytest.raises(KVPoolError) as caught:
        LocalSegment.create(cluster, "too-big", 0, 1 << 50, huge_pages=huge_pages)
    assert caught.value.status == Status.NO_SPACE
    assert not [n for n in os.listdir(SHM_DIR) if f".{cluster}." in f".{n}"]


async def test_a_peer_mapping_written_through_is_populated_in_the_background(
        segment: LocalSegment, peer: ShmTransport) -> None:
    info = _descriptor(segment)

    def peer_resident() -> int:
        return sum(rss for address, rss in _mappings_of(segment.shm_name).items()
                   if address != segment.address)

    out = bytearray(4)
    await peer.read(info, Placement(info.segment_id, 0, 4), [memoryview(out)])
    time.sleep(0.2)
    assert 0 < peer_resident() < 1 << 20  # read from only: not populated
    await peer.write(info, Placement(info.segment_id, 0, 4), [memoryview(b"head")])
    assert segment.buffer[:4] == b"head"
    assert _wait_for(lambda: peer_resident() >= segment.size_bytes)
    assert bytes(segment.buffer[4:4096]) == bytes(4092)  # populating wrote nothing


async def test_without_populate_a_peer_mapping_holds_only_what_was_touched(
        segment: LocalSegment) -> None:
    transport = ShmTransport(copier=ParallelCopier(num_threads=1), populate=False)
    try:
        info = _descriptor(segment)
        await transport.write(info, Placement(info.segment_id, 0, 4), [memoryview(b"head")])
        time.sleep(0.2)
        resident = [rss for address, rss in _mappings_of(segment.shm_name).items()
                    if address != segment.address]
        assert len(resident) == 1 and resident[0] < 1 << 20
    finally:
        await transport.close()


async def test_a_forgotten_mapping_is_unmapped_even_while_populating(segment: LocalSegment,
                                                                     peer: ShmTransport) -> None:
    info = _descriptor(segment)
    await peer.write(info, Placement(info.segment_id, 0, 4), [memoryview(b"head")])
    peer.forget(info.segment_id)
    assert _wait_for(lambda: len(_mappings_of(segment.shm_name)) == 1)  # the owner's only
    assert peer.num_mappings == 0


def test_populator_drops_gone_items_and_stops_after_stop() -> None:
    held: list[str] = []
    released: list[str] = []
    done = threading.Event()

    def hold(item: str) -> tuple[int, int] | None:
        held.append(item)
        if item == "gone":
            return None
        if item == "last":
            done.set()
        return 0, 0  # nothing to populate: a zero-length chunk is not a call

    populator: pages.Populator[str] = pages.Populator(hold, released.append)
    for item in ("gone", "empty", "last"):
        populator.add(item)
    assert done.wait(5)
    assert _wait_for(lambda: released == ["empty", "last"])
    assert held == ["gone", "empty", "last"]
    populator.stop()
    populator.add("after-stop")
    time.sleep(0.05)
    assert held == ["gone", "empty", "last"]


def test_populator_stops_for_good_on_a_kernel_without_populate(
        monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    monkeypatch.setattr(pages, "populate", lambda address, length: calls.append(length)
                        or errno.EINVAL)
    released: list[str] = []
    populator: pages.Populator[str] = pages.Populator(lambda item: (4096, 1 << 30),
                                                      released.append)
    populator.add("first")
    assert _wait_for(lambda: released == ["first"])
    assert calls == [pages.POPULATE_CHUNK_BYTES]  # one chunk tried, none after the refusal
    populator.add("second")
    time.sleep(0.05)
    assert released == ["first"] and len(calls) == 1


@pytest.fixture
def small_tmpfs(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A 64 MiB tmpfs mounted ``huge=advise`` where this process may mount one (root), as the
    directory segments are made in; skipped elsewhere. Unmounted after."""
    import subprocess

    import kvpool_client.segments as segments_module

    mountpoint = str(tmp_path / "shm")
    os.mkdir(mountpoint)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m,huge=advise,mode=700",
                              "kvpool-test", mountpoint], capture_output=True, timeout=30)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    monkeypatch.setattr(segments_module, "SHM_DIR", mountpoint)
    try:
        yield mountpoint
    finally:
        subprocess.run(["umount", mountpoint], capture_output=True, timeout=30)


def test_huge_pages_where_tmpfs_allows_them_and_no_space_when_it_is_full(
        small_tmpfs: str, cluster: str) -> None:
    with LocalSegment.create(cluster, "fits", 0, 32 << 20, huge_pages=True) as seg:
        assert seg.huge_bytes == seg.size_bytes  # huge=advise and MADV_HUGEPAGE: 2 MiB pages
        seg.buffer[-4:] = b"tail"
        assert bytes(seg.buffer[:4096]) == bytes(4096)
    for huge_pages in (True, False):  # populating a full tmpfs fails cleanly, as fallocate does
        with pytest.raises(KVPoolError) as caught:
            LocalSegment.create(cluster, f"too-big-{huge_pages}", 0, 128 << 20,
                                huge_pages=huge_pages)
        assert caught.value.status == Status.NO_SPACE
    assert os.listdir(small_tmpfs) == []
