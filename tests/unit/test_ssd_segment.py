"""SSD segment files: created 0600 and whole, direct I/O where the filesystem takes it (ext4
under the test's temporary directory) and the page cache where it does not (tmpfs), any memory
and any length in and out, clear errors for a full disk, a bad directory, a range outside the
segment and a truncated file, and stale files of gone owners removed."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from kvpool_client.ssd import SsdSegment, cleanup_stale_files
from kvpool_wire.status import KVPoolError, Status
from kvpool_wire.types import Tier

MIB = 1 << 20


def _roundtrip(segment: SsdSegment) -> None:
    data = os.urandom(3 * MIB + 123)                      # not a whole page
    segment.write(8192, memoryview(bytearray(data)))      # unaligned memory: via bounce
    assert bytes(segment.read(8192, len(data))) == data
    parts = [bytearray(1000), bytearray(len(data) - 1000)]
    segment.read_into(8192, len(data), [memoryview(p) for p in parts])
    assert bytes(parts[0]) + bytes(parts[1]) == data


def test_a_segment_on_a_disk_uses_direct_io(tmp_path: Path) -> None:
    segment = SsdSegment.create(str(tmp_path / "ssd"), "c", "client", 0, 16 * MIB)
    try:
        assert segment.direct                                   # ext4 takes O_DIRECT
        info = os.stat(segment.path)
        assert stat.S_IMODE(info.st_mode) == 0o600 and info.st_size >= 16 * MIB
        assert stat.S_IMODE(os.stat(tmp_path / "ssd").st_mode) == 0o700
        _roundtrip(segment)
        described = segment.describe("host", "127.0.0.1:1")
        assert described.tier == Tier.SSD and described.file_path == segment.path
    finally:
        segment.close()
    assert not os.path.exists(segment.path)
    segment.close()                                             # idempotent


def test_a_segment_where_direct_io_is_refused_uses_the_page_cache(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Filesystems without O_DIRECT answer EINVAL to the open (older tmpfs, some FUSE): the
    # one fault this machine's filesystems cannot show, so the open is made to answer it.
    real_open = os.open

    def no_direct(path: str, flags: int, *args: int) -> int:
        if flags & os.O_DIRECT:
            raise OSError(22, "Invalid argument")
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", no_direct)
    segment = SsdSegment.create(str(tmp_path / "ssd"), "c", "client", 0, 8 * MIB)
    try:
        assert not segment.direct
        _roundtrip(segment)
    finally:
        segment.close()


def test_bad_sizes_directories_and_ranges_are_refused(tmp_path: Path) -> None:
    with pytest.raises(KVPoolError) as bad_size:
        SsdSegment.create(str(tmp_path), "c", "client", 0, MIB + 1)
    assert bad_size.value.status == Status.INVALID_ARGUMENT
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    with pytest.raises(KVPoolError) as bad_dir:
        SsdSegment.create(str(not_a_dir), "c", "client", 0, MIB)
    assert bad_dir.value.status == Status.INVALID_ARGUMENT
    segment = SsdSegment.create(str(tmp_path / "ssd"), "c", "client", 0, MIB)
    try:
        for offset, length in ((MIB - 4096, 8192), (-4096, 10), (MIB, 1), (0, 0)):
            with pytest.raises(KVPoolError) as outside:
                segment.read(offset, length)
            assert outside.value.status == Status.INVALID_ARGUMENT
    finally:
        segment.close()


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no tmpfs at /dev/shm")
def test_a_full_disk_fails_at_creation_with_no_space_and_leaves_no_file() -> None:
    directory = f"/dev/shm/kvpool-ssd-full-{os.getpid()}"
    free = os.statvfs("/dev/shm")
    too_big = (free.f_bavail * free.f_frsize + 64 * MIB) & ~4095
    try:
        with pytest.raises(KVPoolError) as full:
            SsdSegment.create(directory, "c", "client", 0, too_big)
        assert full.value.status == Status.NO_SPACE
        assert os.listdir(directory) == []
    finally:
        os.rmdir(directory)


def test_a_truncated_file_reads_as_an_error(tmp_path: Path) -> None:
    segment = SsdSegment.create(str(tmp_path / "ssd"), "c", "client", 0, 4 * MIB)
    try:
        segment.write(0, memoryview(bytearray(b"x" * 8192)))
        os.truncate(segment.path, 4096)
        with pytest.raises(KVPoolError) as short:
            segment.read(0, 8192)
        assert short.value.status == Status.TRANSFER_FAILED
    finally:
        segment.close()


def test_only_files_of_owners_that_are_gone_are_removed(tmp_path: Path) -> None:
    directory = tmp_path / "ssd"
    mine = SsdSegment.create(str(directory), "c", "alive", 0, MIB)
    # a segment of a process that has exited (it never closed it)
    code = ("import sys; from kvpool_client.ssd import SsdSegment; "
            f"SsdSegment.create({str(directory)!r}, 'c', 'dead', 0, 1 << 20); "
            "import os; os._exit(0)")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
    other_cluster = SsdSegment.create(str(directory), "other", "alive", 1, MIB)
    try:
        assert len(os.listdir(directory)) == 3
        removed = cleanup_stale_files(str(directory), "c")
        assert len(removed) == 1 and ".dead." in removed[0]
        assert sorted(os.listdir(directory)) == sorted(
            os.path.basename(s.path) for s in (mine, other_cluster))
    finally:
        mine.close()
        other_cluster.close()


def test_neighbours_sharing_pages_keep_their_bytes(tmp_path: Path) -> None:
    """Extents are 64-byte aligned: objects share pages. Writes from several threads at once,
    every odd size, each read back whole and exact, through every read path."""
    import concurrent.futures
    import random

    segment = SsdSegment.create(str(tmp_path / "ssd"), "c", "client", 0, 4 * MIB)
    try:
        rng = random.Random(5)
        extents: list[tuple[int, bytes]] = []
        offset = 64
        while offset < 3 * MIB:
            size = rng.choice([64, 100, 4000, 4096, 6144, 9000, 70_000])
            extents.append((offset, os.urandom(size)))
            offset += (size + 63) & ~63
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            list(pool.map(lambda e: segment.write(e[0], memoryview(bytearray(e[1]))),
                          extents))
        assert segment.direct
        for offset, data in extents:
            assert bytes(segment.read(offset, len(data))) == data
            out = bytearray(len(data))
            segment.read_into(offset, len(data), [memoryview(out)])
            assert bytes(out) == data
    finally:
        segment.close()
