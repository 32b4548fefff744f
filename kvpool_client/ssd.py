"""Local SSD segments: files under a directory the client owns, read and written with
positioned, aligned, page-cache-bypassing I/O.

Rules of this file:
- A segment is one file ``<dir>/kvpool.<cluster>.<client>.<index>.<pid>.<start>.ssd``, created
  ``O_EXCL`` with mode 0600 in a directory made 0700 when it is created; the whole file is
  allocated up front (``posix_fallocate``: a full disk fails at start with NO_SPACE, never in
  the middle of a copy). Like a DRAM segment, the file ends with one page of header (magic and
  the ownership proof the owner stamps before every mount), and the owner holds a shared
  ``flock`` on it while it lives, so that start-up cleanup removes only the files of owners
  that are gone.
- Bytes are moved with ``os.preadv`` / ``os.pwritev`` on a file descriptor opened ``O_DIRECT``
  where the filesystem allows it (tmpfs does not: then a plain descriptor, and the page cache).
  Direct I/O needs page-aligned memory, offsets and lengths, while the master aligns extents to
  64 bytes: reads cover the enclosing pages, writes patch a page shared with a neighbour under
  a lock (read, overlay, write back), and memory that is not aligned goes through a per-thread
  aligned bounce buffer.
- A restarted client does not trust what a file of an earlier process holds: the master
  dropped those objects when that client expired, and the file is removed. Nothing on SSD is
  served except through the master's placements, and every read of an object with a checksum
  is checked against it.
- A file found shorter than it was allocated (truncated by something else: its holes would
  read back as zeros, even once later writes extend it again) is damaged for good: every read
  and write of it fails (TRANSFER_FAILED) rather than serve those zeros. Each read and write
  checks the size first (one ``fstat``).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import logging
import mmap
import os
import stat
import threading
from collections.abc import Sequence

from kvpool_client.segments import HEADER_BYTES, HEADER_MAGIC, cleanup_stale_segments, shm_name_for
from kvpool_wire.capability import ownership_proof
from kvpool_wire.status import KVPoolError, Status
from kvpool_wire.types import ClientId, SegmentId, SegmentInfo, Tier

log = logging.getLogger(__name__)

SUFFIX = ".ssd"
ALIGN_BYTES = 4096
_PROOF_AT = len(HEADER_MAGIC)


def aligned_up(n: int) -> int:
    """``n`` rounded up to the direct-I/O alignment."""
    return (n + ALIGN_BYTES - 1) & ~(ALIGN_BYTES - 1)


class _Bounce(threading.local):
    """One page-aligned buffer per thread, grown on demand."""

    mapping: mmap.mmap | None = None

    def get(self, num_bytes: int) -> memoryview:
        if self.mapping is None or len(self.mapping) < num_bytes:
            if self.mapping is not None:
                self.mapping.close()
            self.mapping = mmap.mmap(-1, max(aligned_up(num_bytes), 1 << 20))
        return memoryview(self.mapping)[:num_bytes]


_bounce = _Bounce()


def cleanup_stale_files(directory: str, cluster: str) -> list[str]:
    """Remove the SSD segment files of ``cluster`` under ``directory`` whose owner is gone
    (the rules of ``segments.cleanup_stale_segments``); return their names, sorted."""
    return cleanup_stale_segments(cluster, directory, SUFFIX)


def _is_aligned(view: memoryview) -> bool:
    if view.readonly or not view.c_contiguous:
        return False
    try:
        address = ctypes.addressof(ctypes.c_char.from_buffer(view))
    except (TypeError, ValueError):
        return False
    return address % ALIGN_BYTES == 0


def open_direct(path: str, flags: int) -> tuple[int, bool]:
    """(a descriptor of ``path``, whether it bypasses the page cache)."""
    flags |= os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        return os.open(path, flags | os.O_DIRECT), True
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
        return os.open(path, flags), False


def read_range(fd: int, direct: bool, offset: int, length: int,
               regions: Sequence[memoryview]) -> None:
    """Read ``length`` bytes at ``offset`` of the segment file into ``regions`` (which hold
    exactly ``length`` bytes). Direct I/O reads the enclosing whole pages (through the bounce
    buffer unless the range and the one region are page-aligned). Raises OSError, or
    KVPoolError TRANSFER_FAILED on a short read (a truncated file)."""
    if not direct:
        got = os.preadv(fd, list(regions), offset)
        if got != length:
            raise KVPoolError(Status.TRANSFER_FAILED, f"short read at {offset}: {got}")
        return
    start = offset & ~(ALIGN_BYTES - 1)
    end = aligned_up(offset + length)
    if start == offset and end == offset + length and len(regions) == 1 \
            and _is_aligned(regions[0]):
        got = os.preadv(fd, [regions[0]], offset)
        if got != length:
            raise KVPoolError(Status.TRANSFER_FAILED, f"short read at {offset}: {got}")
        return
    bounce = _bounce.get(end - start)
    got = os.preadv(fd, [bounce], start)
    if got < offset + length - start:
        raise KVPoolError(Status.TRANSFER_FAILED, f"short read at {offset}: {got}")
    at = offset - start
    for region in regions:
        region[:] = bounce[at:at + len(region)]
        at += len(region)


class SsdSegment:
    """One SSD segment of this process: a 0600 file, allocated, locked by its owner."""

    def __init__(self, segment_id: str, path: str, size_bytes: int, fd: int, direct: bool,
                 lock_fd: int, client_id: str) -> None:
        self.segment_id = SegmentId(segment_id)
        self.path = path
        self.size_bytes = size_bytes
        self.client_id = ClientId(client_id)
        self.direct = direct
        self._patch_lock = threading.Lock()  # pages shared with a neighbour (see write)
        self._fd = fd
        self._lock_fd = lock_fd
        self._damaged = ""  # why the file cannot be trusted any more ("" while it can)

    @classmethod
    def create(cls, directory: str, cluster: str, client_id: str, index: int,
               size_bytes: int) -> SsdSegment:
        """Create and allocate a new segment file under ``directory`` (made 0700 if absent).

        Raises KVPoolError INVALID_ARGUMENT (size <= 0, or ``directory`` is not a directory
        this user owns), NO_SPACE (the disk cannot hold it) or INTERNAL_ERROR."""
        if size_bytes <= 0 or size_bytes % ALIGN_BYTES:
            raise KVPoolError(Status.INVALID_ARGUMENT,
                              f"SSD segment size must be a positive multiple of {ALIGN_BYTES}, "
                              f"got {size_bytes}")
        try:
            os.makedirs(directory, mode=0o700, exist_ok=True)
            info = os.stat(directory)
        except OSError as exc:
            raise KVPoolError(Status.INVALID_ARGUMENT,
                              f"SSD directory {directory!r}: {exc}") from exc
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
            raise KVPoolError(Status.INVALID_ARGUMENT,
                              f"SSD directory {directory!r} is not a directory this user owns")
        name = shm_name_for(cluster, client_id, index) + SUFFIX
        path = os.path.join(directory, name)
        try:
            lock_fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                              | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise KVPoolError(Status.INTERNAL_ERROR, f"cannot create {path}: {exc}") from exc
        fd = -1
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            os.fchmod(lock_fd, 0o600)
            os.posix_fallocate(lock_fd, 0, size_bytes + HEADER_BYTES)
            fd, direct = open_direct(path, os.O_RDWR)
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.unlink(path)
            os.close(lock_fd)
            if fd >= 0:
                os.close(fd)
            status = Status.NO_SPACE if exc.errno in (errno.ENOSPC, errno.EDQUOT) \
                else Status.INTERNAL_ERROR
            raise KVPoolError(status, f"cannot allocate {size_bytes} bytes in {path}: {exc}") \
                from exc
        if not direct:
            log.info("%s does not take O_DIRECT: SSD segment I/O goes through the page cache",
                     directory)
        return cls(f"{client_id}-ssd{index}", path, size_bytes, fd, direct, lock_fd, client_id)

    @property
    def closed(self) -> bool:
        return self._fd < 0

    def stamp_owner(self, capability_key: bytes) -> None:
        """Write the ownership proof of ``capability_key`` into the header (before mounting)."""
        proof = ownership_proof(capability_key, self.segment_id, self.path, self.size_bytes)
        page = _bounce.get(HEADER_BYTES)
        page[:] = bytes(HEADER_BYTES)
        page[:_PROOF_AT] = HEADER_MAGIC
        page[_PROOF_AT:_PROOF_AT + len(proof)] = proof
        os.pwritev(self._checked_fd(), [page], self.size_bytes)

    def describe(self, host_id: str, tcp_endpoint: str = "") -> SegmentInfo:
        """The SegmentInfo a peer needs to reach this segment (what gets mounted)."""
        return SegmentInfo(segment_id=self.segment_id, client_id=self.client_id,
                           size_bytes=self.size_bytes, tier=Tier.SSD, host_id=host_id,
                           tcp_endpoint=tcp_endpoint, file_path=self.path)

    def _checked_fd(self) -> int:
        fd = self._fd
        if fd < 0:
            raise KVPoolError(Status.SEGMENT_NOT_FOUND, f"segment {self.segment_id} is closed")
        if not self._damaged:
            try:
                size = os.fstat(fd).st_size
            except OSError as exc:
                raise KVPoolError(Status.TRANSFER_FAILED, f"{self.path}: {exc}") from exc
            if size < self.size_bytes + HEADER_BYTES:
                self._damaged = (f"{self.path} was cut to {size} bytes by something else "
                                 f"(allocated {self.size_bytes + HEADER_BYTES}): the objects "
                                 "on it are lost")
                log.error("SSD segment %s: %s", self.segment_id, self._damaged)
        if self._damaged:
            raise KVPoolError(Status.TRANSFER_FAILED, self._damaged)
        return fd

    def _check_range(self, offset: int, length: int) -> None:
        if offset < 0 or length <= 0 or offset + length > self.size_bytes:
            raise KVPoolError(Status.INVALID_ARGUMENT,
                              f"[{offset}, {offset + length}) is not an extent of "
                              f"{self.segment_id} ({self.size_bytes} bytes)")

    def read_into(self, offset: int, length: int, regions: Sequence[memoryview]) -> None:
        """Read an extent into ``regions``. Raises KVPoolError (TRANSFER_FAILED on I/O errors)."""
        self._check_range(offset, length)
        try:
            read_range(self._checked_fd(), self.direct, offset, length, regions)
        except OSError as exc:
            raise KVPoolError(Status.TRANSFER_FAILED,
                              f"reading {self.segment_id} at {offset}: {exc}") from exc

    def read(self, offset: int, length: int) -> memoryview:
        """The bytes of an extent, in a fresh page-aligned buffer the file is read into
        directly (what the data server sends from)."""
        self._check_range(offset, length)
        start = offset & ~(ALIGN_BYTES - 1) if self.direct else offset
        view = memoryview(mmap.mmap(-1, aligned_up(offset + length) - start))
        need = offset + length - start
        try:
            got = os.preadv(self._checked_fd(), [view if self.direct else view[:need]], start)
        except OSError as exc:
            raise KVPoolError(Status.TRANSFER_FAILED,
                              f"reading {self.segment_id} at {offset}: {exc}") from exc
        if got < need:
            raise KVPoolError(Status.TRANSFER_FAILED, f"short read at {offset}: {got}")
        return view[offset - start:need]

    def write(self, offset: int, data: memoryview) -> None:
        """Write ``data`` at ``offset`` (an extent the master handed out for a copy). Raises
        KVPoolError (NO_SPACE when the disk is full, TRANSFER_FAILED on other I/O errors).

        Extents are aligned to 64 bytes, pages to 4 KiB: with direct I/O the whole pages of
        the extent are written from a page-aligned buffer, and a page it shares with a
        neighbour is read, patched and written back under a lock (the neighbour's bytes are
        written back as they were; only this process writes the file)."""
        length = len(data)
        self._check_range(offset, length)
        fd = self._checked_fd()
        try:
            if not self.direct:
                if os.pwritev(fd, [data], offset) != length:
                    raise KVPoolError(Status.TRANSFER_FAILED, f"short write at {offset}")
                return
            end = offset + length
            inner_start, inner_end = aligned_up(offset), end & ~(ALIGN_BYTES - 1)
            if inner_start < inner_end:  # whole pages
                inner = data[inner_start - offset:inner_end - offset]
                if not _is_aligned(inner):
                    bounce = _bounce.get(inner_end - inner_start)
                    bounce[:] = inner
                    inner = bounce
                if os.pwritev(fd, [inner], inner_start) != inner_end - inner_start:
                    raise KVPoolError(Status.TRANSFER_FAILED, f"short write at {offset}")
            mask = ALIGN_BYTES - 1
            shared = {page for page, partial in ((offset & ~mask, offset & mask),
                                                 (end & ~mask, end & mask)) if partial}
            for page in sorted(shared):
                lo, hi = max(offset, page), min(end, page + ALIGN_BYTES)
                with self._patch_lock:
                    buf = _bounce.get(ALIGN_BYTES)
                    if os.preadv(fd, [buf], page) != ALIGN_BYTES:
                        raise KVPoolError(Status.TRANSFER_FAILED, f"short read at {page}")
                    buf[lo - page:hi - page] = data[lo - offset:hi - offset]
                    if os.pwritev(fd, [buf], page) != ALIGN_BYTES:
                        raise KVPoolError(Status.TRANSFER_FAILED, f"short write at {page}")
        except OSError as exc:
            status = Status.NO_SPACE if exc.errno in (errno.ENOSPC, errno.EDQUOT) \
                else Status.TRANSFER_FAILED
            raise KVPoolError(status, f"writing {self.segment_id} at {offset}: {exc}") from exc

    def close(self) -> None:
        """Remove the file and close it (idempotent)."""
        if self._fd < 0:
            return
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        os.close(self._fd)
        os.close(self._lock_fd)  # the lock goes with it
        self._fd = self._lock_fd = -1

    def __repr__(self) -> str:
        return f"SsdSegment({self.segment_id!r}, {self.path!r}, {self.size_bytes})"
